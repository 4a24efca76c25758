"""Time and output limits on a chat-template render (Jinja code, run on a worker thread).

A Python thread cannot be killed, so the render stops itself. For its duration the rendering thread
runs under a trace function (sys.settrace) that sees every Python call and every line of the compiled
template: Jinja compiles a template to Python code whose file name is "<template>", so a template loop
produces line events even when it calls nothing. Every CHECK_EVERY events the tracer checks the deadline
and a stop flag (set when the client has gone); on every yield of the template's root function it
counts the characters written. Past a limit it raises, which unwinds the render at once and frees the
thread; the thread's previous trace function is restored afterwards.

A long render also yields the GIL at each check (after NICE_AFTER_S). A thread that runs pure Python
holds the GIL for the whole switch interval (5 ms) whenever another thread asks for it; the engine loop
and the HTTP thread ask for it hundreds of times per step (after every torch call), so without the
yield a runaway template slows every other request several times over while it runs.

What this cannot stop: a single C-level operation (one enormous string repetition) runs to its end
before the next event. So request-supplied templates, refused unless the operator trusts them
(--trust-request-chat-template), render in child processes the OS bounds (template_isolation.py).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

DEFAULT_MAX_RENDER_SECONDS = 5.0
DEFAULT_MAX_OUTPUT_CHARS = 4 << 20  # 4 Mi characters: a prompt of about a million tokens or more

# Events between two looks at the clock: a tight template loop makes about one event per microsecond.
CHECK_EVERY = 256
# A render running longer than this sleeps briefly at each check, so that threads waiting for the GIL get
# it at once. A chat template's usual render (well under a millisecond) never does.
NICE_AFTER_S = 0.01
GIL_YIELD_S = 5e-5

_TEMPLATE_FILENAME = "<template>"  # what Jinja compiles a template from a string under
_ROOT = "root"  # the compiled template's top-level generator: its yields are the whole output

T = TypeVar("T")


@dataclass(frozen=True)
class RenderLimits:
    max_seconds: float | None = DEFAULT_MAX_RENDER_SECONDS  # None: no time limit
    max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS  # None: no size limit


class RenderLimitExceeded(Exception):
    """A render went past a limit; the message names the limit and the server option that sets it."""


class RenderCancelled(Exception):
    """The render was stopped because nobody waits for it any more."""


class _Stop(BaseException):
    """Raised inside the render. A BaseException, so that no `except Exception` in Jinja or transformers
    catches it: the trace function is removed when it raises, so the first raise has to unwind."""


class _Watchdog:
    """The trace function of one render on the current thread."""

    def __init__(self, limits: RenderLimits, stop: threading.Event | None) -> None:
        self.limits = limits
        self.stop = stop
        self.start = time.monotonic()
        self.deadline = None if limits.max_seconds is None else self.start + limits.max_seconds
        self.max_chars = limits.max_output_chars
        self.chars = 0
        self.countdown = CHECK_EVERY
        self.reason: Exception | None = None  # why the render was stopped

    def on_call(self, frame: FrameType, event: str, arg: Any):
        """The global trace function: called for every Python frame the render enters (or resumes)."""
        self.countdown -= 1
        if self.countdown <= 0:
            self._check()
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            return self.on_template_event
        return None  # no line events outside the template: they would cost time and tell nothing

    def on_template_event(self, frame: FrameType, event: str, arg: Any):
        """The local trace function of template frames: lines, and returns (a yield is a return event)."""
        if event == "return" and type(arg) is str and self.max_chars is not None and frame.f_code.co_name == _ROOT:
            self.chars += len(arg)
            if self.chars > self.max_chars:
                self._fail(RenderLimitExceeded(
                    f"the chat template wrote more than {self.max_chars} characters "
                    "(the server's --max-chat-template-output-chars)"
                ))
        self.countdown -= 1
        if self.countdown <= 0:
            self._check()
        return self.on_template_event

    def _check(self) -> None:
        self.countdown = CHECK_EVERY
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            self._fail(RenderLimitExceeded(
                f"the chat template took longer than {self.limits.max_seconds:g} s to render "
                "(the server's --max-chat-template-render-seconds)"
            ))
        if self.stop is not None and self.stop.is_set():
            self._fail(RenderCancelled("the render was cancelled"))
        if now - self.start > NICE_AFTER_S:
            time.sleep(GIL_YIELD_S)  # a sleep releases the GIL; sleep(0) would take it straight back

    def _fail(self, reason: Exception) -> None:
        self.reason = reason
        raise _Stop


def run_limited(render: Callable[[], T], limits: RenderLimits, stop: threading.Event | None = None) -> T:
    """render() on this thread within the limits; RenderLimitExceeded (or RenderCancelled once `stop` is
    set) when it goes past them. The output-size limit counts what a Jinja template's root writes."""
    if limits.max_seconds is None and limits.max_output_chars is None and stop is None:
        return render()
    watchdog = _Watchdog(limits, stop)
    previous = sys.gettrace()
    sys.settrace(watchdog.on_call)
    try:
        result = render()
    except _Stop:
        assert watchdog.reason is not None
        raise watchdog.reason from None
    finally:
        sys.settrace(previous)
    if watchdog.reason is not None:  # stopped, but something in between swallowed the stop
        raise watchdog.reason
    return result
