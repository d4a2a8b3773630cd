"""The library's log records reach a user's handlers writable in UTF-8 (cachepipe.logfallback)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_record_factory_that_replaces_the_librarys_still_gets_its_records_escaped_for_the_roots_handlers(
    tmp_path: Path,
) -> None:
    """The escaping of names of undecodable bytes is a record factory, installed at import: a
    user's factory installed after it that does not call the one it replaces (the plain
    ``logging.setLogRecordFactory(MyRecord)``) ended it, and a strict handler on the root
    (``FileHandler(path, encoding="utf-8")``) failed the line ("--- Logging error ---") and lost
    it, which it wrote before the factory (a handler on ``cachepipe`` escaped it). A fresh
    interpreter: the process-wide factory and handlers as a user's program has them."""
    log = tmp_path / "run.log"
    script = textwrap.dedent(
        f"""
        import logging
        import cachepipe

        class MyRecord(logging.LogRecord):
            pass

        logging.setLogRecordFactory(MyRecord)  # after the import, calling no other factory
        logging.getLogger().addHandler(logging.FileHandler({str(log)!r}, encoding="utf-8"))
        logging.getLogger("cachepipe.map").warning("item %s failed", "caf\\udce9")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "Logging error" not in done.stderr, done.stderr  # before: the line failed, and was lost
    assert log.read_text(encoding="utf-8") == "item caf\\udce9 failed\n"
