"""Medusa heads as a proposer: the FasterDecoding checkpoint layout loads (safetensors or .pt), the heads'
drafts come from the hidden state of the row that sampled each request's newest token, and decoding with
them gives exactly what decoding without speculation gives (greedy and seeded sampling, with prompt
chunks, preemption, prefix caching, n > 1 and tensor parallelism)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.engine.messages import DRAFT_PLACEHOLDER, ScheduledChunk
from tokenmill.errors import ModelLoadError
from tokenmill.loader.medusa import load_medusa_heads, save_medusa_heads
from tokenmill.models.medusa import MedusaHeads
from tokenmill.worker.medusa_proposer import MedusaProposer

from conftest import smollm2_gguf_path
from test_spec_decode import (assert_greedy_matches_plain_decoding, assert_mixed_batch_matches_plain_decoding,
                              assert_no_blocks_held, assert_same_outputs, tiny_llm, token_prompts)


def random_heads(hidden: int, vocab: int, num_heads: int = 3, num_layers: int = 1, seed: int = 0, lm_head=None,
                 shared: bool = False) -> MedusaHeads:
    """Heads with random blocks; with lm_head (the target's), each head starts as the target's own head,
    as Medusa's training does (so on a model that repeats itself its guesses are sometimes right).
    shared: heads that use the target's LM head (no weights of their own for it)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, shared_lm_head=shared)
    with torch.no_grad():
        for head in heads.heads:
            if lm_head is not None and head.lm_head is not None:
                head.lm_head.weight.copy_(lm_head)
            for block in head.blocks:
                block.weight.mul_(0.1)
    return heads


def heads_folder(tmp_path, heads: MedusaHeads, fmt: str = "safetensors") -> str:
    path = str(tmp_path / f"medusa-{fmt}")
    save_medusa_heads(heads, path, base_model="tiny")
    if fmt == "pt":  # FasterDecoding's own format: a torch state dict
        from safetensors.torch import load_file

        torch.save(load_file(os.path.join(path, "medusa_lm_head.safetensors")), os.path.join(path, "medusa_lm_head.pt"))
        os.remove(os.path.join(path, "medusa_lm_head.safetensors"))
    return path


def target_lm_head(folder: str) -> torch.Tensor:
    from safetensors.torch import load_file

    state = load_file(os.path.join(folder, "model.safetensors"))
    return state.get("lm_head.weight", state.get("model.embed_tokens.weight"))


def model_dims(folder: str) -> tuple[int, int]:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("hidden_size", config.get("n_embd")), config["vocab_size"]


# -- loading ----------------------------------------------------------------------------------------


def test_shared_heads_round_trip_without_lm_head_weights(tmp_path):
    heads = random_heads(16, 40, num_heads=2, shared=True)
    folder = heads_folder(tmp_path, heads)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["medusa_lm_head"] == "shared"
    loaded = load_medusa_heads(folder, 16, 40, torch.device("cpu"), torch.float32)
    assert loaded.shared_lm_head and set(heads.medusa_state_dict()) == {"0.0.linear.weight", "0.0.linear.bias",
                                                                        "1.0.linear.weight", "1.0.linear.bias"}
    x = torch.randn(5, 16)
    assert torch.equal(loaded.transform(x, 2), heads.transform(x, 2))


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_heads_round_trip_through_fasterdecoding_layout(tmp_path, fmt):
    heads = random_heads(16, 40, num_heads=2, num_layers=2)
    loaded = load_medusa_heads(heads_folder(tmp_path, heads, fmt), 16, 40, torch.device("cpu"), torch.float32)
    assert set(heads.medusa_state_dict()) == {"0.0.linear.weight", "0.0.linear.bias", "0.1.linear.weight", "0.1.linear.bias",
                                              "0.2.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.linear.weight",
                                              "1.1.linear.bias", "1.2.weight"}
    x = torch.randn(5, 16)
    assert torch.equal(loaded.propose(x, 2), heads.propose(x, 2))


def test_heads_for_another_model_are_a_clear_error(tmp_path):
    folder = heads_folder(tmp_path, random_heads(16, 40))
    with pytest.raises(ModelLoadError, match=r"has shape \(40, 16\), expected \(50, 16\).*50 tokens"):
        load_medusa_heads(folder, 16, 50, torch.device("cpu"), torch.float32)
    with pytest.raises(ModelLoadError, match="not a Medusa heads folder"):
        load_medusa_heads(str(tmp_path), 16, 40, torch.device("cpu"), torch.float32)


# -- the proposer's bookkeeping ---------------------------------------------------------------------


class RowHeads(torch.nn.Module):
    """Stands in for MedusaHeads: row r of the hidden states proposes [r[0], r[0] + 1, ...]."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = [None] * 4
        self.scale = torch.nn.Parameter(torch.ones(1))

    def propose(self, hidden: torch.Tensor, k: int, width: int = 1) -> torch.Tensor:
        """[rows, k, width]: head h's rank-r candidate is r[0] + h + 100 r."""
        return hidden[:, :1, None].long() + torch.arange(k)[:, None] + 100 * torch.arange(width)


def chunk(request_id: str, token_ids: list[int], start_pos: int, k: int = 0, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(request_id, token_ids + [DRAFT_PLACEHOLDER] * k, start_pos, [1], sample, SamplingParams(), 0, 0,
                          spec_token_ids=[DRAFT_PLACEHOLDER] * k)


def test_drafts_come_from_the_row_that_sampled_the_newest_token():
    proposer = MedusaProposer(RowHeads(), num_speculative_tokens=2)
    # A prompt chunk (rows 0-3, sampled one token), a decode with 2 drafts of which 1 kept (rows 4-6), a
    # chunk that did not sample (rows 7-8).
    chunks = [chunk("a", [1, 2, 3, 4], 0), chunk("b", [9], 20, k=2), chunk("c", [5, 5], 0, sample=False)]
    chunks[1].spec_token_ids[:] = [7, 8]
    hidden = torch.arange(9, dtype=torch.float32)[:, None] * 10
    proposer.observe(chunks, hidden, [[50], [7, 33], []])
    # a: its token came from row 3 (position 3), so its next step's last token is at position 4.
    # b: draft 7 kept, then 33 sampled at row 5 (position 21), so its last token is at position 22.
    assert {r: (p, d.tolist()) for r, (p, d) in proposer._drafts.items()} == {"a": (4, [[30], [31]]), "b": (22, [[50], [51]])}
    step = [chunk("a", [50], 4, k=2), chunk("b", [33], 22, k=1), chunk("d", [4], 9, k=2)]
    proposer.fill(step)
    assert [c.spec_token_ids for c in step] == [[30, 31], [50], [4, 4]]  # d: unknown, its last token repeated
    assert [c.token_ids for c in step] == [[50, 30, 31], [33, 50], [4, 4, 4]]
    proposer.forget(["a"])
    proposer.keep_only(["a", "c"])
    assert proposer._drafts == {}


def test_more_drafts_than_heads_is_an_error():
    with pytest.raises(ValueError, match="num_speculative_tokens 4 is more than the 3 Medusa heads"):
        MedusaProposer(random_heads(8, 16, num_heads=3), 4)


# -- end to end ---------------------------------------------------------------------------------------


def medusa_config(folder: str, k: int = 3) -> dict:
    return {"method": "medusa", "model": folder, "num_speculative_tokens": k, "disable_by_batch_size": None}


@pytest.mark.parametrize("model, shared", [("llama_gqa", False), ("qwen2", False), ("gpt2", False), ("llama_gqa", True), ("gpt2", True)])
def test_greedy_with_medusa_equals_decoding_without(tiny_model_factory, tmp_path, model, shared):
    folder = tiny_model_factory(model)
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, lm_head=target_lm_head(folder), shared=shared))
    llm = assert_greedy_matches_plain_decoding(folder, medusa_config(heads))
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_with_sampling_chunks_preemption_and_prefix_caching(tiny_model_factory, tmp_path, shared):
    """Seeded sampling (n > 1 too) and greedy requests, a small token budget (prompts chunked) and a KV cache
    too small for the batch (preemption): the outputs of decoding without speculation."""
    folder = tiny_model_factory("llama_gqa")
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, num_heads=4, lm_head=target_lm_head(folder), shared=shared))
    assert_mixed_batch_matches_plain_decoding(folder, medusa_config(heads, k=4))


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_under_tensor_parallelism(tiny_model_factory, tmp_path, shared):
    """The heads live on rank 0 (which alone samples) and read its full hidden states; shared heads' rows
    go to every rank for the vocabulary-parallel LM head."""
    folder = tiny_model_factory("llama_gqa")
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, lm_head=target_lm_head(folder), shared=shared))
    llm = assert_greedy_matches_plain_decoding(folder, medusa_config(heads), num_prompts=4, seed=5, max_tokens=16, tensor_parallel_size=2)
    try:
        assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0
    finally:
        llm.llm_engine.shutdown()


