"""A thread that samples a cache directory every few ms while a test runs."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from cachepipe.blocks import clamp_block
from cachepipe.cache import tree_bytes


class Sampler:
    """Records the peak bytes under ``root`` and checks that no visible item is partial.

    ``expected``: {item name: {relative file: size}}; every file of an item folder seen outside
    ``.cachepipe`` must have its full size (staging files grow from 0, so a partially published
    item would show short files). Consumers check completeness and content at hand-out.

    The walk is not atomic, but it cannot count a file twice: files move only between staging
    (under ``.cachepipe``) and their place (a publish, an acknowledgement moving the item aside),
    and each sample lists the cache folder first, then walks ``.cachepipe``, then the items. A
    file moved into staging after the listing is counted there and is gone from its place when
    the walk reaches it; one moved out of staging after it was walked is not in the listing.
    """

    def __init__(
        self, root: Path, expected: dict[str, dict[str, int]] | None = None, interval: float = 0.002, block: int | None = None
    ) -> None:
        self.root = Path(root)
        # bytes counted as the cache's ledger counts them (files in whole blocks of this, a block
        # per folder): by default the block the cache reads at its open (its filesystem's
        # f_frsize, held to 512 B..64 KiB), read at the first sample; 0: the files' sizes alone
        self.block = block
        self.expected = expected
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self.partial: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.root.exists():
                continue
            self.peak = max(self.peak, self._bytes())
            self.samples += 1
            if self.expected is not None:
                self._check_complete()

    def _bytes(self) -> int:
        try:
            names = sorted(os.listdir(self.root), key=lambda name: name != ".cachepipe")
        except FileNotFoundError:
            return 0
        total = 0
        for name in names:
            path = self.root / name
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            block = self.block
            if block is None:
                block = self.block = clamp_block(os.statvfs(self.root).f_frsize)
            if stat.S_ISDIR(st.st_mode):
                total += block + tree_bytes(path, block=block)  # with its own folder
            elif stat.S_ISREG(st.st_mode):
                total += -(-st.st_size // block) * block if block else st.st_size
        return total

    def _check_complete(self) -> None:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            if name == ".cachepipe" or name not in self.expected:
                continue
            try:
                before = os.stat(self.root / name).st_ino
            except FileNotFoundError:
                continue
            found = {}
            for dirpath, _d, files in os.walk(self.root / name):
                for f in files:
                    p = Path(dirpath, f)
                    try:
                        found[p.relative_to(self.root / name).as_posix()] = p.stat().st_size
                    except (FileNotFoundError, ValueError):
                        pass
            try:
                unchanged = os.stat(self.root / name).st_ino == before
            except FileNotFoundError:
                unchanged = False
            if not unchanged:
                continue  # evicted while we walked it: the walk saw a half-removed tree, not a half-published one
            # A file of the wrong size means a partial item was visible. Missing files are an
            # eviction in progress (an item is deleted in place when closing).
            expected = self.expected[name]
            wrong = {rel: size for rel, size in found.items() if expected.get(rel) != size}
            if wrong:
                self.partial.append(f"{name}: {wrong}")


def block_of(path: str | os.PathLike[str]) -> int:
    """The block a cache at ``path`` (or its nearest existing folder) charges its items in."""
    from cachepipe.blocks import clamp_block

    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return clamp_block(os.statvfs(probe).f_frsize)


def charge(path: str | os.PathLike[str], file_sizes: list[int], folders: int) -> int:
    """What an item of files of ``file_sizes`` making ``folders`` folders takes in a cache at
    ``path``: as the ledger charges it (:func:`cachepipe.blocks.footprint`)."""
    from cachepipe.blocks import footprint

    return footprint(file_sizes, folders, block_of(path))
