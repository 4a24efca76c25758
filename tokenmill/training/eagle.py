"""Train an EAGLE draft head for a model on text the model generates itself (self-distillation, as
EAGLE does), sharing train-medusa's generation (training/selfdistill.py).

1. The engine generates a continuation for each prompt (and extra_samples sampled ones), and for each of
   self_prompts user messages it writes itself (selfdistill.self_written_prompts), keeping every computed
   position's final hidden state f[t] (what the model's LM head reads).
2. Row t of the head reads [embedding of x[t + 1], f[t]] and learns f[t + 1] (smooth L1, EAGLE's
   regression loss) and, through the target's frozen LM head, the target's most likely token after
   x[t + 1] (cross-entropy): the argmax of the LM head at f[t + 1], which is what a greedy target keeps
   and what a sampling one draws most often. (The generated x[t + 2] is that token only for the greedy
   answers; as the label of the sampled ones it taught the head their sampling noise: held-out top-1
   35.3% -> 38.8% and the second chained draft 31% -> 38% on SmolLM2.) Teacher forcing over whole
   sequences (causal attention among a sequence's rows; several sequences packed per step with a
   block-diagonal mask). A little uniform noise on the input states, as EAGLE adds, so the head
   tolerates its own guessed states when it chains.
3. The draft vocabulary (tokenmill's extension, models/eagle.py): the draft_vocab most frequent labels,
   the only tokens the drafts may then take (their rows of the LM head only). Training scores those rows
   only too (labels outside them are skipped), as the drafts will: 2.5x faster steps on SmolLM2.
4. AdamW with a linear warm-up, cosine decay and gradient clipping (EAGLE's 0.5); matmuls in bf16
   autocast on CPUs with native bf16; a held-out tenth of the sequences gives the top-1 accuracy of the
   first draft (an estimate of how often it will be kept).

EagleTrainingHead is the same head in plain PyTorch (transformers' Llama decoder layers, autograd),
under EAGLE-1/2's checkpoint names: its state_dict is what the loader reads (loader/eagle.py).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from tokenmill.loader import load_model_source
from tokenmill.sampling_params import SamplingParams
from tokenmill.training.configs import EagleTrainingConfig
from tokenmill.training.selfdistill import generate_with_states, has_chat_template, self_written_prompts, target_embedding, target_lm_head

logger = logging.getLogger(__name__)

# Config keys that are not the draft layers' own (layer_types would describe the target's layers).
_NOT_LAYER_KEYS = ("architectures", "model_type", "auto_map", "torch_dtype", "dtype", "layer_types")


@dataclass
class EagleTrainingReport:
    num_sequences: int
    num_positions: int
    num_self_prompts: int
    generate_s: float
    train_s: float
    accuracy: float | None = None  # top-1 of the first draft on the held-out positions (teacher-forced states) against the labels
    vocab_coverage: float | None = None  # of the held-out positions' labels, the share inside the draft vocabulary
    losses: list[float] = field(default_factory=list)  # per epoch


def eagle_layers_config(hf_config, num_layers: int):
    """The draft layers' Llama config: the target's shapes (hidden, heads, MLP, RoPE), num_layers layers."""
    from transformers import LlamaConfig

    values = {k: v for k, v in hf_config.to_dict().items() if k not in _NOT_LAYER_KEYS}
    config = LlamaConfig(**{**values, "num_hidden_layers": num_layers, "tie_word_embeddings": False})
    config._attn_implementation = "sdpa"
    return config


class EagleTrainingHead(nn.Module):
    """fc over [embedding, state], then Llama decoder layers (the first without its input norm), no final
    norm: EAGLE-1/2's draft head, on [batch, rows, hidden] with an explicit attention mask."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.draft_vocab: torch.Tensor | None = None  # token ids the drafts may take (train_eagle_head sets it)
        std = getattr(config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, states [B, T, hidden]; positions [B, T]; mask [B, 1, T, T] additive (None: causal)."""
        hidden = self.fc(torch.cat([embeds, states.to(embeds.dtype)], dim=-1))
        if mask is None:
            mask = causal_mask(torch.zeros(hidden.shape[:2], dtype=torch.int64), hidden.dtype)
        cos_sin = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_embeddings=cos_sin)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under EAGLE-1/2's names (fc.*, layers.{i}.*), and the draft vocabulary if any."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        if getattr(self, "draft_vocab", None) is not None:
            state["draft_vocab"] = self.draft_vocab
        return state

    def eagle_config(self) -> dict:
        config = self.config.to_dict()
        config.pop("_attn_implementation", None)
        return {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True}


def lr_factor(step: int, total_steps: int, config: EagleTrainingConfig) -> float:
    """The learning rate at an optimizer step over the peak: linear warm-up, then cosine decay to min_lr_frac."""
    warmup = max(1, round(config.warmup_frac * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return config.min_lr_frac + (1 - config.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def causal_mask(sequence_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask [B, 1, T, T]: row i sees rows j <= i of its own sequence (sequence_ids [B, T])."""
    t = sequence_ids.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool).tril() & (sequence_ids[:, :, None] == sequence_ids[:, None, :])
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


