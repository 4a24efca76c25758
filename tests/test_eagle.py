"""EAGLE draft heads as a proposer: EAGLE-1/2's checkpoint layout loads (and other layouts are clear
errors), tokenmill's paged draft layer computes what the plain-PyTorch head computes, and decoding with
a head (random or briefly trained) gives exactly what decoding without speculation gives (greedy and
seeded sampling, mixed with requests that do not speculate, prompt chunks, preemption, prefix caching)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.engine.messages import ScheduledChunk
from tokenmill.errors import ModelLoadError
from tokenmill.loader.eagle import load_eagle_head, save_eagle_head
from tokenmill.training.eagle import EagleTrainingHead, causal_mask, eagle_layers_config
from tokenmill.worker.batch import build_batch_inputs
from tokenmill.worker.model_runner import ModelRunner

from test_spec_decode import (assert_greedy_matches_plain_decoding, assert_mixed_batch_matches_plain_decoding,
                              assert_no_blocks_held, assert_same_outputs, tiny_llm, token_prompts)


def hf_config(folder: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def random_head(folder: str, seed: int = 0, num_layers: int = 1) -> EagleTrainingHead:
    torch.manual_seed(seed)
    return EagleTrainingHead(eagle_layers_config(hf_config(folder), num_layers)).eval()


def head_folder(tmp_path, head: EagleTrainingHead, fmt: str = "safetensors", name: str = "eagle") -> str:
    path = str(tmp_path / name)
    save_eagle_head(head.eagle_state_dict(), head.eagle_config(), path)
    if fmt == "bin":  # EAGLE's own releases: pytorch_model.bin
        from safetensors.torch import load_file

        state = load_file(os.path.join(path, "model.safetensors"))
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        os.remove(os.path.join(path, "model.safetensors"))
    return path


def eagle_config(folder: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": folder, "num_speculative_tokens": k, "disable_by_batch_size": None}


# -- loading ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, num_layers", [("safetensors", 1), ("bin", 1), ("safetensors", 2)])
def test_paged_draft_layers_compute_what_the_plain_head_computes(tiny_model_factory, tmp_path, fmt, num_layers):
    """A head saved under EAGLE's names loads, and tokenmill's layers over the paged KV cache (a prompt in
    two chunks, then one row) give the plain head's outputs at float32."""
    folder = tiny_model_factory("llama_gqa")
    head = random_head(folder, num_layers=num_layers)
    config = hf_config(folder)
    draft = load_eagle_head(head_folder(tmp_path, head, fmt), config, torch.device("cpu"), torch.float32, 256)
    runner = ModelRunner(draft, torch.device("cpu"), torch.float32, block_size=4)
    runner.allocate_kv_cache(16)
    torch.manual_seed(1)
    n, hidden = 11, config.hidden_size
    embeds, states = torch.randn(n, hidden), torch.randn(n, hidden)
    with torch.no_grad():
        expected = head(embeds[None], states[None], torch.arange(n)[None])[0]
        got = []
        for lo, hi in ((0, 6), (6, 10), (10, 11)):
            chunk = ScheduledChunk("r", list(range(lo, hi)), lo, [3, 5, 7], True, SamplingParams(), 0, 0)
            batch = build_batch_inputs([chunk], 4, torch.device("cpu"))
            got.append(draft(embeds[lo:hi], states[lo:hi], batch.positions, batch))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_block_diagonal_mask_keeps_sequences_apart():
    mask = causal_mask(torch.tensor([[0, 0, 1, 1]]), torch.float32)[0, 0]
    assert (mask == 0).tolist() == [[True, False, False, False], [True, True, False, False],
                                    [False, False, True, False], [False, False, True, True]]


