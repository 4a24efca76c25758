"""The Llama family from one implementation: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention import Attention, CpuPagedAttention
from tokenmill.layers.build_context import ModelBuildContext, join_prefix
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantization.smoothquant import SmoothingPair
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.weights import load_named_weights
from tokenmill.layers.attention_metadata import AttentionGroup, BatchInputs

# "0": every batch through the layers' forward; "python": the Python decode program only (no C++ one).
DECODE_PROGRAM_ENV = "TOKENMILL_DECODE_PROGRAM"


@dataclass
class NativeDecodeProgram:
    """The C++ decode program (kernels/cpu/decode_program.cpp) with what decides when it runs: batches of up
    to max_rows rows; built again if the runner binds other caches than those it holds."""

    program: torch.ScriptObject
    max_rows: int
    k_cache: torch.Tensor  # layer 0's, as registered


def decode_program_enabled() -> bool:
    """Whether decode programs may run (DECODE_PROGRAM_ENV not "0")."""
    return os.environ.get(DECODE_PROGRAM_ENV, "1") != "0"


def decode_program_group(batch: BatchInputs, layers: nn.ModuleList, enabled: bool) -> AttentionGroup | None:
    """The batch's plain decode group (BatchInputs.plain_decode_group) when a decode program of these layers
    may run it: enabled, and the layers on the CPU kernels' attention; None otherwise."""
    if not enabled or layers[0].self_attn.attn.backend is not CpuPagedAttention:
        return None
    return batch.plain_decode_group()


