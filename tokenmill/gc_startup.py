"""The cyclic garbage collector while a start-up imports the big libraries: paused, then what they made frozen.

`import torch` makes about 250,000 Python objects that live as long as the process (FastAPI and the API's
models 50,000 more). With the collector on, every few hundred new objects start a collection and every few
of those a full one that walks all of them: on the Zen 4 VM 0.25-0.3 s of the ~1.4 s `from tokenmill
import LLM` took, and 0.15-0.2 s more while `LLM()` built (its full collections walking torch's objects
again). Pausing the collector while they import and then `gc.freeze()` (CPython moves every object it
tracks into a permanent generation no collection walks) removes that, and shortens every later full
collection too, such as those a serving loop meets.

The price: frozen objects that are, or later become, garbage in a reference cycle are never freed (after
importing torch, ~7,000 objects already were: ~1 MB). So a block pauses and freezes only when its module
is not imported yet: once per process, not once per engine (a process building many engines, a test
suite, would otherwise freeze the engines it is done with, and their caches, whenever one is built); and
only where no engine is being built meanwhile (not the tokenizer's thread, which imports transformers
while `LLM()` builds the model: frozen, a model in a reference cycle was never freed after `del llm`).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def long_lived_import(module: str) -> Iterator[None]:
    """Run the block, which imports `module` first in this process, with the collector paused, then freeze.

    Nothing changes when `module` is already imported or the collector is already off (an outer block,
    or the caller's own choice, which is left as it was)."""
    if module in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


__all__ = ["long_lived_import"]
