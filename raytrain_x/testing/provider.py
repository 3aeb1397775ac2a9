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

Ray's autoscaler loads it as an external provider (`provider.type: external`,
`provider.module`) in its monitor process on the head.
"""

from __future__ import annotations

import time

from ray._private import ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class CloudLikeFakeProvider(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources,
                                               labels):
        time.sleep(float(self.provider_config.get("launch_delay_s", 0.0)))
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
    raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET) or []
    return bool(raylets) and all(info.process.poll() is not None for info in raylets)
