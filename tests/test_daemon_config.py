"""The daemon's config file: validation errors name the field path, the value and what is expected;
environment overrides; the commented example documents every field."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cachepipe import ConfigError, PipelineConfig
from cachepipe.config import Share
from cachepipe.service.config import DEFAULT_SOCKET, ServiceConfig, load_config, read_config_file

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "cachepipe.yaml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.upper().startswith("CACHEPIPE_"):
            monkeypatch.delenv(key)


def write(tmp_path: Path, data, name: str = "cachepipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def minimal(tmp_path: Path, **pipeline) -> dict:
    return {"pipelines": {"train": {"source": "s3://b/p/", "cache_dir": str(tmp_path / "c"), "capacity": "1GiB", **pipeline}}}


def error_of(tmp_path: Path, data) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data))
    return str(info.value)


def test_minimal_config_gets_the_daemon_defaults(tmp_path):
    cfg = load_config(write(tmp_path, minimal(tmp_path)))
    assert cfg.socket == DEFAULT_SOCKET and cfg.socket_mode == 0o660 and cfg.tcp_port is None
    train = cfg.pipelines["train"]
    assert isinstance(train, PipelineConfig)
    assert train.capacity == 1024**3
    assert train.lease_timeout == 600 and train.keep_on_close is True
    if "resume" in PipelineConfig.model_fields:
        assert train.resume is True


def test_a_small_capacity_without_a_unit_is_warned_about_as_written(tmp_path, caplog):
    """Before, the daemon built each pipeline from the parsed bytes, so "512KiB" was warned about
    as if written without a unit ("capacity 524288 is 524288 bytes"), and a job's worked-out
    share likewise. Now the file's own value is checked at load, naming its field."""
    from cachepipe import Pipeline
    from cachepipe.service.config import pipeline_options

    data = minimal(tmp_path, capacity=100)
    data["pipelines"]["b"] = {"source": "s3://b/q/", "cache_dir": str(tmp_path / "d"), "capacity": "512KiB"}
    data["jobs"] = {"root": str(tmp_path / "jobs"), "capacity": "900"}
    path = write(tmp_path, data)
    with caplog.at_level("WARNING", logger="cachepipe"):
        cfg = load_config(path)
        Pipeline(**pipeline_options(cfg.pipelines["b"]))
    advice = "a size without a unit is in bytes; if you meant more, give a unit like '100MiB' or '100GiB', or a share like '80%'"
    assert [r.getMessage() for r in caplog.records] == [
        f"pipelines.train.capacity in {path}: capacity 100 is 100 bytes, less than 1 MiB: {advice}",
        f"jobs.capacity in {path}: capacity '900' is 900 bytes, less than 1 MiB: {advice}",
    ]


def test_a_small_capacity_set_by_the_environment_is_warned_about_naming_the_variable(tmp_path, caplog, monkeypatch):
    """An override of a capacity by a ``CACHEPIPE_*`` variable is what the daemon uses: a small
    one without a unit is warned about, naming the variable (before, nothing was said)."""
    data = minimal(tmp_path, capacity="1GiB")
    data["jobs"] = {"root": str(tmp_path / "jobs"), "capacity": "1GiB"}
    path = write(tmp_path, data)
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__CAPACITY", "512")
    monkeypatch.setenv("cachepipe_jobs__capacity", "2GiB")  # a unit: nothing to say
    with caplog.at_level("WARNING", logger="cachepipe"):
        cfg = load_config(path)
    assert cfg.pipelines["train"].capacity == 512 and cfg.jobs.capacity == 2 * 1024**3
    advice = "a size without a unit is in bytes; if you meant more, give a unit like '100MiB' or '100GiB', or a share like '80%'"
    variable = "CACHEPIPE_PIPELINES__TRAIN__CAPACITY"
    said = "capacity '512' is 512 bytes, less than 1 MiB"
    assert [r.getMessage() for r in caplog.records] == [
        f"jobs.capacity in {path} is overridden by the environment variable cachepipe_jobs__capacity",
        f"pipelines.train.capacity in {path} is overridden by the environment variable {variable}",
        f"pipelines.train.capacity set by the environment variable {variable}: {said}: {advice}",
    ]


def test_daemon_defaults_yield_to_explicit_values(tmp_path):
    cfg = load_config(write(tmp_path, minimal(tmp_path, lease_timeout=None, keep_on_close=False)))
    assert cfg.pipelines["train"].lease_timeout is None and cfg.pipelines["train"].keep_on_close is False


