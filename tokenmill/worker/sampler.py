"""Batched sampling on tensors: penalties, logit bias, allowed / banned tokens, greedy,
temperature, min-p, top-k, top-p, per-request seeds, logprobs.

The order is vLLM's: on the raw logits first allowed_token_ids, bad words and the min_tokens
ban (masks), then logit_bias, then the repetition / frequency / presence penalties, so
greedy rows honour all of them too; then temperature, min-p, and top-k / top-p on what is left.
Every step of it is one tensor operation over the whole batch; per-request data reaches it
as flat index tensors (row, token id) built once per step.

Logprobs follow vLLM v1's default ``raw_logprobs``: log-softmax of the raw model logits,
before any penalty, mask or temperature. The sampled token's logprob is computed for every
row (cheap; cumulative_logprob, best_of and beam search need it); its rank and the top-k
alternatives only for rows that ask for logprobs.

Randomness comes from a counter-based hash of (request seed, output index): one uniform per row,
drawn by inverse CDF over the row's probabilities, so a request's sample depends only on its own
seed, position and distribution: never on the other requests in the batch, and a preempted
request resumes with the same tokens. (One number per row, not one per vocabulary entry: an
exponential race over a [rows, vocab] table of hashed uniforms cost 32 ms a step at 32 rows of a
49,152-token vocabulary, more than the model's whole decode step; the cumulative sum costs ~1 ms.)
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import nn

from tokenmill.engine.messages import ScheduledChunk
from tokenmill.kernels import cpu as cpu_kernels

_MASK31 = 0x7FFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31, so a 31-bit value times it stays inside int64
# Arbitrary 31-bit constants that keep the seed, step and row streams and the low bits apart.
_SALT_SEED, _SALT_STEP, _SALT_ROW, _SALT_LOW = 0x2545F491, 0x6A09E667 & _MASK31, 0x3C6EF372, 0x510E527F

def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (xorshift-multiply rounds); int64 in, int64 in [0, 2**31) out.

    A bijection on [0, 2**31): distinct inputs give distinct outputs.
    """
    x = ((x >> 16) ^ x) * _HASH_MUL & _MASK31
    x = ((x >> 16) ^ x) * _HASH_MUL & _MASK31
    return (x >> 16) ^ x


def _seed_key(seeds: torch.Tensor) -> torch.Tensor:
    """Fold all 64 bits of each int64 seed into a 31-bit key (seeds differing only in high bits differ)."""
    low = seeds & _MASK31
    mid = (seeds >> 31) & _MASK31
    top = (seeds >> 62) & 3
    return _mix31(_mix31(_mix31(low ^ _SALT_SEED) ^ mid) ^ top)


def random_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] float64 uniforms in [0, 1) with 53 random bits, a pure function of (seed, step)."""
    key = _seed_key(seeds)
    row = _mix31((_mix31(key) + _mix31((steps & _MASK31) ^ _SALT_STEP)) & _MASK31)
    high = _mix31(row ^ _SALT_ROW)  # 31 bits
    low = _mix31(high ^ _SALT_LOW) >> 9  # 22 more
    return ((high << 22) | low).to(torch.float64) / float(1 << 53)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniforms[i] times the row's total
    ([B, V] probabilities, [B] uniforms in [0, 1)). A token of probability 0 is never chosen: the
    cumulative sum does not rise there, and u * total rounding up to the total falls back to the last
    token that has any probability."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    threshold = (uniforms * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return torch.minimum(sampled, cdf.argmax(dim=-1))  # argmax: the first index at the total


def _to_int64(seed: int) -> int:
    """Any Python int seed as a signed 64-bit value (its low 64 bits), so torch can hold it."""
    return ((seed + (1 << 63)) % (1 << 64)) - (1 << 63)


def _flat_pairs(rows: list[int], lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index, token id) pairs for every token of every list, flattened with numpy."""
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    ids = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=total)
    return np.repeat(np.asarray(rows, dtype=np.int64), lengths), ids


def banned_bad_words(bad_words_token_ids, output_token_ids) -> list[int]:
    """vLLM's bad words rule: a word's last token is banned when its other tokens end the output so far
    (a one-token word is always banned)."""
    banned = []
    num_out = len(output_token_ids)
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > num_out:
            continue
        if prefix == 0 or output_token_ids[num_out - prefix :] == list(word[:-1]):
            banned.append(word[-1])
    return banned