def test_medusa_config_errors():
    from tokenmill.config import SpeculativeConfig

    with pytest.raises(ValueError, match='"medusa" needs "model"'):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match='"quantization" belongs to the draft_model and eagle methods, not "medusa"'):
        SpeculativeConfig(method="medusa", model="x", quantization="int8")


# -- training -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False])
def test_trained_heads_are_accepted_and_change_nothing(tiny_model_factory, tmp_path, shared):
    """train_medusa_heads on the tiny model's own greedy continuations (heads that learn those sequences):
    decoding the same prompts with them keeps most drafts, and gives exactly the tokens of plain decoding."""
    from tokenmill.loader.medusa import save_medusa_heads
    from tokenmill.training.medusa import MedusaTrainingConfig, train_medusa_heads

    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(7, seed=6)
    # Two prompts share their first 32 tokens: a prefix-cache hit may skip them (positions never needed).
    prompts.append({"prompt_token_ids": [7] * 32 + [1, 2]})
    prompts[0] = {"prompt_token_ids": [7] * 32 + [3]}
    config = MedusaTrainingConfig(num_heads=2, max_tokens=24, epochs=60, batch_size=64, lr=3e-3, held_out=0.0, shared_lm_head=shared)
    heads, report = train_medusa_heads(tiny_llm(folder), prompts, config, use_tqdm=False)
    assert report.num_sequences == 8 and report.num_positions == 8 * 23  # t from the last prompt token to 3 before the end
    save_medusa_heads(heads, str(tmp_path / "heads"), base_model=folder)

    params = SamplingParams(max_tokens=24, temperature=0.0)
    reference = tiny_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=medusa_config(str(tmp_path / "heads"), k=2))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats
    assert stats.accepted_per_pos[1] > 0  # the second head's drafts are kept too
    assert_no_blocks_held(llm)


