"""Load an HF model folder: config.json, single or sharded safetensors, tokenizer, chat template."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.errors import ModelLoadError
from tokenmill.loader.config_cache import load_config
from tokenmill.loader.source import ModelSource, done, eos_ids_from, in_background
from tokenmill.models.registry import get_model_class

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard files listed in {index.name} are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    safetensors = sorted(folder.glob("*.safetensors"))
    # Mistral's repos ship consolidated.safetensors (its own tensor names) beside the HF-format files.
    files = [f for f in safetensors if not f.name.startswith("consolidated")] or safetensors
    files = files or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"{folder}: no weights found (expected *.safetensors or pytorch_model*.bin)")
    return files


def _iter_weights(files: list[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    for path in files:
        if path.suffix == ".bin":
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise ModelLoadError(f"{path}: cannot read PyTorch weights: {exc}") from None
            yield from state.items()
            continue
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    yield key, handle.get_tensor(key)
        except SafetensorError as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from None


def _check_architecture(config_path: Path) -> None:
    """Read the raw JSON first: an architecture we cannot run is named as such (with the supported
    ones), even when transformers itself does not know its model_type and would suggest upgrading."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object, not {type(raw).__name__}")
    get_model_class(SimpleNamespace(architectures=raw.get("architectures")))


# tokenizer_config.json classes that are transformers' generic tokenizers.json tokenizer: loaded by that
# class directly, since AutoTokenizer also imports the model-config machinery (about a second).
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _generic_tokenizer_class(path: str) -> bool:
    try:
        raw = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES and (Path(path) / "tokenizer.json").is_file()


def load_tokenizer(path: str):
    try:
        if _generic_tokenizer_class(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from None


def load_hf_source(path: str, tokenizer_path: str | None = None, skip_tokenizer_init: bool = False,
                   weights_required: bool = True) -> ModelSource:
    """An HF folder as a ModelSource (weights_required=False: a folder with the config and tokenizer
    only, whose weights the caller supplies).

    The tokenizer is built in a thread of its own (importing transformers and parsing tokenizer.json
    take about a second) while the caller builds the model, when the EOS ids are known without it."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if ggufs:
            raise ModelLoadError(f"{path}: no config.json here, but it holds {ggufs[0].name}: give the path of that .gguf file")
        raise ModelLoadError(f"{path}: no config.json here; give an HF model folder or a .gguf file")
    _check_architecture(folder / "config.json")
    resolved = load_config(folder)
    config = resolved.config
    files = _weight_files(folder) if weights_required else []
    eos = eos_ids_from(getattr(config, "eos_token_id", None), resolved.generation_eos)

    tokenizer = done(None)
    if not skip_tokenizer_init:
        tok_path = Path(tokenizer_path) if tokenizer_path else folder
        if tokenizer_path or any((tok_path / f).is_file() for f in _TOKENIZER_FILES):
            if eos:
                tokenizer = in_background("tokenmill-tokenizer", lambda: load_tokenizer(str(tok_path)))
            else:
                tokenizer = done(load_tokenizer(str(tok_path)))
                eos_token_id = getattr(tokenizer.result(), "eos_token_id", None)
                if eos_token_id is not None:
                    eos.add(eos_token_id)
        else:
            logger.warning("%s has no tokenizer files: only token-id prompts will work", path)

    attrs = vars(config)  # not getattr: transformers warns on every read of the old torch_dtype name
    dtype = attrs.get("dtype") or attrs.get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return ModelSource(
        name=path,
        hf_config=config,
        weights=lambda: _iter_weights(files),
        tokenizer_future=tokenizer,
        eos_token_ids=eos,
        checkpoint_dtype=dtype,
    )
