"""An HF folder's config, resolved by transformers once and kept as plain JSON for later starts.

`AutoConfig.from_pretrained` imports transformers' model machinery (and through it
torch.distributed.tensor and sympy): about a second of a warm start, spent before the model can
even be built. What the model classes read from the config is plain data (numbers, strings, lists,
the RoPE dict), so the first start records the resolved attributes (class defaults filled in,
legacy keys standardized: everything transformers did) and later starts read them back in
milliseconds. The record is keyed by the bytes of config.json and generation_config.json and by
transformers' version, so an edited file or an upgrade resolves afresh; a config whose attributes
do not survive the JSON round trip exactly (nested sub-configs, tuples) is never recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.loader.cache_dir import cache_root

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when the record's layout changes
_DROPPED = frozenset({"id2label", "label2id"})  # classification heads' labels (int keys JSON cannot keep); unused here


class CachedHFConfig:
    """The attributes of a transformers config, read back from the record (attribute access, with
    the class's attribute_map aliases, e.g. GPT-2's n_embd for hidden_size)."""

    def __init__(self, attrs: dict, attribute_map: dict[str, str]) -> None:
        self.__dict__.update(attrs)
        self._attribute_map = attribute_map

    def to_dict(self) -> dict:
        """The recorded attributes, as PretrainedConfig.to_dict gives them."""
        return {k: v for k, v in self.__dict__.items() if k != "_attribute_map"}

    def __getattr__(self, name: str):  # only reached for names not set as attributes
        alias = self.__dict__.get("_attribute_map", {}).get(name)
        if alias is None:
            raise AttributeError(name)
        return getattr(self, alias)


@dataclass(frozen=True)
class ResolvedConfig:
    config: object  # a transformers PretrainedConfig, or a CachedHFConfig read from the record
    generation_eos: int | list[int] | None  # generation_config.json's eos_token_id


def load_config(folder: Path) -> ResolvedConfig:
    """The folder's config and generation EOS: from the record when one matches, else from transformers
    (recording them for the next start)."""
    path = _record_path(folder)
    if path is not None and path.is_file():
        try:
            record = json.loads(path.read_text())
            return ResolvedConfig(CachedHFConfig(record["attrs"], record["attribute_map"]), record["generation_eos"])
        except (OSError, ValueError, KeyError, TypeError):
            logger.debug("ignoring an unreadable config record %s", path)
    resolved = _from_transformers(folder)
    if path is not None:
        _write_record(path, resolved)
    return resolved


def _from_transformers(folder: Path) -> ResolvedConfig:
    from transformers import AutoConfig, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"{folder / 'config.json'} cannot be read: {exc}") from None
    generation_eos = None
    if (folder / "generation_config.json").is_file():
        try:
            generation_eos = GenerationConfig.from_pretrained(folder).eos_token_id
        except Exception:
            logger.warning("ignoring an unreadable generation_config.json in %s", folder)
    return ResolvedConfig(config, generation_eos)


def _record_path(folder: Path) -> Path | None:
    digest = hashlib.sha256(f"{_FORMAT}:{_transformers_version()}".encode())
    for name in ("config.json", "generation_config.json"):
        try:
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
        except FileNotFoundError:
            digest.update(name.encode() + b"\0-\0")
        except OSError:
            return None
    return Path(cache_root()) / "hf-configs" / f"{digest.hexdigest()[:24]}.json"


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")  # reads the dist-info, imports nothing
    except metadata.PackageNotFoundError:
        return "none"


def _plain_attrs(config) -> dict | None:
    """The config's public attributes as JSON data (dtype by name), or None if any would not
    come back from JSON exactly as it is."""
    attrs = {k: v for k, v in vars(config).items() if not k.startswith("_") and k not in _DROPPED}
    attrs["model_type"] = getattr(config, "model_type", None)
    if isinstance(attrs.get("dtype"), torch.dtype):
        attrs["dtype"] = str(attrs["dtype"]).removeprefix("torch.")
    if isinstance(attrs.get("torch_dtype"), torch.dtype):
        attrs["torch_dtype"] = str(attrs["torch_dtype"]).removeprefix("torch.")
    try:
        same = json.loads(json.dumps(attrs)) == attrs
    except (TypeError, ValueError):
        return None
    return attrs if same else None


def _needs_transformers(config) -> bool:
    """Whether the model's construction calls the config's own methods, which a record has not: scaled
    RoPE goes through transformers' init functions (standardize_rope_params and the like)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default"


def _write_record(path: Path, resolved: ResolvedConfig) -> None:
    if _needs_transformers(resolved.config):
        logger.debug("%s: config not recorded (scaled RoPE needs transformers' config methods)", path)
        return
    attrs = _plain_attrs(resolved.config)
    attribute_map = dict(getattr(type(resolved.config), "attribute_map", {}) or {})
    if attrs is None or not all(isinstance(v, str) for v in attribute_map.values()):
        logger.debug("%s: config not recorded (attributes JSON cannot hold exactly)", path)
        return
    record = {"attrs": attrs, "attribute_map": attribute_map, "generation_eos": resolved.generation_eos}
    try:
        text = json.dumps(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-")
    except (OSError, TypeError, ValueError) as exc:
        logger.debug("could not record the resolved config at %s: %s", path, exc)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a concurrent start reads nothing or the whole record
    except OSError as exc:
        logger.debug("could not record the resolved config at %s: %s", path, exc)
        Path(tmp).unlink(missing_ok=True)
