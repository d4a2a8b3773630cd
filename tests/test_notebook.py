"""The ModelArts example notebook, run cell by cell against the moto server through obs://.

The code cells are taken from the .ipynb JSON and executed in-process, in one fresh namespace per
"kernel", in notebook order (nbclient and ipykernel are not dependencies of the project). The
first code cell reads its settings from environment variables, which point it at moto here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "modelarts_obs.ipynb"
BUCKET = "your-bucket"
FOLDERS = 5


def load() -> dict:
    with open(NOTEBOOK, encoding="utf-8") as fh:
        return json.load(fh)


def sources(kind: str) -> list[str]:
    return ["".join(cell["source"]) for cell in load()["cells"] if cell["cell_type"] == kind]


def run(code: str, ns: dict, index: int) -> None:
    exec(compile(code, f"{NOTEBOOK.name}[code cell {index}]", "exec"), ns)  # noqa: S102 - runs the repository's own notebook cells


def stream_index(code_cells: list[str]) -> int:
    [index] = [i for i, code in enumerate(code_cells) if "with Pipeline(" in code]
    return index


@pytest.fixture
def dataset(s3_client) -> dict[str, tuple[str, str]]:
    """obs://your-bucket/video/folder1..5 with video.mp4 + text.txt; returns {folder: (md5, text)}."""
    s3_client.create_bucket(Bucket=BUCKET)
    rng = random.Random(4)
    expected = {}
    for i in range(1, FOLDERS + 1):
        video = rng.randbytes(rng.randint(40, 120) * 1024)
        text = f"caption {i}: a person opens a door\n"
        s3_client.put_object(Bucket=BUCKET, Key=f"video/folder{i}/video.mp4", Body=video)
        s3_client.put_object(Bucket=BUCKET, Key=f"video/folder{i}/text.txt", Body=text.encode())
        expected[f"folder{i}"] = (hashlib.md5(video).hexdigest(), text)
    return expected


@pytest.fixture
def env(monkeypatch, s3_endpoint, tmp_path) -> Path:
    """The notebook's settings pointed at moto, credentials from OBS_* variables; returns the cache dir."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CACHEPIPE_EXAMPLE_URL", f"obs://{BUCKET}/video/")
    monkeypatch.setenv("CACHEPIPE_EXAMPLE_CACHE_DIR", str(cache))
    monkeypatch.setenv("OBS_ENDPOINT", s3_endpoint)
    monkeypatch.setenv("OBS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("OBS_SECURITY_TOKEN", raising=False)
    return cache


class Recorder:
    """Stands in for the notebook's train_step (after calling it): records what the loop read."""

    def __init__(self, original, interrupt_at: int | None = None) -> None:
        self.original = original
        self.interrupt_at = interrupt_at
        self.seen: list[tuple[str, str]] = []

    def __call__(self, video: bytes, text: str) -> None:
        self.original(video, text)
        if self.interrupt_at is not None and len(self.seen) == self.interrupt_at:
            raise KeyboardInterrupt  # the stop button, inside the loop body
        self.seen.append((hashlib.md5(video).hexdigest(), text))


def run_setup(ns: dict) -> list[str]:
    """Run every code cell before the streaming one; return all code cells."""
    code_cells = sources("code")
    for i in range(stream_index(code_cells)):
        run(code_cells[i], ns, i)
    return code_cells


def assert_clean(cache: Path) -> None:
    """Nothing but cachepipe's own state directory is left, and no download in progress."""
    assert os.listdir(cache) == [".cachepipe"]
    staging = cache / ".cachepipe" / "staging"
    assert not staging.exists() or os.listdir(staging) == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("cachepipe")]


def test_notebook_is_clean_nbformat4_with_the_documented_cells():
    nb = load()
    assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["language"] == "python"
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("markdown", "code") and isinstance(cell["source"], list)
        if cell["cell_type"] == "code":  # committed without outputs
            assert cell["outputs"] == [] and cell["execution_count"] is None
    assert any("pip install './cachepipe[obs]'" in md for md in sources("markdown"))
    code_cells = sources("code")
    for code in code_cells:  # nothing installs, shells out or needs IPython
        assert "pip install" not in code
        assert not [line for line in code.splitlines() if line.lstrip().startswith(("!", "%"))]
    stream = code_cells[stream_index(code_cells)]
    for needle in (
        'capacity="80%"',
        "progress=True",
        "for path in pipe:",
        'path / "video.mp4"',
        'path / "text.txt"',
        "pipe.stats()",
    ):
        assert needle in stream


def test_first_cell_defaults_are_the_modelarts_ones(monkeypatch):
    for name in ("CACHEPIPE_EXAMPLE_URL", "CACHEPIPE_EXAMPLE_CACHE_DIR", "OBS_ENDPOINT", "OBS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    ns: dict = {}
    run(sources("code")[0], ns, 0)
    assert ns["OBS_URL"] == "obs://your-bucket/video/"
    assert ns["CACHE_DIR"] == "/cache"
    assert ns["OBS_ENDPOINT"].startswith("https://obs.")


def test_notebook_streams_every_folder_and_leaves_the_cache_clean(dataset, env, capsys):
    ns: dict = {}
    code_cells = run_setup(ns)
    ns["train_step"] = recorder = Recorder(ns["train_step"])
    index = stream_index(code_cells)
    run(code_cells[index], ns, index)
    run_rest = code_cells[index + 1 :]
    for i, code in enumerate(run_rest, index + 1):
        run(code, ns, i)

    assert recorder.seen == [dataset[name] for name in sorted(dataset)]  # every byte, in order
    stats = ns["stats"]
    assert stats.items_listed == stats.items_handed == stats.items_acked == FOLDERS
    assert stats.bytes_downloaded == stats.bytes_listed and stats.items_failed == 0
    assert 0 < stats.capacity <= os.statvfs(env).f_bavail * os.statvfs(env).f_frsize
    out, err = capsys.readouterr()
    assert "OBS credentials: OBS_ACCESS_KEY_ID" in out
    assert f"{FOLDERS} folders" in out
    assert f"{FOLDERS}/{FOLDERS}" in err  # the progress bar
    assert_clean(env)


def test_rerunning_the_stream_cell_after_an_interrupt(dataset, env):
    ns: dict = {}
    code_cells = run_setup(ns)
    index = stream_index(code_cells)
    notebook_step = ns["train_step"]
    ns["train_step"] = Recorder(notebook_step, interrupt_at=1)
    with pytest.raises(KeyboardInterrupt) as first_run:
        run(code_cells[index], ns, index)
    assert_clean(env)
    # Like IPython's sys.last_traceback, keep the interrupted run's frames alive while re-running.
    assert first_run.value.__traceback__ is not None
    ns["train_step"] = recorder = Recorder(notebook_step)
    run(code_cells[index], ns, index)
    assert recorder.seen == [dataset[name] for name in sorted(dataset)]
    assert ns["stats"].items_handed == FOLDERS
    assert_clean(env)
