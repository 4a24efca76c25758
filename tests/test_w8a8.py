"""`quantization="w8a8"`: int8 weights per channel x int8 activations per token and group of input
features (dynamic scales; groups of 128 by default, 0 = one scale per token).

The kernel (kernels/cpu/int8_gemm.cpp) against the plain PyTorch reference (layers/quantization/
w8a8.py: quantize per token and group with torch ops, integer matmul per group in float64, the same
float32 sums and epilogue): the quantize and the whole linear are compared bit for bit (so the int32 sums are exact:
a wrong sum would change the float32 result), and the result against the float64 product of the
dequantized operands within a few float32 ulps. tests/test_kernel_isa.py runs the `w8a8_kernel`
tests again on the AVX2 build (and, under -m slow, the AVX-512BW and scalar builds).

In the engine, the reference is the same model in float32 with every quantized weight replaced by
its dequantized value and every linear layer's input fake-quantized per token and group (quantize,
then dequantize), the product taken in float64: tokenmill's w8a8 engine must give its logits and its
greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_engine_computes, smollm2_gguf_path
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantization import W8A8Config, check_quantization, get_quantization_config, quant_utils as Q
from tokenmill.layers.quantization.base import LinearMethodBase
from tokenmill.layers.quantization.w8a8 import ACTIVATION_GROUP_SIZE, activation_groups, quantize_per_token_group, w8a8_linear_reference

needs_kernels = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, K, N): one row and a few; K no multiple of 4, of the vector width or of 64; N no multiple of
# a panel (16 or 64 channels), odd; SmolLM2-135M's layers.
SHAPES = [(1, 64, 16), (3, 200, 17), (17, 576, 960), (5, 1536, 576), (33, 7, 3), (64, 130, 129), (1, 576, 3072), (2, 3, 1)]
# Activation groups: one per token, the default 128 (K = 200, 576, 130: a shorter last group), 32 and 4.
GROUPS = [0, ACTIVATION_GROUP_SIZE, 32, 4]


def _fake_quantized(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] quantized per row and group and dequantized again, in float64."""
    qx, x_scale = quantize_per_token_group(x, group_size)
    sizes = [b - a for a, b in activation_groups(x.shape[-1], group_size)]
    return qx.double() * x_scale.double().repeat_interleave(torch.tensor(sizes), dim=1)


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    q, scale = Q.quantize_int8(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, q, scale, bias


@needs_kernels
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k", [(1, 64), (3, 200), (17, 576), (4, 7), (9, 1536)])
def test_w8a8_kernel_quantize_matches_reference(m, k, dtype, group):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * 5).to(dtype)
    x[0, : min(k, 5)] = 0.0
    if m > 2:
        x[2] = 0.0  # an all-zero row: the smallest normal scale, and zeros
    q, scale = cpu.w8a8_quantize(x, group)
    want_q, want_scale = quantize_per_token_group(x, group)
    assert scale.shape == (m, len(activation_groups(k, group)))
    assert torch.equal(scale, want_scale) and torch.equal(q, want_q)
    assert int(q.abs().max()) == 127  # each nonzero group uses the whole range


@needs_kernels
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_w8a8_kernel_linear_is_the_reference_exactly(shape, dtype, group):
    """Same int32 sums per group and the same float32 sums and epilogue as the reference: the same
    bits, bias or not."""
    m, k, n = shape
    x, q, scale, bias = _operands(m, k, n, dtype, seed=m + k + n)
    packed, colsum = cpu.w8a8_pack(q, group)
    assert torch.equal(colsum, torch.stack([q[:, a:b].int().sum(dim=1) for a, b in activation_groups(k, group)]))
    for b in (None, bias):
        got = cpu.w8a8_linear(x, packed, colsum, scale, b, group)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, w8a8_linear_reference(x, q, scale, b, group))


