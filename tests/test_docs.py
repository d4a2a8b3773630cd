"""The docs are kept true: the site builds with ``mkdocs build --strict``, and every Python and
shell snippet in README.md and docs/ runs against the moto S3 server.

The convention (also in docs/development.md):

- A fenced block labelled ``python``, ``bash`` or ``sh`` is a snippet and runs, unless the line
  before it is ``<!-- not run: REASON -->`` (the reason is required). Other blocks (``yaml``,
  ``text``, unlabelled output) are shown, not run.
- The test creates the buckets and objects the docs name (``DATASET``), and rewrites the
  placeholders of ``SUBSTITUTIONS`` in each snippet before it runs.
- The Python snippets of one page run in order in one namespace, with ``STUBS`` for the names
  that stand for the reader's code; shell snippets run with ``bash -euo pipefail``, ``cachepipe``
  on PATH and the environment pointing at the moto server.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachepipe.service.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGS = {"python": "python", "bash": "bash", "sh": "bash"}
SKIP = re.compile(r"^<!-- not run:(.*)-->$")
FENCE = re.compile(r"^```(\S*)\s*$")


def substitutions(endpoint: str, tmp: str) -> dict[str, str]:
    """Placeholders in the docs -> what the test runs with. Applied in this order, as plain text."""
    return {
        "https://s3.example.com": endpoint,  # the reader's endpoint -> the moto server
        "my-access-key": "testing",  # the moto server's dummy credentials
        "my-secret-key": "testing",
        "/mnt/ssd/": f"{tmp}/ssd/",  # local cache directories
        "obs://your-bucket/video/": "obs://my-bucket/videos/",  # the OBS example: the same dataset through the OBS SDK
        '"/cache"': f'"{tmp}/obs-cache"',  # its cache directory
        "/run/cachepipe/cachepipe.sock": f"{tmp}/d.sock",  # the test's daemon (see _daemon_for)
        "/tmp/cachepipe-demo": f"{tmp}/demo",  # noqa: S108 - a placeholder in the docs, rewritten to a private temp dir; the daemon example's config, socket and cache
    }


SUBSTITUTIONS = substitutions  # the name docs/development.md points at


def _noop(*_args, **_kwargs):
    return None


# Names in the snippets that stand for the reader's own code.
STUBS = dict.fromkeys(("train_on", "train_step", "process", "work_on", "decode_video"), _noop)
SHELL_STUBS = "ffmpeg() { :; }\n"


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    skip: str | None  # the stated reason, or None: the block runs

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` that are snippets (python, bash, sh)."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in RUN_LANGS:
            continue
        before = lines[start - 1] if start else ""
        sm = SKIP.match(before)
        found.append(Block(page, start + 1, RUN_LANGS[lang], "\n".join(body) + "\n", sm.group(1).strip() if sm else None))
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUN_PAGES = sorted({b.page for b in ALL if b.skip is None})


def test_snippet_inventory():
    """Every skipped snippet states why; report how many run and how many are skipped."""
    missing = [b.where() for b in ALL if b.skip is not None and not b.skip]
    assert not missing, f"<!-- not run: --> without a reason at {missing}"
    run = [b for b in ALL if b.skip is None]
    reasons = Counter(b.skip for b in ALL if b.skip)
    report = [f"docs snippets: {len(run)} run, {len(ALL) - len(run)} skipped"]
    report += [f"  skipped x{n}: {reason}" for reason, n in sorted(reasons.items())]
    print("\n".join(report))
    assert len(run) >= 10, "most snippets should run"


def _put_dataset(s3_client) -> None:
    """The objects the docs name: s3://my-bucket/videos/ and .../datasets/video/ (folders of
    video.mp4 + text.txt), s3://my-bucket/archives/ (folders holding a .tar.gz and a text.txt)."""
    s3_client.create_bucket(Bucket="my-bucket")
    for prefix in ("videos", "datasets/video"):
        for i in range(3):
            s3_client.put_object(Bucket="my-bucket", Key=f"{prefix}/folder{i}/video.mp4", Body=os.urandom(4096 + i))
            s3_client.put_object(Bucket="my-bucket", Key=f"{prefix}/folder{i}/text.txt", Body=f"caption {i}\n".encode())
    for i in range(2):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            data = os.urandom(2048)
            info = tarfile.TarInfo("frames.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        s3_client.put_object(Bucket="my-bucket", Key=f"archives/clip{i}/video.tar.gz", Body=buf.getvalue())
        s3_client.put_object(Bucket="my-bucket", Key=f"archives/clip{i}/text.txt", Body=b"text\n")


DAEMON_CONFIG = """\
socket: {tmp}/d.sock
pipelines:
  train:
    source: s3://my-bucket/videos/
    cache_dir: {tmp}/daemon-cache
    capacity: 16MiB
    storage_options: {{endpoint_url: "{endpoint}"}}
jobs:
  root: {tmp}/jobs
  capacity: 16MiB
  sources: ["s3://my-bucket/"]
  options:
    storage_options: {{endpoint_url: "{endpoint}"}}
"""


def _daemon_for(page: Path, tmp: str, endpoint: str, env: dict[str, str]) -> DaemonProcess | None:
    """A daemon serving pipeline ``train`` (s3://my-bucket/videos/) and jobs (under
    s3://my-bucket/) at the socket the docs call /run/cachepipe/cachepipe.sock, for a page whose
    snippets consume from one; else None."""
    if not any(b.skip is None and ("/run/cachepipe" in b.code or "Client(" in b.code) for b in blocks(page)):
        return None
    config = Path(tmp, "daemon.yaml")
    config.write_text(DAEMON_CONFIG.format(tmp=tmp, endpoint=endpoint))
    return DaemonProcess(config, env=env).start()


def _rewrite(code: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        code = code.replace(old, new)
    return code


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_page_snippets_run(page, s3_endpoint, s3_client, monkeypatch):
    """Run every snippet of ``page`` that is not marked ``not run``, in order."""
    _put_dataset(s3_client)
    tmp = tempfile.mkdtemp(prefix="cpdoc-")  # short: the daemon's socket path must fit 108 bytes
    daemon = None
    try:
        table = substitutions(s3_endpoint, tmp)
        env = {
            "AWS_ENDPOINT_URL": s3_endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "OBS_ENDPOINT": s3_endpoint,  # the OBS SDK talks to the same moto server
            "OBS_ACCESS_KEY_ID": "testing",
            "OBS_SECRET_ACCESS_KEY": "testing",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("CACHEPIPE_SOCKET", raising=False)  # read by the daemon's config too: set only with the test's daemon
        daemon = _daemon_for(page, tmp, s3_endpoint, env)
        if daemon is not None:
            monkeypatch.setenv("CACHEPIPE_SOCKET", table["/run/cachepipe/cachepipe.sock"])
        shell_env = dict(os.environ)
        shell_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{shell_env.get('PATH', '')}"
        shell_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), shell_env.get("PYTHONPATH")]))
        namespace: dict = {"__name__": "__docs__", **STUBS}
        for block in blocks(page):
            if block.skip is not None:
                continue
            code = _rewrite(block.code, table)
            if block.lang == "python":
                try:
                    exec(compile(code, block.where(), "exec"), namespace)  # noqa: S102 - the docs' own examples
                except Exception as exc:  # noqa: BLE001 - any error of a snippet fails the test, naming the snippet
                    pytest.fail(f"snippet at {block.where()} failed: {exc!r}\n{code}")
            else:
                proc = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", SHELL_STUBS + code],
                    env=shell_env,
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                    timeout=180,
                    check=False,
                )
                assert proc.returncode == 0, (
                    f"snippet at {block.where()} exited {proc.returncode}\n{code}\n"
                    f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
                )
    finally:
        if daemon is not None:
            try:
                status, log = daemon.stop(), daemon.log()
            finally:
                daemon.close()
            assert status == 0, log
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the docs extra's pins (mkdocs-material 9.8) need Python 3.11")
def test_mkdocs_build_strict(tmp_path):
    """The site builds with --strict (broken links, pages left out of the nav, API objects not found)."""
    mkdocs = [sys.executable, "-m", "mkdocs"]  # the docs extra, part of the test extra that `make test` installs
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*mkdocs, "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()
    assert not (ROOT / "site").exists()


