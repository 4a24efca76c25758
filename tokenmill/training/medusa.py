"""Train Medusa heads for a model on text the model generates itself (self-distillation, as Medusa-2's
recipe does when no training set matches the model's own outputs).

1. The engine generates a continuation for each prompt; a hidden-state observer on the runner keeps
   the final hidden state of every position it computes (prompt and output), so no second pass runs.
2. Head i learns to predict, from the hidden state at position t, the token at t + 2 + i (the model's
   own LM head predicts t + 1), over the generated part of each sequence. Each head starts as Medusa
   does, as the target's head: its residual blocks at zero, and the target's LM head (shared, by
   default, and frozen; or a copy of its own).
3. Cross-entropy per head, weighted 0.8^i; Adam (the blocks at lr, the LM heads at a tenth); matmuls
   in bf16 autocast on CPUs with native bf16; a held-out tenth of the sequences gives each head's
   top-1 accuracy, an estimate of how often its draft will be kept.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tokenmill.loader import load_model_source
from tokenmill.models.medusa import MedusaHeads
from tokenmill.sampling_params import SamplingParams
from tokenmill.training.configs import MedusaTrainingConfig
from tokenmill.training.selfdistill import HiddenStateCollector, chat_prompts, generate_with_states, target_lm_head

__all__ = ["MedusaTrainingConfig", "MedusaTrainingReport", "build_examples", "train_medusa_heads", "HiddenStateCollector",
           "chat_prompts", "target_lm_head"]


@dataclass
class MedusaTrainingReport:
    num_sequences: int
    num_positions: int
    generate_s: float
    train_s: float
    accuracy: list[float] = field(default_factory=list)  # per head, top-1 on the held-out positions


def build_examples(collector: HiddenStateCollector, outputs, num_heads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: hidden states of its generated positions [n, hidden] and their targets [n, num_heads]
    (head i: the token 2 + i positions ahead; -100 past the end)."""
    hiddens, targets = [], []
    for out in outputs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        first, last = len(out.prompt_token_ids) - 1, len(tokens) - 3  # t from the last prompt token to where t + 2 exists
        if last < first:
            continue
        hidden = collector.sequence(out.request_id, first, last + 1)
        ids = torch.tensor(tokens + [-100] * num_heads, dtype=torch.int64)
        positions = torch.arange(first, last + 1)
        target = torch.stack([ids[positions + 2 + i] for i in range(num_heads)], dim=1)
        hiddens.append(hidden)
        targets.append(target)
    return hiddens, targets


def train_medusa_heads(llm, prompts: Sequence, config: MedusaTrainingConfig, use_tqdm: bool = True) -> tuple[MedusaHeads, MedusaTrainingReport]:
    """Generate with `llm` (an LLM: one engine, any tensor_parallel_size) from `prompts`, then train heads."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=config.seed)
    collector, outputs, generate_s = generate_with_states(llm, prompts, params, use_tqdm, "train-medusa")

    hiddens, targets = build_examples(collector, outputs, config.num_heads)
    if not hiddens:
        raise ValueError("no training positions: the prompts generated fewer than 3 tokens each")
    rng = random.Random(config.seed)
    order = list(range(len(hiddens)))
    rng.shuffle(order)
    num_held = max(1, int(len(order) * config.held_out)) if len(order) > 1 else 0
    held, used = order[:num_held], order[num_held:]
    train_h, train_t = torch.cat([hiddens[i] for i in used]), torch.cat([targets[i] for i in used])

    hidden_size, vocab_size = train_h.shape[1], int(engine.vocab_size)
    torch.manual_seed(config.seed)
    heads = MedusaHeads(hidden_size, vocab_size, config.num_heads, config.num_layers, config.shared_lm_head)
    source = load_model_source(replace(engine.config.model, skip_tokenizer_init=True))
    shared = torch.nn.Linear(hidden_size, vocab_size, bias=False).requires_grad_(False)
    with torch.no_grad():
        shared.weight.copy_(target_lm_head(source.weights(), source.hf_config)[:vocab_size])
        for head in heads.heads:
            if head.lm_head is not None:
                head.lm_head.weight.copy_(shared.weight)
            for block in head.blocks:
                block.weight.zero_()  # Medusa's start: each head is the target's head
                block.bias.zero_()
    groups = [{"params": [p for head in heads.heads for p in head.blocks.parameters()], "lr": config.lr}]
    if not config.shared_lm_head:
        groups.append({"params": [head.lm_head.weight for head in heads.heads], "lr": config.lr / 10})
    optimizer = torch.optim.Adam(groups)
    weights = [config.head_decay ** i for i in range(config.num_heads)]
    steps_per_epoch = math.ceil(len(train_h) / config.batch_size)
    # The vocabulary-wide matmuls in bf16 where the CPU has native bf16 (about 2x faster; the weights and
    # the optimizer stay float32); float32 elsewhere, where bf16 matmuls crawl.
    fast_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    start = time.perf_counter()
    heads.train()
    bar = tqdm(range(config.epochs), desc="Training Medusa heads", unit="epoch", disable=not use_tqdm, dynamic_ncols=True)
    for _ in bar:
        permutation = torch.randperm(len(train_h))
        total = 0.0
        for step in range(steps_per_epoch):
            index = permutation[step * config.batch_size : (step + 1) * config.batch_size]
            h, t = train_h[index], train_t[index]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast_bf16):
                loss = sum(w * F.cross_entropy(head(h, shared).float(), t[:, i], ignore_index=-100)
                           for i, (head, w) in enumerate(zip(heads.heads, weights)))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        bar.set_postfix_str(f"loss {total / steps_per_epoch:.3f}")
    heads.eval()
    train_s = time.perf_counter() - start
    accuracy = []
    if held:
        held_h, held_t = torch.cat([hiddens[i] for i in held]), torch.cat([targets[i] for i in held])
        with torch.no_grad():
            for i, head in enumerate(heads.heads):
                valid = held_t[:, i] != -100
                accuracy.append(float((head(held_h[valid], shared).argmax(-1) == held_t[valid, i]).float().mean()) if valid.any() else 0.0)
    report = MedusaTrainingReport(len(hiddens), int(sum(len(h) for h in hiddens)), generate_s, train_s, accuracy)
    return heads, report
