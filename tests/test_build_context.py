"""Models are built from one ModelBuildContext: every linear layer, embedding and LM head gets its
prefix (its name in the model), asks the quantization config for its method by that prefix, and
loads through per-parameter weight loaders that follow the method's own layout (output_dim), so a
fused QKV or gate-up projection loads shard by shard whatever the format."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import random_prompts
from tokenmill.config import ModelConfig
from tokenmill.engine.messages import ScheduledChunk
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantization import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedConfig,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)
from tokenmill.loader import build_model, load_model_source
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.batch import build_batch_inputs
from tokenmill.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
ARCHS = ["llama_gqa", "qwen2", "qwen3", "gpt2", "llama_mqa_tied"]


class TransposedLinearMethod(LinearMethodBase):
    """A stand-in for a quantized layout: the weight stored [in, out] (output channels on dim 1),
    so loading a fused layer's shards must follow the parameter's output_dim."""

    def create_weights(self, layer, input_size, output_sizes, weight_loader):
        layer.weight = nn.Parameter(torch.empty(input_size, sum(output_sizes)), requires_grad=False)
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: weight_loader(param, loaded.t(), shard_id)
        layer.weight.output_dim = 1

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight.t(), bias)


class RecordingConfig(QuantizationConfig):
    """Transposed layout for every linear layer but the ones named in `keep`; records every prefix it is asked for."""

    def __init__(self, keep: tuple[str, ...] = ()) -> None:
        self.keep = keep
        self.linear_prefixes: list[str] = []
        self.embedding_prefixes: list[str] = []

    def linear_method(self, prefix):
        self.linear_prefixes.append(prefix)
        return UnquantizedLinearMethod() if prefix.endswith(self.keep or ("\0",)) else TransposedLinearMethod()

    def embedding_method(self, prefix):
        self.embedding_prefixes.append(prefix)
        return UnquantizedEmbeddingMethod()


def logits(model: nn.Module, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, CPU, torch.float32, 16)
    runner.allocate_kv_cache(1 + -(-len(tokens) // 16))
    chunk = ScheduledChunk(request_id="x", token_ids=tokens, start_pos=0, block_ids=list(range(1, 1 + -(-len(tokens) // 16))),
                           sample=False, sampling_params=SamplingParams(), sampling_seed=0, output_index=0)
    batch = build_batch_inputs([chunk], 16, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


def build(folder: str, quant_config: QuantizationConfig | None = None) -> nn.Module:
    source = load_model_source(ModelConfig(model=folder))
    return build_model(source, CPU, torch.float32, 128, quant_config)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_layer_knows_its_prefix_and_asks_the_config_for_its_method(tiny_model_factory, arch):
    config = RecordingConfig()
    model = build(tiny_model_factory(arch), config)
    named = {name: m for name, m in model.named_modules() if isinstance(m, (Linear, VocabEmbedding, LMHead))}
    assert named and all(m.prefix == name for name, m in named.items())
    linears = sorted(name for name, m in named.items() if isinstance(m, Linear))
    assert sorted(config.linear_prefixes) == linears
    embeddings = sorted(name for name, m in named.items() if not isinstance(m, Linear))
    assert sorted(config.embedding_prefixes) == embeddings and "lm_head" in embeddings


@pytest.mark.parametrize("arch", ARCHS)
def test_a_per_layer_method_with_its_own_layout_loads_fused_shards_and_computes_the_same(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    tokens = random_prompts([37], seed=1)[0]
    reference = logits(build(folder), tokens)
    # Every linear layer but the attention output projection in the transposed layout.
    keep = ("o_proj", "attn.c_proj")
    config = RecordingConfig(keep=keep)
    model = build(folder, config)
    methods = {name: type(m.method) for name, m in model.named_modules() if isinstance(m, Linear)}
    assert {t for n, t in methods.items() if n.endswith(keep)} == {UnquantizedLinearMethod}
    assert {t for n, t in methods.items() if not n.endswith(keep)} == {TransposedLinearMethod}
    torch.testing.assert_close(logits(model, tokens), reference, rtol=1e-5, atol=1e-5)


def test_the_default_config_prepacks_only_where_it_pays():
    # float32 on any CPU oneDNN runs on; the input embedding never (it only gathers rows).
    onednn = torch.backends.mkldnn.is_available()
    assert UnquantizedConfig(CPU, torch.float32).prepack == onednn
    head = UnquantizedConfig(CPU, torch.float32).embedding_method("lm_head")
    assert isinstance(head, UnquantizedEmbeddingMethod) and head.prepack == onednn
    assert not UnquantizedConfig(CPU, torch.float32).embedding_method("model.embed_tokens").prepack