@needs_kernels
@pytest.mark.parametrize("group", [0, ACTIVATION_GROUP_SIZE])
@pytest.mark.parametrize("shape", [(17, 576, 960), (3, 200, 17)], ids=str)
def test_w8a8_kernel_linear_is_the_fake_quantized_product(shape, group):
    """Against the float64 product of the dequantized operands: within a few float32 ulps (a
    rounding per group and three in the epilogue), and within the quantization error of the float
    product."""
    m, k, n = shape
    x, q, scale, bias = _operands(m, k, n, torch.float32, seed=7)
    got = cpu.w8a8_linear(x, *cpu.w8a8_pack(q, group), scale, bias, group)
    fake = _fake_quantized(x, group) @ (q.double() * scale.double()[:, None]).t() + bias.double()
    torch.testing.assert_close(got.double(), fake, rtol=1e-6, atol=1e-6 * float(fake.abs().max()))
    exact = x.double() @ Q.dequantize_int8(q, scale).double().t() + bias.double()
    assert float((got.double() - exact).norm() / exact.norm()) < 0.02  # 8-bit activations: ~0.5% here


@needs_kernels
@pytest.mark.parametrize("group", [0, ACTIVATION_GROUP_SIZE])
@pytest.mark.parametrize("k", [64, 1536, 4099])
def test_w8a8_kernel_extreme_values_do_not_saturate(k, group):
    """Every product at +-127 x +-127, where the maddubs builds' int16 pair sums peak (2 * 127^2)
    and the int32 sums grow largest; the float64 reference is exact there."""
    gen = torch.Generator().manual_seed(k)
    signs = lambda *s: torch.randint(0, 2, s, generator=gen).float() * 2 - 1  # noqa: E731
    x = torch.cat([signs(3, k), torch.ones(1, k), -torch.ones(1, k)])  # every |q| = 127
    q = (signs(40, k) * 127).to(torch.int8)
    q[0], q[1] = 127, -127
    scale = torch.rand(40, generator=gen) + 0.5
    got = cpu.w8a8_linear(x, *cpu.w8a8_pack(q, group), scale, None, group)
    assert torch.equal(got, w8a8_linear_reference(x, q, scale, None, group))
    assert float(got[3, 0]) == pytest.approx(127 * 127 * k * float(scale[0]) / 127, rel=1e-6)  # all +127: no clipping


@needs_kernels
def test_w8a8_kernel_takes_any_layout_of_x():
    x, q, scale, bias = _operands(6, 96, 40, torch.bfloat16, seed=3)
    packed, colsum = cpu.w8a8_pack(q, 32)
    strided = x.t().contiguous().t()  # the same values, column-major
    assert torch.equal(cpu.w8a8_linear(strided, packed, colsum, scale, bias, 32), cpu.w8a8_linear(x, packed, colsum, scale, bias, 32))
    assert cpu.w8a8_linear(x[:0], packed, colsum, scale, bias, 32).shape == (0, 40)


