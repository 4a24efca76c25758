"""Speculative decoding: the ngram proposer, the keep rule, and the engine with drafts in its steps.

The engine tests swap the proposer for an oracle that knows what decoding without speculation
produces (same prompts, same seeds) and corrupts some of its guesses on purpose, so every step
mixes kept and rejected drafts; the outputs must be token for token those of decoding without
speculation, whatever else is in the batch (prompt chunks, preemption, n > 1, logprobs, penalties).
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.spec_decode.metrics import SpecDecodeStats
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.verify import draft_rows, num_kept

from conftest import smollm2_gguf_path

# -- the ngram proposer ---------------------------------------------------------------------------------


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    proposer = NgramProposer(min_n=1, max_n=3, num_speculative_tokens=3)
    # The suffix [7, 8, 9] occurred at 0..2 (followed by 1, 2, 3); [8, 9] alone also at 5..6 (followed by 4).
    assert proposer.propose(ids(7, 8, 9, 1, 2, 3, 8, 9, 4, 0, 7, 8, 9)) == [1, 2, 3]


def test_ngram_takes_the_latest_of_equally_long_matches():
    proposer = NgramProposer(min_n=2, max_n=2, num_speculative_tokens=2)
    assert proposer.propose(ids(5, 6, 1, 1, 5, 6, 2, 2, 5, 6)) == [2, 2]


def test_ngram_needs_min_n_tokens_of_match_and_stops_at_the_sequence_end():
    proposer = NgramProposer(min_n=2, max_n=4, num_speculative_tokens=5)
    assert proposer.propose(ids(3, 4, 9, 9, 4)) == []  # only a 1-token match of [4]
    assert proposer.propose(ids(1, 2, 3, 1, 2)) == [3, 1, 2]  # fewer than 5 tokens follow the match
    assert proposer.propose(ids(1, 2)) == []
    assert proposer.propose(ids(1, 2, 3, 1, 2), max_tokens=1) == [3]
    assert proposer.propose(ids(1, 2, 3, 1, 2), max_tokens=0) == []


def test_ngram_repeated_token():
    assert NgramProposer(1, 3, 4).propose(ids(5, 5, 5, 5)) == [5]  # the latest earlier match ends just before the last token


# -- the keep rule --------------------------------------------------------------------------------------


def test_num_kept_counts_leading_agreement_plus_one():
    drafts = [[4, 5, 6], [], [7, 8]]
    rows = draft_rows(drafts)
    assert rows.tolist() == [4, 5, 6, -1, -1, 7, 8, -1]
    sampled = np.array([4, 5, 9, 1, 3, 0, 8, 2])  # chunk 0 keeps 4, 5 then 9; chunk 1 one token; chunk 2 differs at once
    assert num_kept(sampled, rows, np.array([4, 1, 3])).tolist() == [3, 1, 1]
    all_kept = np.array([4, 5, 6, 1, 3, 7, 8, 2])
    assert num_kept(all_kept, rows, np.array([4, 1, 3])).tolist() == [4, 1, 3]


def test_spec_stats_per_position():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    stats.record(3, 3)
    assert stats.accepted_per_pos == [2, 2, 1]
    assert stats.num_draft_tokens == 8 and stats.num_accepted_tokens == 5
    assert stats.mean_accepted_length == pytest.approx(1 + 5 / 3)


# -- configuration --------------------------------------------------------------------------------------


def test_speculative_config_errors_name_what_is_supported():
    with pytest.raises(ValueError, match="unknown speculative method 'nope'; supported: ngram, draft_model, medusa, eagle"):
        SpeculativeConfig(method="nope")
    with pytest.raises(ValueError, match="'eagle3' is not supported yet; supported: ngram, draft_model, medusa, eagle"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) \['k'\]"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3})
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=5)


# -- the engine with drafts: an oracle that is right, except where it is told to be wrong ----------------


class OracleProposer:
    """Proposes the tokens decoding without speculation produced for the same prompt (and sequence),
    with each guess corrupted with probability `wrong`, so steps keep some drafts and reject others."""

    def __init__(self, futures: dict[tuple[int, ...], list[list[int]]], k: int, wrong: float, vocab: int, seed: int = 0) -> None:
        self.futures = futures
        self.k = k
        self.wrong = wrong
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        tokens = token_ids.tolist()
        for prompt, outputs in self.futures.items():
            if tuple(tokens[: len(prompt)]) != prompt:
                continue
            done = tokens[len(prompt) :]
            for output in outputs:  # n > 1: the sequence whose tokens so far match
                if output[: len(done)] == done:
                    guess = output[len(done) : len(done) + min(self.k, max_tokens or self.k)]
                    return [self.rng.randrange(self.vocab) if self.rng.random() < self.wrong else t for t in guess]
        return []


def tiny_llm(folder: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 8 << 20)
    kwargs.setdefault("device", "cpu")
    return LLM(folder, dtype="float32", skip_tokenizer_init=True, **kwargs)


def with_oracle(llm: LLM, reference, prompts, k: int = 4, wrong: float = 0.25, seed: int = 0) -> LLM:
    futures = {tuple(p["prompt_token_ids"]): [c.token_ids for c in out.outputs] for p, out in zip(prompts, reference)}
    llm.llm_engine._proposer.proposer = OracleProposer(futures, k, wrong, llm.llm_engine.vocab_size, seed)
    return llm


def token_prompts(n: int, seed: int, vocab: int = 512) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]} for _ in range(n)]


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


def assert_same_outputs(reference, outputs) -> None:
    for ref, out in zip(reference, outputs):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        assert [c.finish_reason for c in out.outputs] == [c.finish_reason for c in ref.outputs]
        for a, b in zip(ref.outputs, out.outputs):
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("model", ["llama_gqa", "qwen2", "mistral_swa", "qwen3", "gpt2"])
def test_greedy_with_drafts_equals_decoding_without(tiny_model_factory, model):
    folder = tiny_model_factory(model)
    prompts = token_prompts(6, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    reference = tiny_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = with_oracle(tiny_llm(folder, speculative_config=SPEC), reference, prompts)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens  # both paths ran
    assert sum(o.metrics.num_accepted_tokens for o in outputs) == stats.num_accepted_tokens
    assert_no_blocks_held(llm)


def assert_no_blocks_held(llm: LLM) -> None:
    pool = llm.llm_engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def mixed_batch(num_prompts: int = 7, extra: list[SamplingParams] = ()) -> tuple[list[dict], list[SamplingParams]]:
    """num_prompts prompts and one more sharing the first's prefix, with their params: greedy, seeded
    sampling (n > 1 too), then `extra` (one per prompt past the seventh), then greedy with logprobs."""
    prompts = token_prompts(num_prompts, seed=4)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [5, 6, 7]}]  # shares a prefix
    params = [SamplingParams(max_tokens=30, temperature=0.0)] * 5 + [
        SamplingParams(max_tokens=30, temperature=0.9, seed=11),
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, n=2, seed=12),
        *extra,
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=2),
    ]
    return prompts, params


def assert_greedy_matches_plain_decoding(folder: str, speculative_config: dict, num_prompts: int = 6, seed: int = 1,
                                         max_tokens: int = 24, device: str = "cpu", **llm_kwargs) -> LLM:
    """Greedy decoding of token_prompts(num_prompts, seed) with speculation gives the tokens of decoding
    without; the speculating engine comes back for the caller's own checks (and shutdown, with tensor
    parallelism: on a failure here it is shut down before the error goes on)."""
    prompts = token_prompts(num_prompts, seed=seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reference = tiny_llm(folder, device=device).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=speculative_config, device=device, **llm_kwargs)
    try:
        assert_same_outputs(reference, llm.generate(prompts, params, use_tqdm=False))
    except BaseException:
        llm.llm_engine.shutdown()
        raise
    return llm


def assert_mixed_batch_matches_plain_decoding(folder: str, speculative_config: dict, num_prompts: int = 7,
                                              extra: list[SamplingParams] = (), num_kv_blocks: int = 14,
                                              device: str = "cpu") -> tuple[list, LLM, list]:
    """mixed_batch(num_prompts, extra) under a small token budget (prompts chunked) and a KV cache too small
    for it (preemption): the outputs of decoding without speculation, drafts made, no block held after.
    Returns (the outputs without speculation, the speculating engine, its outputs)."""
    prompts, params = mixed_batch(num_prompts, extra)
    tight = dict(num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=24, device=device)
    reference = tiny_llm(folder, **tight).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=speculative_config, **tight)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    assert llm.llm_engine.stats().num_preemptions > 0
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0
    assert_no_blocks_held(llm)
    return reference, llm, outputs


def test_sampling_with_drafts_is_token_for_token_the_same_stream(tiny_model_factory):
    """Seeded sampling (with top-p, penalties, logprobs and n > 1) gives the very tokens it gives without
    drafts: each kept token is the one the request's own random stream samples at that position."""
    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(5, seed=2)
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, seed=11),
        SamplingParams(max_tokens=20, temperature=0.7, top_p=0.8, top_k=40, seed=12, logprobs=3),
        SamplingParams(max_tokens=20, temperature=1.0, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2, seed=13),
        SamplingParams(max_tokens=20, temperature=0.8, n=3, seed=14),
        SamplingParams(max_tokens=20, temperature=0.0, min_p=0.1, logprobs=1, min_tokens=5),
    ]
    reference = tiny_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = with_oracle(tiny_llm(folder, speculative_config=SPEC), reference, prompts, wrong=0.3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    for ref, out in zip(reference, outputs):
        for a, b in zip(ref.outputs, out.outputs):
            if a.logprobs is not None:
                assert [list(d) for d in b.logprobs] == [list(d) for d in a.logprobs]
                for da, db in zip(a.logprobs, b.logprobs):
                    assert [v.logprob for v in db.values()] == pytest.approx([v.logprob for v in da.values()], abs=1e-4)
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0
    assert_no_blocks_held(llm)


def test_stop_tokens_and_max_tokens_inside_a_kept_run_end_the_request_there(tiny_model_factory):
    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(4, seed=3)
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    plain = tiny_llm(folder).generate(prompts, greedy, use_tqdm=False)
    # Stop on a token each output produces mid-way; the oracle is always right, so the stop token comes inside a run.
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[out.outputs[0].token_ids[9]]) for out in plain]
    params[-1] = SamplingParams(max_tokens=7, temperature=0.0)
    reference = tiny_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = with_oracle(tiny_llm(folder, speculative_config={**SPEC, "num_speculative_tokens": 6}), plain, prompts, k=6, wrong=0.0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 3 + ["length"]
    assert len(outputs[-1].outputs[0].token_ids) == 7
    assert_no_blocks_held(llm)


def test_drafts_with_prompt_chunks_preemption_and_prefix_caching(tiny_model_factory):
    """A small token budget (drafts cut to fit, prompts chunked) and a KV cache too small for the batch
    (preemption, recompute): still the outputs of decoding without speculation, and the prefix cache
    holds only blocks of real tokens."""
    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(8, seed=4)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [5, 6, 7]}]  # shares a prefix
    params = SamplingParams(max_tokens=40, temperature=0.0)
    tight = dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=24)
    reference = tiny_llm(folder, **tight).generate(prompts, params, use_tqdm=False)
    llm = with_oracle(tiny_llm(folder, speculative_config=SPEC, **tight), reference, prompts, wrong=0.3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    engine = llm.llm_engine
    assert engine.stats().num_preemptions > 0
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert_no_blocks_held(llm)
    real = [tuple(p["prompt_token_ids"] + o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]
    pool = engine.scheduler.kv_cache.pool
    for block in pool.blocks:
        if block.block_key is not None:  # a cached block holds a run of some request's real tokens
            tokens = block.block_key.token_ids
            assert any(
                seq[i : i + len(tokens)] == tokens for seq in real for i in range(0, len(seq) - len(tokens) + 1, 4)
            ), f"block {block.block_id} caches tokens {tokens} no request produced"


def test_ngram_end_to_end_on_repeating_prompts(tiny_model_factory):
    """The real proposer: on prompts that repeat, drafts are proposed and the output stays the same."""
    folder = tiny_model_factory("llama_gqa")
    base = [3, 17, 99, 250, 4, 61, 18, 7]
    prompts = [{"prompt_token_ids": base * 4}, {"prompt_token_ids": [9, 8, 7] * 6}, {"prompt_token_ids": list(range(40, 60))}]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    reference = tiny_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=SPEC)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0


DRAFT_SELF = {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 3, "disable_by_batch_size": None}


@pytest.mark.parametrize("model, kv_cache_dtype", [("llama_gqa", "auto"), ("qwen2", "auto"), ("mistral_swa", "auto"), ("llama_gqa", "int8")])
def test_self_draft_equals_decoding_without(tiny_model_factory, model, kv_cache_dtype):
    """A quantized copy of the target drafts (in the target's KV cache; int8 with its per-row scales too):
    greedy and seeded sampling (n > 1 too) give the outputs of decoding without speculation, with prompt
    chunks, preemption and prefix caching in play, and most drafts are kept."""
    folder = tiny_model_factory(model)
    prompts = token_prompts(6, seed=5)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [5, 6, 7]}]
    params = [SamplingParams(max_tokens=30, temperature=0.0), SamplingParams(max_tokens=30, temperature=0.8, seed=9, n=2)]
    jobs = [params[i % 2] for i in range(len(prompts))]
    tight = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    reference = tiny_llm(folder, **tight).generate(prompts, jobs, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=DRAFT_SELF, **tight)
    outputs = llm.generate(prompts, jobs, use_tqdm=False)
    assert_same_outputs(reference, outputs)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode.num_accepted_tokens > stats.spec_decode.num_draft_tokens / 2
    assert_no_blocks_held(llm)
    assert not llm.llm_engine.executor.worker.drafter._states  # nothing kept of finished requests


