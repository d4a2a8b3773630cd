"""The daemon's configuration: one file (YAML, or TOML by its ``.toml`` suffix), validated by
pydantic, every field overridable by a ``CACHEPIPE_...`` environment variable.

Environment variables win over the file; the value ``null`` sets a field to null, as in the
file (``CACHEPIPE_PIPELINES__TRAIN__EPOCHS=null``: endless). Nested fields are joined with ``__``::

    CACHEPIPE_SOCKET=/run/cachepipe/train.sock
    CACHEPIPE_PIPELINES__TRAIN__CAPACITY=10GiB
    CACHEPIPE_PIPELINES__TRAIN__STORAGE_OPTIONS='{"endpoint_url": "http://10.0.0.5:9000"}'

:func:`load_config` logs each field a variable sets (a warning when the file sets it too:
``CACHEPIPE_SOCKET`` is also the clients' variable, and moves the daemon's socket), and refuses
a ``CACHEPIPE_*`` variable that names no field and that no other command reads
(:data:`OTHER_VARIABLES`), which pydantic-settings would ignore.

Each pipeline is a :class:`cachepipe.PipelineConfig` (the same model ``Pipeline(...)`` uses); the
daemon only changes three defaults, filled in where the file and the environment say nothing:
``lease_timeout: 600`` (a consumer that died gives its item back), ``keep_on_close: true`` and
``resume: true`` (a restart continues the pass: published items are reused, acknowledged ones are
not delivered again).

Every error names the field path, the bad value and what is expected; :func:`load_config` raises
:class:`~cachepipe.errors.ConfigError` with one line per problem.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from ..config import PipelineConfig, check_absolute_source, secret_input, small_capacity, with_unit
from ..errors import ConfigError, closest
from .configfile import _MODE_RE, read_config_file
from .jobspec import JobsConfig, absolute_path

log = logging.getLogger("cachepipe.service")

__all__ = [
    "DEFAULT_SOCKET",
    "ENV_PREFIX",
    "OTHER_VARIABLES",
    "PIPELINE_DEFAULTS",
    "ServiceConfig",
    "load_config",
    "pipeline_options",
    "read_config_file",
]

ENV_PREFIX = "CACHEPIPE_"
OTHER_VARIABLES = {
    "CACHEPIPE_ITEM": "cachepipe map: the item, in the environment of its command",
    "CACHEPIPE_OUT": "cachepipe map: the item's output folder, in the environment of its command",
    "CACHEPIPE_NAME": "cachepipe map: the item's name, in the environment of its command",
    "CACHEPIPE_WORLD_SIZE": "cachepipe map: the number of processes sharing the source",
    "CACHEPIPE_SOAK_SEED": "the test suite's soak tests",
    "CACHEPIPE_SOAK_KILLS": "the test suite's soak tests",
    "CACHEPIPE_SOAK_EPOCHS": "the test suite's soak tests",
    "CACHEPIPE_CRASH_EXAMPLES": "the test suite's crash tests",
    "CACHEPIPE_EXAMPLE_URL": "the example notebook examples/modelarts_obs.ipynb",
    "CACHEPIPE_EXAMPLE_CACHE_DIR": "the example notebook examples/modelarts_obs.ipynb",
}
"""The ``CACHEPIPE_*`` variables that other commands read, which are no setting of the daemon:
:func:`load_config` refuses any other one that names no setting (``LOG_LEVEL`` misspelled).
``CACHEPIPE_SOCKET`` is a setting: the clients read it too, to find the daemon."""
DEFAULT_SOCKET = Path("/run/cachepipe/cachepipe.sock")
SOCKET_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
PIPELINE_DEFAULTS: dict[str, Any] = {"lease_timeout": 600.0, "keep_on_close": True, "resume": True}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name) or "__" in name:
        raise ValueError(
            f"pipeline name {name!r}: expected 1-63 lowercase letters, digits, '-' or '_' "
            "(no '__'), starting with a letter or digit"
        )
    return name


def _parse_mode(value: Any) -> int:
    """``socket_mode`` as text of octal digits (``"0660"``, ``"660"``, ``"0o660"``). A number is
    refused: YAML reads an unquoted ``440`` as the decimal 440 (the mode 0670, not the 0440 its
    digits spell), and a number from TOML or Python carries no spelling to check either
    (``_load_yaml`` passes YAML's own octal, a leading 0, as its text)."""
    bad = ValueError(f"socket_mode {value!r}: expected an octal permission like '0660' (quote it in YAML)")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        raise ValueError(_number_as_mode(value))  # noqa: TRY004 - pydantic reports a ValueError, not a TypeError
    if isinstance(value, str) and (match := _MODE_RE.match(value.strip())):
        mode = int(match.group(1), 8)
    else:
        raise bad
    if not 0 <= mode <= 0o777:
        raise bad
    return mode


def _number_as_mode(value: int) -> str:
    """Why ``socket_mode`` given as the number ``value`` is refused, and the text to write."""
    digits = _MODE_RE.match(str(value))
    spelled = f"{int(digits.group(1), 8):04o}" if digits and int(digits.group(1), 8) <= 0o777 else None
    decimal = f"{value:04o}" if 0 <= value <= 0o777 else None
    head = f"socket_mode {value}: a number is read as decimal"
    if decimal is None:
        example = f': socket_mode: "{spelled}"' if spelled else ', like socket_mode: "0660"'
        return f"{head}, and {value} is no mode (expected 0 to 0777): write the mode quoted, as text{example}"
    if spelled is None or spelled == decimal:
        return f'{head}, and {value} is the mode {decimal}: write the mode quoted, as text: socket_mode: "{decimal}"'
    return (
        f"{head}, and {value} is the mode {decimal}, not {spelled}: write the mode quoted, as text: "
        f'socket_mode: "{spelled}" (or "{decimal}" if that was meant)'
    )


class DaemonPipelineConfig(PipelineConfig):
    """A pipeline of the daemon: a :class:`~cachepipe.PipelineConfig` whose local ``source`` and
    ``cache_dir`` are absolute paths (``Pipeline(...)`` keeps relative ones, against its
    process's working directory; the daemon's is ``/`` under systemd). Checked with the other
    fields, not by a check of the whole config, which pydantic runs only once every field is
    valid: so ``serve --check`` names a relative path beside a bad capacity, not after it."""

    @field_validator("source")
    @classmethod
    def _absolute_source(cls, value: str) -> str:
        try:
            check_absolute_source(value)
        except ConfigError as exc:  # the field path and the value are said by format_errors
            raise ValueError(str(exc).removeprefix(f"source {value!r}: ")) from None
        return value

    @field_validator("cache_dir")
    @classmethod
    def _absolute_cache_dir(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(
                "expected an absolute path; the daemon would make it in its own working directory ('/' under "
                "systemd), not in the folder of its config file or of the shell that checks it"
            )
        return value


PipelineName = Annotated[str, AfterValidator(_check_name)]
SocketMode = Annotated[int, BeforeValidator(_parse_mode)]


def _group_name(value: Any) -> Any:
    """``socket_group`` as text: a group number written unquoted in YAML (``socket_group: 0``) is
    an int there, and names the same group as ``"0"``."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else value


class ServiceConfig(BaseSettings):
    """Everything ``cachepipe serve`` needs, validated. See ``config/cachepipe.yaml``.

    Attributes:
        socket: path of the Unix socket of the API (absolute, at most 107 bytes).
        socket_mode: permissions of the socket (default ``0660``: owner and group), given as
            octal text (``"0660"``); a number is refused (YAML and TOML read ``440`` as decimal).
        socket_group: group (name or number) given the socket, so that its members may take
            and acknowledge items; None: the daemon's own group.
        tcp_port: also serve the API on TCP at ``tcp_host:tcp_port`` (no authentication:
            anyone who can connect can take and evict items); None (default): no TCP listener.
        tcp_host: address of the TCP listener (default ``127.0.0.1``).
        markers: acknowledge an item when a consumer writes its lease into ``<item>/.done``
            (or creates it empty) or deletes the item (watched through inotify; default True).
        log_level: ``debug``, ``info`` (default), ``warning`` or ``error``.
        status_interval: seconds between two ``STATUS=`` updates to systemd (default 10).
        max_wait: longest a ``next`` request blocks before answering 408 (default 300 s).
        max_clients: most simultaneous API connections (default 256). When they are all taken,
            a new connection ends the one that has waited longest for its client (idle between
            requests, or still sending one); if every connection is busy (a request being
            answered, a ``next`` waiting for an item), the new one is answered 503.
        header_timeout: seconds a client has, from the first byte of a request, to send its
            request line and headers (default 10); then 408 and the connection is closed. Also
            the time it has to take an answer (then the connection is closed), and at most 2 s
            once the daemon stops (``STOP_GRACE``).
        body_timeout: seconds a client has, after the headers, to send the body (default 10).
        idle_timeout: longest a kept-alive connection may wait for its next request, and a new
            one for its first (default 300 s); then it is closed (``Client`` reconnects).
        pipelines: the served datasets by name (lowercase letters, digits, ``-``, ``_``).
        jobs: what training jobs may register through the API (see
            :class:`~cachepipe.service.jobspec.JobsConfig`); None (default): no jobs. A
            configuration needs ``pipelines``, ``jobs`` or both.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        case_sensitive=False,
        allow_inf_nan=False,
        env_parse_none_str="null",  # CACHEPIPE_PIPELINES__TRAIN__EPOCHS=null: endless, as `epochs: null` in the file
    )

    socket: Path = DEFAULT_SOCKET
    socket_mode: SocketMode = Field(default=0o660, validate_default=False)  # a number given is refused: _parse_mode
    socket_group: Annotated[str | None, BeforeValidator(_group_name)] = Field(default=None, min_length=1)
    tcp_port: int | None = Field(default=None, ge=0, le=65535)
    tcp_host: str = Field(default="127.0.0.1", min_length=1)
    markers: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    status_interval: float = Field(default=10.0, gt=0, le=3600)
    max_wait: float = Field(default=300.0, gt=0, le=86400)
    max_clients: int = Field(default=256, ge=1, le=65536)
    header_timeout: float = Field(default=10.0, gt=0, le=3600)
    body_timeout: float = Field(default=10.0, gt=0, le=3600)
    idle_timeout: float = Field(default=300.0, gt=0, le=86400)
    pipelines: dict[PipelineName, DaemonPipelineConfig] = Field(default_factory=dict)
    jobs: JobsConfig | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],  # noqa: ARG003 - pydantic-settings calls this hook with these names
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,  # noqa: ARG003 - pydantic-settings calls this hook with these names
        file_secret_settings: PydanticBaseSettingsSource,  # noqa: ARG003 - pydantic-settings calls this hook with these names
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's contents arrive as init kwargs; the environment overrides them.
        return (env_settings, init_settings)

    @model_validator(mode="before")
    @classmethod
    def _daemon_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("pipelines"), dict):
            return data
        known = PipelineConfig.model_fields
        pipelines = {}
        for name, options in data["pipelines"].items():
            if isinstance(options, dict):
                options = {**{k: v for k, v in PIPELINE_DEFAULTS.items() if k in known}, **options}  # noqa: PLW2901 - the loop value normalised on purpose
            pipelines[name] = options
        return {**data, "pipelines": pipelines}

    @field_validator("socket")
    @classmethod
    def _socket_path(cls, value: Path) -> Path:
        absolute_path(value)
        if len(os.fsencode(value)) > SOCKET_PATH_MAX:
            raise ValueError(f"expected a path of at most {SOCKET_PATH_MAX} bytes (a Unix socket limit)")
        return value

    @model_validator(mode="after")
    def _check_paths(self) -> ServiceConfig:
        if not self.pipelines and self.jobs is None:
            raise ValueError("no pipelines and no jobs section: expected at least one pipeline, or jobs to register")
        roots: dict[str, Path] = {}
        if self.jobs is not None:
            if self.jobs.root in self.socket.parents:
                raise ValueError(f"socket {str(self.socket)!r} is inside jobs.root: expected a path outside every cache")
            roots["jobs.root"] = Path(os.path.normpath(self.jobs.root))
        for name, cfg in self.pipelines.items():
            root = Path(os.path.normpath(cfg.cache_dir))  # absolute, as its source if local (DaemonPipelineConfig)
            for other, other_root in roots.items():
                if root == other_root or other_root in root.parents or root in other_root.parents:
                    raise ValueError(
                        f"pipelines.{name}.cache_dir {str(cfg.cache_dir)!r} overlaps {other} {str(other_root)!r}: "
                        "expected a separate directory per pipeline, and outside jobs.root"
                    )
            if root in self.socket.parents:
                raise ValueError(
                    f"socket {str(self.socket)!r} is inside pipelines.{name}.cache_dir: expected a path outside every cache"
                )
            roots[f"pipelines.{name}.cache_dir"] = root
        return self


