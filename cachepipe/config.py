"""Configuration: the validated options of a pipeline.

One model, :class:`PipelineConfig`, is built at the edge (``Pipeline(...)`` keyword arguments,
or a config file in the daemon) and passed down; nothing reads the environment at import time.

Sizes and shares of free space (``"50GiB"``, ``"80%"``) are parsed and formatted by
:mod:`cachepipe.sizes` (no pydantic there), and sources and destinations are checked by
:mod:`cachepipe.locations`; their names are re-exported here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

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
from pydantic_core import InitErrorDetails, PydanticCustomError

from .errors import ConfigError, closest
from .locations import SCHEMES, cache_in_source, check_absolute_source, check_destination, check_source, utf8_location
from .sizes import (
    SIZE_FORMS,
    SMALL_CAPACITY,
    Share,
    format_size,
    parse_capacity,
    parse_size,
    small_capacity,
    with_unit,
)

__all__ = [
    "SCHEMES",
    "SIZE_FORMS",
    "SMALL_CAPACITY",
    "UNPACK_RATIO",
    "PipelineConfig",
    "Share",
    "check_absolute_source",
    "check_cache_dir",
    "check_destination",
    "check_option_names",
    "check_source",
    "format_size",
    "in_our_words",
    "parse_capacity",
    "parse_size",
    "secret_input",
    "small_capacity",
    "utf8_location",
    "with_unit",
]

UNPACK_RATIO = 1.25
"""Default ``unpack_ratio``: an item's extracted files may take this many times the item's size.

Why 1.25: archives of already-compressed media (MP4/WebM video, JPEG, MP3) barely shrink, but
they do shrink: gzip and zstd find a little redundancy in the containers' indexes, so the files
come out 1-2% larger than the archive (measured on MP4-like clips: tar.gz 1.011-1.014x, tar.zst
1.011-1.019x, zip 0.98-1.014x), and a reserve of exactly 1.0x refused most of them. 1.25 leaves
more than ten times that margin, and costs little: the reserve is held only from the download
to the end of the extraction, then the real size is measured and the surplus released (``map``
keeps it per job slot). Archives of compressible data (text, raw arrays, WAV) expand by their
compression ratio: give ``unpack_ratio`` (``--unpack-ratio``) that ratio."""


def check_cache_dir(value: Any) -> Any:
    """Refuse an empty ``cache_dir`` (``Path("")`` is the current directory, which the cache would
    then own and clean) and expand a leading ``~`` to the user's home, as a shell would (kept, it
    would make a folder named ``~`` in the current directory); everything else is left to the
    ``Path`` field.

    Raises:
        ConfigError: naming the value and what is accepted.
    """
    if isinstance(value, (str, os.PathLike)) and not os.fspath(value).strip():
        raise ConfigError(
            f"cache_dir {os.fspath(value)!r}: expected a directory path; an empty one would make the current "
            "directory the cache (write '.' if that is what you want)"
        )
    if isinstance(value, (str, os.PathLike)) and os.fspath(value).startswith("~"):
        return Path(os.path.expanduser(os.fspath(value)))
    return value


def filtered_tar(unpack: bool) -> bool:
    """``unpack``, refused at once where Python's ``tarfile`` has no extraction filters (Python
    3.10.12, 3.11.4 and newer have them; a distribution may have added them to an older one): the
    ``data`` filter is the second line of defence against an archive's links and paths out of its
    folder, and without it every tar member would fail. For a pydantic ``AfterValidator``."""
    if unpack:
        import platform
        import tarfile

        if not hasattr(tarfile, "data_filter"):
            raise ValueError(
                f"needs tarfile's extraction filters, which Python {platform.python_version()} has not: "
                "upgrade to Python 3.10.12, 3.11.4 or newer"
            )
    return unpack


def check_option_names(options: dict[str, Any], positional: tuple[str, ...] = ("source", "cache_dir", "capacity")) -> None:
    """Refuse a keyword that is not an option of :class:`PipelineConfig` (``max_concurency=4``),
    naming it, its value (not for a name of a credential, :func:`_credential_name`:
    ``secret="..."`` is no option, and its value stays unsaid), the option it most resembles and
    every accepted one; ``positional``: the options given as arguments of their own, not among
    ``options``.

    Raises:
        ConfigError: for the first unknown name.
    """
    accepted = sorted(set(PipelineConfig.model_fields) - set(positional))
    for name, value in options.items():
        if name not in accepted:
            hint = f"did you mean {close!r}? " if (close := closest(name, accepted)) else ""
            given = f"{name} (its value not shown)" if _credential_name(name) else f"{name}={value!r}"
            raise ConfigError(f"{given} is not an option of Pipeline; {hint}accepted: {', '.join(accepted)}")


def check_manifest_location(value: Any) -> Any:
    """A manifest location as a str (a path-like is accepted); refuse an empty one.

    Raises:
        ConfigError: naming the value and what is accepted.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"manifest {value!r}: expected a path or an object URL written by `cachepipe index`, or None")
    return value


