"""A name -> module registry whose modules are imported on first use (providers, engines): a seam's
plug-ins are found by name without importing any of them (cloud SDKs and Ray stay optional)."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from xeontune.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """``kind`` names the seam in messages; each module defines ``attribute``, a ``base`` named as registered."""

    def __init__(self, kind: str, attribute: str, base: type[T]) -> None:
        self.kind, self.attribute, self.base = kind, attribute, base
        self._modules: dict[str, str] = {}

    def register(self, name: str, module: str) -> None:
        """Make ``name`` known: ``module`` (imported on first use) defines the plug-in."""
        self._modules[name] = module

    def unregister(self, name: str) -> None:
        self._modules.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._modules)

    def get(self, name: str) -> T:
        if name not in self._modules:
            raise UserError(f"unknown {self.kind} {name!r} (choose from: {', '.join(self._modules)})")
        module = self._modules[name]
        found = getattr(importlib.import_module(module), self.attribute)
        if not isinstance(found, self.base) or getattr(found, "name", None) != name:
            raise TypeError(f"{module}.{self.attribute} must be a {self.base.__name__} named {name!r}")
        return found
