"""Engine configuration: one dataclass per concern, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers.kv_quant import check_kv_cache_dtype
from tokenmill.layers.quantization import check_quantization
from tokenmill.spec_decode.tree import MAX_TREE_NODES, TokenTree

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return dev


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX): then bf16 matmuls run about 2x
    faster than float32. Read from /proc/cpuinfo; elsewhere assume not."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = handle.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """'auto' takes the checkpoint's dtype on a GPU; on a CPU, bfloat16 where the CPU has native bf16
    (as vLLM's CPU backend does) and float32 elsewhere. float32 is what matches HF transformers bit for bit."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            resolved = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        else:
            resolved = checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {resolved} is not supported; use float32, bfloat16 or float16")
    if device.type == "cuda" and resolved == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bfloat16; use dtype='float16'")
    return resolved


@dataclass
class ModelConfig:
    model: str | None = None  # HF folder or .gguf file; None means the embedded default model
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: str = "auto"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    skip_tokenizer_init: bool = False
    seed: int = 0
    # Weights quantized at load: None (the model dtype), "int8" (W8A16) or "int4" (W4A16, group-wise);
    # quantization_options: int4's {"group_size": 128, "symmetric": False}.
    quantization: str | None = None
    quantization_options: dict | None = None

    def __post_init__(self) -> None:
        check_quantization(self.quantization, self.quantization_options)


@dataclass
class CacheConfig:
    block_size: int = 16
    # The KV budget: an explicit byte count wins; otherwise a fraction of the free
    # memory of the device (GPU memory, or available RAM on a CPU).
    kv_cache_memory: int | None = None
    memory_fraction: float | None = None  # default: 0.9 on GPU (minus weights), 0.25 on CPU
    num_kv_blocks: int | None = None  # exact block count, for tests and experiments
    # The part of the memory-derived budget (memory_fraction, or the CPU default) this engine takes: 1/N for
    # each of N data-parallel replicas sharing one machine's RAM, set by their pool (kv_cache_memory and
    # num_kv_blocks are per engine as given).
    memory_share: float = 1.0
    # What the KV cache stores (vLLM's names): "auto" (the model's dtype), "int8" (per (token, KV head)
    # scales), "fp8" / "fp8_e4m3" / "fp8_e5m2" (a per-tensor scale); see layers/kv_quant.py.
    kv_cache_dtype: str = "auto"
    # Automatic prefix caching: full blocks are hashed and reused by later requests with the same prefix.
    enable_prefix_caching: bool = True
    # Cascade attention: decodes whose contexts start with the same cached blocks read that shared prefix
    # once per step for all of them (worker/batch.py decides when it pays), not once per request.
    cascade_attention: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 < self.memory_share <= 1.0:
            raise ValueError(f"memory_share must be in (0, 1], got {self.memory_share}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (block 0 is reserved), got {self.num_kv_blocks}")
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass
class SchedulerConfig:
    # Token budget of one engine step. 4096, vLLM's CPU default: workload C (64 x 1,056 tokens over a shared
    # 1,024-token prefix) prefills in one step instead of two and ran 1.055-1.08x faster on tiny100m (bf16,
    # Zen 5, alternating runs: 1,120 / 1,159 / 1,148 against 1,088 / 1,085 / 1,122 output tok/s), B 1.04x,
    # A and C-nocache the same.
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256  # running requests at most
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    # Tensor parallelism: each layer split over this many ranks (processes), which all-reduce per layer.
    tensor_parallel_size: int = 1
    # Data parallelism: this many engine replicas, each with its share of the cores (or its own GPU).
    data_parallel_size: int = 1
    # Where the ranks run: "uni" (this process; one rank only), "mp" (one spawned process per extra
    # rank, the default for several), "ray" (Ray actors, on an existing Ray cluster or a local one).
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError('distributed_executor_backend "uni" runs one rank; tensor_parallel_size > 1 needs "mp" or "ray"')

    @property
    def executor_backend(self) -> str:
        """The backend that runs the ranks: as given, else "uni" for one rank and "mp" for several."""
        return self.distributed_executor_backend or ("uni" if self.tensor_parallel_size == 1 else "mp")


@dataclass
class StructuredOutputsConfig:
    # Seconds a grammar may take to compile (in a child process that is killed past it); the
    # request then fails with an error naming this limit. None: no limit.
    grammar_compile_timeout: float | None = 10.0
    # Compiled grammars kept for reuse by later requests with the same constraint (LRU, by bytes).
    grammar_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.grammar_compile_timeout is not None and not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be a positive number of seconds or None, got {self.grammar_compile_timeout}")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "medusa", "eagle")
TREE_METHODS = ("medusa", "eagle")  # proposers that draft token trees
# vLLM's names for proposers tokenmill does not run yet: refused by name rather than as unknown.
_SPECULATIVE_NOT_YET = ("eagle3", "mtp")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer guesses up to num_speculative_tokens
    next tokens per request, and one forward pass of the model verifies them all."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram (prompt lookup): the longest suffix of prompt + output between these lengths that occurs earlier.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No proposals while this many requests or more run: verification only pays at small batches.
    disable_by_batch_size: int | None = 8
    # draft_model: the draft's folder or .gguf file, or "self" for the target's own weights, and the
    # draft's weight quantization ("self" defaults to int4 in groups of 32: a quantized copy of the target as its draft).
    # medusa: the Medusa heads' folder (FasterDecoding's layout, or what `tokenmill train-medusa` writes).
    # eagle: the EAGLE draft head's folder (EAGLE-1/2's layout, or what `tokenmill train-eagle` writes); quantization
    # "int8": the head's layers and its draft-vocabulary rows of the LM head in int8 (CPU), fewer bytes a draft pass.
    model: str | None = None
    quantization: str | None = None
    quantization_options: dict | None = None
    # medusa, eagle: a token tree instead of a chain (spec_decode/tree.py), verified in one pass with tree
    # attention (eagle's branch off its top-1 chain only).
    # tree: Medusa's `medusa_choices`, paths of candidate ranks ([0] head 1's top-1, [0, 1] head 2's second
    # choice after it); its depth is num_speculative_tokens. tree_width: the top-1 chain of
    # num_speculative_tokens with the next tree_width - 1 candidates beside it at every depth (1: a chain).
    tree: list[list[int]] | None = None
    tree_width: int | None = None
    # eagle: the draft's own confidence decides, per request and step, how much of the chain or tree is
    # verified (EAGLE-2's observation: the draft's probability of a path predicts well whether the model
    # keeps it). A draft is verified only where the draft's probability of the path to it (the product of
    # its probabilities along the way) is at least min_draft_probability; no further draft pass runs once
    # the top-1 chain's probability is below stop_draft_probability. 0: every node, every pass.
    min_draft_probability: float = 0.0
    stop_draft_probability: float = 0.0

    def __post_init__(self) -> None:
        if self.method in _SPECULATIVE_NOT_YET:
            raise ValueError(f"speculative method {self.method!r} is not supported yet; supported: {', '.join(SPECULATIVE_METHODS)}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; supported: {', '.join(SPECULATIVE_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 or None, got {self.disable_by_batch_size}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError('speculative method "draft_model" needs "model": a draft model\'s folder or .gguf file, or "self"')
            if self.model == "self" and self.quantization is None:
                # int4: the fastest quantized copy as a draft on every CPU path measured (README, speculative decoding).
                self.quantization = "int4"
            if self.model == "self" and self.quantization == "int4" and not self.quantization_options:
                # Group 32: the closest int4 copy (group 128 costs SmolLM2 far more perplexity; see the README).
                self.quantization_options = {"group_size": 32}
            check_quantization(self.quantization, self.quantization_options)
        elif self.method in ("medusa", "eagle"):
            if not self.model:
                what = "the Medusa heads' folder (`tokenmill train-medusa`" if self.method == "medusa" else "the EAGLE head's folder (`tokenmill train-eagle`"
                raise ValueError(f'speculative method "{self.method}" needs "model": {what} makes one)')
            if self.method == "medusa" and (self.quantization is not None or self.quantization_options is not None):
                raise ValueError('"quantization" belongs to the draft_model and eagle methods, not "medusa"')
            if self.method == "eagle" and (self.quantization not in (None, "none", "int8") or self.quantization_options is not None):
                raise ValueError(f'"quantization" of an EAGLE head is "int8" (its layers and draft-vocabulary rows, a scale '
                                 f'per output channel) or none, without options; got {self.quantization!r}'
                                 + (f" with {self.quantization_options!r}" if self.quantization_options is not None else ""))
        elif self.model is not None or self.quantization is not None or self.quantization_options is not None:
            raise ValueError(f'"model" and "quantization" belong to the draft_model, medusa and eagle methods, not {self.method!r}')
        if (self.tree is not None or self.tree_width is not None) and self.method not in TREE_METHODS:
            raise ValueError(f'"tree" and "tree_width" belong to the {" and ".join(TREE_METHODS)} method(s), not {self.method!r}')
        if self.tree is not None and self.tree_width is not None:
            raise ValueError('give "tree" or "tree_width", not both')
        if self.tree_width is not None and (not isinstance(self.tree_width, int) or isinstance(self.tree_width, bool)
                                            or not 1 <= self.tree_width * self.num_speculative_tokens <= MAX_TREE_NODES):
            raise ValueError(f"tree_width must be an integer >= 1 with tree_width * num_speculative_tokens <= {MAX_TREE_NODES}, "
                             f"got {self.tree_width!r}")
        if self.tree is not None and (tree := TokenTree.from_paths(self.tree)).depth != self.num_speculative_tokens:
            raise ValueError(f"the tree is {tree.depth} deep, so it verifies up to {tree.depth} tokens: set num_speculative_tokens "
                             f"to {tree.depth} or leave it out")
        for name in ("min_draft_probability", "stop_draft_probability"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
            if value and self.method != "eagle":
                raise ValueError(f'"{name}" belongs to the eagle method, not {self.method!r}')
        if self.tree is not None and self.method == "eagle" and any(r for path in tree.paths for r in path[:-1]):
            raise ValueError("an eagle tree branches off the top-1 chain only (its draft passes follow that chain): every "
                             f"path is [0, ..., 0, r], got {self.tree!r}")

    def token_tree(self) -> TokenTree | None:
        """The static token tree the proposer fills each step, or None for a chain."""
        if self.tree is not None:
            tree = TokenTree.from_paths(self.tree)
        elif self.tree_width is not None:
            tree = TokenTree.of_width(self.num_speculative_tokens, self.tree_width)
        else:
            return None
        return None if tree.is_chain else tree

    @classmethod
    def from_dict(cls, values: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """vLLM's dict spelling; unknown keys are an error naming the allowed ones."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; allowed: {', '.join(cls.__dataclass_fields__)}")
        if values.get("tree") is not None and "num_speculative_tokens" not in values:
            values = {**values, "num_speculative_tokens": TokenTree.from_paths(values["tree"]).depth}
        return cls(**values)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    device: str = "auto"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (the LLM(...) and CLI spelling); unknown names are an error."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                 "structured_outputs": StructuredOutputsConfig}
        values: dict[str, dict] = {name: {} for name in parts}
        device = kwargs.pop("device", "auto")
        speculative = SpeculativeConfig.from_dict(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            for name, klass in parts.items():
                if key in klass.__dataclass_fields__:
                    values[name][key] = value
                    break
            else:
                allowed = sorted(f for klass in parts.values() for f in klass.__dataclass_fields__) + ["device", "speculative_config"]
                raise TypeError(f"unknown engine argument {key!r}; allowed: {', '.join(allowed)}")
        return cls(**{name: klass(**values[name]) for name, klass in parts.items()}, speculative=speculative, device=device)
