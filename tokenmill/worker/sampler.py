"""Batched sampling on tensors: greedy, temperature, top-k, top-p, min-p, per-request seeds.

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


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (xorshift-multiply rounds); int64 in, int64 in [0, 2**31) out."""
    x = ((x >> 16) ^ x) * _HASH_MUL & _MASK31
    x = ((x >> 16) ^ x) * _HASH_MUL & _MASK31
    return (x >> 16) ^ x


def random_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    row = _mix31(_mix31(seeds & _MASK31) ^ (steps & _MASK31))
    token = torch.arange(vocab_size, device=seeds.device)
    bits = _mix31(_mix31(row[:, None] ^ token[None, :]) + 0x2545F491 & _MASK31)
    return (bits.to(torch.float64) + 0.5) / float(1 << 31)


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

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], device: torch.device) -> "SamplingMetadata":
        params = [c.sampling_params for c in chunks]
        temperature = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t(temperature, torch.float32),
            top_k=t(top_k, torch.int64),
            top_p=t(top_p, torch.float32),
            min_p=t(min_p, torch.float32),
            seeds=t([c.sampling_seed for c in chunks], torch.int64),
            steps=t([c.output_index for c in chunks], torch.int64),
            all_greedy=all(v == 0.0 for v in temperature),
            use_top_k=any(v > 0 for v in top_k),
            use_top_p=any(v < 1.0 for v in top_p),
            use_min_p=any(v > 0.0 for v in min_p),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf (one sort for the whole batch)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        threshold = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] float32 -> sampled token ids [B]."""
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature == 0.0
        temperature = torch.where(is_greedy, 1.0, meta.temperature)
        logits = logits / temperature[:, None]
        if meta.use_top_k or meta.use_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k if meta.use_top_k else None, meta.top_p if meta.use_top_p else None)
        probs = logits.softmax(dim=-1)
        if meta.use_min_p:
            floor = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential race (equivalent to Gumbel-max): argmax p_i / E_i samples i with probability p_i.
        exponential = -torch.log(random_uniform(meta.seeds, meta.steps, logits.shape[-1]))
        sampled = (probs.to(torch.float64) / exponential).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)
