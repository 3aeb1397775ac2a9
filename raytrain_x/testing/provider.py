"""Ray's fake multi-node provider, made to behave like a cloud's for elastic jobs.

- **Nodes take a while to come up.** A cloud instance takes a minute or more from the
  autoscaler's launch to a running raylet; the fake provider's nodes are up in about a
  second, so a job asking for four nodes gets all four before its first round and never
  grows while it trains. This provider waits `launch_delay_s` (provider config) before
  starting each node.
- **A node whose raylet is gone is gone.** A preempted spot instance, or a node Ray drained
  (its raylet exits once idle), leaves the cloud's instance list. The fake provider keeps
  such a node in its list, and Ray's v1 autoscaler then counts its capacity and never
  replaces it (measured: a job asking for 3 workers waited 300 s with 2). Here a node
  whose raylet process has exited is dropped from the list and its processes stopped.

- **A test decides when nodes arrive.** With `launch_budget_file` (provider config) set, a
  node starts only while that file holds a positive count of launches left, which each
  start takes one from; no file, no limit. A test makes an order of events happen with it
  (the first round forms on one node, more arrive after) instead of hoping the machine is
  slow or fast enough (`LocalAutoscalingCluster.allow_launches`).

Ray's autoscaler loads it as an external provider (`provider.type: external`,
`provider.module`) in its monitor process on the head.
"""

from __future__ import annotations

import os
import threading
import time

from raytrain_x.ray import internals

FakeMultiNodeProvider = internals.fake_multi_node_provider()

BUDGET_POLL_S = 0.1
_budget_lock = threading.Lock()  # the autoscaler launches from several threads


def take_launch(budget_file: str) -> bool:
    """Takes one launch from the budget in `budget_file`; True when a node may start now
    (no file: no limit)."""
    with _budget_lock:
        try:
            with open(budget_file) as f:
                left = int(f.read().strip() or 0)
        except FileNotFoundError:
            return True
        if left <= 0:
            return False
        write_launch_budget(budget_file, left - 1)
        return True


def write_launch_budget(budget_file: str, left: int | None) -> None:
    """Allows `left` more launches (None: no limit), atomically for the reader."""
    if left is None:
        try:
            os.remove(budget_file)
        except FileNotFoundError:
            pass
        return
    with open(budget_file + ".tmp", "w") as f:
        f.write(str(left))
    os.replace(budget_file + ".tmp", budget_file)


class CloudLikeFakeProvider(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources,
                                               labels):
        time.sleep(float(self.provider_config.get("launch_delay_s", 0.0)))
        budget = self.provider_config.get("launch_budget_file")
        while budget and not take_launch(budget):
            time.sleep(BUDGET_POLL_S)
        super()._create_node_with_resources_and_labels(node_config, tags, count, resources,
                                                       labels)

    def non_terminated_nodes(self, tag_filters):
        with self.lock:
            for node_id, entry in list(self._nodes.items()):
                node = entry.get("node")
                if node is not None and _raylet_exited(node):
                    self._nodes.pop(node_id)
                    node.kill_all_processes(check_alive=False, allow_graceful=False)
        return super().non_terminated_nodes(tag_filters)


def _raylet_exited(node) -> bool:
    raylets = node.all_processes.get(internals.RAYLET_PROCESS_TYPE) or []
    return bool(raylets) and all(info.process.poll() is not None for info in raylets)
