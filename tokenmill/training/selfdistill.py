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


class HiddenStateCollector:
    """A ModelRunner hidden_observer that keeps every computed position's final hidden state, per request."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, chunks, hidden: torch.Tensor, sampled) -> None:
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            states = hidden[offset : offset + n].float().cpu()
            per_request = self.rows.setdefault(chunk.request_id, {})
            for j in range(n):  # a recomputed (preempted) position overwrites its earlier row: the same state
                per_request[chunk.start_pos + j] = states[j]
            offset += n

    def first_contiguous(self, request_id: str, end: int) -> int:
        """The first position of the unbroken run of kept positions that ends at end - 1 (positions a
        prefix-cache hit skipped break it)."""
        rows = self.rows[request_id]
        start = end
        while start - 1 in rows:
            start -= 1
        return start

    def sequence(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """The hidden states of positions start..end-1 of a request, [end - start, hidden] (positions a
        prefix-cache hit skipped are not there: ask only from the last prompt token on, always computed)."""
        rows = self.rows[request_id]
        return torch.stack([rows[p] for p in range(start, end)])


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
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return lines
    prompts = []
    for line in lines:
        text, ids = chat_request(tokenizer, line)
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts
