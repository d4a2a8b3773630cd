"""What a ``cachepipe map`` run will do: its options and its work items.

:class:`MapConfig` validates every option of a run; :func:`command_digest` names what makes an
item's outputs (recorded in its completion marker); :func:`plan_items` groups a listing into
work items, :class:`MapItem` (folders, objects, or split archive volumes with their checksum files);
:class:`PlannedSource` shows the pipeline only the items to do, under their cache names. Pure (no
disk, no network) but for the reads :class:`PlannedSource` forwards to the real store.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from ..blocks import folders_made, footprint, round_up
from ..catalog import check_key, group_items
from ..config import UNPACK_RATIO, Capacity, check_manifest_location, filtered_tar, in_our_words, parse_size, utf8_location
from ..errors import UnsafeKeyError
from ..grouping import version_of
from ..keys import _TreeCheck
from ..stores import Store
from ..stores.base import ObjectInfo, abort_store, scoped_store, takes_etag
from ..unpack import DEFAULT_MAX_MEMBERS, is_checksum_file, split_volume

__all__ = [
    "SLOT_FOLDERS",
    "WORK_DIR",
    "MapConfig",
    "MapItem",
    "PlannedSource",
    "Reserve",
    "command_digest",
    "function_name",
    "in_blocks",
    "item_charge",
    "item_reserve",
    "out_reserve",
    "plan_items",
]

WORK_DIR = ".cachepipe-map"
"""The folder under the cache directory holding the jobs' slots (outputs, extracted files)."""

_MIB = 1024**2


def _optional_size(what: str) -> Any:
    return BeforeValidator(lambda v: None if v is None else parse_size(v, what))


