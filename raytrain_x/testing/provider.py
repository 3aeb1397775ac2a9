"""Ray's fake multi-node provider with nodes that take a while to come up.

A cloud instance takes a minute or more from the autoscaler's launch to a running raylet;
the fake provider's nodes are up in about a second, so a job asking for four nodes gets all
four before its first round and never grows while it trains. This provider waits
`launch_delay_s` (provider config) before starting each node. Ray's autoscaler loads it
as an external provider (`provider.type: external`, `provider.module`), in its monitor
process on the head.
"""

from __future__ import annotations

import time

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class SlowStartFakeProvider(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources,
                                               labels):
        time.sleep(float(self.provider_config.get("launch_delay_s", 0.0)))
        super()._create_node_with_resources_and_labels(node_config, tags, count, resources,
                                                       labels)
