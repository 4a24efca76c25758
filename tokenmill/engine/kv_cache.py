"""Block bookkeeping for the paged KV cache. No tensors here: only block ids.

BlockPool owns the blocks: a free list in LRU order (freed blocks go to the back, new
allocations come from the front) and a ref count per block. KVCacheManager maps each
request to its block table and grows it as the request's tokens are scheduled: into the
blocks right after its last one where they are free (the engine keeps up to RESERVED_BLOCKS
of them at the back of the free list for it), so that a table lies in consecutive blocks.
Block 0 is the null block: never handed out, used to pad block tables.

Automatic prefix caching (vLLM's scheme): every full block gets a hash that chains its
parent block's hash with its own token ids (and extra keys), so equal hashes mean equal
prefixes. BlockPool maps hash -> block for cached blocks. A full block is registered
when it is allocated for the tokens that fill it, i.e. in the step whose forward pass
writes its KV; see allocate_slots for why that is safe. A freed block keeps its hash and
stays in the free list, reusable, until get_new_blocks evicts it from the front. A new
request takes the longest cached run of its full blocks (get_computed_blocks) and starts
with num_computed_tokens past them. A hit is accepted only if the cached block's stored
key (parent hash, token ids, extra keys) equals the request's, so a colliding hash never
hands out another block's tokens; the parent is known only by its hash, which is why the
hash is sha256 (see hash_block_tokens). Cached blocks are full, so nothing writes into
them again: copy-on-write only ever concerns partial blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.engine.request import Request


class BlockKey(NamedTuple):
    """What a cached block holds, in full: compared on every hit, so a hash collision is never a hit."""

    parent_hash: int | None  # the previous block's hash; None for a request's first block
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()  # what else the KV depends on (a LoRA id, image hashes); none yet


_ROOT = bytes(32)  # the "parent hash" of a first block


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """The chained hash of one full block: sha256(parent hash, token count, token ids, extra keys).

    sha256 rather than Python's hash(): the stored-key check on a hit verifies one block, but
    its parent is only known by hash, so the chain must be collision-resistant even against
    prompts crafted to collide (hash() of an int tuple is neither cryptographic nor stable
    across processes). About a microsecond per block, computed once per block of a request.
    The encoding is unambiguous: a fixed-size parent, a length-prefixed token list, then extras.
    """
    digest = hashlib.sha256(_ROOT if parent_hash is None else parent_hash.to_bytes(32, "big"))
    digest.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return int.from_bytes(digest.digest(), "big")


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache; a freed block keeps its
    # hash (and key) so a later request can reuse it until the block is evicted.
    block_hash: int | None = None
    block_key: BlockKey | None = None


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
        # Prefix cache: hash -> the block holding that full block of tokens (in use or free).
        self._cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached)

    def get_new_blocks(self, n: int, after: int | None = None) -> list[KVCacheBlock]:
        """n free blocks: with `after` (the last block of the table they extend), first the blocks
        right after it while they are free and hold no cached prefix, then from the front (LRU)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        out = []
        following = [] if after is None else self._free_run(after, n, uncached_only=True)
        for i in range(n):
            block = self._free.pop(following[i]) if i < len(following) else self._free.popitem(last=False)[1]
            if block.block_hash is not None:  # evicted: its old contents are no longer reusable
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
                block.block_key = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def _free_run(self, block_id: int, limit: int, uncached_only: bool = False) -> list[int]:
        """The ids of the free blocks right after block_id, up to limit, stopping at the first one that is not."""
        run = []
        for i in range(block_id + 1, min(block_id + 1 + limit, self.num_blocks)):
            block = self._free.get(i)
            if block is None or (uncached_only and block.block_hash is not None):
                break
            run.append(i)
        return run

    def reserve_after(self, block_id: int, count: int) -> None:
        """Move the free blocks right after block_id (up to count) to the back of the free list, so that
        other requests take them last and the table ending at block_id can grow into them. Only an
        order: when the front runs out, they are handed out like any other."""
        for i in self._free_run(block_id, count):
            self._free.move_to_end(i)

    def get_cached_block(self, block_hash: int, key: BlockKey) -> KVCacheBlock | None:
        """The cached block with this hash, if it holds exactly `key` (else None: a miss, or a collision)."""
        block = self._cached.get(block_hash)
        if block is None or block.block_key != key:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: int, key: BlockKey) -> bool:
        """Register a full block under its hash; False if it is not registered.

        The first block registered under a hash keeps it: a second block with the same
        contents (two requests computed the same prefix at once) or a colliding hash stays
        uncached, and is evicted like any plain block once freed.
        """
        if block is self.null_block:
            raise RuntimeError("the null block (block 0) cannot be cached")
        if block.block_hash is not None:  # already cached: a prefix hit, or a block shared by a fork
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.block_key = key
        self._cached[block_hash] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a block out of the prefix cache (its KV was never written): it stays allocated, as a plain block."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.block_key = None

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference to each cached block a request reuses; a free one leaves the free list."""
        for block in blocks:
            if block.block_hash is None or self._cached.get(block.block_hash) is not block:
                raise RuntimeError(f"block {block.block_id} is not in the prefix cache")
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

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


# Blocks kept for a request to grow into, at most (reserve_after). The decode attention kernel reads a
# request's blocks one after the other: where they lie in sequence, the hardware prefetchers run ahead
# of each block's end (SmolLM2's heads, 114 requests x 400 tokens, Zen 5: a layer 1.56 ms with blocks at
# random places, 1.31 interleaved as decode growth handed them out, 1.00 in sequence). Without it,
# workload B's tables went from 91% to 43% consecutive blocks over the run; with it they stay at 100%,
# and B on tiny100m (bf16) ran 1.045x faster (1,252-1,257 -> 1,311-1,317 output tok/s, two runs each).
RESERVED_BLOCKS = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = False, reserved_blocks: int = 0) -> None:
        """reserved_blocks: at most this many free blocks after a table's last one are kept for it to
        grow into (BlockPool.reserve_after); the engine's is RESERVED_BLOCKS."""
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reserved_blocks = reserved_blocks
        # Prefix-cache counters, in tokens, as vLLM's metrics count them: prompt tokens looked up, and found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix caching: how many leading blocks of each request's table were already offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
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

    # -- prefix caching -----------------------------------------------------------------
    @staticmethod
    def _extra_keys(request: Request) -> tuple:
        """What besides the tokens a request's KV depends on (its LoRA adapter, later); part of every block's key."""
        return ()

    def _block_key(self, request: Request, index: int) -> BlockKey:
        """The key of block `index` of the request's tokens (request.block_hashes must cover index - 1)."""
        start = index * self.block_size
        return BlockKey(
            request.block_hashes[index - 1] if index else None,
            tuple(request.all_token_ids[start : start + self.block_size]),
            self._extra_keys(request),
        )

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's chained block hashes, computed once per block and kept on the request (forks copy them)."""
        hashes = request.block_hashes
        # Only an uncomputed last token is ever taken back (beam search), and blocks are hashed only
        # up to computed or scheduled tokens; dropping hashes past the tokens keeps that an invariant.
        del hashes[request.num_tokens // self.block_size :]
        while len(hashes) < num_blocks:
            hashes.append(hash_block_tokens(*self._block_key(request, len(hashes))))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock] | None:
        """The cached blocks of the longest prefix of the request's full blocks; None if the cache is not consulted.

        Only a request that holds no KV yet (first admitted, or re-admitted after preemption)
        looks up, and not one that asks for prompt_logprobs (they need every prompt position's
        logits). Pure: nothing is taken until allocate_slots gets the blocks. The hit stops
        short of the last token, which must be computed to sample from its logits: capping at
        num_tokens - 1 rounded down to a block also means the block it is written into is never
        a shared cached one. A request about to fork holds its last prompt token back until
        the fork, so it needs one more token of its own before it.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return None
        if request.num_computed_tokens or self.req_to_blocks.get(request.request_id):
            return None
        to_compute = 2 if request.awaiting_fork else 1
        max_blocks = max(0, request.num_tokens - to_compute) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        for index in range(max_blocks):
            block = self.pool.get_cached_block(hashes[index], self._block_key(request, index))
            if block is None:
                break
            hits.append(block)
        return hits

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that the first num_tokens tokens fill (tokens whose KV is computed by the end of this step)."""
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for index in range(start, num_full):
            self.pool.cache_block(blocks[index], hashes[index], self._block_key(request, index))
        self._num_cached_blocks[request.request_id] = num_full

    # -- allocation ---------------------------------------------------------------------
    def _shared_blocks_written(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices in the block table of blocks the next num_new_tokens tokens write into while others hold them too.

        Only the block holding num_computed_tokens can be partly written: full blocks (the
        only ones ever cached) lie before it, so a cached block is never copied or written.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks or num_new_tokens <= 0:
            return []
        first = request.num_computed_tokens // self.block_size
        last = min((request.num_computed_tokens + num_new_tokens - 1) // self.block_size, len(blocks) - 1)
        return [i for i in range(first, last + 1) if blocks[i].ref_cnt > 1]

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for num_new_tokens more tokens of the request; False (and no change) if blocks run out.

        `cached_blocks` is get_computed_blocks' answer for a request with no KV yet: they
        start its block table (one more reference each; a free one leaves the free list, so
        it counts against the free blocks), and num_new_tokens are the tokens after them.
        The caller then sets num_computed_tokens past them. The lookup is counted in the
        prefix-cache counters only when the allocation succeeds, so a request that waits
        for memory is not counted each time it tries.

        A block the new tokens write into that is shared with a forked sequence is copied on
        write: the request gets a fresh block, the copy (src, dst) is queued for the runner
        (take_block_copies), and the shared block loses this request's reference.

        With prefix caching, the blocks these tokens fill are registered now, before their
        KV exists, as vLLM does: the forward pass of this step writes them before the next
        schedule can hand them to anyone, and a request admitted later in this same step
        that hits them reads them in that pass, after every layer has written the step's
        K/V (attention writes the whole batch's K/V into the cache before it reads). A
        scheduled request is never freed before its forward pass (preemption only takes
        requests not yet scheduled in the step).
        """
        rid = request.request_id
        hits = cached_blocks or []
        if hits and (request.num_computed_tokens or self.req_to_blocks.get(rid)):
            raise RuntimeError(f"request {rid!r} already has KV: cached prefix blocks start a block table")
        num_cached_tokens = len(hits) * self.block_size
        have = len(self.req_to_blocks.get(rid, ())) + len(hits)
        need = max(0, cdiv(request.num_computed_tokens + num_cached_tokens + num_new_tokens, self.block_size) - have)
        cow = self._shared_blocks_written(request, num_new_tokens)
        hits_in_free_list = sum(1 for b in hits if b.ref_cnt == 0)
        if need + len(cow) + hits_in_free_list > self.pool.num_free_blocks:
            return False
        if cached_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens
        if hits:  # before any new block is taken, so eviction cannot pick one of them
            self.pool.touch(hits)
            self.req_to_blocks[rid] = list(hits)
            self._num_cached_blocks[rid] = len(hits)
        if cow:
            blocks = self.req_to_blocks[rid]
            released = []
            for index, fresh in zip(cow, self.pool.get_new_blocks(len(cow))):
                if index * self.block_size < request.num_computed_tokens:  # it holds computed tokens: copy them
                    self._pending_copies.setdefault(rid, []).append((blocks[index].block_id, fresh.block_id))
                released.append(blocks[index])
                blocks[index] = fresh
            self.pool.free_blocks(released)
        blocks = self.req_to_blocks.setdefault(rid, [])
        if need:
            blocks.extend(self.pool.get_new_blocks(need, blocks[-1].block_id if blocks else None))
            if self.reserved_blocks:
                self.pool.reserve_after(blocks[-1].block_id, min(self.reserved_blocks, self._blocks_to_come(request, len(blocks))))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, request.num_computed_tokens + num_cached_tokens + num_new_tokens)
        return True

    def _blocks_to_come(self, request: Request, have: int) -> int:
        """Blocks the request may still need after its first `have`, as far as max_tokens says."""
        max_tokens = request.sampling_params.max_tokens
        last = request.max_model_len if max_tokens is None else min(request.max_model_len, request.num_prompt_tokens + max_tokens)
        return max(0, cdiv(last, self.block_size) - have)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent's table (one more reference each)."""
        if child.request_id in self.req_to_blocks:
            raise RuntimeError(f"request {child.request_id!r} already has KV blocks")
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.pool.share_blocks(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        if parent.request_id in self._num_cached_blocks:
            self._num_cached_blocks[child.request_id] = self._num_cached_blocks[parent.request_id]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copy-on-write block copies queued since the last call, to run before the next forward pass."""
        copies = [pair for pairs in self._pending_copies.values() for pair in pairs]
        self._pending_copies.clear()
        return copies

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Drop from the prefix cache the request's blocks past its first num_tokens tokens: they were
        registered for a step that never wrote them. (A block before that holds computed tokens only:
        cached blocks are full, and a partly computed block is never registered.)"""
        first = num_tokens // self.block_size
        for block in self.req_to_blocks.get(request.request_id, [])[first:]:
            self.pool.uncache(block)
        if self._num_cached_blocks.get(request.request_id, 0) > first:
            self._num_cached_blocks[request.request_id] = first

    def free(self, request: Request) -> None:
        self._pending_copies.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail blocks first, so a request's prefix stays cached longest (evicted last).
        self.pool.free_blocks(list(reversed(blocks)))
