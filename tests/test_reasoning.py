"""Reasoning output (--reasoning-parser qwen3 | deepseek_r1): <think>...</think> goes to reasoning_content.

The parsers on recorded outputs, whole and streamed in arbitrary pieces; the grammar that lets the
reasoning through and constrains only the answer (checked with xgrammar's matcher, and applied by
the engine to a tiny model); and the server over a scripted engine, with the openai client:
message.reasoning_content and delta.reasoning_content, enable_thinking passed to the template,
reasoning before tool calls, and structured output applied to the answer only.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from tokenmill.entrypoints.openai.chat_output import ChoiceParser  # noqa: E402
from tokenmill.entrypoints.openai.reasoning_grammar import reasoning_grammar  # noqa: E402
from tokenmill.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser  # noqa: E402
from tokenmill.entrypoints.openai.tool_parsers import get_tool_parser  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402

from chat_fakes import (  # noqa: E402
    WEATHER_TOOL,
    ScriptedEngine,
    build_tiny_chat_model,
    make_client,
    smollm2_tools_tokenizer,
    tools_tokenizer,
)
from conftest import smollm2_gguf_path  # noqa: E402

ASK = [{"role": "user", "content": "What is the capital of France?"}]
# Qwen3-8B, thinking on
QWEN3 = ("<think>\nOkay, the user is asking for the capital of France. That's Paris.\n</think>\n\n"
         "The capital of France is **Paris**.")
# DeepSeek-R1-Distill: the template ends the prompt with "<think>\n", so the output starts inside the reasoning
R1 = "Okay, so I need to find 2 + 2.\nThat is 4.\n</think>\n\nThe answer is **4**."

RECORDED = [
    ("qwen3", QWEN3, "Okay, the user is asking for the capital of France. That's Paris.", "The capital of France is **Paris**."),
    ("qwen3", "The capital of France is Paris.", None, "The capital of France is Paris."),  # enable_thinking=false
    ("qwen3", "<think>\n\n</think>\n\nParis.", None, "Paris."),  # an empty think block
    ("qwen3", "<think>\nLet me think about this for a long", "Let me think about this for a long", None),  # cut off
    ("qwen3", "  <thinking> is not the tag", None, "  <thinking> is not the tag"),
    ("deepseek_r1", R1, "Okay, so I need to find 2 + 2.\nThat is 4.", "The answer is **4**."),
    ("deepseek_r1", "<think>\nHmm.\n</think>\nFour.", "Hmm.", "Four."),  # an opening tag in the output
    ("deepseek_r1", "Still thinking about </thin", "Still thinking about </thin", None),  # no </think>: all reasoning
]


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rng.choice([1, 1, 2, 3, 4, 7])
        out.append(text[i : i + k])
        i += k
    return out


@pytest.mark.parametrize("name, text, reasoning, content", RECORDED)
def test_recorded_outputs(name, text, reasoning, content):
    assert get_reasoning_parser(name)().extract(text) == (reasoning, content)
    for pieces in [list(text), [text]] + [random_pieces(text, seed) for seed in range(20)]:
        parser = get_reasoning_parser(name)()
        got_r = got_c = ""
        for p in pieces:
            r, c = parser.extract_streaming(p)
            got_r, got_c = got_r + r, got_c + c
            assert "<think>" not in got_r + got_c and "</think>" not in got_r + got_c  # tags never show
        r, c = parser.finish()
        assert (got_r + r, got_c + c) == (reasoning or "", content or ""), pieces


def test_registry():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose from deepseek_r1, qwen3"):
        get_reasoning_parser("r2")


def test_reasoning_then_tool_calls():
    """Qwen3 thinks, then calls a tool: the tool parser reads only what follows the reasoning."""
    text = ('<think>\nThe user wants the weather; I will call get_weather with <tool_call> tags.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')

    def make():
        return ChoiceParser(get_reasoning_parser("qwen3")(), get_tool_parser("hermes")())

    whole = make().whole(text)
    assert whole.reasoning_content == "The user wants the weather; I will call get_weather with <tool_call> tags."
    assert whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    for seed in range(10):
        parser = make()
        reasoning, content, args = "", "", ""
        for d in [parser.delta(p) for p in random_pieces(text, seed)] + [parser.finish()]:
            reasoning += d.reasoning_content
            content += d.content
            args += "".join(c.arguments for c in d.tool_calls)
        assert reasoning == whole.reasoning_content and content == "" and args == whole.tool_calls[0].arguments


# ------------------------------------------------------------------ structured output after the reasoning

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "<think>", "</think>", "<eos>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return xgr, xgr.GrammarCompiler(info)


def accepts(compiler, ebnf: str, text: str) -> bool:
    xgr, c = compiler
    matcher = xgr.GrammarMatcher(c.compile_grammar(ebnf))
    return matcher.accept_string(text) and matcher.is_completed()


def test_the_grammar_constrains_only_the_answer(compiler):
    qwen3 = reasoning_grammar(get_reasoning_parser("qwen3"), StructuredOutputsParams(json=SCHEMA))
    assert accepts(compiler, qwen3, '<think>\nAny {text, "not JSON" at all} <tags>.\n</think>\n\n{"city": "Paris"}')
    assert accepts(compiler, qwen3, '{"city": "Paris"}')  # enable_thinking=false: no think block
    assert not accepts(compiler, qwen3, '<think>\nhmm\n</think>\n\n{"town": "Paris"}')
    assert not accepts(compiler, qwen3, '<think>\nhmm\n</think>\n\nParis')
    assert not accepts(compiler, qwen3, '<think>\nhmm')  # the answer must come
    r1 = reasoning_grammar(get_reasoning_parser("deepseek_r1"), StructuredOutputsParams(choice=["yes", "no"]))
    assert accepts(compiler, r1, "Is it? Well...\n</think>\n\nyes")
    assert accepts(compiler, r1, "<think>\nNo.\n</think>no")
    assert not accepts(compiler, r1, "yes")  # deepseek_r1 reasons first
    assert not accepts(compiler, r1, "Hmm.\n</think>\n\nmaybe")
    regex = reasoning_grammar(get_reasoning_parser("qwen3"), StructuredOutputsParams(regex=r"[0-9]{3}"))
    assert accepts(compiler, regex, "<think>x</think>123") and not accepts(compiler, regex, "<think>x</think>12a")


def test_the_engine_applies_the_grammar(tmp_path):
    """The engine compiles the grammar for a real vocabulary and applies it: a tiny random model pushed
    (by logit_bias) to end its reasoning at once must then answer within the constraint."""
    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed (its tokenizer is used)")
    from tokenmill import LLM, SamplingParams
    from tokenmill.loader.gguf_file import load_gguf_source

    tok = tools_tokenizer(load_gguf_source(smollm2_gguf_path()).tokenizer)
    tok.add_tokens(["<think>", "</think>"])  # one token each, as in Qwen3 and DeepSeek-R1
    end_id = tok.convert_tokens_to_ids("</think>")
    llm = LLM(model=build_tiny_chat_model(str(tmp_path), tok), dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
    grammar = reasoning_grammar(get_reasoning_parser("deepseek_r1"), StructuredOutputsParams(choice=["yes", "no"]))
    prompt = "<|im_start|>user\nyes or no?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    constrained = SamplingParams(temperature=0, max_tokens=32, logit_bias={end_id: 100},
                                 structured_outputs=StructuredOutputsParams(grammar=grammar))
    free = SamplingParams(temperature=0, max_tokens=4, logit_bias={end_id: 100})
    out, unconstrained = (o.outputs[0] for o in llm.generate([prompt, prompt], [constrained, free], use_tqdm=False))
    assert unconstrained.text == "</think>" * 4  # without the grammar the bias wins every step
    assert out.finish_reason == "stop" and out.text.startswith("</think>")
    assert get_reasoning_parser("deepseek_r1")().extract(out.text) in ((None, "yes"), (None, "no"))


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tools_tokenizer()


@pytest.fixture()
def engine(tokenizer):
    return ScriptedEngine(tokenizer)



def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_reasoning_content_whole_and_streamed(engine):
    engine.script = pieces(QWEN3)
    with make_client(engine, reasoning_parser="qwen3") as c:
        r = c.chat.completions.create(model="fake", messages=ASK)
        message = r.choices[0].message
        assert message.reasoning_content == "Okay, the user is asking for the capital of France. That's Paris."
        assert message.content == "The capital of France is **Paris**." and r.choices[0].finish_reason == "stop"
        chunks = list(c.chat.completions.create(model="fake", messages=ASK, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        assert (reasoning, content) == (message.reasoning_content, message.content)
        # reasoning streams first, in several deltas, then the answer
        kinds = [("r" if getattr(d, "reasoning_content", None) else "c") for d in deltas if getattr(d, "reasoning_content", None) or d.content]
        assert kinds == sorted(kinds, reverse=True) and kinds.count("r") > 5
    with make_client(engine) as plain:  # without the flag the think block is content, as before
        assert plain.chat.completions.create(model="fake", messages=ASK).choices[0].message.content == QWEN3


def test_enable_thinking_false_reaches_the_template(engine):
    engine.script = pieces("Paris.")
    with make_client(engine, reasoning_parser="qwen3") as c:
        r = c.chat.completions.create(model="fake", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert engine.last_prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert r.choices[0].message.content == "Paris." and r.choices[0].message.reasoning_content is None
        c.chat.completions.create(model="fake", messages=ASK)
        assert engine.last_prompt.endswith("<|im_start|>assistant\n")


def test_structured_output_applies_to_the_answer(engine):
    engine.script = pieces('<think>\nThey want JSON {like this}.\n</think>\n\n{"city": "Paris"}')
    with make_client(engine, reasoning_parser="qwen3") as c:
        r = c.chat.completions.create(model="fake", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
        so = engine.last_params.structured_outputs
        assert so.json is None and "</think>" in so.grammar and '"\\"city\\""' in so.grammar  # reasoning, then the schema
        assert json.loads(r.choices[0].message.content) == {"city": "Paris"}
        assert r.choices[0].message.reasoning_content == "They want JSON {like this}."
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="fake", messages=ASK, extra_body={"guided_regex": "[unclosed"})
        assert info.value.body["param"] == "structured_outputs" and "invalid" in info.value.body["message"]


def test_reasoning_before_forced_and_auto_tool_calls(engine):
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    engine.script = pieces(f"Paris weather needed.\n</think>\n\n[{call}]")
    with make_client(engine, reasoning_parser="deepseek_r1", tool_call_parser="hermes", enable_auto_tool_choice=True) as c:
        r = c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER_TOOL], tool_choice="required")
        assert "TagDispatch" in engine.last_params.structured_outputs.grammar  # the tools' schema after the reasoning
        message = r.choices[0].message
        assert message.reasoning_content == "Paris weather needed." and not message.content
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
            ("get_weather", {"city": "Paris", "unit": "celsius"})]
        assert r.choices[0].finish_reason == "tool_calls"
        engine.script = pieces('Use the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
        chunks = list(c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER_TOOL], stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Use the tool."
        args = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
        assert json.loads(args) == {"city": "Oslo"} and not "".join(d.content or "" for d in deltas)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
