"""The HF transformers baseline (`--baseline hf`): `generate` on static batches with left padding.

Same requests (token ids), same dtype and device as the engine, greedy. A static batch generates
until its longest request is done: every batch asks for max_new_tokens = min_new_tokens = the
largest output length in the batch (EOS cannot end it early), and each request is credited only
with its own output length, as vLLM's `benchmark_throughput --backend hf` does. The time spent on
the extra tokens of shorter requests is the cost of static batching, and it is kept.
"""

from __future__ import annotations

import inspect
import os
import time

import torch
from tqdm.auto import tqdm

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import throughput_metrics
from tokenmill.errors import ModelLoadError


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_from_gguf(path: str, dtype: torch.dtype):
    """HF's own model on the GGUF's dequantized weights (from_pretrained(gguf_file=) would need accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"], strict=False)
    model.tie_weights()
    return model.to(dtype)


def is_gguf(path: str) -> bool:
    """A .gguf name, or a file that starts with GGUF's magic (Ollama blobs have no suffix)."""
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def load_hf_model(path: str | None, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """transformers' AutoModelForCausalLM for a model folder or a GGUF file (None: the embedded default)."""
    from transformers import AutoModelForCausalLM

    from tokenmill.loader.default_model import default_model_path

    path = path or default_model_path()
    if is_gguf(path):
        model = _hf_from_gguf(path, dtype)
    elif os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        raise ModelLoadError(f"{path}: no such model folder or GGUF file for the HF baseline")
    return model.to(device).eval()


def _pad_left(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device) -> torch.Tensor:
    """Greedy generate of exactly new_tokens tokens for a left-padded batch; returns the new tokens."""
    ids, mask = _pad_left(prompts, 0, device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :]


def hf_prefill(model, prompts: list[list[int]], device) -> None:
    """One forward pass over a left-padded batch (the prompt phase of generate, with its KV cache)."""
    ids, mask = _pad_left(prompts, 0, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)


def make_batches(requests: list[SampleRequest], batch_size: int | None) -> list[list[SampleRequest]]:
    """Consecutive static batches of batch_size requests (None or 0: one batch of all)."""
    if batch_size is not None and batch_size < 0:
        raise ValueError(f"--hf-batch-size must be >= 0, got {batch_size}")
    size = batch_size or len(requests)
    return [requests[i : i + size] for i in range(0, len(requests), size)]


def hf_throughput(model, requests: list[SampleRequest], batch_size: int | None, device, use_tqdm: bool = True) -> dict:
    """Offline throughput of HF generate over the requests in static batches."""
    device = torch.device(device)
    batches = make_batches(requests, batch_size)
    hf_generate(model, [requests[0].prompt_token_ids[:8]], 2, device)  # warm-up
    sync(device)
    generated = 0  # tokens actually produced, padding waste included
    start = time.perf_counter()
    with tqdm(total=len(requests), desc="HF generate", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
        for batch in batches:
            new = max(r.output_len for r in batch)
            out = hf_generate(model, [r.prompt_token_ids for r in batch], new, device)
            if out.shape[1] != new:
                raise RuntimeError(f"HF generate made {out.shape[1]} tokens, {new} were asked for")
            generated += new * len(batch)
            bar.update(len(batch))
    sync(device)
    elapsed = time.perf_counter() - start
    metrics = throughput_metrics(
        len(requests), sum(r.prompt_len for r in requests), sum(r.output_len for r in requests), elapsed
    )
    metrics["batch_size"] = max(len(b) for b in batches)
    metrics["num_batches"] = len(batches)
    metrics["generated_tokens_incl_padding"] = generated
    return metrics


def hf_latency_iteration(model, prompts: list[list[int]], output_len: int, device) -> dict:
    """One latency measurement: prefill (a forward of the batch) and generate of output_len tokens."""
    device = torch.device(device)
    sync(device)
    start = time.perf_counter()
    hf_prefill(model, prompts, device)
    sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(model, prompts, output_len, device)
    sync(device)
    total = time.perf_counter() - start
    decode = (total - prefill) / (output_len - 1) if output_len > 1 else 0.0
    return {"prefill": prefill, "decode_per_token": max(decode, 0.0), "latency": total}
