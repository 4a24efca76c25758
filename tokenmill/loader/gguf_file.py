"""Load a GGUF file with the `gguf` package: metadata to an HF config, tokenizer and chat
template through transformers' GGUF support, weights dequantized to HF names and layout."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable

import numpy as np
import torch

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loader.cache_dir import cache_root
from tokenmill.loader.source import ModelSource, eos_ids_from

# GGUF tensor name (block index as {i}) -> HF name, per GGUF architecture family.
_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
_GPT2_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
    "blk.{i}.attn_norm": "transformer.h.{i}.ln_1",
    "blk.{i}.attn_qkv": "transformer.h.{i}.attn.c_attn",
    "blk.{i}.attn_output": "transformer.h.{i}.attn.c_proj",
    "blk.{i}.ffn_norm": "transformer.h.{i}.ln_2",
    "blk.{i}.ffn_up": "transformer.h.{i}.mlp.c_fc",
    "blk.{i}.ffn_down": "transformer.h.{i}.mlp.c_proj",
}
_ARCHS = {
    # gguf arch: (HF model_type, HF architecture, name map)
    "llama": ("llama", "LlamaForCausalLM", _LLAMA_NAMES),
    "mistral": ("mistral", "MistralForCausalLM", _LLAMA_NAMES),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", _LLAMA_NAMES),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", _LLAMA_NAMES),
    "gpt2": ("gpt2", "GPT2LMHeadModel", _GPT2_NAMES),
}
logger = logging.getLogger(__name__)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class _Metadata:
    def __init__(self, reader) -> None:
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return value


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    match = _BLOCK_RE.match(base)
    if match:
        template = names.get(f"blk.{{i}}.{match.group(2)}")
        return template.format(i=match.group(1)) + "." + suffix if template else None
    template = names.get(base)
    return f"{template}.{suffix}" if template else None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of q/k rows (interleaved -> half-split RoPE)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def dequantize_tensor(tensor) -> np.ndarray:
    """Any GGUF tensor (F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants...) as float32 in HF shape [out, in]."""
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be dequantized") from None
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
        array = array.copy()
    return array.reshape(tuple(reversed([int(d) for d in tensor.shape])))


def _hf_config(meta: _Metadata, arch: str, tensors: dict, tokenizer_ids: dict):
    from transformers import AutoConfig

    model_type, architecture, _ = _ARCHS[arch]
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    common = dict(vocab_size=vocab_size, architectures=[architecture], **tokenizer_ids)
    if arch == "gpt2":
        return AutoConfig.for_model(
            "gpt2",
            n_embd=int(meta.require("gpt2.embedding_length")),
            n_layer=int(meta.require("gpt2.block_count")),
            n_head=int(meta.require("gpt2.attention.head_count")),
            n_positions=int(meta.require("gpt2.context_length")),
            n_inner=int(meta.get("gpt2.feed_forward_length", 0)) or None,
            layer_norm_epsilon=float(meta.get("gpt2.attention.layer_norm_epsilon", 1e-5)),
            **common,
        )
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    rope = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(meta.require(f"{arch}.rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF RoPE scaling {scaling!r} is not supported; supported: none, linear, llama3 (rope_freqs)")
    extra = {}
    if arch in ("llama", "mistral"):
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensors
        extra["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    return AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.require(f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors,
        **extra,
        **common,
    )


def load_gguf_source(path: str, tokenizer_path: str | None = None, skip_tokenizer_init: bool = False) -> ModelSource:
    """A GGUF file as a ModelSource, through a converted copy kept in a per-file cache.

    Reading a GGUF's metadata (tens of thousands of vocabulary entries, parsed in Python by the
    `gguf` package) and dequantizing its tensors takes seconds on every start; the converted
    model (an HF folder: config.json, the dequantized weights as safetensors in HF layout, the
    tokenizer) loads in a fraction of a second, memory-mapped. The first start converts and
    publishes the folder by an atomic rename; later starts load it. The cache is keyed by the
    file's path, size and modification time, so an edited file is converted again."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such GGUF file")
    cache = _cache_dir(path)
    if not os.path.isfile(os.path.join(cache, _DONE)):
        _convert(path, cache)
    return _load_converted(path, cache, tokenizer_path, skip_tokenizer_init)


_DONE = "tokenmill-gguf.json"  # written last: its presence means the folder is complete
_ROPE_FREQS = "rope_freqs.npy"  # llama.cpp's baked Llama 3 RoPE factors (not a safetensors file: not a weight)


def _read(path: str):
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHS))}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path} holds no token_embd.weight tensor (a vocab-only GGUF?)")
    return reader, meta, arch, tensors


def _hf_weights(reader, arch: str, config) -> Iterable[tuple[str, torch.Tensor]]:
    """The GGUF's tensors dequantized, under HF names and in HF layout."""
    _, _, names = _ARCHS[arch]
    permuted = arch in ("llama", "mistral")  # llama.cpp permutes q/k rows only for these
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, names)
        if name is None:
            continue
        weight = torch.from_numpy(dequantize_tensor(tensor))
        # convert_hf_to_gguf permutes the q/k biases along with the weights.
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            weight = unpermute_qk(weight, config.num_key_value_heads)
        elif arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            weight = weight.t()  # back to HF's Conv1D layout; the model transposes on load
        yield name, weight.contiguous()


