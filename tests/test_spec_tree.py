"""Token trees (spec_decode/tree.py) with Medusa heads and EAGLE heads: the tree shapes and their checks, tree attention
on the PyTorch reference backend against plain masked attention, the kept path's rule, and greedy and
seeded decoding with trees giving exactly the tokens of decoding without speculation (batches mixing
speculating and plain requests, prompt chunks, preemption, prefix caching), with no KV blocks held after."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.kernels import cpu
from tokenmill.layers.attention import TorchPagedAttention
from tokenmill.layers.attention_metadata import AttentionGroup
from tokenmill.spec_decode.tree import TokenTree, confident_nodes, subtree_parents, tree_layout
from tokenmill.spec_decode.verify import kept_tree_rows

from test_medusa import heads_folder, model_dims, random_heads, target_lm_head
from test_spec_decode import assert_greedy_matches_plain_decoding, assert_mixed_batch_matches_plain_decoding, assert_no_blocks_held


def test_tree_shapes():
    tree = TokenTree.of_width(3, 2)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1))
    assert tree.parents() == [-1, -1, 0, 0, 2, 2] and tree.depth == 3
    assert tree.num_nodes_within(2) == 4  # a prefix of the nodes
    heads, ranks = tree.heads_and_ranks()
    assert heads.tolist() == [0, 0, 1, 1, 2, 2] and ranks.tolist() == [0, 1, 0, 1, 0, 1]
    depth, mask = tree_layout(np.array(tree.parents()), np.zeros(6, dtype=np.int64))
    assert depth.tolist() == [1, 1, 2, 2, 3, 3] and mask.tolist() == [0b1, 0b10, 0b101, 0b1001, 0b10101, 0b100101]
    assert TokenTree.of_width(3, 1).is_chain


def test_tree_config_errors():
    medusa = {"method": "medusa", "model": "heads"}
    assert SpeculativeConfig.from_dict({**medusa, "tree": [[0], [1], [0, 0]]}).num_speculative_tokens == 2  # the tree's depth
    assert SpeculativeConfig.from_dict({**medusa, "tree_width": 1}).token_tree() is None  # a chain
    eagle = SpeculativeConfig.from_dict({"method": "eagle", "model": "h", "tree": [[0], [1], [0, 0], [0, 2]]})
    assert eagle.token_tree().parents() == [-1, -1, 0, 0]
    for bad, message in [
        ({**medusa, "tree": [[0], [1, 0]]}, r"tree path \[1, 0\] has no parent: add \[1\]"),
        ({**medusa, "tree": [[0], [0]]}, r"lists path \[0\] twice"),
        ({**medusa, "tree": [[0], [-1]]}, "candidate ranks >= 0"),
        ({**medusa, "tree": []}, "non-empty list of paths"),
        ({**medusa, "tree": [[0], [0, 0]], "num_speculative_tokens": 3}, "the tree is 2 deep"),
        ({**medusa, "tree": [[0]], "tree_width": 2}, 'give "tree" or "tree_width", not both'),
        ({**medusa, "tree_width": 0}, "tree_width must be an integer >= 1"),
        ({**medusa, "tree_width": 30, "num_speculative_tokens": 3}, "<= 64"),
        ({"method": "ngram", "tree_width": 2}, '"tree" and "tree_width" belong to the medusa and eagle'),
        ({"method": "eagle", "model": "h", "tree": [[0], [1], [1, 0]]}, r"an eagle tree branches off the top-1 chain only"),
        ({"method": "eagle", "model": "h", "min_draft_probability": 1.0}, r"min_draft_probability must be a number in \[0, 1\)"),
        ({"method": "eagle", "model": "h", "stop_draft_probability": "0.5"}, "stop_draft_probability must be a number"),
        ({**medusa, "min_draft_probability": 0.1}, '"min_draft_probability" belongs to the eagle method'),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(bad)


def test_confident_nodes_are_a_tree_of_probable_paths():
    """confident_nodes keeps the nodes whose path the draft finds at least that probable, within the passes
    that ran; subtree_parents renumbers the parents among them."""
    tree = TokenTree.of_width(3, 2)  # [0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]
    node_pass, node_rank = tree.heads_and_ranks()
    probs = np.array([[0.8, 0.15], [0.5, 0.3], [0.9, 0.05]])  # per pass, its two candidates' probabilities
    # Paths: 0.8, 0.15, 0.4, 0.24, 0.36, 0.02.
    assert confident_nodes(node_pass, node_rank, probs, 0.1).tolist() == [True, True, True, True, True, False]
    assert confident_nodes(node_pass, node_rank, probs, 0.3).tolist() == [True, False, True, False, True, False]
    assert confident_nodes(node_pass, node_rank, probs[:2], 0.0).tolist() == [True] * 4 + [False] * 2  # pass 3 did not run
    assert not confident_nodes(node_pass, node_rank, probs, 0.9).any()
    keep = confident_nodes(node_pass, node_rank, probs, 0.2)  # [0], [0, 0], [0, 1], [0, 0, 0]
    assert subtree_parents(tree.parents(), keep) == [-1, 0, 0, 1]


def test_kept_path_is_the_longest_agreeing_one():
    tree = [10, 11, 20, 21, 30, 31]  # TokenTree.of_width(3, 2)'s nodes
    parents = [-1, -1, 0, 0, 2, 2]
    # Rows: the root, then one per node. The root samples 10 (node 0 kept), node 0's row samples 21 (node 3
    # kept), node 3's row samples 8 (no child): kept rows 0, 1, 4, tokens 10, 21, 8.
    sampled_a = [10, 21, 5, 5, 8, 5, 5]
    # A chain beside it (no parents): drafts 1, 2, 3, the model agrees with 1 and 2.
    sampled_b = [1, 2, 9, 9]
    # The root samples 11 (node 1, a leaf, kept), then 40 after it.
    sampled_c = [11, 5, 40, 5, 5, 5, 5]
    got = kept_tree_rows(np.array(sampled_a + sampled_b + sampled_c), [tree, [1, 2, 3], tree], [parents, [], parents])
    assert got == [[0, 1, 4], [0, 1, 2], [0, 2]]


def test_reference_backend_tree_attention_matches_masked_attention():
    """The PyTorch backend's decode path (the reference, and every non-CPU device's) with tree masks."""
    if not cpu.cpu_kernels_available():
        pytest.skip("the case is built with the kernels' write_kv")
    from test_kernel_shapes import tree_attention_case

    for window in (None, 30):
        i, want = tree_attention_case(torch.float32, 64, 3, window, seed=1)
        rows = i["token_rows"]
        group = AttentionGroup(token_index=rows[:, None], block_table=i["block_table"], query_pos=i["positions"][:, None],
                               tree_start=i["tree_start"], tree_mask=i["tree_mask"])
        out = torch.zeros(len(rows) + 1, *i["q"].shape[1:])
        TorchPagedAttention.decode(i["q"], i["k_cache"], i["v_cache"], group, out, i["scale"], window, None)
        torch.testing.assert_close(out[:-1], want, atol=1e-5, rtol=1e-5)


def tree_config(folder: str, **tree) -> dict:
    return {"method": "medusa", "model": folder, "disable_by_batch_size": None, **tree}


@pytest.mark.parametrize("model, shared, tree", [
    ("llama_gqa", False, {"tree_width": 3, "num_speculative_tokens": 3}),
    ("llama_gqa", True, {"tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0], [0, 0, 0, 0]]}),
    ("qwen2", True, {"tree_width": 2, "num_speculative_tokens": 3}),
    ("gpt2", False, {"tree_width": 2, "num_speculative_tokens": 2}),
])
def test_greedy_with_medusa_trees_equals_decoding_without(tiny_model_factory, tmp_path, model, shared, tree):
    folder = tiny_model_factory(model)
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, num_heads=4, lm_head=target_lm_head(folder), shared=shared))
    llm = assert_greedy_matches_plain_decoding(folder, tree_config(heads, **tree))
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    if model != "gpt2":  # (random heads on the tiny GPT-2 guess nothing right: only its outputs are checked)
        assert stats.num_accepted_tokens > 0
    assert_no_blocks_held(llm)


def assert_tree_mixed_batch_matches_plain_decoding(folder: str, speculative_config: dict, device: str = "cpu"):
    """The shared mixed-batch check (prompt chunks, trees cut short, preemption) with one more request that
    cannot speculate (max_tokens 1), and room for a tree's slots."""
    return assert_mixed_batch_matches_plain_decoding(folder, speculative_config, num_prompts=8, device=device,
                                                     extra=[SamplingParams(max_tokens=1, temperature=0.0)], num_kv_blocks=18)


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_trees_with_sampling_chunks_preemption_and_prefix_caching(tiny_model_factory, tmp_path, shared):
    folder = tiny_model_factory("llama_gqa")
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, num_heads=4, lm_head=target_lm_head(folder), shared=shared))
    reference, llm, outputs = assert_tree_mixed_batch_matches_plain_decoding(
        folder, tree_config(heads, tree_width=3, num_speculative_tokens=3))
    for ref, out in zip(reference, outputs):  # each kept token's logprobs are its own row's
        if ref.outputs[0].logprobs is not None:
            for want, got in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
                assert list(got) == list(want)
                assert [g.logprob for g in got.values()] == pytest.approx([w.logprob for w in want.values()], abs=1e-4)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert len(stats.accepted_per_pos) == 3  # per depth, not per node


