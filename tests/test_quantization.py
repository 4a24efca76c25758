"""Weight-only quantization in the engine (`quantization="int8" | "int4"`).

The reference for a quantized model is the same model in float32 with every quantized weight
replaced by its dequantized value (a "fake-quantized" checkpoint, built here with the same
quant_utils): tokenmill's quantized engine must give that model's logits, through the decode
kernels (prompt fed one token at a time) and the prompt path (dequantize + GEMM) alike, and
its greedy tokens. On SmolLM2, the perplexity cost of each method is bounded.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_engine_computes, random_prompts, smollm2_gguf_path
from tokenmill import LLM, SamplingParams
from tokenmill.bench.perplexity import run_perplexity, score_windows, window_token_ids
from tokenmill.kernels import cpu
from tokenmill.layers.quantization import get_quantization_config, quant_utils as Q

needs_kernels = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

METHODS = [
    pytest.param("int8", None, id="int8"),
    pytest.param("int4", {"group_size": 32}, id="int4-g32-asym"),
    pytest.param("int4", {"group_size": 64, "symmetric": True}, id="int4-g64-sym"),
]


def _fake_quantized(weight: torch.Tensor, method: str, options: dict | None, lm_head: bool) -> torch.Tensor:
    if method == "int8" or lm_head:  # the LM head is int8 under both methods
        return Q.dequantize_int8(*Q.quantize_int8(weight))
    group = (options or {}).get("group_size", 128)
    packed, scale, minimum = Q.quantize_int4(weight, group, (options or {}).get("symmetric", False))
    return Q.dequantize_int4(packed, scale, minimum, group)


def _fake_quantized_folder(src: str, dst, method: str, options: dict | None) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_fake_quantized(module.weight, method, options, lm_head=name == "lm_head"))
    model.save_pretrained(dst, safe_serialization=True)
    return str(dst)


@needs_kernels
@pytest.mark.parametrize("method,options", METHODS)
@pytest.mark.parametrize("model_name", ["llama_bias", "qwen3"])
def test_quantized_engine_computes_the_fake_quantized_model(tiny_model_factory, tmp_path, model_name, method, options):
    src = tiny_model_factory(model_name)
    reference = LLM(_fake_quantized_folder(src, tmp_path / "fake", method, options), dtype="float32", num_kv_blocks=64)
    quantized = LLM(src, dtype="float32", num_kv_blocks=64, quantization=method, quantization_options=options)
    assert_engine_computes(quantized, reference)


@needs_kernels
def test_quantized_weights_replace_the_float_ones(tiny_model_factory):
    llm = LLM(tiny_model_factory("qwen2"), dtype="float32", num_kv_blocks=16, quantization="int4", quantization_options={"group_size": 32})
    model = llm.llm_engine.executor.driver_runner.model
    linears = [m for m in model.modules() if type(m).__name__ in ("Linear", "MergedLinear", "QKVLinear")]
    assert linears
    for layer in linears:
        assert layer.weight.numel() == 0  # the float weight is freed after quantizing
        # int4_pack's tiles of 32 output rows: 64 bytes per 4 input features (half a byte per weight),
        # the scales and mins in fp16 (quantize_int4 rounds them to fp16 values)
        assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (-(-layer.output_size // 32), layer.input_size // 4, 64)
        assert layer.weight_scale.dtype == layer.weight_min.dtype == torch.float16
    # Qwen2's tied LM head multiplies by an int8 copy; the input embedding keeps its float rows.
    head = model.lm_head
    assert head.qweight.dtype == torch.int8 and head.weight.numel() > 0
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_quantization_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"'fp8' is not supported yet; supported: int8, int4, w8a8, gguf"):
        LLM(quantization="fp8")
    with pytest.raises(ValueError, match=r"unknown quantization 'int3'; supported: int8, int4"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match=r"unknown quantization option\(s\) 'bits' for 'int4'; allowed: group_size, symmetric"):
        LLM(quantization="int4", quantization_options={"bits": 3})
    with pytest.raises(ValueError, match="allowed: none"):
        LLM(quantization="int8", quantization_options={"group_size": 32})
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        get_quantization_config("int4", {"group_size": 48}, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="runs on CPU only"):
        get_quantization_config("int8", None, torch.device("cuda"), torch.float16)


def test_cli_quantization_errors(capsys):
    from tokenmill.entrypoints.cli import main

    assert main(["generate", "hi", "--quantization", "fp8"]) != 0
    assert "'fp8' is not supported yet; supported: int8, int4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "-q", "int4", "--quantization-options", "{not json"])
    assert "not valid JSON" in capsys.readouterr().err


def test_perplexity_matches_hf(tiny_model_factory, hf_model_factory):
    """The perplexity bench's scoring (prompt logprobs through the engine) against HF's own loss."""
    name = "llama_gqa"
    llm = LLM(tiny_model_factory(name), dtype="float32", num_kv_blocks=64)
    ids = random_prompts([150], seed=9)[0]
    windows = window_token_ids(ids, 64)
    assert [len(w) for w in windows] == [64, 64, 22]
    result = score_windows(llm, windows)
    hf = hf_model_factory(name)
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = hf(torch.tensor([window])).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum").item()
            count += len(window) - 1
    assert result.tokens_scored == count
    assert result.mean_nll == pytest.approx(total / count, rel=1e-5)


@needs_kernels
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="the embedded SmolLM2 GGUF is not installed")
def test_smollm2_perplexity_cost_of_each_method():
    """On the first ~1,000 tokens of the shipped text. The GGUF's weights are Q4_1 (4 bits per group
    of 32), so int4 with groups of 32 keeps them almost exactly; larger groups requantize them."""
    from tokenmill.bench.perplexity import DEFAULT_TEXT

    text = DEFAULT_TEXT.read_text()[:4000]
    results = {}
    for label, method, options in (("float", None, None), ("int8", "int8", None), ("int4-g32", "int4", {"group_size": 32})):
        llm = LLM(dtype="float32", quantization=method, quantization_options=options, num_kv_blocks=128)
        results[label] = run_perplexity(llm, text, 256).perplexity
        del llm
    assert results["int8"] == pytest.approx(results["float"], rel=0.02), results
    assert results["int4-g32"] == pytest.approx(results["float"], rel=0.02), results
