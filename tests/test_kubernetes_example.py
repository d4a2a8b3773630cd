"""The Kubernetes example (examples/kubernetes/) agrees with the daemon config it ships: the config
loads, the socket and every cache live under host paths the daemon mounts, the training pod
mounts them at the same places, and the probes and the metrics port are the config's."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
import yaml

from cachepipe.service.config import load_config

EXAMPLES = PurePosixPath(__file__).parent.parent / "examples" / "kubernetes"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.upper().startswith("CACHEPIPE_"):
            monkeypatch.delenv(key)


def documents(name: str) -> dict[str, dict]:
    with open(EXAMPLES / name, encoding="utf-8") as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f) if doc}


def host_mounts(pod: dict, container: dict) -> dict[PurePosixPath, str]:
    """{mount path: host path} of the container's hostPath volumes."""
    hosts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    return {PurePosixPath(m["mountPath"]): hosts[m["name"]] for m in container["volumeMounts"] if m["name"] in hosts}


def under(path: PurePosixPath, mounts) -> PurePosixPath | None:
    return next((m for m in mounts if path.is_relative_to(m)), None)


@pytest.fixture
def example(tmp_path):
    docs = documents("cachepipe-daemonset.yaml")
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_map = docs["ConfigMap"]
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (key,) = config_map["data"]
    # the daemon is started with the file the ConfigMap mounts
    args = container["command"]
    assert args[:2] == ["cachepipe", "serve"]
    assert PurePosixPath(args[args.index("--config") + 1]) == PurePosixPath(config_mount["mountPath"]) / key
    path = tmp_path / key
    path.write_text(config_map["data"][key])
    return docs, pod, container, load_config(path)


def test_the_shipped_config_loads_and_its_paths_are_on_the_mounted_host_paths(example):
    _, pod, container, cfg = example
    mounts = host_mounts(pod, container)
    assert under(cfg.socket.parent, mounts) is not None, f"socket {cfg.socket} is not under a hostPath mount {list(mounts)}"
    for name, pipeline in cfg.pipelines.items():
        mount = under(PurePosixPath(pipeline.cache_dir), mounts)
        assert mount is not None, f"pipeline {name}: cache_dir {pipeline.cache_dir} is not under a hostPath mount"
        assert mount != under(cfg.socket.parent, mounts), "the cache and the socket share a host directory"
    assert cfg.jobs is not None, "the example takes training jobs (node mode)"
    mount = under(PurePosixPath(cfg.jobs.root), mounts)
    assert mount is not None and mount != under(cfg.socket.parent, mounts), f"jobs.root {cfg.jobs.root}"


def test_probes_ask_the_configured_socket_and_the_metrics_port_is_the_tcp_listener(example):
    docs, _pod, container, cfg = example
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["cachepipe", "wait"], probe
        assert command[command.index("--socket") + 1] == str(cfg.socket), probe
        timeout = float(command[command.index("--timeout") + 1])
        assert timeout < container[probe]["timeoutSeconds"], f"{probe}: kubelet would cut the wait short"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert cfg.tcp_port is not None and ports["metrics"] == cfg.tcp_port
    assert cfg.tcp_host == "0.0.0.0"  # noqa: S104 - the pod's address, for the scraper; fenced by the NetworkPolicy
    assert docs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.tcp_port)
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == docs["DaemonSet"]["spec"]["selector"]["matchLabels"]
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == [cfg.tcp_port]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])


def test_the_training_pod_mounts_the_same_host_paths_at_the_same_places(example):
    _, pod, container, cfg = example
    daemon = host_mounts(pod, container)
    job = documents("training-job.yaml")["Job"]["spec"]["template"]["spec"]
    (trainer,) = job["containers"]
    mine = host_mounts(job, trainer)
    roots = [PurePosixPath(p.cache_dir) for p in cfg.pipelines.values()] + ([PurePosixPath(cfg.jobs.root)] if cfg.jobs else [])
    for path in (cfg.socket.parent, *roots):
        mount = under(path, daemon)
        assert mount in mine and mine[mount] == daemon[mount], f"{path}: {daemon[mount]} at {mount} in the daemon, {mine}"
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["CACHEPIPE_SOCKET"] == str(cfg.socket)
    assert cfg.socket_group is not None and int(cfg.socket_group) in job["securityContext"]["supplementalGroups"]


def test_the_caches_on_one_host_disk_are_given_at_most_all_of_it(example):
    """Found in review: the example gave the pipeline 80% of the node's SSD and the jobs 60% of
    it, each resolved on its own: together 140% of the disk. Once the pipeline's items (kept
    with ``retain: auto`` over endless epochs) filled its 80%, the jobs had 15% of the disk left
    before ``min_free`` paused their downloads, not the 60% the config said."""
    from cachepipe.config import Share

    _, pod, container, cfg = example
    mounts = host_mounts(pod, container)
    shares: dict[str, float] = {}
    caps = [(p.cache_dir, p.capacity) for p in cfg.pipelines.values()]
    caps += [(cfg.jobs.root, cfg.jobs.capacity)] if cfg.jobs else []
    for path, capacity in caps:
        assert isinstance(capacity, Share), f"{path}: the example sizes its caches as shares of the node's disk"
        disk = mounts[under(PurePosixPath(path), mounts)]
        shares[disk] = shares.get(disk, 0) + capacity.fraction
    assert all(total <= 1 for total in shares.values()), shares
