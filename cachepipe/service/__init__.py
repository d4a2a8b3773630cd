"""The daemon front-end: ``cachepipe serve`` (see README_SECTION.md in this folder).

Modules, one noun each::

    config.py    ServiceConfig: the YAML/TOML file + CACHEPIPE_* environment, validated
    daemon.py    Daemon: named Pipelines, routing of paths to pipelines, reload, status
    api.py       the HTTP/JSON API on the Unix socket (and optional loopback TCP)
    markers.py   acks by ``<item>/.done`` markers and deletions (inotify: inotify.py)
    marker_policy.py  which event acks which hand-out (pure), the record of hand-outs
    metrics.py   Prometheus metrics in a per-daemon registry
    notify.py    sd_notify: READY, STATUS, RELOADING, STOPPING, WATCHDOG
    logs.py      journald-friendly logging to stderr
    main.py      serve(): the main thread, signals, the systemd conversation
    testing.py   DaemonProcess: run a daemon subprocess in tests and benchmarks
"""

from __future__ import annotations

from .config import ServiceConfig, load_config
from .daemon import Daemon

__all__ = ["Daemon", "ServiceConfig", "load_config"]
