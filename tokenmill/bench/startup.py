"""`tokenmill bench startup`: how long a fresh process takes from the command to its first token,
and a fresh `tokenmill serve` to a healthy /health; medians over several runs, each in a new
process (so every import, file load and kernel load is counted, as a user meets them)."""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import time

# The child: wall-clock stamps (time.time(), comparable with the parent's) after each phase.
_CHILD = """
import json, sys, time
stamps = {"started": time.time()}
from tokenmill import LLM, SamplingParams
stamps["imported"] = time.time()
llm = LLM(**json.loads(sys.argv[1]))
stamps["engine_ready"] = time.time()
llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
stamps["first_token"] = time.time()
print("TOKENMILL_STARTUP " + json.dumps(stamps), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_run(engine_kwargs: dict, timeout: float) -> dict[str, float]:
    """One fresh process: seconds from the command to the import, the engine, the first token."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(engine_kwargs)], capture_output=True, text=True, timeout=timeout)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("TOKENMILL_STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the startup run failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    stamps = json.loads(line.split(" ", 1)[1])
    return {
        "interpreter_s": stamps["started"] - spawned,
        "import_s": stamps["imported"] - stamps["started"],
        "engine_s": stamps["engine_ready"] - stamps["imported"],
        "first_token_s": stamps["first_token"] - stamps["engine_ready"],
        "total_s": stamps["first_token"] - spawned,
    }


def serve_run(serve_args: list[str], timeout: float) -> float:
    """One fresh `tokenmill serve`: seconds from the command to the first 200 from /health."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    spawned = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.time() - spawned < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {proc.returncode} before it was healthy")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    return time.time() - spawned
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"tokenmill serve was not healthy after {timeout:g} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_startup(engine_kwargs: dict, serve_args: list[str], num_runs: int, serve: bool, timeout: float = 600.0) -> dict:
    runs = [offline_run(engine_kwargs, timeout) for _ in range(num_runs)]
    result = {
        "benchmark": "startup",
        "num_runs": num_runs,
        "runs": runs,
        "median": {key: statistics.median(r[key] for r in runs) for key in runs[0]},
    }
    if serve:
        healthy = [serve_run(serve_args, timeout) for _ in range(num_runs)]
        result["serve_healthy_s"] = healthy
        result["median"]["serve_healthy_s"] = statistics.median(healthy)
    return result


def format_startup(result: dict) -> str:
    m = result["median"]
    lines = [
        f"Startup, median of {result['num_runs']} fresh processes:",
        f"  command to first token:  {m['total_s']:.2f} s",
        f"    interpreter start:     {m['interpreter_s']:.2f} s",
        f"    import tokenmill:      {m['import_s']:.2f} s",
        f"    LLM() (load, KV, ...): {m['engine_s']:.2f} s",
        f"    first token:           {m['first_token_s']:.2f} s",
    ]
    if "serve_healthy_s" in m:
        lines.append(f"  tokenmill serve healthy: {m['serve_healthy_s']:.2f} s")
    return "\n".join(lines)


def engine_kwargs_from_args(args) -> dict:
    kwargs = {"model": args.model, "dtype": args.dtype}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    return kwargs


def serve_args_from_args(args) -> list[str]:
    out = ["--dtype", args.dtype]
    if args.model:
        out += ["--model", args.model]
    if args.max_model_len is not None:
        out += ["--max-model-len", str(args.max_model_len)]
    return out


__all__ = ["engine_kwargs_from_args", "format_startup", "offline_run", "run_startup", "serve_args_from_args", "serve_run"]
