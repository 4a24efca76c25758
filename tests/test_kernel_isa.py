"""The CPU kernels built for each instruction set this machine can run, not just the native one.

Users run tokenmill on AVX2-only CPUs (Zen 2/3, many cloud VMs, laptops) and on AVX-512 ones, and
on others the kernels fall back to scalar loops (cpu/vec.h picks the code from the -march target).
For each level, a build with TOKENMILL_CPU_MARCH=<level> in a temporary TORCH_EXTENSIONS_DIR:

    x86-64      SSE2 only: vec.h's scalar loops          (the fallback still compiles and is right)
    x86-64-v3   AVX2 + FMA + F16C: 8-lane Vec            (in the default run)
    x86-64-v4   AVX-512 F/BW/CD/DQ/VL: 16-lane Vec

Each runs the kernel tests of tests/test_layers.py, all of tests/test_kernel_shapes.py and
tests/test_quant_kernels.py and tests/test_gguf_kernels.py, the prompt-chunk kernel tests of tests/test_chunk_attention.py, the
`kv_quant_kernel` tests of tests/test_kv_quant.py (quantized KV cache writes and decode), the
`cascade_kernel` tests of tests/test_cascade_attention.py (decodes over a shared prefix), the
`decode_attention_block` tests of tests/test_decode_program.py (a layer's decode attention in one op), and the
`w8a8_kernel` tests of tests/test_w8a8.py (whose x86-64-v4
build runs the AVX512BW code, x86-64-v4 having no VNNI; -march=native runs VNNI where the CPU has
it) in a subprocess, and checks that the kernels were really used there (built, loaded, no test skipped,
the library's `vector_isa` is the level's, its ninja file has the requested -march). A build takes
about a minute on a small machine, so only x86-64-v3 is in the default run (about 1.5-2 min), and only
where the native build is not already the AVX2 code (a CPU with AVX-512); the
others, and the check that all levels give the same numbers, are marked slow.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.kernels import cpu

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 420  # one build takes 30-90 s on a busy 2-core machine
TESTS_TIMEOUT_S = 420
START_TIMEOUT_S = 120  # a start that loads a finished build

# /proc/cpuinfo names of what gcc may use at each level (x86-64 psABI levels; abm = lzcnt, pni = sse3).
V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS = {"x86-64": ("scalar", set()), "x86-64-v3": ("avx2", V3), "x86-64-v4": ("avx512", V4)}

# What test_layers.py has of the C++ kernels: paged attention (through CpuPagedAttention, which also
# writes K/V with write_kv), argmax + logsumexp, RMSNorm / residual add, SiLU-and-mul, rotary.
LAYER_TESTS = "CpuPagedAttention or test_cpu_"
# What test_chunk_attention.py has of the prompt-chunk kernel, without its end-to-end model runs.
CHUNK_TESTS = "(test_chunk_attention and not greedy)"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _skip_reason(level: str) -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 machine ({platform.machine()})"
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        return "building the CPU kernels needs c++ and ninja"
    flags = _cpu_flags()
    if not flags:
        return "no CPU flags in /proc/cpuinfo to tell which levels this machine runs"
    missing = sorted(LEVELS[level][1] - flags)
    return f"this CPU cannot run {level} code: it lacks {', '.join(missing)}" if missing else None


def _native_is_level(level: str) -> bool:
    """Whether -march=native already builds this level's vector code: the highest level the CPU runs
    (an AVX2-only CPU's native build is the AVX2 code, which the rest of the default run tests)."""
    higher = [other for other in LEVELS if len(LEVELS[other][1]) > len(LEVELS[level][1])]
    flags = _cpu_flags()
    return _skip_reason(level) is None and all(not LEVELS[other][1] <= flags for other in higher)


def _level_param(level: str, slow: bool):
    marks = [pytest.mark.skipif(_skip_reason(level) is not None, reason=_skip_reason(level) or "")]
    if not slow and not os.environ.get("TOKENMILL_TEST_ALL_ISA"):  # a second build of the same code: 1.5-2 min for nothing
        marks.append(pytest.mark.skipif(_native_is_level(level), reason=f"the native build is the {LEVELS[level][0]} code "
                                        f"already, tested by the rest of the run (TOKENMILL_TEST_ALL_ISA=1 builds {level} too)"))
    if slow:
        marks.append(pytest.mark.slow)
    return pytest.param(level, marks=marks, id=level)


# Loads the kernels (building them the first time) and says what came of it, as JSON.
PROBE = r"""
import json
from pathlib import Path
from tokenmill.kernels import cpu

result = cpu.load_cpu_kernels()
out = dict(available=result.available, error=result.error, compiled=result.compiled, seconds=result.seconds,
           path=str(result.path) if result.path else None, kernel_dir=str(cpu.kernel_dir()))
if result.available:
    out["vector_isa"] = cpu.vector_isa()
ninja = cpu.kernel_dir() / "build" / "build.ninja"
out["cflags"] = next((l.split("=", 1)[1].split() for l in ninja.read_text().splitlines() if l.startswith("cflags")), None) if ninja.exists() else None
print(json.dumps(out))
"""


def _env(root: Path, level: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_CPU_KERNELS", cpu.BUILD_TIMEOUT_ENV)}
    env.update({cpu.MARCH_ENV: level, "TORCH_EXTENSIONS_DIR": str(root), "TOKENMILL_EXPECT_VECTOR_ISA": LEVELS[level][0]}, **extra)
    return env


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(level) -> the probe's report of the build for that level; each level is built once per module."""
    root = tmp_path_factory.mktemp("torch_extensions")
    reports: dict[str, dict] = {}

    def get(level: str) -> dict:
        if level not in reports:
            proc = subprocess.run(
                [sys.executable, "-c", PROBE], cwd=ROOT, env=_env(root, level), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            assert report["available"], f"the {level} build failed: {report['error']}\n{proc.stderr[-4000:]}"
            reports[level] = report
        return reports[level]

    get.root = root
    return get


@pytest.mark.parametrize("level", [_level_param("x86-64-v3", slow=False), _level_param("x86-64-v4", slow=True), _level_param("x86-64", slow=True)])
def test_kernels_built_for_level_pass(build, level):
    report = build(level)
    assert report["vector_isa"] == LEVELS[level][0], report
    marches = [f for f in report["cflags"] or [] if f.startswith("-march=")]
    assert marches == [f"-march={level}"], report["cflags"]
    assert Path(report["path"]).parent == Path(report["kernel_dir"])

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/test_layers.py", "tests/test_kernel_shapes.py", "tests/test_quant_kernels.py", "tests/test_w8a8.py",
         "tests/test_chunk_attention.py", "tests/test_kv_quant.py", "tests/test_cascade_attention.py", "tests/test_gguf_kernels.py",
         "tests/test_decode_program.py",
         "-k", f"{LAYER_TESTS} or test_kernel_shapes or test_quant_kernels or w8a8_kernel or {CHUNK_TESTS} or kv_quant_kernel "
         "or cascade_kernel or test_gguf_ or decode_attention_block"],
        cwd=ROOT, env=_env(build.root, level), capture_output=True, text=True, timeout=TESTS_TIMEOUT_S,
    )  # fmt: skip
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 570, summary  # ~100 of test_layers, ~120 of test_kernel_shapes, ~220 quant, ~45 w8a8, ~50 chunk, ~125 gguf
    assert "skipped" not in summary, f"kernel tests skipped (the PyTorch paths ran?): {proc.stdout[-3000:]}"


def test_levels_build_apart(monkeypatch):
    """Each target has a hash of its own, so builds for different targets never mix (nothing is built here)."""
    monkeypatch.delenv(cpu.MARCH_ENV, raising=False)
    names = {cpu.kernel_name()}
    for level in LEVELS:
        monkeypatch.setenv(cpu.MARCH_ENV, level)
        names.add(cpu.kernel_name())
        assert f"-march={level}" in cpu._cflags() and "-march=native" not in cpu._cflags()
    assert len(names) == len(LEVELS) + 1
    monkeypatch.setenv(cpu.MARCH_ENV, "x86-64-v3 -O0")  # not a -march name: ignored, with a warning
    assert "-march=native" in cpu._cflags()


def test_every_kernel_file_is_in_the_build_hash():
    """A source or header left out of the hash would let a build of the old code load after it changes."""
    on_disk = {p.name for p in (ROOT / "tokenmill" / "kernels" / "cpu").iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {p.name for p in cpu._SOURCES + cpu._HEADERS}


# Every op on fixed inputs, saved for the comparison across levels.
OUTPUTS = r"""
import sys
import gguf
import torch
sys.path.insert(0, "tests")
from test_gguf_kernels import random_packed
from tokenmill.kernels import cpu
from tokenmill.layers.quantization import quant_utils

assert cpu.cpu_kernels_available()
torch.manual_seed(0)
res = {"vector_isa": cpu.vector_isa()}
wq = torch.randn(200, 576)
quant = {"int8": quant_utils.quantize_int8(wq), "int4": quant_utils.quantize_int4(wq, 128, False)}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    name = str(dtype).split(".")[-1]
    x, r, w = torch.randn(33, 576).to(dtype), torch.randn(33, 576).to(dtype), torch.randn(576).to(dtype)
    res[f"rms_norm.{name}"] = cpu.rms_norm(x, w, 1e-5)
    res[f"add_rms_norm.{name}"] = cpu.add_rms_norm(r, x, w, 1e-5)
    res[f"residual.{name}"] = r
    res[f"silu.{name}"] = cpu.silu_and_mul((torch.randn(9, 2 * 1536) * 4).to(dtype))
    q, k = torch.randn(7, 9, 64).to(dtype), torch.randn(7, 3, 64).to(dtype)
    cos, sin = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    cpu.rotary(q, k, cos, sin)
    res[f"rotary_q.{name}"], res[f"rotary_k.{name}"] = q, k
    ids, lse = cpu.argmax_logsumexp((torch.randn(4, 49152) * 5).to(dtype))
    res[f"argmax.{name}"], res[f"lse.{name}"] = ids, lse
    kc = torch.randn(3, 40, 16, 64).to(dtype)
    vc = torch.randn(3, 40, 16, 64).to(dtype)
    qd = torch.randn(4, 9, 64).to(dtype)
    out = torch.zeros_like(qd)
    table = torch.randperm(40)[:36].view(4, 9)
    cpu.paged_decode_attention(out, qd, kc, vc, torch.arange(4), table, torch.tensor([0, 15, 100, 143]), None, 0.125)
    res[f"attention.{name}"] = out
    qp = torch.randn(60, 9, 64).to(dtype)
    outp = torch.zeros(61, 9, 64, dtype=dtype)
    cpu.paged_prefill_attention(outp, qp, kc, vc, torch.tensor([0, 40]), torch.tensor([0, 100]), torch.tensor([40, 20]),
                                table[:2].contiguous(), None, 0.125)
    res[f"prefill_attention.{name}"] = outp
    xq = torch.randn(5, 576).to(dtype)
    res[f"dense_linear.{name}"] = cpu.dense_linear(xq, cpu.dense_pack(torch.randn(43, 576).to(dtype)), 43, None)
    res[f"int8_linear.{name}"] = cpu.int8_linear(xq, cpu.int8_pack(quant["int8"][0]), quant["int8"][1], quant["int8"][0].shape[0], None)
    res[f"int4_linear.{name}"] = cpu.int4_linear(xq, *cpu.int4_pack(*quant["int4"]), 128, quant["int4"][0].shape[0], None)
    res[f"w8a8_linear.{name}"] = cpu.w8a8_linear(torch.randn(7, 576).to(dtype), *cpu.w8a8_pack(quant["int8"][0], 128), quant["int8"][1], None, 128)
    for qtype in (2, 3, 8, 12, 13, 14):  # gguf Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: random valid blocks
        packed = torch.from_numpy(random_packed(gguf.GGMLQuantizationType(qtype), 48, 512, seed=qtype))
        res[f"gguf_linear_{qtype}.{name}"] = cpu.gguf_linear(torch.randn(3, 512).to(dtype), packed, qtype, 512, None)
torch.save(res, sys.argv[1])
"""


@pytest.mark.slow
def test_levels_agree(build, tmp_path):
    """The AVX-512, AVX2 and scalar code give the same numbers: bit for bit where the ops round as
    torch's eager ops (rotary, residual add), within the kernel tests' tolerances elsewhere (sums in
    another order, libmvec's expf at another width)."""
    import torch

    levels = [level for level in LEVELS if _skip_reason(level) is None]
    if len(levels) < 2:
        pytest.skip("fewer than two ISA levels run on this machine")
    results = {}
    for level in levels:
        build(level)
        path = tmp_path / f"{level}.pt"
        proc = subprocess.run([sys.executable, "-c", OUTPUTS, str(path)], cwd=ROOT, env=_env(build.root, level), capture_output=True, text=True, timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[level] = torch.load(path)
    for level in levels:
        assert results[level].pop("vector_isa") == LEVELS[level][0]
    ref_level, ref = levels[0], results[levels[0]]
    for level in levels[1:]:
        got = results[level]
        for key, want in ref.items():
            op, dtype = key.split(".")
            where = f"{key}: {level} vs {ref_level}"
            if op in ("rotary_q", "rotary_k", "residual", "argmax", "w8a8_linear"):  # w8a8: exact int32 sums, one epilogue
                assert torch.equal(got[key], want), where
            elif op == "lse":
                torch.testing.assert_close(got[key], want, atol=1e-5, rtol=1e-5, msg=where)
            elif (op in ("dense_linear", "int8_linear", "int4_linear") or op.startswith("gguf_linear")) and dtype == "float32":  # sums of 576 products, as in test_quant_kernels
                torch.testing.assert_close(got[key], want, atol=1e-4, rtol=1e-4, msg=where)
            elif dtype == "float32":
                torch.testing.assert_close(got[key], want, atol=1e-5, rtol=1e-5, msg=where)
            else:  # one ulp of the dtype, where a float32 difference crossed a rounding boundary
                torch.testing.assert_close(got[key].float(), want.float(), atol=1e-2, rtol=1e-2, msg=where)

