"""Batched sampling on tensors: greedy, temperature, min-p, top-k, top-p, per-request seeds.

The order is vLLM's: banned tokens (min_tokens) are masked first, so greedy rows honour
them too; then temperature, min-p, and top-k / top-p on what is left.

Randomness comes from a counter-based hash of (request seed, output index, token id), so a
request's sample depends only on its own seed and position: never on the other requests in
the batch, and a preempted request resumes with the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.engine.scheduler import ScheduledChunk

_MASK31 = 0x7FFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31, so a 31-bit value times it stays inside int64
# Arbitrary 31-bit constants that keep the seed, step and token streams apart.
_SALT_SEED, _SALT_STEP, _SALT_ROW, _SALT_TOKEN = 0x2545F491, 0x6A09E667 & _MASK31, 0x3C6EF372, 0x510E527F


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


def random_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, step, token id).

    The row hash and the token hash are combined by addition between mixing rounds rather
    than by ``row ^ token``: with XOR, two rows whose hashes agree above the low log2(V) bits
    would get the same numbers merely permuted.
    """
    key = _seed_key(seeds)
    row = _mix31((_mix31(key) + _mix31((steps & _MASK31) ^ _SALT_STEP)) & _MASK31)
    token = _mix31(torch.arange(vocab_size, device=seeds.device) ^ _SALT_TOKEN)
    bits = _mix31((_mix31(row ^ _SALT_ROW)[:, None] + token[None, :]) & _MASK31)
    return (bits.to(torch.float64) + 0.5) / float(1 << 31)


def _to_int64(seed: int) -> int:
    """Any Python int seed as a signed 64-bit value (its low 64 bits), so torch can hold it."""
    return ((seed + (1 << 63)) % (1 << 64)) - (1 << 63)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the output token being sampled
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # Token ids each row must not sample (EOS and stop tokens before min_tokens): row / column indices.
    banned_rows: torch.Tensor | None = None
    banned_cols: torch.Tensor | None = None

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], device: torch.device) -> "SamplingMetadata":
        params = [c.sampling_params for c in chunks]
        temperature = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        banned = [(i, tok) for i, c in enumerate(chunks) for tok in c.banned_token_ids]
        return cls(
            temperature=t(temperature, torch.float32),
            top_k=t(top_k, torch.int64),
            top_p=t(top_p, torch.float32),
            min_p=t(min_p, torch.float32),
            seeds=t([_to_int64(c.sampling_seed) for c in chunks], torch.int64),
            steps=t([c.output_index for c in chunks], torch.int64),
            all_greedy=all(v == 0.0 for v in temperature),
            use_top_k=any(v > 0 for v in top_k),
            use_top_p=any(v < 1.0 for v in top_p),
            use_min_p=any(v > 0.0 for v in min_p),
            banned_rows=t([i for i, _ in banned], torch.int64) if banned else None,
            banned_cols=t([tok for _, tok in banned], torch.int64) if banned else None,
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf (one sort for the whole batch).

    Rows with top_k == 0 and top_p == 1 come back unchanged.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        threshold = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p)[:, None]
        # top_p == 1 is off: without this, tokens whose probability underflows to 0 would be cut.
        drop &= (top_p < 1.0)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits whose probability is below min_p times the row's top probability to -inf."""
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_banned_tokens(logits: torch.Tensor, meta: "SamplingMetadata") -> torch.Tensor:
    if meta.banned_rows is None:
        return logits
    rows, cols = meta.banned_rows, meta.banned_cols
    inside = cols < logits.shape[-1]
    logits = logits.clone()
    logits[rows[inside], cols[inside]] = float("-inf")
    return logits


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] (float32, or cast to it) -> sampled token ids [B]."""
        logits = apply_banned_tokens(logits.float(), meta)
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature == 0.0
        temperature = torch.where(is_greedy, 1.0, meta.temperature)
        logits = logits / temperature[:, None]
        if meta.use_min_p:
            logits = apply_min_p(logits, meta.min_p)
        if meta.use_top_k or meta.use_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k if meta.use_top_k else None, meta.top_p if meta.use_top_p else None)
        probs = logits.softmax(dim=-1)
        # Exponential race (equivalent to Gumbel-max): argmax p_i / E_i samples i with probability p_i.
        exponential = -torch.log(random_uniform(meta.seeds, meta.steps, logits.shape[-1]))
        sampled = (probs.to(torch.float64) / exponential).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)