def test_unconfident_nodes_leave_the_chunk():
    """EagleProposer._write_kept: the kept nodes' drafts in the reserved places, the others gone from
    token_ids, spec_token_ids and spec_parents (renumbered); a tree cut to its chain is a chain; none kept
    leaves a plain decode."""
    from tokenmill.engine.messages import DRAFT_PLACEHOLDER
    from tokenmill.worker.eagle_proposer import EagleProposer

    def chunk(parents):
        k = len(parents) or 3
        return ScheduledChunk("r", [5] + [DRAFT_PLACEHOLDER] * k, 9, [0, 1, 2, 3], True, SamplingParams(), 0, 0,
                              spec_token_ids=[DRAFT_PLACEHOLDER] * k, spec_parents=list(parents))

    tree = chunk([-1, -1, 0, 0])  # [0], [1], [0, 0], [0, 1]
    EagleProposer._write_kept(tree, [10, 20, 21], np.array([True, False, True, True]))
    assert (tree.token_ids, tree.spec_token_ids, tree.spec_parents) == ([5, 10, 20, 21], [10, 20, 21], [-1, 0, 0])
    to_chain = chunk([-1, -1, 0, 0])
    EagleProposer._write_kept(to_chain, [10, 20], np.array([True, False, True, False]))
    assert (to_chain.token_ids, to_chain.spec_token_ids, to_chain.spec_parents) == ([5, 10, 20], [10, 20], [])
    chain = chunk([])
    EagleProposer._write_kept(chain, [10], np.array([True, False, False]))
    assert (chain.token_ids, chain.spec_token_ids, chain.spec_parents) == ([5, 10], [10], [])
    none = chunk([-1, -1, 0, 0])
    EagleProposer._write_kept(none, [], np.zeros(4, dtype=bool))
    assert (none.token_ids, none.spec_token_ids, none.spec_parents) == ([5], [], [])


