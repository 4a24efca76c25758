"""Shared by the tool-calling and reasoning tests: a Qwen2.5/Qwen3-style chat template with tools
(hermes format, <think> switched off by enable_thinking=false), SmolLM2's tokenizer carrying it,
and a scripted engine that "generates" given text piece by piece (one piece per engine step) and
records what it was asked, for in-process servers driven by the official openai client."""

from __future__ import annotations

import copy
import time

from tokenmill.engine.engine import EngineStats
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput

TOOLS_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {{- '<|im_start|>assistant' }}
    {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
    {%- for tool_call in message.tool_calls %}
      {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
      {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "New York"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER_PARAMETERS},
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def stamp_step(metrics: RequestMetrics, last: bool) -> None:
    """A fake engine step's times on a request's metrics, as the engine stamps them."""
    now = time.monotonic()
    metrics.first_scheduled_time = metrics.first_scheduled_time or now
    metrics.first_token_time = metrics.first_token_time or now
    metrics.last_token_time = now
    if last:
        metrics.finished_time = now


def build_tiny_chat_model(folder: str, tokenizer) -> str:
    """A tiny seeded random Llama over `tokenizer`'s vocabulary (EOS <|im_end|>), saved with the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=None, pad_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tools_tokenizer(tokenizer):
    """A copy of `tokenizer` whose chat template is TOOLS_TEMPLATE."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


class ScriptedEngine:
    """Each request's output is `script` (a list of text pieces, one per step), the same for every
    choice; every generated token is id 7. `calls` records (prompt, params) of each request."""

    model_name = "fake"
    max_model_len = 4096

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.script: list[str] = ["Hello", "!"]
        self.finish_reason = "stop"
        self.calls: list[tuple[dict, object]] = []
        self.errored = False
        self.is_running = True

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=10, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0)

    @property
    def last_prompt(self) -> str:
        return self.calls[-1][0]["prompt"]

    @property
    def last_params(self):
        return self.calls[-1][1]

    async def generate(self, prompt, params, request_id):
        self.calls.append((prompt, params))
        ids = list(prompt["prompt_token_ids"])
        metrics = RequestMetrics(arrival_time=time.monotonic())
        script = list(self.script)[: params.max_tokens] if params.max_tokens else list(self.script)
        text = ""
        for step, piece in enumerate(script, 1):
            text += piece
            last = step == len(script)
            stamp_step(metrics, last)
            reason = (self.finish_reason if len(script) == len(self.script) else "length") if last else None
            outputs = [CompletionOutput(index=i, text=text, token_ids=[7] * step, finish_reason=reason) for i in range(params.n)]
            yield RequestOutput(request_id, None, ids, outputs, finished=last, metrics=metrics)

    async def abort(self, request_id: str) -> None:
        pass


def smollm2_tools_tokenizer():
    """SmolLM2's tokenizer with the tools chat template (the test skips where the model is not installed)."""
    import pytest

    from conftest import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed (its tokenizer is used)")
    from tokenmill.loader.gguf_file import load_gguf_source

    return tools_tokenizer(load_gguf_source(smollm2_gguf_path()).tokenizer)


def make_client(engine, **settings):
    """The official openai client on an in-process app around `engine` (no network, no engine thread)."""
    import openai
    from fastapi.testclient import TestClient

    from tokenmill.entrypoints.openai.api_server import ServerSettings, build_app

    app = build_app(engine, ServerSettings(served_model_names=["fake"], **settings), manage_engine=False)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                         http_client=TestClient(app, raise_server_exceptions=False))
