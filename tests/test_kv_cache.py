"""BlockPool / KVCacheManager bookkeeping: exact block ids, ref counts, LRU order, no leaks."""

from __future__ import annotations

import math
import random

import pytest

from tokenmill.engine.kv_cache import BlockPool, KVCacheManager, cdiv
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(range(num_prompt_tokens)), sampling_params=SamplingParams())


def free_ids(pool: BlockPool) -> list[int]:
    """The free list, front (next handed out) first."""
    return list(pool._free)


def grow(manager: KVCacheManager, request: Request, num_new: int) -> bool:
    """What the scheduler does: allocate, then (after the forward pass) count the tokens as computed."""
    ok = manager.allocate_slots(request, num_new)
    if ok:
        request.num_computed_tokens += num_new
    return ok


# -- BlockPool ------------------------------------------------------------------


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)
    BlockPool(2)


def test_pool_initial_state_reserves_null_block():
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.null_block.block_id == 0
    assert pool.null_block.ref_cnt == 1
    assert pool.usage() == 0.0


def test_pool_hands_out_from_front_in_order():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in a)
    b = pool.get_new_blocks(2)
    assert [x.block_id for x in b] == [4, 5]
    assert free_ids(pool) == [6, 7]
    assert pool.num_free_blocks == 2
    # Block 0 is never handed out, even when the pool is drained.
    rest = pool.get_new_blocks(2)
    assert [x.block_id for x in rest] == [6, 7]
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0


def test_pool_freed_blocks_go_to_back_in_given_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3; free: 4, 5
    pool.free_blocks([blocks[2], blocks[0]])
    assert free_ids(pool) == [4, 5, 3, 1]
    assert blocks[2].ref_cnt == 0 and blocks[0].ref_cnt == 0
    # LRU: the blocks that were free longest come out first, then the just-freed ones.
    again = pool.get_new_blocks(4)
    assert [b.block_id for b in again] == [4, 5, 3, 1]


def test_pool_too_many_blocks_raises_without_change():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="only 3 are free"):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]


def test_pool_ref_counts_shared_block():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder (what a prefix-cache hit does)
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool)[-1] == block.block_id


def test_pool_double_free_is_an_error():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    before = free_ids(pool)
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free_blocks([blocks[0]])
    assert free_ids(pool) == before
    assert blocks[0].ref_cnt == 0


def test_pool_double_free_in_one_call_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free_blocks([a, b, a])
    # All or nothing: no block was released by the failed call.
    assert a.ref_cnt == 1 and b.ref_cnt == 1
    assert free_ids(pool) == [3]


def test_pool_null_block_cannot_be_freed():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="null block"):
        pool.free_blocks([pool.null_block])
    assert free_ids(pool) == [1, 2, 3]
    assert pool.null_block.ref_cnt == 1


def test_pool_usage():
    pool = BlockPool(11)  # 10 usable
    blocks = pool.get_new_blocks(4)
    assert pool.usage() == pytest.approx(0.4)
    pool.free_blocks(blocks[:1])
    assert pool.usage() == pytest.approx(0.3)


def test_new_block_forgets_old_hash():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    block.block_hash = 1234
    pool.free_blocks([block])
    assert block.block_hash == 1234  # a freed block stays cached until evicted
    pool.get_new_blocks(1)  # block 2
    (again,) = pool.get_new_blocks(1)
    assert again is block
    assert again.block_hash is None


# -- KVCacheManager ---------------------------------------------------------------