def test_other_layouts_are_clear_errors(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("llama_gqa")
    config, cpu = hf_config(folder), torch.device("cpu")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_eagle_head(str(tmp_path), config, cpu, torch.float32, 64)
    head = random_head(folder)
    path = head_folder(tmp_path, head)
    eagle3 = {"midlayer.self_attn.q_proj.weight": torch.zeros(2, 2), "fc.weight": torch.zeros(2, 6), "d2t": torch.zeros(3)}
    save_eagle_head(eagle3, head.eagle_config(), str(tmp_path / "e3"))
    with pytest.raises(ModelLoadError, match="EAGLE-3 draft head"):
        load_eagle_head(str(tmp_path / "e3"), config, cpu, torch.float32, 64)
    save_eagle_head({"0.0.linear.weight": torch.zeros(2, 2)}, {"medusa_num_heads": 1}, str(tmp_path / "medusa"))
    with pytest.raises(ModelLoadError, match="not an EAGLE-1/2 draft head: it needs fc.weight"):
        load_eagle_head(str(tmp_path / "medusa"), config, cpu, torch.float32, 64)
    config.hidden_size = 2 * config.hidden_size
    with pytest.raises(ModelLoadError, match="a head for another model"):
        load_eagle_head(path, config, cpu, torch.float32, 64)
    config.hidden_size //= 2
    state = head.eagle_state_dict()
    del state["layers.0.mlp.down_proj.weight"]
    save_eagle_head(state, head.eagle_config(), str(tmp_path / "partial"))
    with pytest.raises(ModelLoadError, match="lacks 1 weights the model needs: layers.0.mlp.down_proj.weight"):
        load_eagle_head(str(tmp_path / "partial"), config, cpu, torch.float32, 64)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1


def test_eagle_config_errors(tiny_model_factory, tmp_path):
    from tokenmill.config import SpeculativeConfig

    with pytest.raises(ValueError, match='"eagle" needs "model"'):
        SpeculativeConfig(method="eagle")
    for quantization, options in (("int4", None), ("w8a8", None), ("int8", {"group_size": 32})):
        with pytest.raises(ValueError, match='"quantization" of an EAGLE head is "int8"'):
            SpeculativeConfig(method="eagle", model="x", quantization=quantization, quantization_options=options)
    gpt2 = tiny_model_factory("gpt2")
    with pytest.raises(ValueError, match="needs a Llama-family model"):
        tiny_llm(gpt2, speculative_config=eagle_config(head_folder(tmp_path, random_head(tiny_model_factory("llama_gqa")))))


# -- end to end ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama_gqa", "llama_mqa_tied", "qwen2"])
def test_greedy_with_eagle_equals_decoding_without(tiny_model_factory, tmp_path, model):
    folder = tiny_model_factory(model)
    llm = assert_greedy_matches_plain_decoding(folder, eagle_config(head_folder(tmp_path, random_head(folder))))
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0
    assert_no_blocks_held(llm)


def test_eagle_with_sampling_chunks_preemption_and_prefix_caching(tiny_model_factory, tmp_path):
    """Seeded sampling (n > 1 too), greedy requests with logprobs, a small token budget (prompts
    chunked) and a KV cache too small for the batch (preemption): the outputs of decoding without speculation."""
    folder = tiny_model_factory("llama_gqa")
    heads = head_folder(tmp_path, random_head(folder, num_layers=2))
    assert_mixed_batch_matches_plain_decoding(folder, eagle_config(heads, k=4))


# -- training -----------------------------------------------------------------------------------------


def test_trained_head_is_accepted_and_changes_nothing(tiny_model_factory, tmp_path):
    """train_eagle_head on the tiny model's own greedy continuations (drafts from a 200-token draft
    vocabulary): decoding the same prompts with the head keeps most first drafts (chained ones too), and
    gives exactly the tokens of plain decoding, mixed with a request that does not speculate (max_tokens 1)."""
    from tokenmill.training.eagle import EagleTrainingConfig, train_eagle_head

    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(8, seed=6)
    prompts[0] = {"prompt_token_ids": [7] * 32 + [3]}
    prompts.append({"prompt_token_ids": [7] * 32 + [1, 2]})  # shares 32 tokens: a prefix-cache hit skips them
    config = EagleTrainingConfig(max_tokens=24, epochs=40, tokens_per_step=512, lr=1e-2, held_out=0.0, noise=0.0,
                                 token_loss_weight=1.0, draft_vocab=200, extra_samples=0)
    head, report = train_eagle_head(tiny_llm(folder), prompts, config, use_tqdm=False)
    assert report.num_sequences == 9 and report.losses[-1] < report.losses[0] / 3
    path = head_folder(tmp_path, head)
    draft = load_eagle_head(path, hf_config(folder), torch.device("cpu"), torch.float32, 64)
    assert draft.draft_vocab.tolist() == head.draft_vocab.tolist() and len(draft.draft_vocab) == 200

    params = [SamplingParams(max_tokens=24, temperature=0.0)] * 8 + [SamplingParams(max_tokens=1, temperature=0.0)]
    reference = tiny_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=eagle_config(path, k=3))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.accepted_per_pos[0] > 0.6 * stats.num_drafts, stats  # the first draft is mostly right
    assert llm.llm_engine.executor.worker.drafter.draft.decode_steps is not None  # its passes took the decode program
    assert stats.accepted_per_pos[1] > 0  # and chained drafts are kept too
    assert_no_blocks_held(llm)

    # A token tree (the top-1 chain and two more candidates beside it at each depth): the same outputs, and
    # the kept paths (some through a second candidate) keep the draft's rows right for the next steps.
    tree = tiny_llm(folder, speculative_config={**eagle_config(path, k=3), "tree_width": 3})
    assert_same_outputs(reference, tree.generate(prompts, params, use_tqdm=False))
    tree_stats = tree.llm_engine.stats().spec_decode
    assert tree_stats.num_accepted_tokens >= stats.num_accepted_tokens and tree_stats.accepted_per_pos[2] > 0, tree_stats
    assert_no_blocks_held(tree)

    # The same tree verified only where the draft is confident: per request and step, fewer nodes (some
    # steps a chain, some none), fewer passes, still the same outputs.
    confident = {**eagle_config(path, k=3), "tree_width": 3, "min_draft_probability": 0.3, "stop_draft_probability": 0.6}
    llm = tiny_llm(folder, speculative_config=confident)
    assert_same_outputs(reference, llm.generate(prompts, params, use_tqdm=False))
    confident_stats = llm.llm_engine.stats().spec_decode
    assert 0 < confident_stats.num_draft_tokens < tree_stats.num_draft_tokens and confident_stats.num_accepted_tokens > 0, confident_stats
    assert_no_blocks_held(llm)
    # Seeded sampling, n > 1, chunked prompts and preemption with it: the outputs of decoding without speculation.
    assert_mixed_batch_matches_plain_decoding(folder, confident)

    # The head in int8 (its layers and draft-vocabulary rows): the same outputs, its first drafts still mostly kept.
    llm = tiny_llm(folder, speculative_config={**eagle_config(path, k=3), "quantization": "int8"})
    assert_same_outputs(reference, llm.generate(prompts, params, use_tqdm=False))
    int8_stats = llm.llm_engine.stats().spec_decode
    assert int8_stats.accepted_per_pos[0] > 0.6 * int8_stats.num_drafts, int8_stats
    head = llm.llm_engine.executor.worker.drafter.draft
    assert head.quantization == "int8" and head.fc.qweight.dtype == torch.int8
    assert_no_blocks_held(llm)


