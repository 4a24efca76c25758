"""build_batch_inputs: everything one forward pass needs, from the scheduled chunks in one go with numpy."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from tokenmill.engine.messages import ScheduledChunk
from tokenmill.layers.attention_metadata import AttentionGroup, BatchInputs
from tokenmill.spec_decode.tree import tree_layout


# Cascade attention is used from here on: a shared prefix of at least this many tokens, over at least this
# many decode rows. Below, the prefix pass's extra work (a second kernel call, padded rows, the merge) is
# not won back: one layer of SmolLM2's heads, 48 own tokens per request, one Zen 5 thread
# (benchmarks/cascade_attention.py's case): 8 requests over 256 tokens break even (0.97-1.04x), 16 gain
# 1.3x, 64 over 1,024 tokens 1.55-1.65x; 4 requests lose 15-25%. (vLLM's thresholds are 256 and 8.)
CASCADE_MIN_PREFIX_TOKENS = 256
CASCADE_MIN_ROWS = 16

# A chunk of at most this many tokens that continues a context is attended as decode rows, one per
# token, each over the context up to itself: a draft model's first pass of a speculative step (the
# last draft and the target's bonus token), a prompt's last tokens after a prefix-cache hit. Such a
# batch then takes the decode program (models/llama.py) when it holds nothing else: with a "self"
# int4 draft (k = 6, SmolLM2, bf16, Zen 5) the draft's first pass went through the layers' forward
# in 17% of a step's samples, 4% after.
SHORT_CHUNK_MAX_TOKENS = 4


def build_batch_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device, cascade: bool = True) -> BatchInputs:
    """BatchInputs from the scheduled chunks, in one go with numpy; cascade: look for a prefix the decodes share."""
    if all(len(c.token_ids) == 1 and c.sample and not c.spec_token_ids for c in chunks):
        return _plain_decodes(chunks, block_size, device, cascade)
    return _any_chunks(chunks, block_size, device, cascade)


def _any_chunks(chunks: list[ScheduledChunk], block_size: int, device: torch.device, cascade: bool) -> BatchInputs:
    """build_batch_inputs for any mix of chunks: prompt chunks, decodes, drafts to verify, token trees."""
    num_reqs = len(chunks)
    q_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=num_reqs)
    num_tokens = int(q_lens.sum())
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    seq_lens = starts + q_lens

    input_ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=num_tokens)
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    positions = np.arange(num_tokens) - query_start_loc[:-1][req_of_token] + starts[req_of_token]

    block_tables = _block_tables(chunks)
    slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    # Token trees: node i of a chunk's drafts sits in the slot after its last real token plus 1 + i (as a
    # chain's draft would), but its position is that token's plus its depth, and it sees only its ancestors.
    slot_pos, tree = positions, _tree_rows(chunks, query_start_loc, positions)
    if tree is not None:
        positions = positions.copy()
        positions[tree[0]] = tree[1]

    # Sampled rows: each sampling chunk's last token, and with k drafts its last k + 1 tokens.
    num_spec = np.fromiter((len(c.spec_token_ids) for c in chunks), dtype=np.int64, count=num_reqs)
    sample_rows = np.fromiter((c.sample for c in chunks), dtype=bool, count=num_reqs)
    rows_sampled = np.where(sample_rows, num_spec + 1, 0)
    total_sampled = int(rows_sampled.sum())
    # Row i of a chunk sampling c rows is its token c - i from the end.
    from_end = np.repeat(np.cumsum(rows_sampled), rows_sampled) - np.arange(total_sampled)
    logits_indices = np.repeat(query_start_loc[1:], rows_sampled) - from_end

    # Decodes, chunks verifying drafts, and chunks of a few tokens past a context (a draft model catching
    # up on the tokens the target kept) attend per token: each query token is a row of the decode group
    # over its request's context up to its own position (causal among a chunk's tokens as well).
    is_decode = (q_lens == 1) | (num_spec > 0) | ((q_lens <= SHORT_CHUNK_MAX_TOKENS) & (starts > 0))
    groups = []
    if is_decode.any():
        groups.append(_decode_group(np.flatnonzero(is_decode[req_of_token]), req_of_token, positions, slot_pos, tree, block_tables,
                                    block_size, device, cascade))
    for rows in _prompt_row_groups(np.nonzero(~is_decode)[0], q_lens):
        groups.append(_make_group(rows, q_lens, starts, seq_lens, query_start_loc, block_tables, block_size, num_tokens, device))

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return BatchInputs(
        input_ids=t(input_ids),
        positions=t(positions),
        slot_mapping=t(slot_mapping),
        query_start_loc=t(query_start_loc),
        seq_lens=t(seq_lens),
        block_tables=t(block_tables),
        logits_indices=t(logits_indices),
        attn_groups=groups,
        block_size=block_size,
        num_tokens=num_tokens,
    )


def _plain_decodes(chunks: list[ScheduledChunk], block_size: int, device: torch.device, cascade: bool) -> BatchInputs:
    """build_batch_inputs for a batch of plain decodes (one token each, sampled, no drafts), the steady
    state of decoding, in a third of its numpy and torch calls: one request's build took ~0.25 ms of a
    step in the engine against ~0.07 ms timed alone, as a step's Python runs on caches its forward pass
    has just emptied, so every call counts (the same arrays as the general path makes for such a batch)."""
    num_reqs = len(chunks)
    input_ids = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=num_reqs)
    positions = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=num_reqs)
    block_tables = _block_tables(chunks)
    rows = np.arange(num_reqs)
    slot_mapping = block_tables[rows, positions // block_size] * block_size + positions % block_size
    group = _decode_group(rows, rows, positions, positions, None, block_tables, block_size, device, cascade)
    rows_t = group.token_index[:, 0]
    return BatchInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.arange(num_reqs + 1, device=device),
        seq_lens=torch.from_numpy(positions + 1).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        logits_indices=rows_t,
        attn_groups=[group],
        block_size=block_size,
        num_tokens=num_reqs,
    )


def _block_tables(chunks: list[ScheduledChunk]) -> np.ndarray:
    """Every request's block ids scattered into a zero-padded [requests, most blocks] matrix."""
    num_reqs = len(chunks)
    n_blocks = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int64, count=num_reqs)
    flat_blocks = np.fromiter(chain.from_iterable(c.block_ids for c in chunks), dtype=np.int64, count=int(n_blocks.sum()))
    block_tables = np.zeros((num_reqs, max(int(n_blocks.max()), 1)), dtype=np.int64)
    block_starts = np.cumsum(n_blocks) - n_blocks
    row_of_block = np.repeat(np.arange(num_reqs), n_blocks)
    block_tables[row_of_block, np.arange(len(flat_blocks)) - block_starts[row_of_block]] = flat_blocks
    return block_tables


