"""A decode step of the default model: the eager, hand-fused path against torch.compile (inductor CPU).

    python benchmarks/compile_decode.py [--dtype float32] [--batches 1,32] [--compile-timeout 900] [--rounds 3]

The eager step is what the engine runs (tokenmill's C++ kernels, oneDNN-prepacked linears). The
compiled step is the same model through torch.compile(dynamic=True, fullgraph=True): the C++ ops get
fake (shape-only) implementations so dynamo keeps them in one graph, and each prepacked linear is
wrapped in an opaque custom op (inductor's mkldnn lowering wants packed weights as frozen constants).
Decode batches are captured from the engine's own steps (64-token prompts); both paths run the same
batch, alternating, and the table shows medians in milliseconds and the ratio. The compile has a
deadline (SIGALRM): past it the run stops with a message instead of hanging.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels import cpu as cpu_kernels  # noqa: E402
from tokenmill.layers.quantization import unquantized  # noqa: E402
from tokenmill.worker import model_runner  # noqa: E402


def _register_fakes() -> None:
    lib = "tokenmill_cpu"
    torch.library.register_fake(f"{lib}::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake(f"{lib}::add_rms_norm")(lambda r, x, w, eps: torch.empty_like(x))
    torch.library.register_fake(f"{lib}::silu_and_mul")(lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
    torch.library.register_fake(f"{lib}::rotary")(lambda q, k, cos, sin: None)
    torch.library.register_fake(f"{lib}::write_kv")(lambda kc, vc, k, v, slots: None)
    torch.library.register_fake(f"{lib}::paged_decode_attention")(lambda out, q, kc, vc, rows, table, pos, w, s, ks=None, vs=None: None)


@torch.library.custom_op("tokenmill_bench::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_packed_linear.register_fake
def _(x, packed, bias):
    return x.new_empty(x.shape[0], packed.shape[0])


def _compilable_packed_linear() -> None:
    eager_call = unquantized.PackedCPUWeight.__call__

    def call(self, x, bias=None):
        if torch.compiler.is_compiling():
            flat = x.reshape(-1, self.in_features).contiguous()
            return _packed_linear(flat, self.packed, bias).view(*x.shape[:-1], self.out_features)
        return eager_call(self, x, bias)

    unquantized.PackedCPUWeight.__call__ = call


def _capture_decode_batches(llm: LLM, batches: list[int]) -> dict:
    captured = {}
    forward = model_runner.ModelRunner.forward

    def capture(self, batch):
        captured[int(batch.input_ids.shape[0])] = batch
        return forward(self, batch)

    model_runner.ModelRunner.forward = capture
    try:
        for b in batches:
            prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(b)]
            llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        model_runner.ModelRunner.forward = forward
    return {b: captured[b] for b in batches}


def _timeout(seconds: float):
    def expired(signum, frame):
        raise TimeoutError(f"torch.compile did not finish within {seconds:g} s (--compile-timeout)")

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--compile-timeout", type=float, default=900.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    flags = cpu_kernels.vector_flags()
    print(f"CPU flags: {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if not cpu_kernels.load_cpu_kernels().available:
        raise SystemExit("tokenmill's CPU kernels are not available: nothing hand-fused to compare against")
    _register_fakes()
    _compilable_packed_linear()
    # The kernel check takes a lock on first use; for the graph it is a constant.
    cpu_kernels.cpu_kernels_available = torch.compiler.assume_constant_result(lambda: True)

    llm = LLM(dtype=args.dtype, max_num_seqs=max(batches))
    model = llm.llm_engine.executor.worker.runner.model
    captured = _capture_decode_batches(llm, batches)
    compiled = torch.compile(model, dynamic=True, fullgraph=True)

    def step(m, batch):
        with torch.inference_mode():
            return m(batch.input_ids, batch.positions, batch)

    for b in batches:
        batch = captured[b]
        print(f"compiling the decode step (batch {b}, inductor; minutes on a loaded machine) ...", flush=True)
        start = time.perf_counter()
        _timeout(args.compile_timeout)
        try:
            got = step(compiled, batch)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(f"  compiled in {time.perf_counter() - start:.1f} s", flush=True)
        ref = step(model, batch)
        diff = (ref.float() - got.float()).abs().max().item()
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name, m in (("eager", model), ("compiled", compiled)):
                for _ in range(3):
                    step(m, batch)
                t = time.perf_counter()
                for _ in range(args.steps):
                    step(m, batch)
                times[name].append((time.perf_counter() - t) / args.steps * 1000)
        eager, comp = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"{args.dtype} batch {b}: eager {eager:.2f} ms, compiled {comp:.2f} ms, compiled/eager {comp / eager:.2f}, "
              f"max |hidden diff| {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
