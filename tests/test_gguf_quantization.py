"""`quantization="gguf"`: a GGUF's quantized weights kept packed and computed packed, against the
same file run the default way (every tensor dequantized to float32 at load).

The packed kernels dequantize each block to gguf's very float32 values, so the two engines compute
the same function up to the summation order: their logits agree within float32 rounding and
their greedy tokens are equal. The kernels themselves are tested per block type in
tests/test_gguf_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from conftest import assert_engine_computes, random_prompts, smollm2_gguf_path
from test_gguf_kernels import random_packed
from test_loader import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.kernels import cpu

needs_kernels = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

# Each tensor's type in the mixed file: q and k/v differ, so the fused QKV keeps two packed parts.
MIXED = {"attn_q": QT.Q4_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q8_0, "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1,
         "ffn_down": QT.Q4_0, "token_embd": QT.Q8_0, "output": QT.Q4_1}


def mixed_type(name: str) -> QT | None:
    return next((qtype for key, qtype in MIXED.items() if f".{key}." in f".{name}"), None)


@pytest.fixture(autouse=True)
def _private_gguf_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.mktemp("tokenmill-cache")))


def _model(llm: LLM):
    return llm.llm_engine.executor.driver_runner.model


# Q4_0 / Q4_1 against x itself: the very products of the dequantized copy (the default quantizes x to
# int8 per block of 32, as llama.cpp does: test_int8_activations_are_the_default_and_stay_close).
FLOAT_ACTIVATIONS = {"activations": "float"}


@needs_kernels
def test_mixed_types_file_computes_its_dequantized_copy(tiny_model_factory, tmp_path):
    path = str(write_gguf(tiny_model_factory("llama_gqa"), tmp_path / "mixed.gguf", quant=mixed_type))
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128, block_size=4)
    packed, reference = LLM(path, quantization="gguf", quantization_options=FLOAT_ACTIVATIONS, **kw), LLM(path, **kw)
    layer = _model(packed).model.layers[0]
    # Q8_0 / Q4_0 / Q4_1 linear layers move onto the weight-only methods' tiles (TiledSegment), one per run of a type
    assert [(type(s).__name__, s.ggml_type) for s in layer.self_attn.qkv_proj.gguf_segments] == [("TiledSegment", QT.Q4_0), ("TiledSegment", QT.Q8_0)]
    assert [(type(s).__name__, s.ggml_type) for s in layer.mlp.gate_up_proj.gguf_segments] == [("TiledSegment", QT.Q4_1)]
    assert _model(packed).model.embed_tokens.weight.gguf.ggml_type == QT.Q8_0
    assert _model(packed).lm_head.weight.gguf.ggml_type == QT.Q4_1
    # the LM head's matmul on a tiled copy; the embedding gathers the file's rows
    assert _model(packed).lm_head.gguf_tiled.ggml_type == QT.Q4_1 and _model(packed).model.embed_tokens.gguf_tiled is None
    assert_engine_computes(packed, reference, atol=1e-4)


@needs_kernels
def test_int8_activations_are_the_default_and_stay_close(tiny_model_factory, tmp_path):
    """By default Q4_0 / Q4_1 layers multiply x quantized to int8 per block of 32 (int4_linear_a8, tested
    value for value in test_quant_kernels.py); through the whole model the logits stay within the
    rounding of x: on average 2.4% of their spread here (a random 4-layer model, whose logits
    have heavy tails), at every chunk size."""
    from conftest import tokenmill_logits

    path = str(write_gguf(tiny_model_factory("llama_gqa"), tmp_path / "mixed.gguf", quant=mixed_type))
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128, block_size=4)
    packed, exact = LLM(path, quantization="gguf", **kw), LLM(path, quantization="gguf", quantization_options=FLOAT_ACTIVATIONS, **kw)
    segments = _model(packed).model.layers[0].self_attn.qkv_proj.gguf_segments
    assert segments[0].ggml_type == QT.Q4_0 and segments[0].linear_call.op == torch.ops.tokenmill_cpu.int4_linear_a8.default
    assert segments[1].ggml_type == QT.Q8_0  # Q8_0 keeps float activations
    prompt = random_prompts([72], seed=5)[0]
    want = tokenmill_logits(exact, prompt, chunk=72)
    spread = float(want.std())
    for chunk in (1, 3, 72):
        error = (tokenmill_logits(packed, prompt, chunk=chunk) - want).abs()
        assert 0 < float(error.mean()) < 0.04 * spread
    with pytest.raises(ValueError, match="gguf's activations option must be one of 'int8', 'float', got 'int4'"):
        LLM(path, quantization="gguf", quantization_options={"activations": "int4"}, **kw)


# A Q4_K_M-like file: Q4_K q/k/gate/up, Q6_K v/down and LM head, Q5_K o_proj, Q8_0 embedding.
K_MIXED = {"attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q6_K, "attn_output": QT.Q5_K, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K,
           "ffn_down": QT.Q6_K, "token_embd": QT.Q8_0, "output": QT.Q6_K}


def k_quant_blocks(weight: np.ndarray, qtype: QT) -> np.ndarray:
    """gguf-py has no encoder for the K-quants: random valid blocks of the weight's shape stand in for
    llama-quantize's (both engines read the same file, so what the blocks hold does not matter)."""
    if qtype == QT.Q8_0:
        return quantize(weight, qtype)
    rows, cols = weight.shape
    return random_packed(qtype, rows, cols, seed=rows * 7 + cols, scale=0.0002)


