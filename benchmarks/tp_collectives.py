"""Latency of tensor parallelism's collectives between two ranks on this machine: gloo (TCP) against the
shared-memory path (tokenmill/distributed/shm_collectives.py), for the shapes a step all-reduces
(one decode row, a batch of decodes, a prompt chunk) at the default model's hidden size.

    python benchmarks/tp_collectives.py [--hidden 576] [--iters 300]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch

from tokenmill.distributed.communicator import join_tensor_parallel
from tokenmill.executor.tensor_parallel import cpu_share, free_port, pin_process


def run(rank: int, port: int, shm: bool, hidden: int, iters: int, queue) -> None:
    pin_process(cpu_share(rank, 2))
    comm = join_tensor_parallel(rank, 2, "127.0.0.1", port, torch.device("cpu"), 120.0, same_machine=shm)
    results = {}
    for rows in (1, 32, 512):
        x = torch.randn(rows, hidden)
        times = []
        for i in range(iters + 20):
            start = time.perf_counter()
            comm.all_reduce(x)
            if i >= 20:
                times.append(time.perf_counter() - start)
        results[f"all_reduce {rows}x{hidden}"] = statistics.median(times) * 1e6
    times = []
    for i in range(iters + 20):
        start = time.perf_counter()
        comm.broadcast_object(("forward", "target", list(range(64))) if rank == 0 else None)
        if i >= 20:
            times.append(time.perf_counter() - start)
    results["broadcast of a step's message"] = statistics.median(times) * 1e6
    if rank == 0:
        queue.put(results)
    comm.close()


def measure(shm: bool, hidden: int, iters: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, port, shm, hidden, iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    gloo = measure(False, args.hidden, args.iters)
    shm = measure(True, args.hidden, args.iters)
    print(f"{'median latency, 2 ranks':34} {'gloo (us)':>10} {'shared memory (us)':>19} {'ratio':>7}")
    for name in gloo:
        print(f"{name:34} {gloo[name]:10.1f} {shm[name]:19.1f} {gloo[name] / shm[name]:6.1f}x")
    print(f"cores: {sorted(os.sched_getaffinity(0))}")


if __name__ == "__main__":
    main()
