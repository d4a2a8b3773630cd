"""A package's public names, imported on first use (PEP 562).

``import cachepipe`` then costs what the caller touches: the ``cachepipe`` command that only
talks to a daemon (``cachepipe next``, once per item from a shell loop) does not import
pydantic, the cache and the stores. Type checkers and readers see the names imported under
``TYPE_CHECKING`` in the package itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attach"]


def attach(
    package: str, names: Mapping[str, tuple[str, str]], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``.

    ``names`` maps each public name to ``(module, attribute)``, the module relative to
    ``package`` (``".pipeline"``). The first access imports it and binds the name in
    ``namespace`` (the package's globals), so later accesses cost a dictionary lookup.
    ``names`` must list exactly the package's ``__all__``.
    """
    if set(names) != set(namespace["__all__"]):
        raise ImportError(f"{package}: lazy names {sorted(names)} differ from __all__ {sorted(namespace['__all__'])}")

    def getattr_(name: str) -> Any:
        try:
            module, attribute = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module, package), attribute)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(names))

    return getattr_, dir_
