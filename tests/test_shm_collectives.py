"""The shared-memory collectives of tensor parallelism on one machine, between two real processes: sums
bit-identical on both ranks and equal to the plain sum, tensors larger than a slot in pieces, gather and
broadcast, and a peer that dies is an error, not a hang."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from tokenmill.distributed.shm_collectives import PeerGoneError, SharedMemoryCollectives

SLOT = 4096  # bytes: small, so that most tensors below go through in several pieces


def attach(path: str, rank: int, create: bool) -> SharedMemoryCollectives:
    if not create:
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
    shm = SharedMemoryCollectives(path, rank, 2, SLOT, create=create, timeout_s=60)
    return shm


def rank_main(path: str, rank: int, pids, results) -> None:
    shm = attach(path, rank, create=False)
    shm.peer_pids = {0: pids[0]}
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = tensor_of(rank, dtype, (37, 300))  # 44 KB in float32: 11 pieces
        out[str(dtype)] = shm.all_reduce(x).float().numpy()  # exact for bf16 too; numpy crosses the queue plainly
    shm.gather(tensor_of(rank, torch.float32, (5, 700)))
    out["broadcast"] = shm.broadcast_bytes(None)
    results.put(out)
    shm.close()


def tensor_of(rank: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(dtype)


def test_all_reduce_gather_and_broadcast_between_two_processes(tmp_path):
    path = str(tmp_path / "shm")
    shm = attach(path, 0, create=True)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    peer = ctx.Process(target=rank_main, args=(path, 1, {0: os.getpid()}, results))
    peer.start()
    shm.peer_pids = {1: peer.pid}
    try:
        mine = {}
        for dtype in (torch.float32, torch.bfloat16):
            mine[str(dtype)] = shm.all_reduce(tensor_of(0, dtype, (37, 300)))
            expected = tensor_of(0, dtype, (37, 300)) + tensor_of(1, dtype, (37, 300))
            assert torch.equal(mine[str(dtype)], expected)
        gathered = shm.gather(tensor_of(0, torch.float32, (5, 700)))
        assert torch.equal(gathered[1], tensor_of(1, torch.float32, (5, 700)))
        payload = os.urandom(3 * SLOT + 17)
        assert shm.broadcast_bytes(payload) == payload
        theirs = results.get(timeout=60)
    finally:
        peer.join(30)
        shm.unlink()
        shm.close()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(torch.from_numpy(theirs[str(dtype)]), mine[str(dtype)].float())  # bit-identical on both ranks
    assert theirs["broadcast"] == payload
    assert not os.path.exists(path)


def sleeper(path: str) -> None:
    SharedMemoryCollectives(path, 1, 2, SLOT, create=False, timeout_s=60)
    time.sleep(60)


def test_a_peer_that_dies_is_an_error_within_a_second_or_two(tmp_path):
    path = str(tmp_path / "shm")
    shm = attach(path, 0, create=True)
    peer = multiprocessing.get_context("spawn").Process(target=sleeper, args=(path,))
    peer.start()
    shm.peer_pids = {1: peer.pid}
    time.sleep(0.5)
    peer.kill()
    start = time.monotonic()
    with pytest.raises(PeerGoneError, match="rank 1"):
        shm.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5
    peer.join(5)
    shm.unlink()
    shm.close()


def test_a_peer_the_executor_knows_has_failed_is_an_error_within_a_second_or_two(tmp_path):
    """A Ray rank that failed leaves its actor's process running: the executor's word ends the wait."""
    shm = attach(str(tmp_path / "shm"), 0, create=True)
    shm.peer_failure = lambda: "tensor-parallel rank 1 (a Ray actor) failed: boom"
    start = time.monotonic()
    with pytest.raises(PeerGoneError, match="rank 1 .* failed: boom"):
        shm.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5
    shm.unlink()
    shm.close()
