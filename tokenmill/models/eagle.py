"""An EAGLE draft head (Li et al. 2024; EAGLE-1/2's checkpoint layout, yuhuili/EAGLE's `cnets.py`).

Row p of the draft reads the token at position p and the target's final hidden state at p - 1 (the
state its LM head turned into that token): `fc` maps their concatenation [embedding, state] (2 x
hidden) to hidden, then Llama decoder layers (the first without its input norm, as in EAGLE) give a
guess of the target's state at p, which the target's own LM head turns into the next token. The
draft's next row reads that token and that guess, so k chained rows draft k tokens. The embedding
and the LM head are the target's: the checkpoint holds only `fc` and the layers (an embed_tokens
copy in it is ignored), in the Llama module names (`layers.0.self_attn.q_proj.weight`, ...).

The layers are tokenmill's own Llama layers, with a paged KV cache of their own (the proposer's).

tokenmill's extension (what `tokenmill train-eagle` writes): a `draft_vocab` tensor in the checkpoint,
the token ids the draft may propose (the most frequent in the model's own text). The drafts' logits
then come from those rows of the LM head only: on a small model the vocabulary-sized LM head is much
of a draft pass's cost (a fifth of SmolLM2-135M's weights), and the rare tokens cut are rarely right.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.attention_metadata import BatchInputs
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import Linear
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM, decode_program_enabled, decode_program_group
from tokenmill.models.weights import load_named_weights


class EagleDraftModel(nn.Module):
    def __init__(self, ctx: ModelBuildContext, fc_bias: bool, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.draft_vocab = draft_vocab  # token ids the drafts may take (None: all)
        self.quantization = ctx.quant_config.name  # "none", or "int8": the proposer's draft-vocabulary head follows it
        config = ctx.hf_config
        self.hidden_size = config.hidden_size
        # tokenmill's Linear (not nn.Linear): its CPU method multiplies decode rows in dense_linear, where torch's
        # bf16 addmm took ~280 us a call for this 1,152 x 576 weight at a draft pass's few rows.
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias, ctx=ctx, prefix="fc")
        self.layers = nn.ModuleList(LlamaDecoderLayer(ctx, i, f"layers.{i}") for i in range(config.num_hidden_layers))
        # EAGLE's first layer reads fc's output as it is: fc already scales the two halves.
        self.layers[0].input_layernorm = nn.Identity()
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(config, head_dim, ctx.max_position or config.max_position_embeddings)
        self.use_decode_program = decode_program_enabled()  # as the target's (TOKENMILL_DECODE_PROGRAM=0: off)
        self.decode_steps: list | None = None  # the layers' plain_decode_step, built on the first plain decode batch

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        """The guessed target states [T, hidden] of rows reading these token embeddings [T, hidden] and
        the (target's or guessed) states of the positions before them [T, hidden]."""
        hidden = self.fc.forward(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        residual = None
        group = decode_program_group(batch, self.layers, self.use_decode_program)
        if group is not None:
            # Every draft pass is decode rows (a request's pending rows, then one row each): the layers' decode
            # program (models/llama.py), the same ops without forward's lookups and checks.
            if self.decode_steps is None:
                self.decode_steps = [layer.plain_decode_step(hidden.dtype) for layer in self.layers]
            for step in self.decode_steps:
                hidden, residual = step(hidden, residual, cos, sin, batch, group)
        else:
            for layer in self.layers:
                hidden, residual = layer.forward(hidden, residual, cos, sin, batch)
        return hidden + residual  # EAGLE-1/2 have no final norm: the target's LM head (after its norm) reads this

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, LlamaForCausalLM.packed_modules, ignore=("embed_tokens.", "rotary_emb.inv_freq"))