@dataclass
class _Sequence:
    states: torch.Tensor  # [n + 1, hidden]: f[t] for t = first .. first + n
    tokens: torch.Tensor  # [n + 2]: x[t] for t = first .. first + n + 1
    first: int  # the position of states[0]
    labels: torch.Tensor | None = None  # [n]: the target's most likely token at f[t + 1] for rows t (set_labels)


def set_labels(sequences: list[_Sequence], lm_head: torch.Tensor, fast_bf16: bool, rows_per_matmul: int = 4096) -> None:
    """Each sequence's labels: the argmax of the target's LM head at its states f[t + 1], in matmuls of a few
    thousand rows (a [rows, vocab] logits block at a time)."""
    states = torch.cat([s.states[1:] for s in sequences])
    labels = torch.empty(len(states), dtype=torch.int64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast_bf16):
        for start in range(0, len(states), rows_per_matmul):
            labels[start : start + rows_per_matmul] = F.linear(states[start : start + rows_per_matmul], lm_head).argmax(-1)
    for seq, piece in zip(sequences, labels.split([len(s.states) - 1 for s in sequences])):
        seq.labels = piece


def build_sequences(collector, outputs) -> list[_Sequence]:
    """Per generated sequence, the unbroken run of kept states up to its last computed position and its tokens."""
    sequences = []
    for out in outputs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        end = len(tokens) - 1  # the last token's state is never computed
        first = collector.first_contiguous(out.request_id, end)
        if end - first < 2:
            continue
        sequences.append(_Sequence(collector.sequence(out.request_id, first, end), torch.tensor(tokens[first:], dtype=torch.int64), first))
    return sequences


def _pack(sequences: list[_Sequence], tokens_per_step: int) -> list[list[_Sequence]]:
    packs, current, size = [], [], 0
    for seq in sequences:
        if current and size + len(seq.states) - 1 > tokens_per_step:
            packs.append(current)
            current, size = [], 0
        current.append(seq)
        size += len(seq.states) - 1
    if current:
        packs.append(current)
    return packs


def _batch(pack: list[_Sequence], embedding: torch.Tensor):
    """One packed row: inputs (embeddings of x[t + 1], states f[t]), positions, mask, and targets
    (f[t + 1], the labels) for t over each sequence's rows."""
    embeds = torch.cat([embedding[s.tokens[1:-1]] for s in pack])[None]
    states = torch.cat([s.states[:-1] for s in pack])[None]
    positions = torch.cat([torch.arange(s.first, s.first + len(s.states) - 1) for s in pack])[None]
    ids = torch.cat([torch.full((len(s.states) - 1,), i) for i, s in enumerate(pack)])[None]
    target_states = torch.cat([s.states[1:] for s in pack])
    labels = torch.cat([s.labels for s in pack])
    return embeds, states, positions, ids, target_states, labels


