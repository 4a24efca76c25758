"""No request parameter can break or slow the engine for others: integers that do not fit int64,
text that is not valid Unicode, stop token ids outside the vocabulary, and unbounded stop lists
are refused when the request is made; per-sequence output work stays cheap for n > 1."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import MAX_STOP_STRINGS

HUGE = [1 << 63, 1 << 64, 18446744073709551616 * 7]


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize(
    "make",
    [
        lambda v: dict(top_k=v),
        lambda v: dict(n=v),
        lambda v: dict(min_tokens=v, max_tokens=None),
        lambda v: dict(max_tokens=v),
        lambda v: dict(stop_token_ids=[5, v], min_tokens=2),
        lambda v: dict(allowed_token_ids=[v]),
        lambda v: dict(logit_bias={str(v): 1.0}),
    ],
    ids=["top_k", "n", "min_tokens", "max_tokens", "stop_token_ids", "allowed_token_ids", "logit_bias"],
)
def test_integers_beyond_int64_are_refused_naming_the_parameter(make, value):
    kwargs = make(value)
    with pytest.raises(ValueError, match=rf"^{next(iter(kwargs))}.*2\*\*63"):
        SamplingParams(**kwargs)


def test_a_big_seed_is_fine():  # seeds are mixed into 64 bits, never stored as they are
    assert SamplingParams(seed=1 << 80).seed == 1 << 80


@pytest.mark.parametrize("field", ["stop", "bad_words"])
def test_lone_surrogates_in_text_parameters_are_refused(field):
    with pytest.raises(ValueError, match=rf"^{field} is not valid Unicode: .*U\+D800"):
        SamplingParams(**{field: ["ok", "bad \ud800 text"]})


def test_stop_lists_are_bounded():
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    with pytest.raises(ValueError, match="^stop takes at most 64 strings"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match="^stop takes at most .* of at most 1024 characters"):
        SamplingParams(stop=["x" * 1025])
    with pytest.raises(ValueError, match="^bad_words takes at most 256 words"):
        SamplingParams(bad_words=[f"w{i}" for i in range(257)])


def test_token_id_lists_drop_repeats():
    params = SamplingParams(stop_token_ids=[3, 3, 1, 3], allowed_token_ids=[7] * 100_000 + [2])
    assert params.stop_token_ids == [3, 1] and params.allowed_token_ids == [7, 2]


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(model=tiny_model_factory("llama_gqa"), dtype="float32", num_kv_blocks=64)


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_admission(llm):
    params = SamplingParams(stop_token_ids=[10**12], min_tokens=2, max_tokens=4)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids \[1000000000000\] are outside the vocabulary \[0, 512\)"):
        llm.llm_engine.make_request({"prompt_token_ids": [1, 2, 3]}, params)


def test_a_prompt_that_is_not_valid_unicode_is_refused(tiny_model_factory):
    from conftest import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed")
    llm = LLM(dtype="float32", max_model_len=64, kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequestError, match=r"^the prompt is not valid Unicode: .*U\+DC00 at index 3"):
        llm.llm_engine.make_request("abc\udc00", SamplingParams())
    # Detokenizers of the sequences of one request share the byte table (built once per process).
    tokenizer = llm.get_tokenizer()
    a = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams())
    b = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams())
    assert a._byte_of_char is not None and a._byte_of_char is b._byte_of_char


class _CharTokenizer:
    """Just enough tokenizer for IncrementalDetokenizer: one character per token."""

    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return 256

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


def _pending_reference(text: str, stops: list[str]) -> int:
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def test_held_back_stop_prefix_matches_the_plain_definition():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        detok = IncrementalDetokenizer(_CharTokenizer(), [], SamplingParams(stop=stops))
        detok.text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 10)))
        assert detok._pending_stop_prefix() == _pending_reference(detok.text, stops), (detok.text, stops)
