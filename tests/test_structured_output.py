"""Structured output (xgrammar) end to end on the embedded SmolLM2: every constrained output
parses / matches, bad constraints fail before anything runs, unconstrained neighbours are untouched."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.structured_output import choice_grammar  # noqa: E402
from tokenmill.errors import InvalidRequestError  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams as SO  # noqa: E402

SUBJECTS = ["a cat", "a teacher", "a pirate", "a robot", "a chef", "a child", "an astronaut", "a farmer",
            "a doctor", "a musician", "a king", "a spy"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "job": {"type": "string", "enum": ["cook", "pilot", "none"]},
    },
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so", 'she said "hi"\\']
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
GRAMMAR_RE = r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)"
UNCONSTRAINED = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


def _chat(llm: LLM, question: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def batch(llm):
    """One batched generate over every constraint kind (sampled, many seeds), plus greedy unconstrained rows."""
    jobs: list[tuple[str, str, SamplingParams]] = []
    for i, s in enumerate(SUBJECTS):
        sp = dict(temperature=0.8, seed=i)
        jobs.append(("json", _chat(llm, f"Describe {s} as JSON."), SamplingParams(max_tokens=64, structured_outputs=SO(json=SCHEMA), **sp)))
        if i < 4:
            jobs.append(("json_compact", _chat(llm, f"Describe {s} as JSON."),
                         SamplingParams(max_tokens=64, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True), **sp)))
        if i < 8:
            jobs.append(("json_object", _chat(llm, f"Describe {s} as a JSON object with one key."),
                         SamplingParams(max_tokens=128, structured_outputs=SO(json_object=True), **sp)))
            jobs.append(("regex", _chat(llm, f"Give a code for {s}."), SamplingParams(max_tokens=16, structured_outputs=SO(regex=REGEX), **sp)))
            jobs.append(("choice", _chat(llm, f"Is {s} happy?"), SamplingParams(max_tokens=16, structured_outputs=SO(choice=CHOICES), **sp)))
            jobs.append(("grammar", _chat(llm, f"Add up the ages of {s}'s friends."),
                         SamplingParams(max_tokens=24, structured_outputs=SO(grammar=GRAMMAR), **sp)))
    # A greedy constrained row, and EOS games: ignore_eos / min_tokens must not outlive the grammar.
    jobs.append(("regex", _chat(llm, "Give a code."), SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=SO(regex=REGEX))))
    jobs.append(("choice", _chat(llm, "Yes or no?"),
                 SamplingParams(temperature=0.9, seed=99, max_tokens=32, ignore_eos=True, structured_outputs=SO(choice=CHOICES))))
    jobs.append(("choice", _chat(llm, "Yes or no?"),
                 SamplingParams(temperature=0.9, seed=98, max_tokens=32, min_tokens=12, structured_outputs=SO(choice=CHOICES))))
    for prompt in UNCONSTRAINED:
        jobs.append(("plain", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    outputs = llm.generate([p for _, p, _ in jobs], [sp for *_, sp in jobs], use_tqdm=False)
    by_kind: dict[str, list] = {}
    for (kind, _, sp), out in zip(jobs, outputs):
        by_kind.setdefault(kind, []).append((sp, out.outputs[0]))
    return by_kind


def _texts(batch, kind):
    return [c.text for _, c in batch[kind]]


def test_json_schema_outputs_validate(batch):
    jsonschema = pytest.importorskip("jsonschema")
    results = batch["json"] + batch["json_compact"]
    assert len(results) == 16
    for _, c in results:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_disable_any_whitespace_is_compact(batch):
    for _, c in batch["json_compact"]:
        obj = json.loads(c.text)
        assert "\n" not in c.text and c.text == json.dumps(obj), c.text


def test_json_object_outputs_are_objects(batch):
    results = batch["json_object"]
    stopped = [c for _, c in results if c.finish_reason == "stop"]
    assert len(stopped) >= len(results) // 2  # the rest ran into max_tokens mid-object
    for c in stopped:
        assert isinstance(json.loads(c.text), dict), c.text
    for _, c in results:
        assert c.text.startswith("{"), c.text


def test_regex_outputs_match(batch):
    assert len(batch["regex"]) == 9
    for _, c in batch["regex"]:
        assert c.finish_reason == "stop"
        assert re.fullmatch(REGEX, c.text), c.text


def test_choice_outputs_are_choices(batch):
    assert len(batch["choice"]) == 10
    for sp, c in batch["choice"]:
        assert c.text in CHOICES, c.text
        assert c.finish_reason == "stop"  # ignore_eos and min_tokens included: the grammar ends the request


def test_grammar_outputs_are_in_the_language(batch):
    for _, c in batch["grammar"]:
        assert c.finish_reason == "stop"
        assert re.fullmatch(GRAMMAR_RE, c.text), c.text


def test_unconstrained_rows_are_untouched(llm, batch):
    alone = llm.generate(UNCONSTRAINED, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for _, c in batch["plain"]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json={"type": "foo"}), "json"),
        (dict(json={"type": "object", "properties": 3}), "json"),
        (dict(json="[1, 2]"), "json"),
        (dict(regex="a(b"), "regex"),
        (dict(grammar="root ::= undefined_rule"), "grammar"),
        (dict(grammar="this is not ebnf"), "grammar"),
    ],
)
def test_invalid_constraint_fails_before_generation(llm, constraint, message):
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4, structured_outputs=SO(**constraint))
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError, match=f"structured_outputs.{message}") as info:
        llm.generate(["Hi", "Hello", "Hey"], [good, good, bad], use_tqdm=False)
    assert "/project/" not in str(info.value)  # xgrammar's source location is stripped
    assert not engine.has_unfinished_requests()


def test_compile_cache(llm):
    engine = llm.llm_engine
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}}, "required": ["x", "y"]}
    reordered = {"required": ["x", "y"], "properties": {"y": {"type": "boolean"}, "x": {"type": "integer"}}, "type": "object"}
    manager = engine.structured_output_manager()
    before, hits = manager.num_compiles, manager.num_cache_hits
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=SO(json=s)) for s in (schema, reordered, json.dumps(schema))]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    # The dict twice (key order does not matter) is one compile; the JSON text is a second key.
    assert manager.num_compiles - before == 2
    assert manager.num_cache_hits - hits >= 1
    again = llm.generate(["a"], params[0], use_tqdm=False)
    assert manager.num_compiles - before == 2
    for o in outs + again:
        if o.outputs[0].finish_reason == "stop":
            obj = json.loads(o.outputs[0].text)
            assert isinstance(obj["x"], int) and isinstance(obj["y"], bool)


def test_choice_grammar_escapes():
    assert choice_grammar(["a", 'b"c', "d\\e", "x\ny"]) == 'root ::= "a" | "b\\"c" | "d\\\\e" | "x\\ny"'


def test_bitmask_applies_per_row():
    from tokenmill.worker.sampler import apply_grammar_bitmask

    logits = torch.zeros(2, 40)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)  # row 0: everything allowed
    bitmask[1] = torch.tensor([1 << 3, 1 << 1], dtype=torch.int32)  # row 1: tokens 3 and 33
    out = apply_grammar_bitmask(logits, bitmask)  # xgrammar's kernel
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [3, 33]
    assert torch.isfinite(logits).all()  # not in place
    fallback = apply_grammar_bitmask(logits.double(), bitmask)  # the torch bit ops
    assert torch.equal(fallback.float(), out)


def test_constrained_requests_survive_preemption():
    """A cache too small for the batch: constrained requests are preempted and recomputed, outputs still valid."""
    llm = LLM(dtype="float32", max_model_len=256, num_kv_blocks=20, block_size=16, enable_prefix_caching=False)  # the test is about preemption
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=64, structured_outputs=SO(json=SCHEMA)) for i in range(6)]
    prompts = [_chat(llm, f"Describe {s} as JSON.") for s in SUBJECTS[:6]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        obj = json.loads(c.text)
        assert set(obj) == {"name", "age", "job"}


def test_parallel_samples_each_follow_the_grammar(llm):
    """n > 1: the sequences forked off one prompt each get their own matcher."""
    out = llm.generate(
        [_chat(llm, "Give a code.")],
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, structured_outputs=SO(regex=REGEX)),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