def test_self_draft_shares_the_targets_kv_cache(tiny_model_factory):
    """A "self" draft reads and writes the target's cache: the same tensors, the whole budget the
    target's (as many blocks as without a draft), a first pass of one token per decode; a separate
    draft model keeps a cache of its own."""
    folder = tiny_model_factory("llama_gqa")
    plain = tiny_llm(folder)
    llm = tiny_llm(folder, speculative_config=DRAFT_SELF)
    worker = llm.llm_engine.executor.worker
    target, draft = worker.runner.attn_layers, worker.drafter.runner.attn_layers
    assert all(d.k_cache is t.k_cache and d.v_cache is t.v_cache for d, t in zip(draft, target))
    assert llm.llm_engine.scheduler.kv_cache.pool.num_usable_blocks == plain.llm_engine.scheduler.kv_cache.pool.num_usable_blocks
    first_passes = []
    execute = worker.drafter.runner.execute
    worker.drafter.runner.execute = lambda chunks: first_passes.append([len(c.token_ids) for c in chunks]) or execute(chunks)
    prompts = token_prompts(3, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    assert_same_outputs(plain.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False))
    assert first_passes and all(n == 1 for lens in first_passes[1:] for n in lens)  # after the prompts' steps: one token
    other = tiny_llm(folder, speculative_config={**DRAFT_SELF, "model": tiny_model_factory("llama_mqa_tied")})
    assert other.llm_engine.executor.worker.drafter.runner.attn_layers[0].k_cache is not other.llm_engine.executor.worker.runner.attn_layers[0].k_cache