def test_readme_is_short_and_links_stay_in_the_repo():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    assert len(text.splitlines()) <= 80
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links
    for link in links:
        assert "://" not in link and not link.startswith("/"), link
        assert (ROOT / link.split("#")[0]).exists(), link


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_cli_reference_lists_every_command_and_map_option():
    from cachepipe.cli import _parser

    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    commands = _subparsers(_parser())
    assert "map" in commands
    for name in commands:
        assert f"`cachepipe {name}" in page, f"command {name!r} missing from docs/reference/cli.md"
    for action in commands["map"]._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}" in page, f"map option {flag} missing from docs/reference/cli.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_fences_are_closed(page):
    """An unclosed fence turns the rest of a page into one code block (and hides its snippets)."""
    fences = [n for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: a code fence is not closed (fences on lines {fences})"


def test_systemd_install_steps_leave_the_config_readable_by_the_service_user():
    """docs/service/systemd.md's install block is not run (root, systemd), but its steps that make
    /etc/cachepipe and the config are, in a temporary folder, with a group standing for
    ``cachepipe``: the service's user (in that group only) must read the config. They made the
    folder 0750 root:root, so the user could not reach the file (``config file ...: cannot read
    it: Permission denied``, exit 78, and RestartPreventExitStatus=78 keeps it down)."""
    import grp
    import pwd

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a step as another user")
    group = next((g for g in ("daemon", "adm", "users") if _has_group(g)), None)
    if group is None:
        pytest.skip("no group to stand for cachepipe's")
    (block,) = [b for b in blocks(ROOT / "docs" / "service" / "systemd.md") if "install -d" in b.code]
    tmp = tempfile.mkdtemp(prefix="cpsysd-")
    try:
        os.chmod(tmp, 0o755)  # noqa: S103 - (mkdtemp makes it 0700) the user reaches what the steps make in it
        etc = f"{tmp}/etc/cachepipe"
        os.makedirs(os.path.dirname(etc))
        steps = [line for line in block.code.splitlines() if "/etc/cachepipe" in line]
        assert steps and any(line.startswith("install -d") for line in steps), block.code
        script = "\n".join(steps)
        script = script.replace("/opt/cachepipe/bin/cachepipe", "cachepipe").replace("/etc/cachepipe", etc)
        script = re.sub(r"(chgrp|-g) cachepipe\b", rf"\1 {group}", script)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env["PYTHONPATH"] = str(ROOT)
        made = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert made.returncode == 0, made.stderr
        user = pwd.getpwnam("nobody").pw_uid
        gid = grp.getgrnam(group).gr_gid
        read = subprocess.run(
            ["setpriv", f"--reuid={user}", f"--regid={gid}", "--clear-groups", "head", "-c", "10", f"{etc}/cachepipe.yaml"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert read.returncode == 0, f"the service's user cannot read the config the steps made: {read.stderr}\n{script}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _has_group(name: str) -> bool:
    import grp

    try:
        return grp.getgrnam(name).gr_gid != 0
    except KeyError:
        return False
