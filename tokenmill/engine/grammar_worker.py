"""Grammar compilation in a child process: bounded in time, and out of the engine's way.

xgrammar compiles a constraint into a token-mask cache; for some schemas (a `"maxLength": 5000`
string, big repetition counts) that takes seconds of CPU, and a compile cannot be interrupted
inside the process. So compiles run in a child process that the engine can kill: a compile that
runs past its time limit is ended (the child is killed and started again on the next compile) and
the request gets a clear error naming the limit. The child runs at a lower CPU priority (nice), so
while it compiles the engine's forward passes keep the cores and other requests keep their pace.
The compiled grammar comes back serialized (xgrammar's own JSON format), a few MB, ~0.1 s.

Run as a script (`python grammar_worker.py`), not as `-m tokenmill...`: the child imports only
the standard library and xgrammar, not tokenmill and torch, so it starts in about a second.
The protocol on its stdin/stdout: length-prefixed pickles of plain tuples.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

_HEADER = struct.Struct("<Q")
_START_TIMEOUT = 60.0  # seconds for the child to import xgrammar and load the tokenizer info


@dataclass(frozen=True)
class CompileJob:
    """What to compile: kind is "json" (a JSON schema's text), "regex" or "grammar" (EBNF)."""

    kind: str
    text: str
    any_whitespace: bool = True
    strict_mode: bool = True


class GrammarCompileError(Exception):
    """xgrammar refused the constraint (its message, without xgrammar's source-location prefix)."""


class GrammarCompileTimeout(Exception):
    """The time limit passed: while compiling (the child was killed), or, with waited, while
    waiting for another request's compile to finish."""

    def __init__(self, waited: bool = False) -> None:
        super().__init__("waited for the grammar compiler" if waited else "the grammar compile timed out")
        self.waited = waited


class GrammarWorkerCrashed(Exception):
    """The child process died or could not start."""


def _write(fd: int, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """n bytes from fd; GrammarCompileTimeout past the deadline, GrammarWorkerCrashed at end of file."""
    chunks = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise GrammarCompileTimeout()
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise GrammarWorkerCrashed("the grammar compiler process exited")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None) -> object:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


class GrammarCompileWorker:
    """One child process that compiles grammars one at a time (callers queue on a lock)."""

    WALL_FACTOR = 10.0  # wall-clock bound, as a multiple of the CPU-time limit

    def __init__(self, tokenizer_info_json: str, *, max_threads: int = 2, niceness: int = 10) -> None:
        self._init = (tokenizer_info_json, max_threads, niceness)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.num_starts = 0

    def compile(self, job: CompileJob, timeout: float | None) -> str:
        """The serialized compiled grammar.

        timeout is CPU seconds of the compile: what a constraint costs, whatever else the machine
        is doing (the niced child runs slowly while the engine is busy, and that is no fault of the
        constraint). Waiting for the compiler (another request's compile) and the compile's wall
        time are bounded too, by WALL_FACTOR times that. GrammarCompileTimeout past a limit,
        GrammarCompileError if xgrammar refuses the constraint, GrammarWorkerCrashed if the child dies.
        """
        wall = None if timeout is None else timeout * self.WALL_FACTOR
        if not self._lock.acquire(timeout=-1 if wall is None else wall):
            raise GrammarCompileTimeout(waited=True)
        try:
            proc = self._ensure_started()
            try:
                # A plain tuple: the child must not import tokenmill to unpickle it.
                _write(proc.stdin.fileno(), ("compile", (job.kind, job.text, job.any_whitespace, job.strict_mode)))
                if timeout is not None:
                    self._wait_for_answer(proc, timeout, time.monotonic() + wall)
                status, payload = _read(proc.stdout.fileno(), None)
            except GrammarCompileTimeout:
                self._kill()
                raise
            except (GrammarWorkerCrashed, OSError) as exc:
                self._kill()
                raise GrammarWorkerCrashed(f"the grammar compiler process died while compiling ({exc})") from None
            if status == "error":
                raise GrammarCompileError(payload)
            return payload
        finally:
            self._lock.release()

    @staticmethod
    def _wait_for_answer(proc: subprocess.Popen, cpu_limit: float, wall_deadline: float) -> None:
        """Until the child has something to say; GrammarCompileTimeout once it has used cpu_limit
        CPU seconds on this compile, or at the wall deadline."""
        child = psutil.Process(proc.pid)
        times = child.cpu_times()
        start = times.user + times.system
        fd = proc.stdout.fileno()
        while not select.select([fd], [], [], 0.05)[0]:
            try:
                times = child.cpu_times()
            except psutil.Error:  # it died: reading tells why
                return
            if times.user + times.system - start > cpu_limit or time.monotonic() > wall_deadline:
                raise GrammarCompileTimeout()

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()  # one that exited: reap it
        self.num_starts += 1
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, close_fds=True,
        )
        try:
            _write(self._proc.stdin.fileno(), self._init)
            ready = _read(self._proc.stdout.fileno(), time.monotonic() + _START_TIMEOUT)
        except (GrammarCompileTimeout, GrammarWorkerCrashed, OSError) as exc:
            self._kill()
            raise GrammarWorkerCrashed(f"the grammar compiler process did not start ({type(exc).__name__})") from None
        if ready != "ready":
            self._kill()
            raise GrammarWorkerCrashed(f"the grammar compiler process did not start: {ready}")
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            stream.close()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# ---------------------------------------------------------------- the child


def _compile(compiler, job: tuple[str, str, bool, bool]):
    kind, text, any_whitespace, strict_mode = job
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace, strict_mode=strict_mode)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _main() -> None:
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr  # anything printed goes to the log, not into the protocol
    tokenizer_info_json, max_threads, niceness = _read(stdin, None)
    try:
        os.nice(niceness)
    except OSError:
        pass
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    except Exception as exc:  # noqa: BLE001 - told to the parent
        _write(stdout, f"{type(exc).__name__}: {exc}")
        return
    _write(stdout, "ready")
    while True:
        try:
            _, job = _read(stdin, None)
        except GrammarWorkerCrashed:  # the parent closed the pipe: done
            return
        try:
            result = ("ok", _compile(compiler, job).serialize_json())
        except Exception as exc:  # noqa: BLE001 - the constraint is invalid: told to the parent
            result = ("error", str(exc))
        _write(stdout, result)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules must not shadow anything xgrammar imports
    _main()
