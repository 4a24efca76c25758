"""HF `architectures` name -> model class."""

from __future__ import annotations

from torch import nn

from tokenmill.errors import UnsupportedArchitectureError
from tokenmill.models.gpt2 import GPT2LMHeadModel
from tokenmill.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(config) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    architectures = [architectures] if isinstance(architectures, str) else list(architectures)
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(
        f"model architecture {architectures or '(none given in config.json)'} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