def pipeline_options(cfg: PipelineConfig) -> dict[str, Any]:
    """Keyword arguments that build a :class:`cachepipe.Pipeline` from ``cfg`` (values as validated;
    a capacity in bytes with its unit: a small one was warned about as written, at load)."""
    options = {name: getattr(cfg, name) for name in type(cfg).model_fields}
    options["capacity"] = with_unit(options["capacity"])
    return options


# ---- loading ---------------------------------------------------------------------------
def load_config(path: str | os.PathLike[str], *, environ: dict[str, str] | None = None) -> ServiceConfig:
    """Read ``path``, apply ``CACHEPIPE_*`` overrides from the environment, validate.

    Args:
        path: the config file.
        environ: the environment, to refuse ``CACHEPIPE_*`` variables that name no setting, to
            say which fields variables set, and to name the variable behind a bad value
            (default ``os.environ``; the values themselves are read by pydantic-settings).

    Raises:
        ConfigError: one line per problem: ``<field path> = <value>: <what is expected>``, and
            one per unknown ``CACHEPIPE_*`` variable.
    """
    data = read_config_file(path)
    bad_keys = [k for k in data if not isinstance(k, str) or k.startswith("_")]
    if bad_keys:
        raise ConfigError(
            f"invalid configuration in {str(path)!r}:\n  {bad_keys[0]!r}: unknown key; expected one of: {', '.join(_keys(()))}"
        )
    env: Any = os.environ if environ is None else environ
    unknown = _unknown_variables(env)
    try:
        config = ServiceConfig(**data)
    except ValidationError as exc:
        raise ConfigError("\n  ".join([format_errors(exc, str(path), env, data), *unknown])) from None
    except SettingsError as exc:  # an environment override that pydantic-settings cannot parse (bad JSON)
        raise ConfigError("\n  ".join([_settings_error(exc, str(path), env), *unknown])) from None
    if unknown:
        raise ConfigError("\n  ".join([f"invalid configuration in {str(path)!r}:", *unknown]))
    _note_environment(data, str(path), env)
    _warn_small_capacities(config, data, str(path), env)
    return config


