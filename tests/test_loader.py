"""Model loading: clear ModelLoadErrors for broken inputs, GGUF round trips written the way
llama.cpp's convert_hf_to_gguf writes them, and dequantization of the GGUF quant types."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loader.gguf_file import dequantize_tensor
from tokenmill.models.registry import supported_architectures

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _private_gguf_cache(tmp_path_factory, monkeypatch):
    """The GGUF files these tests write are converted into a cache of their own, not the user's."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.mktemp("tokenmill-cache")))


def tm_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- HF folders: errors ----------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model folder or file"):
        LLM(model=str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        LLM(model=str(tmp_path / "nowhere.gguf"))


def test_a_file_that_is_no_model(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model"):
        LLM(model=str(path))


def test_folder_without_config(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(model=str(folder))


def test_unreadable_config(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(folder))


def test_folder_without_weights(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights found"):
        LLM(model=str(folder))


def test_consolidated_safetensors_is_skipped(tmp_path, tiny_model_factory, hf_model_factory):
    """Mistral's repos hold consolidated.safetensors (other tensor names) beside the HF files: it is not read."""
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)}, folder / "consolidated.safetensors")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=32)
    prompt = random_prompts([9], seed=34)[0]
    assert tm_generate(llm, [prompt])[0] == hf_greedy(hf_model_factory("llama_mqa_tied"), prompt, GREEDY.max_tokens)


def test_pytorch_bin_checkpoint(tmp_path, tiny_model_factory, hf_model_factory):
    """Old-style pytorch_model.bin loads like safetensors; a corrupt one is a ModelLoadError."""
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=32)
    prompt = random_prompts([9], seed=35)[0]
    assert tm_generate(llm, [prompt])[0] == hf_greedy(hf_model_factory("llama_mqa_tied"), prompt, GREEDY.max_tokens)
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin: cannot read PyTorch weights"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=32)


def test_sharded_checkpoint_loads(tiny_model_factory):
    folder = Path(tiny_model_factory("llama_sharded"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded (the greedy tests check the values)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=16)
    assert len(tm_generate(llm, [[1, 2, 3]])[0]) == GREEDY.max_tokens


def test_missing_shard(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_sharded"), tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing") as info:
        LLM(model=str(folder))
    assert shard.name in str(info.value) and "model.safetensors.index.json" in str(info.value)


def test_bad_index(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_sharded"), tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="not a valid safetensors index"):
        LLM(model=str(folder))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "huge_header"])
def test_corrupt_safetensors(damage, tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a header length far beyond the file
        path.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)
    assert "model.safetensors" in str(info.value)


def test_missing_weight(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks 1 weights") as info:
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)
    assert "model.layers.1.mlp.down_proj.weight" in str(info.value)