@pytest.mark.parametrize(
    ("pipeline", "path", "value", "expected"),
    [
        ({"capacity": "10X"}, "pipelines.train.capacity", "'10X'", "expected a positive number of bytes"),
        ({"capacity": -5}, "pipelines.train.capacity", "-5", "expected"),
        ({"max_concurrency": "many"}, "pipelines.train.max_concurrency", "'many'", "valid integer"),
        ({"max_concurrency": 0}, "pipelines.train.max_concurrency", "0", "greater than or equal to 1"),
        ({"items": "dirs"}, "pipelines.train.items", "'dirs'", "'folders' or 'files'"),
        ({"part_size": "big"}, "pipelines.train.part_size", "'big'", "size like '50GiB'"),
        ({"lease_timeout": 0}, "pipelines.train.lease_timeout", "0", "greater than 0"),
        ({"colour": "red"}, "pipelines.train.colour", "'red'", "unknown key; expected one of: source, cache_dir, capacity"),
    ],
)
def test_bad_pipeline_values_name_path_value_and_expectation(tmp_path, pipeline, path, value, expected):
    message = error_of(tmp_path, minimal(tmp_path, **pipeline))
    assert str(tmp_path) in message.splitlines()[0]
    line = next(line for line in message.splitlines() if path in line)
    assert f"{path} = {value}" in line and expected in line, message


@pytest.mark.parametrize(
    ("top", "fragment"),
    [
        ({"socket_mode": 660}, "socket_mode = 660: socket_mode 660: a number is read as decimal, and 660 is no mode"),
        ({"socket_mode": "rw"}, "socket_mode = 'rw'"),
        ({"tcp_port": 70000}, "tcp_port = 70000: Input should be less than or equal to 65535"),
        ({"log_level": "loud"}, "log_level = 'loud': Input should be 'debug', 'info', 'warning' or 'error'"),
        ({"status_interval": "often"}, "status_interval = 'often'"),
        ({"sockets": "/x"}, "sockets = '/x': unknown key; did you mean 'socket'? expected one of: socket, socket_mode"),
        ({"socket": "relative.sock"}, "socket = 'relative.sock': expected an absolute path"),
        ({"socket": "/" + "s" * 120}, "expected a path of at most 107 bytes"),
        ({"max_wait": float("nan")}, "max_wait = nan: Input should be a finite number"),
    ],
)
def test_bad_daemon_values(tmp_path, top, fragment):
    assert fragment in error_of(tmp_path, {**minimal(tmp_path), **top})


def test_missing_and_empty(tmp_path):
    assert "no pipelines and no jobs section" in error_of(tmp_path, {"log_level": "info"})
    assert "no pipelines and no jobs section" in error_of(tmp_path, {"pipelines": {}})
    message = error_of(tmp_path, {"pipelines": {"train": {"source": "s3://b/"}}})
    assert "pipelines.train.cache_dir: required, not set" in message and "pipelines.train.capacity: required, not set" in message


def test_every_problem_is_reported_at_once(tmp_path):
    message = error_of(tmp_path, {**minimal(tmp_path, capacity="10X", items="dirs"), "log_level": "loud"})
    assert len(message.splitlines()) == 4  # the heading + three problems


def test_a_relative_path_is_reported_with_the_other_problems(tmp_path, capsys):
    """A relative ``cache_dir``, ``source`` or ``socket`` was checked by the model's own validator,
    which pydantic runs only once every field is valid: with a bad capacity beside it, ``serve
    --check`` named the capacity alone, and the relative path only after it was fixed."""
    from cachepipe.cli import main

    data = {**minimal(tmp_path, source="data/train/", cache_dir="cache", capacity="10GiBB"), "socket": "api.sock"}
    message = error_of(tmp_path, data)
    lines = message.splitlines()
    assert lines[2].startswith("  pipelines.train.source = 'data/train/': a relative local path; the daemon would"), message
    assert [*lines[1:2], *lines[3:]] == [
        "  socket = 'api.sock': expected an absolute path",
        (
            "  pipelines.train.cache_dir = 'cache': expected an absolute path; the daemon would make it in its own working "
            "directory ('/' under systemd), not in the folder of its config file or of the shell that checks it"
        ),
        (
            "  pipelines.train.capacity = '10GiBB': capacity '10GiBB': expected a positive number of bytes or a size like "
            "'50GiB', '1.5GB', '512M', '1g', or a share of free disk space like '80%'"
        ),
    ], message
    assert main(["serve", "--check", "--config", str(tmp_path / "cachepipe.yaml")]) == 78
    assert capsys.readouterr().err.rstrip("\n").splitlines()[1:] == message.splitlines()[1:]
    jobs = error_of(tmp_path, {"jobs": {"root": "jobs", "capacity": "lots"}}).splitlines()[1:]
    assert [line.split(":")[0] for line in jobs] == ["  jobs.root = 'jobs'", "  jobs.capacity = 'lots'"], jobs