def _daemon_variables(environ: Any) -> Iterator[tuple[str, list[str]]]:
    """Each ``CACHEPIPE_*`` variable of ``environ`` that no other command reads
    (:data:`OTHER_VARIABLES`), in order, with its parts after the prefix (lower case, split at ``__``)."""
    for variable in sorted(environ, key=str.upper):
        name = variable.upper()
        if name.startswith(ENV_PREFIX) and name not in OTHER_VARIABLES:
            yield variable, name.removeprefix(ENV_PREFIX).lower().split("__")


def _unknown_variables(environ: Any) -> list[str]:
    """One line for each ``CACHEPIPE_*`` variable that names no setting (by its first part: a
    nested typo, ``CACHEPIPE_PIPELINES__TRAIN__CAPACTIY``, is pydantic's unknown key) and that
    no other command reads (:data:`OTHER_VARIABLES`); pydantic-settings would ignore it."""
    fields = list(ServiceConfig.model_fields)
    lines = []
    for variable, parts in _daemon_variables(environ):
        field = parts[0]
        if field in fields:
            continue
        if close := closest(field, fields):
            expected = f"did you mean {ENV_PREFIX + close.upper()}?"
        else:
            expected = (
                f"expected {ENV_PREFIX} and a setting in capitals ({', '.join(f.upper() for f in fields)}; "
                f"nested ones joined by __), or a variable another command reads ({', '.join(OTHER_VARIABLES)})"
            )
        lines.append(f"{variable} (in the environment): names no setting of the daemon; {expected}")
    return lines