@needs_kernels
def test_k_quant_file_computes_its_dequantized_copy(tiny_model_factory, tmp_path):
    """Q4_K, Q5_K and Q6_K layers through the engine: fused QKV split by type (Q4_K q/k, Q6_K v),
    fused gate-up, a Q6_K LM head, chunks of 1, 3 and 64 rows and greedy tokens, against the file
    dequantized at load."""
    quant = lambda name: next((t for key, t in K_MIXED.items() if f".{key}." in f".{name}"), None)  # noqa: E731
    path = str(write_gguf(tiny_model_factory("llama_wide"), tmp_path / "k.gguf", quant=quant, encode=k_quant_blocks))
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128, block_size=4)
    packed, reference = LLM(path, quantization="gguf", **kw), LLM(path, **kw)
    layer = _model(packed).model.layers[0]
    assert [(type(s).__name__, s.ggml_type) for s in layer.self_attn.qkv_proj.gguf_segments] == [("GGUFTensor", QT.Q4_K), ("TiledSegment", QT.Q6_K)]
    assert _model(packed).lm_head.gguf_tiled.ggml_type == QT.Q6_K  # Q6_K on the int8 tiles, groups of 16
    assert [s.ggml_type for s in layer.mlp.gate_up_proj.gguf_segments] == [QT.Q4_K]
    assert layer.self_attn.o_proj.gguf_segments[0].ggml_type == QT.Q5_K
    assert _model(packed).lm_head.weight.gguf.ggml_type == QT.Q6_K
    assert_engine_computes(packed, reference, atol=1e-4)


