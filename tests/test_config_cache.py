"""Start-up shortcuts of the loader: the resolved-config record (loader/config_cache.py) gives the
models exactly the attributes transformers resolved, and the tokenizer built in a thread still
fails the start with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.loader.config_cache import CachedHFConfig, load_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "tokenmill-cache"))


def _public(config) -> dict:
    attrs = {k: v for k, v in vars(config).items() if not k.startswith("_") and k not in ("id2label", "label2id")}
    if isinstance(attrs.get("dtype"), torch.dtype):
        attrs["dtype"] = str(attrs["dtype"]).removeprefix("torch.")
    return attrs


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa", "qwen2_mixed_swa", "qwen3", "gpt2_options"])
def test_the_record_holds_what_transformers_resolved(name, tiny_model_factory):
    folder = Path(tiny_model_factory(name))
    first = load_config(folder).config
    again = load_config(folder).config
    assert not isinstance(first, CachedHFConfig) and isinstance(again, CachedHFConfig)
    for key, value in _public(first).items():
        assert getattr(again, key) == value, key
    for alias, target in type(first).attribute_map.items():  # GPT-2's hidden_size is n_embd
        assert getattr(again, alias) == getattr(first, target), alias
    assert again.model_type == first.model_type


@pytest.mark.parametrize("name", ["llama3_rope", "llama_yarn"])
def test_scaled_rope_configs_are_not_recorded(name, tiny_model_factory):
    """Scaled RoPE calls the config's own methods (transformers' RoPE init functions), which a record lacks."""
    folder = Path(tiny_model_factory(name))
    load_config(folder)
    assert not isinstance(load_config(folder).config, CachedHFConfig)


def test_an_edited_config_is_resolved_again(tmp_path, tiny_model_factory):
    folder = Path(shutil.copytree(tiny_model_factory("llama_gqa"), tmp_path / "model"))
    assert load_config(folder).config.rms_norm_eps != 1e-3
    raw = json.loads((folder / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(raw))
    config = load_config(folder).config
    assert not isinstance(config, CachedHFConfig) and config.rms_norm_eps == 1e-3
    assert load_config(folder).config.rms_norm_eps == 1e-3


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_greedy_tokens_are_the_same_from_the_record(name, tiny_model_factory):
    prompts = [[5, 17, 99, 3], [250, 1, 2]]

    def run() -> list[list[int]]:
        llm = LLM(model=tiny_model_factory(name), dtype="float32")
        assert isinstance(llm.llm_engine.hf_config, CachedHFConfig) == ran_before
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)]

    ran_before = False
    first = run()
    ran_before = True
    assert run() == first


def test_a_broken_tokenizer_built_in_the_background_fails_the_start(tmp_path, tiny_model_factory):
    folder = Path(shutil.copytree(tiny_model_factory("llama_gqa"), tmp_path / "model"))
    raw = json.loads((folder / "config.json").read_text())
    raw["eos_token_id"] = 1  # EOS known from the config: the tokenizer is built in a thread
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "tokenizer.json").write_text("{not json")
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        LLM(model=str(folder), dtype="float32")


def test_a_generic_tokenizer_loads_as_autotokenizer_would():
    """The default model's converted tokenizer (tokenizer_class TokenizersBackend) is loaded by that class
    directly; it encodes, decodes and renders the chat template as AutoTokenizer's does."""
    from transformers import AutoTokenizer

    from tokenmill.config import ModelConfig
    from tokenmill.loader import load_model_source
    from tokenmill.loader.gguf_file import _cache_dir
    from tokenmill.loader.hf import _generic_tokenizer_class, load_tokenizer

    folder = _cache_dir(load_model_source(ModelConfig(skip_tokenizer_init=True)).name)  # the converted GGUF
    assert _generic_tokenizer_class(folder)
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto)
    text = "Hello, world! <|im_start|>user\\nÜnïcödé  tabs\\tand 123456"
    assert ours.encode(text) == auto.encode(text)
    assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert ours.eos_token_id == auto.eos_token_id and ours.all_special_ids == auto.all_special_ids
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