def test_train_medusa_command_line(tmp_path, capsys, tiny_model_factory):
    """Bad flags are one-line errors, before any model loads (the README's SmolLM2 run is the real thing)."""
    from tokenmill.entrypoints.cli import main

    assert main(["train-medusa", "--output", str(tmp_path / "h"), "--num-heads", "0"]) == 2
    assert "--num-heads must be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs the embedded SmolLM2 model")
def test_chat_dataset_holds_out_the_training_prompts():
    from tokenmill.bench.datasets import CHAT_TRAIN_PROMPTS, chat_dataset, chat_prompt_lines
    from tokenmill.loader import load_model_source
    from tokenmill.config import ModelConfig
    from tokenmill.training.medusa import chat_prompts

    tokenizer = load_model_source(ModelConfig(model=smollm2_gguf_path())).tokenizer
    lines = chat_prompt_lines()
    assert len(lines) > CHAT_TRAIN_PROMPTS + 16
    requests = chat_dataset(tokenizer, 3, 50, seed=1)
    assert [lines[CHAT_TRAIN_PROMPTS + 1] in r.prompt for r in requests] == [True, False, False]
    assert all("<|im_start|>assistant" in r.prompt and r.output_len == 50 for r in requests)
    training = chat_prompts(tokenizer, count=CHAT_TRAIN_PROMPTS)
    assert len(training) == CHAT_TRAIN_PROMPTS and not any(lines[CHAT_TRAIN_PROMPTS] in p["prompt"] for p in training)
