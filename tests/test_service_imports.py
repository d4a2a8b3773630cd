"""The service package has no import circle: issue #15 item 3. A daemon's start does not
import the code only some requests need.

Imports are read from the source (``ast``), so an import under ``if TYPE_CHECKING:`` or inside
a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cachepipe.service

PACKAGE = Path(cachepipe.service.__file__).parent


def service_imports() -> dict[str, set[str]]:
    """Module name -> the modules of ``cachepipe.service`` it imports (anywhere in its source)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    found.add(node.module.split(".")[0])
                elif node.level == 1:
                    found.update(alias.name for alias in node.names)
                elif node.level == 0 and (node.module or "").startswith("cachepipe.service."):
                    found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("cachepipe.service."))
        graph[name] = (found & modules) - {name}
    return graph


def test_no_import_circle_in_the_service_package():
    graph = service_imports()
    assert "daemon" not in graph["api"], "api.py imports daemon.py: it should depend on the Service protocol"

    def visit(name: str, path: list[str]) -> None:
        for dep in sorted(graph[name]):
            assert dep not in path, f"import circle: {' -> '.join([*path[path.index(dep) :], name, dep])}"
            visit(dep, [*path, name])

    for module in sorted(graph):
        if module != "__init__":
            visit(module, [])


def test_the_daemon_imports_the_node_code_with_its_first_job():
    """``cachepipe.node``, ``cachepipe.lanequeues`` and ``cachepipe.lanes`` (1,300 lines, compiled
    at every start where no bytecode is cached) serve only jobs: the daemon imports them when the
    first job registers."""
    node_code = ("cachepipe.node", "cachepipe.lanequeues", "cachepipe.lanes")
    code = f"import sys, cachepipe.service.main; print([m for m in {node_code!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"