def test_pipeline_names_and_cache_dirs(tmp_path):
    data = minimal(tmp_path)
    data["pipelines"]["Train"] = data["pipelines"].pop("train")
    assert "pipeline name 'Train': expected 1-63 lowercase letters" in error_of(tmp_path, data)
    rel = minimal(tmp_path, cache_dir="relative/cache")
    assert "pipelines.train.cache_dir = 'relative/cache': expected an absolute path" in error_of(tmp_path, rel)
    both = minimal(tmp_path)
    both["pipelines"]["val"] = {**both["pipelines"]["train"], "cache_dir": str(tmp_path / "c" / "val")}
    assert "overlaps pipelines.train.cache_dir" in error_of(tmp_path, both)


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__CAPACITY", "10GiB")
    monkeypatch.setenv("CACHEPIPE_SOCKET", "/run/x/train.sock")
    monkeypatch.setenv("CACHEPIPE_LOG_LEVEL", "debug")
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__STORAGE_OPTIONS", '{"endpoint_url": "http://h:9000"}')
    cfg = load_config(write(tmp_path, minimal(tmp_path)))
    assert cfg.pipelines["train"].capacity == 10 * 1024**3
    assert cfg.pipelines["train"].source == "s3://b/p/"  # the rest of the pipeline still comes from the file
    assert cfg.pipelines["train"].storage_options == {"endpoint_url": "http://h:9000"}
    assert cfg.socket == Path("/run/x/train.sock") and cfg.log_level == "debug"


def test_error_from_the_environment_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__CAPACITY", "lots")
    message = error_of(tmp_path, minimal(tmp_path))
    assert "pipelines.train.capacity = 'lots'" in message
    assert "(set by the environment variable CACHEPIPE_PIPELINES__TRAIN__CAPACITY)" in message


def test_an_environment_value_that_is_not_json_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__STORAGE_OPTIONS", '{"endpoint_url": "http://x"')
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__CAPACITY", "2GiB")  # a good one beside it is not blamed
    message = error_of(tmp_path, minimal(tmp_path))
    assert "pipelines: the environment variable CACHEPIPE_PIPELINES__TRAIN__STORAGE_OPTIONS cannot be parsed" in message
    assert "Expecting ',' delimiter" in message and "must be JSON" in message


def test_a_rank_outside_the_world_size_is_refused_with_the_file(tmp_path):
    message = error_of(tmp_path, minimal(tmp_path, rank=5, world_size=2))
    assert "pipelines.train" in message and "rank 5 with world_size 2: expected 0 <= rank < world_size" in message
    assert load_config(write(tmp_path, minimal(tmp_path, rank=1, world_size=2))).pipelines["train"].rank == 1
    with pytest.raises(ValueError, match="rank 2 with world_size 2"):
        PipelineConfig(source="s3://b/p/", cache_dir=str(tmp_path / "c"), capacity="1GiB", rank=2, world_size=2)


def test_a_socket_group_may_be_a_number_written_unquoted(tmp_path):
    assert load_config(write(tmp_path, "socket_group: 0\n" + yaml.safe_dump(minimal(tmp_path)))).socket_group == "0"


def test_share_capacity_and_octal_modes(tmp_path):
    cfg = load_config(write(tmp_path, {**minimal(tmp_path, capacity="80%"), "socket_mode": "0640"}))
    assert cfg.pipelines["train"].capacity == Share(0.8) and cfg.socket_mode == 0o640
    assert load_config(write(tmp_path, "socket_mode: 0600\n" + yaml.safe_dump(minimal(tmp_path)))).socket_mode == 0o600