def _note_environment(data: dict[str, Any], path: str, environ: Any) -> None:
    """Log each setting a ``CACHEPIPE_*`` variable sets: a warning when the file sets it too (the
    variable wins, and the file does not say so: a ``CACHEPIPE_SOCKET`` exported for the clients
    moves the daemon's socket), otherwise at info. Values are not shown (credentials)."""
    for variable, parts in _daemon_variables(environ):
        field, node = ".".join(parts), data
        for part in parts:
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is _ABSENT:
            log.info("%s is set by the environment variable %s", field, variable)
        else:
            log.warning("%s in %s is overridden by the environment variable %s", field, path, variable)


_ABSENT = object()


def _warn_small_capacities(config: ServiceConfig, data: dict[str, Any], path: str, environ: Any) -> None:
    """Warn of each capacity under 1 MiB written without a unit, in the file or in the
    ``CACHEPIPE_*`` variable that overrides it (as :class:`cachepipe.Pipeline` warns of one
    given to it), naming its field and where it was written."""
    raw = data.get("pipelines")
    written: dict[str, Any] = raw if isinstance(raw, dict) else {}
    given = {f"pipelines.{name}.capacity": (written.get(name) or {}).get("capacity") for name in config.pipelines}
    found = {f"pipelines.{name}.capacity": cfg.capacity for name, cfg in config.pipelines.items()}
    if config.jobs is not None:
        given["jobs.capacity"] = data["jobs"].get("capacity") if isinstance(data.get("jobs"), dict) else None
        found["jobs.capacity"] = config.jobs.capacity
    variables = {str(k).upper(): v for k, v in (environ or {}).items()}
    for field, value in found.items():
        where, text = f"in {path}", given[field]
        variable = ENV_PREFIX + field.replace(".", "__").upper()
        if variable in variables:  # the environment overrides the file
            where, text = f"set by the environment variable {variable}", variables[variable]
        if isinstance(text, (int, str)) and (warning := small_capacity(text, value)) is not None:
            log.warning("%s %s: %s", field, where, warning)