@needs_kernels
def test_w8a8_kernel_bad_inputs_are_errors():
    q, scale = Q.quantize_int8(torch.randn(8, 64))
    packed, colsum = cpu.w8a8_pack(q, 32)
    with pytest.raises(RuntimeError, match="w8a8_pack's output for 8 channels of 32 inputs"):
        cpu.w8a8_linear(torch.randn(2, 32), packed, colsum, scale, None, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu.w8a8_linear(torch.randn(2, 64), packed, colsum, scale, torch.zeros(7), 32)
    with pytest.raises(RuntimeError, match=r"colsum must be w8a8_pack's int32 \[1, 8\] for activation groups of 64"):
        cpu.w8a8_linear(torch.randn(2, 64), packed, colsum, scale, None, 64)  # packed for groups of 32
    for bad in (6, -4):
        with pytest.raises(RuntimeError, match="activation group size must be 0 .one per token. or a positive multiple of 4"):
            cpu.w8a8_linear(torch.randn(2, 64), packed, colsum, scale, None, bad)
    with pytest.raises(RuntimeError, match="-127..127"):
        cpu.w8a8_pack(torch.full((4, 8), -128, dtype=torch.int8), 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        cpu.w8a8_linear(torch.zeros(2, 64, dtype=torch.float64), packed, colsum, scale, None, 32)


@needs_kernels
@pytest.mark.parametrize("group", [0, ACTIVATION_GROUP_SIZE, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 200, 17), (33, 130, 129), (2, 7, 5), (4, 9000, 40)])
@pytest.mark.parametrize("residual", [False, True], ids=["first", "residual"])
def test_w8a8_kernel_norm_quantize_then_gemm_is_norm_then_linear(m, k, n, dtype, group, residual):
    """The RMSNorm with the activation quantize in it (w8a8_rms_norm_quant, then w8a8_linear_quantized)
    gives w8a8_linear(rms_norm(x)) / w8a8_linear(add_rms_norm(residual, x)) bit for bit, and updates the
    residual stream as add_rms_norm does (K = 9000: the normalized row on the heap, not the stack)."""
    x, q, scale, bias = _operands(m, k, n, dtype, seed=k + n)
    gen = torch.Generator().manual_seed(m)
    stream = torch.randn(m, k, generator=gen).to(dtype) if residual else None
    weight = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    packed, colsum = cpu.w8a8_pack(q, group)
    want_stream = None if stream is None else stream.clone()
    normed = cpu.rms_norm(x, weight, 1e-5) if stream is None else cpu.add_rms_norm(want_stream, x, weight, 1e-5)
    want = cpu.w8a8_linear(normed, packed, colsum, scale, bias, group)
    got_stream = None if stream is None else stream.clone()
    qx, x_scale = cpu.w8a8_rms_norm_quant(x, got_stream, weight, 1e-5, group)
    assert qx.dtype == torch.uint8 and x_scale.shape == (m, len(activation_groups(k, group)))
    assert torch.equal(cpu.w8a8_linear_quantized(qx, x_scale, packed, colsum, scale, bias, group, dtype), want)
    if stream is not None:
        assert torch.equal(got_stream, want_stream)


@needs_kernels
def test_w8a8_kernel_quantized_input_bad_inputs_are_errors():
    q, scale = Q.quantize_int8(torch.randn(8, 64))
    packed, colsum = cpu.w8a8_pack(q, 32)
    weight = torch.ones(64)
    qx, x_scale = cpu.w8a8_rms_norm_quant(torch.randn(2, 64), None, weight, 1e-5, 32)
    with pytest.raises(RuntimeError, match="the activations have 64 .padded. features, the packed weight 32"):
        cpu.w8a8_linear_quantized(qx, x_scale, *cpu.w8a8_pack(q[:, :32], 32), scale, None, 32, torch.float32)
    with pytest.raises(RuntimeError, match="2 activation scales per row, but groups of 16 over 64 features make 4"):
        cpu.w8a8_linear_quantized(qx, x_scale, packed, colsum, scale, None, 16, torch.float32)
    with pytest.raises(RuntimeError, match="q and scales must be w8a8_rms_norm_quant's output"):
        cpu.w8a8_linear_quantized(qx.to(torch.int8), x_scale, packed, colsum, scale, None, 32, torch.float32)
    with pytest.raises(RuntimeError, match="residual must be a contiguous tensor shaped and typed like x"):
        cpu.w8a8_rms_norm_quant(torch.randn(2, 64), torch.randn(3, 64), weight, 1e-5, 32)
    with pytest.raises(RuntimeError, match=r"weight must be \[hidden\] in x's dtype"):
        cpu.w8a8_rms_norm_quant(torch.randn(2, 64), None, weight.bfloat16(), 1e-5, 32)


@needs_kernels
@pytest.mark.parametrize("options", [{}, {"activation_group_size": 0}], ids=["groups", "per token"])
def test_w8a8_layers_after_norms_take_quantized_input(tiny_model_factory, options):
    """qkv_proj and gate_up_proj take their input from the norm's quantize in both decode programs
    (Python: norm_then_linear; C++: every layer), and o_proj and down_proj, after no norm, quantize it
    themselves; test_decode_program.py checks the tokens against the layers' forward."""
    from tokenmill.models.llama import norm_then_linear

    llm = LLM(tiny_model_factory("llama_bias"), dtype="float32", num_kv_blocks=64, quantization="w8a8", quantization_options=options)
    llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    model = llm.llm_engine.executor.driver_runner.model.model
    assert model.native_decode.program.quantizing_layers() == len(model.layers)
    layer = model.layers[0]
    group = options.get("activation_group_size", ACTIVATION_GROUP_SIZE)
    assert layer.self_attn.qkv_proj.quantized_input(torch.float32).group_size == group
    assert layer.mlp.gate_up_proj.quantized_input(torch.float32).group_size == group
    x, stream = torch.randn(3, layer.self_attn.qkv_proj.input_size), torch.randn(3, layer.self_attn.qkv_proj.input_size)
    fused = norm_then_linear(layer.input_layernorm, layer.self_attn.qkv_proj, torch.float32)
    plain = layer.self_attn.qkv_proj.forward
    want_stream = stream.clone()
    assert torch.equal(fused(x, stream), plain(cpu.add_rms_norm(want_stream, x, layer.input_layernorm.weight, layer.input_layernorm.eps)))
    assert torch.equal(stream, want_stream)
    assert torch.equal(fused(x, None), plain(cpu.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)))


