"""Automatic prefix caching: exact block reuse, LRU eviction, the hash chain and its collision check,
counters, preemption, forks; then end to end on a tiny model: the same tokens with and without caching.

The model-free part drives KVCacheManager / Scheduler directly, like test_kv_cache.py and
test_scheduler.py. FakeKV stands in for the model: each step it writes, for every scheduled
token, the whole token prefix the real KV at that slot would depend on, then checks that every
position a chunk attends to holds its own request's prefix. So a cached block handed to the
wrong request, or written while others read it, fails even without a model.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine import kv_cache as kv_module
from tokenmill.engine.kv_cache import BlockKey, BlockPool, KVCacheManager, cdiv, hash_block_tokens
from tokenmill.engine.request import Request, RequestStatus, SequenceGroup
from tokenmill.engine.messages import ScheduledChunk, SchedulerOutput
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 16


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def make_request(request_id: str, token_ids: list[int], **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(**params),
        sampling_seed=hash(request_id) & 0xFFFF,
    )


def make_manager(num_blocks: int = 64, block_size: int = BS, enabled: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching=enabled)


def admit(manager: KVCacheManager, request: Request) -> bool:
    """What the scheduler does for a waiting request: look up, allocate the rest of the prompt, run it."""
    cached = manager.get_computed_blocks(request)
    num_cached = len(cached) * manager.block_size if cached else 0
    num_new = request.num_tokens - num_cached
    if not manager.allocate_slots(request, num_new, cached):
        return False
    request.num_computed_tokens = num_cached + num_new
    return True


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool._free)


def cached_ids(pool: BlockPool) -> set[int]:
    return {b.block_id for b in pool._cached.values()}


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64, max_num_seqs: int = 16, enabled: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching=enabled))


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start_pos, len(c.token_ids)) for c in out.chunks]


# -- exact reuse ----------------------------------------------------------------------------------


def test_second_request_reuses_the_full_blocks_of_a_shared_prefix():
    manager = make_manager()
    pool = manager.pool
    prefix = tokens(48)
    a = make_request("a", prefix + [1, 2])  # 3 full blocks and a partial one
    assert admit(manager, a)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    assert cached_ids(pool) == {1, 2, 3}  # the partial block is not cached
    assert pool.blocks[4].block_hash is None

    b = make_request("b", prefix + [7, 8, 9, 10, 11])
    hits = manager.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2, 3]
    assert manager.allocate_slots(b, b.num_tokens - 48, hits)
    b.num_computed_tokens = 48
    assert manager.get_block_ids("b") == [1, 2, 3, 5]  # own block for the differing tail
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert a.block_hashes[:3] == b.block_hashes[:3]

    manager.free(a)
    manager.free(b)
    assert all(blk.ref_cnt == 0 for blk in pool.blocks[1:])
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_scheduler_starts_a_hit_after_its_cached_prefix():
    sched = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    prefix = tokens(48)
    a = make_request("a", prefix + [1, 2], max_tokens=1)
    sched.add_request(a)
    out = sched.schedule()
    assert shape(out) == [("a", 0, 50)]
    sched.update(out, [5])
    assert a.is_finished  # its blocks are free now, and still cached

    b = make_request("b", prefix + [7, 8, 9])
    sched.add_request(b)
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start_pos, chunk.token_ids) == (48, [7, 8, 9])
    assert chunk.block_ids[:3] == [1, 2, 3] and chunk.sample
    assert b.num_computed_tokens == 48
    sched.update(out, [5])
    assert b.num_computed_tokens == 51 and b.output_token_ids == [5]


def test_requests_admitted_in_the_same_step_share_blocks():
    """Blocks are cached when allocated for the tokens that fill them, so a request admitted later in
    the same step already hits them (the forward pass writes them before attention reads them)."""
    sched = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    prefix = tokens(48)
    a, b = make_request("a", prefix + [1]), make_request("b", prefix + [2, 3])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert shape(out) == [("a", 0, 49), ("b", 48, 2)]
    assert out.chunks[1].block_ids == [1, 2, 3, 5]
    kv = sched.kv_cache
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (49 + 50, 48)


def test_whole_prompt_cached_still_computes_the_last_block():
    manager = make_manager()
    prompt = tokens(48)
    a = make_request("a", prompt)
    assert admit(manager, a)
    assert cached_ids(manager.pool) == {1, 2, 3}
    b = make_request("b", prompt)
    hits = manager.get_computed_blocks(b)
    # Capped at num_tokens - 1 rounded down to a block: the last token's logits are needed, and
    # the block it lands in must be the request's own, not a shared cached one.
    assert [h.block_id for h in hits] == [1, 2]
    assert manager.allocate_slots(b, 16, hits)
    assert manager.get_block_ids("b") == [1, 2, 4]
    # One more token than the cached blocks: all three are hit and one token is computed.
    c = make_request("c", prompt + [5])
    hits = manager.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [1, 2, 3]
    assert manager.allocate_slots(c, 1, hits)
    assert manager.get_block_ids("c") == [1, 2, 3, 5]


def test_scheduler_whole_prompt_cached_samples_from_the_last_token():
    sched = make_scheduler(block_size=4)
    prompt = tokens(8)
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    sched.update(sched.schedule(), [9])
    b = make_request("b", prompt, max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert shape(out) == [("b", 4, 4)] and out.chunks[0].sample
    assert out.chunks[0].block_ids[0] == 1


def test_one_token_and_one_block_prompts_never_hit():
    manager = make_manager(block_size=4)
    a = make_request("a", tokens(4))
    assert admit(manager, a)
    assert manager.get_computed_blocks(make_request("b", tokens(4))) == []  # capped at 3 tokens: no full block
    assert manager.get_computed_blocks(make_request("c", tokens(1))) == []


# -- eviction ----------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_freed_block_first_and_forgets_its_hash():
    manager = make_manager(num_blocks=1 + 6, block_size=4)
    pool = manager.pool
    a = make_request("a", tokens(8, start=100) + [1])  # blocks 1, 2 full; 3 partial
    b = make_request("b", tokens(8, start=200) + [1])  # blocks 4, 5 full; 6 partial
    assert admit(manager, a) and admit(manager, b)
    assert cached_ids(pool) == {1, 2, 4, 5}
    manager.free(a)
    manager.free(b)
    # Tail first, so a request's first blocks are evicted last; a (freed first) goes before b.
    assert free_ids(pool) == [3, 2, 1, 6, 5, 4]
    hash_a1 = a.block_hashes[1]

    c = make_request("c", tokens(9, start=300))  # 3 new blocks, nothing cached: evicts 3, 2, 1
    assert admit(manager, c)
    assert manager.get_block_ids("c") == [3, 2, 1]
    assert cached_ids(pool) == {4, 5, 3, 2}  # c's own full blocks (3, 2) are cached now; a's are gone
    assert pool.get_cached_block(hash_a1, manager._block_key(a, 1)) is None
    assert all(blk.block_key.token_ids[0] not in (100, 104) for blk in pool._cached.values())
    again = make_request("a2", tokens(8, start=100) + [1])
    assert manager.get_computed_blocks(again) == []

    # b's blocks are still cached: a hit takes them out of the free list (ref 0 -> 1).
    b2 = make_request("b2", tokens(8, start=200) + [2])
    hits = manager.get_computed_blocks(b2)
    assert [h.block_id for h in hits] == [4, 5]
    assert free_ids(pool) == [6, 5, 4]
    assert manager.allocate_slots(b2, 1, hits)
    assert manager.get_block_ids("b2") == [4, 5, 6]
    assert free_ids(pool) == []
    assert [pool.blocks[i].ref_cnt for i in (4, 5, 6)] == [1, 1, 1]


def test_cached_free_blocks_count_against_free_space():
    manager = make_manager(num_blocks=1 + 4, block_size=4)
    pool = manager.pool
    a = make_request("a", tokens(12))  # 3 blocks, all full
    assert admit(manager, a)
    manager.free(a)
    assert free_ids(pool) == [4, 3, 2, 1]
    # b hits blocks 1, 2 (both free) and needs 3 more: 5 blocks, 4 usable. Nothing changes.
    b = make_request("b", tokens(8) + [0] * 9)
    hits = manager.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2]
    assert not manager.allocate_slots(b, 9, hits)
    assert free_ids(pool) == [4, 3, 2, 1]
    assert all(blk.ref_cnt == 0 for blk in pool.blocks[1:])
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (12, 0)  # a failed admission is not counted
    # Two more fit exactly.
    assert manager.allocate_slots(b, 8, hits)
    assert manager.get_block_ids("b") == [1, 2, 4, 3]
    assert pool.num_free_blocks == 0


def test_an_in_use_hit_only_adds_a_reference():
    manager = make_manager(num_blocks=1 + 3, block_size=4)
    a = make_request("a", tokens(9))  # blocks 1, 2, 3: all blocks in use
    assert admit(manager, a)
    b = make_request("b", tokens(8) + [5])
    hits = manager.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2]
    assert not manager.allocate_slots(b, 1, hits)  # the tail block does not fit
    assert manager.allocate_slots(b, 0, hits)  # the hit alone needs no free block
    assert [manager.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]


# -- the hash chain and the key check ------------------------------------------------------------------


def test_same_tokens_after_a_different_parent_or_at_another_position_do_not_hit():
    manager = make_manager(block_size=4)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_request("a", x + y + [0])
    assert admit(manager, a)
    assert manager.get_computed_blocks(make_request("b", z + y + [0])) == []
    assert manager.get_computed_blocks(make_request("c", y + x + [0])) == []  # y first: another parent
    hits = manager.get_computed_blocks(make_request("d", x + z + [0]))
    assert [h.block_id for h in hits] == [1]
    assert hash_block_tokens(None, y) != a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], y)
    assert hash_block_tokens(None, x) == a.block_hashes[0] == hash_block_tokens(None, tuple(x))
    assert hash_block_tokens(None, x, ("lora", 1)) != hash_block_tokens(None, x)  # extra keys are hashed


def test_block_hash_is_stable_across_processes():
    """sha256 over a fixed byte encoding: the same value in every process (no PYTHONHASHSEED dependence)."""
    first = hash_block_tokens(None, [1, 2, 3])
    assert f"{first:064x}" == "66907cda9ac1626793310313709e011ecb6e18b63f01cfce51be971c1628d51b"
    assert f"{hash_block_tokens(first, [4, 5, 6]):064x}" == "e63eedd381ebeb9bfcf977b61c62207af91f71e043857cdfde711de894698476"


def test_forged_hash_collision_is_rejected_by_the_stored_key(monkeypatch):
    monkeypatch.setattr(kv_module, "hash_block_tokens", lambda parent, token_ids, extra_keys=(): 42)
    manager = make_manager(block_size=4)
    pool = manager.pool
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert admit(manager, a)
    # Both full blocks hash to 42: the first is cached, the second collides and stays uncached.
    assert a.block_hashes == [42, 42]
    assert cached_ids(pool) == {1}
    # Other tokens with the same hash: the stored key does not match, so no hit.
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert manager.get_computed_blocks(b) == []
    assert admit(manager, b)
    assert manager.get_block_ids("b") == [4, 5, 6]
    # The second block's tokens after a colliding parent hash: not a hit either.
    assert pool.get_cached_block(42, BlockKey(42, (5, 6, 7, 8))) is None
    # The true owner still hits.
    hits = manager.get_computed_blocks(make_request("c", [1, 2, 3, 4, 0]))
    assert [h.block_id for h in hits] == [1]


def test_duplicate_block_stays_uncached_and_is_evicted_like_a_plain_block():
    manager = make_manager(num_blocks=1 + 6, block_size=4)
    pool = manager.pool
    # Admitted one after the other without a lookup (prompt logprobs): the same blocks computed twice.
    a = make_request("a", tokens(8) + [1], prompt_logprobs=1)
    b = make_request("b", tokens(8) + [2], prompt_logprobs=1)
    assert admit(manager, a) and admit(manager, b)
    assert manager.get_block_ids("b") == [4, 5, 6]
    assert cached_ids(pool) == {1, 2}  # a's came first
    assert pool.blocks[4].block_hash is None and pool.blocks[5].block_hash is None
    manager.free(a)
    manager.free(b)
    hits = manager.get_computed_blocks(make_request("c", tokens(8) + [3]))
    assert [h.block_id for h in hits] == [1, 2]


# -- counters, prompt logprobs, disabled ------------------------------------------------------------------


def test_counters_count_tokens_looked_up_and_found():
    manager = make_manager()
    prefix = tokens(48)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    assert admit(manager, make_request("a", prefix + [1, 2]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (50, 0)
    assert admit(manager, make_request("b", prefix + [3, 4, 5]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (101, 48)
    assert admit(manager, make_request("c", tokens(20, start=5)))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (121, 48)


def test_prompt_logprobs_request_reads_nothing_but_caches_its_blocks():
    manager = make_manager()
    prompt = tokens(40)
    assert admit(manager, make_request("a", prompt))
    p = make_request("p", prompt, prompt_logprobs=2)
    assert manager.get_computed_blocks(p) is None
    assert admit(manager, p)
    assert manager.get_block_ids("p") == [4, 5, 6]  # computed in full, in its own blocks
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (40, 0)  # not a lookup
    q = make_request("q", tokens(48, start=7000), prompt_logprobs=0)
    assert admit(manager, q)
    hits = manager.get_computed_blocks(make_request("r", tokens(48, start=7000) + [1]))
    assert [h.block_id for h in hits] == manager.get_block_ids("q")


def test_disabled_caches_nothing_and_counts_nothing():
    manager = make_manager(enabled=False)
    prompt = tokens(48)
    a, b = make_request("a", prompt + [1]), make_request("b", prompt + [1])
    assert manager.get_computed_blocks(a) is None
    assert admit(manager, a) and admit(manager, b)
    assert manager.get_block_ids("b") == [5, 6, 7, 8]
    assert manager.pool.num_cached_blocks == 0
    assert all(blk.block_hash is None for blk in manager.pool.blocks)
    assert a.block_hashes == [] and b.block_hashes == []
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


# -- a fake model: every slot holds the prefix its KV would depend on ----------------------------------


class FakeKV:
    """Stands in for the KV cache tensors: slot -> the tokens [0..position] its K/V was computed from."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def run(self, sched: Scheduler, out: SchedulerOutput) -> None:
        """One forward pass: copy-on-write first, then every layer writes the whole batch's K/V before any attention reads."""
        for src, dst in out.block_copies:
            for offset in range(self.block_size):
                slot = src * self.block_size + offset
                if slot in self.slots:
                    self.slots[dst * self.block_size + offset] = self.slots[slot]
        for chunk in out.chunks:
            history = chunk.prompt_token_ids + chunk.output_token_ids
            for i in range(len(chunk.token_ids)):
                pos = chunk.start_pos + i
                self.slots[self._slot(chunk, pos)] = tuple(history[: pos + 1])
        for chunk in out.chunks:
            history = chunk.prompt_token_ids + chunk.output_token_ids
            for pos in range(chunk.start_pos + len(chunk.token_ids)):
                got = self.slots.get(self._slot(chunk, pos))
                assert got == tuple(history[: pos + 1]), f"{chunk.request_id} reads wrong KV at position {pos}"

    def _slot(self, chunk: ScheduledChunk, pos: int) -> int:
        return chunk.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


