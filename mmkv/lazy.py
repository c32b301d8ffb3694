"""Public names that load on first use (PEP 562): a package's ``__init__`` names where each lives,
so importing the package, or one light module of it, does not load the heavy ones."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: dict[str, Any], homes: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose globals are ``package``: name ->
    the module it lives in (``homes``), imported when the name is first read and kept."""
    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        package[name] = value  # found once; later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted(set(package) | set(homes))

    return __getattr__, __dir__
