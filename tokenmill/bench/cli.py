"""`tokenmill bench throughput | serve | latency` options. (Placeholder until the benchmarks land.)"""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, latency")
    bench.add_subparsers(dest="bench_command", required=True)
