"""Package names that resolve on first use (PEP 562): importing one pure module of a
package (the drafting subsystem, the planner) does not load what the package's other names
need (the native extension)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """``package``'s ``__getattr__``: ``name`` from its submodule ``where[name]`` (the
    submodule itself where that is ``name``), imported on first use and kept."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = import_module(f".{where[name]}", package)
        value = module if where[name] == name else getattr(module, name)
        namespace[name] = value
        return value

    return __getattr__
