"""The CUDA path against HF transformers on the same GPU: greedy token equality at float32, batches
and prefix-cache hits that change nothing, bf16 within the CPU tests' tolerance, seeded sampling
that repeats, speculative decoding (n-gram, a draft model, Medusa and EAGLE heads, chains and trees)
that keeps the outputs, and clear errors for what runs on CPU only. Marked `gpu` and skipped without CUDA (CI has none).
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_MODELS, hf_greedy, random_prompts, tokenmill_logits
from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Lengths as in test_models.py: 1 token, exactly two blocks of 4, odd, longer than the token budget.
PROMPT_LENGTHS = [1, 8, 13, 70]
MAX_NEW = 16
SMALL = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=512)


def cuda_llm(path: str, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(model=path, dtype=dtype, device="cuda", **{**SMALL, **kwargs})


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    params = params or SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


@pytest.fixture(scope="module")
def hf_cuda(tiny_model_factory):
    """hf_cuda(name, dtype) -> the transformers model on the GPU (eager attention), loaded once."""
    cache: dict = {}

    def get(name: str, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        if (name, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(name), dtype=dtype, attn_implementation="eager")
            cache[name, dtype] = model.to("cuda").eval()
        return cache[name, dtype]

    return get


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_greedy_matches_hf_on_cuda(name, tiny_model_factory, hf_cuda):
    """Every architecture, the prompts batched together: each request's greedy tokens equal HF's on the GPU."""
    llm = cuda_llm(tiny_model_factory(name))
    assert llm.llm_engine.executor.driver_runner.device.type == "cuda"
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    for prompt, got in zip(prompts, generate(llm, prompts)):
        assert got == hf_greedy(hf_cuda(name), prompt, MAX_NEW), f"{name}: prompt of {len(prompt)} tokens"


def test_batch_and_prefix_hits_change_nothing_on_cuda(tiny_model_factory, hf_cuda):
    """12 requests sharing a 24-token prefix, in one batch and then again from the prefix cache: HF's tokens both times."""
    prefix = random_prompts([24], seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 46, 1, 17, 30, 8, 39, 2, 21, 12, 44, 5], seed=21)]
    llm = cuda_llm(tiny_model_factory("llama_gqa"), max_num_batched_tokens=32)
    first = generate(llm, prompts)
    again = generate(llm, prompts)
    want = [hf_greedy(hf_cuda("llama_gqa"), p, MAX_NEW) for p in prompts]
    assert first == want
    assert again == want


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "gpt2"])
def test_bf16_logits_close_to_hf_on_cuda(name, tiny_model_factory, hf_cuda):
    """The CPU test's bf16 tolerance (test_models.py): no further from HF float32 than HF bf16 (1.5x + 1e-3),
    within 5% of the logit range of HF bf16, and the same argmax wherever HF's top-2 margin is clear."""
    prompt = random_prompts([40], seed=5)[0]
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        ref32 = hf_cuda(name)(ids).logits[0].float()
        ref16 = hf_cuda(name, torch.bfloat16)(ids).logits[0].float()
    llm = cuda_llm(tiny_model_factory(name), dtype="bfloat16", num_kv_blocks=32)
    got = tokenmill_logits(llm, prompt, chunk=16)
    assert got.device.type == "cuda"
    assert (got - ref32).abs().mean().item() <= 1.5 * (ref16 - ref32).abs().mean().item() + 1e-3
    bound = 0.05 * ref32.abs().max().item()
    assert (got - ref16).abs().max().item() <= bound
    top2 = ref16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert torch.equal(got.argmax(-1)[clear], ref16.argmax(-1)[clear])


def test_seeded_sampling_repeats_on_cuda(tiny_model_factory):
    """Sampling with a seed gives the same tokens twice, and n=3 gives three samples, on the GPU."""
    llm = cuda_llm(tiny_model_factory("llama_gqa"))
    prompts = random_prompts([5, 30], seed=2)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    assert generate(llm, prompts, params) == generate(llm, prompts, params)
    outs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs) == 3