def _size_field(what: str) -> BeforeValidator:
    return BeforeValidator(lambda v: parse_size(v, what))


Capacity = Annotated[int | Share, BeforeValidator(parse_capacity)]


CREDENTIAL_FIELDS = frozenset({"storage_options", "dest_options"})
"""Options that hold a store's credentials (a secret key, a token, a password in a URL): a
validation error never shows their value."""
NOT_SHOWN = "(not shown: it may hold credentials)"
"""The input of a validation error that :func:`secret_input` keeps unsaid, in its ``errors()``."""


def secret_input(loc: tuple[Any, ...], value: Any, kind: str = "") -> bool:
    """True when a validation error at ``loc`` (its path of fields), of pydantic type ``kind``,
    must not show its input ``value``: one under a :data:`CREDENTIAL_FIELDS` (a list or a string
    given instead of a mapping holds the key as well), one of the whole model (``loc`` empty: its
    input is every option), or an unknown key given a mapping or a list (``storage_option:``
    misspelt) or named as a credential (:func:`_credential_name`: ``secret="..."``)."""
    if not loc or (isinstance(value, str) and value == NOT_SHOWN) or any(str(part) in CREDENTIAL_FIELDS for part in loc):
        return True
    return kind == "extra_forbidden" and (isinstance(value, dict | list | tuple) or _credential_name(str(loc[-1])))


_CREDENTIAL = re.compile(r"key|secret|token|passw|credential|option|^[as]k$", re.IGNORECASE)


def _credential_name(name: str) -> bool:
    """Whether an unknown option's ``name`` is one that holds a credential elsewhere (s3fs's
    ``key``, ``secret``, ``token``; botocore's ``aws_secret_access_key``; OBS's ``ak``, ``sk``;
    ``storage_option``, misspelt): given beside the storage options instead of in them, its value
    is never shown. Any other unknown option's value is (``colour = 'red'``)."""
    return _CREDENTIAL.search(name) is not None


def in_our_words(exc: ValidationError) -> ValidationError:
    """``exc`` as the user is shown it: the same errors (type, place, message, input, context),
    without pydantic's "For further information visit https://errors.pydantic.dev/..." line
    under each (a page on pydantic, not on the option: our messages say what is wrong), and
    without their inputs when one is :func:`secret_input`: pydantic's message shows each input
    (``input_value=[...]``), and a ``storage_options`` given as a list or a string holds the
    secret key it shows (every input is hidden then: pydantic hides all or none).

    Each error is remade as a custom error of its type and message, which pydantic prints with no
    link (``errors(include_url=False)`` alone leaves ``str(exc)`` as it was)."""
    errors = exc.errors(include_url=False)
    hidden = any(secret_input(err["loc"], err["input"], err["type"]) for err in errors)
    details: list[InitErrorDetails] = []
    for err in errors:
        ctx = err.get("ctx")
        if ctx and any(f"{{{key}}}" in err["msg"] for key in ctx):
            ctx = None  # a message holding "{ge}" as written (a value given): pydantic would fill it in again
        kind = PydanticCustomError(err["type"], err["msg"], ctx)
        given = NOT_SHOWN if secret_input(err["loc"], err["input"], err["type"]) else err["input"]  # nor in errors()
        details.append({"type": kind, "loc": err["loc"], "input": given})
    return ValidationError.from_exception_data(exc.title, details, hide_input=hidden)


