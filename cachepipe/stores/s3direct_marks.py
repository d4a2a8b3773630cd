"""Reading a response body under low-water marks (``SO_RCVLOWAT``): how many bytes the kernel
gathers before it wakes the thread reading, and when a body is read so at all.

Over a network, whose packets come one at a time, a read woke for each (on the 400 Mbit/s link
of ``benchmarks/bench_link.py``, shared by 16 requests, a few KiB per wake-up, each a poll, a
recv and two hand-overs of the interpreter's lock: half the client's CPU on large items). On
Linux 5.8 or later (:data:`LOW_WATER_KERNEL`) the kernel is asked to gather up to
:data:`LOW_WATER` bytes first, never more than a quarter of the connection's receive buffer and
never more than is still to come. :func:`body_read` decides each read's mark and size (pure);
the other functions read and set the socket's options. :mod:`cachepipe.stores.s3direct` reads
its object bodies with them.
"""

from __future__ import annotations

import platform
import re
import socket
import sys

__all__ = ["BODY_AHEAD", "LOW_WATER", "LOW_WATER_KERNEL", "MIN_MARK", "NETWORK_SEGMENT", "body_read", "kernel_at_least"]

LOW_WATER = 256 * 1024
"""The most bytes of a response body the kernel gathers before waking the thread reading
it (``SO_RCVLOWAT``; Linux 5.8 or later; less for a small receive buffer and towards the body's end,
:func:`body_read`)."""
BODY_AHEAD = 64 * 1024
"""Bytes of a body that may have left the socket without being read by the response:
http.client's buffer (8 KiB) and, over TLS, a record (16 KiB) with its framing; the margin
:func:`body_read` keeps."""
MIN_MARK = 8 * 1024
"""The smallest low-water mark :func:`body_read` sets above the kernel's default of 1 byte."""
NETWORK_SEGMENT = 9000
"""The largest TCP segment (``TCP_MAXSEG``, bytes; jumbo frames included) of a connection whose
body reads get a low-water mark. Over loopback a segment is 64 KiB, so a wake-up brings that
much without a mark."""
LOW_WATER_KERNEL = (5, 8)
"""The oldest Linux release whose marks are used: before it, a receive buffer filled by packets'
overhead before the mark's bytes came could leave the reader asleep until the timeout (fixed by
"tcp: fix SO_RCVLOWAT possible hangs under high mem pressure", Linux 5.8)."""


def kernel_at_least(release: str, wanted: tuple[int, int]) -> bool:
    """Whether a Linux release string (``platform.release()``, e.g. ``"6.8.0-45-generic"``) is
    ``wanted`` (major, minor) or later; False if it does not start with a version."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= wanted


# socket(7): poll and recv honour the mark for TCP
_LOW_WATER_ON = sys.platform.startswith("linux") and kernel_at_least(platform.release(), LOW_WATER_KERNEL)


def body_read(left: int | None, most: int, receive_buffer: int, low_water: int = LOW_WATER) -> tuple[int, int]:
    """The next read of a response body with ``left`` bytes not yet read by the response (None:
    not known): ``(mark, size)``, the low-water mark to set on the connection and the bytes to
    ask for, at most ``most``.

    A read waits in the kernel until ``mark`` bytes are there (or the connection ends), so it
    must never wait for bytes that will not come: a read under a mark above 1 byte leaves at
    least that mark and :data:`BODY_AHEAD` bytes of the body after it. Towards the end the mark
    halves with what is left, down to :data:`MIN_MARK`; the last ``BODY_AHEAD`` bytes or so
    (and a body of unknown length) are read under 1 byte, the kernel's default. The mark is at
    most a quarter of the connection's ``receive_buffer`` (``SO_RCVBUF``, bytes; the kernel
    grows it as the connection speeds up): the window the sender sees is about half of it, so
    the sender goes on sending while the reader sleeps. With a mark above half the buffer the
    kernel sizes the window to the mark, and the sender stops until the reader wakes (a fixed
    256 KiB slowed 40 x 8 MiB on loopback by a sixth, ``benchmarks/README.md``).
    """
    room = -1 if left is None else left - BODY_AHEAD  # bytes of the body surely still in or to the socket
    if room >= 2 * MIN_MARK and receive_buffer >= 4 * MIN_MARK:
        mark = min(low_water, receive_buffer // 4, room // 2)
        return mark, min(most, room - mark)
    return 1, most if left is None else min(most, left)


def _marks_help(sock: socket.socket | None, left: int | None) -> bool:
    """Whether a body of ``left`` bytes (None: not known) on ``sock`` is read under low-water
    marks: on Linux 5.8 or later, a body long enough for one (:func:`body_read`), over a connection whose
    segments are a network's (:data:`NETWORK_SEGMENT`). Small bodies cost no system call here."""
    if not _LOW_WATER_ON or sock is None or left is None or left - BODY_AHEAD < 2 * MIN_MARK:
        return False
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) <= NETWORK_SEGMENT


def _receive_buffer(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def _set_low_water(sock: socket.socket, mark: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