def test_ngram_speculation_keeps_greedy_tokens_on_cuda(tiny_model_factory):
    """n-gram drafts verified on the GPU: the tokens greedy decoding gives without them."""
    prompts = [p * 3 for p in random_prompts([6, 9], seed=4)]  # repeats for the n-gram proposer to find
    plain = generate(cuda_llm(tiny_model_factory("llama_gqa")), prompts)
    spec = cuda_llm(tiny_model_factory("llama_gqa"), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert generate(spec, prompts) == plain


def test_draft_model_keeps_greedy_tokens_on_cuda(tiny_model_factory):
    """A separate draft model (its own paged KV cache under the target's block tables) on the GPU."""
    from test_spec_decode import assert_greedy_matches_plain_decoding

    draft = {"method": "draft_model", "model": tiny_model_factory("llama_mqa_tied"), "num_speculative_tokens": 3,
             "disable_by_batch_size": None}
    llm = assert_greedy_matches_plain_decoding(tiny_model_factory("llama_gqa"), draft, device="cuda")
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0


@pytest.mark.parametrize("tree", [{}, {"tree_width": 3, "num_speculative_tokens": 3}])
def test_medusa_chains_and_trees_keep_the_outputs_on_cuda(tiny_model_factory, tmp_path, tree):
    """Medusa heads, chain and tree (tree attention on the PyTorch path), in the CPU tests' mixed batch:
    greedy, seeded sampling and n > 1, prompt chunks, preemption and a shared prefix."""
    from test_medusa import heads_folder, medusa_config, model_dims, random_heads, target_lm_head
    from test_spec_tree import assert_tree_mixed_batch_matches_plain_decoding

    folder = tiny_model_factory("llama_gqa")
    hidden, vocab = model_dims(folder)
    heads = heads_folder(tmp_path, random_heads(hidden, vocab, num_heads=4, lm_head=target_lm_head(folder)))
    _, llm, _ = assert_tree_mixed_batch_matches_plain_decoding(folder, {**medusa_config(heads, k=3), **tree}, device="cuda")
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [{}, {"tree_width": 3, "num_speculative_tokens": 3},
                                  # draft confidence: thresholds a random head's drafts pass at some steps only
                                  {"tree_width": 3, "num_speculative_tokens": 3, "min_draft_probability": 0.002,
                                   "stop_draft_probability": 0.004}])
def test_eagle_chains_and_trees_keep_the_outputs_on_cuda(tiny_model_factory, tmp_path, tree):
    """An EAGLE head (two layers, fed the target's hidden states) on the GPU, in the same mixed batch."""
    from test_eagle import eagle_config, head_folder, random_head
    from test_spec_tree import assert_tree_mixed_batch_matches_plain_decoding

    folder = tiny_model_factory("llama_gqa")
    heads = head_folder(tmp_path, random_head(folder, num_layers=2))
    assert_tree_mixed_batch_matches_plain_decoding(folder, {**eagle_config(heads, k=3), **tree}, device="cuda")


@pytest.mark.parametrize("kwargs,names", [
    (dict(quantization="int8"), "CPU only"),
    (dict(kv_cache_dtype="int8"), "CPU only"),
    (dict(speculative_config={"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 3}),
     "CPU only"),
])
def test_cpu_only_features_are_clear_errors_on_cuda(kwargs, names, tiny_model_factory):
    with pytest.raises(ValueError, match=names):
        cuda_llm(tiny_model_factory("llama_gqa"), **kwargs)


@pytest.mark.parametrize("name", ["llama3_rope", "qwen2"])
def test_gguf_on_cuda_gives_the_cpu_tokens(name, tmp_path, tiny_model_factory):
    """A Q8_0 GGUF (llama3's rope_freqs tensor for the Llama) loads onto the GPU and decodes the greedy
    tokens the CPU gives (both float32)."""
    from gguf import GGMLQuantizationType

    from test_loader import write_gguf

    path = str(write_gguf(tiny_model_factory(name), tmp_path / f"{name}.gguf", quant=GGMLQuantizationType.Q8_0))
    prompts = random_prompts([6, 45], seed=31)
    cpu = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, **SMALL)
    assert generate(cuda_llm(path, skip_tokenizer_init=True), prompts) == generate(cpu, prompts)