@dataclass
class SamplingMetadata:
    # The random sampling's per-row settings; None when every row is greedy (all_greedy), which reads
    # none of them: a batch of greedy decodes then makes no tensor here at all (six small tensors were
    # ~0.1 ms of a one-request decode step, the step's Python running on caches its forward pass emptied).
    temperature: torch.Tensor | None  # [B] float32; 0 = greedy
    top_k: torch.Tensor | None  # [B] int64; 0 = off
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    seeds: torch.Tensor | None  # [B] int64
    steps: torch.Tensor | None  # [B] int64, index of the output token being sampled
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # Token ids each row must not sample (EOS and stop tokens before min_tokens, bad words): row / column indices.
    banned_rows: torch.Tensor | None = None
    banned_cols: torch.Tensor | None = None
    # allowed_token_ids: the rows that are restricted, and the (row, token id) pairs they keep.
    allowed_restricted_rows: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None
    allowed_cols: torch.Tensor | None = None
    # logit_bias as (row, token id, bias) triples.
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Penalties ([B] each; None when no row uses any) and the token history they count:
    # output tokens of every penalized row, prompt tokens of rows with a repetition penalty.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_rows: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None
    prompt_rows: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    # Logprobs: the largest top-k any row asks for (None: no row asks; 0: only the sampled token's rank).
    max_num_logprobs: int | None = None
    # Structured output: xgrammar's packed bitmask, int32 [B, ceil(V / 32)], bit j of word i set when
    # token 32 * i + j is allowed. Set by the runner; applied before everything else, as in vLLM.
    grammar_bitmask: torch.Tensor | None = None

    @property
    def use_penalties(self) -> bool:
        return self.presence_penalty is not None

    @property
    def changes_logits(self) -> bool:
        """Whether any row has a mask, bias or penalty (apply_logits_processors would change the logits)."""
        return (
            self.allowed_restricted_rows is not None or self.banned_rows is not None or self.bias_rows is not None or self.use_penalties
        )

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], device: torch.device) -> "SamplingMetadata":
        params = [c.sampling_params for c in chunks]
        temperature = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]

        def t(values, dtype):
            if isinstance(values, np.ndarray):
                return torch.from_numpy(values).to(device=device, dtype=dtype)
            return torch.tensor(values, dtype=dtype, device=device)

        banned = [(i, tok) for i, c in enumerate(chunks) for tok in c.banned_token_ids]
        for i, c in enumerate(chunks):
            if c.bad_words_token_ids and c.sample:
                banned.extend((i, tok) for tok in banned_bad_words(c.bad_words_token_ids, c.output_token_ids))
        all_greedy = all(v == 0.0 for v in temperature)
        meta = cls(
            temperature=None if all_greedy else t(temperature, torch.float32),
            top_k=None if all_greedy else t(top_k, torch.int64),
            top_p=None if all_greedy else t(top_p, torch.float32),
            min_p=None if all_greedy else t(min_p, torch.float32),
            seeds=None if all_greedy else t([_to_int64(c.sampling_seed) for c in chunks], torch.int64),
            steps=None if all_greedy else t([c.output_index for c in chunks], torch.int64),
            all_greedy=all_greedy,
            use_top_k=any(v > 0 for v in top_k),
            use_top_p=any(v < 1.0 for v in top_p),
            use_min_p=any(v > 0.0 for v in min_p),
            banned_rows=t([i for i, _ in banned], torch.int64) if banned else None,
            banned_cols=t([tok for _, tok in banned], torch.int64) if banned else None,
        )

        restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if restricted:
            rows, cols = _flat_pairs(restricted, [params[i].allowed_token_ids for i in restricted])
            meta.allowed_restricted_rows = t(restricted, torch.int64)
            meta.allowed_rows, meta.allowed_cols = t(rows, torch.int64), t(cols, torch.int64)

        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            rows, cols = _flat_pairs(biased, [list(params[i].logit_bias) for i in biased])
            values = list(chain.from_iterable(params[i].logit_bias.values() for i in biased))
            meta.bias_rows, meta.bias_cols = t(rows, torch.int64), t(cols, torch.int64)
            meta.bias_values = t(values, torch.float32)

        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalized:
            meta.presence_penalty = t([p.presence_penalty for p in params], torch.float32)
            meta.frequency_penalty = t([p.frequency_penalty for p in params], torch.float32)
            meta.repetition_penalty = t([p.repetition_penalty for p in params], torch.float32)
            rows, ids = _flat_pairs(penalized, [chunks[i].output_token_ids for i in penalized])
            meta.output_rows, meta.output_ids = t(rows, torch.int64), t(ids, torch.int64)
            repeat = [i for i in penalized if params[i].repetition_penalty != 1.0]
            if repeat:
                rows, ids = _flat_pairs(repeat, [chunks[i].prompt_token_ids for i in repeat])
                meta.prompt_rows, meta.prompt_ids = t(rows, torch.int64), t(ids, torch.int64)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        return meta