def test_greedy_draft_passes_take_the_argmax_without_the_sampler(tiny_model_factory, monkeypatch):
    """Greedy requests with nothing else to apply: the draft's passes after the first take the logits'
    argmax straight (worker/batch.py's next_decode_batch between them), requests ending at different
    passes; a repetition penalty, which can change a greedy choice, keeps the sampler. Outputs unchanged."""
    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(5, seed=8)
    greedy = [SamplingParams(max_tokens=m, temperature=0.0) for m in (5, 9, 17, 30, 30)]
    penalized = [replace(p, repetition_penalty=1.3) for p in greedy]
    reference = tiny_llm(folder).generate(prompts * 2, greedy + penalized, use_tqdm=False)
    llm = tiny_llm(folder, speculative_config=DRAFT_SELF)
    runner, calls = llm.llm_engine.executor.worker.drafter.runner, []
    fast = runner.greedy_decode
    monkeypatch.setattr(runner, "greedy_decode", lambda batch: calls.append(batch.num_tokens) or fast(batch))
    assert_same_outputs(reference[:5], llm.generate(prompts, greedy, use_tqdm=False))
    assert calls and set(calls) > {5}  # every request's passes at first, fewer once some are done
    calls.clear()
    assert_same_outputs(reference[5:], llm.generate(prompts, penalized, use_tqdm=False))
    assert not calls


