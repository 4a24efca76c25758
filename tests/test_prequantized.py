"""Pre-quantized checkpoints: GPTQ, AWQ and compressed-tensors, loaded onto the int4 / int8 / w8a8 methods.

No hub access: each test quantizes a tiny seeded random Llama itself (round to nearest, per group),
packs the integers with a small packer written here from each format's spec (AutoGPTQ's `pack`,
AutoAWQ's `WQLinear_GEMM` order, compressed-tensors' `pack_to_int32`) and writes the checkpoint
with its config.json `quantization_config`. The reference is the same model with every quantized
weight replaced by its dequantized value (with the checkpoint's float16 scales), run in float32:
tokenmill's logits on the checkpoint must match it within 2e-4 (absolute and relative), through
the decode kernels and the prompt path, and its greedy tokens must be equal.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import _llama, assert_engine_computes, random_prompts, randomize_weights
from tokenmill import LLM
from tokenmill.kernels import cpu

needs_kernels = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's WQLinear_GEMM: slot i of an int32 holds channel AWQ_ORDER[i]


# -- the float model and its quantization -----------------------------------------------------------


def _float_model(seed: int = 21):
    from transformers import AutoModelForCausalLM

    # head_dim 32, hidden 128, MLP 256: every layer's input is whole groups of 32, 64 or 128.
    config = _llama(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed, std=0.2)
    return model


def _quantized_linears(model) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int = 0):
    """Round-to-nearest per group of `group` input channels: (q [N, K] in 0..2^bits-1, zero [N, G] int,
    scale [N, G] float16). W ~ (q - zero) * scale."""
    n, k = w.shape
    levels = (1 << bits) - 1
    g = w.view(n, k // group, group)
    if sym:
        scale = g.abs().amax(-1) / (levels // 2)
        zero = torch.full_like(scale, (levels + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / levels
        zero = torch.round(-lo / scale).long().clamp(min_zero, levels)
    scale = scale.half()
    q = torch.round(g / scale.float()[..., None]) + zero[..., None]
    return q.clamp(0, levels).long().view(n, k), zero, scale


def dequantize(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]


def to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (held in int64) as the int32 they are stored as."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] -> [R / per, C]: rows i * per + j into bits [bits * j, ...) of row i (per = 32 / bits)."""
    per = 32 // bits
    v = values.long().view(-1, per, values.shape[1])
    if order is not None:
        v = v[:, order]
    shifts = (torch.arange(per) * bits).view(1, per, 1)
    return to_int32((v << shifts).sum(1))


def pack_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    return pack_rows(values.t(), bits, order).t().contiguous()