def test_labels_are_the_targets_most_likely_tokens():
    """set_labels: a row's label is the argmax of the LM head at the next state (what a greedy target keeps),
    not the token the generation sampled there, computed a few rows at a time across sequences."""
    from tokenmill.training.eagle import _Sequence, set_labels

    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(50, 8, generator=gen)
    sequences = [_Sequence(torch.randn(n + 1, 8, generator=gen), torch.zeros(n + 2, dtype=torch.int64), 0) for n in (3, 1, 6)]
    set_labels(sequences, lm_head, fast_bf16=False, rows_per_matmul=4)
    for seq in sequences:
        assert seq.labels.tolist() == (seq.states[1:] @ lm_head.T).argmax(-1).tolist()


def test_learning_rate_warms_up_then_decays_to_its_floor():
    from tokenmill.training.eagle import EagleTrainingConfig, lr_factor

    config = EagleTrainingConfig(warmup_frac=0.1, min_lr_frac=0.1)
    factors = [lr_factor(step, 100, config) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)  # 10 warm-up steps
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))  # then it only falls
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_extra_samples_add_sampled_continuations(tiny_model_factory):
    """extra_samples=2: each prompt is answered three times (greedy, then two seeded samples), so the head
    trains on three sequences per prompt."""
    from tokenmill.training.eagle import EagleTrainingConfig, train_eagle_head

    config = EagleTrainingConfig(max_tokens=8, epochs=1, held_out=0.0, extra_samples=2, draft_vocab=0)
    _, report = train_eagle_head(tiny_llm(tiny_model_factory("llama_gqa")), token_prompts(3, seed=2), config, use_tqdm=False)
    assert report.num_sequences == 9
    assert report.num_self_prompts == 0  # no chat template to write prompts with (self_prompts=384 by default): skipped


def test_the_model_writes_its_own_prompts():
    """self_written_prompts on SmolLM2: user messages sampled from its chat template's user turn, each ended by
    the model within the token limit, distinct, seeded, and returned in the chat template as prompts."""
    from conftest import smollm2_gguf_path
    from tokenmill import LLM
    from tokenmill.training.selfdistill import self_written_prompts

    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed")
    llm = LLM(smollm2_gguf_path(), kv_cache_memory=64 << 20, dtype="float32")
    prompts = self_written_prompts(llm, 6, seed=3, max_tokens=48)
    assert 3 <= len(prompts) <= 6
    texts = [p["prompt"] for p in prompts]
    assert len(set(texts)) == len(texts)
    tokenizer = llm.get_tokenizer()
    for prompt in prompts:
        message = prompt["prompt"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert message.strip() and len(tokenizer.encode(message, add_special_tokens=False)) <= 48
        assert prompt["prompt"].endswith("<|im_start|>assistant\n")
        assert prompt["prompt_token_ids"] == tokenizer.encode(prompt["prompt"], add_special_tokens=False)
    assert self_written_prompts(llm, 6, seed=3, max_tokens=48) == prompts


def test_train_eagle_command_line(tmp_path, capsys):
    """Bad flags are one-line errors, before any model loads (the README's SmolLM2 run is the real thing)."""
    from tokenmill.entrypoints.cli import main

    assert main(["train-eagle", "--output", str(tmp_path / "h"), "--num-layers", "0"]) == 2
    assert "--num-layers must be at least 1" in capsys.readouterr().err
