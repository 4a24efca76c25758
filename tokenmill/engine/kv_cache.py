"""Block bookkeeping for the paged KV cache. No tensors here: only block ids.

BlockPool owns the blocks: a free list in LRU order (freed blocks go to the back, new
allocations come from the front) and a ref count per block. KVCacheManager maps each
request to its block table and grows it as the request's tokens are scheduled.
Block 0 is the null block: never handed out, used to pad block tables.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and hashed (prefix caching); a freed block keeps its
    # hash so a later request can reuse it until the block is evicted.
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed
        # Insertion order is LRU order: the front is evicted first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            block.block_hash = None  # evicted: its old contents are no longer reusable
            block.ref_cnt = 1
            out.append(block)
        return out

    def share_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block (a forked sequence now holds them too)."""
        for block in blocks:
            if block is self.null_block or block.ref_cnt < 1:
                raise RuntimeError(f"block {block.block_id} is not held by anyone and cannot be shared")
        for block in blocks:
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks that reach zero join the back of the free list in the order given.

        All or nothing: a block freed more often than it is held, or the null block, raises
        before any ref count changes, so a bookkeeping bug cannot half-apply.
        """
        drops: dict[int, int] = {}
        for block in blocks:
            if block is self.null_block:
                raise RuntimeError("the null block (block 0) is never allocated and cannot be freed")
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if drops[block.block_id] > block.ref_cnt:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix-cache counters, in tokens, as vLLM's metrics count them: prompt tokens looked up, and found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Copy-on-write: (src, dst) block copies owed before the next forward pass, per request
        # (a request freed before the pass, e.g. preempted, drops its own).
        self._pending_copies: dict[str, list[tuple[int, int]]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def _shared_blocks_written(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices in the block table of blocks the next num_new_tokens tokens write into while others hold them too."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks or num_new_tokens <= 0:
            return []
        first = request.num_computed_tokens // self.block_size
        last = min((request.num_computed_tokens + num_new_tokens - 1) // self.block_size, len(blocks) - 1)
        return [i for i in range(first, last + 1) if blocks[i].ref_cnt > 1]

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of the request; False (and no change) if blocks run out.

        A block the new tokens write into that is shared with a forked sequence is copied on
        write: the request gets a fresh block, the copy (src, dst) is queued for the runner
        (take_block_copies), and the shared block loses this request's reference.
        """
        need = self.num_blocks_needed(request, num_new_tokens)
        cow = self._shared_blocks_written(request, num_new_tokens)
        if need + len(cow) > self.pool.num_free_blocks:
            return False
        if cow:
            blocks = self.req_to_blocks[request.request_id]
            released = []
            for index, fresh in zip(cow, self.pool.get_new_blocks(len(cow))):
                if index * self.block_size < request.num_computed_tokens:  # it holds computed tokens: copy them
                    self._pending_copies.setdefault(request.request_id, []).append((blocks[index].block_id, fresh.block_id))
                released.append(blocks[index])
                blocks[index] = fresh
            self.pool.free_blocks(released)
        if need:
            self.req_to_blocks.setdefault(request.request_id, []).extend(self.pool.get_new_blocks(need))
        else:
            self.req_to_blocks.setdefault(request.request_id, [])
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent's table (one more reference each)."""
        if child.request_id in self.req_to_blocks:
            raise RuntimeError(f"request {child.request_id!r} already has KV blocks")
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.pool.share_blocks(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copy-on-write block copies queued since the last call, to run before the next forward pass."""
        copies = [pair for pairs in self._pending_copies.values() for pair in pairs]
        self._pending_copies.clear()
        return copies

    def free(self, request: Request) -> None:
        self._pending_copies.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail blocks first, so a request's prefix stays cached longest (evicted last).
        self.pool.free_blocks(list(reversed(blocks)))