def test_cdiv():
    assert [cdiv(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_manager_allocates_exact_block_ids():
    pool = BlockPool(10)
    manager = KVCacheManager(pool, block_size=4)
    a, b = make_request("a", 10), make_request("b", 5)
    assert manager.allocate_slots(a, 10)
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.allocate_slots(b, 5)
    assert manager.get_block_ids("b") == [4, 5]
    assert pool.num_free_blocks == 4
    assert manager.get_block_ids("missing") == []


def test_manager_grows_block_table_only_at_block_boundaries():
    pool = BlockPool(10)
    manager = KVCacheManager(pool, block_size=4)
    req = make_request("r", 3)
    assert grow(manager, req, 3)
    assert manager.get_block_ids("r") == [1]
    assert grow(manager, req, 1)  # 4 tokens: still one block
    assert manager.get_block_ids("r") == [1]
    other = make_request("o", 1)
    assert grow(manager, other, 1)  # takes block 2
    assert grow(manager, req, 1)  # token 5 needs a new block: 3
    assert manager.get_block_ids("r") == [1, 3]
    assert manager.num_blocks_needed(req, 3) == 0
    assert manager.num_blocks_needed(req, 4) == 1
    assert manager.num_blocks_needed(req, 12) == 3


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_manager_blocks_equal_ceil_tokens_over_block_size(block_size):
    rng = random.Random(block_size)
    pool = BlockPool(1 + 500)
    manager = KVCacheManager(pool, block_size=block_size)
    req = make_request("r", 1)
    total = 0
    for _ in range(60):
        n = rng.randint(1, 7)
        assert grow(manager, req, n)
        total += n
        blocks = manager.get_block_ids("r")
        assert len(blocks) == math.ceil(total / block_size)
        # Waste only in the last block.
        assert len(blocks) * block_size - total < block_size
        assert pool.num_free_blocks == 500 - len(blocks)
    assert len(set(manager.get_block_ids("r"))) == len(manager.get_block_ids("r"))


def test_allocate_slots_fails_without_change_when_blocks_run_out():
    pool = BlockPool(5)  # 4 usable
    manager = KVCacheManager(pool, block_size=4)
    a = make_request("a", 8)
    assert grow(manager, a, 8)  # blocks 1, 2
    b = make_request("b", 16)
    before_free = free_ids(pool)
    assert not manager.allocate_slots(b, 12)  # needs 3, only 2 free
    assert free_ids(pool) == before_free
    assert manager.get_block_ids("b") == []
    assert "b" not in manager.req_to_blocks
    # Growing an existing request past the end also fails cleanly.
    assert not manager.allocate_slots(a, 9)  # 17 tokens -> 5 blocks, has 2, needs 3
    assert manager.get_block_ids("a") == [1, 2]
    assert free_ids(pool) == before_free
    assert all(pool.blocks[i].ref_cnt == 1 for i in (1, 2))
    assert all(pool.blocks[i].ref_cnt == 0 for i in (3, 4))
    # Exactly what is left still fits.
    assert manager.allocate_slots(b, 8)
    assert manager.get_block_ids("b") == [3, 4]
    assert pool.num_free_blocks == 0
    assert not manager.allocate_slots(make_request("c", 1), 1)


def test_allocate_zero_new_blocks_is_fine():
    pool = BlockPool(3)
    manager = KVCacheManager(pool, block_size=4)
    req = make_request("r", 4)
    assert grow(manager, req, 4)
    assert pool.num_free_blocks == 1
    assert manager.allocate_slots(req, 0)
    assert manager.get_block_ids("r") == [1]


def test_free_releases_tail_first_to_back_of_lru():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, block_size=2)
    a, b = make_request("a", 6), make_request("b", 3)
    assert grow(manager, a, 6)  # 1, 2, 3
    assert grow(manager, b, 3)  # 4, 5
    manager.free(a)
    assert free_ids(pool) == [6, 7, 3, 2, 1]
    assert manager.get_block_ids("a") == []
    assert all(pool.blocks[i].ref_cnt == 0 for i in (1, 2, 3))
    manager.free(b)
    assert free_ids(pool) == [6, 7, 3, 2, 1, 5, 4]
    # The next request takes the longest-free blocks first.
    c = make_request("c", 8)
    assert grow(manager, c, 8)
    assert manager.get_block_ids("c") == [6, 7, 3, 2]


def test_free_unknown_or_twice_is_a_no_op_for_the_manager():
    pool = BlockPool(4)
    manager = KVCacheManager(pool, block_size=4)
    req = make_request("r", 4)
    assert grow(manager, req, 4)
    manager.free(req)
    manager.free(req)  # the manager forgets the request after the first free
    manager.free(make_request("never", 1))
    assert pool.num_free_blocks == 3
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_capacity_tokens():
    manager = KVCacheManager(BlockPool(11), block_size=16)
    assert manager.capacity_tokens == 160


def test_no_leak_after_random_workload():
    rng = random.Random(0)
    num_blocks, block_size = 33, 4
    pool = BlockPool(num_blocks)
    manager = KVCacheManager(pool, block_size)
    live: dict[str, Request] = {}
    for step in range(500):
        action = rng.random()
        if action < 0.3 or not live:
            req = make_request(f"r{step}", rng.randint(1, 20))
            if grow(manager, req, req.num_prompt_tokens):
                live[req.request_id] = req
            else:
                assert manager.get_block_ids(req.request_id) == []
        elif action < 0.8:
            req = rng.choice(list(live.values()))
            grow(manager, req, rng.randint(1, 3))
        else:
            req = live.pop(rng.choice(list(live)))
            manager.free(req)
        held = [bid for r in live.values() for bid in manager.get_block_ids(r.request_id)]
        assert len(held) == len(set(held)), "a block is in two block tables"
        assert 0 not in held
        assert len(held) + pool.num_free_blocks == num_blocks - 1
        assert set(held).isdisjoint(free_ids(pool))
        for r in live.values():
            assert len(manager.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, block_size)
    for req in live.values():
        manager.free(req)
    assert pool.num_free_blocks == num_blocks - 1
    assert sorted(free_ids(pool)) == list(range(1, num_blocks))
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert pool.null_block.ref_cnt == 1
    assert manager.req_to_blocks == {}
    assert pool.usage() == 0.0


# -- fork and copy-on-write (parallel sampling, beam search) ------------------------------------


def ref_counts(pool: BlockPool, ids: list[int]) -> list[int]:
    return [pool.blocks[i].ref_cnt for i in ids]


def forked_pair(num_tokens: int = 10, block_size: int = 4, num_blocks: int = 10):
    """A parent with num_tokens computed tokens and a child forked off it."""
    pool = BlockPool(num_blocks)
    manager = KVCacheManager(pool, block_size=block_size)
    parent = make_request("p", num_tokens)
    assert grow(manager, parent, num_tokens)
    child = make_request("c", num_tokens)
    manager.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    return pool, manager, parent, child


def test_fork_shares_every_block_with_one_more_reference():
    pool, manager, parent, child = forked_pair()
    assert manager.get_block_ids("p") == [1, 2, 3]
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert ref_counts(pool, [1, 2, 3]) == [2, 2, 2]
    assert pool.num_free_blocks == 6  # nothing allocated by the fork
    third = make_request("d", 10)
    manager.fork(child, third)
    assert ref_counts(pool, [1, 2, 3]) == [3, 3, 3]
    assert manager.req_to_blocks["c"] is not manager.req_to_blocks["p"]  # own tables
    with pytest.raises(RuntimeError, match="already has KV blocks"):
        manager.fork(parent, child)


def test_copy_on_write_of_the_shared_partial_block():
    pool, manager, parent, child = forked_pair()  # 10 tokens: blocks 1, 2 full, block 3 holds 2 tokens
    assert manager.take_block_copies() == []
    # The child writes token 11 into block 3, which the parent holds too: it gets block 4, a copy of 3.
    assert manager.allocate_slots(child, 1)
    assert manager.get_block_ids("c") == [1, 2, 4]
    assert ref_counts(pool, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert manager.take_block_copies() == [(3, 4)]
    assert manager.take_block_copies() == []  # handed out once
    # The parent is now block 3's only holder: it writes in place, no copy.
    assert manager.allocate_slots(parent, 1)
    assert manager.get_block_ids("p") == [1, 2, 3]
    assert manager.take_block_copies() == []
    assert free_ids(pool) == [5, 6, 7, 8, 9]


def test_copy_on_write_and_a_new_block_in_one_allocation():
    pool, manager, parent, child = forked_pair()
    assert manager.allocate_slots(child, 4)  # tokens 11..14: rest of block 3 (copied) and a new block
    assert manager.get_block_ids("c") == [1, 2, 4, 5]
    assert manager.take_block_copies() == [(3, 4)]
    assert ref_counts(pool, [1, 2, 3, 4, 5]) == [2, 2, 1, 1, 1]


def test_full_shared_blocks_are_never_copied():
    pool, manager, parent, child = forked_pair(num_tokens=8)  # two full blocks
    assert manager.allocate_slots(child, 1)
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert manager.take_block_copies() == []
    assert ref_counts(pool, [1, 2, 3]) == [2, 2, 1]


def test_copy_on_write_needs_a_free_block_and_fails_without_change():
    pool, manager, parent, child = forked_pair(num_tokens=10, num_blocks=4)  # blocks 1..3 used, none free
    assert not manager.allocate_slots(child, 1)
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert ref_counts(pool, [1, 2, 3]) == [2, 2, 2]
    assert manager.take_block_copies() == []


def test_freed_request_drops_its_pending_copies_and_nothing_leaks():
    pool, manager, parent, child = forked_pair()
    assert manager.allocate_slots(child, 1)  # copy (3, 4) queued
    manager.free(child)  # preempted before the forward pass: its copy must not run
    assert manager.take_block_copies() == []
    assert ref_counts(pool, [1, 2, 3, 4]) == [1, 1, 1, 0]
    manager.free(parent)
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert manager.req_to_blocks == {}


def test_eight_forks_share_the_prompt_and_copy_only_the_last_block():
    pool = BlockPool(64)
    manager = KVCacheManager(pool, block_size=16)
    parent = make_request("p", 199)
    assert grow(manager, parent, 199)  # 12 full blocks and one with 7 tokens
    children = []
    for i in range(7):
        child = make_request(f"c{i}", 199)
        manager.fork(parent, child)
        child.num_computed_tokens = 199
        children.append(child)
    assert ref_counts(pool, manager.get_block_ids("p")) == [8] * 13
    for seq in [parent] + children:  # each computes the last prompt token
        assert manager.allocate_slots(seq, 1)
    # 7 copies of the partial block; the last writer keeps the original.
    copies = manager.take_block_copies()
    assert [src for src, _ in copies] == [13] * 7
    assert manager.get_block_ids("c6")[-1] == 13
    assert pool.num_usable_blocks - pool.num_free_blocks == 12 + 8
    for seq in [parent] + children:
        manager.free(seq)
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_share_blocks_refuses_free_and_null_blocks():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="cannot be shared"):
        pool.share_blocks([block])
    with pytest.raises(RuntimeError, match="cannot be shared"):
        pool.share_blocks([pool.null_block])


# -- tables in consecutive blocks (reserved_blocks, the engine's RESERVED_BLOCKS) ---------------------


def reserving_request(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(range(num_prompt_tokens)),
                   sampling_params=SamplingParams(max_tokens=max_tokens))


def test_a_growing_table_takes_the_blocks_right_after_its_last():
    pool = BlockPool(80)
    manager = KVCacheManager(pool, block_size=4, reserved_blocks=64)
    a, b = reserving_request("a", 8, 8), reserving_request("b", 8, 400)
    assert grow(manager, a, 8)
    assert manager.get_block_ids("a") == [1, 2]  # 3, 4 (a's 8 tokens to come) go to the back of the free list
    assert free_ids(pool)[:2] == [5, 6] and free_ids(pool)[-2:] == [3, 4]
    assert grow(manager, b, 8)
    assert manager.get_block_ids("b") == [5, 6]  # 7 .. 70 go back: 100 blocks to come, at most 64
    assert free_ids(pool)[:2] == [71, 72]
    for _ in range(8):  # both decode: each grows into its own run
        assert grow(manager, a, 1) and grow(manager, b, 1)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    assert manager.get_block_ids("b") == [5, 6, 7, 8]
    other = reserving_request("o", 4, 1)
    assert grow(manager, other, 4)
    assert manager.get_block_ids("o") == [73]  # after b's 64 reserved, 9 .. 72


def test_reserved_blocks_are_only_an_order():
    """A reservation keeps no block from anyone: once the front is used up, reserved blocks are handed out."""
    pool = BlockPool(9)
    manager = KVCacheManager(pool, block_size=4, reserved_blocks=64)
    a = reserving_request("a", 4, 100)
    assert grow(manager, a, 4)  # block 1; 2 .. 8 reserved for it
    other = reserving_request("o", 28, 1)
    assert grow(manager, other, 28)  # needs all 7
    assert manager.get_block_ids("o") == [2, 3, 4, 5, 6, 7, 8]
    assert not grow(manager, a, 1)
    assert manager.get_block_ids("a") == [1]


def test_a_table_skips_cached_blocks_to_stay_consecutive():
    """The block after a table's last one is not taken if it holds a cached prefix: that would evict it."""
    pool = BlockPool(12)
    manager = KVCacheManager(pool, block_size=4, enable_prefix_caching=True)
    a = reserving_request("a", 8, 1)
    assert grow(manager, a, 8)  # 1, 2: cached
    b = reserving_request("b", 8, 1)
    b.prompt_token_ids[:] = b.all_token_ids[:] = [5] * 8
    assert grow(manager, b, 8)  # 3, 4: cached
    manager.free(b)
    assert free_ids(pool) == [5, 6, 7, 8, 9, 10, 11, 4, 3]
    manager.reserved_blocks = 64
    c = reserving_request("c", 12, 8)  # a's prompt and 4 more: a hit on 1, 2, then a new block
    hits = manager.get_computed_blocks(c)
    assert [x.block_id for x in hits] == [1, 2]
    assert manager.allocate_slots(c, 4, hits)
    assert manager.get_block_ids("c") == [1, 2, 5]  # not b's cached 3
    assert pool.blocks[3].block_hash is not None and pool.blocks[4].block_hash is not None
    assert free_ids(pool)[-2:] == [6, 7]  # c's 8 tokens to come
