"""Tensor parallelism's process group: the collectives the layers run, over torch.distributed."""