@needs_kernels
def test_q6_k_on_int8_tiles_keeps_the_files_values():
    """Q6_K's 6-bit values as int8, with the file's int8 scale per 16 and fp16 d per 256: exactly gguf's dequantize."""
    from gguf.quants import dequantize

    from tokenmill.layers.quantization.gguf_packed import GGUFTensor, TiledSegment, q6_k_values

    rows, cols = 40, 512  # 40: a part tile
    packed = random_packed(QT.Q6_K, rows, cols, seed=3)
    want = torch.from_numpy(dequantize(packed, QT.Q6_K).reshape(rows, cols))
    q, scale, d = q6_k_values(torch.from_numpy(packed).view(rows, cols // 256, 210))
    assert q.dtype == torch.int8 and int(q.min()) >= -32 and int(q.max()) <= 31
    assert scale.dtype == torch.int8 and d.dtype == torch.float16
    group_scale = scale.float() * d.float().repeat_interleave(16, dim=1)
    assert torch.equal((q.float().view(rows, -1, 16) * group_scale.view(rows, -1, 1)).view(rows, cols), want)
    segment = TiledSegment.of(GGUFTensor(torch.from_numpy(packed), int(QT.Q6_K), cols), int8_activations=True)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(segment.linear_call(x, None), x @ want.T, atol=1e-4, rtol=1e-4)
    tiles, scale_tiles, super_tiles, group = segment.tensors
    assert scale_tiles.dtype == torch.int8 and super_tiles.dtype == torch.float16 and group == 16
    assert torch.equal(cpu.int8_group_dequantize(*segment.tensors, rows, torch.float32), want)  # long prompts' path


def test_gguf_on_a_checkpoint_that_is_not_gguf_is_a_clear_error(tiny_model_factory):
    with pytest.raises(ModelLoadError, match="quantization='gguf' computes a GGUF file's packed weights, and .* is not a GGUF file"):
        LLM(tiny_model_factory("llama_gqa"), quantization="gguf", skip_tokenizer_init=True, dtype="float32")


def test_gguf_on_a_gpt2_file_is_a_clear_error(tiny_model_factory, tmp_path):
    path = write_gguf(tiny_model_factory("gpt2"), tmp_path / "gpt2.gguf", quant=QT.Q8_0)
    with pytest.raises(ModelLoadError, match="quantization='gguf' runs GGUF files of llama, mistral, qwen2, qwen3"):
        LLM(str(path), quantization="gguf", skip_tokenizer_init=True, dtype="float32")


@pytest.fixture(scope="module")
def smollm2_pair():
    path = smollm2_gguf_path()
    if path is None or not cpu.cpu_kernels_available():
        pytest.skip("needs the embedded SmolLM2 model and the CPU kernels")
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256)
    return LLM(path, quantization="gguf", quantization_options=FLOAT_ACTIVATIONS, **kw), LLM(path, **kw)


@pytest.mark.slow
def test_smollm2_keeps_the_files_blocks(smollm2_pair):
    model = _model(smollm2_pair[0])
    layer = model.model.layers[0]
    (qkv,) = layer.self_attn.qkv_proj.gguf_segments
    # Q4_1 on the int4 tiles: the nibbles as they are (64 bytes per tile and 4 inputs), the fp16 scales and mins as they are
    tiles, scale, minimum, group = qkv.tensors
    assert qkv.ggml_type == QT.Q4_1 and tiles.shape == ((576 + 2 * 192) // 32, 576 // 4, 64) and group == 32
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == ((576 + 2 * 192) // 32, 576 // 32, 32)
    assert model.model.embed_tokens.weight.gguf.ggml_type == QT.Q8_0 and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.gguf_tiled.ggml_type == QT.Q8_0  # the tied head's matmul on a tiled copy of its Q8_0 blocks
    segments = [s for m in model.modules() for s in getattr(m, "gguf_segments", [])]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in segments if hasattr(s, "tensors") for t in s.tensors[:-1])
    assert weight_bytes < 110e6  # the file's ~104 MB (float32 would be 540 MB)


@pytest.mark.slow
def test_smollm2_gguf_computes_the_dequantized_model(smollm2_pair):
    assert_engine_computes(*smollm2_pair, atol=2e-3)  # logits ~1e1 after 30 layers of float32 sums in another order


@pytest.mark.slow
def test_smollm2_gguf_greedy_tokens_equal_the_dequantized_models(smollm2_pair):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 30], seed=12, vocab=49152)]
    packed, reference = smollm2_pair
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]


@needs_kernels
def test_two_ranks_split_the_packed_blocks(tiny_model_factory, tmp_path):
    """Column-parallel layers take their rank's packed rows, row-parallel ones their input blocks
    (o_proj: 2 heads x 16 = one block of 32 per rank; down_proj: 64 of 128)."""
    from test_tensor_parallel import generate_both, token_prompts, token_ids

    path = str(write_gguf(tiny_model_factory("llama_gqa"), tmp_path / "mixed.gguf", quant=mixed_type))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference, outputs, _ = generate_both(path, token_prompts(3, seed=4), params, skip_tokenizer_init=True,
                                          kv_cache_memory=8 << 20, quantization="gguf")
    assert token_ids(outputs) == token_ids(reference)


def test_a_rank_slice_that_cuts_a_block_is_a_clear_error():
    from tokenmill.layers.quantization.gguf_packed import GGUFTensor

    packed = GGUFTensor(torch.zeros(4, 2 * 18, dtype=torch.uint8), int(QT.Q4_0), 64)
    assert packed.narrow_cols(32, 32, "o_proj").data.shape == (4, 18)
    with pytest.raises(ModelLoadError, match=r"o_proj: input columns \[16, 32\) do not fall on whole blocks of 32 values \(Q4_0\)"):
        packed.narrow_cols(16, 16, "o_proj")
