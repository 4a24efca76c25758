"""Benchmark requests: random token ids, ShareGPT conversations, a long shared prefix, text edits.

Pure functions of their arguments (and a seed): no model, no engine. Every request is a
SampleRequest holding its prompt as token ids (exact lengths) and, where there is one, as text.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.errors import TokenmillError

DATASETS = ("random", "sharegpt", "prefix", "edit", "chat")

# The edit dataset's text and instruction: the answer copies most of the passage, the workload where
# prompt lookup (speculative decoding's ngram proposer) pays, as in editing or summarising a given text.
EDIT_TEXT = Path(__file__).parent / "data" / "us_constitution.txt"
EDIT_INSTRUCTION = 'Copy the following text exactly, but write "will" in place of "shall". Write nothing else.\n\n'

# Open-ended chat prompts (answers the model must make up: where Medusa heads, not prompt lookup, pay).
# The first CHAT_TRAIN_PROMPTS are train-medusa's default training prompts; --dataset chat uses the rest.
CHAT_PROMPTS = Path(__file__).parent / "data" / "chat_prompts.txt"
CHAT_TRAIN_PROMPTS = 64

# vLLM's ShareGPT filter (benchmarks/datasets.py is_valid_sequence): very short prompts or
# completions are dropped, and so are long ones.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class SampleRequest:
    """One benchmark request: the prompt's token ids, the output length to ask for, and the text if any."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(
    name: str, value: int, range_ratio: float = 0.0, low: int | None = None, high: int | None = None
) -> tuple[int, int]:
    """The [low, high] range (inclusive) that lengths are drawn from.

    By default vLLM's rule: [value * (1 - ratio), value * (1 + ratio)]; an explicit low or high
    replaces that end. range_ratio 0 and no explicit ends gives a fixed length.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo = low if low is not None else max(1, math.floor(value * (1.0 - range_ratio)))
    hi = high if high is not None else max(lo, math.ceil(value * (1.0 + range_ratio)))
    if lo < 1:
        raise ValueError(f"the {name} length must be at least 1, got {lo}")
    if hi < lo:
        raise ValueError(f"the {name} length range is empty: min {lo} > max {hi}")
    return lo, hi


def allowed_token_ids(vocab_size: int, exclude: Iterable[int] = ()) -> np.ndarray:
    """The token ids random prompts are drawn from: the whole vocabulary but special tokens (as vLLM)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    mask = np.ones(vocab_size, dtype=bool)
    bad = [t for t in exclude if 0 <= t < vocab_size]
    mask[bad] = False
    ids = np.nonzero(mask)[0]
    if ids.size == 0:
        raise ValueError("every token of the vocabulary is a special token: no random prompt can be drawn")
    return ids


def check_at_least(flag: str, value: int, minimum: int) -> None:
    """A count given on the command line that must be at least `minimum`: a one-line error naming the flag."""
    if value < minimum:
        bound = f"at least {minimum}" if minimum else ">= 0"
        raise ValueError(f"{flag} must be {bound}, got {value}")


def random_dataset(
    num_prompts: int,
    vocab_size: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int = 0,
    exclude: Iterable[int] = (),
) -> list[SampleRequest]:
    """Prompts of random token ids; input and output lengths uniform in their ranges (inclusive)."""
    check_at_least("--num-prompts", num_prompts, 1)
    allowed = allowed_token_ids(vocab_size, exclude)
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    return [
        SampleRequest(rng.choice(allowed, size=int(n)).tolist(), int(m))
        for n, m in zip(input_lens, output_lens)
    ]


def prefix_dataset(
    num_prompts: int,
    vocab_size: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    num_prefixes: int = 1,
    exclude: Iterable[int] = (),
) -> list[SampleRequest]:
    """Requests sharing a long common prefix (request i takes prefix i % num_prefixes), each with its own
    random suffix. The suffixes' first tokens are all different (while the vocabulary allows), so the
    requests of one prefix share exactly prefix_len tokens."""
    check_at_least("--num-prompts", num_prompts, 1)
    check_at_least("--prefix-len", prefix_len, 0)
    check_at_least("--suffix-len", suffix_len, 1)
    check_at_least("--output-len", output_len, 1)
    check_at_least("--num-prefixes", num_prefixes, 1)
    allowed = allowed_token_ids(vocab_size, exclude)
    rng = np.random.default_rng(seed)
    prefixes = [rng.choice(allowed, size=prefix_len).tolist() for _ in range(num_prefixes)]
    firsts = rng.choice(allowed, size=num_prompts, replace=num_prompts > allowed.size).tolist()
    requests = []
    for i in range(num_prompts):
        suffix = [firsts[i]] + rng.choice(allowed, size=suffix_len - 1).tolist()
        requests.append(SampleRequest(prefixes[i % num_prefixes] + suffix, output_len))
    return requests


def edit_dataset(tokenizer, num_prompts: int, passage_len: int, seed: int = 0) -> list[SampleRequest]:
    """num_prompts chat requests, each asking to copy a passage of the shipped text (paragraphs joined up
    to about passage_len tokens) with one word changed; the output length is the passage's length."""
    check_at_least("--num-prompts", num_prompts, 1)
    check_at_least("--input-len", passage_len, 16)
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise TokenmillError("--dataset edit needs a tokenizer with a chat template, and this model has none")
    paragraphs = [p.strip() for p in EDIT_TEXT.read_text(encoding="utf-8").split("\n\n") if len(p.strip()) > 80]
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in paragraphs]
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        index = rng.randrange(len(paragraphs))
        passage, length = [paragraphs[index]], lengths[index]
        while length < passage_len and index + 1 < len(paragraphs):
            index += 1
            passage.append(paragraphs[index])
            length += lengths[index]
        text = "\n\n".join(passage)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": EDIT_INSTRUCTION + text}], tokenize=False, add_generation_prompt=True
        )
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(ids, len(tokenizer.encode(text, add_special_tokens=False)), prompt=prompt))
    return requests


