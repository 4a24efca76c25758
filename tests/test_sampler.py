"""Sampler: filters against a plain per-row reference, greedy, seeded reproducibility, the
sampled distribution, the uniform generator, and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.messages import ScheduledChunk
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    inverse_cdf_sample,
    random_uniform,
)

NEG_INF = float("-inf")


# -- reference implementations (plain, per row) ------------------------------------------------


def ref_top_k_top_p_row(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th kept too), then the smallest set of the
    most likely remaining tokens whose probability reaches p."""
    row = row.clone().double()
    vocab = row.numel()
    if 0 < k < vocab:
        kth = sorted(row.tolist(), reverse=True)[k - 1]
        row[row < kth] = NEG_INF
    if p < 1.0:
        probs = torch.softmax(row, dim=-1)
        order = sorted(range(vocab), key=lambda i: -row[i].item())
        mass = 0.0
        for i in order:
            if mass >= p:
                row[i] = NEG_INF
            mass += probs[i].item()
    return row


def ref_min_p_row(row: torch.Tensor, min_p: float) -> torch.Tensor:
    row = row.clone().double()
    probs = torch.softmax(row, dim=-1)
    top = probs.max().item()
    for i in range(row.numel()):
        if probs[i].item() < min_p * top:
            row[i] = NEG_INF
    return row


def ref_distribution(row: torch.Tensor, params: SamplingParams, banned=()) -> torch.Tensor:
    """The distribution a row should be sampled from, in vLLM's order:
    banned tokens, temperature, min-p, then top-k / top-p."""
    row = row.clone().double()
    for t in banned:
        row[t] = NEG_INF
    if params.is_greedy:
        out = torch.zeros_like(row)
        out[row.argmax()] = 1.0
        return out
    row = row / params.temperature
    if params.min_p > 0:
        row = ref_min_p_row(row, params.min_p)
    row = ref_top_k_top_p_row(row, params.top_k, params.top_p)
    return torch.softmax(row, dim=-1)


# -- helpers -------------------------------------------------------------------------------------


def chunk(params: SamplingParams, seed: int = 0, step: int = 0, banned=()) -> ScheduledChunk:
    return ScheduledChunk(
        request_id="r",
        token_ids=[1],
        start_pos=0,
        block_ids=[1],
        sample=True,
        sampling_params=params,
        sampling_seed=seed,
        output_index=step,
        banned_token_ids=tuple(banned),
    )


def metadata(params: list[SamplingParams], seeds=None, steps=None, banned=None) -> SamplingMetadata:
    n = len(params)
    seeds = seeds if seeds is not None else [0] * n
    steps = steps if steps is not None else [0] * n
    banned = banned if banned is not None else [()] * n
    chunks = [chunk(p, s, t, b) for p, s, t, b in zip(params, seeds, steps, banned)]
    return SamplingMetadata.from_chunks(chunks, torch.device("cpu"))


def sample(logits: torch.Tensor, params, seeds=None, steps=None, banned=None) -> list[int]:
    if isinstance(params, SamplingParams):
        params = [params] * logits.shape[0]
    return Sampler()(logits, metadata(params, seeds, steps, banned)).tolist()


def assert_same_filter(out: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor) -> None:
    """Same -inf pattern, and the kept logits unchanged."""
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), (out, ref)
    kept = ~torch.isinf(ref)
    assert torch.equal(out[kept], logits[kept])


# -- top-k / top-p / min-p against the reference ---------------------------------------------------


@pytest.mark.parametrize("trial", range(5))
def test_top_k_top_p_matches_reference_mixed_batch(trial):
    gen = torch.Generator().manual_seed(trial)
    batch, vocab = 24, 50
    logits = torch.randn(batch, vocab, generator=gen) * 3
    ks = [0, 1, 2, 5, 17, 49, 50, 80] * 3
    ps = [1.0, 0.9, 0.5, 0.05, 0.999, 0.3, 1.0, 0.75] * 3
    ps = ps[trial % 3 :] + ps[: trial % 3]  # different k/p pairings each trial
    out = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps, dtype=torch.float32))
    for i in range(batch):
        ref = ref_top_k_top_p_row(logits[i], ks[i], ps[i])
        assert_same_filter(out[i], ref, logits[i])
        assert (~torch.isinf(out[i])).sum() >= 1
        if ks[i] > 0:
            assert (~torch.isinf(out[i])).sum() <= min(ks[i], vocab)