class MapConfig(BaseModel):
    """Every option of a map run, validated (sizes in bytes). See :func:`map_items` for each."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # as PipelineConfig: inf/nan named

    source: Annotated[str, BeforeValidator(utf8_location)] = Field(min_length=1)
    dest: Annotated[str, BeforeValidator(utf8_location)] = Field(min_length=1)
    cache_dir: Path
    capacity: Capacity
    command: tuple[str, ...] | None = None
    jobs: int = Field(default=1, ge=1, le=1024)
    out_reserve: Annotated[int | None, _optional_size("out_reserve")] = None
    out_ratio: float | None = Field(default=None, gt=0)
    out_margin: Annotated[int | None, _optional_size("out_margin")] = None
    items: Literal["folders", "files"] = "folders"
    manifest: Annotated[str | None, BeforeValidator(check_manifest_location)] = None
    unpack: Annotated[bool, AfterValidator(filtered_tar)] = False
    unpack_ratio: float = Field(default=UNPACK_RATIO, gt=0, le=1_000_000)
    timeout: float | None = Field(default=None, gt=0)
    retries: int = Field(default=2, ge=0, le=100)
    request_retries: int = Field(default=12, ge=0, le=1000)
    retry_backoff: float = Field(default=0.2, ge=0, le=60)
    retry_backoff_max: float = Field(default=10.0, gt=0, le=600)
    max_concurrency: int = Field(default=64, ge=1, le=1024)
    max_large_requests: int = Field(default=16, ge=1, le=1024)
    part_size: Annotated[int | None, _optional_size("part_size")] = None  # None: a pipeline's default, by the capacity
    verify: Literal["size", "etag"] = "size"  # as a pipeline's: "etag" checks each input file's MD5 before the command
    upload_concurrency: int = Field(default=8, ge=1, le=1024)
    upload_part_size: Annotated[int, BeforeValidator(lambda v: parse_size(v, "upload_part_size"))] = 16 * _MIB
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)  # credentials: not in the repr
    dest_options: dict[str, Any] | None = Field(default=None, repr=False)
    watch_interval: float = Field(default=0.05, gt=0, le=10)
    kill_grace: float = Field(default=5.0, ge=0, le=600)
    max_members: int = Field(default=DEFAULT_MAX_MEMBERS, ge=1)
    dry_run: bool = False
    progress: bool = False
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    rank_source: str = "default"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:  # as PipelineConfig's: without pydantic's link, credentials unsaid
            raise in_our_words(exc) from None

    # Checks of one field against those before it, not of the model: an error of a model validator
    # carries every option as its input, which pydantic's message and the command line would show
    # (the storage options' credentials among them).
    @field_validator("out_ratio")
    @classmethod
    def _one_reserve(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("out_reserve") is not None:
            raise ValueError("give out_reserve or out_ratio, not both (--out-reserve or --out-ratio)")
        return value

    @field_validator("upload_part_size")
    @classmethod
    def _smallest_part(cls, value: int) -> int:
        if value < 5 * _MIB:
            raise ValueError(f"upload_part_size {value}: expected at least 5 MiB (the smallest S3 part)")
        if value > 5 * 1024 * _MIB:
            raise ValueError(f"upload_part_size {value}: expected at most 5 GiB (the largest S3 and OBS part)")
        return value

    @field_validator("world_size")
    @classmethod
    def _rank_in_world(cls, value: int, info: ValidationInfo) -> int:
        rank = info.data.get("rank")
        if rank is not None and rank >= value:
            raise ValueError(f"rank {rank}: expected 0 <= rank < world_size {value}")
        return value


def function_name(fn: Any) -> str:
    """What names ``fn`` for :func:`command_digest`: ``module.qualname`` of a function or method,
    of the function a ``functools.partial`` wraps (its bound arguments left out: their text
    can differ between two runs of the same code, as an object's address does), or of the class
    of a callable object. The name is how the child process finds ``fn`` (by reference, as
    pickle does), so it is what the run can tell apart; fn's body is not part of it."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    if not hasattr(target, "__qualname__"):
        target = type(target)
    return f"{getattr(target, '__module__', None)}.{target.__qualname__}"


def command_digest(command: Sequence[str] | None, function: str | None, unpack: bool) -> str:
    """16 hex digits of a digest of what makes an item's outputs from its input: the command's
    arguments as given (placeholders such as ``{}`` not yet replaced; the CLI's ``-- CMD ARGS``
    and a list given to :func:`~cachepipe.map.run.map_items` alike), or ``fn``'s
    :func:`function_name`, and ``unpack`` (the command sees the extracted files; without a
    command, they are the outputs). Recorded in each item's completion marker: a rerun does
    again an item whose marker records another digest.

    Left out, since they do not change what an item's outputs are: the sizes, ratios, timeouts,
    retries, concurrency and storage options (and ``items``, which changes the items and their
    names: the input's version tells an item's input apart). Not seen: the content of a script
    the command runs (``python split.py``) and the body of ``fn``."""
    what = {"command": None if command is None else list(command), "function": function, "unpack": unpack}
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=8).hexdigest()  # ASCII: \u escapes


@dataclass(frozen=True)
class MapItem:
    """One unit of work.

    Attributes:
        name: its name in ``SRC`` and ``DST`` (results go to ``DST/<name>/``).
        local: its name in the cache (a single path segment when volumes are grouped).
        objects: its objects as the pipeline lists them (keys relative to ``SRC``, or under
            ``local`` when grouped).
        keys: real key of each listed key.
        size: total bytes.
        unsafe: why the item cannot be stored in the cache (a key of it that is unsafe or
            collides, naming the key; see :func:`cachepipe.catalog.check_key`), or None. The run
            refuses such an item, recorded as failed, and does the others.
    """

    name: str
    local: str
    objects: tuple[ObjectInfo, ...]
    keys: dict[str, str] = field(hash=False, compare=False)
    size: int = 0
    unsafe: str | None = None

    @property
    def version(self) -> str | None:
        """Which version of the item's objects the listing names (a digest of their keys, sizes
        and ETags; None without ETags): recorded in its completion marker, so that a rerun does
        an item whose objects were rewritten since again."""
        return version_of([(o.key, o.size, o.etag) for o in self.objects])


