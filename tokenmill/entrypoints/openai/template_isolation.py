"""Chat templates sent with requests, rendered in child processes that the OS bounds.

The render watchdog (render_limits.py) stops a template between two Python events, so it cannot stop a
single C-level operation: `'x' * 10**9`, a string doubled 31 times, `'x'|center(10**9)` each run to
their end, taking seconds and gigabytes of the server's memory. Templates that come with requests (only
with --trust-request-chat-template) are the request's own code, so they render in a child process with
an address-space limit (a memory bomb is a MemoryError there, a 400 here) and a deadline at which the
parent kills it. A runaway template costs one child, never the server's memory or its threads. The
model's own template (the operator's) keeps rendering in process, where it costs no IPC.

Children are spawned processes holding a copy of the tokenizer (its special tokens are the template's
variables, and apply_chat_template is the same code as in process). A child that failed a render is
replaced, so a fragmented or killed child never serves the next request.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import threading
import time
from typing import Any

from tokenmill.entrypoints.openai.errors import BadRequest, OpenAIError
from tokenmill.entrypoints.openai.render_limits import RenderCancelled, RenderLimits

logger = logging.getLogger(__name__)

DEFAULT_WORKERS = 2
# Memory a render may take above a child's idle footprint: a 4 Mi-character prompt needs a few tens of MB.
DEFAULT_MAX_RENDER_BYTES = 512 << 20
# Past the render time limit before the child is killed: its own watchdog normally stops it first.
KILL_GRACE_S = 1.0
# How long a render waits for a child that is still starting (importing, loading the tokenizer).
START_TIMEOUT_S = 120.0
POLL_S = 0.05


def _child_main(conn: Any, tokenizer_bytes: bytes, max_render_bytes: int) -> None:
    """A child's loop: (messages, kwargs) in, ("ok", text) or ("bad", message, param, spent) out; `spent`:
    the child should be replaced (it hit its memory limit, so its heap may stay large)."""
    import resource

    from tokenmill.entrypoints.openai.chat_utils import render_chat

    tokenizer = pickle.loads(tokenizer_bytes)
    del tokenizer_bytes
    with open("/proc/self/status") as f:
        vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm_size + max_render_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        conn.send(("ready",))
    except OSError:  # the server has gone (a BrokenPipeError)
        return
    while True:
        try:
            messages, kwargs = conn.recv()
        except (EOFError, OSError):  # the server has gone
            return
        try:
            reply: tuple = ("ok", render_chat(tokenizer, messages, **kwargs))
        except OpenAIError as exc:
            reply = ("bad", exc.message, exc.param, False)
        except MemoryError:
            reply = ("bad", "the chat template needed more memory than a render may take "
                            f"({max_render_bytes >> 20} MB)", "chat_template", True)
        except Exception as exc:  # noqa: BLE001 - the request's own code failed: its fault, said in one line
            reply = ("bad", f"the chat template could not render these messages: {exc or type(exc).__name__}",
                     "chat_template", False)
        del messages, kwargs
        conn.send(reply)


class _Child:
    def __init__(self, ctx: Any, tokenizer_bytes: bytes, max_render_bytes: int) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(child_conn, tokenizer_bytes, max_render_bytes),
                                   name="tokenmill-template", daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False

    def wait_ready(self, stop: threading.Event | None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready:
            if stop is not None and stop.is_set():
                raise RenderCancelled("the render was cancelled")
            if self.conn.poll(POLL_S):
                self.conn.recv()
                self.ready = True
            elif not self.process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"a chat-template process did not start (exit code {self.process.exitcode})")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class TemplateIsolation:
    """Renders request-supplied chat templates in `workers` child processes, each render within `limits`
    and `max_render_bytes` of memory; renders beyond `workers` at once wait for a free child."""

    def __init__(self, tokenizer: Any, limits: RenderLimits, workers: int = DEFAULT_WORKERS,
                 max_render_bytes: int = DEFAULT_MAX_RENDER_BYTES) -> None:
        self.limits = limits
        self.max_render_bytes = max_render_bytes
        self._tokenizer_bytes = pickle.dumps(tokenizer)
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._closed = False
        self._first = [self._spawn() for _ in range(workers)]
        for child in self._first:
            self._idle.put(child)

    def wait_ready(self) -> None:
        """Block until the first children have started (the server calls it before it reports healthy, so
        that no request's render time includes a child's start)."""
        for child in self._first:
            child.wait_ready(None)
        self._first = []

    def _spawn(self) -> _Child:
        return _Child(self._ctx, self._tokenizer_bytes, self.max_render_bytes)

    def _take(self, stop: threading.Event | None) -> _Child:
        while True:
            if stop is not None and stop.is_set():
                raise RenderCancelled("the render was cancelled")
            try:
                return self._idle.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def render(self, messages: list[dict[str, Any]], stop: threading.Event | None = None, **kwargs: Any) -> str:
        """render_chat(tokenizer, messages, **kwargs) in a child. Blocking: run it on a worker thread."""
        if self._closed:
            raise RuntimeError("the chat-template processes have been shut down")
        child = self._take(stop)
        reusable = False
        try:
            child.wait_ready(stop)
            child.conn.send((messages, {**kwargs, "limits": self.limits}))
            reply = self._wait(child, stop)
            if reply[0] == "ok":
                reusable = True
                return reply[1]
            reusable = not reply[3]
            raise BadRequest(reply[1], reply[2])
        finally:
            if reusable:
                self._idle.put(child)
            else:  # killed, died, or spent: a fresh child for the next render
                child.kill()
                threading.Thread(target=self._replace, name="tokenmill-template-spawn", daemon=True).start()

    def _replace(self) -> None:
        # Off the request's thread: Process.start blocks until the new child has read its arguments,
        # that is until it has imported this module (about a second; several on a busy machine).
        if self._closed:
            return
        child = self._spawn()
        if self._closed:
            child.kill()
        else:
            self._idle.put(child)

    def _wait(self, child: _Child, stop: threading.Event | None) -> tuple:
        max_seconds = self.limits.max_seconds
        deadline = None if max_seconds is None else time.monotonic() + max_seconds + KILL_GRACE_S
        while not child.conn.poll(POLL_S):
            if stop is not None and stop.is_set():
                raise RenderCancelled("the render was cancelled")
            if deadline is not None and time.monotonic() > deadline:
                raise BadRequest(f"the chat template took longer than {max_seconds:g} s to render "
                                 "(the server's --max-chat-template-render-seconds)", "chat_template")
            if not child.process.is_alive():
                break
        try:
            return child.conn.recv()
        except (EOFError, OSError):  # the child died mid-render: the OS stopped what the template did
            logger.warning("a chat-template process died while rendering (exit code %s)", child.process.exitcode)
            return ("bad", "the chat template's render was stopped: it took more memory or time than a render may take",
                    "chat_template", True)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
