"""The package's layering (DESIGN.md, "the next shape"), checked with import-linter's contracts in
pyproject.toml: layers and models import nothing of the engine or the worker, the worker sees of
the engine only the step messages, the messages are a leaf, and the core knows nothing of the server."""

from __future__ import annotations

from pathlib import Path

import pytest

importlinter_cli = pytest.importorskip("importlinter.cli")

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out
