"""Groups agreed responses into fused batches (pure logic, identical on every rank)."""

from __future__ import annotations

from raytrain_x.engine.messages import ALLREDUCE, Response


def fusion_key(response: Response) -> tuple:
    """Responses with equal keys may share one fused collective."""
    m = response.meta
    return (m.dtype, m.wire_dtype, m.op, m.prescale, m.postscale, m.process_set_id, m.device)


def plan_batches(responses: list[Response], threshold_bytes: int,
                 plans: dict | None = None) -> list[list[Response]]:
    """Greedy fusion in response order: an allreduce joins the open batch with its key while
    the batch stays within `threshold_bytes` (0 = no fusion); everything else runs alone.
    Batches come out ordered by their first response, so every rank runs the same plan.
    `plans` (`Agreement.plans`) keeps each threshold's plan of these same responses."""
    if plans is not None and threshold_bytes in plans:
        return plans[threshold_bytes]
    batches: list[list[Response]] = []
    open_batch: dict[tuple, tuple[int, int]] = {}  # key -> (batch index, bytes so far)
    for r in responses:
        if r.error or r.meta.kind != ALLREDUCE or threshold_bytes <= 0 or not r.meta.fuse:
            batches.append([r])
            continue
        key = fusion_key(r)
        size = r.meta.nbytes_on_wire()
        current = open_batch.get(key)
        if current is not None and current[1] + size <= threshold_bytes:
            batches[current[0]].append(r)
            open_batch[key] = (current[0], current[1] + size)
        else:
            batches.append([r])
            open_batch[key] = (len(batches) - 1, size)
    if plans is not None:
        plans[threshold_bytes] = batches
    return batches
