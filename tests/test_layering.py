"""The package's layering (DESIGN.md, "the next shape"), checked with import-linter's contracts in
pyproject.toml: layers and models import nothing of the engine or the worker, the worker sees of
the engine only the step messages, the messages are a leaf, speculative decoding's proposers are plain
functions of token ids, and the core knows nothing of the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
# In a process of its own: import-linter configures logging with dictConfig, which would disable
# every logger this test process already has.
_LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def test_import_contracts_are_kept():
    proc = subprocess.run([sys.executable, "-c", _LINT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 kept, 0 broken" in proc.stdout
