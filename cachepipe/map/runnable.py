"""What :func:`~cachepipe.map.run.map_items` refuses of ``fn`` or a command before anything is
downloaded, because it could not run for any item: a program that is not on ``PATH`` or not an
executable file; an ``fn`` that a child process started by ``spawn`` could not find (defined in a
``__main__`` it cannot import, or in a module still being imported), or a call at a script's
top level outside its ``__main__`` guard, which each child would run again. Reads the main
script and the modules already imported; starts nothing.
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__: list[str] = []  # map_items' own checks: map/run.py calls them


def _check_command(program: str) -> None:
    """Refuse, before anything is downloaded, a program that cannot run: a bare name not on
    ``PATH``, or a path that is not an executable file. Not checked: a name with a placeholder
    (``{}``...), and a relative path with a ``/`` (it is resolved in the item's folder, the
    command's working directory, which exists only later).

    Raises:
        ConfigError: naming the program and what is accepted.
    """
    if "{" in program:
        return
    if "/" not in program:
        if shutil.which(program) is None:
            raise ConfigError(
                f"command {program!r}: not found on PATH; expected a program on PATH or a path to an executable file"
            )
        return
    if os.path.isabs(program) and not (os.path.isfile(program) and os.access(program, os.X_OK)):
        why = "is not a file" if os.path.exists(program) else "does not exist"
        if os.path.isfile(program):
            why = "is not executable"
        raise ConfigError(f"command {program!r}: {why}; expected a program on PATH or a path to an executable file")


def _from_fileless_main(fn: Any) -> bool:
    """Whether ``fn`` (a function, a ``functools.partial`` of one, or a callable object) is
    pickled by reference to a ``__main__`` that a spawned child cannot import: the child runs
    the parent's main module again (as multiprocessing's spawn does, by its ``__spec__`` name,
    else its file) to find such names, and there is none in a session without a script file
    (``python -c``, a REPL, a notebook), nor for a package's ``__main__`` (``python -m pkg``)."""
    if not any(getattr(x, "__module__", None) == "__main__" for x in (fn, getattr(fn, "func", None), type(fn))):
        return False
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return bool(name == "__main__" or name.endswith(".__main__"))
    return not getattr(main, "__file__", None)


def _importing(fn: Any) -> str | None:
    """The name of the module that defines ``fn`` (a function, a ``functools.partial`` of one, or
    a callable object) if it is still being imported, i.e. ``map_items`` runs from its top level:
    a child would import it to find ``fn``, so run that top level, this call included, again, and
    the run's threads that look ``fn`` up would wait for that import to end, which waits for them."""
    for x in (fn, getattr(fn, "func", None), type(fn)):
        name = getattr(x, "__module__", None)
        module = sys.modules.get(name) if isinstance(name, str) else None
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            return name
    return None


def _unguarded_line() -> int | None:
    """The line of the main script's top-level statement running now (the one that led to this
    call) if it runs unconditionally, so that a spawned child, which runs the script again by
    its file or module name (as multiprocessing's spawn does), would run it too. None where any
    ``if`` stands on the way: one that tests ``__name__`` (at the top level, or in a function of
    the script between it and this call), or any other at the top level (``if IS_MAIN:``), which
    may be a guard; and None where there is no script for spawn to run or for us to read."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if main is None or not path or (name is not None and (name == "__main__" or name.endswith(".__main__"))):
        return None  # spawn does not run such a main again (and a fn from it is refused on its own)
    lines, frame = [], inspect.currentframe()  # the lines running in the script's frames, its top level's last
    while frame is not None:
        if frame.f_globals is vars(main):
            lines.append((frame.f_lineno, frame.f_code.co_name == "<module>"))
        frame = frame.f_back
    if not lines or not lines[-1][1]:
        return None
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    ifs = [
        (n, any(isinstance(x, ast.Name) and x.id == "__name__" for x in ast.walk(n.test)))
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
    ]
    for line, top in lines:
        for node, tests_name in ifs:
            if (tests_name or top) and any(_holds(s, line) for s in node.body + node.orelse):
                return None
    line = lines[-1][0]
    return line if any(_holds(s, line) for s in tree.body) else None  # else the file changed since it ran


def _holds(stmt: ast.stmt, line: int) -> bool:
    """Whether ``line`` is in ``stmt``, its decorators included."""
    first: int = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
    return first <= line <= (stmt.end_lineno or stmt.lineno)
