"""The model names the server answers to (/v1/models, and the `model` field of every request)."""

from __future__ import annotations

import time

from tokenmill.entrypoints.openai.errors import NotFound
from tokenmill.entrypoints.openai.protocol import ModelCard, ModelList


class ServedModels:
    def __init__(self, names: list[str], max_model_len: int, root: str | None = None) -> None:
        if not names:
            raise ValueError("at least one served model name is needed")
        self.names = list(names)
        self.max_model_len = max_model_len
        self.root = root or names[0]
        self.created = int(time.time())

    @property
    def default(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to answer with; an unknown name is a 404 (no model field: the first served name)."""
        if requested is None or requested == "":
            return self.default
        if requested not in self.names:
            raise NotFound(f"The model `{requested}` does not exist. Served models: {', '.join(self.names)}", "model")
        return requested

    def card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, root=self.root, max_model_len=self.max_model_len)

    def list(self) -> ModelList:
        return ModelList(data=[self.card(n) for n in self.names])
