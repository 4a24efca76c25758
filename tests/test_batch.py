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
        chunk("part", [20, 21, 22], start=4, blocks=[4, 5], sample=False),  # middle chunk
        chunk("dec2", [60], start=0, blocks=[6]),  # one-token prompt
    ]
    b = build(chunks)
    assert b.num_tokens == 11
    assert b.input_ids.tolist() == [50, 10, 11, 12, 13, 14, 15, 20, 21, 22, 60]
    assert b.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 4, 5, 6, 0]
    assert b.query_start_loc.tolist() == [0, 1, 7, 10, 11]
    assert b.seq_lens.tolist() == [6, 6, 7, 1]
    assert b.block_tables.tolist() == [[3, 7], [1, 2], [4, 5], [6, 0]]
    # slot = block_id * block_size + offset
    assert b.slot_mapping.tolist() == [
        7 * 4 + 1,
        1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1,
        5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2,
        6 * 4 + 0,
    ]  # fmt: skip
    # Only chunks that sample give a logits row: their last token.
    assert b.logits_indices.tolist() == [0, 6, 10]

    decode, prefill = b.attn_groups
    assert decode.token_index.tolist() == [[0], [10]]
    assert decode.query_pos.tolist() == [[5], [0]]
    assert decode.block_table.tolist() == [[3, 7], [6, 0]]
    assert prefill.token_index.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 11, 11, 11]]  # padding -> scratch row 11
    assert prefill.query_pos[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert prefill.query_pos[1, :3].tolist() == [4, 5, 6]
    assert prefill.block_table.tolist() == [[1, 2], [4, 5]]


def test_mask_is_causal_over_the_requests_context():
    chunks = [chunk("a", [1, 2, 3], start=2, blocks=[1, 2]), chunk("b", [4, 5], start=0, blocks=[3])]
    b = build(chunks, block_size=4)
    (group,) = b.attn_groups
    mask = group.mask(4)
    assert mask.shape == (2, 1, 3, 8)
    for row, (start, q_len) in enumerate([(2, 3), (0, 2)]):
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
    chunks += [chunk(f"s{i}", [1, 2, 3], 40, list(range(11 + 11 * i, 22 + 11 * i))) for i in range(5)]
    chunks += [chunk("d0", [7], 9, [90, 91, 92]), chunk("d1", [8], 2, [93])]
    batch = build(chunks)
    shapes = [tuple(g.token_index.shape) for g in batch.attn_groups]
    assert shapes == [(2, 1), (2, 40), (4, 3)]  # at most 2x padding: the long chunk takes one short one along
    covered = sorted(int(t) for g in batch.attn_groups for t in g.token_index.flatten() if t < batch.num_tokens)
    assert covered == list(range(batch.num_tokens))  # every token attended exactly once
