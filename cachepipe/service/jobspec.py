"""What a job may ask for, and what the daemon lets jobs do: the two validated models of
:mod:`cachepipe.service.jobs`, data only.

:class:`JobSpec` is the body of ``PUT /v1/jobs/NAME``; :class:`JobsConfig` is the daemon's
``jobs`` section, read with the rest of the configuration (:mod:`.config`, :mod:`.preflight`)
before any job exists. They hold no jobs and do no I/O beyond validating (a source's backend is
imported as its prefix is checked), so the configuration reads them without the registry of jobs
(:class:`~cachepipe.service.jobs.Jobs`), the pipelines it opens or their manifests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import Capacity, PipelineConfig, check_absolute_source, check_manifest_location, parse_size, secret_input
from ..errors import ConfigError
from ..stores import preload

__all__ = ["JobSpec", "JobsConfig", "absolute_path"]

_JOB_FIELDS = ("source", "items", "manifest", "epochs", "shuffle", "seed", "balance", "partition", "equal_steps", "retain")
_NODE_SETS = {
    "cache_dir",
    "capacity",
    "keep_on_close",
    "resume",
    "start_epoch",
    "prefetch",
    "rank",
    "worker",
    "world_size",
    "num_workers",
}


def absolute_path(value: Path) -> Path:
    """``value``, a path of the daemon's config that must be absolute (the daemon's working
    directory is ``/`` under systemd). A check of a field, not of the model, which pydantic runs
    only once every field is valid: so it is said beside the other fields' errors."""
    if not value.is_absolute():
        raise ValueError("expected an absolute path")
    return value


class JobsConfig(BaseModel):
    """The ``jobs`` section of the daemon's configuration: what registered jobs may do.

    Attributes:
        root: absolute directory; job ``NAME`` caches under ``root/NAME``.
        capacity: the most all jobs together may hold (a size, or a share of the disk
            space of ``root`` like ``"80%"`` resolved when a job registers: of its free space and
            what the registered jobs and the one registering hold in their folders).
        sources: URL prefixes a job's ``source`` and ``manifest`` must start with (empty: any).
        max_jobs: most jobs registered at once (default 4).
        max_manifest: largest manifest a job may upload, in bytes (default 1 GiB; a manifest
            takes about 30 bytes per item of a folder of two files).
        manifest_grace: seconds a manifest no job names is kept after it was written (uploaded
            or listed; default 86400, a day): a node's ranks list or upload it when their
            ``CachePipeDataset`` is made, and register the job that names it at its first
            iteration, after the model is set up (minutes to hours). Older ones are removed when a job is deleted and at the
            daemon's start (see :mod:`cachepipe.service.jobsroot`).
        options: :class:`~cachepipe.PipelineConfig` options for every job (``storage_options``,
            ``max_concurrency``, ``part_size``...); not the ones a job gives or the node decides. Not
            in the repr: its ``storage_options`` hold credentials.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    root: Path
    capacity: Capacity
    sources: list[str] = Field(default_factory=list)
    max_jobs: int = Field(default=4, ge=1, le=1024)
    max_manifest: Annotated[int, BeforeValidator(lambda v: parse_size(v, "jobs.max_manifest"))] = 2**30
    manifest_grace: float = Field(default=86400.0, ge=0, le=30 * 86400)
    options: dict[str, Any] = Field(default_factory=dict, repr=False)  # its storage_options hold credentials

    @field_validator("root")
    @classmethod
    def _absolute_root(cls, value: Path) -> Path:
        return absolute_path(value)

    @model_validator(mode="after")
    def _check(self) -> JobsConfig:
        for key in self.options:
            if key not in PipelineConfig.model_fields:
                raise ValueError(f"jobs.options.{key}: not a pipeline option (see cachepipe.PipelineConfig)")
            if key in _NODE_SETS or key in _JOB_FIELDS:
                raise ValueError(f"jobs.options.{key}: set by the job or by the daemon, not in jobs.options")
        self._check_option_values()
        for prefix in self.sources:
            check_absolute_source(prefix, "jobs.sources")
            try:  # checks the scheme, and imports its backend before the daemon serves: the first job does not wait
                preload(prefix)
            except (ConfigError, ImportError) as exc:
                raise ValueError(f"jobs.sources {prefix!r}: {exc}") from exc
        return self

    def _check_option_values(self) -> None:
        """The values of ``options`` as a job's pipeline will validate them when a job registers
        (a ``max_concurrency`` of ``"abc"``), checked now; the options of the stores are checked
        against ``sources`` by the daemon's host checks (:mod:`.preflight`)."""
        source = self.sources[0] if self.sources else "s3://bucket/"  # some validators look at the source
        try:
            PipelineConfig(source=source, cache_dir=self.root / "job", capacity=1, **self.options)
        except ValidationError as exc:
            lines = []
            for err in exc.errors(include_url=False):
                where = ".".join(str(p) for p in err["loc"])
                shown = "" if secret_input(err["loc"], err["input"], err["type"]) else f" = {err['input']!r}"
                lines.append(f"jobs.options.{where}{shown}: {err['msg'].removeprefix('Value error, ')}")
            raise ValueError("; ".join(lines)) from None


class JobSpec(BaseModel):
    """What a job asks for when it registers (the body of ``PUT /v1/jobs/NAME``).

    Attributes:
        source: the dataset URL (under one of the daemon's ``jobs.sources``).
        items, manifest, epochs, shuffle, seed, balance, partition, equal_steps, retain,
            on_error, on_oversize: as for :class:`~cachepipe.Pipeline` (``manifest`` also under
            ``jobs.sources``).
        catalog: the digest of a manifest uploaded to this daemon (``PUT /v1/manifests``), to
            plan from instead of listing (not with ``manifest``).
        world_size: ranks in the whole job.
        ranks: the ranks on this node.
        num_workers: DataLoader workers per rank (1: none).
        capacity: this job's share of ``jobs.capacity`` (default: all of it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    source: str = Field(min_length=1)
    items: Literal["folders", "files"] = "folders"
    manifest: Annotated[str | None, BeforeValidator(check_manifest_location)] = None
    catalog: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    epochs: int | None = Field(default=1, ge=1)
    shuffle: bool = False
    seed: int = 0
    balance: Literal["bytes", "count"] = "bytes"
    partition: Literal["epoch", "fixed"] = "epoch"
    equal_steps: Literal["pad", "drop"] | None = None
    retain: Literal["none", "auto"] = "none"
    on_error: Literal["raise", "skip"] = "raise"
    on_oversize: Literal["raise", "skip"] = "raise"
    world_size: int = Field(ge=1)
    ranks: list[int] = Field(min_length=1)
    num_workers: int = Field(default=1, ge=1, le=1024)
    capacity: Capacity | None = None

    @model_validator(mode="after")
    def _one_catalog(self) -> JobSpec:
        if self.manifest is not None and self.catalog is not None:
            raise ValueError("manifest and catalog: give one (catalog names a manifest uploaded to the daemon)")
        return self
