"""tokenmill: a small, fast LLM inference engine."""

from tokenmill.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import tokenmill`
    # and `tokenmill --help` stay fast.
    if name == "LLM":
        from tokenmill.gc_startup import long_lived_import

        # torch and the engine's code (gc_startup); before the engine's module is imported, no engine exists to be frozen.
        with long_lived_import("tokenmill.engine.engine"):
            from tokenmill.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "__version__",
]