@pytest.mark.parametrize("tree", [{"tree_width": 3, "num_speculative_tokens": 3}, {"tree": [[0], [1], [0, 0], [0, 1], [0, 2], [0, 0, 0]]}])
def test_eagle_trees_with_sampling_chunks_preemption_and_prefix_caching(tiny_model_factory, tmp_path, tree):
    """An EAGLE head drafting trees (the top-1 chain and candidates beside it) in the Medusa test's mixed batch."""
    from test_eagle import eagle_config, head_folder, random_head

    folder = tiny_model_factory("llama_gqa")
    assert_tree_mixed_batch_matches_plain_decoding(folder, {**eagle_config(head_folder(tmp_path, random_head(folder))), **tree})


@pytest.mark.slow
def test_medusa_trees_under_tensor_parallelism(tiny_model_factory, tmp_path):
    """The kept path's KV moves on every rank (rank 0 announces the move): outputs as without speculation."""
    folder = tiny_model_factory("llama_gqa")
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, lm_head=target_lm_head(folder), shared=True))
    llm = assert_greedy_matches_plain_decoding(folder, tree_config(heads, tree_width=3, num_speculative_tokens=3), num_prompts=4,
                                               seed=5, max_tokens=16, tensor_parallel_size=2)
    try:
        assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0
    finally:
        llm.llm_engine.shutdown()
