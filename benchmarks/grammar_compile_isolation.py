"""How much slow grammar compiles slow down a concurrent plain stream (AsyncLLMEngine, in process).

One plain greedy request of --tokens tokens is streamed alone, then again while --compiles
requests with a slow-to-compile JSON schema (a string with "maxLength": 5000, each a different
schema so none is cached) are submitted at the same time. Reported per round: the stream's wall
time, its largest gap between two tokens, and what the constrained requests got (their errors
when they ran past --grammar-compile-timeout). Medians over --rounds, alone and loaded, in one run.

    python benchmarks/grammar_compile_isolation.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.sampling_params import StructuredOutputsParams


async def stream(engine: AsyncLLMEngine, request_id: str, tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = last = time.perf_counter()
    gap = 0.0
    async for _ in engine.generate("Tell me a story about a lighthouse keeper.", params, request_id):
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return last - start, gap


async def constrained(engine: AsyncLLMEngine, request_id: str, salt: int) -> str:
    schema = {"type": "object", "properties": {f"field{salt}": {"type": "string", "maxLength": 5000}}}
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema))
    try:
        async for _ in engine.generate("Answer in JSON.", params, request_id):
            pass
    except Exception as exc:  # noqa: BLE001 - reported, as a client would see it
        return type(exc).__name__
    return "ok"


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig.from_kwargs(dtype=args.dtype, max_model_len=512, kv_cache_memory=64 << 20,
                                      grammar_compile_timeout=args.grammar_compile_timeout)
    engine = AsyncLLMEngine(config)
    await engine.start()
    try:
        await stream(engine, "warmup", 8)
        await constrained(engine, "warmup-grammar", -1)  # starts the compiler process
        alone, loaded = [], []
        for r in range(args.rounds):
            alone.append(await stream(engine, f"alone-{r}", args.tokens))
            jobs = [constrained(engine, f"g-{r}-{i}", r * 100 + i) for i in range(args.compiles)]
            (wall, gap), *results = await asyncio.gather(stream(engine, f"loaded-{r}", args.tokens), *jobs)
            loaded.append((wall, gap))
            print(f"round {r}: alone {alone[-1][0]:.2f} s (max gap {alone[-1][1] * 1000:.0f} ms), "
                  f"with {args.compiles} compiles {wall:.2f} s (max gap {gap * 1000:.0f} ms); constrained: {results}")
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        print(f"median: alone {med(alone, 0):.2f} s, max gap {med(alone, 1) * 1000:.0f} ms; "
              f"loaded {med(loaded, 0):.2f} s, max gap {med(loaded, 1) * 1000:.0f} ms; "
              f"slowdown {med(loaded, 0) / med(alone, 0):.2f}x")
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--compiles", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--grammar-compile-timeout", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
