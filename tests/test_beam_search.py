"""LLM.beam_search against HF transformers' num_beams search on a tiny seeded Llama at float32.

The beams are requests that share their common prefix's KV blocks (fork + copy on write);
the test checks every returned beam token for token, its cumulative logprob, and that no block
is left behind."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def hf_model(wide_tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(wide_tiny_llama, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def llm(wide_tiny_llama) -> LLM:
    return LLM(model=wide_tiny_llama, dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=256)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def hf_beams(model, prompt: list[int], beam_width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    """HF's num_beams search (no EOS in reach): every returned beam's new tokens and cumulative logprob."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=beam_width, num_return_sequences=beam_width,
            max_new_tokens=max_tokens, early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    # sequences_scores = cum_logprob / generated_length ** length_penalty
    return [(row[len(prompt):].tolist(), score.item() * max_tokens) for row, score in zip(out.sequences, out.sequences_scores)]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache.pool
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert engine.scheduler.kv_cache.req_to_blocks == {}
    assert engine._groups == {}


CASES = [(2, 12, 10, 0), (3, 10, 21, 1), (4, 16, 7, 2), (5, 9, 30, 3)]  # beam width, max tokens, prompt length, seed


@pytest.mark.parametrize("beam_width,max_tokens,prompt_len,seed", CASES)
def test_beam_search_matches_hf(llm, hf_model, beam_width, max_tokens, prompt_len, seed):
    prompt = prompt_of(prompt_len, seed)
    expected = hf_beams(hf_model, prompt, beam_width, max_tokens)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    (result,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    assert isinstance(result, BeamSearchOutput)
    assert len(result.sequences) == beam_width
    for seq, (tokens, cum) in zip(result.sequences, expected):
        assert seq.tokens[:prompt_len] == prompt  # vLLM's shape: the prompt is part of tokens
        assert seq.tokens[prompt_len:] == tokens
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
        assert seq.finish_reason == "length"
    assert [s.cum_logprob for s in result.sequences] == sorted((s.cum_logprob for s in result.sequences), reverse=True)
    assert_no_leak(llm)


def test_several_prompts_in_one_call_come_back_in_order(llm, hf_model):
    prompts = [prompt_of(n, 40 + n) for n in (12, 5, 19)]
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        expected = hf_beams(hf_model, prompt, 3, 8)
        assert [s.tokens[len(prompt):] for s in result.sequences] == [t for t, _ in expected]
    assert_no_leak(llm)


def test_beam_width_one_is_greedy(llm):
    prompt = prompt_of(14, 7)
    greedy = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    (result,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    assert result.sequences[0].tokens[len(prompt):] == greedy[0].outputs[0].token_ids
    assert result.sequences[0].cum_logprob == pytest.approx(greedy[0].outputs[0].cumulative_logprob, abs=1e-4)
    assert_no_leak(llm)


def test_beams_share_blocks(llm):
    """k beams of a long prompt hold the prompt once: far fewer blocks than k copies."""
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache.pool
    prompt_len, beam_width, max_tokens, bs = 120, 4, 10, 8
    engine.add_beam_search_request({"prompt_token_ids": prompt_of(prompt_len, 9)}, BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
    # At most: the prompt's blocks once, and per beam the blocks of its own continuation (plus a copied partial block).
    assert peak <= prompt_len // bs + beam_width * (-(-max_tokens // bs) + 1)
    assert_no_leak(llm)


def test_beam_search_under_preemption_gives_the_same_beams(wide_tiny_llama, llm):
    prompts = [prompt_of(n, 60 + n) for n in (30, 25, 33)]
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    reference = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    small = LLM(model=wide_tiny_llama, dtype="float32", num_kv_blocks=16, block_size=4, max_num_batched_tokens=32)
    pressed = small.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for ref, out in zip(reference, pressed):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([s.cum_logprob for s in ref.sequences], abs=1e-4)
    assert_no_leak(small)


def _reference_vllm_beam_search(model, prompt, beam_width, max_tokens, eos, length_penalty):
    """vLLM's LLM.beam_search algorithm on HF logits (every candidate EOS ends a hypothesis)."""
    beams = [(list(prompt), 0.0)]
    completed = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            values, ids = logprobs.topk(2 * beam_width)
            for t, lp in zip(ids.tolist(), values.tolist()):
                if t == eos:
                    completed.append((tokens, cum + lp, True))
                else:
                    candidates.append((tokens + [t], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:beam_width]
    completed += [(t, c, False) for t, c in beams]

    def score(entry):
        tokens, cum, _ = entry
        return cum / (len(tokens) ** length_penalty)

    return sorted(completed, key=score, reverse=True)[:beam_width]


def test_eos_ends_hypotheses_as_vllm_does(llm, hf_model):
    prompt = prompt_of(11, 3)
    # An EOS id that shows up among the candidates: the runner-up of the first greedy step.
    with torch.no_grad():
        eos = hf_model(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1].item()
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})
    try:
        (result,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    finally:
        engine.eos_token_ids = saved
    expected = _reference_vllm_beam_search(hf_model, prompt, 3, 6, eos, 0.5)
    assert [s.tokens for s in result.sequences] == [t for t, _, _ in expected]
    assert [s.cum_logprob for s in result.sequences] == pytest.approx([c for _, c, _ in expected], abs=1e-3)
    assert [s.finish_reason for s in result.sequences] == ["stop" if e else "length" for _, _, e in expected]
    assert any(s.finish_reason == "stop" for s in result.sequences)
    assert_no_leak(llm)


def test_beam_search_params_are_checked(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([{"prompt_token_ids": [1, 2]}], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search([{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=4))
    assert_no_leak(llm)


def test_beam_search_in_a_cache_barely_larger_than_one_sequence(wide_tiny_llama, llm):
    """Beams that wait for a preempted sibling give up their blocks rather than deadlock the batch."""
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    reference = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    tight = LLM(model=wide_tiny_llama, dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=32)
    out = tight.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [[s.tokens for s in o.sequences] for o in out] == [[s.tokens for s in r.sequences] for r in reference]
    assert_no_leak(tight)
