"""Parallel sampling (n > 1, best_of) end to end on a tiny seeded Llama: the prompt is prefilled once,
the sequences share its KV blocks (the partly filled last block copied on write), and come back
as one RequestOutput with n CompletionOutputs."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.kv_cache import cdiv

VOCAB = 256


@pytest.fixture(scope="module")
def llm(wide_tiny_llama) -> LLM:
    return LLM(model=wide_tiny_llama, dtype="float32", num_kv_blocks=256, block_size=16, max_num_batched_tokens=512)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def generate(llm: LLM, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache.pool
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert engine.scheduler.kv_cache.req_to_blocks == {}
    assert engine._groups == {}


def test_n8_long_prompt_memory_is_one_prompt_plus_eight_continuations(llm):
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache.pool
    prompt_len, max_tokens, n, bs = 200, 32, 8, 16
    params = SamplingParams(n=n, temperature=1.0, seed=11, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt_of(prompt_len)}, params, request_id="long")
    peak, computed, final = 0, 0, None
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        nonlocal computed
        computed += out.num_batched_tokens
        return out

    engine.scheduler.schedule = schedule
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
            peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
    finally:
        del engine.scheduler.schedule
    assert final is not None and final.finished and final.request_id == "long"
    assert [c.index for c in final.outputs] == list(range(n))
    assert all(len(c.token_ids) == max_tokens for c in final.outputs)
    # The prompt is prefilled once (up to its last token, which each sequence computes itself).
    assert computed == (prompt_len - 1) + n * max_tokens
    # Peak blocks: the prompt's full blocks once, plus each sequence's own tail (the copied
    # partial last prompt block and its continuation). KV is held for prompt + max_tokens - 1 tokens.
    shared = (prompt_len - 1) // bs
    own = cdiv(prompt_len + max_tokens - 1, bs) - shared
    assert peak == shared + n * own == 12 + 8 * 3
    assert peak <= cdiv(prompt_len, bs) + n * (cdiv(max_tokens, bs) + 1)  # one prompt + eight continuations
    assert peak < n * cdiv(prompt_len + max_tokens - 1, bs) / 3  # 120 blocks without sharing
    assert_no_leak(llm)


def test_seeded_samples_are_reproducible_and_differ_from_each_other(llm):
    params = SamplingParams(n=6, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    prompt = prompt_of(37, seed=1)
    first = generate(llm, [prompt], params)[0]
    again = generate(llm, [prompt], params)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in tokens}) == 6
    # In a batch with other requests the same seed gives the same samples.
    mixed = generate(llm, [prompt_of(20, 5), prompt, prompt_of(50, 6)], [SamplingParams(max_tokens=5, seed=1), params, SamplingParams(n=3, max_tokens=7)])
    assert [c.token_ids for c in mixed[1].outputs] == tokens
    assert [len(o.outputs) for o in mixed] == [1, 6, 3]
    # Sequence 0 keeps the request's seed: it is what n=1 gives.
    single = generate(llm, [prompt], SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == tokens[0]
    assert_no_leak(llm)


def test_greedy_n_gives_identical_copies(llm):
    prompt = prompt_of(30, seed=2)
    greedy = generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    out = generate(llm, [prompt], SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == greedy.token_ids for c in out.outputs)
    assert all(c.cumulative_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-4) for c in out.outputs)
    assert_no_leak(llm)


def test_best_of_returns_the_top_n_by_cumulative_logprob(llm):
    prompt = prompt_of(45, seed=3)
    common = dict(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True)
    # best_of=6 generates the same six sequences as n=6 (same seeds), and keeps the best two.
    all_six = generate(llm, [prompt], SamplingParams(n=6, logprobs=0, **common))[0].outputs
    best = generate(llm, [prompt], SamplingParams(n=2, best_of=6, **common))[0].outputs
    for c in all_six:  # the cumulative logprob is the sum of the sampled tokens' logprobs
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)), abs=1e-4)
    ranked = sorted(all_six, key=lambda c: -c.cumulative_logprob)
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob >= ranked[2].cumulative_logprob
    assert_no_leak(llm)


def test_forked_sequences_preempted_give_the_same_tokens(wide_tiny_llama, llm):
    prompts = [prompt_of(n, seed=10 + n) for n in (23, 40, 9, 31)]
    params = [
        SamplingParams(n=3, temperature=0.9, seed=5 + i, max_tokens=20, ignore_eos=True) if i % 2 == 0
        else SamplingParams(n=2, best_of=3, temperature=1.0, top_k=30, seed=50 + i, max_tokens=16, ignore_eos=True)
        for i in range(len(prompts))
    ]
    reference = generate(llm, prompts, params)
    assert llm.llm_engine.scheduler.num_preemptions == 0
    small = LLM(model=wide_tiny_llama, dtype="float32", num_kv_blocks=12, block_size=8, max_num_batched_tokens=64)
    pressed = generate(small, prompts, params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for ref, out in zip(reference, pressed):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert_no_leak(small)


def test_one_token_prompt_and_outputs_in_prompt_order(llm):
    prompts = [[5], prompt_of(17, 8), [9, 10]]
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=5, ignore_eos=True)
    outs = generate(llm, prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs) == 3 and o.finished for o in outs)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for o in outs for c in o.outputs)
    assert_no_leak(llm)


def test_abort_a_group_frees_every_sequence(llm):
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": prompt_of(50, 9)}, SamplingParams(n=4, max_tokens=50, ignore_eos=True), request_id="ab")
    for _ in range(4):
        engine.step()
    out = engine.abort_request("ab")
    assert out.request_id == "ab" and out.finished
    assert len(out.outputs) == 4 and all(c.finish_reason == "abort" for c in out.outputs)
    assert_no_leak(llm)


def test_group_request_id_stays_reserved_until_all_sequences_finish(llm):
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2, max_tokens=3), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(), request_id="dup")
    engine.abort_request("dup")
    assert_no_leak(llm)