SLOT_FOLDERS = 4
"""The folders of a job's slot: its own and its ``in``, ``out`` and ``cwd`` (:class:`~cachepipe.map.job.Slot`),
a block each in what the slot takes."""


def in_blocks(size: int, block: int) -> int:
    """``size`` bytes in whole ``block`` s (0: ``size`` itself, the listed bytes)."""
    return round_up(size, block) if block > 0 else size


@dataclass(frozen=True)
class Reserve:
    """The room one item takes in its job's slot, in bytes counted as the cache counts its files
    (in whole blocks of the cache's filesystem, a block per folder; see :mod:`cachepipe.blocks`):
    ``unpack`` for its extracted files (0 without ``unpack``), ``out`` for its outputs (at most;
    see :func:`out_reserve`), ``folders`` for the slot's own folders (:data:`SLOT_FOLDERS`)."""

    unpack: int
    out: int
    folders: int = 0

    @property
    def total(self) -> int:
        return self.unpack + self.out + self.folders


def out_reserve(cfg: MapConfig, input_size: int, runs: bool = True, block: int = 0) -> int:
    """The bytes a run's outputs may take, for an input (what the command gets: the item, or its
    extracted files) of ``input_size`` bytes: ``out_reserve``, or ``out_ratio`` (default 1) times
    ``input_size``; 0 when nothing runs (``unpack`` alone: the extracted files are the results).
    With ``block`` (above 0), in whole blocks of it, as the outputs are measured."""
    if not runs:
        return 0
    if cfg.out_reserve is not None:
        return in_blocks(cfg.out_reserve, block)
    return in_blocks(max(1, math.ceil((cfg.out_ratio or 1.0) * input_size)), block)


def item_charge(cfg: MapConfig, mi: MapItem, block: int = 0) -> int:
    """What ``mi`` takes in the downloads' cache, as its ledger charges it
    (:meth:`cachepipe.cache.Cache.charge`): its files in whole blocks and a block per folder it
    makes; a single-object item (``items="files"`` without ``unpack``) those of its name in the
    cache (:func:`~cachepipe.blocks.folders_made`). 0 ``block``: its listed size."""
    if block <= 0:
        return mi.size
    is_file = cfg.items == "files" and not cfg.unpack
    rels = [o.key[len(mi.local) + 1 :] for o in mi.objects] if not is_file else []
    return footprint((o.size for o in mi.objects), folders_made(rels, is_file, mi.local), block)


def item_reserve(cfg: MapConfig, mi: MapItem, runs: bool = True, block: int = 0) -> Reserve:
    """What ``mi`` may take in a slot, planned before it is downloaded.

    With ``unpack``, the extraction gets ``unpack_ratio`` times the item's size (refused past it,
    member by member); the outputs' share is then planned from that bound and, at run time,
    computed from the extracted size measured (:func:`out_reserve`): ``cp -r . $CACHEPIPE_OUT``
    fits with the defaults. Separate shares, so that the extraction and a copy of it never
    compete for one reserve.

    With ``block`` (the cache's, above 0), every share is in whole blocks of it, as the slot is
    measured and as the cache counts the downloads beside it: the extraction's members in whole
    blocks and a block per folder they make, the outputs from the input as it takes the disk
    (the item's charge, or the extraction's share), and :data:`SLOT_FOLDERS` blocks for the slot's
    own folders. Else in listed bytes, the folders not counted.
    """
    unpacked = in_blocks(math.ceil(cfg.unpack_ratio * mi.size), block) if cfg.unpack else 0
    given = unpacked if cfg.unpack else item_charge(cfg, mi, block)
    return Reserve(unpacked, out_reserve(cfg, given, runs, block), SLOT_FOLDERS * block)