def test_a_separate_draft_model(tiny_model_factory):
    """Another model with the same vocabulary drafts (badly: it is unrelated); outputs are unchanged."""
    target, draft = tiny_model_factory("llama_gqa"), tiny_model_factory("llama_mqa_tied")
    prompts = token_prompts(4, seed=6)
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2)
    reference = tiny_llm(target).generate(prompts, params, use_tqdm=False)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2, "disable_by_batch_size": None}
    llm = tiny_llm(target, speculative_config=spec)
    assert_same_outputs(reference, llm.generate(prompts, params, use_tqdm=False))
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0


def test_draft_model_errors_name_the_problem(tiny_model_factory, wide_tiny_llama):
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="belong to the draft_model, medusa and eagle methods"):
        SpeculativeConfig(method="ngram", model="self")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        SpeculativeConfig(method="draft_model", model="self", quantization="int3")
    default = SpeculativeConfig(method="draft_model", model="self")
    assert (default.quantization, default.quantization_options) == ("int4", {"group_size": 32})
    assert SpeculativeConfig(method="draft_model", model="self", quantization="int4").quantization_options == {"group_size": 32}
    with pytest.raises(ValueError, match=r"vocabulary \(256 tokens\) differs from the target's \(512\)"):
        tiny_llm(tiny_model_factory("llama_gqa"), speculative_config={"method": "draft_model", "model": wide_tiny_llama})