def packed_weights(path: str, config) -> Iterable[tuple[str, object]]:
    """The GGUF's tensors under HF names for quantization="gguf": the quantized ones packed as the
    file holds them (GGUFTensor: rows of blocks, which q/k's row permutation moves whole), the float
    ones (norms, F16/F32 weights) as float32 tensors."""
    from tokenmill.layers.quantization.gguf_packed import PACKED_TYPES, GGUFTensor

    reader, _, arch, _ = _read(path)
    if arch not in _PACKED_ARCHS:
        raise ModelLoadError(f"quantization='gguf' runs GGUF files of {', '.join(_PACKED_ARCHS)}; {arch!r} is not one "
                             "(GPT-2's fused, transposed layout): leave quantization unset to run it dequantized")
    names = _ARCHS[arch][2]
    permuted = arch in ("llama", "mistral")  # as _hf_weights
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, names)
        if name is None:
            continue
        qtype = int(tensor.tensor_type)
        if qtype in PACKED_TYPES:
            # Copied out of the read-only memory map: [rows, row bytes].
            weight = GGUFTensor(torch.from_numpy(np.array(tensor.data, dtype=np.uint8)), qtype, int(tensor.shape[0]))
        elif tensor.tensor_type.name in ("F32", "F16", "BF16"):
            weight = torch.from_numpy(dequantize_tensor(tensor))
        else:
            supported = ", ".join(name for name, _, _ in PACKED_TYPES.values())
            raise ModelLoadError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}; quantization='gguf' computes "
                                 f"{supported} (and F32/F16/BF16) packed: leave quantization unset to run this file dequantized")
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            weight = _permuted_rows(weight, config.num_attention_heads)
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            weight = _permuted_rows(weight, config.num_key_value_heads)
        yield name, weight


_PACKED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def _permuted_rows(weight, num_heads: int):
    """unpermute_qk on a float tensor, or on a packed tensor's rows (each row's blocks move whole)."""
    if isinstance(weight, torch.Tensor):
        return unpermute_qk(weight, num_heads)
    return dataclasses.replace(weight, data=unpermute_qk(weight.data, num_heads).contiguous())


def _convert(path: str, cache: str) -> None:
    """Convert the GGUF into an HF folder at `cache` (written aside, then renamed into place)."""
    import json

    from safetensors.torch import save_file

    reader, meta, arch, tensors = _read(path)
    tokenizer_ids = {
        key: int(meta.get(f"tokenizer.ggml.{key}"))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if meta.get(f"tokenizer.ggml.{key}") is not None
    }
    config = _hf_config(meta, arch, tensors, tokenizer_ids)
    logger.warning("converting %s for tokenmill (once per file; later starts load the converted copy)", path)
    parent = os.path.dirname(cache)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".converting-")
    numel = sum(int(np.prod(t.shape)) for t in reader.tensors if _hf_name(t.name, _ARCHS[arch][2]) is not None)
    keep_weights = numel * 4 <= _max_cached_weight_bytes()
    try:
        config.save_pretrained(tmp)
        if keep_weights:
            save_file(dict(_hf_weights(reader, arch, config)), os.path.join(tmp, "model.safetensors"))
        if "rope_freqs.weight" in tensors:
            np.save(os.path.join(tmp, _ROPE_FREQS), dequantize_tensor(tensors["rope_freqs.weight"]).reshape(-1))
        try:
            _gguf_tokenizer(path).save_pretrained(tmp)
        except ModelLoadError as exc:  # the model still runs on token ids
            logger.warning("%s", exc)
        eos = eos_ids_from(
            tokenizer_ids.get("eos_token_id"),
            meta.get("tokenizer.ggml.eot_token_id"),
            meta.get("tokenizer.ggml.eom_token_id"),
        )
        with open(os.path.join(tmp, _DONE), "w") as f:
            json.dump({"source": os.path.abspath(path), "eos_token_ids": sorted(eos), "weights_cached": keep_weights}, f)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process published it first: theirs is as good
            if not os.path.isfile(os.path.join(cache, _DONE)):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _load_converted(path: str, cache: str, tokenizer_path: str | None, skip_tokenizer_init: bool) -> ModelSource:
    import json

    from tokenmill.loader.hf import load_hf_source

    with open(os.path.join(cache, _DONE)) as f:
        done = json.load(f)
    if tokenizer_path is None and not skip_tokenizer_init and not os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF file {path}; give --tokenizer, or use token ids only")
    if done["weights_cached"]:
        source = load_hf_source(cache, tokenizer_path or cache, skip_tokenizer_init)
    else:  # too big to keep dequantized: the config and tokenizer from the cache, the weights from the file
        source = load_hf_source(cache, tokenizer_path or cache, skip_tokenizer_init, weights_required=False)
        reader, _, arch, _ = _read(path)
        source = dataclasses.replace(source, weights=lambda: _hf_weights(reader, arch, source.hf_config))
    freqs_path = os.path.join(cache, _ROPE_FREQS)
    freq_factors = torch.from_numpy(np.load(freqs_path)) if os.path.isfile(freqs_path) else None
    return dataclasses.replace(
        source,
        name=path,
        eos_token_ids=set(done["eos_token_ids"]),
        checkpoint_dtype=torch.bfloat16,
        rope_freq_factors=freq_factors,
        packed_weights=lambda: packed_weights(path, source.hf_config),
    )


def _max_cached_weight_bytes() -> int:
    """Models whose dequantized float32 weights are larger are not kept dequantized on disk (a 7B
    model would take 28 GB): they dequantize from the file at every start instead."""
    return int(float(os.environ.get("TOKENMILL_GGUF_CACHE_MAX_BYTES", 4 << 30)))


def _cache_dir(path: str) -> str:
    """The converted copy's folder: one per file version (path, size, modification time)."""
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "gguf", key)


def _gguf_tokenizer(path: str):
    """The GGUF's own vocabulary, merges and chat template, as a transformers tokenizer."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF file {path}: {exc}") from None