def test_w8a8_pytorch_path_is_the_kernel_path(monkeypatch):
    """Without the C++ kernels a layer keeps its int8 weight and runs the reference with float32
    sums: on these sizes the same bits as the kernel (and as the float64 reference)."""
    x, q, scale, bias = _operands(9, 576, 200, torch.bfloat16, seed=11)
    want = w8a8_linear_reference(x, q, scale, bias)
    assert torch.equal(w8a8_linear_reference(x, q, scale, bias, acc_dtype=torch.float32), want)
    weight = Q.dequantize_int8(q, scale)
    for kernels in ([True, False] if cpu.cpu_kernels_available() else [False]):
        monkeypatch.setattr(cpu, "cpu_kernels_available", lambda k=kernels: k)
        layer = Linear(576, 200, bias=True, ctx=_ctx(), prefix="model.layers.0.mlp.down_proj")
        layer.weight.data.copy_(weight)
        layer.bias.data.copy_(bias.float())
        layer.method.process_weights_after_loading(layer)
        assert hasattr(layer, "packed_weight") == kernels and hasattr(layer, "qweight") != kernels
        assert layer.weight.numel() == 0
        assert torch.equal(layer(x.view(3, 3, 576)), w8a8_linear_reference(x, q, scale, layer.bias).view(3, 3, 200))


def _ctx():
    from tokenmill.layers.build_context import ModelBuildContext

    return ModelBuildContext(quant_config=W8A8Config())


# ---- the engine ---------------------------------------------------------------------------------


class FakeQuantActivations(LinearMethodBase):
    """The reference's linear method: y = fake_quant(x) @ W^T + b in float64, W the (already
    dequantized) float weight of the layer."""

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = F.linear(_fake_quantized(flat, ACTIVATION_GROUP_SIZE), layer.weight.double(), None if bias is None else bias.double())
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class FakeQuantHead(FakeQuantActivations):
    """The same for the LM head (quantize_lm_head), whose method takes no bias."""

    def apply(self, layer, hidden: torch.Tensor) -> torch.Tensor:
        return super().apply(layer, hidden, None)


def _fake_quantized_reference(src: str, dst, monkeypatch, lm_head: bool = False) -> LLM:
    from transformers import AutoModelForCausalLM

    import tokenmill.layers.quantization.unquantized as unquantized
    from tokenmill.layers.embedding import LMHead

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (lm_head or name != "lm_head"):  # w8a8 leaves the LM head alone by default
                module.weight.copy_(Q.dequantize_int8(*Q.quantize_int8(module.weight)))
    model.save_pretrained(dst, safe_serialization=True)
    with monkeypatch.context() as patch:  # float weights as they are (not prepacked): the fake method reads them
        patch.setattr(unquantized, "cpu_packed_weights_supported", lambda device, dtype: False)
        llm = LLM(str(dst), dtype="float32", num_kv_blocks=64)
    for module in llm.llm_engine.executor.driver_runner.model.modules():
        if isinstance(module, Linear):
            module.method = FakeQuantActivations()
        elif lm_head and isinstance(module, LMHead):
            module.method = FakeQuantHead()
    return llm


@needs_kernels
@pytest.mark.parametrize("model_name", ["llama_bias", "qwen3"])
def test_w8a8_engine_computes_the_fake_quantized_model(tiny_model_factory, tmp_path, model_name, monkeypatch):
    src = tiny_model_factory(model_name)
    reference = _fake_quantized_reference(src, tmp_path / "fake", monkeypatch)
    quantized = LLM(src, dtype="float32", num_kv_blocks=64, quantization="w8a8")
    # 40 tokens: w8a8 runs one path at every row count, and a longer prompt meets an activation whose
    # float64 (reference) and float32 (kernel) values round to different int8 levels (logits 0.017 apart).
    assert_engine_computes(quantized, reference, prompt_len=40)