def next_decode_batch(batch: BatchInputs, input_ids: torch.Tensor) -> BatchInputs | None:
    """A batch of plain decodes (BatchInputs.plain_decode_group, no token tree) one position further on:
    input_ids at each request's next position, in the blocks its table already holds (a draft model's next pass, whose
    slots the scheduler reserved), made with a few tensor ops instead of build_batch_inputs' numpy from
    chunks (~0.25 ms a pass of one request). None for any other batch."""
    group = batch.plain_decode_group()
    if group is None or group.tree_start is not None:
        return None
    return _decodes_at(batch.positions + 1, batch.block_tables, input_ids, batch.block_size)


def next_rows_batch(batch: BatchInputs, requests: torch.Tensor, input_ids: torch.Tensor) -> BatchInputs:
    """One plain decode per request given (indices into the batch's chunks, each sampling one row and
    no drafts), a position after its sampled row: input_ids there, in the blocks its table already holds.
    An EAGLE head's next draft pass after one of any shape (its first reads several rows per request), as
    next_decode_batch does for a draft model's."""
    positions = batch.positions[batch.logits_indices[requests]] + 1
    return _decodes_at(positions, batch.block_tables[requests], input_ids, batch.block_size)


def _decodes_at(positions: torch.Tensor, block_tables: torch.Tensor, input_ids: torch.Tensor, block_size: int) -> BatchInputs:
    """Plain decodes of input_ids at these positions (one per request, [B]), in these block tables ([B, blocks])."""
    blocks = block_tables.gather(1, (positions // block_size)[:, None])[:, 0]
    num_blocks = int(positions.max()) // block_size + 1
    rows = torch.arange(len(positions), device=positions.device)
    return BatchInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start_loc=torch.arange(len(positions) + 1, device=positions.device),
        seq_lens=positions + 1,
        block_tables=block_tables,
        logits_indices=rows,
        attn_groups=[AttentionGroup(token_index=rows[:, None], block_table=block_tables[:, :num_blocks].contiguous(),
                                    query_pos=positions[:, None])],
        block_size=block_size,
        num_tokens=len(positions),
    )


# A prompt group's padded query slots may be at most this many times its real query tokens.
_MAX_PADDING_RATIO = 2


def _prompt_row_groups(rows: np.ndarray, q_lens: np.ndarray) -> list[np.ndarray]:
    """Prompt chunks split into groups of similar length, longest first: one 1,056-token chunk
    and thirty 32-token ones (a shared prefix computed once, then the suffixes) would otherwise be
    padded to 31 x 1,056 query rows, and attention would do 30 times the work."""
    if len(rows) == 0:
        return []
    rows = rows[np.argsort(-q_lens[rows], kind="stable")]
    lens = q_lens[rows]
    groups, first = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or lens[first] * (i - first + 1) > _MAX_PADDING_RATIO * (lens[first : i + 1].sum()):
            groups.append(rows[first:i])
            first = i
    return groups


def _tree_rows(chunks: list[ScheduledChunk], query_start_loc: np.ndarray,
               slot_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """For the chunks whose drafts form a tree (spec_parents): their node rows in the step, each node's
    position (its root's plus its depth), first tree slot position and ancestor bitmask; None without trees."""
    trees = [i for i, c in enumerate(chunks) if c.spec_parents]
    if not trees:
        return None
    counts = np.fromiter((len(chunks[i].spec_parents) for i in trees), dtype=np.int64, count=len(trees))
    parents = np.fromiter(chain.from_iterable(chunks[i].spec_parents for i in trees), dtype=np.int64, count=int(counts.sum()))
    node_start = np.repeat(np.cumsum(counts) - counts, counts)
    depth, mask = tree_layout(parents, node_start)
    root_row = np.repeat(query_start_loc[np.asarray(trees) + 1] - counts - 1, counts)
    rows = root_row + 1 + np.arange(len(parents)) - node_start
    return rows, slot_pos[root_row] + depth, slot_pos[root_row] + 1, mask


def _decode_group(
    token_rows: np.ndarray, req_of_token: np.ndarray, positions: np.ndarray, slot_pos: np.ndarray,
    tree: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None, block_tables: np.ndarray, block_size: int,
    device: torch.device, cascade: bool = True,
) -> AttentionGroup:
    """One row per query token: its row in the step, its request's block table and its position (and
    for a tree node, where its tree starts and which of its slots it sees)."""
    query_pos = positions[token_rows]
    num_blocks = int(slot_pos[token_rows].max()) // block_size + 1
    table = np.ascontiguousarray(block_tables[req_of_token[token_rows], :num_blocks])
    # Not with token trees: the decode kernel's prefix merge and its tree mask do not combine yet.
    prefix_blocks = shared_prefix_blocks(table, query_pos, block_size) if cascade and tree is None else 0
    tree_start = tree_mask = None
    if tree is not None:
        # Every row gets a value: a plain row's tree starts after it, with an empty mask.
        start, bits = query_pos + 1, np.zeros(len(token_rows), dtype=np.int64)
        where = np.searchsorted(token_rows, tree[0])  # token_rows is sorted, and holds every tree row
        start[where], bits[where] = tree[2], tree[3]
        tree_start, tree_mask = torch.from_numpy(start).to(device), torch.from_numpy(bits).to(device)
    return AttentionGroup(
        token_index=torch.from_numpy(token_rows[:, None]).to(device),
        block_table=torch.from_numpy(table).to(device),
        query_pos=torch.from_numpy(query_pos[:, None]).to(device),
        from_start=bool((query_pos == 0).all()),
        shared_prefix=(prefix_blocks * block_size, torch.from_numpy(table[0, :prefix_blocks].copy()).to(device)) if prefix_blocks else None,
        tree_start=tree_start,
        tree_mask=tree_mask,
    )


def shared_prefix_blocks(table: np.ndarray, query_pos: np.ndarray, block_size: int) -> int:
    """The leading blocks every row's block table shares (the same physical blocks, as prefix caching
    hands out), when cascade attention pays for them (CASCADE_MIN_ROWS, CASCADE_MIN_PREFIX_TOKENS); else 0.

    Only whole blocks before every row's own position count, so each token keeps at least itself to
    attend to after the prefix. Without sharing the first column differs and that ends it."""
    limit = int(query_pos.min()) // block_size
    if len(table) < CASCADE_MIN_ROWS or limit * block_size < CASCADE_MIN_PREFIX_TOKENS:
        return 0
    head = table[:, :limit]
    same = (head == head[0]).all(axis=0)
    shared = limit if same.all() else int(np.argmin(same))
    return shared if shared * block_size >= CASCADE_MIN_PREFIX_TOKENS else 0


def _make_group(
    rows: np.ndarray,
    q_lens: np.ndarray,
    starts: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    num_tokens: int,
    device: torch.device,
) -> AttentionGroup:
    max_q = int(q_lens[rows].max())
    offsets = np.arange(max_q)[None, :]
    token_index = query_start_loc[rows][:, None] + offsets
    token_index[offsets >= q_lens[rows][:, None]] = num_tokens  # padding -> scratch row
    query_pos = starts[rows][:, None] + offsets
    num_blocks = -(-int(seq_lens[rows].max()) // block_size)
    return AttentionGroup(
        token_index=torch.from_numpy(token_index).to(device),
        block_table=torch.from_numpy(np.ascontiguousarray(block_tables[rows, :num_blocks])).to(device),
        query_pos=torch.from_numpy(query_pos).to(device),
        from_start=bool((starts[rows] == 0).all()),
    )
