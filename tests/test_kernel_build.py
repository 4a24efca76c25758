"""The CPU kernels' build: an interrupted or concurrent start never wedges the next one.

Every start runs in a subprocess against a temporary TORCH_EXTENSIONS_DIR, so the real cache is
never touched, and under a timeout, so a regression (a start waiting forever on a lock) fails the
test instead of hanging the suite. One real build is shared by the module; the other scenarios copy
it, or hold the build lock from a small process of their own, and never compile again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill.kernels import cpu

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None or shutil.which("ninja") is None, reason="building the CPU kernels needs c++ and ninja"
)

BUILD_TIMEOUT_S = 240  # one real build takes 15-60 s on a small machine
START_TIMEOUT_S = 120  # a start that finds a finished build, or only has to run ninja over up-to-date objects

# One start: load the kernels, report what came of it as JSON on stdout, its log on stderr.
START = r"""
import json, logging, os, sys, time
from pathlib import Path

args = sys.argv[1:]
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
if "--signal-waiting" in args:  # tell the lock holder of the test that this start is waiting on it
    signal_path = Path(args[args.index("--signal-waiting") + 1])

    class Signal(logging.Handler):
        def emit(self, record):
            if "waiting for another process" in record.getMessage():
                signal_path.touch()

    logging.getLogger("tokenmill").addHandler(Signal())
import torch
if "--no-cpp-extension" in args:  # a start that tries to build fails: it must load the published library
    sys.modules["torch.utils.cpp_extension"] = None
from tokenmill.kernels import cpu

result = cpu.load_cpu_kernels()
out = dict(
    available=result.available, compiled=result.compiled, seconds=result.seconds, error=result.error,
    path=str(result.path) if result.path else None, kernels_available=cpu.cpu_kernels_available(),
)
if result.available:
    x, w = torch.randn(5, 96), torch.randn(96)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    out["rms_norm_error"] = (torch.ops.tokenmill_cpu.rms_norm(x, w, 1e-6) - want).abs().max().item()
print(json.dumps(out))
"""

# Holds the build lock as a building process does, with the debris a build cut short leaves (torch's
# `lock` file, a half-copied library); optionally waits for a start to wait on it, then publishes a library.
HOLD = r"""
import fcntl, os, shutil, sys, time
from pathlib import Path

