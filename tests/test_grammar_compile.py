"""Grammar compiles are bounded: in a child process, at low CPU priority, killed past their time
limit (the request gets an error naming the limit, and a resent slow constraint is refused at
once), deduplicated between concurrent requests, cached in an LRU bounded in bytes, and never
run on the engine loop."""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.structured_output import StructuredOutputManager  # noqa: E402
from tokenmill.errors import InvalidRequestError  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams as SO  # noqa: E402

SLOW_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5000}}}
SMALL_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20, grammar_compile_timeout=1.0)


@pytest.fixture(scope="module")
def manager(llm) -> StructuredOutputManager:
    manager = llm.llm_engine.structured_output_manager()
    manager.compile(SO(regex="[a-z]"))  # the compiler process is started (a second or so), not timed
    return manager


def test_a_slow_grammar_fails_at_its_limit_and_is_then_refused_at_once(manager):
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"more than the limit of 1 s of CPU time.*grammar_compile_timeout"):
        manager.compile(SO(json=SLOW_SCHEMA))
    assert time.monotonic() - start < 10.0  # 1 s of CPU time: more wall time on a busy machine
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="grammar_compile_timeout"):
        manager.compile(SO(json=SLOW_SCHEMA))
    assert time.monotonic() - start < 0.2
    # The killed compiler is started again for the next constraint (a generous limit from here on:
    # even a small schema takes most of a second to compile on a busy 2-core machine).
    manager.compile_timeout = 60.0
    starts = manager.worker.num_starts
    assert manager.compile(SO(json=SMALL_SCHEMA)) is not None
    assert manager.worker.num_starts == starts + 1


def test_the_compiler_runs_niced_in_its_own_process(manager):
    manager.compile(SO(regex=r"[a-z]{3}"))
    proc = manager.worker._proc
    assert proc is not None and proc.pid != os.getpid() and proc.poll() is None
    assert os.getpriority(os.PRIO_PROCESS, proc.pid) > os.getpriority(os.PRIO_PROCESS, os.getpid())


def test_invalid_constraints_are_clear_errors(manager):
    with pytest.raises(InvalidRequestError, match=r"invalid structured_outputs\.regex"):
        manager.compile(SO(regex="[unclosed"))
    with pytest.raises(InvalidRequestError, match=r"invalid structured_outputs\.grammar"):
        manager.compile(SO(grammar="root ::= undefined_rule"))


def test_concurrent_requests_for_one_constraint_compile_it_once(manager):
    params = SO(regex=r"[0-9]{2}-[a-z]{5}")
    before = manager.num_compiles
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(manager.compile(params))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert manager.num_compiles == before + 1


def test_the_cache_is_bounded_in_bytes(llm):
    engine = llm.llm_engine
    manager = StructuredOutputManager(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids), cache_bytes=250_000)
    try:
        for i in range(4):
            manager.compile(SO(regex=f"[a-z]{{{i + 1}}}"))
        assert manager._cached_bytes <= 250_000 and 1 <= len(manager._cache) < 4
        assert manager.num_compiles == 4
    finally:
        manager.close()


def test_the_engine_loop_never_compiles(llm, manager):
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=SO(json=SMALL_SCHEMA))
    request = llm.llm_engine.make_request("Give me a number as JSON:", params)
    assert request.compiled_grammar is not None
    manager._cache.clear()  # evicted meanwhile: the step still uses the request's own grammar
    calls = manager.num_compiles
    out = llm.generate(["Give me a number as JSON:"], params, use_tqdm=False)[0].outputs[0].text
    assert out.startswith("{") and manager.num_compiles == calls + 1  # one compile, at make_request
