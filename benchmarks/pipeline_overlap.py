"""What the async engine's output pipeline saves: detokenization on its own thread vs inline.

Runs the same streaming workload through AsyncLLMEngine twice per round, in one process:
pipeline=True (the output thread detokenizes while the engine thread runs the next forward
pass; prompts are tokenized on worker threads) and pipeline=False (the engine thread does it
all, one after the other). Every request streams to its own asyncio consumer, as the server's
clients do. Reports the median output tokens/s of each and their ratio.

    python benchmarks/pipeline_overlap.py --num-requests 32 --output-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine

WORDS = "the of and to in is was for on that with as by at from his her an which it be are this".split()


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def run_once(engine: AsyncLLMEngine, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    async def one(i: int, prompt: str) -> int:
        tokens = 0
        async for out in engine.generate(prompt, params, f"req-{i}-{time.monotonic_ns()}"):
            tokens = len(out.outputs[0].token_ids)
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, sum(counts)


async def main_async(args: argparse.Namespace) -> None:
    config = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype)
    engines = {}
    for pipeline in (True, False):
        engine = AsyncLLMEngine(config, pipeline=pipeline)
        await engine.start()
        engines[pipeline] = engine
    prompts = make_prompts(args.num_requests, args.prompt_words, seed=0)
    # A stop string that never matches still makes the detokenizer check every new piece of text.
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, stop=["@@@never@@@"])
    for engine in engines.values():  # warm-up
        await run_once(engine, prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))
    rates: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(args.rounds):
        for pipeline in (True, False) if round_index % 2 == 0 else (False, True):
            elapsed, tokens = await run_once(engines[pipeline], prompts, params)
            rates[pipeline].append(tokens / elapsed)
            print(f"round {round_index} pipeline={pipeline}: {tokens} tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} tok/s")
    for engine in engines.values():
        await engine.shutdown()
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"\nmedian output tok/s: pipeline {on:.1f}, inline {off:.1f}, ratio {on / off:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