def test_wrong_shape(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:8].contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"k_proj.*shape \(8, 64\), expected \(16, 64\)"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}])
def test_sequence_length_dependent_rope_is_refused(rope, tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = dict(rope, rope_theta=10000.0, original_max_position_embeddings=64)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"rope_type '{rope['rope_type']}' is not supported"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture(tmp_path, tiny_model_factory):
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    _edit_config(folder, architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as info:
        LLM(model=str(folder))
    message = str(info.value)
    assert "FooForCausalLM" in message
    for name in supported_architectures():
        assert name in message


def test_unknown_model_type_names_supported_architectures(tmp_path, tiny_model_factory):
    """A config transformers itself cannot parse (unknown model_type) still says what is supported."""
    folder = copy_model(tiny_model_factory("llama_mqa_tied"), tmp_path / "m")
    _edit_config(folder, model_type="foo", architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as info:
        LLM(model=str(folder))
    assert "FooForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


# -- GGUF: written the way llama.cpp's convert_hf_to_gguf writes it ---------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF's half-split RoPE rows -> GGML's interleaved ones."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse, written independently of tokenmill's: split interleaved pairs back into halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LLAMA_TENSORS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GPT2_TENSORS = {
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}


def _gguf_name(hf_name: str, table: dict[str, str]) -> str:
    module, _, suffix = hf_name.rpartition(".")
    parts = module.split(".")
    if "layers" in parts or "h" in parts:
        at = parts.index("layers") if "layers" in parts else parts.index("h")
        block, rest = parts[at + 1], ".".join(parts[at + 2 :])
        return f"blk.{block}.{table[rest]}.{suffix}"
    return f"{table[module]}.{suffix}"


def _llama3_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(hf_folder: str, out: Path, quant: QT | Callable[[str], QT | None] | None = None,
               encode: Callable[[np.ndarray, QT], np.ndarray] = quantize) -> Path:
    """Convert a tiny HF folder to GGUF as llama.cpp does: metadata keys, tensor names, q/k permuted
    for llama, GPT-2's Conv1D weights transposed, 2-D weights quantized when `quant` is given (a
    type, or a function of the GGUF tensor name giving each one's type, None for float32) by
    `encode` (gguf's quantize; it has no encoder for the K-quants, whose tests give their own)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder)
    state = {}
    for f in sorted(Path(hf_folder).glob("*.safetensors")):
        state.update(load_file(f))
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}[config.model_type]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny")
    tensors: list[tuple[str, np.ndarray]] = []
    if arch == "gpt2":
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        for name, t in state.items():
            w = t.float().numpy()
            if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
                w = np.ascontiguousarray(w.T)
            tensors.append((_gguf_name(name, _GPT2_TENSORS), w))
            if name == "transformer.wte.weight":  # GPT-2's output is a copy of wte in llama.cpp's files
                tensors.append(("output.weight", w))
    else:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        rope = config.rope_parameters
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(head_dim)
        if getattr(config, "head_dim", None) is not None:  # llama.cpp writes these only when config.json has head_dim
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        elif rope["rope_type"] == "llama3":
            tensors.append(("rope_freqs.weight", _llama3_rope_factors(config)))
        for name, t in state.items():
            w = t.float().numpy()
            if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):  # llama.cpp permutes biases too
                w = llama_cpp_permute(w, config.num_attention_heads)
            elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = llama_cpp_permute(w, config.num_key_value_heads)
            tensors.append((_gguf_name(name, _LLAMA_TENSORS), w))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quant is None else gguf.LlamaFileType.MOSTLY_Q8_0)
    for name, w in tensors:
        qtype = quant(name) if callable(quant) else quant
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(name, encode(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _greedy(path: Path, **kw) -> list[int]:
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, **kw)
    out = llm.generate([{"prompt_token_ids": [5, 9, 2, 77, 31]}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("max_bytes", [None, "0"], ids=["weights-cached", "too-big-to-cache"])
def test_a_gguf_is_converted_once_and_later_starts_skip_the_gguf_reader(tmp_path, tiny_model_factory, monkeypatch, max_bytes):
    if max_bytes is not None:
        monkeypatch.setenv("TOKENMILL_GGUF_CACHE_MAX_BYTES", max_bytes)
    path = write_gguf(tiny_model_factory("llama3_rope"), tmp_path / "m.gguf", quant=QT.Q8_0)
    first = _greedy(path)
    reads = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: reads.append(a) or real_reader(*a, **k))
    assert _greedy(path) == first  # the converted copy computes exactly what the file does
    assert len(reads) == (0 if max_bytes is None else 1)  # a too-big model still reads its tensors from the file
    before = len(reads)
    os.utime(path, ns=(1, 1))  # an edited file (another mtime) is converted again
    assert _greedy(path) == first and len(reads) > before


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_tied", "llama_linear_rope", "llama3_rope", "llama_bias", "qwen2", "qwen3", "gpt2"])
def test_gguf_f32_round_trip_matches_hf(name, tmp_path, tiny_model_factory, hf_model_factory):
    """The same weights as GGUF F32: tokenmill's greedy tokens equal HF's on the original folder."""
    path = write_gguf(tiny_model_factory(name), tmp_path / f"{name}.gguf")
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128, block_size=4, max_num_batched_tokens=16)
    prompts = random_prompts([6, 45], seed=31)
    hf = hf_model_factory(name)
    assert tm_generate(llm, prompts) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_gguf_q8_0_round_trip(tmp_path, tiny_model_factory, monkeypatch):
    """Q8_0: every loaded weight is exactly gguf's dequantization of the written blocks (un-permuted),
    within Q8_0's error of the original, and greedy decoding equals HF run on those same weights."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory("llama_gqa")
    path = write_gguf(folder, tmp_path / "q8.gguf", quant=QT.Q8_0)
    reader = gguf.GGUFReader(str(path))
    written = {t.name: t for t in reader.tensors}
    assert written["blk.0.attn_q.weight"].tensor_type == QT.Q8_0

    def deq(name: str) -> np.ndarray:
        t = written[name]
        return dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])

    import tokenmill.layers.quantization.unquantized as unquantized

    monkeypatch.setattr(unquantized, "cpu_packed_weights_supported", lambda device, dtype: False)  # the weights as loaded
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128, block_size=4, max_num_batched_tokens=16)
    model = llm.llm_engine.executor.driver_runner.model
    config = model.config
    original = load_file(Path(folder) / "model.safetensors")
    hf_state = {}
    for i in range(config.num_hidden_layers):
        q = llama_cpp_unpermute(deq(f"blk.{i}.attn_q.weight"), config.num_attention_heads)
        k = llama_cpp_unpermute(deq(f"blk.{i}.attn_k.weight"), config.num_key_value_heads)
        v = deq(f"blk.{i}.attn_v.weight")
        layer = model.model.layers[i]
        np.testing.assert_array_equal(layer.self_attn.qkv_proj.weight.numpy(), np.concatenate([q, k, v]))
        np.testing.assert_array_equal(
            layer.mlp.gate_up_proj.weight.numpy(), np.concatenate([deq(f"blk.{i}.ffn_gate.weight"), deq(f"blk.{i}.ffn_up.weight")])
        )
        np.testing.assert_array_equal(layer.mlp.down_proj.weight.numpy(), deq(f"blk.{i}.ffn_down.weight"))
        np.testing.assert_array_equal(layer.self_attn.o_proj.weight.numpy(), deq(f"blk.{i}.attn_output.weight"))
        np.testing.assert_array_equal(layer.input_layernorm.weight.numpy(), deq(f"blk.{i}.attn_norm.weight"))
        # Un-permuted in the right direction: Q8_0 keeps each weight within ~1% of the original.
        prefix = f"model.layers.{i}."
        np.testing.assert_allclose(q, original[prefix + "self_attn.q_proj.weight"].numpy(), atol=0.02)
        np.testing.assert_allclose(k, original[prefix + "self_attn.k_proj.weight"].numpy(), atol=0.02)
        hf_state.update(
            {
                prefix + "self_attn.q_proj.weight": q,
                prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": deq(f"blk.{i}.attn_output.weight"),
                prefix + "mlp.gate_proj.weight": deq(f"blk.{i}.ffn_gate.weight"),
                prefix + "mlp.up_proj.weight": deq(f"blk.{i}.ffn_up.weight"),
                prefix + "mlp.down_proj.weight": deq(f"blk.{i}.ffn_down.weight"),
                prefix + "input_layernorm.weight": deq(f"blk.{i}.attn_norm.weight"),
                prefix + "post_attention_layernorm.weight": deq(f"blk.{i}.ffn_norm.weight"),
            }
        )
    np.testing.assert_array_equal(model.model.embed_tokens.weight.numpy(), deq("token_embd.weight"))
    np.testing.assert_array_equal(model.lm_head.weight.numpy(), deq("output.weight"))
    hf_state["model.embed_tokens.weight"] = deq("token_embd.weight")
    hf_state["lm_head.weight"] = deq("output.weight")
    hf_state["model.norm.weight"] = deq("output_norm.weight")

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in hf_state.items()}, strict=True)
    prompts = random_prompts([6, 45], seed=32)
    assert tm_generate(llm, prompts) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


