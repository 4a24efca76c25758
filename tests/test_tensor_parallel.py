"""Tensor parallelism: two ranks (rank 0 here, rank 1 a spawned process, gloo between them) compute what
one rank computes: greedy outputs identical at float32 on every architecture, with chunked prefill,
prefix caching, preemption, n > 1, speculative decoding and structured output; a rank that dies fails
the engine with a clear error, never a hang."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import ParallelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.executor import ExecutorDiedError
from tokenmill.executor.tensor_parallel import cpu_share
from tokenmill.layers.linear import HeadPartition
from tokenmill.sampling_params import StructuredOutputsParams

from conftest import smollm2_gguf_path
from server_utils import RemoteServer

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def engine(model: str | None, **kwargs):
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    llm = LLM(model, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def token_prompts(n: int, seed: int, vocab: int = 512, lengths=(3, 40)) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1], (1,), generator=gen))
        out.append({"prompt_token_ids": torch.randint(0, vocab, (length,), generator=gen).tolist()})
    return out


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def generate_both(model: str | None, prompts, params, tp_kwargs=None, **kwargs):
    """Outputs of one rank, then of two ranks, on the same prompts."""
    with engine(model, **kwargs) as one:
        reference = one.generate(prompts, params, use_tqdm=False)
    with engine(model, tensor_parallel_size=2, **{**kwargs, **(tp_kwargs or {})}) as two:
        outputs = two.generate(prompts, params, use_tqdm=False)
        pool = two.llm_engine.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_usable_blocks  # every block given back
        stats = two.llm_engine.stats()
    return reference, outputs, stats


# -- the layout ---------------------------------------------------------------------------------


def test_heads_split_by_kv_group_evenly_uneven_or_replicated():
    # SmolLM2: 9 heads in 3 KV groups over 2 ranks -> 1 group and 2 groups.
    assert HeadPartition.of(9, 3, 0, 2) == HeadPartition(3, 1, 0, 0)
    assert HeadPartition.of(9, 3, 1, 2) == HeadPartition(6, 2, 3, 1)
    # One KV head over 2 ranks: replicated, its 4 query heads split.
    assert HeadPartition.of(4, 1, 1, 2) == HeadPartition(2, 1, 2, 0)
    assert HeadPartition.of(4, 4, 1, 2) == HeadPartition(2, 2, 2, 2)
    with pytest.raises(ModelLoadError, match="must be at most, or a multiple of, the number of KV heads"):
        HeadPartition.of(4, 2, 0, 3)


def test_cores_are_split_evenly_between_ranks():
    assert cpu_share(0, 2, [0, 1, 2, 3]) == [0, 1] and cpu_share(1, 2, [0, 1, 2, 3]) == [2, 3]
    assert cpu_share(1, 4, [0, 1]) == [0, 1]  # fewer cores than ranks: every rank may use all


def test_parallel_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        ParallelConfig(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match='"uni" runs one rank'):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


# -- outputs equal to one rank ------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama_gqa", "llama_mqa_tied", "llama_bias", "mistral_swa", "qwen2", "qwen3", "gpt2"])
def test_two_ranks_decode_what_one_rank_decodes(tiny_model_factory, model):
    folder = tiny_model_factory(model)
    prompts = token_prompts(5, seed=3)
    reference, outputs, _ = generate_both(folder, prompts, GREEDY, skip_tokenizer_init=True, kv_cache_memory=8 << 20)
    assert token_ids(outputs) == token_ids(reference)


def test_chunked_prefill_prefix_caching_preemption_and_n_greater_than_one(tiny_model_factory):
    folder = tiny_model_factory("llama_gqa")
    shared = token_prompts(1, seed=5, lengths=(60, 61))[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in token_prompts(6, seed=6)]
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=7, n=2, logprobs=2, ignore_eos=True)
    # 16-token chunks, and so few KV blocks that the batch cannot all fit: preemption.
    kwargs = dict(skip_tokenizer_init=True, num_kv_blocks=24, max_num_batched_tokens=16)
    reference, outputs, stats = generate_both(folder, prompts, params, **kwargs)
    assert token_ids(outputs) == token_ids(reference)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for ref, out in zip(reference, outputs):
        for a, b in zip(ref.outputs, out.outputs):
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def test_speculative_decoding_with_a_draft_model_and_ngram(tiny_model_factory):
    folder = tiny_model_factory("qwen2")
    prompts = token_prompts(4, seed=8)
    for spec in ({"method": "draft_model", "model": "self", "num_speculative_tokens": 3, "disable_by_batch_size": None},
                 {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}):
        reference, outputs, stats = generate_both(folder, prompts, GREEDY, tp_kwargs={"speculative_config": spec},
                                                  skip_tokenizer_init=True, kv_cache_memory=8 << 20)
        assert token_ids(outputs) == token_ids(reference)
        assert stats.spec_decode.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_shards_quantize_per_rank(tiny_model_factory, method):
    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(3, seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0)
    options = {"group_size": 32} if method == "int4" else None
    reference, outputs, _ = generate_both(folder, prompts, params, skip_tokenizer_init=True, kv_cache_memory=8 << 20,
                                          quantization=method, quantization_options=options)
    # A row-parallel layer's scales are its rank's (over its slice of the input channels), so two ranks
    # round a little differently from one: the prompt's logprobs agree closely, not bit for bit.
    for ref, out in zip(reference, outputs):
        ref_lp = [next(iter(d.values())).logprob for d in ref.prompt_logprobs[1:]]
        out_lp = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        assert out_lp == pytest.approx(ref_lp, abs=0.15)


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs the embedded SmolLM2 model")
def test_smollm2_uneven_heads_text_and_json_schema():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))]
    prompts = ["The capital of France is", "Give me a person as JSON:"]
    reference, outputs, _ = generate_both(None, prompts, params)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in reference]
    json.loads(outputs[1].outputs[0].text)


# -- errors -------------------------------------------------------------------------------------


def test_a_model_that_cannot_be_split_is_a_clear_error(tiny_model_factory):
    with pytest.raises(ModelLoadError, match="must be at most, or a multiple of, the number of KV heads"):
        LLM(tiny_model_factory("llama_gqa"), tensor_parallel_size=3, skip_tokenizer_init=True, device="cpu")


def test_a_rank_that_dies_fails_the_engine_not_a_hang(tiny_model_factory):
    folder = tiny_model_factory("llama_gqa")
    cores_before = os.sched_getaffinity(0)
    llm = LLM(folder, tensor_parallel_size=2, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory=8 << 20)
    [follower] = llm.llm_engine.executor.processes
    # The collectives' shared file is unlinked once both ranks have mapped it: a killed rank leaves nothing.
    assert not glob.glob(f"/dev/shm/tokenmill-tp-{os.getpid()}-*")
    os.kill(follower.pid, signal.SIGKILL)
    follower.join(10)
    start = time.monotonic()
    with pytest.raises(ExecutorDiedError, match="rank 1 exited"):
        llm.generate(token_prompts(2, seed=1), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.llm_engine.shutdown()
    assert os.sched_getaffinity(0) == cores_before  # rank 0's pinning is given back


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs the embedded SmolLM2 model")
def test_serve_with_two_ranks_and_a_rank_that_dies():
    server = RemoteServer(["--tensor-parallel-size", "2", "--dtype", "float32"])
    try:
        client = server.client(timeout=60)
        done = client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                         max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 8
        # Kill rank 1: requests fail with an error, and /health says the engine is gone.
        [rank1] = [c for c in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        rank1.kill()
        with pytest.raises(openai.APIError):
            client.completions.create(model=done.model, prompt="hello", max_tokens=8, temperature=0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and httpx.get(server.url("/health")).status_code == 200:
            time.sleep(0.5)
        assert httpx.get(server.url("/health")).status_code != 200
    finally:
        server.stop()
