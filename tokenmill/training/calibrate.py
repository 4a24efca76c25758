"""`tokenmill calibrate-smoothquant`: each linear layer's per-input-channel absmax, for SmoothQuant
(layers/quantization/smoothquant.py), measured while the float model answers chat prompts itself (the
package's, or a file's: text it has not been evaluated on; SmoothQuant calibrated on 512 sentences of
the Pile), prompt and answer positions alike."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.quantization.base import LinearMethodBase
from tokenmill.sampling_params import SamplingParams


class AbsmaxRecorder(LinearMethodBase):
    """A loaded linear layer's method, wrapped: each call folds the per-channel absmax of its input into
    `absmax[key]` (tensor ops over the batch's rows), then computes as the wrapped method does. No decode
    kernel of its own, so the decode programs take the layer's Python path, which calls apply."""

    def __init__(self, inner: LinearMethodBase, absmax: dict[str, torch.Tensor], key: str) -> None:
        self.inner, self.absmax, self.key = inner, absmax, key

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float().cpu()
        known = self.absmax.get(self.key)
        self.absmax[self.key] = seen if known is None else torch.maximum(known, seen)
        return self.inner.apply(layer, x, bias)


@dataclass
class CalibrationReport:
    num_prompts: int
    num_positions: int  # prompt and generated tokens the model computed
    seconds: float


def calibrate_act_scales(llm, prompts: Sequence, max_tokens: int) -> tuple[dict[str, torch.Tensor], CalibrationReport]:
    """{linear layer name: absmax of its input per channel} over the prompts and the model's greedy answers."""
    engine = llm.llm_engine
    runner = getattr(getattr(engine, "executor", None), "driver_runner", None)
    if runner is None or engine.config.parallel.tensor_parallel_size > 1:
        raise ValueError("calibrate-smoothquant runs one engine in one process: drop --data-parallel-size and --tensor-parallel-size")
    if engine.config.model.quantization not in (None, "none"):
        raise ValueError("calibrate-smoothquant measures the float model: drop --quantization")
    model = runner.model
    absmax: dict[str, torch.Tensor] = {}
    wrapped = [(m, m.method) for m in model.modules() if isinstance(m, Linear)]
    for module, method in wrapped:
        module.method = AbsmaxRecorder(method, absmax, module.prefix)
    programs = [m for m in model.modules() if hasattr(m, "decode_program")]
    for program in programs:  # built with the layers' own kernels: rebuilt on the recorders
        program.decode_program, program.native_decode = None, None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    try:
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
    finally:
        for module, method in wrapped:
            module.method = method
        for program in programs:
            program.decode_program, program.native_decode = None, None
    positions = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs)
    return absmax, CalibrationReport(len(outputs), positions, time.perf_counter() - start)
