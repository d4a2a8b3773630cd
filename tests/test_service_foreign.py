"""The daemon as a consumer in another language meets it: raw HTTP over its Unix socket, not
cachepipe's own client (a Go or C++ trainer, curl in a shell script), with the mistakes and the
deaths such clients have.

The daemon runs as a real subprocess over a local source; waits are on events (an answer, a
refusal, a process exit) with deadlines.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path

import yaml
from conftest import via
from waiting import wait_until

from cachepipe.listing import FIRST_PAGE_OBJECTS
from cachepipe.service.testing import DaemonProcess


def folders_config(tmp_path: Path, sock: Path, count: int, **top) -> Path:
    """A daemon's config over a local source of ``count`` one-file folders."""
    src = tmp_path / "src"
    for i in range(count):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "a.bin").write_bytes(bytes(100))
    train = {"source": f"{src}/", "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump({"socket": str(sock), **top, "pipelines": {"train": train}}))
    return path


def connect(sock: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)  # a bound on the test's own waits, not a timed assertion
    conn.connect(str(sock))
    return conn


def send(conn: socket.socket, method: str, route: str, body: dict | None = None) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    head = b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (method.encode(), route.encode(), len(data))
    conn.sendall(head + data)


def answer(conn: socket.socket) -> tuple[int, dict]:
    """Read one answer: (status, JSON body); (0, {}) if the connection ended without one."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = conn.recv(65536)
        if not chunk:
            return (0, {}) if not got else (-1, {"unparsed": got.decode("latin-1")})
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = re.search(rb"\r\nContent-Length: (\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = conn.recv(65536)
        assert chunk, got
        body += chunk
    return int(head.split()[1]), json.loads(body) if body else {}


def ask(sock: Path, method: str, route: str, body: dict | None = None) -> tuple[int, dict]:
    with connect(sock) as conn:
        send(conn, method, route, body)
        return answer(conn)


def waiting(tcp: socket.socket) -> int:
    """How many ``next`` requests of pipeline "train" wait in the daemon, asked over ``tcp``."""
    send(tcp, "GET", "/v1/status")
    return answer(tcp)[1]["pipelines"]["train"]["waiting"]


def test_consumers_killed_while_their_next_waits_do_not_hold_the_connection_slots(tmp_path, short_dir):
    # A consumer killed while its `next` waited (no item ready: all leased) held its connection
    # slot, and a thread, for the whole wait (up to max_wait, 300 s by default): a Go client
    # whose own timeout is shorter than the daemon's wait leaves one behind at each retry, and
    # once they filled max_clients every other consumer was refused 503 until their waits ended.
    sock = short_dir / "api.sock"
    config = folders_config(tmp_path, sock, 1, max_clients=3, tcp_port=0)  # TCP: slots of its own, to watch
    with DaemonProcess(config) as daemon:
        port = int(re.search(r" and http://127\.0\.0\.1:(\d+)", daemon.log()).group(1))
        status, held = ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 30})
        assert status == 200, held
        ghosts = [connect(sock) for _ in range(3)]
        try:
            for ghost in ghosts:
                send(ghost, "POST", "/v1/pipelines/train/next", {"timeout": 60})
            with socket.create_connection(("127.0.0.1", port), timeout=30) as tcp:
                wait_until(lambda: waiting(tcp) == 3, 30, "three consumers waiting")
        finally:
            for ghost in ghosts:
                ghost.close()  # the consumers die while their requests wait
        with connect(sock) as consumer:
            send(consumer, "POST", "/v1/pipelines/train/next", {"timeout": 30})  # was refused 503 (max_clients)
            status, body = ask(sock, "POST", "/v1/release", {"path": held["path"], "lease": held["lease"]})
            assert status == 200, body
            status, got = answer(consumer)  # the item given back reaches the live consumer, not a dead one
            assert status == 200 and got["name"] == held["name"], got
        assert "ending the one whose client went away while its request was answered" in daemon.log(), daemon.log()


def test_connections_ended_while_answered_are_bounded_by_max_clients(tmp_path, short_dir):
    # A connection ended because its client went away still waits in its thread (and holds its
    # descriptor) until its `next`'s wait ends: ended at each new connection, 30 dead consumers
    # took a daemon of max_clients 3 from 5 threads to 35 (review). No more than max_clients such
    # are ended; then a new connection is refused 503, as a full server refuses one.
    sock = short_dir / "api.sock"
    config = folders_config(tmp_path, sock, 1, max_clients=2, tcp_port=0)  # TCP: slots of its own, to watch
    with DaemonProcess(config) as daemon:
        try:  # failed 2 of 5 whole suites in s56, never alone (29 runs, 80 more beside the daemon's tests):
            # its log says which connections were ended or refused
            port = int(re.search(r" and http://127\.0\.0\.1:(\d+)", daemon.log()).group(1))
            assert ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 30})[0] == 200  # the only item, held
            with socket.create_connection(("127.0.0.1", port), timeout=30) as tcp:
                for dead in (2, 4):  # two dead consumers, then two more, each ending one of the first two
                    ghosts = [connect(sock) for _ in range(2)]
                    try:
                        for ghost in ghosts:
                            send(ghost, "POST", "/v1/pipelines/train/next", {"timeout": 60})
                        wait_until(lambda n=dead: waiting(tcp) == n, 30, f"{dead} consumers waiting")
                    finally:
                        for ghost in ghosts:
                            ghost.close()
            with connect(sock) as late:  # refused at once; before, accepted (a third ended connection), and no
                # answer came before the ghosts' 60 s waits ended: connect's 30 s bound tells the two apart (10 s
                # ran out on a loaded machine, load 10, in a whole suite)
                assert answer(late) == (503, {"error": "unavailable", "message": "too many connections (max_clients)"})
        except (AssertionError, OSError) as exc:
            raise AssertionError(f"{exc!r}; the daemon's log:\n{daemon.log()}") from exc


def test_a_request_line_over_the_limit_is_answered_431_naming_it(tmp_path, short_dir):
    # A request line over 64 KiB raised out of the connection's handler: the client got its
    # connection closed without an answer, and the daemon logged an ERROR with a traceback.
    sock = short_dir / "api.sock"
    config = folders_config(tmp_path, sock, 1)
    with DaemonProcess(config) as daemon, connect(sock) as conn:
        conn.sendall(b"GET /v1/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = answer(conn)
        assert status == 431, (status, body)
        assert body == {
            "error": "request_header_fields_too_large",
            "message": "request line over 65536 bytes: expected a method, a path and HTTP/1.1",
        }
        with connect(sock) as long:  # a client's bug: megabytes of line. Its write failed (EPIPE) before it
            long.settimeout(30)  # could read the answer: the daemon closed with the rest unread
            long.sendall(b"GET /v1/" + b"a" * (8 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer(long)[0] == 431
        assert ask(sock, "GET", "/v1/health")[0] == 200
        assert "Traceback" not in daemon.log(), daemon.log()


def test_a_next_that_finds_nothing_in_time_names_the_wait_it_asked_for(tmp_path, short_dir):
    # A 408 said what was left of the wait at the pipeline's last try, to the nanosecond: "no
    # item became ready within 0.29999712598510087 s" for a request of 0.3 s.
    sock = short_dir / "api.sock"
    with DaemonProcess(folders_config(tmp_path, sock, 1)):
        assert ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 30})[0] == 200  # the only item, leased
        status, body = ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 0.3})
    assert (status, body) == (408, {"error": "timeout", "message": "no item became ready within 0.3 s"})


def test_the_codes_of_malformed_requests_are_the_same_on_every_python():
    # They were made from the standard library's reason phrases: a body too large was
    # "request_entity_too_large" up to Python 3.12 and "content_too_large" from 3.13, and a 414
    # "request-uri_too_long". A client in another language matches on them.
    from http import HTTPStatus

    from cachepipe.service.routes import malformed_code

    assert [malformed_code(s) for s in (400, 404, 405, 408, 411, 413, 414, 431)] == [
        "bad_request",
        "not_found",
        "method_not_allowed",
        "request_timeout",
        "length_required",
        "request_entity_too_large",
        "request_uri_too_long",
        "request_header_fields_too_large",
    ]
    assert all(re.fullmatch(r"[a-z_]+", malformed_code(status)) for status in HTTPStatus if status >= 400)


def test_connections_ended_at_max_clients_are_logged_a_few_lines_at_a_time(tmp_path, short_dir):
    # Each connection ended to make room was a line of the log: 1,744 for 2,000 connections of a
    # client that opens one per request. Three lines, then a count of those held back.
    sock = short_dir / "api.sock"
    with DaemonProcess(folders_config(tmp_path, sock, 1, max_clients=2)) as daemon:
        opened = []
        try:
            opened.extend(connect(sock) for _ in range(20))  # each new one ends the one idle the longest
            send(opened[-1], "GET", "/v1/health")
            assert answer(opened[-1])[0] == 200
        finally:
            for conn in opened:
                conn.close()
        lines = [line for line in daemon.log().splitlines() if "max_clients (2) connections open: ending" in line]
    assert len(lines) == 3, lines  # before: 18 or more
    assert lines[-1].endswith("to make room (similar messages are held back for 30 s)"), lines


def test_a_listing_that_timed_out_is_answered_as_the_store_s_failure_not_as_a_wait_that_ran_out(
    s3_source, fault_proxy, tmp_path, short_dir
):
    # The 408 above said the request's wait for every TimeoutError the pipeline raised, also a
    # store's: a listing whose second page timed out (its read timeout, retries spent) was answered
    # 408 "no item became ready within 30 s" at once, as if nothing were ready yet (a client asks
    # again, forever), where it is 503 store_unavailable naming the store's endpoint.
    proxy, endpoint = fault_proxy
    s3_source.folders(FIRST_PAGE_OBJECTS + 1, {"a.bin": 10})
    options = via(s3_source, endpoint)
    # the proxy sees 10 tries of the held page before the listing fails, each waiting out this
    # timeout (at 1 s, ~12 s of the test); an unheld request that meets it is tried again
    options["config_kwargs"] = {**options["config_kwargs"], "read_timeout": 0.5}
    train = {"source": s3_source.url, "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    train |= {"storage_options": options, "retries": 0, "resume": False}  # a plain pass: the listing streams
    sock = short_dir / "api.sock"
    config = tmp_path / "cachepipe.yaml"
    config.write_text(yaml.safe_dump({"socket": str(sock), "pipelines": {"train": train}}))
    gate = threading.Event()
    proxy.hold(lambda head: "max-keys=1000" in head.split("\r\n")[0], gate, limit=60)  # the second page: no answer
    try:
        with DaemonProcess(config):
            taken = 0
            while True:  # the items of the first page, then the listing's failure in its turn
                status, body = ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 30, "count": FIRST_PAGE_OBJECTS})
                if status != 200:
                    break
                taken += len(body["items"])
    finally:
        gate.set()
    assert (status, body["error"]) == (503, "store_unavailable"), body  # before: 408 timeout
    assert f"timed out talking to {endpoint}" in body["message"] and taken <= FIRST_PAGE_OBJECTS, body