@needs_kernels
def test_w8a8_with_its_lm_head_computes_the_fake_quantized_model(tiny_model_factory, tmp_path, monkeypatch):
    """quantize_lm_head: the logits too come from the w8a8 GEMM (int8 weight per vocabulary row, activations per group)."""
    src = tiny_model_factory("llama_bias")
    reference = _fake_quantized_reference(src, tmp_path / "fake", monkeypatch, lm_head=True)
    quantized = LLM(src, dtype="float32", num_kv_blocks=64, quantization="w8a8", quantization_options={"quantize_lm_head": True})
    head = quantized.llm_engine.executor.driver_runner.model.lm_head
    assert head.packed_weight.dtype == torch.int8 and head.weight.numel() > 0  # the float weight stays for the embedding
    assert_engine_computes(quantized, reference, prompt_len=40)


@needs_kernels
def test_w8a8_weights_replace_the_float_ones(tiny_model_factory):
    llm = LLM(tiny_model_factory("qwen2"), dtype="float32", num_kv_blocks=16, quantization="w8a8")
    model = llm.llm_engine.executor.driver_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears
    for layer in linears:
        assert layer.weight.numel() == 0  # the float weight is freed after quantizing
        assert layer.packed_weight.dtype == torch.int8 and layer.weight_scale.shape == (layer.output_size,)
    head = model.lm_head  # tied to the embedding, and left in the model dtype
    assert not hasattr(head, "qweight") and head.weight.dtype == torch.float32 and head.weight.numel() > 0
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_w8a8_settings():
    check_quantization("w8a8")
    with pytest.raises(ValueError, match=r"unknown quantization option\(s\) 'group_size' for 'w8a8'; allowed: activation_group_size, quantize_lm_head"):
        check_quantization("w8a8", {"group_size": 32})
    config = get_quantization_config("w8a8", None, torch.device("cpu"), torch.float32)
    assert isinstance(config, W8A8Config) and config.name == "w8a8" and config.activation_group_size == 128
    per_token = get_quantization_config("w8a8", {"activation_group_size": 0}, torch.device("cpu"), torch.float32)
    assert per_token.activation_group_size == 0 and per_token.linear_method("model.layers.0.mlp.down_proj").group_size == 0
    for bad in (6, -4, "128", True):
        with pytest.raises(ValueError, match="activation_group_size must be 0 .one scale per token. or a positive multiple of 4"):
            get_quantization_config("w8a8", {"activation_group_size": bad}, torch.device("cpu"), torch.float32)
    assert config.prepack_lm_head == torch.backends.mkldnn.is_available()  # float32 heads are prepacked wherever oneDNN runs
    assert not config.quantize_lm_head
    with pytest.raises(ValueError, match="quantize_lm_head must be true or false"):
        get_quantization_config("w8a8", {"quantize_lm_head": "yes"}, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="runs on CPU only"):
        get_quantization_config("w8a8", None, torch.device("cuda"), torch.float16)


@pytest.mark.slow
@needs_kernels
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="the embedded SmolLM2 GGUF is not installed")
def test_smollm2_perplexity_cost_of_w8a8():
    """Activation scales per group of 128 cost SmolLM2-135M +2.5% on this excerpt in windows of 256
    (+0.72% on the whole text in windows of 512, README); one per token costs far more (+9.1% here,
    +7.1% on the whole text): a few hidden channels carry outliers, so each row's absmax leaves its
    other values few levels. Guards against either getting worse."""
    from tokenmill.bench.perplexity import DEFAULT_TEXT, run_perplexity

    text = DEFAULT_TEXT.read_text()[:4000]
    results = {}
    for method, options in ((None, None), ("w8a8", None), ("w8a8 per token", {"activation_group_size": 0})):
        llm = LLM(dtype="float32", quantization=method and "w8a8", quantization_options=options, num_kv_blocks=128)
        results[method] = run_perplexity(llm, text, 256).perplexity
        del llm
    assert results[None] < results["w8a8"] < results[None] * 1.035, results
    assert results["w8a8"] < results["w8a8 per token"] < results[None] * 1.15, results
