"""Reading the daemon's configuration file into a mapping: YAML, or TOML by its ``.toml``
suffix. No validation here: :mod:`.config` validates the mapping (with the ``CACHEPIPE_*``
environment over it) into a :class:`~cachepipe.service.config.ServiceConfig`.

What is read is what was written. A key given twice in one YAML mapping is refused (PyYAML keeps
the last silently), and a ``socket_mode`` written as an unquoted number with a leading 0
(``0660``, octal to YAML) is handed on as its text, the mode it spells, so that the validation,
which refuses numbers (``_MODE_RE``, the spelling of a mode), can take it. A file that cannot be
read or parsed raises :class:`~cachepipe.errors.ConfigError` naming the file, and the line where
the parser says.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib is new in 3.11; tomli is the same parser (a dependency on 3.10 only)
    import tomli as tomllib

from ..errors import ConfigError

__all__ = ["read_config_file"]

_MODE_RE = re.compile(r"^(?:0o?)?([0-7]{1,4})$")


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str) -> Any:
    """``text`` read by :class:`_StrictLoader`, with a ``socket_mode`` written as an unquoted
    number with a leading 0 (``0660``, which YAML reads as octal) given as that text, the mode
    it spells; any other number there stays a number, refused by ``_parse_mode``."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()
    if isinstance(node, yaml.MappingNode) and isinstance(data, dict):
        for key, value in node.value:
            if (
                key.value == "socket_mode"
                and isinstance(value, yaml.ScalarNode)
                and value.tag == "tag:yaml.org,2002:int"
                and value.style is None
                and _MODE_RE.match(value.value)
                and value.value.startswith("0")
            ):
                data["socket_mode"] = value.value
    return data


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML (or ``.toml``) config file into a mapping.

    Raises:
        ConfigError: the file is missing or unreadable, is not valid YAML/TOML (with the line),
            or does not hold a mapping at the top.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot read it: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        if path.suffix.lower() == ".toml":
            data: Any = tomllib.loads(text)
        else:
            data = _load_yaml(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: invalid TOML: {exc}") from exc
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"config file {str(path)!r}: invalid YAML{where}: {problem}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping of settings at the top, got {type(data).__name__}")
    return data