# -- GGUF: errors ----------------------------------------------------------------


def _minimal_gguf(path: Path, arch: str = "llama", metadata: bool = True, embedding: bool = True) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata:
        writer.add_context_length(64)
        writer.add_embedding_length(32)
        writer.add_feed_forward_length(64)
        writer.add_head_count(2)
    if embedding:
        writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:
        writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 100, b"GGUF" + os.urandom(2000)], ids=["empty", "magic-only", "text", "random"])
def test_not_a_gguf(content, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        LLM(model=str(path), skip_tokenizer_init=True)


def test_truncated_gguf(tmp_path, tiny_model_factory):
    src = write_gguf(tiny_model_factory("llama_mqa_tied"), tmp_path / "whole.gguf")
    path = tmp_path / "cut.gguf"
    path.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        LLM(model=str(path), skip_tokenizer_init=True)


def test_gguf_without_suffix_loads_by_magic(tmp_path, tiny_model_factory, hf_model_factory):
    """A GGUF whose name lacks .gguf (an Ollama blob, say) is recognised by its magic bytes."""
    path = write_gguf(tiny_model_factory("llama_mqa_tied"), tmp_path / "model.gguf").rename(tmp_path / "sha256-0123abcd")
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32)
    prompt = random_prompts([9], seed=33)[0]
    assert tm_generate(llm, [prompt])[0] == hf_greedy(hf_model_factory("llama_mqa_tied"), prompt, GREEDY.max_tokens)


