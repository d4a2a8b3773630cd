"""Which items of ``SRC`` this process takes when ``cachepipe map`` runs on several nodes (pure).

:func:`resolve_rank` finds this process's ``(rank, world_size)``, and says where they came
from, from explicit values or the environment a scheduler sets, in this order:

1. ``rank``/``world_size`` given (``--rank``/``--world-size``): both, or ``world_size`` alone
   as the count of an index found in the environment (2, 3);
2. ``RANK`` and ``WORLD_SIZE`` (torchrun, most launchers): both or neither;
3. ``JOB_COMPLETION_INDEX`` (Kubernetes Indexed Job): the count is not in the environment,
   so it comes from ``world_size`` or ``CACHEPIPE_WORLD_SIZE`` (set it to the Job's
   ``completions``); an index without a count is refused;
4. ``SLURM_ARRAY_TASK_ID`` with ``SLURM_ARRAY_TASK_COUNT`` (or ``world_size``): made 0-based
   with ``SLURM_ARRAY_TASK_MIN`` and ``SLURM_ARRAY_TASK_STEP`` when set
   (``--array=1-16`` gives ranks 0..15; ``--array=0-30:2`` too);
5. ``SLURM_PROCID`` and ``SLURM_NTASKS`` (the tasks of ``srun -n N``);
6. none of them: rank 0 of 1 (this process takes every item).

:func:`take_share` gives each rank a run of consecutive items of the listing, balanced by
bytes: disjoint, covering, each within one item's size of an equal part of the bytes. A run,
not items dealt across the whole listing (the training plan's :func:`cachepipe.plan.split`,
which map used until now): a rank's results then lie together in DST, and it lists only that
part of DST (:mod:`cachepipe.map.dstrange`), not the whole of it. Shares depend only on the
listing (never on which items are done), so a rerun gives every rank the same share and the
done markers keep it idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .plan import MapItem

__all__ = ["COUNT_VARIABLE", "Rank", "resolve_rank", "take_share"]

COUNT_VARIABLE = "CACHEPIPE_WORLD_SIZE"
"""The variable giving the count of a Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX``."""

_GIVEN = "--rank/--world-size"


@dataclass(frozen=True)
class Rank:
    """This process's place among ``world_size`` processes, and where it came from (``source``,
    e.g. ``"RANK=1, WORLD_SIZE=3"``), for messages and the summary."""

    rank: int
    world_size: int
    source: str


def _given(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} {value!r}: expected an integer")
    return value


def _env_int(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected an integer") from None


def _check(rank: int, world_size: int, source: str) -> Rank:
    if world_size < 1:
        raise ConfigError(f"world size {world_size} (from {source}): expected an integer >= 1")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} (from {source}): expected 0 <= rank < world size {world_size}")
    return Rank(rank, world_size, source)


def _count(env: Mapping[str, str], world_size: int | None, index: str, fallback: str | None) -> tuple[int, str]:
    """The count for an index found in the environment: ``world_size`` if given (it must agree
    with ``fallback``'s value when that is set too), else ``fallback``'s value."""
    if world_size is not None:
        if fallback is not None and fallback in env and _env_int(env, fallback) != world_size:
            raise ConfigError(
                f"--world-size {world_size} disagrees with {fallback}={env[fallback]!r}: give the same count or drop one"
            )
        return world_size, f"--world-size {world_size}"
    if fallback is not None and fallback in env:
        return _env_int(env, fallback), f"{fallback}={env[fallback]}"
    want = f"--world-size (world_size=) or {fallback}" if fallback else "--world-size (world_size=)"
    raise ConfigError(f"{index}={env[index]!r} is set but the number of processes is not: give {want}")


def resolve_rank(environ: Mapping[str, str], rank: int | None = None, world_size: int | None = None) -> Rank:
    """This process's rank and world size (see the module notes for the order).

    Args:
        environ: the environment (``os.environ``).
        rank: the rank given (``--rank``), or None.
        world_size: the number of processes given (``--world-size``), or None.

    Raises:
        ConfigError: a malformed or out-of-range value, an index without a count, one of
            ``RANK``/``WORLD_SIZE`` without the other, a count without a rank; the message names
            the values and where they came from.
    """
    rank, world_size = _given("rank", rank), _given("world_size", world_size)
    env = environ
    if rank is not None:
        if world_size is None:
            raise ConfigError(f"rank {rank} is given without the number of processes: give --world-size (world_size=) too")
        return _check(rank, world_size, _GIVEN)
    if "RANK" in env or "WORLD_SIZE" in env:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            present, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise ConfigError(f"{present}={env[present]!r} is set but {missing} is not: set both (torchrun does) or neither")
        env_rank, count = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        source = f"RANK={env['RANK']}, WORLD_SIZE={env['WORLD_SIZE']}"
        if world_size is not None and world_size != count:
            raise ConfigError(f"--world-size {world_size} disagrees with {source}: give the same count or drop one")
        return _check(env_rank, count, source)
    if "JOB_COMPLETION_INDEX" in env:
        index = _env_int(env, "JOB_COMPLETION_INDEX")
        count, counted = _count(env, world_size, "JOB_COMPLETION_INDEX", COUNT_VARIABLE)
        return _check(index, count, f"JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}, {counted}")
    if "SLURM_ARRAY_TASK_ID" in env:
        task = _env_int(env, "SLURM_ARRAY_TASK_ID")
        low = _env_int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
        count, counted = _count(env, world_size, "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
        based = [f"minus SLURM_ARRAY_TASK_MIN={low}"] if "SLURM_ARRAY_TASK_MIN" in env else []
        based += [f"divided by SLURM_ARRAY_TASK_STEP={step}"] if step != 1 else []
        zero_based = f" ({', '.join(based)})" if based else ""
        source = f"SLURM_ARRAY_TASK_ID={env['SLURM_ARRAY_TASK_ID']}{zero_based}, {counted}"
        if step < 1 or (task - low) % step:
            raise ConfigError(
                f"SLURM_ARRAY_TASK_ID={task} is not SLURM_ARRAY_TASK_MIN={low} plus a multiple of "
                f"SLURM_ARRAY_TASK_STEP={step}: expected an array of evenly spaced ids (--array=0-15 or 1-16 or 0-30:2)"
            )
        return _check((task - low) // step, count, source)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun -n N: the tasks of one job step
        task, tasks = _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_NTASKS")
        source = f"SLURM_PROCID={env['SLURM_PROCID']}, SLURM_NTASKS={env['SLURM_NTASKS']}"
        if world_size is not None and world_size != tasks:
            raise ConfigError(f"--world-size {world_size} disagrees with {source}: give the same count or drop one")
        return _check(task, tasks, source)
    if world_size is not None and world_size != 1:
        raise ConfigError(
            f"--world-size {world_size} is given without a rank: give --rank, or run under a launcher that sets "
            "RANK, JOB_COMPLETION_INDEX, SLURM_ARRAY_TASK_ID or SLURM_PROCID"
        )
    if COUNT_VARIABLE in env:
        raise ConfigError(
            f"{COUNT_VARIABLE}={env[COUNT_VARIABLE]!r} is set but JOB_COMPLETION_INDEX is not: "
            "it counts the processes of a Kubernetes Indexed Job; unset it, or give --rank"
        )
    return Rank(0, 1, "default: no rank given or found in the environment")


def take_share(items: Sequence[MapItem], rank: int, world_size: int) -> list[MapItem]:
    """The items of ``rank`` among ``world_size`` processes: a run of consecutive items in
    listing order, so that a rank's keys in DST lie together and it lists only that part of DST
    (:mod:`~cachepipe.map.dstrange`). Every process that lists the same items gets a disjoint
    share; the shares cover ``items``, in rank order.

    An item goes to the rank whose part of the bytes, ``[r * total / world_size, (r + 1) *
    total / world_size)``, holds its middle (integers only). The first item of rank ``r`` then
    starts within half an item of ``r * total / world_size``, so each share's bytes are within
    the largest item's size of ``total / world_size``, and two shares differ by at most twice
    it (an item larger than a part can leave a rank with none). Every item empty: by count."""
    total, n = sum(mi.size for mi in items), len(items)
    share, before = [], 0
    for i, mi in enumerate(items):
        owner = min((2 * before + mi.size) * world_size // (2 * total), world_size - 1) if total else i * world_size // n
        if owner == rank:
            share.append(mi)
        before += mi.size
    return share