class PipelineConfig(BaseModel):
    """Every option of a pipeline, validated. Sizes are bytes after validation.

    Attributes:
        source: URL of the dataset prefix (``s3://b/p/``, ``obs://b/p/``, ``file:///d``, an
            existing local path, ``memory://...``, any fsspec URL). ``Pipeline`` refuses a
            source with no scheme that does not exist locally (see :func:`check_source`).
        cache_dir: local directory the cache owns; created if missing. Not empty, and neither
            inside nor around the cache of another open pipeline (refused at open).
        capacity: hard cap on bytes under ``cache_dir`` (a size or a share of free space), in
            what the files take on the disk: each file's size rounded up to the filesystem's
            block (``f_frsize``, held to 512 B..64 KiB) and a block per folder, so an item of
            eight 512 B files counts 36 KiB on a filesystem of 4 KiB blocks. Under 1 MiB is
            allowed with a warning: ``"100"`` is 100 bytes.
        items: ``"folders"``: each first-level folder under the prefix is one item (default);
            ``"files"``: each object is one item.
        storage_options: passed to the store (s3fs/fsspec options, or OBS settings); not shown in
            the config's repr (they hold credentials).
        prefetch: most items downloaded ahead of the consumer (staging + ready); None (default):
            as many as the capacity allows.
        max_concurrency: requests in flight across all items and files at most (default 64).
            The download threads follow how long requests take: as many as keep one working
            while the others wait for theirs (1 + median request time / mean work of a part,
            chosen every 32 parts), so a request that costs microseconds (a local or
            ``memory://`` source) is made by 2 or 3 threads, not 64.
        max_large_requests: of those, most for items with a file over 256 KiB, which is cut
            into parts (default 16; at most ``max_concurrency``). An item whose files are all
            of 256 KiB or less is short requests, mostly round trip: up to ``max_concurrency``
            of them keep a link busy on folders of small files, while large items stay at the
            bytes in flight of 16 streams.
        part_size: objects larger than this are fetched as parallel ranged GETs of this size.
            None (default): the capacity over twice ``max_large_requests``, between 1 and 8 MiB
            (8 MiB from a 256 MiB cache at 16 requests; it follows a capacity changed live),
            so that every request has a part while half the cache holds items for the
            consumer. Parts are cut when a request takes them, finer for the items the
            consumers wait for next: the next one over every request (parts of at least
            256 KiB).
        download_processes: make the GETs in this many worker processes, ``max_concurrency``
            requests split among them, instead of in threads of this process (default 0). For
            a process whose own core would be the limit: the node daemon serving many
            consumers, or many small items. Each worker opens the source with
            ``storage_options``, so a ``store=`` object or a ``memory://`` source (private to
            this process) cannot be used with it.
        hedge: request the last part of an item the consumers take next a second time when it
            runs late (twice as long as the item's other parts, and at least 0.2 s; the first
            request to end wins), while the consumers are slower than the link (default True).
            Bounds a lost packet's or connection's wait (TCP's retransmission timeouts, 0.2-1 s
            or more) at the cost of that part's bytes twice (``stats().hedges`` counts them;
            ``bytes_downloaded`` counts the bytes of each request that ran to its end: a hedge that
            won, not the request it beat). False: each byte is requested once. Not with
            ``download_processes``, nor in node mode (its lanes count as outpacing the items).
        ordered: hand items out in listing order (default True); False: whichever is ready first.
        auto_ack: when the loop asks for the next item, the previous one is acknowledged and
            evicted (default True). False: call ``ack``/``release`` yourself.
        on_oversize: ``"raise"`` (default) an item larger than the capacity before anything is
            downloaded, or ``"skip"`` it with a warning in the log.
        on_error: ``"raise"`` (default) a failed item from the iterator, or ``"skip"`` it
            (logged and counted in stats). An item with an object key that cannot be stored in
            the cache (:class:`~cachepipe.UnsafeKeyError`) follows it too: ``"raise"`` refuses
            the listing where it meets the key (at open for the first listing page), ``"skip"``
            skips the item in its turn.
        verify: ``"size"`` (default): every file's size must match the listing before publish;
            ``"etag"``: also its MD5 where the listing's ETag is one (single-part uploads).
            A mismatch frees the staging files and downloads the item again.
        retries: retries of a transient failure per request before the item fails (default 12;
            with the default backoff they span 36 to 73 seconds: a store outage of that long is ridden out).
        retry_backoff: first backoff in seconds, doubled each retry, with equal jitter (default 0.2).
        retry_backoff_max: cap on one backoff in seconds (default 10).
        min_free: pause downloads while the cache filesystem would keep less than this free
            (a size, or a share of the filesystem's total size such as ``"5%"``); None (default):
            no floor. The disk may be shared with other tenants.
        lease_timeout: seconds a handed-out item may stay unacknowledged before it is handed out
            again (a consumer that died); None (default): never.
        epochs: passes over the dataset (default 1); None: endless.
        start_epoch: the epoch the pipeline starts at when no state is loaded and nothing is
            resumed (default 0): it reads epochs ``start_epoch`` to ``epochs - 1``, each in the
            same order as a pipeline started at 0 reads it (a loop that makes one pipeline per
            epoch passes ``start_epoch=e, epochs=e + 1`` to read epoch ``e``'s permutation).
        shuffle: a new seeded permutation every epoch, identical on every rank (default False:
            listing order).
        seed: the shuffle's seed (default 0).
        rank, world_size: this process's share of every epoch; both None (default): from the
            ``RANK``/``WORLD_SIZE`` environment (torchrun) or ``torch.distributed``, else 0 and 1.
        worker, num_workers: a DataLoader worker's share of the rank's share (default 0 of 1).
        partition: how the items are dealt to ranks and workers. ``"epoch"`` (default): a new
            split of every epoch's permutation (a global shuffle, like torch's
            ``DistributedSampler``). ``"fixed"``: the node-local shuffle: the items are split
            once for the run and each share is read in a new order every epoch, so a cache that
            holds its share (``retain="auto"``) downloads nothing after the first epoch; a batch
            then only ever mixes items of one share (see the training guide).
        balance: how a split weighs items: ``"bytes"`` (default: shares differ by at most the
            largest item's size) or ``"count"`` (round-robin: counts differ by at most one).
        equal_steps: every rank reads the same number of items per epoch, which DDP needs (a
            rank with more steps than the others hangs in a collective at the epoch's end).
            None (default): the shares the split gives (by bytes, counts may differ a lot);
            ``"pad"``: the epoch's permutation is extended with its first items until its
            length is a multiple of ``world_size`` (some items are read twice), as torch's
            ``DistributedSampler`` does; ``"drop"``: its last ``n % world_size`` items are
            left out of the epoch, as with ``drop_last=True``. With ``balance="bytes"`` the
            ranks' bytes still differ by at most the largest item's size; a rank's DataLoader
            workers get the same counts on every rank (so batches are equal too). With
            ``partition="fixed"`` the same items are padded or dropped every epoch. No effect
            with one rank.
        retain: ``"none"`` (default): evict an item when it is acknowledged; ``"auto"``: keep
            acknowledged items while space allows and, when space is needed, evict the one whose
            next use in the (known) plan is farthest away (Belady's MIN).
        prepare: ``fn(path)`` run on each item after download and before it is handed out, in a
            pool of ``prepare_workers`` threads (decode, probe, unpack...); it may write into the
            item folder. Its errors follow ``on_error``.
        prepare_reserve, prepare_ratio: bytes reserved for ``prepare``'s output beside each item:
            ``prepare_reserve + prepare_ratio * item size`` (defaults 0 and 0.0). After the hook
            the item's real size is measured: a surplus is released, an item that outgrew its
            reserve fails (its files are removed).
        prepare_workers: threads running ``prepare`` and ``unpack`` (default 2).
        unpack: extract each item's archives before it is handed out (default False): tar,
            ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``, ``.tar.zst`` (with ``zstandard``),
            zip, and the split volumes of one archive in a folder (``x.tar.gz-00``, ``-01``...;
            ``.partaa``...; ``.001``...), streamed in order into the extractor (no joined copy).
            ``<volume>.md5`` sidecars and ``md5sums`` files are checked. A folder item is
            delivered as the extracted files plus its files that are neither archives nor
            checksum files; a single-file item (``items="files"``) as a folder of the archive's
            name holding its members. The extracted files are reserved beside the item:
            ``unpack_ratio * item size`` (plus ``prepare``'s reserve, which the extraction may
            use too), at most what the capacity leaves beside the item. A member that would
            take the extraction past its reserve is refused before it is written
            (:class:`~cachepipe.ArchiveTooLargeError` naming it, the size it would reach and the
            option to raise), so the cap holds throughout;
            unsafe members (``..``, absolute names, links leaving the item, device files) are
            refused with :class:`~cachepipe.UnsafeMemberError`, an MD5 mismatch is a
            :class:`~cachepipe.ChecksumError`: the item fails (following ``on_error``) and
            nothing of it is published. ``prepare``, if given, then runs on the extracted item.
            ``CachedItem.size``/``files`` still describe the listed objects (the archives).
            Extracted items no longer match the listing: with ``keep_on_close``/``resume`` they
            are downloaded again.
        unpack_ratio: with ``unpack``, the room reserved for an item's extracted files, in times
            the item's size (default :data:`UNPACK_RATIO`, 1.25: archives of video, images or
            audio, which extract to 1-2% more than their size). Archives of compressible data
            need their compression ratio (5 for text packed to a fifth). After the extraction
            the real size is measured and the surplus released.
        keep_on_close: leave published items in ``cache_dir`` on close (default False); the next
            owner of the same source and items mode reuses those whose files still match the
            listing (by size, and by version where it gives ETags), and removes the others.
        resume: continue the pass an earlier owner of ``cache_dir`` was in (after a crash or a
            restart): from the first step of the plan it had not consumed, skipping the steps it
            acknowledged beyond it, with its saved listing instead of listing the source again
            (default False: a new pass).
        relist: with ``resume``, list the source again instead of using the saved listing.
        manifest: plan from this manifest (a local path or an object URL, written by
            ``cachepipe index``) instead of listing the source (default None: list it). It must
            list the same ``source`` and ``items`` mode; a corrupt or truncated one is refused.
            Objects added to the source since are not delivered. Read with ``storage_options``.
        progress: show a tqdm progress bar (default False).
        stall_warning: seconds a consumer waits in ``get``/the loop before each warning that no
            item is ready, with what is downloading and what is held (default 60); None: never.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, allow_inf_nan=False)

    source: Annotated[str, BeforeValidator(utf8_location)] = Field(min_length=1)
    cache_dir: Annotated[Path, BeforeValidator(check_cache_dir)]
    capacity: Capacity
    items: Literal["folders", "files"] = "folders"
    # not in the repr: a notebook shows `pipe.config`, and these hold the credentials (a backend's
    # secret may be under any name, nested: client_kwargs, an Azure connection string, a GCS token)
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    prefetch: int | None = Field(default=None, ge=1)
    max_concurrency: int = Field(default=64, ge=1, le=1024)
    max_large_requests: int = Field(default=16, ge=1, le=1024)
    part_size: Annotated[int | None, BeforeValidator(lambda v: None if v is None else parse_size(v, "part_size"))] = None
    download_processes: int = Field(default=0, ge=0, le=256)
    hedge: bool = True
    ordered: bool = True
    auto_ack: bool = True
    on_oversize: Literal["raise", "skip"] = "raise"
    on_error: Literal["raise", "skip"] = "raise"
    verify: Literal["size", "etag"] = "size"
    retries: int = Field(default=12, ge=0, le=1000)
    retry_backoff: float = Field(default=0.2, ge=0, le=60)
    retry_backoff_max: float = Field(default=10.0, gt=0, le=600)
    min_free: Annotated[int | Share | None, BeforeValidator(lambda v: None if v is None else parse_capacity(v, "min_free"))] = (
        None
    )
    lease_timeout: float | None = Field(default=None, gt=0)
    epochs: int | None = Field(default=1, ge=1)
    start_epoch: int = Field(default=0, ge=0)
    shuffle: bool = False
    seed: int = 0
    rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, ge=1)
    worker: int = Field(default=0, ge=0)
    num_workers: int = Field(default=1, ge=1)
    partition: Literal["epoch", "fixed"] = "epoch"
    balance: Literal["bytes", "count"] = "bytes"
    equal_steps: Literal["pad", "drop"] | None = None
    retain: Literal["none", "auto"] = "none"
    prepare: Callable[[Path], Any] | None = None
    prepare_reserve: Annotated[int, BeforeValidator(lambda v: 0 if v in (0, "0") else parse_size(v, "prepare_reserve"))] = 0
    prepare_ratio: float = Field(default=0.0, ge=0)
    prepare_workers: int = Field(default=2, ge=1, le=256)
    unpack: Annotated[bool, AfterValidator(filtered_tar)] = False
    unpack_ratio: float = Field(default=UNPACK_RATIO, gt=0, le=1_000_000)
    keep_on_close: bool = False
    resume: bool = False
    relist: bool = False
    manifest: Annotated[str | None, BeforeValidator(check_manifest_location)] = None
    progress: bool = False
    stall_warning: float | None = Field(default=60.0, gt=0)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:  # without pydantic's link, the storage options' credentials unsaid
            raise in_our_words(exc) from None

    # Checks of a field against fields before it, never of the model: an error of a model validator
    # carries every option as its input, which pydantic's message shows (the storage options'
    # credentials among them).
    @field_validator("start_epoch")
    @classmethod
    def _start_within_epochs(cls, value: int, info: ValidationInfo) -> int:
        if "epochs" not in info.data:
            return value  # epochs was refused already
        epochs = info.data["epochs"]
        if epochs is not None and value >= epochs:
            raise ValueError(f"start_epoch={value} with epochs={epochs}: expected 0 <= start_epoch < epochs (counted from 0)")
        return value

    @field_validator("download_processes")
    @classmethod
    def _processes_can_read(cls, value: int, info: ValidationInfo) -> int:
        source = info.data.get("source")
        if value and isinstance(source, str) and source.startswith("memory:"):
            raise ValueError(
                f"download_processes={value} with source {source!r}: a memory:// file system "
                "is private to this process, worker processes cannot read it; use download_processes=0"
            )
        return value

    @field_validator("cache_dir")
    @classmethod
    def _outside_the_source(cls, value: Path, info: ValidationInfo) -> Path:
        source = info.data.get("source")
        if isinstance(source, str) and cache_in_source(source, value):
            raise ValueError(
                f"{str(value)!r} is inside the source {source!r}: the source's listing would hold the cache's own "
                "files as items of the dataset; give a cache_dir outside the source folder"
            )
        return value

    @field_validator("world_size")
    @classmethod
    def _rank_in_world(cls, value: int | None, info: ValidationInfo) -> int | None:
        rank = info.data.get("rank")
        if rank is not None and value is not None and rank >= value:
            raise ValueError(f"rank {rank} with world_size {value}: expected 0 <= rank < world_size")
        return value

    @field_validator("prepare", "unpack")
    @classmethod
    def _without_retention(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False) and info.data.get("retain", "none") != "none":
            raise ValueError(f"{info.field_name} with retain='auto' is not supported yet: use retain='none'")
        return value

    @property
    def large_requests(self) -> int:
        """Requests in flight of items with a file over 256 KiB at most: ``max_large_requests``,
        within ``max_concurrency``."""
        return min(self.max_large_requests, self.max_concurrency)

    @property
    def prepares(self) -> bool:
        """True when items pass through a step between download and hand-out (``prepare``, ``unpack``)."""
        return self.prepare is not None or self.unpack

    def prepare_extra(self, size: int, block: int = 0, is_file: bool = False) -> int:
        """Bytes to reserve beside an item of ``size`` bytes for what ``unpack`` and ``prepare``
        write: ``unpack_ratio * size`` with ``unpack``, plus ``prepare_reserve + prepare_ratio *
        size``; 0 without either step. The extraction may use all of it (``prepare`` runs after
        it, and the item is measured at the end). With ``block`` (the cache's, above 0) and
        ``unpack``: that in whole blocks, and a block for each folder the extraction itself
        makes beside the item's (its own, and for a single archive file, ``is_file``, the one
        the archive is moved into): what ``unpack_ratio`` gives is for the members alone."""
        if not self.prepares:
            return 0
        unpacked = math.ceil(self.unpack_ratio * size) if self.unpack else 0
        extra = unpacked + self.prepare_reserve + int(self.prepare_ratio * size)
        if block > 0 and self.unpack:
            return -(-extra // block) * block + (2 if is_file else 1) * block
        return extra

    def unpack_advice(self, size: int, extra: int, block: int = 0, is_file: bool = False) -> str:
        """What to raise when the extraction of an item of ``size`` bytes passes its ``extra``
        bytes (the reserve :meth:`prepare_extra` asked for, with ``block`` and ``is_file``, cut
        to what the capacity leaves)."""
        wanted = self.prepare_extra(size, block, is_file)
        if extra < wanted:
            return (
                f"the capacity leaves only {extra} bytes beside this item of {size} bytes for its extraction "
                f"(unpack_ratio {self.unpack_ratio:g} asks for {wanted}): raise capacity"
            )
        with_prepare = " (with prepare_reserve/prepare_ratio)" if self.prepare_reserve or self.prepare_ratio else ""
        small = (
            f", and more where its files are small: each takes whole blocks of {block} bytes on this filesystem"
            if block > 0
            else ""
        )
        return (
            f"unpack_ratio {self.unpack_ratio:g}{with_prepare} reserves {self.prepare_extra(size)} bytes for this item of "
            f"{size} bytes: raise unpack_ratio to what the extracted files take over the archive's size (its compression "
            f"ratio{small})"
        )
