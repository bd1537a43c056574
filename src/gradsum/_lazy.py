"""Package exports that load on first use (PEP 562), so that importing a package for one light
name does not load torch through its heavy siblings."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``homes`` is imported from its
    submodule on first access and cached in the package."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