def plan_items(objects: Iterable[ObjectInfo], items: Literal["folders", "files"], unpack: bool) -> list[MapItem]:
    """Group a listing into work items.

    ``folders``: each first-level folder; ``files``: each object. With ``files`` and ``unpack``,
    split volumes (``x.tar.gz-00``, ``x.tar.gz-01``...; ``.partaa``...; ``.001``...) in one folder
    form one item named by their stem (``dir/x.tar.gz``), and checksum files are attached to the
    item whose volume they name: ``<volume>.md5`` (in the same folder or, if that volume's file
    name is unique, anywhere under ``SRC``, e.g. a ``md5/`` folder beside ``compressed/``), and an
    ``md5sums`` file to every item with a volume in its folder. Checksum files are not items.

    An item with an unsafe key, or named like the work folder ``.cachepipe-map``, is planned
    with :attr:`MapItem.unsafe` set: in its place, so that every rank takes the same share. So
    are two items whose results' folders in DST lie one in the other (:func:`_nested`).
    """
    objects = [o for o in objects if not (o.key.endswith("/") and o.size == 0)]
    if items == "folders" or not unpack:
        planned = [
            MapItem(
                it.name,
                it.name,
                tuple(ObjectInfo(f.key, f.size, f.etag) for f in it.files),
                {f.key: f.key for f in it.files},
                it.size,
                None if it.unsafe is None else str(it.unsafe),
            )
            for it in group_items(objects, items)
        ]
    else:
        planned = _plan_grouped(objects)
    for k, mi in enumerate(planned):
        if mi.unsafe is None and mi.local.split("/", 1)[0] == WORK_DIR:
            reserved = UnsafeKeyError(mi.objects[0].key, f"'{WORK_DIR}' is reserved for cachepipe map's work folder")
            planned[k] = replace(mi, unsafe=str(reserved))
    nested = _nested(mi.name for mi in planned if mi.unsafe is None)
    return [mi if mi.name not in nested else replace(mi, unsafe=nested[mi.name]) for mi in planned]


def holder(path: str, names: Collection[str]) -> str | None:
    """The item of ``names`` whose folder is the nearest one holding ``path`` (a key, or another
    item's name): of ``a`` and ``a/b``, ``a/b`` holds ``a/b/x`` and ``a`` holds ``a/b``; None if
    no item's folder holds it."""
    end = path.rfind("/")
    while end > 0:
        if path[:end] in names:
            return path[:end]
        end = path.rfind("/", 0, end)
    return None


def _nested(names: Iterable[str]) -> dict[str, str]:
    """Why each item of ``names`` whose folder in DST lies in another's, or holds another's, is
    refused: objects ``a`` and ``a/b`` (S3 holds both; with ``--items files --unpack`` both are
    items) have their results in ``DST/a/`` and ``DST/a/b/``, so ``a``'s outputs named ``b/...``
    mix with ``a/b``'s, and a rerun of ``a/b`` (whose objects are those under ``DST/a/b/``) could
    delete them, leaving ``a``'s marker listing what is not there. Both are refused, each naming
    the other; the others run."""
    names = set(names)
    outer = {name: held_by for name in names if (held_by := holder(name, names)) is not None}  # the nearest item around
    why = {}
    for name in sorted(outer):
        held_by = outer[name]
        why[name] = (
            f"item {name!r} has its results in DST/{name}/, inside the folder of item {held_by!r} (DST/{held_by}/): "
            "their outputs would mix, and a rerun of one could delete the other's; rename or move one of them in SRC"
        )
        why.setdefault(
            held_by,
            f"item {held_by!r} has its results in DST/{held_by}/, which holds the folder of item {name!r} "
            f"(DST/{name}/): their outputs would mix, and a rerun of one could delete the other's; rename or move "
            "one of them in SRC",
        )
    return why