def test_no_drafts_at_or_above_disable_by_batch_size(tiny_model_factory):
    folder = tiny_model_factory("llama_gqa")
    prompts = [{"prompt_token_ids": [9, 8, 7] * 6}] * 3
    llm = tiny_llm(folder, speculative_config={"method": "ngram", "disable_by_batch_size": 3})
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens == 0


def test_kept_tokens_follow_the_target_distribution(tiny_model_factory, hf_model_factory):
    """Chi-square over many seeded draws: the second token (sampled in a step that verifies a draft, which
    always guesses the second likeliest token) must follow the model's own distribution given the first; an
    acceptance rule that favoured the draft would over-represent it and fail. And each draw is the very
    token sequence decoding without speculation samples for that seed."""
    folder = tiny_model_factory("llama_mqa_tied")
    prompt = [5, 77, 300, 12]
    temperature, draws = 0.5, 3000
    hf = hf_model_factory("llama_mqa_tied")

    def next_probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([tokens])).logits[0, -1].double() / temperature, dim=-1)

    first = int(next_probs(prompt).argmax())
    probs = next_probs(prompt + [first])  # the second token's distribution, given the likeliest first
    guess = int(probs.topk(2).indices[1])  # kept sometimes, rejected more often

    class FixedGuess:
        def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
            return [guess][: max_tokens or 1]

    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s) for s in range(draws)]
    llm = tiny_llm(folder, speculative_config={**SPEC, "num_speculative_tokens": 1}, max_num_seqs=256)
    llm.llm_engine._proposer.proposer = FixedGuess()
    outputs = llm.generate([{"prompt_token_ids": prompt}] * draws, params, use_tqdm=False)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens == draws and 0 < stats.num_accepted_tokens < draws
    seconds = [o.outputs[0].token_ids[1] for o in outputs if o.outputs[0].token_ids[0] == first]
    assert len(seconds) > 300
    counts = torch.bincount(torch.tensor(seconds), minlength=probs.numel()).double()
    expected = probs * len(seconds)
    keep = expected >= 5  # rare tokens pooled into one cell, as the chi-square test needs
    observed_cells = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected_cells = torch.cat([expected[keep], expected[~keep].sum()[None]])
    stat = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    dof = len(observed_cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom (p = {p_value:.2g})"
    reference = tiny_llm(folder, max_num_seqs=256).generate([{"prompt_token_ids": prompt}] * 300, params[:300], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:300]] == [o.outputs[0].token_ids for o in reference]


