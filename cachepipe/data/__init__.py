"""Files shipped for the daemon: the systemd units and the example config.

One source: in the repository these are symlinks to ``systemd/`` and ``config/``; the sdist and
the wheel hold copies (``tests/test_packaging.py`` compares them byte for byte).
``cachepipe print-unit [NAME]`` and ``cachepipe print-config`` print them from an installed
package, so a deployment needs no clone of the repository.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["CONFIG", "read", "units"]

CONFIG = "cachepipe.yaml"


def units() -> list[str]:
    """Names of the shipped systemd units, e.g. ``['cachepipe.service', 'cachepipe@.service']``."""
    return sorted(entry.name for entry in resources.files(__name__).iterdir() if entry.name.endswith(".service"))


def read(name: str) -> bytes:
    """The bytes of a shipped file: a unit name from :func:`units`, or :data:`CONFIG`."""
    if name != CONFIG and name not in units():
        raise ValueError(f"no shipped file {name!r}: expected {CONFIG!r} or one of {', '.join(units())}")
    return resources.files(__name__).joinpath(name).read_bytes()