def _plan_grouped(objects: list[ObjectInfo]) -> list[MapItem]:
    groups: dict[str, list[ObjectInfo]] = {}
    sidecars: list[ObjectInfo] = []
    unsafe: dict[str, str] = {}  # key -> why
    for obj in objects:
        try:
            check_key(obj.key)
        except UnsafeKeyError as exc:
            unsafe[obj.key] = str(exc)
        if is_checksum_file(obj.key):
            sidecars.append(obj)
            continue
        folder, _, base = obj.key.rpartition("/")
        split = split_volume(base)
        name = obj.key if split is None else (f"{folder}/{split[0]}" if folder else split[0])
        groups.setdefault(name, []).append(obj)
    by_base: dict[str, list[str]] = {}
    for name, members in groups.items():
        for obj in members:
            by_base.setdefault(obj.key.rpartition("/")[2], []).append(name)
    for side in sidecars:
        folder, _, base = side.key.rpartition("/")
        if base.lower().endswith(".md5"):
            owners = by_base.get(base[:-4], [])
            near = [n for n in owners if any(o.key == f"{folder}/{base[:-4]}".lstrip("/") for o in groups[n])]
            targets = near or (owners if len(owners) == 1 else [])
        else:
            targets = [n for n, members in groups.items() if any(o.key.rpartition("/")[0] == folder for o in members)]
        for name in targets:
            groups[name].append(side)
    planned = []
    for name in sorted(groups):
        local = quote(name, safe="")
        members = sorted(groups[name], key=lambda o: o.key)
        listed = tuple(ObjectInfo(f"{local}/{o.key}", o.size, o.etag) for o in members)
        why = next((unsafe[o.key] for o in members if o.key in unsafe), None) or _collision(members)
        keys = {f"{local}/{o.key}": o.key for o in members}
        planned.append(MapItem(name, local, listed, keys, sum(o.size for o in members), why))
    return planned


def _collision(members: list[ObjectInfo]) -> str | None:
    """Why the objects of one grouped item (in key order) cannot all be stored in its folder: a
    file that is also the folder of another (``md5sums`` and ``md5sums/x.md5``), or None. Such
    an item is refused by itself; found by the pipeline instead, it stopped the run."""
    tree = _TreeCheck()
    try:
        for obj in members:
            tree.add(obj.key, obj.key.split("/"))
    except UnsafeKeyError as exc:
        return str(exc)
    return None


class PlannedSource:
    """The source store as the pipeline sees it: only the items to do, under their cache names.

    The map run owns the real store (opened from ``source``, or given) and closes it; the
    pipeline reads through :meth:`scoped`, the same plan over a view of it, which the pipeline
    aborts and closes (the real store, also the destination when the two are one, serves on)."""

    def __init__(self, store: Store, items: Sequence[MapItem]) -> None:
        self.url = store.url
        self._store = store
        self._view = False  # True: _store is a view of the real store (scoped), this object's to abort and close
        self._objects = sorted((o for mi in items for o in mi.objects), key=lambda o: o.key)
        self._keys = {k: v for mi in items for k, v in mi.keys.items()}
        self._conditional = takes_etag(store)

    def scoped(self) -> PlannedSource | None:
        """The same plan over a view of the real store (see :mod:`cachepipe.stores.base`); None
        if it has none (the pipeline then neither aborts nor closes it: its requests are waited for)."""
        view = scoped_store(self._store)
        if view is None:
            return None
        planned = copy.copy(self)
        planned._store, planned._view = view, True  # noqa: SLF001 - a copy of this class's own object
        return planned

    def list(self) -> Iterator[ObjectInfo]:
        return iter(self._objects)

    def get(self, key: str, out: Any, start: int, end: int, *, etag: str | None = None) -> int:
        if etag is not None and self._conditional:
            return self._store.get(self._keys[key], out, start, end, etag=etag)  # type: ignore[call-arg]  # takes_etag said so
        return self._store.get(self._keys[key], out, start, end)

    def close(self) -> None:
        """Close the view (:meth:`scoped`); the real store is the map run's."""
        if self._view:
            self._store.close()

    def abort(self) -> None:
        """Cut the view's requests in flight (the pipeline is closing; :meth:`scoped`)."""
        if self._view:
            abort_store(self._store)