directory, hold_s = Path(sys.argv[1]), float(sys.argv[2])
wait_for, publish_from = (Path(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 3 else (None, None)
fd = os.open(directory / "build.lock", os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
(directory / "build").mkdir(exist_ok=True)
(directory / "build" / "lock").touch()
(directory / f".{directory.name}.so.999999.tmp").write_bytes(b"half a library")
print("holding", flush=True)
deadline = time.monotonic() + hold_s
while time.monotonic() < deadline and not (wait_for and wait_for.exists()):
    time.sleep(0.05)
if publish_from:
    shutil.copyfile(publish_from, directory / ".publishing")
    os.replace(directory / ".publishing", directory / f"{directory.name}.so")
"""


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_CPU_KERNELS", cpu.BUILD_TIMEOUT_ENV)}
    env.update(TORCH_EXTENSIONS_DIR=str(root), **extra)
    return env


def start(root: Path, *args: str, timeout: float = START_TIMEOUT_S, **env: str) -> tuple[dict, str]:
    """One start in a fresh process: its JSON report and its log."""
    proc = subprocess.run(
        [sys.executable, "-c", START, *args], env=_env(root, **env), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def hold_lock(directory: Path, *args: str) -> subprocess.Popen:
    """A process holding the build lock of `directory`, once this returns."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), *args], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def kernel_dir(root: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(root))
        return cpu.kernel_dir()


def published(directory: Path) -> Path:
    return directory / f"{directory.name}.so"


def copy_build(built: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the shared build with its library unpublished: a start there must go through the lock and ninja."""
    root = tmp_path / "torch_extensions"
    shutil.copytree(built, root)  # copy2 keeps mtimes, so ninja finds the objects up to date
    directory = kernel_dir(root)
    published(directory).unlink()
    return root, directory


def assert_ops_work(result: dict) -> None:
    assert result["available"] and result["kernels_available"], result
    assert result["rms_norm_error"] < 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A TORCH_EXTENSIONS_DIR holding one finished build, made by a first start.

    Where this process's own kernels were built already, their objects are copied in first (mtimes
    kept): the first start still takes the lock, runs ninja and publishes, but ninja finds nothing to
    compile, which saves the default run a full build (1-2 minutes on a small machine)."""
    root = tmp_path_factory.mktemp("torch_extensions")
    own_objects = cpu.kernel_dir() / "build"
    if own_objects.is_dir():
        shutil.copytree(own_objects, kernel_dir(root) / "build", ignore=shutil.ignore_patterns("lock", "*.so"))
    result, log = start(root, timeout=BUILD_TIMEOUT_S)
    assert_ops_work(result)
    assert result["compiled"]
    assert "building tokenmill's CPU kernels for this machine (once; about half a minute)" in log
    return root


def test_first_start_builds_and_publishes(built):
    directory = kernel_dir(built)
    assert published(directory).is_file()
    assert (directory / "build.lock").exists()  # never deleted: only the flock on it means anything
    assert not (directory / "build" / "lock").exists()
    assert not list(directory.glob(".*.tmp"))


def test_second_start_loads_the_published_library_directly(built):
    result, log = start(built, "--no-cpp-extension")
    assert_ops_work(result)
    assert not result["compiled"] and result["path"] == str(published(kernel_dir(built)))
    assert "building" not in log and "waiting" not in log
    assert result["seconds"] < 5


def test_stale_torch_lock_does_not_block_a_start(built, tmp_path):
    root, directory = copy_build(built, tmp_path)
    (directory / "build" / "lock").touch()  # as a build killed mid-way leaves it: torch alone waits on it forever
    result, log = start(root, **{cpu.BUILD_TIMEOUT_ENV: "30"})
    assert_ops_work(result)
    assert result["compiled"]  # it went through the build, which found the objects up to date
    assert not (directory / "build" / "lock").exists()
    assert published(directory).is_file()
    assert "waiting" not in log


def test_killed_builder_does_not_block_the_next_start(built, tmp_path):
    root, directory = copy_build(built, tmp_path)
    holder = hold_lock(directory, "600")
    holder.kill()  # SIGKILL while holding the lock, with torch's lock file and a half-published library left behind
    holder.wait(timeout=10)
    result, log = start(root, **{cpu.BUILD_TIMEOUT_ENV: "30"})
    assert_ops_work(result)
    assert "waiting" not in log
    assert not (directory / "build" / "lock").exists()
    assert not list(directory.glob(".*.tmp"))  # the half-written copy was never loaded, and is cleaned up
    assert published(directory).is_file()


# A process of the given name (as /proc/<pid>/comm shows it) working in a directory for a while.
NAMED = r"""
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode())  # PR_SET_NAME
os.chdir(sys.argv[2])
print("running", flush=True)
time.sleep(float(sys.argv[3]))
"""


def run_named(name: str, cwd: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", NAMED, name, str(cwd), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "running"
    return proc


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux's /proc")
def test_start_waits_for_the_orphaned_ninja_of_a_killed_build(built, tmp_path):
    """A killed start's ninja outlives it (torch runs it as a child process): the next build waits for it
    to exit rather than run a second ninja over the same objects; a shell sitting in the directory is no builder."""
    root, directory = copy_build(built, tmp_path)
    orphan = run_named("ninja", directory / "build", 120)
    bystander = run_named("bash", directory / "build", 120)
    starting = None
    try:
        assert cpu._leftover_builders(directory / "build") == [orphan.pid]
        starting = subprocess.Popen([sys.executable, "-c", START], env=_env(root, **{cpu.BUILD_TIMEOUT_ENV: "60"}),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The start says it waits (however long this busy machine takes to get there), and goes on
        # only once the orphan has exited.
        expected = f"waiting for the build tools of an interrupted start to exit (pids [{orphan.pid}]"
        log = ""
        while expected not in log:
            line = starting.stderr.readline()
            assert line, f"the start ended without waiting: {log}"
            log += line
        assert starting.poll() is None
        orphan.kill()
        out, rest = starting.communicate(timeout=START_TIMEOUT_S)
        assert starting.returncode == 0, log + rest
    finally:
        for proc in (orphan, bystander, starting):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(timeout=10)
    assert_ops_work(json.loads(out.strip().splitlines()[-1]))


def test_start_waits_for_a_live_builder_and_loads_its_build(built, tmp_path):
    root, directory = copy_build(built, tmp_path)
    signal = tmp_path / "waiting"
    holder = hold_lock(directory, "60", str(signal), str(published(kernel_dir(built))))
    try:
        result, log = start(root, "--no-cpp-extension", "--signal-waiting", str(signal), **{cpu.BUILD_TIMEOUT_ENV: "60"})
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert_ops_work(result)
    assert not result["compiled"]
    assert f"waiting for another process to finish building tokenmill's CPU kernels (lock held at {directory / 'build.lock'})" in log
    assert "gave up" not in log


def test_start_gives_up_on_a_live_builder_after_the_timeout(tmp_path):
    root = tmp_path / "torch_extensions"
    directory = kernel_dir(root)
    directory.mkdir(parents=True)
    holder = hold_lock(directory, "120")
    try:
        begin = time.monotonic()
        result, log = start(root, **{cpu.BUILD_TIMEOUT_ENV: "2"})
        elapsed = time.monotonic() - begin
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert not result["available"] and not result["kernels_available"]  # the PyTorch paths run
    assert f"waiting for another process to finish building tokenmill's CPU kernels (lock held at {directory / 'build.lock'})" in log
    assert "gave up waiting for another process to build tokenmill's CPU kernels" in log
    assert cpu.BUILD_TIMEOUT_ENV in log
    assert 2 <= result["seconds"] < 10 and elapsed < 60


def test_build_kernels_command(built):
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "build-kernels"],
        env=_env(built), capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(published(kernel_dir(built))) in proc.stdout
    assert "found a finished build of tokenmill's CPU kernels in" in proc.stdout


def test_build_kernels_command_fails_clearly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "build-kernels"],
        env=_env(tmp_path, TOKENMILL_CPU_KERNELS="0"), capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )
    assert proc.returncode == 1
    assert "error: tokenmill's CPU kernels could not be built: turned off by TOKENMILL_CPU_KERNELS=0" in proc.stderr


@pytest.mark.parametrize("value, want", [(None, 300.0), ("2.5", 2.5), ("0", 0.0), ("soon", 300.0), ("-1", 300.0), ("nan", 300.0)])
def test_build_timeout_from_env(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(cpu.BUILD_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu.BUILD_TIMEOUT_ENV, value)
    assert cpu._build_timeout() == want


def test_publish_replaces_atomically_and_leaves_no_temporary(tmp_path):
    built, final = tmp_path / "built.so", tmp_path / "final.so"
    built.write_bytes(b"new library")
    final.write_bytes(b"old library")
    cpu._publish(built, final)
    assert final.read_bytes() == b"new library"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built.so", "final.so"]
