"""``cachepipe map``: process a dataset bigger than the disk, item by item, and write the results back.

::

    cachepipe map SRC DST --cache DIR --capacity 20GiB --jobs 4 [--out-ratio 1.5] -- CMD ARGS...

For each item of ``SRC`` (a first-level folder, or an object with ``--items files``) CMD runs
once, with the item's local path and an empty output folder as ``{}``/``{out}`` placeholders
and as ``$CACHEPIPE_ITEM``/``$CACHEPIPE_OUT``. When it exits 0, everything in the output folder
is uploaded to ``DST/<item>/``, then the marker ``DST/<item>/.cachepipe-done``, then the local
input and output are deleted. Python: :func:`map_items`, with ``fn(item_path, out_path)``.

**The cap, both ways.** Bytes under ``--cache`` never exceed ``--capacity``. Downloads run in a
:class:`~cachepipe.Pipeline` whose capacity is ``capacity - jobs * (reserve + margin)``: they can
never take the space set aside for outputs. Each job owns a *slot* of ``reserve + margin`` bytes
for its outputs (and, with ``--unpack``, the extracted files), where ``reserve`` is the largest
item's: ``--out-reserve``, or ``--out-ratio`` (default 1) times the command's input; with
``--unpack`` the extraction has a share of its own, ``--unpack-ratio`` (default 1.25) times the
item, and the outputs' share is computed from the extracted size (measured once the extraction
ends), so ``-- sh -c 'cp -r . "$CACHEPIPE_OUT/"'`` fits with the defaults. A watcher measures
every running job's slot (plus whatever the command adds to its input folder) every
``watch_interval`` (50 ms) and kills the command's process group once it holds more than the
item's reserve; the item fails with :class:`OutputTooLargeError`. The margin (default ``min(reserve, 64 MiB)``)
absorbs what a command writes between two measurements: the cap holds for any command that
writes less than ``margin`` per ``watch_interval`` (1.3 GB/s at the defaults); a faster
writer can pass the cap by what it writes beyond that within one interval (as can a steady one
on a machine so busy that the watcher measures late), and the item's error then says by how
much the cache may have passed it. Extraction
(``--unpack``) is exact: each member's size is checked before it is written; past its share the
item fails with :class:`~cachepipe.ArchiveTooLargeError` naming ``--unpack-ratio`` and the size.
An item larger than what the capacity leaves for downloads is refused before it is downloaded,
naming the least capacity that would hold it;
``--dry-run`` lists those refusals (``would refuse: ...``, exit status 1). The command's
input stays in the cache until its outputs are uploaded (a retry needs it), so downloads pause
while outputs wait for upload. When CMD exits, whatever it left running in its process group is
killed (Linux), so nothing it started writes into the cache after it; a process started outside
the group that still holds CMD's stderr a second later is killed too (by its ``CACHEPIPE_OUT``).

**Resumable.** Items whose marker exists in ``DST`` are skipped before anything is downloaded,
if it records the same input version and command (:func:`~cachepipe.map.plan.command_digest`:
CMD's arguments or ``fn``'s name, and ``unpack``; a marker of an earlier cachepipe, which records
no command, counts). An item done by another command is run again, and the summary and
``--dry-run`` say how many. The marker is written last and lists the item's outputs; a run
killed mid-upload leaves no marker, and the next run does that item again. An item that runs
leaves ``DST/<item>/`` holding its outputs and marker only: what an earlier attempt left there
under other names is deleted first (:mod:`~cachepipe.map.uploader`), known from one listing of
``DST`` at the start.

**Failures.** A non-zero exit, a timeout or a failed upload retries the item (``--retries``,
re-using the downloaded input; an upload failure re-uploads without running CMD again); then
the item is recorded as failed with the tail of CMD's stderr and the run goes on. Over-reserve
outputs and unusable archives fail at once (a retry would do the same). Exit status 1 if any
item failed.

**Across nodes.** ``--rank R --world-size W`` (or ``RANK``/``WORLD_SIZE``, a Kubernetes Indexed
Job's ``JOB_COMPLETION_INDEX`` with ``CACHEPIPE_WORLD_SIZE``, a Slurm array's
``SLURM_ARRAY_TASK_ID``): each of W processes lists ``SRC`` and takes a disjoint, byte-balanced
share of it, the same on every rerun (:mod:`~cachepipe.map.share`).

The code, one noun a module: :mod:`~cachepipe.map.plan` (options, work items; pure),
:mod:`~cachepipe.map.run` (:func:`map_items`: one run; its parts :mod:`~cachepipe.map.runnable`,
the checks of ``fn`` or the command, :mod:`~cachepipe.map.sizing`, the capacity's split, pure, and
:mod:`~cachepipe.map.remote`, the run's requests to ``SRC`` and ``DST``), :mod:`~cachepipe.map.job` (one job's
attempts at an item), :mod:`~cachepipe.map.child` (the child process and the reserve watcher),
:mod:`~cachepipe.map.result` (counters, progress, summary), :mod:`~cachepipe.map.share` (rank and
world size from flags or the scheduler's environment, each rank's share of the listing; pure), :mod:`~cachepipe.map.uploader`
(outputs, then the marker), :mod:`~cachepipe.map.cli` (the command line) and
:mod:`~cachepipe.unpack`.

``cachepipe.map``, the attribute, is :func:`map_items` (the public entry, ``from cachepipe import
map``), which hides this package under that name: import its modules with ``from
cachepipe.map.plan import ...`` or ``from cachepipe.map import plan``; the dotted attribute path
(``cachepipe.map.plan``, ``import cachepipe.map.plan as plan``, ``mock.patch("cachepipe.map....")``)
reaches the function and fails. ``python -m cachepipe.map`` runs the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import attach

if TYPE_CHECKING:
    from .job import OutputTooLargeError, UnsafeArgumentError
    from .plan import WORK_DIR, MapConfig, MapItem, plan_items
    from .result import MapFailure, MapResult
    from .run import map_items

__all__ = [
    "WORK_DIR",
    "MapConfig",
    "MapFailure",
    "MapItem",
    "MapResult",
    "OutputTooLargeError",
    "UnsafeArgumentError",
    "map_items",
    "plan_items",
]

# Imported on first use: `import cachepipe` loads this package (see cachepipe/__init__.py), and
# the `cachepipe` command builds its `map` options without importing the pipeline.
__getattr__, __dir__ = attach(
    __name__,
    {
        "OutputTooLargeError": (".job", "OutputTooLargeError"),
        "UnsafeArgumentError": (".job", "UnsafeArgumentError"),
        "WORK_DIR": (".plan", "WORK_DIR"),
        "MapConfig": (".plan", "MapConfig"),
        "MapItem": (".plan", "MapItem"),
        "plan_items": (".plan", "plan_items"),
        "MapFailure": (".result", "MapFailure"),
        "MapResult": (".result", "MapResult"),
        "map_items": (".run", "map_items"),
    },
    globals(),
)
del TYPE_CHECKING, attach  # not names of this package