def train_eagle_head(llm, prompts: Sequence, config: EagleTrainingConfig, use_tqdm: bool = True) -> tuple[EagleTrainingHead, EagleTrainingReport]:
    """Generate with `llm` (one engine) from `prompts` and from prompts it writes itself, then train an EAGLE head
    on what it generated."""
    engine = llm.llm_engine
    start = time.perf_counter()
    written = []
    if config.self_prompts and has_chat_template(llm.get_tokenizer()):
        written = self_written_prompts(llm, config.self_prompts, config.seed, use_tqdm=use_tqdm)
    elif config.self_prompts:
        logger.warning("the model has no chat template to write its own prompts with: training on the given prompts only")
    params = [SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=config.seed)]
    params += [SamplingParams(max_tokens=config.max_tokens, temperature=config.sample_temperature, seed=config.seed + 1 + i)
               for i in range(max(config.extra_samples, config.self_prompt_samples))]
    own, other = params[: 1 + config.extra_samples], params[: 1 + config.self_prompt_samples]
    requests = [p for p in prompts for _ in own] + [p for p in written for _ in other]
    collector, outputs, _ = generate_with_states(llm, requests, own * len(prompts) + other * len(written), use_tqdm, "train-eagle")
    generate_s = time.perf_counter() - start
    sequences = build_sequences(collector, outputs)
    if not sequences:
        raise ValueError("no training positions: the prompts generated fewer than 3 tokens each")
    rng = random.Random(config.seed)
    rng.shuffle(sequences)
    num_held = max(1, int(len(sequences) * config.held_out)) if len(sequences) > 1 and config.held_out > 0 else 0
    held, used = sequences[:num_held], sequences[num_held:]

    source = load_model_source(replace(engine.config.model, skip_tokenizer_init=True))
    vocab_size = int(engine.vocab_size)
    lm_head = target_lm_head(source.weights(), source.hf_config)[:vocab_size]
    embedding = target_embedding(source.weights())
    # bf16 matmuls where the CPU has them natively (about 2x faster; weights and optimizer stay float32).
    fast_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    set_labels(sequences, lm_head, fast_bf16)
    vocab = torch.arange(vocab_size)
    if config.draft_vocab and config.draft_vocab < vocab_size:
        counts = torch.bincount(torch.cat([s.labels for s in used]), minlength=vocab_size)
        vocab = counts.topk(config.draft_vocab).indices.sort().values
    head_rows = lm_head[vocab]  # the LM head's rows the drafts may take, all that training scores
    index_in_vocab = torch.full((vocab_size,), -100, dtype=torch.int64)  # a label's row in head_rows (-100: outside)
    index_in_vocab[vocab] = torch.arange(len(vocab))
    torch.manual_seed(config.seed)
    head = EagleTrainingHead(eagle_layers_config(source.hf_config, config.num_layers))
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    total_steps = config.epochs * len(_pack(used, config.tokens_per_step))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
    scale = float(torch.cat([s.states for s in used]).pow(2).mean().sqrt())
    losses = []
    start = time.perf_counter()
    head.train()
    bar = tqdm(range(config.epochs), desc="Training the EAGLE head", unit="epoch", disable=not use_tqdm, dynamic_ncols=True)
    for _ in bar:
        rng.shuffle(used)
        total, steps = 0.0, 0
        for pack in _pack(used, config.tokens_per_step):
            embeds, states, positions, ids, target_states, labels = _batch(pack, embedding)
            if config.noise:
                states = states + (torch.rand_like(states) - 0.5) * (2 * config.noise * scale)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast_bf16):
                guess = head(embeds, states, positions, causal_mask(ids, torch.float32))[0].float()
                logits = F.linear(guess, head_rows).float()
            targets = index_in_vocab[labels]
            token_loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / max(1, int((targets >= 0).sum()))
            loss = F.smooth_l1_loss(guess, target_states) + config.token_loss_weight * token_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
            optimizer.step()
            schedule.step()
            total, steps = total + float(loss.detach()), steps + 1
        losses.append(total / steps)
        bar.set_postfix_str(f"loss {losses[-1]:.3f}")
    head.eval()
    train_s = time.perf_counter() - start
    if len(vocab) < vocab_size:
        head.draft_vocab = vocab
    accuracy = coverage = None
    if held:
        right = inside = count = 0
        with torch.no_grad():
            for pack in _pack(held, config.tokens_per_step):
                embeds, states, positions, ids, _, labels = _batch(pack, embedding)
                guess = head(embeds, states, positions, causal_mask(ids, torch.float32))[0]
                top1 = vocab[F.linear(guess, head_rows).argmax(-1)]
                right += int((top1 == labels).sum())
                inside += int((index_in_vocab[labels] >= 0).sum())
                count += len(labels)
        accuracy, coverage = right / count, inside / count
    report = EagleTrainingReport(len(sequences), sum(len(s.states) - 1 for s in sequences), len(written), generate_s, train_s,
                                 accuracy, coverage, losses)
    return head, report
