"""ModelRunner: owns the model and its KV memory; turns scheduled chunks into sampled tokens."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.layers.attention import Attention
from tokenmill.worker.batch import BatchInputs
from tokenmill.worker.sampler import Sampler, SamplingMetadata


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.num_blocks = 0

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's K and V once: [num_blocks, block_size, num_kv_heads, head_dim].

        Zeroed, so never-written slots (the null block, a block's unfilled tail) hold finite
        values: attention masks them, and 0 * garbage could otherwise be NaN.
        """
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = self._zeros(shape)
            layer.v_cache = self._zeros(shape)
        self.num_blocks = num_blocks

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        # numpy's zeros comes from calloc: the OS hands out zero pages lazily, so a large
        # cache costs no start-up time and RAM is only touched as blocks get used.
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        raw = np.zeros(shape, dtype={2: np.int16, 4: np.int32}[itemsize])
        return torch.from_numpy(raw).view(self.dtype)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        """One forward pass over the mixed batch; a sampled token for each chunk that ends its request's tokens."""
        batch = BatchInputs.build(chunks, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        sampling_chunks = [c for c in chunks if c.sample]
        if not sampling_chunks:
            return [None] * len(chunks)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        tokens = iter(self.sampler(logits, SamplingMetadata.from_chunks(sampling_chunks, self.device)).tolist())
        return [next(tokens) if c.sample else None for c in chunks]
