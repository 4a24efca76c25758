"""What train-medusa and train-eagle share: the model's own answers to prompts (self-distillation, as
Medusa-2 and EAGLE train), with every computed position's final hidden state kept on the way (a
hidden-state observer on the runner, so no second pass runs), the target's LM head and embedding, and
the chat prompts to generate from."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from tokenmill.bench.datasets import chat_prompt_lines, chat_request
from tokenmill.sampling_params import SamplingParams

# A stand-in user message: the chat template's text before it is where a user turn's content begins.
_USER_SENTINEL = "\u2063tokenmill-user-turn\u2063"


class HiddenStateCollector:
    """A ModelRunner hidden_observer that keeps every computed position's final hidden state, per request.

    The states go into one buffer in the model's dtype (lossless), grown by doubling, not a tensor per
    decode row: with hundreds of thousands of those small long-lived tensors among the forward passes'
    freed activations (a heap tune_malloc never trims), a 768-request run on SmolLM2 once grew to 24 GB
    and was killed (a rerun peaked at 7.5 GB, ~36 KB a position); the buffer holds ~1.2 KB a position in bf16."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, int]] = {}  # per request: position -> row of the buffer
        self._buffer: torch.Tensor | None = None
        self._used = 0

    def __call__(self, chunks, hidden: torch.Tensor, sampled) -> None:
        first = self._append(hidden.detach().cpu())
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            per_request = self.rows.setdefault(chunk.request_id, {})
            for j in range(n):  # a recomputed (preempted) position overwrites its earlier row: the same state
                per_request[chunk.start_pos + j] = first + offset + j
            offset += n

    def _append(self, rows: torch.Tensor) -> int:
        """Copies rows into the buffer; returns the first one's index."""
        if self._buffer is None:
            self._buffer = rows.new_empty((max(4096, len(rows)), rows.shape[1]))
        if self._used + len(rows) > len(self._buffer):
            grown = self._buffer.new_empty((max(2 * len(self._buffer), self._used + len(rows)), self._buffer.shape[1]))
            grown[: self._used] = self._buffer[: self._used]
            self._buffer = grown
        first = self._used
        self._buffer[first : first + len(rows)] = rows
        self._used += len(rows)
        return first

    def first_contiguous(self, request_id: str, end: int) -> int:
        """The first position of the unbroken run of kept positions that ends at end - 1 (positions a
        prefix-cache hit skipped break it)."""
        rows = self.rows[request_id]
        start = end
        while start - 1 in rows:
            start -= 1
        return start

    def sequence(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """The hidden states of positions start..end-1 of a request, [end - start, hidden] in float32 (positions a
        prefix-cache hit skipped are not there: ask only from the last prompt token on, always computed)."""
        rows = self.rows[request_id]
        index = torch.tensor([rows[p] for p in range(start, end)], dtype=torch.int64)
        return self._buffer.index_select(0, index).float()


def target_lm_head(weights, hf_config) -> torch.Tensor:
    """The target's LM head weight from its checkpoint (the input embedding when the two are tied)."""
    heads, embeddings = {}, {}
    for name, tensor in weights:
        if name in ("lm_head.weight",):
            heads[name] = tensor
        elif name.endswith(("embed_tokens.weight", "wte.weight")):
            embeddings[name] = tensor
    found = heads.get("lm_head.weight")
    if found is None or getattr(hf_config, "tie_word_embeddings", False) and embeddings:
        found = next(iter(embeddings.values()), found)
    if found is None:
        raise ValueError("could not find the model's LM head (lm_head.weight or a tied embedding) in its checkpoint")
    return found.float()


def target_embedding(weights) -> torch.Tensor:
    """The target's input embedding weight from its checkpoint."""
    for name, tensor in weights:
        if name.endswith(("embed_tokens.weight", "wte.weight")):
            return tensor.float()
    raise ValueError("could not find the model's input embedding (embed_tokens.weight) in its checkpoint")


def generate_with_states(llm, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams], use_tqdm: bool,
                         command: str) -> tuple[HiddenStateCollector, list, float]:
    """Generate from `prompts` with `llm` (one engine; `params` one for all or one per prompt) while keeping
    every computed position's final hidden state: (the states, the outputs, seconds taken)."""
    engine = llm.llm_engine
    runner = getattr(getattr(engine, "executor", None), "driver_runner", None)
    if runner is None:
        raise ValueError(f"{command} runs one engine: drop data_parallel_size")
    if runner.hidden_observer is not None:
        raise ValueError(f"{command} needs the engine without speculative decoding")
    collector = HiddenStateCollector()
    runner.hidden_observer = collector
    start = time.perf_counter()
    try:
        outputs = llm.generate(list(prompts), params, use_tqdm=use_tqdm)
    finally:
        runner.hidden_observer = None
    return collector, outputs, time.perf_counter() - start


def chat_prompts(tokenizer, path: str | None = None, count: int | None = None) -> list:
    """The first `count` prompts of a file (one per line; default: the package's chat prompts, whose first
    CHAT_TRAIN_PROMPTS are for training), in the model's chat template when it has one."""
    lines = chat_prompt_lines(path)[:count]
    if not has_chat_template(tokenizer):
        return lines
    return in_chat_template(tokenizer, lines)


def in_chat_template(tokenizer, messages: Sequence[str]) -> list[dict]:
    """Each user message as a prompt in the tokenizer's chat template: {"prompt": text, "prompt_token_ids": ids}."""
    prompts = []
    for message in messages:
        text, ids = chat_request(tokenizer, message)
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def self_written_prompts(llm, count: int, seed: int = 0, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 0.95,
                         use_tqdm: bool = False) -> list:
    """Up to `count` user messages the model writes itself, each in its chat template as a prompt (Magpie, Xu
    et al. 2024): sampled from the template's text up to the start of a user turn's content, where an instruct
    model writes what a user would ask. Kept: the distinct, non-empty ones that ended their turn within
    max_tokens. More varied training data than a fixed prompt list: SmolLM2's EAGLE head, scored on the
    benchmark's held-out chat prompts, 45.5% -> 48.1% first-draft top-1 with 384 of them (and their answers)
    beside the 64 hand-written prompts' 12 answers each, at the same training steps."""
    tokenizer = llm.get_tokenizer()
    if not has_chat_template(tokenizer):
        raise ValueError("prompts the model writes itself need a tokenizer with a chat template; set the number of self-written prompts to 0")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _USER_SENTINEL}], tokenize=False, add_generation_prompt=False)
    prefix, _, suffix = text.partition(_USER_SENTINEL)
    end_of_turn = suffix.strip().split("\n")[0].strip()  # e.g. "<|im_end|>"; the EOS token ends a turn anyway
    prefix_ids = list(tokenizer.encode(prefix, add_special_tokens=False))
    found: dict[str, None] = {}  # insertion-ordered, distinct
    for attempt in range(4):  # about 70% of SmolLM2's end their turn in 64 tokens
        wanted = count - len(found)
        if wanted <= 0:
            break
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + 100_000 * (attempt + 1) + i,
                                 stop=[end_of_turn] if end_of_turn else None) for i in range(wanted * 3 // 2 + 8)]
        outputs = llm.generate([{"prompt": prefix, "prompt_token_ids": prefix_ids}] * len(params), params, use_tqdm=use_tqdm)
        for out in outputs:
            message = out.outputs[0].text.strip()
            if out.outputs[0].finish_reason == "stop" and message:
                found.setdefault(message)
    return in_chat_template(tokenizer, list(found)[:count])
