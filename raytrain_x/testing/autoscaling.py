"""A Ray cluster on this machine whose worker nodes an autoscaler starts and stops.

Ray's fake multi-node provider (`ray.cluster_utils.AutoscalingCluster`) runs each "node"
as a real raylet on this machine, launched and terminated by Ray's real autoscaler. This
subclass keeps the whole cluster to itself, so it can run beside other Ray clusters (a test
session's, a user's):

- its own GCS port and temp dir (Ray's class starts on port 6379 and runs
  `ray stop --force`, which stops every Ray process on the machine);
- the provider's nodes join that GCS (`provider.gcs_address`);
- `shutdown()` stops exactly its processes: those naming its temp dir or GCS port, and
  their descendants, found before any is signalled;
- its base config is built here, as Ray's wheel no longer ships the example YAML that
  `AutoscalingCluster` reads;
- its provider is Ray's fake one made cloud-like (`raytrain_x.testing.provider`): nodes
  can take a while to come up, and a node whose raylet exited (killed, or drained) leaves
  the provider's list, so the autoscaler replaces it.

    with LocalAutoscalingCluster({"cpu": {"resources": {"CPU": 1}, "max_workers": 4,
                                          "min_workers": 0, "node_config": {}}},
                                 head_resources={"CPU": 0}) as cluster:
        ray.init(cluster.address)
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ray.cluster_utils import AutoscalingCluster

from raytrain_x.ray import internals
from raytrain_x.testing.processes import (
    cluster_processes,
    environ_has,
    kill,
    processes,
    start_once_more,
    stop,
    with_descendants,
)
from raytrain_x.testing.waiting import free_port

# The fields of Ray's fake multi-node example config that the autoscaler reads.
BASE_CONFIG: dict[str, Any] = {
    "cluster_name": "raytrain-x-local",
    "max_workers": 8,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                 "disable_node_updaters": True, "disable_launch_config_check": True},
    "available_node_types": {},
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [],
    "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
    "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
}
NODE_ID_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"  # the fake provider names its nodes so
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
RAY = str(Path(sys.executable).with_name("ray"))


class LocalAutoscalingCluster(AutoscalingCluster):
    """Ray's fake multi-node autoscaling cluster, on its own port and temp dir.

    Args:
        worker_node_types: the autoscaler's `available_node_types` for workers (the
            config file's when None).
        head_resources: the head's resources (`{"CPU": 0}` keeps workers off the head).
        config_file: a cluster YAML for the fake provider to start from (for example
            `examples/clusters/local-fake.yaml`); the built-in base config when None.
        autoscaler_v2: run Ray's autoscaler v2 instead of v1.
        node_launch_delay_s: each node comes up this long after the autoscaler launches it,
            as a cloud instance takes a while to boot. The cluster runs Ray's fake provider
            through `raytrain_x.testing.provider.CloudLikeFakeProvider`, which also drops a
            node whose raylet has exited, as a cloud drops a preempted instance.
        start_timeout_s: how long `ray start --head` may take.
        **config_kwargs: top-level config fields (`idle_timeout_minutes`,
            `upscaling_speed`, `max_workers`).
    """

    def __init__(self, worker_node_types: dict | None = None,
                 head_resources: dict | None = None, *, config_file: str | None = None,
                 autoscaler_v2: bool = False, node_launch_delay_s: float = 0.0,
                 start_timeout_s: float = 90.0, **config_kwargs: Any) -> None:
        self._config_file = config_file
        self._launch_delay_s = node_launch_delay_s
        # in /tmp, not the temp dir: the config names it before start() makes that dir
        self.launch_budget_file = os.path.join(
            tempfile.gettempdir(), f"rtxas-launches-{os.getpid()}-{id(self):x}")
        self.start_timeout_s = start_timeout_s
        self.address: str | None = None
        self.temp_dir: str | None = None
        self._port = 0
        super().__init__(dict(head_resources or {"CPU": 0}), worker_node_types,
                         autoscaler_v2=autoscaler_v2, **config_kwargs)

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False,
                         **config_kwargs):
        if self._config_file:
            import yaml

            with open(self._config_file) as f:
                config = yaml.safe_load(f)
        else:
            config = copy.deepcopy(BASE_CONFIG)
        types = dict(config.get("available_node_types") or {})
        if worker_node_types is not None:
            types = dict(worker_node_types)
        types["ray.head.default"] = {"resources": dict(head_resources), "node_config": {},
                                     "max_workers": 0}
        config["available_node_types"] = types
        config["head_node_type"] = "ray.head.default"
        if config["provider"].get("type") == "fake_multinode":
            config["provider"].update({
                "type": "external", "launch_delay_s": self._launch_delay_s,
                "launch_budget_file": self.launch_budget_file,
                "module": "raytrain_x.testing.provider.CloudLikeFakeProvider"})
        if autoscaler_v2:
            config["provider"]["launch_multiple"] = True
            config["provider"]["head_node_id"] = FAKE_HEAD_NODE_ID
        config.update(config_kwargs)
        return config

    @property
    def config(self) -> dict:
        return copy.deepcopy(self._config)

    # ------------------------------------------------------------------ lifecycle
    def start(self, _system_config: dict | None = None,
              override_env: dict | None = None) -> LocalAutoscalingCluster:
        """Starts the head (with the autoscaler), once more if Ray's own start limit ran
        out (`start_once_more`)."""
        return start_once_more(lambda: self._start_once(_system_config, override_env),
                               "the autoscaling cluster's head")

    def _start_once(self, _system_config: dict | None,
                    override_env: dict | None) -> LocalAutoscalingCluster:
        import ray

        self.temp_dir = tempfile.mkdtemp(prefix="rtxas", dir="/tmp")  # short: unix sockets
        self._port = free_port()
        self.address = f"{ray.util.get_node_ip_address()}:{self._port}"
        config = copy.deepcopy(self._config)
        config["provider"]["gcs_address"] = self.address
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        head = dict(self._head_resources)
        cmd = [RAY, "start", "--head", f"--port={self._port}",
               f"--autoscaling-config={config_path}", f"--temp-dir={self.temp_dir}",
               "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={head.pop('CPU', 0)}", f"--num-gpus={head.pop('GPU', 0)}",
               # its own agent ports: the defaults may be taken by another cluster here
               f"--dashboard-agent-listen-port={free_port()}",
               f"--dashboard-agent-grpc-port={free_port()}",
               f"--metrics-export-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}"]
        if head:
            cmd.append(f"--resources={json.dumps(head)}")
        if _system_config is not None:
            cmd.append(f"--system-config={json.dumps(_system_config, separators=(',', ':'))}")
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1",
               "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
        if self._autoscaler_v2:
            env.update({"RAY_enable_autoscaler_v2": "1",
                        "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                        NODE_ID_ENV: FAKE_HEAD_NODE_ID})
        env.update(override_env or {})
        try:  # a start that fails half-way leaves processes: stopped below
            out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=self.start_timeout_s)
        except subprocess.TimeoutExpired:
            self.shutdown()
            raise RuntimeError(f"`ray start --head` with the autoscaler did not finish in "
                               f"{self.start_timeout_s:.0f}s") from None
        if out.returncode != 0:
            self.shutdown()
            raise RuntimeError(f"`ray start --head` with the autoscaler failed:\n"
                               f"{out.stderr[-2000:]}")
        return self

    def allow_launches(self, count: int | None) -> None:
        """From now on the autoscaler may bring up `count` more nodes (None: any number);
        a launch past them waits until more are allowed. Tests make an order of events
        happen with it: the first round on one node, the next nodes after it."""
        from raytrain_x.testing.provider import write_launch_budget

        write_launch_budget(self.launch_budget_file, count)

    def shutdown(self) -> None:
        """Stops this cluster's processes (the head's and every node the autoscaler
        started) and removes its temp dir; other Ray clusters on the machine keep
        running."""
        if self.temp_dir is None:
            return
        stop(cluster_processes([self.temp_dir, f":{self._port} "]))
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.allow_launches(None)
        self.temp_dir = None

    def __enter__(self) -> LocalAutoscalingCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ what it runs
    def gcs_client(self):

        return internals.gcs_client(self.address)

    def _alive(self) -> dict[str, Any]:
        """Alive node id -> its GCS node info, read from this cluster's GCS (no driver
        connection needed)."""
        from ray.core.generated import gcs_pb2

        nodes = self.gcs_client().get_all_node_info(timeout=10)
        return {node_id.hex(): info for node_id, info in nodes.items()
                if info.state == gcs_pb2.GcsNodeInfo.ALIVE}

    def alive_nodes(self) -> dict[str, dict[str, float]]:
        """Alive node id -> total resources."""
        return {node: dict(info.resources_total) for node, info in self._alive().items()}

    def worker_nodes(self) -> list[str]:
        """Alive nodes other than the head, oldest first (the provider numbers them)."""
        return sorted(node for node, info in self._alive().items() if not info.is_head_node)

    def head_node_id(self) -> str:
        for node, info in self._alive().items():
            if info.is_head_node:
                return node
        raise RuntimeError("the cluster has no alive head node")

    def resource_request(self) -> list[dict[str, float]]:
        """What `ray.autoscaler.sdk.request_resources` asks of this cluster now (v1)."""
        raw = self.gcs_client().internal_kv_get(internals.autoscaler_request_channel(), None,
                                                timeout=10)
        return json.loads(raw) if raw else []


def drain_node(address: str, node_id: str, deadline_s: float | None = None,
               reason: str = "DRAIN_NODE_REASON_PREEMPTION",
               message: str = "spot preemption notice") -> None:
    """Drains a node as the autoscaler or a cloud's preemption notice does, through the
    GCS call `ray drain-node` makes: Ray stops placing work there and announces the
    deadline by which the node will be gone. Like Ray, this does not kill the node at the
    deadline. Raises when the GCS rejects the drain."""
    from ray.core.generated import autoscaler_pb2

    deadline_ms = 0 if deadline_s is None else int(time.time() * 1000 + deadline_s * 1000)
    accepted, why = internals.gcs_client(address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(reason), message, deadline_ms)
    if not accepted:
        raise RuntimeError(f"the GCS rejected draining node {node_id[:8]}: {why}")


def kill_node(node_id: str) -> int:
    """Kills every process of a fake provider's node with SIGKILL, as a lost host; returns
    how many processes were killed."""
    procs = processes()
    roots = {pid for pid in procs if environ_has(pid, NODE_ID_ENV, node_id)}
    pids = with_descendants(roots, procs) - {os.getpid()}
    kill(pids)
    return len(pids)
