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
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of the request; False (and no change) if blocks run out."""
        need = self.num_blocks_needed(request, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            self.req_to_blocks.setdefault(request.request_id, []).extend(self.pool.get_new_blocks(need))
        else:
            self.req_to_blocks.setdefault(request.request_id, [])
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail blocks first, so a request's prefix stays cached longest (evicted last).
        self.pool.free_blocks(list(reversed(blocks)))
