"""What the front end and a replica process say to each other: pickled dataclasses over multiprocessing pipes.

Front end -> replica: AddRequest, AbortRequest, Shutdown (in order, on the replica's command pipe).
Replica -> front end: ReplicaReady once, then one ReplicaUpdate per turn of its loop, or ReplicaFatal
as its last word. The front end's pool adds ReplicaDied when a replica's process is gone.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.engine import EngineStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


# -- front end -> replica -------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt: Any  # PromptInput: text, token ids, or a dict with "prompt" / "prompt_token_ids"
    params: SamplingParams | BeamSearchParams
    arrival_time: float  # time.monotonic() when the front end got it (the clock is the machine's, not the process's)
    stream: bool = True  # every step's (cumulative) output; False: only the final one
    beam_search: bool = False


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    reason: str = "the front end asked"


# -- replica -> front end -------------------------------------------------------------------------
@dataclass
class ReplicaReady:
    max_model_len: int
    num_usable_blocks: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    stats: EngineStats


@dataclass
class ReplicaUpdate:
    """One turn of a replica's loop: the commands it took and the step it ran."""

    outputs: list[RequestOutput] = field(default_factory=list)
    num_outputs: int = 0  # outputs the step made, sent or not (the offline progress bar's rate)
    # A request make_request refused (InvalidRequestError: the same 400 as on one engine).
    rejected: list[tuple[str, BaseException]] = field(default_factory=list)
    # Requests whose step failed (RequestFailedError on one engine), with why.
    failed: list[tuple[list[str], str]] = field(default_factory=list)
    stats: EngineStats | None = None  # the engine's, at the end of the turn
    adds_taken: int = 0  # AddRequests taken so far, for the front end's count of requests on their way


@dataclass
class ReplicaFatal:
    """The replica's engine cannot go on (a bug, a dead tensor-parallel rank, a model that failed to load)."""

    error: BaseException


@dataclass
class ReplicaDied:
    """Made by the front end's pool, never sent: the replica's process is gone."""

    reason: str


def portable_error(exc: BaseException) -> BaseException:
    """exc itself if it survives a trip through pickle (tokenmill's errors with one message do), else a
    RuntimeError naming its type and message (an exception whose __init__ takes other arguments does not)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - anything pickle can raise
        return RuntimeError(f"{type(exc).__name__}: {exc}")
