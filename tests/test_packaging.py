"""The package a user installs: a real sdist and wheel, built, checked by twine and installed.

Built once per module (a few seconds, no network: the build runs in this interpreter with
`--no-isolation`) from a copy of the files the sdist needs, so the worktree gets no build/ or
egg-info. `python -m build` builds the wheel from the sdist, as pip does from an sdist.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from cachepipe.cli import main

ROOT = Path(__file__).resolve().parent.parent
# what the build reads; cachepipe/data/ holds symlinks into systemd/ and config/
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "cachepipe", "systemd", "config")
# the shipped file in the package -> its one source in the repository
SHIPPED = {
    "cachepipe.service": ROOT / "systemd" / "cachepipe.service",
    "cachepipe@.service": ROOT / "systemd" / "cachepipe@.service",
    "cachepipe.yaml": ROOT / "config" / "cachepipe.yaml",
}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """Build the sdist and the wheel; returns (sdist, wheel, build output)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        check=False,
        cwd=src,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    (sdist,) = out.glob("cachepipe-*.tar.gz")
    (wheel,) = out.glob("cachepipe-*.whl")
    return sdist, wheel, output


def test_the_build_warns_about_nothing_and_twine_check_passes(dist):
    sdist, wheel, output = dist
    # e.g. setuptools' SetuptoolsDeprecationWarning for the table form of `license`
    warnings = [line for line in output.splitlines() if "Warning" in line or "deprecated" in line.lower()]
    assert not warnings, output
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_metadata_declares_the_license_and_classifiers(dist):
    _, wheel, _ = dist
    with zipfile.ZipFile(wheel) as whl:
        (meta_name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(meta_name))
        licence = whl.read(meta_name.replace("METADATA", "licenses/LICENSE"))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert licence == (ROOT / "LICENSE").read_bytes()
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert "Typing :: Typed" in classifiers
    assert meta["Requires-Python"] == ">=3.10"
    # no invented project URL
    assert meta.get_all("Project-URL") is None


def test_sdist_and_wheel_ship_the_units_and_the_config_byte_for_byte(dist):
    sdist, wheel, _ = dist
    with zipfile.ZipFile(wheel) as whl:
        shipped = {n.rsplit("/", 1)[1]: whl.read(n) for n in whl.namelist() if n.startswith("cachepipe/data/")}
        assert "cachepipe/py.typed" in whl.namelist()
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        in_sdist = {}
        for name in SHIPPED:
            member = tar.getmember(f"{root}/cachepipe/data/{name}")
            assert member.isfile(), f"{name} is a {member.type!r} in the sdist, not a copy"
            in_sdist[name] = tar.extractfile(member).read()
    for name, source in SHIPPED.items():
        assert shipped[name] == source.read_bytes(), name
        assert in_sdist[name] == source.read_bytes(), name
    # every unit in systemd/ is shipped
    assert {p.name for p in (ROOT / "systemd").iterdir()} <= set(shipped)


def test_installed_wheel_prints_the_shipped_files(dist, tmp_path):
    """The console script of the installed wheel, with the worktree off sys.path."""
    _, wheel, _ = dist
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-compile",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # dependencies (pydantic...) from this environment; cachepipe from the wheel: PYTHONPATH comes before
    # the environment's site-packages and its editable-install finder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if Path(p).resolve() != ROOT)

    def run(*args):
        return subprocess.run(
            [sys.executable, str(target / "bin" / "cachepipe"), *args], capture_output=True, check=False, cwd=tmp_path, env=env
        )

    where = subprocess.run(
        [sys.executable, "-c", "import cachepipe; print(cachepipe.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    )
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout
    proc = run("print-unit")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == SHIPPED["cachepipe.service"].read_bytes()
    proc = run("print-config")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == SHIPPED["cachepipe.yaml"].read_bytes()


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["print-unit"], "cachepipe.service"),
        (["print-unit", "cachepipe.service"], "cachepipe.service"),
        (["print-unit", "cachepipe@"], "cachepipe@.service"),
        (["print-unit", "cachepipe@.service"], "cachepipe@.service"),
        (["print-config"], "cachepipe.yaml"),
    ],
)
def test_print_commands_print_the_repository_files(capsysbinary, args, name):
    assert main(args) == 0
    assert capsysbinary.readouterr().out == SHIPPED[name].read_bytes()


def test_print_unit_names_the_units_when_asked_for_an_unknown_one(capsys):
    assert main(["print-unit", "cachepipe-foo"]) == 2
    err = capsys.readouterr().err
    assert "'cachepipe-foo'" in err
    assert "cachepipe.service, cachepipe@.service" in err
