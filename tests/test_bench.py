"""`tokenmill bench`: datasets, metric arithmetic and the arrival schedule without a model; the three
commands end to end through the CLI on a tiny model, and `bench serve` against a stand-in
OpenAI-compatible streaming server started here."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
from fastapi import Request  # module level: the stand-in server's handlers name it in annotations

from conftest import smollm2_gguf_path
from tokenmill.bench.datasets import (
    allowed_token_ids,
    check_fits,
    ids_to_text,
    length_range,
    load_sharegpt,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)
from tokenmill.bench.hf_baseline import make_batches
from tokenmill.bench.metrics import RequestResult, arrival_times, percentile, serve_metrics, summarize
from tokenmill.bench.serve import FINISH_ONLY, ServeRequest, build_payload, chunk_content, join_url
from tokenmill.entrypoints.cli import main
from tokenmill.errors import TokenmillError


# -- datasets ------------------------------------------------------------------
def test_random_dataset_lengths_in_range_and_reproducible():
    reqs = random_dataset(50, 100, (16, 40), (3, 9), seed=7, exclude={0, 1, 2})
    assert len(reqs) == 50
    assert all(16 <= r.prompt_len <= 40 and 3 <= r.output_len <= 9 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5  # really drawn from the range
    assert all(3 <= t < 100 for r in reqs for t in r.prompt_token_ids)  # special ids avoided
    again = random_dataset(50, 100, (16, 40), (3, 9), seed=7, exclude={0, 1, 2})
    assert [(r.prompt_token_ids, r.output_len) for r in again] == [(r.prompt_token_ids, r.output_len) for r in reqs]
    other = random_dataset(50, 100, (16, 40), (3, 9), seed=8, exclude={0, 1, 2})
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]
    fixed = random_dataset(3, 100, (5, 5), (7, 7))
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(5, 7)] * 3


def test_length_range():
    assert length_range("input", 128) == (128, 128)
    assert length_range("input", 100, 0.5) == (50, 150)
    assert length_range("input", 100, 0.5, low=16, high=512) == (16, 512)
    with pytest.raises(ValueError, match="range is empty"):
        length_range("input", 100, 0.0, low=20, high=10)
    with pytest.raises(ValueError, match="at least 1"):
        length_range("output", 100, 0.0, low=0)
    with pytest.raises(ValueError, match="random-range-ratio"):
        length_range("input", 100, 1.5)
    with pytest.raises(ValueError, match="special token"):
        allowed_token_ids(3, exclude={0, 1, 2})
    with pytest.raises(ValueError, match="num-prompts"):
        random_dataset(0, 100, (1, 1), (1, 1))


def test_prefix_dataset_shares_exactly_the_prefix():
    reqs = prefix_dataset(64, 512, prefix_len=40, suffix_len=8, output_len=5, seed=3)
    assert all(r.prompt_len == 48 and r.output_len == 5 for r in reqs)
    prefix = reqs[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == prefix for r in reqs)
    # Any two requests share exactly the prefix: their suffixes differ at the first token.
    assert len({r.prompt_token_ids[40] for r in reqs}) == 64
    two = prefix_dataset(6, 512, prefix_len=10, suffix_len=2, output_len=1, seed=3, num_prefixes=2)
    assert two[0].prompt_token_ids[:10] == two[2].prompt_token_ids[:10] != two[1].prompt_token_ids[:10]


class WordTokenizer:
    """A stand-in tokenizer: one token per whitespace-separated word."""

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join("w" * max(i, 1) for i in ids)


def _conversation(prompt_words: int, answer_words: int) -> dict:
    return {
        "id": "x",
        "conversations": [
            {"from": "human", "value": " ".join(["hello"] * prompt_words)},
            {"from": "gpt", "value": " ".join(["ok"] * answer_words)},
        ],
    }


def test_sharegpt_parsing_and_filter(tmp_path):
    data = [
        _conversation(10, 20),
        _conversation(2, 20),  # prompt too short: dropped, as vLLM does
        _conversation(12, 3),  # completion too short: dropped
        {"id": "y", "conversations": [{"from": "human", "value": "only one turn"}]},  # not a pair
        "junk",
        _conversation(30, 40),
        _conversation(8, 100),  # 108 tokens: longer than max_model_len 64 below
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    assert len(load_sharegpt(str(path))) == 5
    reqs = sharegpt_dataset(str(path), WordTokenizer(), num_prompts=10, seed=0, max_model_len=80)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(10, 20), (30, 40)]
    assert all(r.prompt.startswith("hello") for r in reqs)
    fixed = sharegpt_dataset(str(path), WordTokenizer(), num_prompts=1, seed=0, output_len=5)
    assert len(fixed) == 1 and fixed[0].output_len == 5


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ('{"conversations": []}', "JSON list"),
        ('[{"conversations": [{"from": "human", "value": "hi"}]}]', "no conversation with at least two turns"),
    ],
)
def test_sharegpt_bad_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenmillError, match=message):
        sharegpt_dataset(str(path), WordTokenizer(), num_prompts=4)


def test_check_fits_and_ids_to_text():
    reqs = random_dataset(2, 50, (10, 10), (6, 6))
    check_fits(reqs, 16)
    with pytest.raises(ValueError, match="more than the context length 15"):
        check_fits(reqs, 15)
    text, n = ids_to_text(WordTokenizer(), [3, 4, 5])
    assert text == "www wwww wwwww" and n == 3


# -- metrics -------------------------------------------------------------------
def test_percentile_and_summarize():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([], 99) == 0.0
    s = summarize([0.010, 0.020, 0.030, 0.040], (50, 99))
    assert s["mean"] == pytest.approx(25.0) and s["median"] == pytest.approx(25.0)
    assert s["p50"] == pytest.approx(25.0) and s["p99"] == pytest.approx(39.7)
    assert summarize([], (99,)) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    assert "p99.9" in summarize([1.0], (99.9,))


def test_serve_metrics_on_synthetic_timings():
    ok1 = RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.02, 0.02, 0.03, 0.03], latency=0.2)
    ok2 = RequestResult(success=True, prompt_len=20, output_tokens=1, ttft=0.3, itl=[], latency=0.3)
    failed = RequestResult(success=False, prompt_len=30, error="HTTP 500: boom")
    m = serve_metrics([ok1, ok2, failed], duration=2.0, percentiles=(50, 99))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT only for requests with more than one token: (0.2 - 0.1) / 4
    assert m["mean_tpot_ms"] == pytest.approx(25.0)
    assert m["mean_itl_ms"] == pytest.approx(25.0) and m["p50_itl_ms"] == pytest.approx(25.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0) and m["p99_e2el_ms"] == pytest.approx(299.0)
    assert serve_metrics([failed], 1.0)["mean_ttft_ms"] == 0.0


def test_poisson_schedule_mean_rate():
    times = arrival_times(4000, request_rate=20.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert np.std(gaps) == pytest.approx(1 / 20.0, rel=0.1)  # exponential gaps: std = mean
    even = np.diff(arrival_times(4000, request_rate=20.0, burstiness=8.0, seed=1))
    assert np.mean(even) == pytest.approx(1 / 20.0, rel=0.05) and np.std(even) < 0.5 * np.std(gaps)
    assert arrival_times(5, float("inf")) == [0.0] * 5
    assert arrival_times(3, 2.0, seed=4) == arrival_times(3, 2.0, seed=4)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0)


def test_chunk_rules_and_payload():
    assert chunk_content({"choices": [{"text": "a", "finish_reason": None}]}, chat=False) == "a"
    assert chunk_content({"choices": [{"text": "", "finish_reason": None}]}, chat=False) == ""
    assert chunk_content({"choices": [{"text": "", "finish_reason": "length"}]}, chat=False) is FINISH_ONLY
    assert chunk_content({"choices": [{"text": "b", "finish_reason": "length"}]}, chat=False) == "b"
    assert chunk_content({"choices": [{"delta": {}, "finish_reason": "stop"}]}, chat=True) is FINISH_ONLY
    assert chunk_content({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) is None
    assert chunk_content({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True) is None
    assert chunk_content({"choices": [{"delta": {"content": "hi"}}]}, chat=True) == "hi"
    assert join_url("http://h:1/v1/", "/v1/completions") == "http://h:1/v1/completions"
    payload = build_payload("/v1/completions", "m", ServeRequest([1, 2], 2, 7), ignore_eos=True)
    assert payload["prompt"] == [1, 2] and payload["max_tokens"] == 7 and payload["ignore_eos"] is True
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True} and payload["temperature"] == 0
    chat = build_payload("/v1/chat/completions", "m", ServeRequest("hi", 1, 3), ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    assert make_batches(list(range(5)), 2) == [[0, 1], [2, 3], [4]] and make_batches(list(range(5)), 0) == [list(range(5))]


# -- the commands on a tiny model ---------------------------------------------
def _run(capsys, *argv):
    rc = main(["bench", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bench_throughput_cli(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory("llama_gqa")
    out_json = tmp_path / "tp.json"
    rc, out, err = _run(
        capsys, "throughput", "--model", model, "--num-prompts", "5", "--min-input-len", "4", "--max-input-len", "20",
        "--output-len", "6", "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    assert "Output token throughput (tok/s):" in out and "Peak KV cache usage:" in out and "Throughput:" in out
    result = json.loads(out_json.read_text())
    m = result["tokenmill"]
    assert m["num_requests"] == 5 and m["total_output_tokens"] == 30
    assert m["total_input_tokens"] == result["dataset"]["total_input_tokens"]
    assert 4 <= result["dataset"]["input_len_min"] <= result["dataset"]["input_len_max"] <= 20
    assert m["output_tokens_per_second"] > 0 and m["elapsed_time"] > 0
    assert 0 < m["peak_kv_cache_usage"] <= 1 and m["mean_ttft_ms"] > 0
    assert result["args"]["num_prompts"] == 5 and "hf" not in result


def test_bench_throughput_samples_with_the_given_settings(tiny_model_factory, tmp_path, capsys):
    out_json = tmp_path / "tp.json"
    rc, out, err = _run(capsys, "throughput", "--model", tiny_model_factory("llama_gqa"), "--num-prompts", "4", "--input-len", "8",
                        "--output-len", "5", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--disable-tqdm",
                        "--json", str(out_json))
    assert rc == 0, err
    result = json.loads(out_json.read_text())
    assert result["tokenmill"]["total_output_tokens"] == 20
    assert (result["args"]["temperature"], result["args"]["top_p"], result["args"]["top_k"]) == (0.8, 0.9, 20)


def test_bench_throughput_prefix_reports_ttft_and_cache_hits(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory("llama_gqa")
    results = {}
    for flag in ([], ["--no-prefix-caching"]):
        out_json = tmp_path / f"prefix{len(flag)}.json"
        rc, out, err = _run(
            capsys, "throughput", "--model", model, "--dataset", "prefix", "--num-prompts", "4", "--prefix-len", "64",
            "--suffix-len", "4", "--output-len", "2", "--max-num-batched-tokens", "80", "--disable-tqdm",
            "--json", str(out_json), *flag,
        )
        assert rc == 0, err
        assert "Mean TTFT (ms):" in out
        results[bool(flag)] = json.loads(out_json.read_text())["tokenmill"]
    assert results[False]["prefix_cache_hits"] > 0  # later requests found the 64-token prefix cached
    assert results[True]["prefix_cache_hits"] == 0
    assert results[False]["total_input_tokens"] == results[True]["total_input_tokens"] == 4 * 68


def test_bench_latency_cli(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory("llama_gqa")
    out_json = tmp_path / "lat.json"
    rc, out, err = _run(
        capsys, "latency", "--model", model, "--batch-size", "3", "--input-len", "8", "--output-len", "4",
        "--num-iters-warmup", "1", "--num-iters", "2", "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    assert "Prefill time (ms):" in out and "Decode time per token (ms):" in out
    result = json.loads(out_json.read_text())
    m = result["tokenmill"]
    assert m["num_iters"] == 2 and len(m["latencies"]) == 2
    assert 0 < m["prefill_time_ms"] and 0 < m["decode_time_per_token_ms"]
    assert m["prefill_time_ms"] / 1000 <= m["median_latency"]
    assert result["batch_size"] == 3 and set(m["percentiles"]) == {"10", "25", "50", "75", "90", "99"}


def test_baseline_hf(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory("llama_gqa")
    out_json = tmp_path / "hf.json"
    rc, out, err = _run(
        capsys, "throughput", "--model", model, "--num-prompts", "5", "--min-input-len", "4", "--max-input-len", "12",
        "--min-output-len", "2", "--max-output-len", "6", "--baseline", "hf", "--hf-batch-size", "2",
        "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    assert "HF transformers baseline" in out and "(ratio > 1: tokenmill is faster)" in out
    result = json.loads(out_json.read_text())
    hf, ours = result["hf"], result["tokenmill"]
    assert hf["num_batches"] == 3 and hf["batch_size"] == 2
    assert hf["total_output_tokens"] == ours["total_output_tokens"] == result["dataset"]["total_output_tokens"]
    assert hf["generated_tokens_incl_padding"] >= hf["total_output_tokens"]
    assert result["ratio"]["output_tokens_per_second"] == pytest.approx(
        ours["output_tokens_per_second"] / hf["output_tokens_per_second"]
    )

    out_json = tmp_path / "hf_lat.json"
    rc, out, err = _run(
        capsys, "latency", "--model", model, "--batch-size", "2", "--input-len", "6", "--output-len", "3",
        "--num-iters-warmup", "1", "--num-iters", "1", "--baseline", "hf", "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    result = json.loads(out_json.read_text())
    assert result["hf"]["prefill_time_ms"] > 0 and result["hf"]["decode_time_per_token_ms"] >= 0  # timing noise on a busy CPU
    assert set(result["ratio"]) == {"prefill_time_ms", "decode_time_per_token_ms", "median_latency"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["throughput", "--num-prompts", "0"], "--num-prompts must be at least 1"),
        (["throughput", "--input-len", "250", "--output-len", "10"], "more than the context length 256"),
        (["throughput", "--dataset", "sharegpt", "--dataset-path", "/no/such/file.json"], "no such file"),
        (["throughput", "--min-input-len", "30", "--max-input-len", "10"], "range is empty"),
        (["latency", "--batch-size", "4", "--max-num-seqs", "2"], "more than --max-num-seqs"),
        (["throughput", "--json", "/no/such/dir/out.json"], "does not exist"),
        (["throughput", "--top-p", "1.5"], "top_p"),
        (["throughput", "--temperature", "0.8", "--baseline", "hf"], "--baseline hf decodes greedily"),
    ],
)
def test_bad_input_is_a_one_line_error(tiny_model_factory, capsys, argv, message):
    model = tiny_model_factory("llama_gqa")
    rc, out, err = _run(capsys, *argv, "--model", model, "--disable-tqdm")
    assert rc == 2
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


# -- bench serve against a stand-in server ------------------------------------
class StandInServer:
    """A tiny OpenAI-compatible streaming server: /v1/models, and /v1/completions and /v1/chat/completions
    that stream max_tokens one-token chunks (a first-token delay, then a fixed gap) and a usage chunk.
    A request asking for exactly 3 tokens gets HTTP 500, so failures can be counted."""

    FIRST_DELAY = 0.05
    GAP = 0.01

    def __init__(self) -> None:
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        self.payloads: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

        async def stream(body: dict, chat: bool):
            await asyncio.sleep(self.FIRST_DELAY)
            n = body["max_tokens"]
            if chat:
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
            for i in range(n):
                if i:
                    await asyncio.sleep(self.GAP)
                last = "length" if i == n - 1 else None
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                choice["finish_reason"] = last
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.payloads.append(body)
            if body.get("max_tokens") == 3:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            return StreamingResponse(stream(body, chat), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the stand-in server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def stand_in_server():
    with StandInServer() as server:
        yield server


def test_bench_serve_against_stand_in_server(stand_in_server, tiny_model_factory, tmp_path, capsys):
    tokenizer = tiny_model_factory("llama_gqa")  # no tokenizer files: token-id prompts from its 512-token vocabulary
    out_json = tmp_path / "serve.json"
    rc, out, err = _run(
        capsys, "serve", "--base-url", f"http://127.0.0.1:{stand_in_server.port}", "--tokenizer", tokenizer,
        "--num-prompts", "12", "--min-input-len", "4", "--max-input-len", "10", "--min-output-len", "3",
        "--max-output-len", "6", "--request-rate", "200", "--max-concurrency", "4", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out and "P99 E2EL (ms):" in out
    result = json.loads(out_json.read_text())
    sent = stand_in_server.payloads[1:]  # the first is the test request
    assert stand_in_server.payloads[0]["max_tokens"] == 2
    assert len(sent) == 12
    assert all(p["model"] == "stand-in" and p["stream"] and p["ignore_eos"] and p["temperature"] == 0 for p in sent)
    assert all(isinstance(p["prompt"], list) and 4 <= len(p["prompt"]) <= 10 for p in sent)
    failed = sum(p["max_tokens"] == 3 for p in sent)
    assert result["failed"] == failed and result["completed"] == 12 - failed
    assert result["errors"].count("") == 12 - failed and any("HTTP 500" in e and "boom" in e for e in result["errors"]) == bool(failed)
    if failed:
        assert "requests failed" in err
    expected_out = sum(p["max_tokens"] for p in sent if p["max_tokens"] != 3)
    assert result["total_output_tokens"] == expected_out  # from the usage chunks
    assert result["mean_ttft_ms"] >= StandInServer.FIRST_DELAY * 1000 * 0.9
    assert result["mean_tpot_ms"] >= StandInServer.GAP * 1000 * 0.9 and result["mean_itl_ms"] >= StandInServer.GAP * 1000 * 0.9
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert "p50_ttft_ms" in result and "p99_itl_ms" in result
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    assert all(len(result["itls"][i]) == result["output_lens"][i] - 1 for i in ok)


def test_bench_serve_chat_text_prompts(stand_in_server, capsys, tmp_path):
    if smollm2_gguf_path() is None:  # the embedded model's tokenizer decodes the random prompts to text
        pytest.skip("the embedded default model is not installed")
    out_json = tmp_path / "chat.json"
    rc, out, err = _run(
        capsys, "serve", "--port", str(stand_in_server.port), "--endpoint", "/v1/chat/completions", "--model", "stand-in",
        "--num-prompts", "3", "--input-len", "12", "--output-len", "4", "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    result = json.loads(out_json.read_text())
    assert result["completed"] == 3 and result["total_output_tokens"] == 12 and result["prompt_format"] == "text"
    sent = stand_in_server.payloads[1:]
    assert all(isinstance(p["messages"][0]["content"], str) and p["messages"][0]["content"] for p in sent)
    # the role-only chunk is not a token: 4 content chunks, 3 gaps each
    assert all(len(itl) == 3 for itl in result["itls"])


def test_bench_serve_unreachable_server_is_a_clear_error(tiny_model_factory, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err = _run(
        capsys, "serve", "--port", str(port), "--tokenizer", tiny_model_factory("llama_gqa"), "--num-prompts", "2", "--disable-tqdm"
    )
    assert rc == 2 and err.startswith("error: cannot reach the server") and "Traceback" not in err
    rc, out, err = _run(
        capsys, "serve", "--port", str(port), "--model", "m", "--tokenizer", tiny_model_factory("llama_gqa"), "--num-prompts", "2",
        "--disable-tqdm",
    )
    assert rc == 2 and "the test request" in err and "Connect" in err


def test_inf_rate_is_recorded_in_json_as_a_string(stand_in_server, tiny_model_factory, tmp_path, capsys):
    out_json = tmp_path / "inf.json"
    rc, out, err = _run(
        capsys, "serve", "--port", str(stand_in_server.port), "--tokenizer", tiny_model_factory("llama_gqa"),
        "--num-prompts", "2", "--input-len", "5", "--output-len", "2", "--disable-tqdm", "--json", str(out_json),
    )
    assert rc == 0, err
    result = json.loads(out_json.read_text())  # strict JSON: no Infinity literal
    assert result["request_rate"] == "inf" and result["args"]["request_rate"] == "inf"
    assert not math.isnan(result["duration"])


def test_bench_serve_against_tokenmill_server(tiny_model_factory, tmp_path, capsys):
    """The real `tokenmill serve` on a tiny model (no tokenizer: its streams carry no text, only tokens)."""
    import importlib.util
    import os
    import subprocess
    import sys

    import httpx

    if importlib.util.find_spec("tokenmill.entrypoints.openai.api_server") is None:
        pytest.skip("tokenmill's server is not there")
    model = tiny_model_factory("llama_gqa")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", model, "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        for dataset_args, n, out_tokens in (
            (["--num-prompts", "4", "--input-len", "8", "--output-len", "5"], 4, 20),
            (["--dataset", "prefix", "--num-prompts", "3", "--prefix-len", "32", "--suffix-len", "4", "--output-len", "2"], 3, 6),
        ):
            out_json = tmp_path / "real.json"
            rc, out, err = _run(
                capsys, "serve", "--port", str(port), "--tokenizer", model, *dataset_args, "--disable-tqdm", "--json", str(out_json)
            )
            assert rc == 0, err
            result = json.loads(out_json.read_text())
            assert result["completed"] == n and result["failed"] == 0, result["errors"]
            assert result["total_output_tokens"] == out_tokens  # the server's usage
            assert result["mean_ttft_ms"] > 0 and result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_bench_startup_times_a_fresh_process(tiny_model_factory, capsys):
    from tokenmill.bench.startup import format_startup, run_startup

    result = run_startup({"model": tiny_model_factory("llama_gqa"), "dtype": "float32"}, [], num_runs=1, serve=False)
    median = result["median"]
    assert set(median) == {"interpreter_s", "import_s", "engine_s", "first_token_s", "total_s"}
    assert all(v >= 0 for v in median.values())
    assert median["total_s"] >= median["import_s"] + median["engine_s"] + median["first_token_s"] - 1e-6
    assert "command to first token" in format_startup(result)