def chat_prompt_lines(path: str | None = None) -> list[str]:
    """Open-ended chat prompts, one per line: a file's, or the package's (whose first CHAT_TRAIN_PROMPTS
    lines `tokenmill train-medusa` trains on and the rest `--dataset chat` measures with)."""
    text = CHAT_PROMPTS.read_text(encoding="utf-8") if path is None else Path(path).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def chat_request(tokenizer, line: str) -> tuple[str, list[int]]:
    """A user message in the model's chat template: the text and its token ids."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": line}], tokenize=False, add_generation_prompt=True)
    return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))


def chat_dataset(tokenizer, num_prompts: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """num_prompts chat requests from the package's held-out chat prompts, in order from the seed-th
    (repeating past the end)."""
    check_at_least("--num-prompts", num_prompts, 1)
    check_at_least("--output-len", output_len, 1)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TokenmillError("--dataset chat needs a tokenizer with a chat template, and this model has none")
    lines = chat_prompt_lines()[CHAT_TRAIN_PROMPTS:]
    requests = []
    for i in range(num_prompts):
        prompt, ids = chat_request(tokenizer, lines[(seed + i) % len(lines)])
        requests.append(SampleRequest(ids, output_len, prompt=prompt))
    return requests


def _conversation_turns(entry) -> list[str] | None:
    """The turns' texts of one ShareGPT entry ({"conversations": [{"from": ..., "value": ...}, ...]})."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations", entry.get("conversation"))
    if not isinstance(turns, list):
        return None
    texts = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            return None
        texts.append(text)
    return texts


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(prompt, completion) pairs: the first two turns of every conversation with at least two."""
    if not path:
        raise TokenmillError("--dataset sharegpt needs --dataset-path: a ShareGPT-format JSON file")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise TokenmillError(f"--dataset-path {path}: no such file") from None
    except IsADirectoryError:
        raise TokenmillError(f"--dataset-path {path}: is a directory, not a ShareGPT JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenmillError(f"--dataset-path {path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise TokenmillError(f"--dataset-path {path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, list):
        raise TokenmillError(
            f"--dataset-path {path}: a ShareGPT file is a JSON list of {{\"conversations\": [{{\"from\": ..., \"value\": ...}}, ...]}} entries"
        )
    pairs = []
    for entry in data:
        turns = _conversation_turns(entry)
        if turns is not None and len(turns) >= 2:
            pairs.append((turns[0], turns[1]))
    if not pairs:
        raise TokenmillError(f"--dataset-path {path}: no conversation with at least two turns ({len(data)} entries)")
    return pairs


def sharegpt_dataset(
    path: str,
    tokenizer,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[SampleRequest]:
    """num_prompts conversations drawn (shuffled by seed) from a ShareGPT file: the first turn is the prompt;
    the output length is the second turn's token count, or output_len if given. Filtered as vLLM does
    (prompt and completion at least 4 tokens, prompt at most 1024, both at most 2048 and the context)."""
    check_at_least("--num-prompts", num_prompts, 1)
    if output_len is not None and output_len < 1:
        raise ValueError(f"--sharegpt-output-len must be at least 1, got {output_len}")
    pairs = load_sharegpt(path)
    if tokenizer is None:
        raise TokenmillError("--dataset sharegpt needs a tokenizer, and this model has none (give --tokenizer)")
    random.Random(seed).shuffle(pairs)
    max_total = SHAREGPT_MAX_TOTAL_LEN if max_model_len is None else min(SHAREGPT_MAX_TOTAL_LEN, max_model_len)
    requests = []
    for prompt, completion in pairs:
        ids = list(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(completion, add_special_tokens=False))
        if len(ids) < SHAREGPT_MIN_LEN or (output_len is None and out_len < SHAREGPT_MIN_LEN):
            continue
        if len(ids) > SHAREGPT_MAX_PROMPT_LEN or len(ids) + out_len > max_total:
            continue
        requests.append(SampleRequest(ids, out_len, prompt=prompt))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise TokenmillError(
            f"--dataset-path {path}: no conversation fits (prompt and completion of {SHAREGPT_MIN_LEN} tokens or more, "
            f"prompt at most {SHAREGPT_MAX_PROMPT_LEN}, together at most {max_total})"
        )
    return requests


def ids_to_text(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """Text that re-encodes to about as many tokens as token_ids (for servers given text prompts).

    Decoding random ids and encoding the text again rarely gives the same ids: the text is cut to the
    first len(token_ids) tokens of its own encoding. Returns the text and its encoded length."""
    target = len(token_ids)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    for _ in range(3):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= target:
            return text, len(ids)
        text = tokenizer.decode(ids[:target], skip_special_tokens=True)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def check_fits(requests: list[SampleRequest], max_model_len: int) -> None:
    """Every request's prompt plus output must fit the context: a benchmark must not be silently cut short."""
    for i, r in enumerate(requests):
        if r.prompt_len + r.output_len > max_model_len:
            raise ValueError(
                f"request {i} needs {r.prompt_len} prompt + {r.output_len} output tokens = {r.prompt_len + r.output_len}, "
                f"more than the context length {max_model_len}; lower the lengths (or raise --max-model-len)"
            )


def describe(requests: list[SampleRequest]) -> dict:
    """Counts and length ranges of a request list, for the report."""
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "total_input_tokens": sum(ins),
        "total_output_tokens": sum(outs),
        "input_len_min": min(ins),
        "input_len_max": max(ins),
        "output_len_min": min(outs),
        "output_len_max": max(outs),
    }