def _write(folder: Path, model, state: dict[str, torch.Tensor], quantization_config: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    del model.config.quantization_config
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return str(folder)


def _reference(folder: Path, model, dequantized: dict[str, torch.Tensor]) -> str:
    with torch.no_grad():
        for name, w in dequantized.items():
            model.get_submodule(name).weight.copy_(w)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _checkpoints(tmp_path: Path, quantize_layer, quantization_config: dict) -> tuple[str, str]:
    """(quantized checkpoint, float reference): quantize_layer(name, weight) -> (its checkpoint tensors by
    suffix, the dequantized weight)."""
    model = _float_model()
    state = {k: v for k, v in model.state_dict().items()}
    dequantized = {}
    for name, linear in _quantized_linears(model).items():
        del state[f"{name}.weight"]
        tensors, dequantized[name] = quantize_layer(name, linear.weight.detach())
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    quantized = _write(tmp_path / "quantized", model, state, quantization_config)
    return quantized, _reference(tmp_path / "reference", model, dequantized)


def _llm(folder: str, **kw) -> LLM:
    return LLM(folder, dtype="float32", num_kv_blocks=64, **kw)


def _input_seed(name: str) -> int:
    """One seed per layer input: q/k/v share theirs, as gate/up do (act-order's input order follows the input)."""
    key = name if name.endswith(("o_proj", "down_proj")) else name.rsplit(".", 1)[0]
    return zlib.crc32(key.encode())


# -- GPTQ ---------------------------------------------------------------------------------------


def gptq_layer(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, v2: bool, seed: int):
    """AutoGPTQ's layout: qweight [K / per, N] packed along the input, qzeros [G, N / per] (zero - 1 in
    the classic format), scales [G, N], g_idx [K]."""
    n, k = w.shape
    group_len = k if group == -1 else group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    # act-order: groups of the channels in perm's order; g_idx[perm[i]] = i // group
    q_p, zero, scale = rtn(w[:, perm], bits, group_len, sym, min_zero=0 if v2 else 1)
    inverse = torch.argsort(perm)
    q = q_p[:, inverse]
    g_idx = (torch.arange(k) // group_len)[inverse]
    stored_zero = zero if v2 else zero - 1
    tensors = {
        "qweight": pack_rows(q.t(), bits),
        "qzeros": pack_cols(stored_zero.t(), bits),
        "scales": scale.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, dequantize(q, zero, scale, g_idx)


def gptq_config(bits=4, group=64, sym=True, desc_act=False, v2=False) -> dict:
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True}
    if v2:
        config["checkpoint_format"] = "gptq_v2"
    return config


GPTQ_CASES = [
    pytest.param(dict(bits=4, group=64, sym=True), id="4bit-g64-sym"),
    pytest.param(dict(bits=4, group=32, sym=False), id="4bit-g32-asym"),
    pytest.param(dict(bits=4, group=128, sym=False, v2=True), id="4bit-g128-asym-v2"),
    pytest.param(dict(bits=4, group=64, sym=True, desc_act=True), id="4bit-g64-act-order"),
    pytest.param(dict(bits=4, group=-1, sym=True), id="4bit-per-channel"),
    pytest.param(dict(bits=8, group=-1, sym=True), id="8bit-per-channel"),
]


@needs_kernels
@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_checkpoint_computes_its_dequantized_model(tmp_path, case):
    def layer(name, w):
        return gptq_layer(w, case["bits"], case["group"], case["sym"], case.get("desc_act", False), case.get("v2", False),
                          seed=_input_seed(name))

    quantized, reference = _checkpoints(tmp_path, layer, gptq_config(**case))
    llm = _llm(quantized)  # the method comes from config.json
    assert llm.llm_engine.executor.driver_runner.model.model.layers[0].self_attn.qkv_proj.method.__class__.__name__ == "GPTQLinearMethod"
    assert_engine_computes(llm, _llm(reference))


@needs_kernels
def test_gptq_explicit_quantization_must_agree(tmp_path):
    quantized, reference = _checkpoints(tmp_path, lambda n, w: gptq_layer(w, 4, 64, True, False, False, 0), gptq_config())
    _llm(quantized, quantization="gptq")
    with pytest.raises(ValueError, match=r"gptq-quantized .* quantization='int4' was given: leave quantization unset or give 'gptq'"):
        _llm(quantized, quantization="int4")
    with pytest.raises(ValueError, match=r"quantization='gptq' loads gptq checkpoints, but this checkpoint's config.json has no quantization_config"):
        _llm(reference, quantization="gptq")


@pytest.mark.parametrize("config,message", [
    (gptq_config(bits=3), "3-bit"),
    (gptq_config(bits=8, group=128), "8-bit with group_size 128"),
    (gptq_config(group=16), "group_size 16"),
    ({**gptq_config(), "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
])
def test_unsupported_gptq_variants_are_clear_errors(tmp_path, config, message):
    from tokenmill.layers.quantization import get_quantization_config

    hf_config = _llama()
    hf_config.quantization_config = config
    with pytest.raises(ValueError, match=message) as info:
        get_quantization_config(None, None, torch.device("cpu"), torch.float32, hf_config)
    assert "gptq" in str(info.value).lower()


def test_gptq_on_a_float_checkpoint_from_the_cli_is_a_clear_error(capsys):
    from tokenmill.entrypoints.cli import main

    assert main(["generate", "hi", "--quantization", "gptq"]) != 0
    assert "quantization='gptq' loads gptq checkpoints, but this checkpoint's config.json has no quantization_config" in capsys.readouterr().err


# -- tensor parallelism -------------------------------------------------------------------------


def _generate(folder: str, **kw):
    from tokenmill import SamplingParams

    llm = LLM(folder, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory=8 << 20, **kw)
    try:
        prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 23], seed=3)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def _two_rank_checkpoint(tmp_path: Path, method: str) -> str:
    if method == "gptq":
        quantized, _ = _checkpoints(tmp_path, lambda n, w: gptq_layer(w, 4, 64, False, False, False, 0), gptq_config(sym=False))
    elif method == "awq":
        quantized, _ = _checkpoints(tmp_path, lambda n, w: awq_layer(w, 64), awq_config(64))
    else:  # compressed-tensors W4A16, asymmetric: zero points packed along the output axis
        quantized, _ = _checkpoints(tmp_path, lambda n, w: ct_w4_layer(w, 64, False), ct_config(w4_args(64, False)))
    return quantized


@needs_kernels
@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_two_ranks_compute_what_one_computes(tmp_path, method):
    """Column-parallel layers split by output channel (packed tensors by whole int32s), row-parallel ones
    by input channel in whole groups: the same integers and scales as one rank, so the same tokens."""
    quantized = _two_rank_checkpoint(tmp_path, method)
    one, two = _generate(quantized), _generate(quantized, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        lp_one = [next(iter(d.values())).logprob for d in a.prompt_logprobs[1:]]
        lp_two = [next(iter(d.values())).logprob for d in b.prompt_logprobs[1:]]
        assert lp_two == pytest.approx(lp_one, abs=1e-3)


@pytest.mark.parametrize("case,message", [
    (dict(group=128), r"o_proj: this rank's input channels \[0, 64\) .* groups of 128"),
    (dict(group=64, desc_act=True), "act-order .* cannot split their input over tensor-parallel ranks"),
])
def test_gptq_layouts_two_ranks_cannot_split_are_clear_errors(tmp_path, case, message):
    from tokenmill.errors import ModelLoadError

    quantized, _ = _checkpoints(tmp_path, lambda n, w: gptq_layer(w, 4, case["group"], True, case.get("desc_act", False), False,
                                                                   _input_seed(n)), gptq_config(**case))
    with pytest.raises(ModelLoadError, match=message):
        _generate(quantized, tensor_parallel_size=2)


# -- AWQ ----------------------------------------------------------------------------------------


def awq_layer(w: torch.Tensor, group: int):
    """AutoAWQ's WQLinear_GEMM: qweight [K, N / 8] and qzeros [G, N / 8] packed along the output in
    AWQ_ORDER, scales [G, N]; asymmetric, no offset on the zero points."""
    n, k = w.shape
    q, zero, scale = rtn(w, 4, group, sym=False)
    tensors = {
        "qweight": pack_cols(q.t(), 4, AWQ_ORDER),
        "qzeros": pack_cols(zero.t(), 4, AWQ_ORDER),
        "scales": scale.t().contiguous(),
    }
    return tensors, dequantize(q, zero, scale, torch.arange(k) // group)


def awq_config(group=64, **kw) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm", **kw}


def test_awq_packing_order_is_autoawqs():
    # AutoAWQ packs channel order_map[i] of each run of eight into bits [4i, 4i + 4).
    from tokenmill.layers.quantization.prequantized import unpack_int32

    channels = torch.arange(8).view(1, 8)
    packed = pack_cols(channels, 4, AWQ_ORDER)
    assert int(packed) == sum(AWQ_ORDER[i] << (4 * i) for i in range(8))
    assert torch.equal(unpack_int32(packed, 4, dim=1, order=AWQ_ORDER), channels.int())


@needs_kernels
@pytest.mark.parametrize("group", [32, 128])
def test_awq_checkpoint_computes_its_dequantized_model(tmp_path, group):
    quantized, reference = _checkpoints(tmp_path, lambda n, w: awq_layer(w, group), awq_config(group))
    assert_engine_computes(_llm(quantized), _llm(reference))


@needs_kernels
def test_awq_modules_to_not_convert_stay_float(tmp_path):
    model = _float_model()
    state = dict(model.state_dict())
    dequantized = {}
    for name, linear in _quantized_linears(model).items():
        if ".mlp." in name:  # left in float, as modules_to_not_convert says
            continue
        del state[f"{name}.weight"]
        tensors, dequantized[name] = awq_layer(linear.weight.detach(), 64)
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    quantized = _write(tmp_path / "q", model, state, awq_config(64, modules_to_not_convert=["mlp"]))
    llm = _llm(quantized)
    layer = llm.llm_engine.executor.driver_runner.model.model.layers[0]
    assert type(layer.mlp.gate_up_proj.method).__name__ == "UnquantizedLinearMethod"
    assert type(layer.self_attn.o_proj.method).__name__ == "AWQLinearMethod"
    assert_engine_computes(llm, _llm(_reference(tmp_path / "r", model, dequantized)))


def test_unsupported_awq_variants_are_clear_errors():
    from tokenmill.layers.quantization import get_quantization_config

    hf_config = _llama()
    for config, message in [(awq_config(version="gemv"), "version 'gemv'"), (awq_config(zero_point=False), "zero_point false"),
                            ({**awq_config(), "bits": 8}, "8-bit")]:
        hf_config.quantization_config = config
        with pytest.raises(ValueError, match=f"{message}.*tokenmill loads AWQ 4-bit, GEMM layout"):
            get_quantization_config(None, None, torch.device("cpu"), torch.float32, hf_config)


# -- compressed-tensors ---------------------------------------------------------------------------


def ct_pack_to_int32(signed: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' pack_to_int32: values + 2^(bits-1), 32 / bits to an int32 along packed_dim, value i at bits * i."""
    unsigned = signed.long() + (1 << (bits - 1))
    return pack_cols(unsigned, bits) if packed_dim == 1 else pack_rows(unsigned, bits)


def ct_w4_layer(w: torch.Tensor, group: int, sym: bool, act_order_seed: int | None = None):
    """llm-compressor's W4A16: weight_packed [N, K / 8], weight_scale [N, G], weight_zero_point [N / 8, G]
    (asymmetric), weight_shape; with group act-order, weight_g_idx [K] (columns stay in input order)."""
    n, k = w.shape
    group_len = k if group == -1 else group
    perm = torch.arange(k)
    if act_order_seed is not None:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(act_order_seed))
    q_p, zero, scale = rtn(w[:, perm], 4, group_len, sym)
    inverse = torch.argsort(perm)
    q, g_idx = q_p[:, inverse], (torch.arange(k) // group_len)[inverse]
    tensors = {"weight_packed": ct_pack_to_int32(q - 8, 4), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if not sym:
        tensors["weight_zero_point"] = ct_pack_to_int32(zero - 8, 4, packed_dim=0)
    if act_order_seed is not None:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, dequantize(q, zero, scale, g_idx)


def ct_w8_layer(w: torch.Tensor, per_tensor: bool):
    n, k = w.shape
    if per_tensor:
        scale = (w.abs().amax() / 127).half().reshape(1)
        q = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    q, zero, scale = rtn(w, 8, k, sym=True)
    signed = (q - zero).to(torch.int8)
    return {"weight": signed, "weight_scale": scale}, dequantize(q, zero, scale, torch.zeros(k, dtype=torch.long))


def ct_config(weights: dict, input_activations: dict | None = None, fmt: str = "pack-quantized", ignore=("lm_head",)) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": input_activations,
                                      "output_activations": None}},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def w4_args(group: int, sym: bool) -> dict:
    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
    return {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None, **strategy}


W8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
W8_TOKEN_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@needs_kernels
@pytest.mark.parametrize("group,sym", [(128, True), (32, False), (-1, True)], ids=["g128-sym", "g32-asym", "channel-sym"])
def test_compressed_tensors_w4a16_computes_its_dequantized_model(tmp_path, group, sym):
    quantized, reference = _checkpoints(tmp_path, lambda n, w: ct_w4_layer(w, group, sym), ct_config(w4_args(group, sym)))
    llm = _llm(quantized)
    assert type(llm.llm_engine.executor.driver_runner.model.model.layers[0].mlp.down_proj.method).__name__ == "CTPackedInt4Method"
    assert_engine_computes(llm, _llm(reference))


@needs_kernels
def test_compressed_tensors_w4a16_group_act_order(tmp_path):
    weights = {**w4_args(64, False), "actorder": "group"}
    quantized, reference = _checkpoints(tmp_path, lambda n, w: ct_w4_layer(w, 64, False, _input_seed(n)), ct_config(weights))
    llm = _llm(quantized)
    assert llm.llm_engine.executor.driver_runner.model.model.layers[0].self_attn.qkv_proj.input_perm is not None
    assert_engine_computes(llm, _llm(reference))


@needs_kernels
@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_compressed_tensors_w8a16_computes_its_dequantized_model(tmp_path, per_tensor):
    weights = {**W8_WEIGHTS, "strategy": "tensor" if per_tensor else "channel"}
    quantized, reference = _checkpoints(tmp_path, lambda n, w: ct_w8_layer(w, per_tensor), ct_config(weights, fmt="int-quantized"))
    assert_engine_computes(_llm(quantized), _llm(reference))


@needs_kernels
def test_compressed_tensors_w8a8_computes_what_w8a8_computes(tmp_path):
    """Dynamic per-token activations: the reference is `w8a8` with one activation scale per token on the dequantized model, whose per-channel
    requantization gives back the checkpoint's integers (every row reaches +-127) and scales. Compared
    chunking for chunking: rounding activations to int8 turns the float32 difference between the decode
    and prompt paths into a step now and then (0.1 in a logit here, in the reference alone)."""
    from conftest import tokenmill_logits
    from tokenmill import SamplingParams
    from tokenmill.layers.quantization.w8a8 import W8A8LinearMethod

    quantized, reference = _checkpoints(tmp_path, lambda n, w: ct_w8_layer(w, False), ct_config(W8_WEIGHTS, W8_TOKEN_ACTS, "int-quantized"))
    llm, ref = _llm(quantized), _llm(reference, quantization="w8a8", quantization_options={"activation_group_size": 0})
    assert isinstance(llm.llm_engine.executor.driver_runner.model.model.layers[0].self_attn.qkv_proj.method.compute, W8A8LinearMethod)
    prompt = random_prompts([40], seed=5)[0]
    for chunk in (1, 3, 64):
        torch.testing.assert_close(tokenmill_logits(llm, prompt, chunk), tokenmill_logits(ref, prompt, chunk), atol=2e-4, rtol=2e-4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 30], seed=6)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]


@needs_kernels
def test_compressed_tensors_ignore_list_stays_float(tmp_path):
    model = _float_model()
    state = dict(model.state_dict())
    dequantized = {}
    for name, linear in _quantized_linears(model).items():
        if name.endswith("down_proj"):
            continue
        del state[f"{name}.weight"]
        tensors, dequantized[name] = ct_w4_layer(linear.weight.detach(), 64, True)
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    quantized = _write(tmp_path / "q", model, state, ct_config(w4_args(64, True), ignore=["lm_head", "re:.*down_proj$"]))
    llm = _llm(quantized)
    assert type(llm.llm_engine.executor.driver_runner.model.model.layers[1].mlp.down_proj.method).__name__ == "UnquantizedLinearMethod"
    assert_engine_computes(llm, _llm(_reference(tmp_path / "r", model, dequantized)))


@pytest.mark.parametrize("config,message", [
    (ct_config({**W8_WEIGHTS, "symmetric": False}, fmt="int-quantized"), "asymmetric 8-bit weights"),
    (ct_config(W8_WEIGHTS, {**W8_TOKEN_ACTS, "symmetric": False}, "int-quantized"), "asymmetric activations"),
    (ct_config(W8_WEIGHTS, {**W8_TOKEN_ACTS, "dynamic": False, "strategy": "tensor"}, "int-quantized"), "static or per-tensor activation"),
    (ct_config({**w4_args(128, True), "num_bits": 3}), "int 3-bit weights"),
    (ct_config({**W8_WEIGHTS, "actorder": "group"}, fmt="int-quantized"), "group act-order without 4-bit groups"),
    (ct_config({"num_bits": 8, "type": "float", "strategy": "tensor"}, fmt="float-quantized"), "float 8-bit weights"),
])
def test_unsupported_compressed_tensors_schemes_are_clear_errors(config, message):
    from tokenmill.layers.quantization import get_quantization_config

    hf_config = _llama()
    hf_config.quantization_config = config
    with pytest.raises(ValueError, match=f"{message}.*tokenmill loads W8A8 .* W8A16 .* W4A16"):
        get_quantization_config(None, None, torch.device("cpu"), torch.float32, hf_config)


def test_compressed_tensors_quantized_lm_head_is_a_clear_error(tmp_path):
    from tokenmill.errors import ModelLoadError

    quantized, _ = _checkpoints(tmp_path, lambda n, w: ct_w4_layer(w, 64, True), ct_config(w4_args(64, True), ignore=()))
    with pytest.raises(ModelLoadError, match="quantizes the LM head"):
        _llm(quantized)


@needs_kernels
def test_compressed_tensors_w8a8_weights_at_minus_128_are_clamped(caplog):
    """llm-compressor's symmetric int8 reaches -128; the W8A8 kernel's range is -127..127."""
    import logging

    from tokenmill.layers.build_context import ModelBuildContext
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization import get_quantization_config
    from tokenmill.layers.quantization.w8a8 import w8a8_linear_reference

    hf_config = _llama()
    hf_config.quantization_config = ct_config(W8_WEIGHTS, W8_TOKEN_ACTS, "int-quantized")
    quant = get_quantization_config(None, None, torch.device("cpu"), torch.float32, hf_config)
    layer = Linear(64, 32, ctx=ModelBuildContext(quant_config=quant), prefix="model.layers.0.mlp.down_proj")
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8)
    q[3, 5] = -128
    scale = torch.rand(32, 1, generator=gen) / 100
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale.weight_loader(layer.weight_scale, scale.half())
    with caplog.at_level(logging.INFO, logger="tokenmill.layers.quantization.compressed_tensors"):
        layer.method.process_weights_after_loading(layer)
    assert "1 weights at -128 clamped to -127" in caplog.text
    x = torch.randn(5, 64, generator=gen)
    want = w8a8_linear_reference(x, q.clamp(min=-127), scale.half().float().reshape(-1), None, group_size=0)  # per token, as the checkpoint says
    torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=1e-6)