# -- logits processors (vLLM's order: allowed, banned, bias, penalties) --------------------------------


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Tokens whose bit is clear in the row's packed bitmask get -inf (a row of all ones is untouched)."""
    if bitmask is None:
        return logits
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32)
    if logits.dtype == torch.float32 and bitmask.shape[1] * 32 >= logits.shape[-1]:
        try:  # xgrammar's kernel (C++ on CPU, CUDA/Triton on GPU): several times faster than the torch ops below
            from xgrammar import apply_token_bitmask_inplace
        except ImportError:
            pass
        else:
            out = logits.clone()
            apply_token_bitmask_inplace(out, bitmask, vocab_size=logits.shape[-1])
            return out
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(device=logits.device, dtype=torch.int32)[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def apply_allowed_token_ids(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Rows with allowed_token_ids keep only those tokens; every other row is untouched."""
    if meta.allowed_restricted_rows is None:
        return logits
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    mask[meta.allowed_restricted_rows] = True
    mask[meta.allowed_rows, meta.allowed_cols] = False
    return logits.masked_fill(mask, float("-inf"))


def apply_banned_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.banned_rows is None:
        return logits
    rows, cols = meta.banned_rows, meta.banned_cols
    inside = cols < logits.shape[-1]
    logits = logits.clone()
    logits[rows[inside], cols[inside]] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.bias_rows is None:
        return logits
    return logits.index_put((meta.bias_rows, meta.bias_cols), meta.bias_values, accumulate=True)


def token_bin_counts(rows: torch.Tensor, ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] float32: how often each token id occurs in each row's list."""
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(0, rows * vocab_size + ids, torch.ones_like(ids, dtype=torch.float32))
    return counts.view(num_rows, vocab_size)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF: positive logits divided by it, negative
    ones multiplied), then frequency (times the count) and presence penalties over output tokens
    (OpenAI). Rows with no penalty come back bit for bit unchanged."""
    if not meta.use_penalties:
        return logits
    num_rows, vocab = logits.shape
    output_counts = token_bin_counts(meta.output_rows, meta.output_ids, num_rows, vocab)
    output_mask = output_counts > 0
    if meta.prompt_rows is not None:
        seen = output_mask | (token_bin_counts(meta.prompt_rows, meta.prompt_ids, num_rows, vocab) > 0)
        penalty = torch.where(seen, meta.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - meta.frequency_penalty[:, None] * output_counts
    return logits - meta.presence_penalty[:, None] * output_mask


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Everything that may change even a greedy choice, on the raw logits, in vLLM's order."""
    logits = apply_allowed_token_ids(logits, meta)
    logits = apply_banned_tokens(logits, meta)
    logits = apply_logit_bias(logits, meta)
    return apply_penalties(logits, meta)


# -- sampling filters ----------------------------------------------------------------------------------


TOP_P_CANDIDATES = 1024  # top-p looks for each row's nucleus among its most likely tokens first


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. Rows with top_k == 0 and top_p == 1
    come back unchanged.

    top-k keeps the logits at least the k-th largest (ties with it too). top-p keeps, most likely first,
    each token while the probability before it is below p. Neither sorts the vocabulary: top-k takes
    `torch.topk` of the largest k asked for, and top-p works on each row's `candidates` most likely tokens,
    which hold the nucleus unless the row is flatter than that (those rows alone fall back to a full
    sort): a sort of [rows, vocab] each step cost more than the rest of sampling.
    """
    vocab = logits.shape[-1]
    if top_k is not None:
        active = (top_k > 0) & (top_k < vocab)
        if bool(active.any()):
            k = torch.where(active, top_k, 1)
            values = logits.topk(int(k.max()), dim=-1).values  # most likely first
            kth = values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(active[:, None] & (logits < kth), float("-inf"))
    if top_p is None or not bool((top_p < 1.0).any()):
        return logits
    probs = logits.softmax(dim=-1)
    n = min(candidates, vocab)
    top_probs, top_ids = probs.topk(n, dim=-1)
    through = top_probs.cumsum(dim=-1)
    # top_p == 1 is off: without this, tokens whose probability underflows to 0 would be cut.
    on = (top_p < 1.0)[:, None]
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top_ids, (through - top_probs < top_p[:, None]) | ~on)
    # Rows whose candidates hold less than p: the nucleus reaches past them, so they take the full sort.
    short = (through[:, -1] < top_p) & (top_p < 1.0) & (n < vocab)
    if bool(short.any()):
        flat = probs[short]
        order = flat.argsort(dim=-1, descending=True)
        ordered = flat.gather(1, order)
        kept = ordered.cumsum(dim=-1) - ordered < top_p[short][:, None]
        keep[short] = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, order, kept)
    return logits.masked_fill(~keep & on, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits whose probability is below min_p times the row's top probability to -inf."""
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


# -- logprobs --------------------------------------------------------------------------------------------


@dataclass
class LogprobsTensors:
    """Logprobs of one token per row: its logprob and rank (1 = most likely), and the top-k alternatives."""

    token_logprobs: torch.Tensor  # [N] float32
    ranks: torch.Tensor | None = None  # [N] int64
    topk_ids: torch.Tensor | None = None  # [N, k] most likely first
    topk_logprobs: torch.Tensor | None = None  # [N, k]


def argmax_and_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and float32 logsumexp ([N, V] -> [N], [N]): one pass in tokenmill's CPU kernel
    where it is built (torch's CPU argmax alone is ten times slower than a max), torch ops elsewhere.
    Widening bf16/fp16 to float32 is exact, so either input dtype gives the same numbers."""
    if cpu_kernels.use_cpu_kernels(logits):
        return cpu_kernels.argmax_logsumexp(logits)
    logits = logits.float()
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp, computed as argmax_and_logsumexp does, so a logprob is the same number
    whichever path computed it."""
    if cpu_kernels.use_cpu_kernels(logits):
        return cpu_kernels.argmax_logsumexp(logits)[1]
    return torch.logsumexp(logits.float(), dim=-1)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int | None, lse: torch.Tensor | None = None
) -> LogprobsTensors:
    """Log-softmax of `logits` ([N, V] float32) at `token_ids` ([N]); with num_logprobs (k >= 0) also the
    tokens' ranks (how many tokens are at least as likely, itself included) and the k most likely tokens.

    Every logprob is `logit - logsumexp(row)`, so a token's logprob is the same number wherever it shows up.
    lse: the rows' logsumexp where the caller has it already.
    """
    lse = (row_logsumexp(logits) if lse is None else lse)[:, None]
    chosen = logits.gather(1, token_ids[:, None])
    out = LogprobsTensors(token_logprobs=(chosen - lse)[:, 0])
    if num_logprobs is None:
        return out
    out.ranks = (logits >= chosen).sum(dim=-1)
    k = min(num_logprobs, logits.shape[-1])
    values, ids = logits.topk(k, dim=-1)
    out.topk_ids, out.topk_logprobs = ids, values - lse
    return out


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] sampled token ids
    logprobs: LogprobsTensors  # of the sampled tokens, from the raw logits


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] (float32, or cast to it) -> sampled token ids [B]."""
        return self.sample(logits, meta).token_ids

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample a token per row; with the raw logprob of each sampled token (and ranks / top-k when asked)."""
        # The grammar mask comes first and counts as part of the model's distribution, as in vLLM
        # (whose runner masks the logits before its sampler sees them).
        if meta.all_greedy and meta.grammar_bitmask is None and meta.max_num_logprobs is None and not meta.changes_logits:
            # Plain greedy: straight from the model's logits, without a float32 copy of [B, vocab]
            # (5 ms a step at batch 200); the numbers are the same, widening being exact.
            greedy, lse = argmax_and_logsumexp(logits)
            chosen = logits.gather(1, greedy[:, None])[:, 0].float()
            return SamplerOutput(token_ids=greedy, logprobs=LogprobsTensors(token_logprobs=chosen - lse))
        raw = apply_grammar_bitmask(logits.float(), meta.grammar_bitmask)
        processed = apply_logits_processors(raw, meta)
        greedy, lse = argmax_and_logsumexp(raw)
        if processed is not raw:  # penalties, bias or bans may change even the greedy choice
            greedy = processed.argmax(dim=-1)
        token_ids = self._sample(processed, greedy, meta)
        return SamplerOutput(token_ids=token_ids, logprobs=compute_logprobs(raw, token_ids, meta.max_num_logprobs, lse))

    @staticmethod
    def _sample(logits: torch.Tensor, greedy: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature == 0.0
        temperature = torch.where(is_greedy, 1.0, meta.temperature)
        logits = logits / temperature[:, None]
        if meta.use_min_p:
            logits = apply_min_p(logits, meta.min_p)
        if meta.use_top_k or meta.use_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k if meta.use_top_k else None, meta.top_p if meta.use_top_p else None)
        sampled = inverse_cdf_sample(logits.softmax(dim=-1), random_uniform(meta.seeds, meta.steps))
        return torch.where(is_greedy, greedy, sampled)
