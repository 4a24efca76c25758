"""The Llama family's decode program (models/llama.py: batches of plain decodes on the CPU kernels, with
every layer's lookups done once) computes exactly what the layers' forward computes: the same tokens and
the same logprobs, bit for bit, for each variant the program binds (GQA and MQA, biases, sliding windows,
q/k norms, bf16, quantized linears, a quantized KV cache, speculative rows), and those batches take it;
its one op for a layer's attention (decode_attention_block) equals the ops it stands for."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from conftest import random_prompts
from test_gguf_quantization import mixed_type
from test_loader import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu
from tokenmill.layers.kv_quant import KVScales

pytestmark = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

# (tiny model, LLM options, whether the C++ decode program takes its batches: not with q/k norms (Qwen3)).
CASES = {
    "llama_gqa": ("llama_gqa", {}, True),
    "llama_mqa_tied bf16": ("llama_mqa_tied", {"dtype": "bfloat16"}, True),
    "llama_bias": ("llama_bias", {}, True),
    "mistral_swa": ("mistral_swa", {}, True),
    "qwen2_mixed_swa": ("qwen2_mixed_swa", {}, True),
    "qwen3": ("qwen3", {}, False),
    "int8": ("llama_gqa", {"quantization": "int8"}, True),
    "int4 g32": ("llama_gqa", {"quantization": "int4", "quantization_options": {"group_size": 32}}, True),
    "int4 g32 bf16": ("llama_gqa", {"quantization": "int4", "quantization_options": {"group_size": 32}, "dtype": "bfloat16"}, True),
    "w8a8": ("llama_gqa", {"quantization": "w8a8"}, True),
    # The norms quantize qkv_proj's and gate_up_proj's input (bias: qkv's bias in the quantized-input GEMM).
    "w8a8 bf16 bias per token": ("llama_bias", {"quantization": "w8a8", "dtype": "bfloat16",
                                                "quantization_options": {"activation_group_size": 0}}, True),
    "kv int8": ("llama_gqa", {"kv_cache_dtype": "int8"}, True),
    "kv fp8": ("llama_gqa", {"kv_cache_dtype": "fp8"}, True),
    "ngram drafts": ("llama_gqa", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}, True),
}


class _CountedRuns:
    """A C++ decode program's stand-in that counts its runs."""

    def __init__(self, program) -> None:
        self.program, self.runs, self.tree_runs = program, 0, 0

    def run(self, *args):
        self.runs += 1
        self.tree_runs += args[-2] is not None  # tree_start: a token tree's rows in the batch
        return self.program.run(*args)


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_program_computes_what_forward_does(llm: LLM, native: bool, num_prompts: int = 3) -> _CountedRuns | None:
    """The C++ decode program (where native), the Python one and the layers' forward give the same tokens and
    logprobs, and plain decode batches take the programs; returns the C++ program's run counts (where native)."""
    model = llm.llm_engine.executor.driver_runner.model.model
    # Repeating prompts, so n-gram lookup finds drafts; three requests, so decode batches have several rows. No
    # prefix caching: the second run computes its prompts as the first did.
    prompts = [p * 3 for p in random_prompts([1, 5, 7], seed=3)][:num_prompts]
    with_program = _run(llm, prompts)
    assert model.decode_program is not None, "plain decode batches did not take the decode program"
    assert (model.native_decode is not None) == native
    if native:
        counted = model.native_decode.program = _CountedRuns(model.native_decode.program)
        assert _run(llm, prompts) == with_program
        assert counted.runs > 0, "plain decode batches did not take the C++ decode program"
        model.use_native_decode = False
        runs = counted.runs
        assert _run(llm, prompts) == with_program  # the Python decode program
        assert counted.runs == runs
    model.use_decode_program = False
    assert _run(llm, prompts) == with_program
    return counted if native else None


@pytest.mark.parametrize("case", CASES)
def test_decode_program_computes_what_forward_does(case, tiny_model_factory):
    name, options, native = CASES[case]
    _assert_program_computes_what_forward_does(
        LLM(model=tiny_model_factory(name), **{"dtype": "float32", "block_size": 4, "num_kv_blocks": 256, "enable_prefix_caching": False, **options}),
        native)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_program_takes_token_trees(dtype, tiny_model_factory, tmp_path):
    """Medusa token trees' verifying passes (the tree's rows with their masks) take the C++ program, with the same
    tokens and logprobs as the layers' forward (plain rows beside tree rows: test_decode_attention_block_is_its_parts)."""
    from test_medusa import heads_folder, model_dims, random_heads, target_lm_head

    folder = tiny_model_factory("llama_gqa")
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, num_heads=3, lm_head=target_lm_head(folder)))
    # One request and a 4-node tree: 5 rows, within what dense_linear (and so the C++ program) takes on every CPU.
    spec = {"method": "medusa", "model": heads, "tree_width": 2, "num_speculative_tokens": 2, "disable_by_batch_size": None}
    llm = LLM(model=folder, dtype=dtype, num_kv_blocks=64, enable_prefix_caching=False, speculative_config=spec)
    counted = _assert_program_computes_what_forward_does(llm, native=True, num_prompts=1)
    assert counted.tree_runs > 0, "no tree verification took the C++ program"


