"""Perplexity of a model on a fixed text, through the engine itself (prompt logprobs): what a
quantization method or a KV cache dtype costs in accuracy.

The text is cut into windows of `window` tokens, each scored from its start (no context carried
over), as llama.cpp's `llama-perplexity` does; every token but a window's first counts. The
default text is the Constitution of the United States (public domain, about 5,800 SmolLM2 tokens;
the copy in the wordcloud package's examples), shipped in tokenmill/bench/data/.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEXT = Path(__file__).parent / "data" / "us_constitution.txt"


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per token
    tokens_scored: int
    windows: int
    seconds: float


def window_token_ids(token_ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of `window` tokens; a last window shorter than 2 tokens scores nothing and is dropped."""
    windows = [token_ids[start:start + window] for start in range(0, len(token_ids), window)]
    return [w for w in windows if len(w) >= 2]


def score_windows(llm, windows: list[list[int]]) -> PerplexityResult:
    """Perplexity over the windows, each token's log-probability given the tokens before it in its window."""
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    total, count = 0.0, 0
    for window, output in zip(windows, outputs):
        for position, token_id in enumerate(window[1:], start=1):
            total -= output.prompt_logprobs[position][token_id].logprob
            count += 1
    mean = total / count
    return PerplexityResult(perplexity=math.exp(mean), mean_nll=mean, tokens_scored=count, windows=len(windows), seconds=seconds)


def run_perplexity(llm, text: str, window: int) -> PerplexityResult:
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("perplexity needs the model's tokenizer")
    return score_windows(llm, window_token_ids(tokenizer.encode(text), window))
