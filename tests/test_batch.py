"""BatchInputs built from scheduled chunks: ids, positions, slots, block tables, sample rows, groups."""

from __future__ import annotations

import torch

from tokenmill.engine.messages import ScheduledChunk
from tokenmill.sampling_params import SamplingParams
from tokenmill.layers.attention_metadata import BatchInputs
from tokenmill.worker.batch import build_batch_inputs


def chunk(rid: str, token_ids: list[int], start: int, blocks: list[int], sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=rid,
        token_ids=token_ids,
        start_pos=start,
        block_ids=blocks,
        sample=sample,
        sampling_params=SamplingParams(),
        sampling_seed=0,
        output_index=0,
    )


def build(chunks, block_size=4) -> BatchInputs:
    return build_batch_inputs(chunks, block_size, torch.device("cpu"))


def test_mixed_batch_layout():
    chunks = [
        chunk("dec", [50], start=5, blocks=[3, 7]),  # decode of token 6 (position 5)
        chunk("full", [10, 11, 12, 13, 14, 15], start=0, blocks=[1, 2]),  # whole prompt
        chunk("part", [20, 21, 22, 23, 24], start=4, blocks=[4, 5, 8], sample=False),  # middle chunk
        chunk("dec2", [60], start=0, blocks=[6]),  # one-token prompt
    ]
    b = build(chunks)
    assert b.num_tokens == 13
    assert b.input_ids.tolist() == [50, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24, 60]
    assert b.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 0]
    assert b.query_start_loc.tolist() == [0, 1, 7, 12, 13]
    assert b.seq_lens.tolist() == [6, 6, 9, 1]
    assert b.block_tables.tolist() == [[3, 7, 0], [1, 2, 0], [4, 5, 8], [6, 0, 0]]
    # slot = block_id * block_size + offset
    assert b.slot_mapping.tolist() == [
        7 * 4 + 1,
        1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1,
        5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 8 * 4 + 0,
        6 * 4 + 0,
    ]  # fmt: skip
    # Only chunks that sample give a logits row: their last token.
    assert b.logits_indices.tolist() == [0, 6, 12]

    decode, prefill = b.attn_groups
    assert decode.token_index.tolist() == [[0], [12]]
    assert decode.query_pos.tolist() == [[5], [0]]
    assert decode.block_table.tolist() == [[3, 7], [6, 0]]
    assert prefill.token_index.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 13]]  # padding -> scratch row 13
    assert prefill.query_pos[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert prefill.query_pos[1, :5].tolist() == [4, 5, 6, 7, 8]
    assert prefill.block_table.tolist() == [[1, 2, 0], [4, 5, 8]]


def test_short_chunks_past_a_context_attend_as_decode_rows():
    """A chunk of up to SHORT_CHUNK_MAX_TOKENS tokens after position 0 (a draft's catch-up, a prompt's tail after a
    prefix-cache hit) is a row per token of the decode group, each over its context up to itself; a longer one, or
    one from position 0, is a prompt chunk."""
    from tokenmill.worker.batch import SHORT_CHUNK_MAX_TOKENS

    short = list(range(1, SHORT_CHUNK_MAX_TOKENS + 1))
    chunks = [
        chunk("dec", [50], start=5, blocks=[3, 7]),
        chunk("short", short, start=6, blocks=[1, 2, 9]),
        chunk("first", short, start=0, blocks=[4, 5]),
        chunk("long", short + [99], start=6, blocks=[6, 8, 10]),
    ]
    b = build(chunks)
    decode, prompts = b.attn_groups
    n = SHORT_CHUNK_MAX_TOKENS
    assert decode.token_index.flatten().tolist() == list(range(1 + n))  # the decode, then the short chunk's tokens
    assert decode.query_pos.flatten().tolist() == [5] + list(range(6, 6 + n))
    assert decode.block_table[1:].tolist() == [[1, 2, 9][: decode.block_table.shape[1]]] * n
    assert b.attn_groups[0].shared_prefix is None and b.attn_groups[0].tree_start is None
    assert prompts.token_index.shape == (2, n + 1)  # "long" and "first", longest first
    assert b.plain_decode_group() is None  # prompt chunks too: not a plain decode batch
    assert build(chunks[:2]).plain_decode_group() is not None


def test_mask_is_causal_over_the_requests_context():
    chunks = [chunk("a", [1, 2, 3, 4, 5], start=2, blocks=[1, 2]), chunk("b", [4, 5], start=0, blocks=[3])]
    b = build(chunks, block_size=4)
    (group,) = b.attn_groups
    mask = group.mask(4)
    assert mask.shape == (2, 1, 5, 8)
    for row, (start, q_len) in enumerate([(2, 5), (0, 2)]):
        for i in range(q_len):
            expected = [kv <= start + i for kv in range(8)]
            assert mask[row, 0, i].tolist() == expected
    window = group.mask(4, sliding_window=2)
    assert window[0, 0, 0].tolist() == [kv in (1, 2) for kv in range(8)]
    assert group.mask(4) is mask  # cached


def test_block_table_wider_than_needed_is_sliced_per_group():
    chunks = [chunk("long", [9], start=12, blocks=[1, 2, 3, 4]), chunk("short", [8], start=1, blocks=[5])]
    b = build(chunks, block_size=4)
    assert b.block_tables.tolist() == [[1, 2, 3, 4], [5, 0, 0, 0]]
    (group,) = b.attn_groups
    assert group.block_table.shape == (2, 4)
    assert b.slot_mapping.tolist() == [4 * 4 + 0, 5 * 4 + 1]


def test_prompt_chunks_of_very_different_lengths_are_not_padded_together():
    # A shared prefix computed once (40 tokens) next to short suffix chunks, and two decodes.
    chunks = [chunk("long", list(range(40)), 0, list(range(1, 11)))]
    chunks += [chunk(f"s{i}", [1, 2, 3, 4, 5, 6], 40, list(range(11 + 12 * i, 23 + 12 * i))) for i in range(5)]
    chunks += [chunk("d0", [7], 9, [90, 91, 92]), chunk("d1", [8], 2, [93])]
    batch = build(chunks)
    shapes = [tuple(g.token_index.shape) for g in batch.attn_groups]
    assert shapes == [(2, 1), (2, 40), (4, 6)]  # at most 2x padding: the long chunk takes one short one along
    covered = sorted(int(t) for g in batch.attn_groups for t in g.token_index.flatten() if t < batch.num_tokens)
    assert covered == list(range(batch.num_tokens))  # every token attended exactly once


def assert_same_decodes(moved: BatchInputs, want: BatchInputs):
    """A batch made with tensor ops holds what build_batch_inputs made: the same inputs and one decode group;
    returns that group."""
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices"):
        assert torch.equal(getattr(moved, name), getattr(want, name)), name
    assert moved.num_tokens == want.num_tokens
    (got,), (expected,) = moved.attn_groups, want.attn_groups
    for name in ("token_index", "block_table", "query_pos"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    return got


def test_next_decode_batch_is_the_batch_built_a_position_on():
    """A draft model's next pass: the same decodes one position further (one crossing into its next block),
    as build_batch_inputs makes it from the chunks; anything but plain decodes gets None."""
    from tokenmill.worker.batch import next_decode_batch

    decodes = [chunk("a", [50], start=3, blocks=[3, 7, 9]), chunk("b", [60], start=5, blocks=[6, 2]), chunk("c", [70], start=0, blocks=[5])]
    moved = next_decode_batch(build(decodes), torch.tensor([51, 61, 71]))
    want = build([chunk(c.request_id, [c.token_ids[0] + 1], c.start_pos + 1, c.block_ids) for c in decodes])
    got = assert_same_decodes(moved, want)
    assert got.decode_rows_and_positions()[1].tolist() == [4, 6, 1]
    assert moved.slot_rows(2, 40).tolist() == want.slot_rows(2, 40).tolist()
    assert next_decode_batch(build([chunk("p", [1, 2, 3, 4, 5, 6], start=0, blocks=[1, 2])]), torch.tensor([7])) is None


def test_next_rows_batch_is_the_built_batch_of_the_requests_kept():
    """An EAGLE head's next pass: after a pass of several rows per request (and one of a whole prompt's),
    one decode a position after each kept request's sampled row, as build_batch_inputs makes it."""
    from tokenmill.worker.batch import next_rows_batch

    passes = [chunk("a", [50, 51, 52], start=1, blocks=[3, 7, 9]), chunk("b", [60], start=7, blocks=[6, 2, 4]),
              chunk("c", [70, 71, 72, 73, 74, 75], start=0, blocks=[5, 8])]
    moved = next_rows_batch(build(passes), torch.tensor([0, 2]), torch.tensor([53, 76]))
    # a's next row crosses into its second block
    want = build([chunk("a", [53], start=4, blocks=[3, 7, 9]), chunk("c", [76], start=6, blocks=[5, 8, 0])])
    got = assert_same_decodes(moved, want)
    assert moved.plain_decode_group() is got


def _same_batch(a: BatchInputs, b: BatchInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.block_size, a.num_tokens, len(a.attn_groups)) == (b.block_size, b.num_tokens, len(b.attn_groups))
    for g, h in zip(a.attn_groups, b.attn_groups):
        for name in ("token_index", "block_table", "query_pos", "tree_start", "tree_mask"):
            x, y = getattr(g, name), getattr(h, name)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name
        assert g.from_start == h.from_start
        assert (g.shared_prefix is None) == (h.shared_prefix is None)
        if g.shared_prefix is not None:
            assert g.shared_prefix[0] == h.shared_prefix[0] and torch.equal(g.shared_prefix[1], h.shared_prefix[1])


def test_plain_decodes_take_the_short_path_to_the_same_batch():
    """A batch of plain decodes (the steady state) is built with fewer numpy calls: the same tensors as the
    general path's, for one request, requests of different block counts (one at a block's first slot, one
    at position 0), and the 16 requests over a shared 256-token prefix that cascade attention takes."""
    from tokenmill.worker.batch import _any_chunks

    cpu = torch.device("cpu")
    cases = [
        [chunk("a", [50], start=9, blocks=[3, 7, 9])],
        [chunk("a", [50], start=8, blocks=[3, 7, 9]), chunk("b", [60], start=5, blocks=[6, 2]), chunk("c", [70], start=0, blocks=[5])],
        [chunk(str(i), [i], start=256 + i, blocks=list(range(100, 164)) + [200 + i, 300 + i, 400 + i, 500 + i]) for i in range(16)],
    ]
    for chunks in cases:
        for cascade in (True, False):
            _same_batch(build_batch_inputs(chunks, 4, cpu, cascade), _any_chunks(chunks, 4, cpu, cascade))
    assert build_batch_inputs(cases[2], 4, cpu).attn_groups[0].shared_prefix is not None
