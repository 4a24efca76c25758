"""Request-supplied chat templates render in child processes the OS bounds (template_isolation.py): a
single C-level operation that the in-process watchdog cannot interrupt (a memory bomb, a huge integer
power) costs a child, not the server; the next render is served by a working child."""

from __future__ import annotations

import time

import pytest

from tokenmill.entrypoints.openai.errors import BadRequest
from tokenmill.entrypoints.openai.render_limits import RenderLimits
from tokenmill.entrypoints.openai.template_isolation import KILL_GRACE_S, TemplateIsolation

MESSAGES = [{"role": "user", "content": "hi"}]
PLAIN = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1}, unk_token="[UNK]")),
                                   bos_token="<s>", unk_token="[UNK]")


@pytest.fixture(scope="module")
def isolation(tokenizer):
    iso = TemplateIsolation(tokenizer, RenderLimits(max_seconds=1.0, max_output_chars=1 << 20),
                            workers=1, max_render_bytes=128 << 20)
    iso.wait_ready()
    yield iso
    iso.close()


def render(iso: TemplateIsolation, template: str) -> str:
    return iso.render(MESSAGES, chat_template=template, add_generation_prompt=True)


def test_a_template_renders_as_in_process(isolation, tokenizer):
    want = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, chat_template=PLAIN)
    assert render(isolation, PLAIN) == want


@pytest.mark.parametrize("template", ["{{ 'x' * 1000000000 }}", "{{ 'x'|center(2000000000) }}",
                                      "{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}{% endfor %}"])
def test_a_memory_bomb_is_a_400_naming_the_limit_and_the_next_render_works(isolation, template):
    with pytest.raises(BadRequest, match="more memory than a render may take \\(128 MB\\)"):
        render(isolation, template)
    assert render(isolation, PLAIN).endswith("[user] hi")


def test_one_slow_c_operation_is_killed_at_the_deadline(isolation):
    start = time.monotonic()
    with pytest.raises(BadRequest, match="longer than 1 s"):
        render(isolation, "{{ 3 ** 300000000 }}")  # minutes of big-integer work in one C call
    assert time.monotonic() - start < 1.0 + KILL_GRACE_S + 2.0
    assert render(isolation, PLAIN).endswith("[user] hi")


def test_errors_of_the_template_are_400s(isolation):
    with pytest.raises(BadRequest, match="division by zero"):
        render(isolation, "{{ 1 / 0 }}")
    with pytest.raises(BadRequest, match="1 s"):
        render(isolation, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