# -- with a real tokenizer: stop strings and structured output inside a kept run ---------------------------


@pytest.fixture(scope="module")
def smollm_pair():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("the embedded default model is not installed")
    common = dict(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)
    return LLM(**common), LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5}, **common)


EDIT_PROMPT = (
    "Repeat this list exactly, one item per line:\n"
    "- apples and pears\n- green tea with lemon\n- the quick brown fox\n- seven blue bottles\n"
    "Here is the list repeated:\n"
)


def test_smollm2_ngram_greedy_equals_plain_and_drafts_pay(smollm_pair):
    plain, spec = smollm_pair
    params = SamplingParams(max_tokens=48, temperature=0.0)
    ref = plain.generate([EDIT_PROMPT], params, use_tqdm=False)[0].outputs[0]
    out = spec.generate([EDIT_PROMPT], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.token_ids
    assert out.metrics.num_accepted_tokens > 10  # the list is copied: most drafts are kept


def test_smollm2_stop_string_inside_a_kept_run(smollm_pair):
    plain, spec = smollm_pair
    text = plain.generate([EDIT_PROMPT], SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    stop = "brown"
    assert stop in text
    params = SamplingParams(max_tokens=48, temperature=0.0, stop=[stop])
    ref = plain.generate([EDIT_PROMPT], params, use_tqdm=False)[0].outputs[0]
    out = spec.generate([EDIT_PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (ref.text, ref.token_ids, "stop", stop)
    assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)


def test_smollm2_structured_output_checks_drafts_against_the_grammar(smollm_pair):
    from tokenmill.sampling_params import StructuredOutputsParams

    plain, spec = smollm_pair
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"]}
    prompt = EDIT_PROMPT + 'As JSON: {"items": ["apples and pears", "green tea with lemon", '
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    ref = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.token_ids
    assert out.metrics.num_draft_tokens > 0


# -- command line, metrics, bench ---------------------------------------------------------------------------


def test_speculative_config_from_the_command_line():
    from tokenmill.entrypoints.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config_from_args(args).speculative == SpeculativeConfig(num_speculative_tokens=5)
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"method": "eagle3"}'])
    with pytest.raises(ValueError, match="'eagle3' is not supported yet"):
        engine_config_from_args(args)


def test_spec_decode_counters_under_vllm_names():
    from tokenmill.engine.engine import EngineStats
    from tokenmill.metrics import ServerMetrics

    spec = SpecDecodeStats()
    spec.record(3, 2)
    spec.record(3, 1)
    stats = EngineStats(1, 0, 0.1, 10, 0, 0, 0, spec_decode=spec)
    text = ServerMetrics("m", 128, stats=lambda: stats).render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 6.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    plain = ServerMetrics("m", 128, stats=lambda: EngineStats(1, 0, 0.1, 10, 0, 0, 0)).render().decode()
    assert "spec_decode" not in plain


def test_bench_throughput_reports_acceptance(tiny_model_factory):
    from tokenmill.bench.datasets import SampleRequest
    from tokenmill.bench.report import format_throughput
    from tokenmill.bench.throughput import run_throughput

    llm = tiny_llm(tiny_model_factory("llama_gqa"), speculative_config=SPEC)
    requests = [SampleRequest([9, 8, 7] * 6, 24), SampleRequest([1, 2, 3, 4] * 5, 24)]
    metrics = run_throughput(llm.llm_engine, requests, use_tqdm=False)
    spec = metrics["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_pos"])
    assert metrics["median_tpot_ms"] > 0
    result = {"model": "m", "dtype": "float32", "device": "cpu", "quantization": "none", "dataset_name": "x",
              "prefix_caching": True, "dataset": {"num_requests": 2, "input_len_min": 18, "input_len_max": 20,
                                                  "output_len_min": 24, "output_len_max": 24}, "tokenmill": metrics}
    assert "Spec decode acceptance rate:" in format_throughput(result)


def test_edit_dataset_asks_to_copy_a_passage(smollm_pair):
    from tokenmill.bench.datasets import edit_dataset

    tokenizer = smollm_pair[0].get_tokenizer()
    requests = edit_dataset(tokenizer, 3, 100, seed=1)
    assert len(requests) == 3
    for r in requests:
        assert "will" in r.prompt and "<|im_start|>assistant" in r.prompt
        assert r.output_len >= 80 and r.prompt_len > r.output_len


@pytest.mark.parametrize("pipeline", [True, False])
def test_async_engine_streams_kept_runs(tiny_model_factory, pipeline):
    """The server's engine: several tokens per step reach the stream in order, and the final output is
    the one of decoding without speculation."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncLLMEngine

    folder = tiny_model_factory("llama_gqa")
    prompts = [[9, 8, 7] * 6, [3, 17, 99, 250, 4] * 4, [1, 2, 3, 4] * 5]
    params = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.8, seed=3)]
    jobs = [(p, params[i % 2]) for i, p in enumerate(prompts)]
    expected = tiny_llm(folder).generate([{"prompt_token_ids": p} for p, _ in jobs], [sp for _, sp in jobs], use_tqdm=False)

    async def main():
        config = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", skip_tokenizer_init=True,
                                          kv_cache_memory=8 << 20, speculative_config=SPEC)
        engine = AsyncLLMEngine(config, pipeline=pipeline)
        await engine.start()

        async def collect(prompt, sp, rid):
            return [out async for out in engine.generate({"prompt_token_ids": prompt}, sp, rid)]

        try:
            return await asyncio.gather(*(collect(p, sp, f"r{i}") for i, (p, sp) in enumerate(jobs))), engine.stats()
        finally:
            await engine.shutdown()

    results, stats = asyncio.run(main())
    for outputs, want in zip(results, expected):
        assert outputs[-1].finished
        assert outputs[-1].outputs[0].token_ids == want.outputs[0].token_ids
        for before, after in zip(outputs, outputs[1:]):
            assert after.outputs[0].token_ids[: len(before.outputs[0].token_ids)] == before.outputs[0].token_ids
    assert stats.spec_decode.num_accepted_tokens > 0
    assert any(len(b.outputs[0].token_ids) - len(a.outputs[0].token_ids) > 1 for out in results for a, b in zip(out, out[1:]))


def test_serve_with_speculative_config(smollm_pair):
    """`tokenmill serve --speculative-config`: a streamed chat answer equal to the one without speculation,
    and vLLM's counters in /metrics."""
    import httpx
    import openai

    from server_utils import RemoteServer, parse_metrics

    plain, _ = smollm_pair
    messages = [{"role": "user", "content": EDIT_PROMPT}]
    want = plain.chat(messages, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    try:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="none")
        stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                                max_tokens=40, temperature=0.0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == want
        metrics = parse_metrics(httpx.get(srv.url("/metrics")).text)
        assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == metrics["vllm:spec_decode_num_accepted_tokens_total"]
    finally:
        srv.stop()


def test_bench_latency_reports_acceptance(tiny_model_factory, tmp_path, capsys):
    import json

    from tokenmill.entrypoints.cli import main

    out_json = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", tiny_model_factory("llama_gqa"), "--dtype", "float32", "--batch-size", "2",
               "--input-len", "8", "--output-len", "24", "--num-iters-warmup", "0", "--num-iters", "1", "--disable-tqdm",
               "--speculative-config", json.dumps(SPEC), "--json", str(out_json)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Spec decode acceptance rate:" in out.out
    spec = json.loads(out_json.read_text())["tokenmill"]["spec_decode"]
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_pos"])