@pytest.mark.parametrize("candidates", [4, 12])
def test_top_p_beyond_the_candidates_falls_back_to_the_full_sort(candidates):
    """Rows whose nucleus lies past their `candidates` most likely tokens (flat rows, high p) are sorted
    whole; the others are decided among the candidates: both as the reference, in one batch."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.cat([torch.randn(4, 50, generator=gen) * 6, torch.randn(4, 50, generator=gen) * 0.2])  # peaked, flat
    ps = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.5, 0.9, 0.3, 1.0])
    ks = torch.tensor([0, 0, 20, 0, 0, 30, 0, 0])
    out = apply_top_k_top_p(logits, ks, ps, candidates=candidates)
    for i in range(8):
        assert_same_filter(out[i], ref_top_k_top_p_row(logits[i], int(ks[i]), float(ps[i])), logits[i])


def test_top_k_only_and_top_p_only():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 30, generator=gen)
    ks = torch.tensor([0, 1, 3, 10, 29, 30])
    out = apply_top_k_top_p(logits, ks, None)
    for i in range(6):
        assert_same_filter(out[i], ref_top_k_top_p_row(logits[i], int(ks[i]), 1.0), logits[i])
    ps = torch.tensor([1.0, 0.01, 0.2, 0.5, 0.8, 0.99])
    out = apply_top_k_top_p(logits, None, ps)
    for i in range(6):
        assert_same_filter(out[i], ref_top_k_top_p_row(logits[i], 0, float(ps[i])), logits[i])


def test_top_k_one_keeps_argmax_and_top_p_tiny_keeps_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=gen)
    for out in (
        apply_top_k_top_p(logits, torch.ones(8, dtype=torch.int64), None),
        apply_top_k_top_p(logits, None, torch.full((8,), 1e-6)),
    ):
        assert torch.equal((~torch.isinf(out)).sum(dim=1), torch.ones(8, dtype=torch.int64))
        assert torch.equal(out.argmax(dim=1), logits.argmax(dim=1))


def test_disabled_rows_untouched_even_with_extreme_logits():
    logits = torch.tensor(
        [
            [0.0, -1e4, 5.0, -200.0, 1.0],  # off: even probability-0 tokens stay
            [0.0, -1e4, 5.0, -200.0, 1.0],  # top-p row
            [3.0, 3.0, 3.0, 1.0, 0.0],  # off
            [3.0, 3.0, 3.0, 1.0, 0.0],  # top-k=2 with a three-way tie: all tied kept
        ]
    )
    out = apply_top_k_top_p(logits, torch.tensor([0, 0, 0, 2]), torch.tensor([1.0, 0.5, 1.0, 1.0]))
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[2], logits[2])
    assert out[1].tolist() == [NEG_INF, NEG_INF, 5.0, NEG_INF, NEG_INF]
    assert out[3].tolist() == [3.0, 3.0, 3.0, NEG_INF, NEG_INF]


@pytest.mark.parametrize("trial", range(3))
def test_min_p_matches_reference(trial):
    gen = torch.Generator().manual_seed(100 + trial)
    logits = torch.randn(10, 40, generator=gen) * 2
    min_p = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9, 1.0, 0.3, 0.0])
    out = apply_min_p(logits, min_p)
    for i in range(10):
        ref = ref_min_p_row(logits[i], float(min_p[i]))
        assert_same_filter(out[i], ref, logits[i])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[9], logits[9])
    assert (~torch.isinf(out[7])).sum() == 1  # min_p = 1 keeps only the top token


# -- greedy ------------------------------------------------------------------------------------------


def test_all_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=gen)
    assert sample(logits, SamplingParams(temperature=0.0)) == logits.argmax(dim=1).tolist()


def test_an_all_greedy_batch_makes_no_sampling_tensors():
    meta = metadata([SamplingParams(temperature=0.0)] * 3)
    assert meta.all_greedy and meta.temperature is None and meta.seeds is None and meta.steps is None
    mixed = metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)])
    assert not mixed.all_greedy and mixed.temperature.tolist() == [0.0, pytest.approx(0.7)]


def test_greedy_rows_in_mixed_batch_are_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 64, generator=gen)
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=1.5, top_k=5, top_p=0.8, min_p=0.05)
        for i in range(12)
    ]
    got = sample(logits, params, seeds=list(range(12)))
    argmax = logits.argmax(dim=1).tolist()
    for i in range(0, 12, 3):
        assert got[i] == argmax[i]


def test_tiny_temperature_is_greedy():
    params = SamplingParams(temperature=1e-6, top_k=3, top_p=0.5, min_p=0.2)
    assert params.is_greedy and params.temperature == 0.0
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)


def test_sampled_tokens_stay_inside_the_filtered_set():
    gen = torch.Generator().manual_seed(5)
    vocab = 32
    base = torch.randn(vocab, generator=gen) * 2
    configs = [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=10, top_p=0.7, min_p=0.05),
    ]
    for params in configs:
        allowed = set(torch.nonzero(ref_distribution(base, params) > 0).flatten().tolist())
        n = 2000
        got = sample(base.expand(n, vocab).contiguous(), params, seeds=list(range(n)), steps=[3] * n)
        assert set(got) <= allowed
        assert len(set(got)) == len(allowed)  # with 2000 draws every kept token shows up


# -- banned tokens (min_tokens) ---------------------------------------------------------------------------


def test_banned_tokens_are_never_sampled_greedy_or_random():
    vocab = 10
    logits = torch.zeros(4, vocab)
    logits[:, 2] = 10.0  # token 2 (say EOS) would win every time
    logits[:, 5] = 9.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    banned = [(2,), (2, 5), (), (300,)]  # out-of-vocabulary ids are ignored
    got = sample(logits, params, seeds=[1, 2, 3, 4], banned=banned)
    assert got[0] == 5
    assert got[1] not in (2, 5)
    assert got[2] == 2
    n = 500
    got = sample(logits[:1].expand(n, vocab).contiguous(), SamplingParams(temperature=1.0), seeds=list(range(n)), banned=[(2,)] * n)
    assert 2 not in got


# -- seeds -------------------------------------------------------------------------------------------


def test_same_seed_and_step_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(11)
    vocab = 50
    target = torch.randn(vocab, generator=gen)
    target_params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = sample(target[None], target_params, seeds=[1234], steps=[7])[0]
    for trial in range(10):
        batch = 1 + trial * 3
        pos = trial % batch
        logits = torch.randn(batch, vocab, generator=gen) * 2
        logits[pos] = target
        params = [SamplingParams(temperature=0.5 + i * 0.1, top_k=i % 7, min_p=0.01 * (i % 3)) for i in range(batch)]
        params[pos] = target_params
        seeds = [int(torch.randint(0, 1 << 40, (1,), generator=gen)) for _ in range(batch)]
        seeds[pos] = 1234
        steps = [int(torch.randint(0, 100, (1,), generator=gen)) for _ in range(batch)]
        steps[pos] = 7
        assert sample(logits, params, seeds=seeds, steps=steps)[pos] == alone


def test_seeded_draws_are_deterministic_across_calls():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(64, 20, generator=gen)
    params = SamplingParams(temperature=1.0)
    seeds, steps = list(range(64)), list(range(64))
    assert sample(logits, params, seeds, steps) == sample(logits.clone(), params, seeds, steps)


def test_different_seeds_give_different_samples():
    vocab = 64
    logits = torch.zeros(1, vocab)  # uniform: every draw is pure noise
    params = SamplingParams(temperature=1.0)
    seeds = [0, 1, 2, 12345, -1, 1 << 31, (1 << 31) + 1, 1 << 40, 1 << 62, (1 << 63) - 1, -(1 << 63), (1 << 70) + 5]
    streams = []
    for seed in seeds:
        steps = list(range(40))
        streams.append(tuple(sample(logits.expand(40, vocab).contiguous(), params, [seed] * 40, steps)))
    assert len(set(streams)) == len(seeds), "two seeds gave the same 40-token stream"
    # Seeds that agree in their low 31 (or 32) bits still differ.
    assert streams[1] != streams[6]
    assert streams[0] != streams[5]


def test_consecutive_steps_are_independent():
    """For one seed, the draws at steps t and t+1 must not be tied to each other."""
    vocab, n = 8, 4000
    logits = torch.zeros(2 * n, vocab)
    params = SamplingParams(temperature=1.0)
    seeds = [s for s in range(n) for _ in range(2)]
    steps = [t for _ in range(n) for t in (0, 1)]
    got = sample(logits, params, seeds, steps)
    pairs = torch.tensor(got).view(n, 2)
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    expected = n / (vocab * vocab)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 63 degrees of freedom: the 99.99th percentile is about 112.
    assert chi2 < 112, chi2
    assert (pairs[:, 0] == pairs[:, 1]).float().mean().item() < 0.2


# -- the sampled distribution ----------------------------------------------------------------------------


def _empirical(logits_row: torch.Tensor, params: SamplingParams, n: int, step_mod: int = 10) -> torch.Tensor:
    vocab = logits_row.numel()
    seeds = [i // step_mod for i in range(n)]
    steps = [i % step_mod for i in range(n)]
    got = sample(logits_row.expand(n, vocab).contiguous(), params, seeds, steps)
    return torch.bincount(torch.tensor(got), minlength=vocab).double() / n


def _chi2(freq: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    support = probs > 0
    assert freq[~support].sum() == 0
    expected = probs[support] * n
    return (((freq[support] * n - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    n = 20_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    params = SamplingParams(temperature=temperature)
    freq = _empirical(logits, params, n)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    assert (freq - probs).abs().max().item() < 0.012
    # 7 degrees of freedom: the 99.99th percentile is about 29.9.
    assert _chi2(freq, probs, n) < 29.9


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.5, min_p=0.15),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.8, min_p=0.05),
    ],
)
def test_empirical_distribution_with_filters(params):
    n = 20_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    freq = _empirical(logits, params, n)
    probs = ref_distribution(logits, params)
    assert (freq - probs).abs().max().item() < 0.012
    df = int((probs > 0).sum()) - 1
    # Generous bound: the 99.99th percentile of chi-square with df <= 7.
    assert _chi2(freq, probs, n) < 29.9 if df else True


def test_mixed_batch_each_row_follows_its_own_distribution():
    n_per_row = 6000
    vocab = 8
    gen = torch.Generator().manual_seed(21)
    row_logits = [torch.randn(vocab, generator=gen) for _ in range(3)]
    row_params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.4, top_p=0.9)]
    logits = torch.stack([row_logits[i % 3] for i in range(3 * n_per_row)])
    params = [row_params[i % 3] for i in range(3 * n_per_row)]
    got = torch.tensor(sample(logits, params, seeds=list(range(3 * n_per_row)), steps=[5] * (3 * n_per_row)))
    for r in range(3):
        freq = torch.bincount(got[r::3], minlength=vocab).double() / n_per_row
        probs = ref_distribution(row_logits[r], row_params[r])
        assert (freq - probs).abs().max().item() < 0.025


# -- random_uniform, inverse_cdf_sample ---------------------------------------------------------------------


def test_random_uniform_range_and_moments():
    seeds = torch.tensor([0, 1, 2, -7, 1 << 40, (1 << 63) - 1, -(1 << 63), 99])
    steps = torch.tensor([0, 0, 5, 3, 1, 1 << 35, 7, 0])
    u = random_uniform(seeds, steps)
    assert u.shape == (8,) and u.dtype == torch.float64
    assert torch.equal(u, random_uniform(seeds.flip(0), steps.flip(0)).flip(0))  # a function of (seed, step) per row
    many = random_uniform(torch.arange(20000) * 7919 - 10**9, torch.arange(20000) % 13)
    assert (many >= 0).all() and (many < 1).all()
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005
    hist = torch.histc(many.float(), bins=10, min=0.0, max=1.0) / many.numel()
    assert (hist - 0.1).abs().max().item() < 0.01  # roughly flat
    assert len(set(many.tolist())) == len(many)  # no two (seed, step) pairs collide here


def test_random_uniform_steps_of_one_seed_differ():
    u = random_uniform(torch.full((1000,), 3), torch.arange(1000))
    assert len(set(u.tolist())) == 1000
    assert abs(u.mean().item() - 0.5) < 0.03


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]] * 5)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.7501, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u).tolist() == [1, 1, 3, 4, 4]  # never a token of probability 0
    unnormalised = probs * 3  # the row's total scales u
    assert inverse_cdf_sample(unnormalised, u).tolist() == [1, 1, 3, 4, 4]


def test_huge_and_negative_seeds_are_accepted():
    logits = torch.zeros(3, 16)
    got = sample(logits, SamplingParams(temperature=1.0), seeds=[1 << 80, -(1 << 70), -1], steps=[0, 0, 0])
    assert all(0 <= t < 16 for t in got)


# -- SamplingParams validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n=0), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(stop=[""]), "stop"),
        (dict(stop=5), "stop"),
        (dict(bad_words=[3]), "bad_words"),
        (dict(structured_outputs={"regex": "a+", "choice": ["x"]}), "exactly one of"),
        (dict(structured_outputs={"json": "{not json"}), "not valid JSON"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(seed="42"), "seed"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids=7), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_valid_values():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, seed=-5, max_tokens=None, min_tokens=3, stop_token_ids=(4, 5))
    assert p.top_k == 0 and p.stop_token_ids == [4, 5] and not p.is_greedy
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(top_p=1.0, min_p=1.0).min_p == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)