def step_checked(sched: Scheduler, fake: FakeKV, token_fn: Callable[[ScheduledChunk], int]) -> SchedulerOutput:
    """One engine step through FakeKV, checking that no chunk writes a block that was cached before the step."""
    pool = sched.kv_cache.pool
    cached_before = cached_ids(pool)
    # Blocks handed out fresh this step (a cached free block evicted for reuse may be written).
    fresh: list[int] = []
    get_new_blocks = pool.get_new_blocks

    def spy(n: int, after: int | None = None):
        blocks = get_new_blocks(n, after)
        fresh.extend(b.block_id for b in blocks)
        return blocks

    pool.get_new_blocks = spy
    try:
        out = sched.schedule()
    finally:
        del pool.get_new_blocks
    still_cached = cached_before - set(fresh)
    bs = sched.kv_cache.block_size
    written_by_others: set[int] = set()
    for chunk in out.chunks:
        written = {chunk.block_ids[p // bs] for p in range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))}
        assert not written & still_cached, f"{chunk.request_id} writes into a cached block"
        # A block filled this step may already be shared with a request admitted after it in the
        # same step (it only reads it), but two chunks never write the same block.
        assert not written & written_by_others, f"{chunk.request_id} writes a block another chunk writes"
        written_by_others |= written
    assert not {dst for _, dst in out.block_copies} & still_cached
    fake.run(sched, out)
    sched.update(out, [token_fn(c) if c.sample else None for c in out.chunks])
    return out


def check_accounting(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    holders: dict[int, int] = {}
    for blocks in sched.kv_cache.req_to_blocks.values():
        for blk in blocks:
            holders[blk.block_id] = holders.get(blk.block_id, 0) + 1
    assert all(pool.blocks[i].ref_cnt == n for i, n in holders.items())
    assert len(holders) + pool.num_free_blocks == pool.num_blocks - 1
    assert set(holders).isdisjoint(free_ids(pool))
    for h, blk in pool._cached.items():
        assert blk.block_hash == h and blk.block_key is not None
    for request in sched.running:
        assert len(sched.kv_cache.get_block_ids(request.request_id)) == cdiv(request.num_computed_tokens, sched.kv_cache.block_size)


def run_checked(sched: Scheduler, token_fn, fake: FakeKV | None = None, max_steps: int = 10_000) -> FakeKV:
    fake = fake or FakeKV(sched.kv_cache.block_size)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return fake
        out = step_checked(sched, fake, token_fn)
        assert not out.is_empty, "no progress"
        check_accounting(sched)
    raise AssertionError("requests did not finish")


def expected_token(request_id: str, output_index: int, sampling_seed: int) -> int:
    return (hash(request_id.split("#")[0]) + 7919 * output_index + 31 * sampling_seed) % 50_000


def token_of(chunk: ScheduledChunk) -> int:
    """A sampled token that depends only on the request and the output index, as a seeded sampler's does."""
    return expected_token(chunk.request_id, chunk.output_index, chunk.sampling_seed)


# -- preemption and forks ---------------------------------------------------------------------------------


def test_preempted_request_is_readmitted_on_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=1 + 6, block_size=4)
    a = make_request("a", tokens(10, start=100), max_tokens=3, ignore_eos=True)
    b = make_request("b", tokens(11, start=200), max_tokens=8, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    fake = FakeKV(4)
    out = step_checked(sched, fake, token_of)
    assert shape(out) == [("a", 0, 10), ("b", 0, 11)]
    assert sched.kv_cache.get_block_ids("a") == [1, 2, 3] and sched.kv_cache.get_block_ids("b") == [4, 5, 6]
    step_checked(sched, fake, token_of)  # b's 12th token fills block 6, which is cached
    out = step_checked(sched, fake, token_of)  # b needs a 4th block: preempted; a finishes
    assert out.preempted_request_ids == ["b"] and a.is_finished
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert free_ids(sched.kv_cache.pool) == [6, 5, 4, 3, 2, 1]
    assert {4, 5, 6} <= cached_ids(sched.kv_cache.pool)  # freed, still cached

    hits_before = sched.kv_cache.prefix_cache_hits
    out = step_checked(sched, fake, token_of)
    (chunk,) = out.chunks
    assert chunk.request_id == "b"
    # Its own three blocks again (13 tokens: 11 prompt + 2 out), only the last token computed.
    assert chunk.block_ids == [4, 5, 6, 3] and chunk.start_pos == 12
    assert chunk.token_ids == [b.all_token_ids[12]] and chunk.sample and chunk.output_index == 2
    assert sched.kv_cache.prefix_cache_hits - hits_before == 12
    run_checked(sched, token_of, fake)
    assert b.output_token_ids == [expected_token("b", k, b.sampling_seed) for k in range(8)]


def make_group(request_id: str, token_ids: list[int], n: int, **params) -> Request:
    request = make_request(request_id, token_ids, n=n, **params)
    request.group = SequenceGroup(request_id, n, sequences=[request])
    return request


def test_group_with_a_cached_prompt_forks_on_the_hit_and_copies_only_partial_blocks():
    sched = make_scheduler(block_size=4)
    prompt = tokens(10)
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    fake = FakeKV(4)
    step_checked(sched, fake, token_of)
    assert cached_ids(sched.kv_cache.pool) == {1, 2}

    g = make_group("g", prompt, n=3, max_tokens=3, ignore_eos=True, temperature=1.0)
    sched.add_request(g)
    out = step_checked(sched, fake, token_of)
    # The hit is blocks 1, 2; the parent computes tokens 8 (the last one is held back for the fork).
    assert shape(out) == [("g", 8, 1)] and not out.chunks[0].sample
    assert g.group.forked
    out = step_checked(sched, fake, token_of)
    assert shape(out) == [("g", 9, 1), ("g#1", 9, 1), ("g#2", 9, 1)]
    assert [src for src, _ in out.block_copies] == [3, 3]  # the partial block (after the hit's 1, 2), never a cached one
    run_checked(sched, token_of, fake)
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and sched.kv_cache.req_to_blocks == {}


def test_group_whose_prompt_ends_on_a_block_boundary_plus_one():
    """A cached prompt of 2 blocks + 1 token: the parent must still compute a token before it forks."""
    sched = make_scheduler(block_size=4)
    prompt = tokens(9)
    sched.add_request(make_request("a", prompt, max_tokens=1))
    fake = FakeKV(4)
    step_checked(sched, fake, token_of)
    g = make_group("g", prompt, n=2, max_tokens=2, ignore_eos=True, temperature=1.0)
    sched.add_request(g)
    out = step_checked(sched, fake, token_of)
    assert shape(out) == [("g", 4, 4)]  # holds the last prompt token back: the hit stops at block 1
    run_checked(sched, token_of, fake)


# -- random workloads: shared prefixes, forks, preemption, checked against the fake KV -------------------------


def random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    prompts = []
    for _ in range(count):
        base = rng.choice(systems + [[]])
        prompts.append(base + [rng.randrange(50_000) for _ in range(rng.randint(1, 12))])
    return prompts


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_outputs_match_without_caching_and_kv_is_right(seed):
    results = {}
    for enabled in (True, False):
        rng = random.Random(seed)
        sched = make_scheduler(num_blocks=1 + 14, block_size=4, max_num_batched_tokens=rng.choice([8, 16, 48]), max_num_seqs=6, enabled=enabled)
        requests = []
        for i, prompt in enumerate(random_prompts(rng, 14)):
            kind = rng.random()
            params = dict(max_tokens=rng.randint(1, 10), ignore_eos=True)
            if kind < 0.2:
                request = make_group(f"r{i}", prompt, n=rng.randint(2, 3), temperature=1.0, **params)
            elif kind < 0.3:
                request = make_request(f"r{i}", prompt, prompt_logprobs=1, **params)
            else:
                request = make_request(f"r{i}", prompt, **params)
            sched.add_request(request)
            requests.append(request)
        run_checked(sched, token_of)
        outputs = {}
        for request in requests:
            for seq in request.group.sequences if request.group else [request]:
                outputs[seq.request_id] = list(seq.output_token_ids)
        results[enabled] = (outputs, sched.kv_cache.prefix_cache_hits)
        pool = sched.kv_cache.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(blk.ref_cnt == 0 for blk in pool.blocks[1:])
    assert results[True][0] == results[False][0]
    assert results[False][1] == 0


def test_random_workload_with_caching_hits():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=1 + 40, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    for i, prompt in enumerate(random_prompts(rng, 20)):
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=4, ignore_eos=True))
    run_checked(sched, token_of)
    kv = sched.kv_cache
    assert 0 < kv.prefix_cache_hits < kv.prefix_cache_queries


def test_no_hits_means_the_same_schedule_as_without_caching():
    """With no shared prefixes (and no preemption, after which a request finds its own blocks), caching
    changes no chunk: it only remembers hashes, and LRU order is the same. Block ids may differ: a table
    grows into the block after its last one only if that block caches nothing (else it would evict it
    out of LRU order), so with caching on some tables take the front of the free list instead."""
    shapes = {}
    for enabled in (True, False):
        rng = random.Random(3)
        sched = make_scheduler(num_blocks=1 + 40, block_size=4, max_num_batched_tokens=16, max_num_seqs=5, enabled=enabled)
        for i in range(12):
            sched.add_request(make_request(f"r{i}", tokens(rng.randint(1, 20), start=1000 * (i + 1)), max_tokens=rng.randint(1, 12), ignore_eos=True))
        fake = FakeKV(4)
        trace = []
        while sched.has_unfinished_requests():
            out = step_checked(sched, fake, token_of)
            trace.append(([(c.request_id, c.start_pos, len(c.token_ids), len(c.block_ids)) for c in out.chunks], out.preempted_request_ids))
        shapes[enabled] = trace
        assert sched.kv_cache.prefix_cache_hits == 0
    assert shapes[True] == shapes[False]


# -- end to end on a tiny model ------------------------------------------------------------------------------

VOCAB = 512


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama_gqa")


def make_llm(path: str, enabled: bool, **kwargs):
    from tokenmill import LLM

    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("max_num_batched_tokens", 256)
    return LLM(model=path, enable_prefix_caching=enabled, dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def llms(model_path):
    return {enabled: make_llm(model_path, enabled) for enabled in (True, False)}


def rand_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def generate(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def hits(llm) -> int:
    return llm.llm_engine.stats().prefix_cache_hits


def assert_all_free(llm) -> None:
    pool = llm.llm_engine.scheduler.kv_cache.pool
    assert not llm.llm_engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def greedy(max_tokens: int):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def seeded(seed: int, max_tokens: int, **kw):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0.9, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_multi_turn_conversation_matches_without_caching(llms, sampling):
    system = rand_tokens(37, seed=1)
    runs = {}
    for enabled, llm in llms.items():
        before = hits(llm)
        prompt, answers = list(system), []
        for turn in range(4):
            prompt = prompt + rand_tokens(9, seed=10 + turn)  # the user's next message
            params = greedy(12) if sampling == "greedy" else seeded(100 + turn, 12)
            (out,) = generate(llm, [prompt], params)
            answer = out.outputs[0].token_ids
            answers.append(answer)
            prompt = prompt + answer  # the next turn extends this turn's prompt and answer
        runs[enabled] = (answers, hits(llm) - before)
        assert_all_free(llm)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 0 and runs[False][1] == 0
    # Each turn finds at least the previous turn's prompt's full blocks (8 tokens each) cached.
    assert runs[True][1] >= sum((37 + 9 + 21 * t) // 8 * 8 for t in range(3))


def test_shared_system_prompt_together_and_in_sequence_matches_without_caching(llms):
    system = rand_tokens(64, seed=2)
    prompts = [system + rand_tokens(3 + i, seed=20 + i) for i in range(6)]
    params = [greedy(10) if i % 2 else seeded(i, 10) for i in range(6)]
    runs = {}
    for enabled, llm in llms.items():
        before = hits(llm)
        together = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
        together_hits = hits(llm) - before
        one_by_one = [generate(llm, [p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        runs[enabled] = (together, one_by_one, together_hits, hits(llm) - before)
        assert_all_free(llm)
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][0] == runs[True][1]
    # Submitted together: the first request's system prompt blocks serve the other five in the same step.
    assert runs[True][2] >= 5 * 64
    assert runs[True][3] >= 11 * 64
    assert runs[False][3] == 0


def test_small_cache_with_eviction_and_preemption_matches_without_caching(model_path):
    system = rand_tokens(30, seed=3)
    prompts = [system + rand_tokens(5 + i % 4, seed=40 + i) for i in range(8)]
    params = [seeded(7 * i, 16) for i in range(8)]
    outs = {}
    for enabled in (True, False):
        llm = make_llm(model_path, enabled, num_kv_blocks=1 + 14, max_num_batched_tokens=64)
        first = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
        second = [o.outputs[0].token_ids for o in generate(llm, prompts[::-1], params[::-1])]
        stats = llm.llm_engine.stats()
        outs[enabled] = (first, second[::-1], stats.num_preemptions > 0, stats.prefix_cache_hits)
        assert_all_free(llm)
    assert outs[True][:2] == outs[False][:2]
    assert outs[True][0] == outs[True][1]
    assert outs[True][2] and outs[True][3] > 0


def test_parallel_sampling_with_a_shared_prefix_matches_without_caching(llms):
    from tokenmill import SamplingParams

    system = rand_tokens(40, seed=4)
    prompts = [system + rand_tokens(5, seed=50), system + rand_tokens(11, seed=51), system + rand_tokens(1, seed=52)]
    params = [
        SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, best_of=4, temperature=1.0, seed=6, max_tokens=8, ignore_eos=True),
        SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    runs = {}
    for enabled, llm in llms.items():
        before = hits(llm)
        first = [[c.token_ids for c in o.outputs] for o in generate(llm, prompts, params)]
        again = [[c.token_ids for c in o.outputs] for o in generate(llm, prompts, params)]
        runs[enabled] = (first, again, hits(llm) - before)
        assert_all_free(llm)
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][0] == runs[True][1]
    assert runs[True][2] > 0


def test_beam_search_matches_without_caching(llms):
    from tokenmill.sampling_params import BeamSearchParams

    system = rand_tokens(33, seed=5)
    prompts = [{"prompt_token_ids": system + rand_tokens(4, seed=60 + i)} for i in range(2)]
    params = BeamSearchParams(beam_width=3, max_tokens=9, ignore_eos=True)
    runs = {}
    for enabled, llm in llms.items():
        before = hits(llm)
        results = llm.beam_search(prompts, params)
        runs[enabled] = ([[s.tokens for s in r.sequences] for r in results], hits(llm) - before)
        assert_all_free(llm)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 0


def test_prompt_logprobs_are_the_same_with_caching(llms):
    from tokenmill import SamplingParams

    prompt = rand_tokens(45, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=3, logprobs=2)
    runs = {}
    for enabled, llm in llms.items():
        generate(llm, [prompt + [1, 2]], greedy(2))  # caches the prompt's blocks
        before = llm.llm_engine.stats()
        (out,) = generate(llm, [prompt], params)
        after = llm.llm_engine.stats()
        # Not looked up at all: a request asking for prompt logprobs computes every position.
        assert (after.prefix_cache_queries, after.prefix_cache_hits) == (before.prefix_cache_queries, before.prefix_cache_hits)
        runs[enabled] = out
        assert_all_free(llm)
    on, off = runs[True], runs[False]
    assert on.outputs[0].token_ids == off.outputs[0].token_ids
    assert len(on.prompt_logprobs) == len(prompt) and on.prompt_logprobs[0] is None
    for a, b in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)
            assert a[token].rank == b[token].rank