def _bad_json(text: str) -> bool:
    """``text`` is meant as a JSON mapping or list (it starts like one) and does not parse."""
    if not text.lstrip().startswith(("{", "[")):
        return False
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def _settings_error(exc: SettingsError, source: str, environ: Any) -> str:
    """The message for a ``CACHEPIPE_*`` variable whose value pydantic-settings cannot parse (a
    nested value, such as ``CACHEPIPE_PIPELINES__TRAIN__STORAGE_OPTIONS``, must be JSON), naming
    the variables that set the field."""
    match = re.search(r'field "([^"]+)"', str(exc))
    field = match.group(1) if match else ""
    prefix = (ENV_PREFIX + field).upper()
    names = sorted(k for k in environ if k.upper() == prefix or k.upper().startswith(prefix + "__")) if field else []
    names = [k for k in names if _bad_json(environ[k])] or names  # the ones at fault, when that tells
    where = f"the environment variable{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else "the environment"
    return (
        f"invalid configuration in {source!r}:\n  {field or '(an environment override)'}: {where} cannot be parsed "
        f"({exc.__cause__ or exc}); a nested value (a mapping or a list) must be JSON, e.g. "
        f'{ENV_PREFIX}PIPELINES__TRAIN__STORAGE_OPTIONS=\'{{"endpoint_url": "http://127.0.0.1:9000"}}\''
    )