def test_a_socket_mode_written_as_a_decimal_number_is_refused_naming_the_text_to_write(tmp_path):
    # YAML reads an unquoted 440 as four hundred and forty: the daemon gave its socket the mode
    # 0670 (= 440) where 0440 was meant, without a word.
    message = error_of(tmp_path, "socket_mode: 440\n" + yaml.safe_dump(minimal(tmp_path)))
    assert (
        "socket_mode = 440: socket_mode 440: a number is read as decimal, and 440 is the mode 0670, not 0440: "
        'write the mode quoted, as text: socket_mode: "0440" (or "0670" if that was meant)'
    ) in message
    for written in ('"440"', '"0440"', "0440", '"0o440"'):  # as text, or with the leading 0 YAML reads as octal
        assert load_config(write(tmp_path, f"socket_mode: {written}\n" + yaml.safe_dump(minimal(tmp_path)))).socket_mode == 0o440
    base = f'[pipelines.train]\nsource = "s3://b/"\ncache_dir = "{tmp_path}/c"\ncapacity = "2GiB"\n'
    with pytest.raises(ConfigError, match=r'socket_mode 432: .* is the mode 0660, not 0432: .*"0432" \(or "0660" if'):
        load_config(write(tmp_path, "socket_mode = 0o660\n" + base, "c.toml"))  # TOML keeps no spelling either
    assert load_config(write(tmp_path, 'socket_mode = "0660"\n' + base, "c.toml")).socket_mode == 0o660


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read it"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+: expected ',' or ']'"):
        load_config(write(tmp_path, "pipelines:\n  train: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"duplicate key 'capacity'"):
        load_config(write(tmp_path, "pipelines:\n  train:\n    capacity: 1g\n    capacity: 2g\n"))
    with pytest.raises(ConfigError, match=r"expected a mapping of settings at the top, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"unknown key"):
        load_config(write(tmp_path, {**minimal(tmp_path), "_env_file": "/etc/passwd"}))


def test_toml(tmp_path):
    path = write(
        tmp_path,
        f'log_level = "warning"\n[pipelines.train]\nsource = "s3://b/"\ncache_dir = "{tmp_path}/c"\ncapacity = "2GiB"\n',
        "c.toml",
    )
    cfg = load_config(path)
    assert cfg.log_level == "warning" and cfg.pipelines["train"].capacity == 2 * 1024**3
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "pipelines = [", "bad.toml"))


def test_the_example_is_valid_and_documents_every_field():
    cfg = load_config(EXAMPLE)
    assert set(cfg.pipelines) == {"train", "val"}
    text = EXAMPLE.read_text()
    documented = set(re.findall(r"^\s*#?\s*([a-z_]+):", text, flags=re.MULTILINE))
    missing = (set(ServiceConfig.model_fields) | set(PipelineConfig.model_fields)) - documented
    assert not missing, f"config/cachepipe.yaml does not document: {sorted(missing)}"
    assert read_config_file(EXAMPLE)["pipelines"]["train"].keys() >= set(PipelineConfig.model_fields)


@pytest.mark.parametrize("field", ["socket", "cache_dir"])
def test_a_folder_that_cannot_be_created_after_the_host_check_is_named_by_its_field(tmp_path, field):
    """Root may write anywhere as far as access(2) says, but not make a folder in /proc: the host
    check passed it, and serve then stopped with a bare FileNotFoundError naming no field (later
    named, exit 1). The host check now tries a folder there, and knows /proc's filesystem: exit 78,
    naming the field, for root as for any user."""
    data = minimal(tmp_path, source="memory://cachepipe-test-none")
    data["socket"] = str(tmp_path / "api.sock")
    where = "/proc/cachepipe-test-no-such-folder"
    if field == "socket":
        data["socket"] = f"{where}/api.sock"
    else:
        data["pipelines"]["train"]["cache_dir"] = f"{where}/c"
    proc = subprocess.run(
        [sys.executable, "-m", "cachepipe.cli", "serve", "--config", str(write(tmp_path, data))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 78 and field in proc.stderr and where in proc.stderr, proc.stderr
    named = (
        f"socket '{where}/api.sock': its directory: cannot be created: '/proc' is on a proc filesystem"
        if field == "socket"
        else f"pipelines.train.cache_dir '{where}/c': cannot be created: '/proc' is on a proc filesystem"
    )
    if os.geteuid() == 0:  # another user is refused by the rights first
        assert named in proc.stderr, proc.stderr


def test_serve_refuses_a_bad_config_with_exit_status_78(tmp_path):
    path = write(tmp_path, minimal(tmp_path, capacity="10X"))
    for args in (["serve", "--config", str(path)], ["serve", "--check", "--config", str(path)]):
        proc = subprocess.run(
            [sys.executable, "-m", "cachepipe.cli", *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 78, proc.stderr
        assert "pipelines.train.capacity = '10X'" in proc.stderr
    import grp
    import os

    here = {  # the example's paths and group, moved to what this test host has (--check checks the host too)
        "CACHEPIPE_SOCKET": str(tmp_path / "run" / "cachepipe.sock"),
        "CACHEPIPE_SOCKET_GROUP": grp.getgrgid(os.getegid()).gr_name,
        "CACHEPIPE_PIPELINES__TRAIN__CACHE_DIR": str(tmp_path / "train"),
        "CACHEPIPE_PIPELINES__VAL__CACHE_DIR": str(tmp_path / "val"),
    }
    ok = subprocess.run(
        [sys.executable, "-m", "cachepipe.cli", "serve", "--check", "--config", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **here},
    )
    assert ok.returncode == 0 and "valid" in ok.stdout, ok.stderr


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ("pipeline", "pipelines.train.world_size = 2: rank 5 with world_size 2"),
        ("retain", "pipelines.train.unpack = True: unpack with retain='auto' is not supported yet"),
        ("jobs", "jobs: jobs.options.colour: not a pipeline option"),
    ],
)
def test_a_refused_combination_never_echoes_the_storage_options(tmp_path, data, fragment):
    """A check of several options at once (a model validator) had every option of its section as
    its input, and the message showed it: the storage options' credentials in the daemon's log."""
    secret = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-do-not-print"}
    if data == "pipeline":
        config = minimal(tmp_path, rank=5, world_size=2, storage_options=secret)
    elif data == "retain":
        config = minimal(tmp_path, retain="auto", unpack=True, storage_options=secret)
    else:
        jobs = {"root": str(tmp_path / "jobs"), "capacity": "1GiB", "options": {"storage_options": secret, "colour": 1}}
        config = {"jobs": jobs}
    message = error_of(tmp_path, config)
    assert fragment in message, message
    assert "s3cr3t" not in message and "AKIAEXAMPLE" not in message, message
    if data != "jobs":
        options = {k: v for k, v in config["pipelines"]["train"].items() if k not in ("source", "cache_dir", "capacity")}
        with pytest.raises(ValueError, match=r"rank 5|not supported yet") as info:
            PipelineConfig(source="s3://b/p/", cache_dir=str(tmp_path / "c"), capacity="1GiB", **options)
        assert "s3cr3t" not in str(info.value), info.value


@pytest.mark.parametrize(
    ("where", "value", "fragment"),
    [
        ("pipeline", "key=AKIAEXAMPLE secret=s3cr3t", "pipelines.train.storage_options: Input should be a valid dictionary"),
        ("pipeline", ["AKIAEXAMPLE", "s3cr3t"], "pipelines.train.storage_options: Input should be a valid dictionary"),
        ("pipeline", {"key": "AKIAEXAMPLE", 5: "s3cr3t"}, "pipelines.train.storage_options.5: Input should be a valid string"),
        ("misspelt", {"key": "AKIAEXAMPLE", "secret": "s3cr3t"}, "pipelines.train.storage_option: unknown key; did you mean"),
        ("beside", "s3cr3t", "pipelines.train.secret: unknown key; did you mean 'seed'?"),  # s3fs's name, beside the options
        ("section", "storage_options: {secret: s3cr3t}", "pipelines.train: Input should be a valid dictionary"),
        ("jobs", "storage_options=AKIAEXAMPLE:s3cr3t", "jobs.options: Input should be a valid dictionary"),
        ("jobs", {"storage_options": ["AKIAEXAMPLE", "s3cr3t"]}, "jobs.options.storage_options: Input should be a valid"),
        ("environment", '["AKIAEXAMPLE", "s3cr3t"]', "storage_options: Input should be a valid dictionary (set by the"),
    ],
)
def test_storage_options_of_a_wrong_type_are_not_echoed(tmp_path, monkeypatch, where, value, fragment):
    """A refused value was shown (``pipelines.train.storage_options = 'key=... secret=...': Input
    should be a valid dictionary``) by ``serve --check``, ``serve`` and a reload's log line:
    ``storage_options`` or ``jobs.options`` given as a string or a list held the secret key."""
    config = minimal(tmp_path)
    if where == "pipeline":
        config["pipelines"]["train"]["storage_options"] = value
    elif where == "misspelt":
        config["pipelines"]["train"]["storage_option"] = value
    elif where == "beside":
        config["pipelines"]["train"]["secret"] = value
    elif where == "section":
        config["pipelines"]["train"] = value
    elif where == "jobs":
        config = {"jobs": {"root": str(tmp_path / "jobs"), "capacity": "1GiB", "options": value}}
    else:
        monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__STORAGE_OPTIONS", value)
    message = error_of(tmp_path, config)
    assert fragment in message, message
    assert "s3cr3t" not in message and "AKIAEXAMPLE" not in message, message


# ---- what the environment does to the file, said by serve --check and serve ----------------
def serve_cli(path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cachepipe serve [args] --config path``, with ``env`` added to this (CACHEPIPE_-free) environment."""
    return subprocess.run(
        [sys.executable, "-m", "cachepipe.cli", "serve", *args, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_a_setting_of_the_file_that_the_environment_overrides_is_said_by_check_and_serve(tmp_path, short_dir):
    """``CACHEPIPE_SOCKET``, exported for the clients, moved the daemon's socket away from the
    file's without a word: ``--check`` said "valid; socket <the variable's>", and a second daemon
    started from that shell failed on a socket its config does not name."""
    from cachepipe.service.testing import DaemonProcess

    path = write(tmp_path, {"socket": str(short_dir / "file.sock"), "jobs": {"root": str(tmp_path / "jobs"), "capacity": "1GiB"}})
    env = {"CACHEPIPE_SOCKET": str(short_dir / "env.sock"), "CACHEPIPE_MAX_WAIT": "30"}
    overridden = f"WARNING cachepipe.service: socket in {path} is overridden by the environment variable CACHEPIPE_SOCKET"
    added = "INFO cachepipe.service: max_wait is set by the environment variable CACHEPIPE_MAX_WAIT"  # not in the file
    proc = serve_cli(path, "--check", env=env)
    assert proc.returncode == 0 and f"socket {short_dir / 'env.sock'};" in proc.stdout, proc.stderr
    assert proc.stdout.rstrip().endswith(
        f"; pipelines: none; jobs under {tmp_path / 'jobs'}, capacity 1073741824"
    )  # was "pipelines: "
    assert overridden in proc.stderr.splitlines() and added in proc.stderr.splitlines(), proc.stderr
    with DaemonProcess(path, env=env) as daemon:
        assert (short_dir / "env.sock").exists() and not (short_dir / "file.sock").exists()
        assert daemon.stop() == 0
        log = daemon.log().splitlines()
    assert overridden in log and added in log, log
    quiet = serve_cli(path, "--check")  # nothing set by the environment: nothing said
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_a_cachepipe_variable_that_names_no_setting_is_refused_saying_what_was_meant(tmp_path):
    """A top-level typo was ignored (``CACHEPIPE_LOGLEVEL=debug`` left the level at info), when a
    nested one (``CACHEPIPE_PIPELINES__TRAIN__CAPACTIY``) was refused; the variables that other
    commands read (``cachepipe map``'s, the clients' ``CACHEPIPE_SOCKET``) are not refused."""
    path = write(tmp_path, minimal(tmp_path))
    typos = {"CACHEPIPE_LOGLEVEL": "debug", "CACHEPIPE_MAXWAIT": "abc", "CACHEPIPE_TCP_PROT": "1", "CACHEPIPE_COLOUR": "red"}
    for args in (["--check"], []):
        proc = serve_cli(path, *args, env=typos)
        assert proc.returncode == 78, proc.stderr
        lines = proc.stderr.splitlines()
        assert lines[0] == f"invalid configuration in {str(path)!r}:", proc.stderr
        said = "(in the environment): names no setting of the daemon;"
        assert f"  CACHEPIPE_LOGLEVEL {said} did you mean CACHEPIPE_LOG_LEVEL?" in lines, proc.stderr
        assert f"  CACHEPIPE_MAXWAIT {said} did you mean CACHEPIPE_MAX_WAIT?" in lines, proc.stderr
        assert f"  CACHEPIPE_TCP_PROT {said} did you mean CACHEPIPE_TCP_PORT?" in lines, proc.stderr
        colour = next(line for line in lines if "CACHEPIPE_COLOUR" in line)
        assert "expected CACHEPIPE_ and a setting in capitals (SOCKET, SOCKET_MODE" in colour, colour
        assert "or a variable another command reads (CACHEPIPE_ITEM, CACHEPIPE_OUT" in colour, colour
    others = {"CACHEPIPE_ITEM": "/x", "CACHEPIPE_OUT": "/y", "CACHEPIPE_NAME": "a", "CACHEPIPE_WORLD_SIZE": "2"}
    proc = serve_cli(path, "--check", env={**others, "CACHEPIPE_SOCKET": str(tmp_path / "s.sock")})
    assert proc.returncode == 0, proc.stderr


def test_every_cachepipe_variable_read_in_this_repository_is_a_setting_or_known_to_the_daemon():
    """The daemon refuses a ``CACHEPIPE_*`` variable it does not know: every one that cachepipe,
    its tests, examples and benchmarks read must be a setting or in ``OTHER_VARIABLES``, or a
    daemon started where it is set would refuse to start."""
    from cachepipe.service.config import ENV_PREFIX, OTHER_VARIABLES

    root = EXAMPLE.parent.parent
    files = [p for folder in ("cachepipe", "tests", "examples", "benchmarks", "systemd") for p in (root / folder).rglob("*")]
    found: dict[str, Path] = {}
    for file in files:
        if file.is_file() and file.suffix in (".py", ".ipynb", ".yaml", ".service", ".sh") and file.name != Path(__file__).name:
            for name in re.findall(r"CACHEPIPE_[A-Z][A-Z0-9_]*", file.read_text(encoding="utf-8")):
                found.setdefault(name, file)
    assert "CACHEPIPE_ITEM" in found and "CACHEPIPE_SOCKET" in found  # the scan sees them
    settings = set(ServiceConfig.model_fields)
    unknown = {
        name: str(file)
        for name, file in found.items()
        if name not in OTHER_VARIABLES and name.removeprefix(ENV_PREFIX).split("__")[0].lower() not in settings
    }
    assert unknown == {}


def test_a_pipeline_made_by_the_environment_says_so(tmp_path):
    """``CACHEPIPE_PIPELINES__TRIAN__CAPACITY`` (a typo of train) makes a pipeline 'trian' of one
    setting; the refusal named its missing source without saying where 'trian' came from."""
    path = write(tmp_path, minimal(tmp_path))
    proc = serve_cli(path, "--check", env={"CACHEPIPE_PIPELINES__TRIAN__CAPACITY": "1GiB"})
    assert proc.returncode == 78, proc.stderr
    made = (
        "(pipelines.trian is made by the environment variable CACHEPIPE_PIPELINES__TRIAN__CAPACITY: "
        "the file has no pipelines.trian; did you mean 'train'?)"
    )
    assert f"  pipelines.trian.source: required, not set {made}" in proc.stderr.splitlines(), proc.stderr
    assert f"  pipelines.trian.cache_dir: required, not set {made}" in proc.stderr.splitlines(), proc.stderr


def test_an_unknown_key_says_which_key_was_meant(tmp_path):
    """The daemon listed the accepted keys of an unknown one, without the did-you-mean that
    ``Pipeline(lease_timout=5)`` gives."""
    data = {**minimal(tmp_path, lease_timout=5), "log_levl": "debug"}
    proc = serve_cli(write(tmp_path, data), "--check")
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.splitlines()
    assert any(
        line.startswith("  pipelines.train.lease_timout = 5: unknown key; did you mean 'lease_timeout'? expected one of: source,")
        for line in lines
    ), proc.stderr
    assert any(
        line.startswith("  log_levl = 'debug': unknown key; did you mean 'log_level'? expected one of: socket,") for line in lines
    ), proc.stderr
    from cachepipe import Pipeline

    with pytest.raises(ConfigError, match=r"lease_timout=5 is not an option of Pipeline; did you mean 'lease_timeout'\?"):
        Pipeline("s3://b/p/", tmp_path / "c", "1GiB", lease_timout=5)


# ---- a relative local source; the config's log level while it loads; jobs' options --------
def test_a_relative_local_source_is_refused_where_a_pipeline_keeps_it(tmp_path, monkeypatch):
    """``source: data/train/`` was read from the daemon's working directory: ``serve --check`` in
    the user's shell found the folder, and the service (working directory ``/`` under systemd)
    read another one, or none. ``Pipeline(...)``, a library in the user's own process, keeps it."""
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    (tmp_path / "data" / "train" / "a" / "x.bin").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)  # where the folder is: the shell that checks the file
    for source, expected in [
        ("data/train/", "expected an absolute path (such as /srv/data/train/), or a URL if an object store was meant"),
        ("file://data/train", "expected an absolute path after file:// (three slashes, such as file:///srv/data/train)"),
        ("~/data/train", f"expected the path written out (such as {Path.home()}/data/train): '~' is not expanded"),
    ]:
        message = error_of(tmp_path, minimal(tmp_path, source=source))
        assert f"pipelines.train.source = {source!r}: a relative local path; the daemon would read it from" in message
        assert expected in message, message
    jobs = {"root": str(tmp_path / "jobs"), "capacity": "1GiB", "sources": ["data/"]}
    assert "jobs.sources 'data/': a relative local path" in error_of(tmp_path, {"jobs": jobs})
    assert load_config(write(tmp_path, minimal(tmp_path, source=str(tmp_path / "data" / "train"))))
    from cachepipe import Pipeline

    with Pipeline("data/train/", tmp_path / "c", "1MiB") as pipe:
        assert [Path(p).name for p in pipe] == ["a"]


def test_the_config_log_level_applies_to_what_loading_logs(tmp_path, short_dir):
    """``log_level: warning`` left out the daemon's info lines but not those logged while its file
    loaded (a setting made by the environment): the level was set after loading."""
    from cachepipe.service.testing import DaemonProcess

    jobs = {"root": str(tmp_path / "jobs"), "capacity": "1GiB"}
    path = write(tmp_path, {"socket": str(short_dir / "file.sock"), "log_level": "warning", "jobs": jobs})
    env = {"CACHEPIPE_SOCKET": str(short_dir / "env.sock"), "CACHEPIPE_MAX_WAIT": "30"}
    overridden = f"WARNING cachepipe.service: socket in {path} is overridden by the environment variable CACHEPIPE_SOCKET"
    proc = serve_cli(path, "--check", env=env)
    assert proc.returncode == 0 and proc.stderr.splitlines() == [overridden], proc.stderr
    with DaemonProcess(path, env=env) as daemon:
        assert daemon.stop() == 0
        log = daemon.log().splitlines()
    assert log == [overridden], log  # no "max_wait is set by ...", no "serving", no "stopped"


def test_jobs_options_are_checked_when_the_file_loads(tmp_path):
    """``jobs.options`` were checked by name only; their values when a job registered."""
    jobs = {"root": str(tmp_path / "jobs"), "capacity": "1GiB", "options": {"max_concurrency": "many", "retries": -1}}
    message = error_of(tmp_path, {"jobs": jobs})
    assert "jobs.options.max_concurrency = 'many': Input should be a valid integer" in message, message
    assert "jobs.options.retries = -1: Input should be greater than or equal to 0" in message, message
    secret = {"storage_options": {"key": "AKIAEXAMPLE", "secret": "s3cr3t"}}
    message = error_of(tmp_path, {"jobs": {**jobs, "options": {**secret, "retries": "x"}}})
    assert "jobs.options.retries = 'x'" in message and "s3cr3t" not in message, message


def test_what_loading_logs_reaches_the_root_logger_once_at_the_level_and_is_written_if_a_check_fails(
    tmp_path, short_dir, monkeypatch, caplog, capsys
):
    """Review: held records also went on to the root logger's handlers while they were held (every
    level, below the file's log_level too), then again when replayed; and a check that failed with
    an exception other than ConfigError lost them (they were written before the change)."""
    import logging

    from cachepipe.service import main

    logger = logging.getLogger("cachepipe")
    level, propagate = logger.level, logger.propagate
    monkeypatch.setenv("CACHEPIPE_MAX_WAIT", "30")  # loading logs "max_wait is set by the environment..."
    said = "max_wait is set by the environment variable CACHEPIPE_MAX_WAIT"
    try:
        for log_level, times in (("info", 1), ("warning", 0)):
            caplog.clear()
            jobs = {"root": str(tmp_path / "jobs"), "capacity": "1GiB"}
            path = write(tmp_path, {"socket": str(short_dir / "s.sock"), "log_level": log_level, "jobs": jobs})
            with caplog.at_level(logging.DEBUG, logger="cachepipe"):
                assert main.check(path) == 0
            assert [r.getMessage() for r in caplog.records].count(said) == times, (log_level, caplog.records)
            assert logger.propagate is propagate
        capsys.readouterr()

        def fails(config):
            raise RuntimeError("a check that failed itself")

        monkeypatch.setattr(main, "host_problems", fails)
        with pytest.raises(RuntimeError, match="a check that failed itself"):
            main.check(path)
        assert f"INFO cachepipe.service: {said}" in capsys.readouterr().err
        assert logger.propagate is propagate
    finally:
        logger.setLevel(level)


def test_a_prepare_hook_in_the_file_says_a_config_cannot_hold_code(tmp_path):
    """``prepare: mymodule.fn`` (a hook named as text) was refused as pydantic says it, "Input
    should be callable", which does not say what to write: a file cannot hold a callable."""
    message = error_of(tmp_path, minimal(tmp_path, prepare="mymodule.fn"))
    assert "pipelines.train.prepare = 'mymodule.fn': a Python callable, which a config file cannot hold" in message
    assert "leave it out" in message and "Pipeline(prepare=...)" in message, message