def sliding_window_for_layer(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, ctx: ModelBuildContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        config = ctx.hf_config
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = config.model_type == "qwen2"  # Qwen2: bias on q/k/v only
        self.qkv_proj = QKVLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=attention_bias or is_qwen2,
                                  ctx=ctx, prefix=join_prefix(prefix, "qkv_proj"))
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=attention_bias and not is_qwen2, ctx=ctx,
                                        prefix=join_prefix(prefix, "o_proj"), input_slice=self.qkv_proj.heads.input_slice(self.head_dim))
        self.q_norm = self.k_norm = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, sliding_window_for_layer(config, layer_idx)
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        # Submodules' forward is called directly on this hot path: nn.Module.__call__'s hook checks cost
        # ~1.5 us a call, ~0.5 ms a token on SmolLM2's 30 layers at one row (nothing hooks these modules).
        q, k, v = self.qkv_proj.forward(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        out = self.attn.forward(q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v, batch)
        return self.o_proj.forward(out)


class LlamaMLP(nn.Module):
    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        config = ctx.hf_config
        if config.hidden_act != "silu":
            raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported for {config.model_type}; only 'silu'")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                         ctx=ctx, prefix=join_prefix(prefix, "gate_up_proj"))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, ctx=ctx,
                                           prefix=join_prefix(prefix, "down_proj"))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))  # (forward: see LlamaAttention)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: ModelBuildContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        config = ctx.hf_config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(ctx, layer_idx, join_prefix(prefix, "self_attn"))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(ctx, join_prefix(prefix, "mlp"))

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, batch: BatchInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream before it) -> the same after this layer. The residual add
        happens inside the next norm (one fused op on CPU), as in vLLM."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden, residual = self.post_attention_layernorm.forward(self.self_attn.forward(hidden, cos, sin, batch), residual)
        return self.mlp.forward(hidden), residual

    def plain_decode_step(self, dtype: torch.dtype) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """forward for a batch of plain decodes in dtype on the CPU kernels (LlamaModel's decode program), with
        every weight, size and kernel looked up once: step(hidden, residual, cos, sin, batch, group). The same
        calls in the same order as forward, so the same numbers; where qkv_proj or gate_up_proj takes its
        input quantized (w8a8), the norm before it quantizes in the same op (the same bits)."""
        attn, mlp = self.self_attn, self.mlp
        qkv = norm_then_linear(self.input_layernorm, attn.qkv_proj, dtype)
        gate_up = norm_then_linear(self.post_attention_layernorm, mlp.gate_up_proj, dtype)
        o_proj, down = attn.o_proj.decode_call(), mlp.down_proj.decode_call()
        sizes, num_heads, num_kv_heads, head_dim = attn.qkv_proj.output_sizes, attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_norm, k_norm, attention = attn.q_norm, attn.k_norm, attn.attn
        silu_and_mul = torch.ops.tokenmill_cpu.silu_and_mul.default  # resolved once (kernels/cpu.py's wrappers resolve it per call)

        def step(hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, batch: BatchInputs,
                 group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                residual, qkv_out = hidden, qkv(hidden, None)
            else:
                qkv_out = qkv(hidden, residual)
            if q_norm is None:  # rotary, the KV write and the attention in one op
                out = attention.plain_decode_qkv(qkv_out, cos, sin, batch, group)
            else:
                q, k, v = qkv_out.split(sizes, dim=-1)
                tokens = q.shape[0]
                q, k = apply_rotary(q_norm(q.view(tokens, num_heads, head_dim)), k_norm(k.view(tokens, num_kv_heads, head_dim)), cos, sin)
                out = attention.plain_decode(q, k, v.view(tokens, num_kv_heads, head_dim), batch, group)
            return down(silu_and_mul(gate_up(o_proj(out), residual))), residual

        return step

    def add_to_native_program(self, program: torch.ScriptObject, dtype: torch.dtype) -> int | None:
        """Registers this layer's plain_decode_step (its q/k-norm-free path) with the C++ decode program for
        activations in dtype: returns the rows up to which its kernels are that step's, or None (nothing
        registered) where a linear layer has no single kernel op or the attention normalizes q and k."""
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is not None or not isinstance(self.input_layernorm, RMSNorm):
            return None
        # qkv_proj and gate_up_proj take their input quantized by the norm before them where both can (w8a8).
        fused = [attn.qkv_proj.quantized_input(dtype), mlp.gate_up_proj.quantized_input(dtype)]
        if any(f is None for f in fused) or fused[0].group_size != fused[1].group_size:
            fused = [None, None]
        calls = [attn.qkv_proj.decode_kernel(dtype) if fused[0] is None else fused[0].kernel, attn.o_proj.decode_kernel(dtype),
                 mlp.gate_up_proj.decode_kernel(dtype) if fused[1] is None else fused[1].kernel, mlp.down_proj.decode_kernel(dtype)]
        if any(call is None for call in calls):
            return None
        indices = []
        for call in calls:
            tensors = [a for a in call.args if isinstance(a, torch.Tensor)]
            ints = [a for a in call.args if isinstance(a, int)]
            pattern = "".join("T" if isinstance(a, torch.Tensor) else "I" if isinstance(a, int) else "D" if isinstance(a, torch.dtype) else "N"
                              for a in call.args)  # D: the output dtype, always the program's
            indices.append(program.add_linear(call.op, tensors, ints, pattern, dtype))
        attention, scales = attn.attn, attn.attn.kv_scales
        program.add_layer(self.input_layernorm.weight, self.input_layernorm.eps, self.post_attention_layernorm.weight,
                          self.post_attention_layernorm.eps, *indices, attention.num_heads, attention.num_kv_heads, attention.k_cache,
                          attention.v_cache, None if scales is None else scales.k, None if scales is None else scales.v,
                          attention.sliding_window or 0, attention.scale, -1 if fused[0] is None else fused[0].group_size)
        return min((call.max_rows for call in calls if call.max_rows is not None), default=1 << 30)


def norm_then_linear(norm: nn.Module, linear: Linear, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """(x, residual) -> linear(norm(residual + x)) with the residual stream updated in place, or (x, None) ->
    linear(norm(x)), for a decode program in dtype: one op for the norm and the linear layer's activation
    quantize where the layer takes its input quantized (Linear.quantized_input), the same bits as apart.
    A norm that is nn.Identity (an EAGLE head's first layer, models/eagle.py; never with a residual) passes x on."""
    if not isinstance(norm, RMSNorm):
        call = linear.decode_call()
        return lambda x, residual: call(x)
    weight, eps, ops = norm.weight, norm.eps, torch.ops.tokenmill_cpu  # the ops' overloads, resolved once
    quantized = linear.quantized_input(dtype)
    if quantized is not None:
        norm_quant, group_size, gemm = ops.w8a8_rms_norm_quant.default, quantized.group_size, quantized.apply
        return lambda x, residual: gemm(*norm_quant(x, residual, weight, eps, group_size))
    call = linear.decode_call()
    rms_norm, add_rms_norm = ops.rms_norm.default, ops.add_rms_norm.default
    return lambda x, residual: call(rms_norm(x, weight, eps) if residual is None else add_rms_norm(residual, x, weight, eps))


class LlamaModel(nn.Module):
    def __init__(self, ctx: ModelBuildContext, prefix: str = "model") -> None:
        super().__init__()
        config = ctx.hf_config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx=ctx, prefix=join_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(ctx, i, join_prefix(prefix, f"layers.{i}")) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        # One rotary table for all layers; cos/sin are gathered once per forward.
        self.rotary_emb = RotaryEmbedding(config, head_dim, ctx.max_position or config.max_position_embeddings, ctx.rope_freq_factors)
        # See forward; TOKENMILL_DECODE_PROGRAM=0 runs every batch through the layers' forward, =python keeps the
        # C++ program off (to measure the programs).
        self.use_decode_program = decode_program_enabled()
        self.use_native_decode = os.environ.get(DECODE_PROGRAM_ENV, "1") != "python"
        self.decode_program: list[Callable] | None = None
        self.native_decode: NativeDecodeProgram | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        residual = None
        group = decode_program_group(batch, self.layers, self.use_decode_program)
        if group is not None:
            # A decode program: each layer's forward with its lookups done once (built on the first such
            # batch, after the weights are loaded and processed) and its attention in one op. SmolLM2 (30
            # layers), one request, Zen 5, bf16: 8.19 -> 6.83 ms a token against forward's module calls,
            # attribute lookups and checks (benchmarks/decode_program.py).
            if self.decode_program is None:
                self.decode_program = [layer.plain_decode_step(hidden.dtype) for layer in self.layers]
                self.native_decode = self._native_decode_program(hidden.dtype)
            native = self.native_decode
            if native is not None and native.k_cache is not self.layers[0].self_attn.attn.k_cache:
                native = self.native_decode = self._native_decode_program(hidden.dtype)  # the runner bound new caches
            if native is not None and self.use_native_decode and hidden.shape[0] <= native.max_rows:
                # All layers in one call: the same ops in the same order, without Python between them.
                token_rows, query_pos = group.decode_rows_and_positions()
                hidden, residual = native.program.run(hidden, cos, sin, batch.slot_mapping, token_rows, group.block_table, query_pos,
                                                      group.tree_start, group.tree_mask)
            else:
                for step in self.decode_program:
                    hidden, residual = step(hidden, residual, cos, sin, batch, group)
        else:
            for layer in self.layers:
                hidden, residual = layer.forward(hidden, residual, cos, sin, batch)  # (forward: see LlamaAttention)
        return self.norm(hidden, residual)[0]

    def _native_decode_program(self, dtype: torch.dtype) -> NativeDecodeProgram | None:
        """The C++ decode program of every layer, or None where a layer cannot be in it (see
        LlamaDecoderLayer.add_to_native_program)."""
        program, max_rows = torch.classes.tokenmill_cpu.DecodeProgram(), 1 << 30
        for layer in self.layers:
            rows = layer.add_to_native_program(program, dtype)
            if rows is None:
                return None
            max_rows = min(max_rows, rows)
        return NativeDecodeProgram(program, max_rows, self.layers[0].self_attn.attn.k_cache)


class LlamaForCausalLM(nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        config = self.config = ctx.hf_config
        self.model = LlamaModel(ctx, "model")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ctx=ctx, prefix="lm_head", tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits; with tensor parallelism on rank 0 only (None on the others)."""
        return self.lm_head(hidden)

    def smoothing_pairs(self) -> list[SmoothingPair]:
        """Where SmoothQuant's factors fold (layers/quantization/smoothquant.py): qkv_proj's and gate_up_proj's
        input into the norm before each, down_proj's into up_proj's output channels (the second half of
        gate_up_proj's rows, and of its bias)."""
        pairs = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            gate, up = mlp.gate_up_proj.output_sizes
            up_sources = [mlp.gate_up_proj.weight.data[gate:gate + up]]
            if mlp.gate_up_proj.bias is not None:
                up_sources.append(mlp.gate_up_proj.bias.data[gate:gate + up])
            pairs += [SmoothingPair((layer.input_layernorm.weight.data,), attn.qkv_proj),
                      SmoothingPair((layer.post_attention_layernorm.weight.data,), mlp.gate_up_proj),
                      SmoothingPair(tuple(up_sources), mlp.down_proj)]
        return pairs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        ignore = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())
        load_named_weights(self, weights, self.packed_modules, ignore)
