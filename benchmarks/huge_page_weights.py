"""Decode-sized linear layers with their weights in 4 KB pages against the same weights moved into
transparent huge pages (worker/cpu_memory.py's move_weights_to_huge_pages), alternating in one process.

    python benchmarks/huge_page_weights.py [--rows 1,32] [--rounds 15]

SmolLM2-135M's 30 layers of shapes (qkv 960 x 576, o 576 x 576, gate-up 3072 x 576, down 576 x 1536)
as the CPU kernels hold them: bf16 (dense_pack), int4 in groups of 32 with bf16 x (int4_linear) and
with int8 x (int4_linear_a8). Prints each one's median time for all 120 layers per placement and the
median of the rounds' ratios. Prints the CPU's vector flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.quantization import quant_utils
from tokenmill.layers.quantization.weight_only import int4_tiles
from tokenmill.worker.cpu_memory import HUGE_PAGE_WEIGHTS_ENV, move_weights_to_huge_pages

sys.path.insert(0, str(Path(__file__).parent))
from quantization import cpu_flags  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


class Weights(torch.nn.Module):
    """The layers' packed weights as plain attributes (as the layers hold them)."""

    def __init__(self, packed: list) -> None:
        super().__init__()
        self.packed = packed


def int4_layer(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 layer (groups of 32, asymmetric) in the kernels' layout, as the int4 method stores it."""
    return int4_tiles(*quant_utils.quantize_int4(torch.randn(n, k), 32, False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cpu_kernels.load_cpu_kernels()
    os.environ[HUGE_PAGE_WEIGHTS_ENV] = "1"
    torch.manual_seed(0)
    ops = torch.ops.tokenmill_cpu
    kinds = {
        "bf16": ([cpu_kernels.dense_pack(torch.randn(n, k, dtype=torch.bfloat16)) for n, k in SHAPES],
                 lambda x, w, n: ops.dense_linear(x, w, n, None)),
        "int4": ([int4_layer(n, k) for n, k in SHAPES], lambda x, w, n: ops.int4_linear(x, *w, 32, n, None)),
    }
    kinds["int4, int8 x"] = (kinds["int4"][0], lambda x, w, n: ops.int4_linear_a8(x, *w, 32, n, None))
    placed = {}
    for name, (weights, _) in kinds.items():
        if name.startswith("int4,"):
            continue
        copy = Weights([[t.clone() for t in w] if isinstance(w, (list, tuple)) else w.clone() for w in weights])
        if not move_weights_to_huge_pages(copy):
            sys.exit("transparent huge pages are off here (or TOKENMILL_HUGE_PAGE_WEIGHTS=0): nothing to compare")
        placed[name] = copy.packed
    placed["int4, int8 x"] = placed["int4"]
    print(f"CPU flags: {cpu_flags()}")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        for name, (weights, op) in kinds.items():
            times: dict[str, list[float]] = {"4 KB pages": [], "huge pages": []}
            for r in range(args.rounds):
                for label in (("4 KB pages", "huge pages") if r % 2 == 0 else ("huge pages", "4 KB pages")):
                    layers = weights if label == "4 KB pages" else placed[name]
                    start = time.perf_counter()
                    for w, (n, k) in zip(layers, SHAPES):
                        op(xs[k], w, n)
                    times[label].append(time.perf_counter() - start)
            ratio = statistics.median(a / b for a, b in zip(times["4 KB pages"], times["huge pages"]))
            print(f"{rows} rows, {name}: 4 KB pages {statistics.median(times['4 KB pages']) * 1e3:.2f} ms, "
                  f"huge pages {statistics.median(times['huge pages']) * 1e3:.2f} ms, {ratio:.2f}x")


if __name__ == "__main__":
    main()