def format_errors(exc: ValidationError, source: str, environ: Any = None, given: Any = None) -> str:
    """One readable line per validation error: field path, value, what is expected, and the
    environment variable that set it, if one did, or the variables that made its section when
    ``given`` (the file's settings) has none (``CACHEPIPE_PIPELINES__TRIAN__CAPACITY`` makes a
    pipeline ``trian``, without its other settings)."""
    upper_env = {k.upper() for k in (environ or {})}
    lines = [f"invalid configuration in {source!r}:"]
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"] if p != "[key]")
        where = ".".join(loc) or "(top level)"
        msg = err["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(prefix)
        kind = err["type"]
        shown = "" if _secret(loc, err["input"], kind) else f" = {_short(err['input'])}"
        if kind == "extra_forbidden":
            keys = _keys(loc[:-1])
            hint = f"did you mean {close!r}? " if loc and (close := closest(loc[-1], keys)) else ""
            expected = f"expected one of: {', '.join(keys)}" if keys else "expected none here"
            line = f"{where}{shown}: unknown key; {hint}{expected}"
        elif kind == "missing":
            line = f"{where}: required, not set"
        elif kind == "callable_type":  # prepare: a hook, which YAML or TOML cannot give
            line = (
                f"{where}{shown}: a Python callable, which a config file cannot hold; leave it out (null), "
                "or run the hook in your own process (Pipeline(prepare=...))"
            )
        elif not loc:
            line = msg
        else:
            line = f"{where}{shown}: {msg}"
        env_name = ENV_PREFIX + "__".join(loc).upper()
        if loc and env_name in upper_env:
            line += f" (set by the environment variable {env_name})"
        elif given is not None:
            line += _made_by_environment(loc, given, upper_env)
        lines.append("  " + line)
    return "\n".join(lines)


def _made_by_environment(loc: tuple[str, ...], given: Any, upper_env: set[str]) -> str:
    """`` (pipelines.trian is made by the environment variable ...; the file has no ...)`` when
    the first section of ``loc`` that the file lacks is set by ``CACHEPIPE_*`` variables; ""
    otherwise."""
    node = given
    for depth, part in enumerate(loc[:-1]):
        if isinstance(node, dict) and part in node:
            node = node[part]
            continue
        prefix = ENV_PREFIX + "__".join(loc[: depth + 1]).upper()
        names = sorted(v for v in upper_env if v.startswith(prefix + "__"))
        if not names:
            return ""
        section = ".".join(loc[: depth + 1])
        close = closest(part, [str(k) for k in node]) if isinstance(node, dict) else None
        hint = f"; did you mean {close!r}?" if close else ""
        made = f"the environment variable{'s' if len(names) > 1 else ''} {', '.join(names)}"
        return f" ({section} is made by {made}: the file has no {section}{hint})"
    return ""


def _secret(loc: tuple[str, ...], value: Any, kind: str) -> bool:
    """True when the error at ``loc`` must not show its input ``value``: :func:`secret_input`'s
    (under ``storage_options``), or a section that holds storage options (``pipelines``, a
    pipeline, ``jobs``, ``jobs.options``): its input is every option in it, or whatever was written
    in its place (a string holding the key)."""
    sections = loc[:1] in (("pipelines",), ("jobs",)) and len(loc) == 1
    pipeline = loc[:1] == ("pipelines",) and len(loc) == 2
    whole = kind == "value_error" and isinstance(value, dict)  # a check of a section: every option its input
    return secret_input(loc, value, kind) or sections or pipeline or loc[:2] == ("jobs", "options") or whole


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _keys(loc: tuple[str, ...]) -> list[str]:
    """The keys accepted in the section at ``loc``; [] for a section whose keys are free."""
    model: Any = None
    if not loc:
        model = ServiceConfig
    elif len(loc) == 2 and loc[0] == "pipelines":
        model = PipelineConfig
    elif loc == ("jobs",):
        model = JobsConfig
    return list(model.model_fields) if model is not None else []
