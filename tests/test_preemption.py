"""End to end through the real engine: a KV cache so small that requests are preempted and
recomputed, yet every request gives exactly the tokens it gives when run alone."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams

NUM_PROMPTS = 8
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(10, 20))] for _ in range(NUM_PROMPTS)]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in range(NUM_PROMPTS)]


def seeded_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(NUM_PROMPTS)]


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=7 * i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(NUM_PROMPTS)
    ]


PARAM_SETS = {"greedy": greedy_params, "seeded": seeded_params, "mixed": mixed_params}


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    """Each prompt alone, with room to spare: no preemption possible."""
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=4)
    out = {}
    for name, make in PARAM_SETS.items():
        out[name] = [
            llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(prompts, make())
        ]
    assert llm.llm_engine.scheduler.num_preemptions == 0
    return out


def assert_all_free(llm: LLM) -> None:
    scheduler = llm.llm_engine.scheduler
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.running and not scheduler.waiting


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(max_num_batched_tokens=64),
        dict(max_num_batched_tokens=64, enable_chunked_prefill=False),
        dict(max_num_batched_tokens=8),  # prompts and recomputes spread over several chunks
    ],
    ids=["budget64", "no-chunking", "budget8"],
)
def test_preemption_gives_the_same_tokens(tiny_llama, prompts, reference, engine_kwargs):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=12, block_size=4, **engine_kwargs)
    scheduler = llm.llm_engine.scheduler
    for name, make in PARAM_SETS.items():
        before = scheduler.num_preemptions
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=make(), use_tqdm=False)
        assert scheduler.num_preemptions > before, f"{name}: the cache was big enough; no preemption happened"
        got = [o.outputs[0].token_ids for o in outputs]
        assert all(len(t) == MAX_TOKENS for t in got)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert got == reference[name], name
        assert_all_free(llm)


def test_seeded_sampling_is_not_greedy(reference):
    # Guards the test above: the seeded runs must really sample.
    assert reference["seeded"] != reference["greedy"]


def test_abort_midway_frees_blocks(tiny_llama, prompts):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=12, block_size=4, max_num_batched_tokens=64)
    engine = llm.llm_engine
    ids = [engine.add_request({"prompt_token_ids": p}, greedy_params()[0]) for p in prompts]
    for _ in range(6):
        engine.step()
    assert engine.scheduler.kv_cache.pool.num_free_blocks < engine.scheduler.kv_cache.pool.num_blocks - 1
    for request_id in ids[::2]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(llm)


def test_min_tokens_masks_stop_tokens_in_the_real_sampler(tiny_llama, prompts, reference):
    """min_tokens bans EOS / stop tokens in the sampler (as vLLM does), greedy rows included."""
    first = reference["greedy"][0][0]  # the token greedy decoding emits first
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=4)
    stop_now = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[first])
    (out,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=stop_now, use_tqdm=False)
    assert out.outputs[0].token_ids == [first] and out.outputs[0].stop_reason == first
    deferred = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=3, stop_token_ids=[first])
    (out,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=deferred, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert first not in tokens[:3]
    assert len(tokens) >= 3
    if len(tokens) < MAX_TOKENS:
        assert tokens[-1] == first and out.outputs[0].finish_reason == "stop"
    assert_all_free(llm)
