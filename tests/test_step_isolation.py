"""A request whose work fails inside an engine step fails alone.

The engine re-runs the failed step's batch in halves to find the requests that fail on their own,
aborts them (RequestFailedError names them), and recomputes every other request of the step, whose
outputs stay exactly what they would have been; blocks the failed step registered in the prefix
cache leave it, and no block leaks.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.errors import RequestFailedError

ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=128, block_size=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama_gqa")


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model=model, **ENGINE_ARGS)


def poisoned(max_tokens: int = 8) -> SamplingParams:
    """Params that pass validation, then break the step: a top_k no int64 tensor can hold (as a
    bug or a missed check would), so SamplingMetadata.from_chunks raises inside the step."""
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=max_tokens, ignore_eos=True, seed=1)
    params.top_k = 1 << 64
    return params


def run_all(engine, jobs: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict[str, list[int]], list[list[str]]]:
    for request_id, (prompt, params) in jobs.items():
        engine.add_request({"prompt_token_ids": prompt}, params, request_id)
    outputs: dict[str, list[int]] = {}
    failures: list[list[str]] = []
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        except RequestFailedError as exc:
            failures.append(exc.request_ids)
    return outputs, failures


def test_a_poisoned_request_fails_alone_and_the_others_are_unchanged(llm):
    engine = llm.llm_engine
    prompts = random_prompts([40, 7, 23, 15, 33], seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=3)
    clean = {f"r{i}": (p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)}
    expected, failures = run_all(engine, clean)
    assert not failures

    # The poisoned request sits in the middle of the batch, in its first (prompt) step and later ones.
    jobs = dict(clean)
    jobs = {**{k: jobs[k] for k in ("r0", "r1")}, "bad": (prompts[2], poisoned()), **{k: jobs[k] for k in ("r2", "r3", "r4")}}
    got, failures = run_all(engine, jobs)
    assert failures == [["bad"]]
    assert got == expected
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # every block back (block 0 is the null block)
    assert not engine.scheduler.kv_cache.req_to_blocks


def test_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(llm):
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache
    prompt = random_prompts([64], seed=9)[0]
    # Alone, the poisoned request fails in its first step, which registered its 4 full blocks.
    _, failures = run_all(engine, {"bad": (prompt, poisoned())})
    assert failures == [["bad"]]
    assert kv.get_computed_blocks(engine.make_request({"prompt_token_ids": prompt})) in (None, [])
    # The same prompt afterwards computes its own KV and gives the output it gives on a fresh engine.
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got, failures = run_all(engine, {"again": (prompt, greedy)})
    fresh = LLM(model=llm.llm_engine.config.model.model, **ENGINE_ARGS)
    want = fresh.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert not failures and got["again"] == list(want)


def test_a_failure_of_the_whole_batch_fails_every_request_of_the_step_and_the_engine_goes_on(llm):
    engine = llm.llm_engine
    runner = engine.executor.driver_runner
    real = runner.execute
    broken = {"on": True}

    def execute(*args, **kwargs):
        if broken["on"]:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    runner.execute = execute
    try:
        prompts = random_prompts([5, 9, 12], seed=2)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        _, failures = run_all(engine, {f"x{i}": (p, params) for i, p in enumerate(prompts)})
        assert failures == [["x0", "x1", "x2"]]
        broken["on"] = False
        got, failures = run_all(engine, {"after": (prompts[0], params)})
        assert not failures and len(got["after"]) == 4
    finally:
        runner.execute = real


def test_async_engine_streams_of_the_batch_mates_complete(model, llm):
    prompts = random_prompts([12, 30, 8, 20], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    async def main():
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(model=model, **ENGINE_ARGS))
        await engine.start()

        async def final(prompt, sp, request_id):
            last = None
            async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id):
                last = out
            return list(last.outputs[0].token_ids)

        try:
            jobs = [final(p, params, f"ok{i}") for i, p in enumerate(prompts)]
            jobs.insert(2, final(prompts[0], poisoned(), "bad"))
            results = await asyncio.gather(*jobs, return_exceptions=True)
            assert isinstance(results[2], RequestFailedError) and results[2].request_ids == ["bad"]
            assert results[:2] + results[3:] == [list(e) for e in expected]
            assert engine.stats().kv_cache_usage == 0.0
        finally:
            await engine.shutdown()

    asyncio.run(main())
