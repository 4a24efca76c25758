"""Pre-quantized checkpoints against quantizing at load, on one model: perplexity and single-request decode.

    python benchmarks/prequantized.py [--model PATH] [--group-size 128] [--rounds 3] [--json out.json]

With no hub access, the checkpoints are written here from the model's float weights: every linear
layer rounded to nearest (asymmetric 4-bit groups, or symmetric int8 per channel; no GPTQ/AWQ
calibration, so the perplexity is round-to-nearest's, not what a calibrated checkpoint gets) and
packed in each format's layout (GPTQ, AWQ GEMM, compressed-tensors pack-quantized and
int-quantized), with config.json's quantization_config. tokenmill detects each format and runs it
on the same kernels as `-q int4` / `-q w8a8`, so decode speed should match those rows; the table
shows it. Rows run as in benchmarks/quantization.py (perplexity on the shipped text, latency
rounds alternating between rows, medians), with the CPU's vector flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantization import _bench, _method_args, cpu_flags  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _pack_rows(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] 4-bit values -> [R / 8, C], row 8i + j in bits [4j, 4j + 4) of row i (order: slot j holds row order[j])."""
    v = values.long().view(-1, 8, values.shape[1])
    if order is not None:
        v = v[:, order]
    return _int32((v << (torch.arange(8) * 4).view(1, 8, 1)).sum(1))


def _pack_cols(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    return _pack_rows(values.t(), order).t().contiguous()


def _rtn4(w: torch.Tensor, group: int):
    """Asymmetric round-to-nearest, groups of `group` inputs (the last may be shorter): q [N, K], zero and scale [N, G]."""
    n, k = w.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w, (0, groups * group - k), value=0.0).view(n, groups, group)
    valid = (torch.arange(groups * group) < k).view(1, groups, group)
    lo = torch.where(valid, padded, torch.inf).amin(-1).clamp(max=0)
    hi = torch.where(valid, padded, -torch.inf).amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    zero = torch.round(-lo / scale.float()).clamp(1, 15).long()  # >= 1: GPTQ's classic format stores zero - 1
    q = (torch.round(padded / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).long()
    return q.view(n, -1)[:, :k], zero, scale


def _layers(weights: dict[str, torch.Tensor]) -> list[str]:
    return [name[: -len(".weight")] for name in weights if name.endswith("_proj.weight")]


def _formats(weights: dict[str, torch.Tensor], group: int) -> dict[str, tuple[dict, dict]]:
    """Each format's tensors (by name) and quantization_config."""
    out = {}
    gptq, awq, ct4, ct8 = dict(weights), dict(weights), dict(weights), dict(weights)
    for layer in _layers(weights):
        w = weights[f"{layer}.weight"].float()
        for state in (gptq, awq, ct4, ct8):
            del state[f"{layer}.weight"]
        q, zero, scale = _rtn4(w, group)
        k = w.shape[1]
        g_idx = (torch.arange(k) // group).to(torch.int32)
        gptq.update({f"{layer}.qweight": _pack_rows(q.t()), f"{layer}.qzeros": _pack_cols((zero - 1).t()),
                     f"{layer}.scales": scale.t().contiguous(), f"{layer}.g_idx": g_idx})
        awq.update({f"{layer}.qweight": _pack_cols(q.t(), AWQ_ORDER), f"{layer}.qzeros": _pack_cols(zero.t(), AWQ_ORDER),
                    f"{layer}.scales": scale.t().contiguous()})
        ct4.update({f"{layer}.weight_packed": _pack_cols(q), f"{layer}.weight_zero_point": _pack_rows(zero),
                    f"{layer}.weight_scale": scale, f"{layer}.weight_shape": torch.tensor(list(w.shape))})
        s8 = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8).half()
        ct8.update({f"{layer}.weight": torch.round(w / s8.float()).clamp(-127, 127).to(torch.int8), f"{layer}.weight_scale": s8})
    w4 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group, "dynamic": False}
    w8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    a8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}

    def ct(fmt: str, weights_args: dict, acts: dict | None) -> dict:
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_args, "input_activations": acts}}}

    out["gptq"] = gptq, {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False, "desc_act": False}
    out["awq"] = awq, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    out["ct-w4a16"] = ct4, ct("pack-quantized", w4, None)
    out["ct-w8a8"] = ct8, ct("int-quantized", w8, a8)
    return out


def _write(folder: Path, source, tensors: dict[str, torch.Tensor], quant: dict | None) -> str:
    folder.mkdir(parents=True)
    config = source.hf_config
    config.quantization_config = quant
    if quant is None:
        del config.quantization_config
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    source.tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> None:
    from tokenmill.config import ModelConfig
    from tokenmill.loader import load_model_source

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a float model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    source = load_model_source(ModelConfig(model=args.model))
    weights = {name: t.float().contiguous() for name, t in source.weights()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        float_folder = _write(root / "float", source, weights, None)
        rows = [("float, -q int4 g%d (at load)" % args.group_size, float_folder, "int4", {"group_size": args.group_size}),
                ("float, -q w8a8 (at load)", float_folder, "w8a8", None)]
        rows.insert(0, ("float", float_folder, None, None))
        for name, (tensors, quant) in _formats(weights, args.group_size).items():
            rows.append((f"{name} checkpoint (detected)", _write(root / name, source, tensors, quant), None, None))
        results = {label: {"decode_ms": []} for label, *_ in rows}
        for label, folder, method, options in rows:
            common = ["--model", folder, "--dtype", args.dtype]
            result = _bench(["perplexity", *_method_args(common, method, options)])
            results[label].update(perplexity=result["perplexity"], dtype=result["dtype"])
        latency = ["latency", "--batch-size", "1", "--input-len", "32", "--output-len", "64", "--num-iters", "3",
                   "--num-iters-warmup", "1", "--disable-tqdm"]
        for _ in range(args.rounds):
            for label, folder, method, options in rows:
                result = _bench([*latency, *_method_args(["--model", folder, "--dtype", args.dtype], method, options)])
                results[label]["decode_ms"].append(result["tokenmill"]["decode_time_per_token_ms"])
    base = results["float"]
    base_ms = statistics.median(base["decode_ms"])
    print(f"CPU flags: {cpu_flags()}; dtype {base['dtype']}")
    print("| model | perplexity | vs float | decode ms/token (batch 1) | speed-up |")
    print("|---|---|---|---|---|")
    for label, row in results.items():
        ms = statistics.median(row["decode_ms"])
        print(f"| {label} | {row['perplexity']:.3f} | {100 * (row['perplexity'] / base['perplexity'] - 1):+.2f}% | {ms:.2f} | "
              f"{base_ms / ms:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_flags": cpu_flags(), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