def test_folder_holding_a_gguf_points_at_it(tmp_path, tiny_model_factory):
    write_gguf(tiny_model_factory("llama_mqa_tied"), tmp_path / "tiny-f32.gguf")
    with pytest.raises(ModelLoadError, match=r"tiny-f32\.gguf"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True)


def test_gguf_unsupported_architecture(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'.*supported: .*llama"):
        LLM(model=str(path), skip_tokenizer_init=True)


def test_gguf_missing_metadata(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf")  # no llama.block_count
    with pytest.raises(ModelLoadError, match="llama.block_count"):
        LLM(model=str(path), skip_tokenizer_init=True)


def test_gguf_without_weights(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", embedding=False)
    with pytest.raises(ModelLoadError, match="token_embd.weight"):
        LLM(model=str(path), skip_tokenizer_init=True)


def test_gguf_unsupported_rope_scaling(tmp_path, tiny_model_factory):
    src = write_gguf(tiny_model_factory("llama_mqa_tied"), tmp_path / "src.gguf")
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("llama.", "general.name")):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="RoPE scaling 'yarn' is not supported"):
        LLM(model=str(tmp_path / "yarn.gguf"), skip_tokenizer_init=True)


# -- GGUF: dequantization ------------------------------------------------------------

# Byte offsets of the float16 scale fields in each block, so random blocks hold finite scales.
_F16_FIELDS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q8_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208], QT.Q2_K: [80, 82], QT.Q3_K: [108]}


def _random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        raw[..., offset : offset + 2] = rng.uniform(-0.1, 0.1, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K, QT.Q3_K])
def test_dequantize_tensor(qtype, tmp_path):
    """dequantize_tensor gives gguf's own dequantization as float32 in HF's [out, in] shape."""
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    weights = rng.standard_normal((rows, cols)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    if qtype == QT.F32:
        data = weights
        writer.add_tensor("w", data)
    else:
        try:
            data = quantize(weights, qtype)
        except NotImplementedError:  # gguf has no quantizer for the K-quants: random blocks instead
            data = _random_blocks(qtype, rows, cols, rng)
        writer.add_tensor("w", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors[0]
    assert tensor.tensor_type == qtype
    got = dequantize_tensor(tensor)
    assert got.dtype == np.float32 and got.shape == (rows, cols) and got.flags.writeable
    want = dequantize(np.asarray(data), qtype).reshape(rows, cols).astype(np.float32)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)
    if qtype in (QT.F32, QT.F16, QT.BF16, QT.Q8_0):
        np.testing.assert_allclose(got, weights, atol=0.05, rtol=0.02)


def test_dequantize_unsupported_type(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[QT.Q8_K]
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    writer.add_tensor("blk.0.w", np.zeros((2, 2 * size), dtype=np.uint8), raw_dtype=QT.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors[0]
    with pytest.raises(ModelLoadError, match="blk.0.w has type Q8_K"):
        dequantize_tensor(tensor)
