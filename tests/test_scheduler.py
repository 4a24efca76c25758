"""Scheduler without a model: drive schedule()/update() with fake sampled tokens and check
exactly what each step hands out (token budget, chunks, preemption, stopping, block frees)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import BlockPool, KVCacheManager, cdiv
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.messages import ScheduledChunk, SchedulerOutput
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

EOS = 2
FILLER = 100  # a token that never stops anything


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size))


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_model_len: int = 1 << 20,
    first_token: int = 1000,
    **params,
) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + num_prompt_tokens)),
        sampling_params=SamplingParams(**params),
        sampling_seed=hash(request_id) & 0xFFFF,
        eos_token_ids=frozenset({EOS}),
        max_model_len=max_model_len,
    )


def run_step(
    sched: Scheduler, token_fn: Callable[[ScheduledChunk], int] = lambda c: FILLER
) -> tuple[SchedulerOutput, list[Request], list[Request]]:
    out = sched.schedule()
    sampled = [token_fn(c) if c.sample else None for c in out.chunks]
    updated, finished = sched.update(out, sampled)
    return out, updated, finished


def shape(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request_id, len(c.token_ids)) for c in out.chunks]


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert sched.kv_cache.req_to_blocks == {}


def check_invariants(sched: Scheduler) -> None:
    """Block accounting that must hold between steps."""
    pool = sched.kv_cache.pool
    held = [bid for ids in sched.kv_cache.req_to_blocks.values() for bid in (b.block_id for b in ids)]
    assert len(held) == len(set(held))
    assert len(held) + pool.num_free_blocks == pool.num_blocks - 1
    for request in sched.running:
        assert request.status == RequestStatus.RUNNING
        num_blocks = len(sched.kv_cache.get_block_ids(request.request_id))
        assert num_blocks == cdiv(request.num_computed_tokens, sched.kv_cache.block_size)
    for request in sched.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert sched.kv_cache.get_block_ids(request.request_id) == []
    assert len(sched.running) <= sched.config.max_num_seqs


def run_to_completion(sched: Scheduler, token_fn=lambda c: FILLER, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out, _, _ = run_step(sched, token_fn)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert not out.is_empty, "no progress"
        check_invariants(sched)
        outs.append(out)
    raise AssertionError("requests did not finish")


# -- token budget -------------------------------------------------------------------


def test_budget_goes_to_running_first_then_waiting_fcfs():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = make_request("a", 4), make_request("b", 4), make_request("c", 5)
    for r in (a, b, c):
        sched.add_request(r)

    out, updated, finished = run_step(sched, lambda ch: {"a": 11, "b": 12}[ch.request_id])
    assert shape(out) == [("a", 4), ("b", 4), ("c", 2)]
    assert [ch.sample for ch in out.chunks] == [True, True, False]
    assert [ch.start_pos for ch in out.chunks] == [0, 0, 0]
    assert out.chunks[2].token_ids == c.prompt_token_ids[:2]
    assert updated == [a, b] and finished == []
    assert a.output_token_ids == [11] and b.output_token_ids == [12] and c.output_token_ids == []
    assert [r.num_computed_tokens for r in (a, b, c)] == [4, 4, 2]
    assert sched.running == [a, b, c] and not sched.waiting

    d = make_request("d", 3)
    sched.add_request(d)
    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 1), ("b", 1), ("c", 3), ("d", 3)]
    assert out.chunks[0].token_ids == [11] and out.chunks[0].start_pos == 4
    assert out.chunks[1].token_ids == [12] and out.chunks[1].start_pos == 4
    assert out.chunks[2].token_ids == c.prompt_token_ids[2:] and out.chunks[2].start_pos == 2
    assert all(ch.sample for ch in out.chunks)
    assert out.num_batched_tokens == 8

    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    assert [ch.output_index for ch in out.chunks] == [2, 2, 1, 1]


def test_budget_exhausted_by_running_requests_leaves_waiting_alone():
    sched = make_scheduler(max_num_batched_tokens=3)
    reqs = [make_request(f"r{i}", 1) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _, _ = run_step(sched)
    assert shape(out) == [("r0", 1), ("r1", 1), ("r2", 1)]
    out, _, _ = run_step(sched)  # three decodes use the whole budget
    assert shape(out) == [("r0", 1), ("r1", 1), ("r2", 1)]
    assert list(sched.waiting) == [reqs[3]] and reqs[3].status == RequestStatus.WAITING


def test_chunk_carries_block_table_and_sampling_info():
    sched = make_scheduler(block_size=4)
    r = make_request("r", 6, temperature=0.5, seed=7)
    sched.add_request(r)
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.block_ids == [1, 2] == sched.kv_cache.get_block_ids("r")
    assert chunk.sampling_params is r.sampling_params
    assert chunk.sampling_seed == r.sampling_seed
    assert chunk.output_index == 0
    sched.update(out, [FILLER])
    assert r.num_computed_tokens == 6 and r.num_tokens == 7


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (make_request(x, 3, max_tokens=2) for x in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 3), ("b", 3)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, _, finished = run_step(sched)
    assert shape(out) == [("a", 1), ("b", 1)]  # c cannot start while two run
    assert finished == [a, b]
    out, _, _ = run_step(sched)
    assert shape(out) == [("c", 3)]
    run_to_completion(sched)
    assert_all_blocks_free(sched)


# -- chunked prefill ------------------------------------------------------------------


def test_chunked_prefill_spreads_long_prompt_while_decodes_continue():
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b, c = make_request("a", 2), make_request("b", 2), make_request("c", 17)
    for r in (a, b, c):
        sched.add_request(r)
    c_chunks = []
    shapes = []
    for _ in range(5):
        out, _, _ = run_step(sched)
        shapes.append(shape(out))
        c_chunks.append(next(ch for ch in out.chunks if ch.request_id == "c"))
    assert shapes == [
        [("a", 2), ("b", 2), ("c", 2)],
        [("a", 1), ("b", 1), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 3)],
    ]
    assert [ch.start_pos for ch in c_chunks] == [0, 2, 6, 10, 14]
    assert [ch.token_ids for ch in c_chunks] == [
        c.prompt_token_ids[0:2],
        c.prompt_token_ids[2:6],
        c.prompt_token_ids[6:10],
        c.prompt_token_ids[10:14],
        c.prompt_token_ids[14:17],
    ]
    # Only the chunk that reaches the prompt's last token samples.
    assert [ch.sample for ch in c_chunks] == [False, False, False, False, True]
    assert all(ch.output_index == 0 for ch in c_chunks)
    assert c.output_token_ids == [FILLER] and c.num_computed_tokens == 17
    assert a.num_output_tokens == 5 and b.num_output_tokens == 5
    # Block table grows with the chunks.
    assert [len(ch.block_ids) for ch in c_chunks] == [1, 2, 3, 4, 5]
    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 1), ("b", 1), ("c", 1)]


def test_chunked_prefill_budget_of_one_token():
    sched = make_scheduler(max_num_batched_tokens=1)
    r = make_request("r", 3, max_tokens=2)
    sched.add_request(r)
    outs = run_to_completion(sched)
    assert [shape(o) for o in outs] == [[("r", 1)]] * 4
    assert [o.chunks[0].sample for o in outs] == [False, False, True, True]
    assert r.num_output_tokens == 2
    assert_all_blocks_free(sched)


def test_no_chunked_prefill_admits_whole_prompts_only():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b, c = make_request("a", 3), make_request("b", 6), make_request("c", 2)
    for r in (a, b, c):
        sched.add_request(r)
    out, _, _ = run_step(sched)
    # b does not fit the 5 tokens left, and c may not jump the queue.
    assert shape(out) == [("a", 3)]
    assert list(sched.waiting) == [b, c] and b.num_computed_tokens == 0
    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 1), ("b", 6)]
    assert all(ch.sample for ch in out.chunks)
    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 1), ("b", 1), ("c", 2)]


def test_no_chunked_prefill_head_of_line_blocks_on_memory():
    # b needs 3 blocks but only 2 are free: c (1 block) must wait behind it (FCFS).
    sched = make_scheduler(num_blocks=1 + 4, block_size=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
    a = make_request("a", 8, max_tokens=1)
    sched.add_request(a)
    run_step(sched)  # a finishes at once
    assert_all_blocks_free(sched)
    a2 = make_request("a2", 7, max_tokens=3)
    b, c = make_request("b", 9), make_request("c", 2)
    sched.add_request(a2)
    out, _, _ = run_step(sched)
    assert shape(out) == [("a2", 7)]
    sched.add_request(b)
    sched.add_request(c)
    out, _, _ = run_step(sched)
    assert shape(out) == [("a2", 1)]
    assert list(sched.waiting) == [b, c]


# -- preemption --------------------------------------------------------------------------


def test_preemption_victim_is_last_admitted_and_resumes_with_recompute():
    # 4 usable blocks of 4 tokens. Two prompts of 7 tokens take 2 blocks each.
    sched = make_scheduler(num_blocks=1 + 4, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 7, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    counter = iter(range(500, 600))
    token = lambda ch: next(counter)  # noqa: E731

    out, _, _ = run_step(sched, token)  # prefill both: a [1, 2], b [3, 4]
    assert shape(out) == [("a", 7), ("b", 7)]
    assert sched.kv_cache.get_block_ids("a") == [1, 2]
    assert sched.kv_cache.get_block_ids("b") == [3, 4]
    out, _, _ = run_step(sched, token)  # tokens 8 of each fit their second block
    assert shape(out) == [("a", 1), ("b", 1)]
    assert sched.kv_cache.pool.num_free_blocks == 0
    assert a.output_token_ids == [500, 502] and b.output_token_ids == [501, 503]

    # Now a needs a third block: b (admitted last) is preempted.
    out, _, finished = run_step(sched, token)
    assert out.preempted_request_ids == ["b"]
    assert shape(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == []
    assert b.output_token_ids == [501, 503]  # outputs are kept
    # b's blocks were freed (tail first, 4 then 3) and a took 3, the one right after its table.
    assert out.chunks[0].block_ids == [1, 2, 3]
    assert a.is_finished and finished == [a]  # max_tokens=3 reached

    # b resumes: prompt + outputs recomputed in one chunk, then the next token is sampled.
    out, _, _ = run_step(sched, token)
    (chunk,) = out.chunks
    assert chunk.request_id == "b"
    assert chunk.start_pos == 0
    assert chunk.token_ids == b.prompt_token_ids + [501, 503]
    assert chunk.sample and chunk.output_index == 2
    assert b.status == RequestStatus.RUNNING
    assert b.output_token_ids == [501, 503, 505]
    run_to_completion(sched, token)
    assert b.output_token_ids == [501, 503, 505, 506]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(sched)


def test_preemption_of_three_picks_the_newest_and_goes_to_front_of_waiting():
    sched = make_scheduler(num_blocks=1 + 6, block_size=2, max_num_batched_tokens=64)
    reqs = [make_request(x, 4) for x in "abc"]
    for r in reqs:
        sched.add_request(r)
    late = make_request("late", 1)
    run_step(sched)  # 2 blocks each, none free (5 tokens each after sampling)
    sched.add_request(late)
    out, _, _ = run_step(sched)
    # a needs a third block: c (admitted last) is preempted, not b; c's two blocks then serve a and b.
    assert out.preempted_request_ids == ["c"]
    assert shape(out) == [("a", 1), ("b", 1)]
    assert list(sched.waiting) == [reqs[2], late]  # the victim goes before requests that waited
    assert sched.running == reqs[:2]


def test_request_can_preempt_itself():
    # a decodes inside its block; b, admitted last, needs a new block and nobody is left to evict.
    sched = make_scheduler(num_blocks=1 + 3, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", 5)  # 2 blocks, 6 tokens after its first sample
    b = make_request("b", 4)  # 1 block, 5 tokens after its first sample: needs block 2
    sched.add_request(a)
    sched.add_request(b)
    out, _, _ = run_step(sched)
    assert shape(out) == [("a", 5), ("b", 4)]
    assert sched.kv_cache.pool.num_free_blocks == 0
    out, _, _ = run_step(sched)
    assert out.preempted_request_ids == ["b"]
    assert shape(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert sched.kv_cache.get_block_ids("b") == []
    check_invariants(sched)


def test_no_new_admissions_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=1 + 4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 7), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    run_step(sched)
    small = make_request("small", 1)
    sched.add_request(small)
    out, _, _ = run_step(sched)
    assert out.preempted_request_ids == ["b"]
    assert [c.request_id for c in out.chunks] == ["a"]
    assert list(sched.waiting) == [b, small]


def test_preempted_request_recompute_is_chunked_and_samples_once():
    sched = make_scheduler(num_blocks=1 + 4, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 7, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    run_step(sched)
    out, _, finished = run_step(sched)
    assert out.preempted_request_ids == ["b"] and finished == [a]
    sched.config.max_num_batched_tokens = 4  # recompute the 9 tokens in chunks of 4, 4, 1
    outs = [run_step(sched)[0] for _ in range(3)]
    assert [shape(o) for o in outs] == [[("b", 4)], [("b", 4)], [("b", 1)]]
    assert [o.chunks[0].sample for o in outs] == [False, False, True]
    assert [o.chunks[0].start_pos for o in outs] == [0, 4, 8]
    assert outs[2].chunks[0].output_index == 2
    assert b.is_finished and b.num_output_tokens == 3
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_under_memory_pressure_frees_everything(seed, chunked):
    rng = random.Random(seed)
    block_size = 4
    sched = make_scheduler(
        num_blocks=1 + 12, block_size=block_size, max_num_batched_tokens=48, max_num_seqs=6, enable_chunked_prefill=chunked
    )
    expected = {}
    for i in range(12):
        n_prompt, max_tokens = rng.randint(1, 20), rng.randint(1, 20)
        r = make_request(f"r{i}", n_prompt, max_model_len=48, max_tokens=max_tokens, first_token=1000 * (i + 1))
        sched.add_request(r)
        expected[r.request_id] = (r, min(max_tokens, 48 - n_prompt))

    # The token a request samples depends only on its id and output index, so preemption
    # (recompute) must reproduce the same outputs.
    def token(ch):
        return 10_000 + 100 * int(ch.request_id[1:]) + ch.output_index

    run_to_completion(sched, token)
    assert sched.num_preemptions > 0
    for rid, (r, n_out) in expected.items():
        assert r.output_token_ids == [10_000 + 100 * int(rid[1:]) + k for k in range(n_out)]
        assert r.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(sched)


# -- stopping -----------------------------------------------------------------------------


def test_stop_on_eos():
    sched = make_scheduler()
    r = make_request("r", 3)
    sched.add_request(r)
    seq = iter([7, 8, EOS, 9])
    run_to_completion(sched, lambda ch: next(seq))
    assert r.output_token_ids == [7, 8, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.status.finish_reason == "stop" and r.stop_reason is None
    assert_all_blocks_free(sched)
    assert sched.requests == {} and sched.running == []


def test_stop_token_ids():
    sched = make_scheduler()
    r = make_request("r", 3, stop_token_ids=[42, 43])
    sched.add_request(r)
    seq = iter([7, 43, 9])
    run_to_completion(sched, lambda ch: next(seq))
    assert r.output_token_ids == [7, 43]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 43


def test_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=5)
    sched.add_request(r)
    outs = run_to_completion(sched)
    assert len(outs) == 5
    assert r.num_output_tokens == 5
    assert r.status == RequestStatus.FINISHED_LENGTH and r.status.finish_reason == "length"
    assert_all_blocks_free(sched)


def test_max_model_len():
    sched = make_scheduler()
    r = make_request("r", 7, max_model_len=10, max_tokens=None)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.num_output_tokens == 3 and r.num_tokens == 10
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_wins_over_length_on_the_same_token():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=2)
    sched.add_request(r)
    seq = iter([7, EOS])
    run_to_completion(sched, lambda ch: next(seq))
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=6, ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, lambda ch: EOS)
    assert r.output_token_ids == [EOS] * 6
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_ignore_eos_still_honours_stop_token_ids():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=6, ignore_eos=True, stop_token_ids=[5])
    sched.add_request(r)
    seq = iter([EOS, 5, 9])
    run_to_completion(sched, lambda ch: next(seq))
    assert r.output_token_ids == [EOS, 5] and r.stop_reason == 5


def test_min_tokens_defers_eos_and_stop_tokens():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=10, min_tokens=3, stop_token_ids=[5])
    sched.add_request(r)
    seq = iter([EOS, 5, EOS, 9])
    run_to_completion(sched, lambda ch: next(seq))
    assert r.output_token_ids == [EOS, 5, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_banned_token_ids_until_min_tokens():
    """The sampler is told to mask EOS and stop tokens while fewer than min_tokens are out (as vLLM does)."""
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=10, min_tokens=2, stop_token_ids=[5, 6])
    plain = make_request("plain", 3, max_tokens=10, stop_token_ids=[5])
    no_eos = make_request("no_eos", 3, max_tokens=10, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    for x in (r, plain, no_eos):
        sched.add_request(x)
    banned = []
    for _ in range(3):
        out, _, _ = run_step(sched)
        banned.append({c.request_id: set(c.banned_token_ids) for c in out.chunks})
    assert [b["r"] for b in banned] == [{EOS, 5, 6}, {EOS, 5, 6}, set()]
    assert [b["plain"] for b in banned] == [set(), set(), set()]
    assert [b["no_eos"] for b in banned] == [{5}, {5}, set()]


# -- abort and bookkeeping ----------------------------------------------------------------------


def test_abort_running_and_waiting_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 9), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert sched.kv_cache.get_block_ids("a") == [1, 2, 3]
    aborted = sched.abort_request("a")
    assert aborted is a and a.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert sched.running == [] and "a" not in sched.requests
    assert sched.kv_cache.pool.num_free_blocks == sched.kv_cache.pool.num_blocks - 1
    assert sched.abort_request("b") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.waiting and not sched.has_unfinished_requests()
    assert sched.abort_request("b") is None
    assert sched.abort_request("nope") is None
    assert sched.schedule().is_empty
    assert_all_blocks_free(sched)


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=1 + 4, block_size=4)
    a, b = make_request("a", 7), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        run_step(sched)
    assert b.status == RequestStatus.PREEMPTED
    assert sched.abort_request("b") is b
    assert not sched.waiting
    sched.abort_request("a")
    assert_all_blocks_free(sched)


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_request("a")
    updated, finished = sched.update(out, [FILLER, FILLER])
    assert updated == [b] and finished == []
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.running == [b]
    sched.abort_request("b")
    assert_all_blocks_free(sched)


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x", 2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 2))


def test_update_rejects_wrong_number_of_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 2))
    sched.add_request(make_request("b", 2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled token"):
        sched.update(out, [FILLER])


def test_empty_schedule():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert sched.update(out, []) == ([], [])


def test_many_requests_all_blocks_free_at_the_end():
    sched = make_scheduler(num_blocks=1 + 20, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    rng = random.Random(1)
    reqs = [make_request(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 30)) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, lambda ch: EOS if rng.random() < 0.05 else FILLER)
    assert all(r.is_finished for r in reqs)
    assert sched.kv_cache.pool.num_free_blocks == sched.kv_cache.pool.num_blocks - 1
    assert_all_blocks_free(sched)


# -- parallel sampling: fork and copy-on-write ------------------------------------------------


def make_group_request(request_id: str, num_prompt_tokens: int, n: int, **params) -> Request:
    from tokenmill.engine.request import SequenceGroup

    request = make_request(request_id, num_prompt_tokens, n=n, **params)
    request.group = SequenceGroup(request_id, n, sequences=[request])
    return request


def test_parallel_sampling_prefills_once_then_forks_with_copy_on_write():
    from tokenmill.engine.request import sequence_seed

    sched = make_scheduler(block_size=4)
    parent = make_group_request("g", 10, n=3, max_tokens=3, ignore_eos=True)
    sched.add_request(parent)
    # Step 1: the prompt up to its last token, nothing sampled.
    out, updated, _ = run_step(sched)
    assert shape(out) == [("g", 9)] and not out.chunks[0].sample
    assert updated == []
    # Forked: three sequences share blocks 1..3 (block 3 holds one token).
    group = parent.group
    assert group.forked and [s.request_id for s in group.sequences] == ["g", "g#1", "g#2"]
    assert [r.request_id for r in sched.running] == ["g", "g#1", "g#2"]
    kv = sched.kv_cache
    assert all(kv.get_block_ids(s.request_id) == [1, 2, 3] for s in group.sequences)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [3, 3, 3]
    assert all(s.num_computed_tokens == 9 for s in group.sequences)
    # Step 2: each sequence computes the last prompt token and samples its first token with its own seed.
    out = sched.schedule()
    assert shape(out) == [("g", 1), ("g#1", 1), ("g#2", 1)]
    assert all(c.sample and c.output_index == 0 and c.token_ids == [1009] for c in out.chunks)
    seeds = [c.sampling_seed for c in out.chunks]
    assert seeds == [sequence_seed(parent.sampling_seed, i) for i in range(3)]
    assert seeds[0] == parent.sampling_seed and len(set(seeds)) == 3
    # Block 3 is copied on write for the first two; the last holder writes in place.
    assert out.block_copies == [(3, 4), (3, 5)]
    assert [c.block_ids for c in out.chunks] == [[1, 2, 4], [1, 2, 5], [1, 2, 3]]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [3, 3, 1, 1, 1]
    updated, _ = sched.update(out, [7, 8, 9])
    assert [r.output_token_ids for r in group.sequences] == [[7], [8], [9]]
    run_to_completion_shared(sched)
    assert [r.output_token_ids for r in group.sequences] == [[7, FILLER, FILLER], [8, FILLER, FILLER], [9, FILLER, FILLER]]
    assert_all_blocks_free(sched)


def run_to_completion_shared(sched: Scheduler, token_fn=lambda c: FILLER, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """run_to_completion for forked sequences: blocks may be shared, so check ref counts instead of uniqueness."""
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out, _, _ = run_step(sched, token_fn)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert not out.is_empty, "no progress"
        pool = sched.kv_cache.pool
        holders: dict[int, int] = {}
        for blocks in sched.kv_cache.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert all(pool.blocks[i].ref_cnt == count for i, count in holders.items())
        assert len(holders) + pool.num_free_blocks == pool.num_blocks - 1
        for request in sched.running:
            assert len(sched.kv_cache.get_block_ids(request.request_id)) == cdiv(request.num_computed_tokens, sched.kv_cache.block_size)
        outs.append(out)
    raise AssertionError("requests did not finish")


def test_one_token_prompt_forks_at_once():
    sched = make_scheduler(block_size=4)
    parent = make_group_request("g", 1, n=3, max_tokens=2, ignore_eos=True)
    sched.add_request(parent)
    assert [r.request_id for r in sched.waiting] == ["g", "g#1", "g#2"]
    out = sched.schedule()
    assert shape(out) == [("g", 1), ("g#1", 1), ("g#2", 1)]
    assert all(c.sample for c in out.chunks) and out.block_copies == []
    sched.update(out, [1, 2, 3])
    run_to_completion_shared(sched)
    assert [r.output_token_ids for r in parent.group.sequences] == [[1, FILLER], [2, FILLER], [3, FILLER]]
    assert_all_blocks_free(sched)


def test_chunked_prefill_of_a_group_forks_after_the_last_chunk():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    parent = make_group_request("g", 10, n=2, max_tokens=2, ignore_eos=True)
    sched.add_request(parent)
    assert [shape(run_step(sched)[0]) for _ in range(3)] == [[("g", 4)], [("g", 4)], [("g", 1)]]
    assert parent.group.forked and len(sched.running) == 2
    run_to_completion_shared(sched)
    assert_all_blocks_free(sched)


def test_forked_sequences_under_memory_pressure_are_preempted_and_free_everything():
    rng = random.Random(5)
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=16)
    groups = []
    for i in range(4):
        request = make_group_request(f"g{i}", rng.randint(3, 14), n=rng.randint(2, 4), max_tokens=rng.randint(3, 12), ignore_eos=True)
        sched.add_request(request)
        groups.append(request.group)
    run_to_completion_shared(sched, token_fn=lambda c: FILLER)
    assert sched.num_preemptions > 0
    for group in groups:
        assert len(group.sequences) == group.size
        assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in group.sequences)
    assert_all_blocks_free(sched)


def test_running_request_with_nothing_to_compute_is_skipped():
    """A beam waiting for its siblings has every token in the cache: it gets no chunk."""
    sched = make_scheduler(block_size=4)
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    a.output_token_ids.pop()
    a.all_token_ids.pop()
    out, _, _ = run_step(sched)
    assert shape(out) == [("b", 1)]


def test_idle_running_requests_make_room_for_a_waiting_one():
    """Beams waiting for a preempted sibling hold the memory it needs: one of them is preempted to the
    back of the queue (its candidates live on in its group), so the sibling can run."""
    sched = make_scheduler(num_blocks=6, block_size=4)  # 5 usable blocks
    a = make_request("a", 12)
    sched.add_request(a)
    run_step(sched)  # a: 12 prompt tokens in blocks 1..3, one token out
    a.output_token_ids.pop()
    a.all_token_ids.pop()  # idle: nothing to compute
    b = make_request("b", 12)
    sched.add_request(b)  # needs 3 blocks, 2 are free
    out = sched.schedule()
    assert shape(out) == [("b", 12)]
    assert out.preempted_request_ids == ["a"]
    assert [r.request_id for r in sched.waiting] == ["a"] and a.num_computed_tokens == 0
    assert sched.kv_cache.get_block_ids("a") == []