@pytest.mark.parametrize("quant,native", [(mixed_type, False), (QT.Q8_0, True)], ids=["mixed", "Q8_0"])
def test_decode_program_on_packed_gguf(quant, native, tiny_model_factory, tmp_path, monkeypatch):
    """A GGUF kept packed: Q4_0 / Q4_1 / Q8_0 tiles, where a fused QKV of two types keeps two parts (the general
    path, so the Python program only); all Q8_0, every layer one tiled kernel (the C++ program too)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_factory("llama_gqa"), tmp_path / "packed.gguf", quant=quant)
    _assert_program_computes_what_forward_does(LLM(str(path), quantization="gguf", dtype="float32", skip_tokenizer_init=True,
                                                   block_size=4, num_kv_blocks=256, enable_prefix_caching=False), native=native)


def test_decode_program_off_by_environment(tiny_model_factory, monkeypatch):
    """TOKENMILL_DECODE_PROGRAM=0: every batch through the layers' forward (the program's baseline)."""
    monkeypatch.setenv("TOKENMILL_DECODE_PROGRAM", "0")
    llm = LLM(model=tiny_model_factory("llama_gqa"), dtype="float32", num_kv_blocks=64)
    _run(llm, random_prompts([5], seed=4))
    assert llm.llm_engine.executor.driver_runner.model.model.decode_program is None


def test_native_decode_program_follows_new_caches(tiny_model_factory):
    """Caches bound anew after the C++ program was built (it holds the old ones): it is built again on them."""
    llm = LLM(model=tiny_model_factory("llama_gqa"), dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    model = llm.llm_engine.executor.driver_runner.model.model
    prompts = random_prompts([5, 7], seed=5)
    want = _run(llm, prompts)
    first = model.native_decode
    llm.llm_engine.executor.driver_runner.allocate_kv_cache(64)
    assert _run(llm, prompts) == want
    assert model.native_decode is not first and model.native_decode.k_cache is model.layers[0].self_attn.attn.k_cache


def test_native_decode_program_off_by_environment(tiny_model_factory, monkeypatch):
    """TOKENMILL_DECODE_PROGRAM=python: the Python decode program, not the C++ one."""
    monkeypatch.setenv("TOKENMILL_DECODE_PROGRAM", "python")
    llm = LLM(model=tiny_model_factory("llama_gqa"), dtype="float32", num_kv_blocks=64)
    model = llm.llm_engine.executor.driver_runner.model.model
    assert not model.use_native_decode
    _run(llm, random_prompts([5], seed=4))
    assert model.decode_program is not None


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.int8), (torch.float32, torch.float8_e4m3fn)], ids=str)
def test_decode_attention_block_is_its_parts(dtype, cache_dtype, window, tree):
    """decode_attention_block (the program's one op for a layer's attention) equals rotary, the KV write and
    paged_decode_attention called one after another, bit for bit, caches and scales included, and with a token
    tree's rows (tree_start / tree_mask) as well."""
    gen = torch.Generator().manual_seed(0)
    T, H, Hkv, D, NB, BS = 3, 4, 2, 64, 8, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    angles = torch.rand(T, D // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=1).to(dtype), torch.cat([angles.sin()] * 2, dim=1).to(dtype)
    caches = [(torch.randn(Hkv, NB, BS, D, generator=gen) * 0.5).to(cache_dtype) for _ in range(2)]
    scales = KVScales.allocate(cache_dtype, (Hkv, NB, BS, D), torch.device("cpu"))
    block_table = torch.tensor([[1, 2], [3, 4], [5, 6]])
    positions = torch.tensor([4, 7, 2])  # the context is 0..position: the new token at slot block_table[pos // BS] * BS + pos % BS
    # Row 1 a tree node whose tree starts at slot 5 and that sees slots 5 and 7 (itself), not 6: depth 2, so at
    # position 6 (tree_start - 1 + depth), its token in slot 7; the others plain.
    tree_args = (torch.tensor([5, 5, 3]), torch.tensor([0, 0b101, 0])) if tree else (None, None)
    in_table = positions.clone()  # each row's own slot, as an index into its block table
    if tree:
        positions = torch.tensor([4, 6, 2])
    slots = block_table.gather(1, (in_table // BS)[:, None]).squeeze(1) * BS + in_table % BS
    rows = torch.arange(T)

    def run(fused: bool):
        q_k_v, (k_cache, v_cache) = qkv.clone(), [c.clone() for c in caches]
        k_scale, v_scale = (None, None) if scales is None else (scales.k.clone(), scales.v.clone())
        ops = torch.ops.tokenmill_cpu
        if fused:
            out = ops.decode_attention_block(q_k_v, H, Hkv, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, rows, block_table,
                                             positions, window, D**-0.5, *tree_args)
        else:
            q, k, v = (t.view(T, -1, D) for t in q_k_v.split([H * D, Hkv * D, Hkv * D], dim=1))
            ops.rotary(q, k, cos, sin)
            if scales is None:
                ops.write_kv(k_cache, v_cache, k, v, slots)
            else:
                ops.write_kv_quantized(k_cache, v_cache, k_scale, v_scale, k, v, slots)
            out = q.new_empty(q.shape)
            ops.paged_decode_attention(out, q.contiguous(), k_cache, v_cache, rows, block_table, positions, window, D**-0.5, k_scale, v_scale,
                                       0, None, None, *tree_args)
            out = out.view(T, H * D)
        return out, q_k_v, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale

    for got, want in zip(run(True), run(False)):
        assert (got is None and want is None) or torch.equal(got, want)
