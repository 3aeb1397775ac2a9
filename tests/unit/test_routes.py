"""The route of an allreduce batch (`engine.plan`): one pure decision from agreed facts,
tested without processes."""

from __future__ import annotations

import pytest

from raytrain_x.engine.messages import Meta
from raytrain_x.engine.plan import (
    IN_FLIGHT_MIN_BYTES,
    Batch,
    Links,
    Route,
    allreduce_route,
    flat_route,
    gather_route,
)

MB = 1 << 20
ONE_HOST = Links(shm=True)
HOSTS = Links()  # a network, no hierarchy (one worker per host, or a process set)
HOSTS_OF_MANY = Links(hierarchical=True)  # the world: several hosts, several workers each


def batch(op="average", dtype="float32", wire=None, device="cpu", largest=4 * MB):
    return Batch(op, dtype, wire or dtype, device, largest)


@pytest.mark.parametrize("facts,links,knob,route", [
    (batch(op="adasum"), ONE_HOST, True, Route.ADASUM),
    (batch(op="adasum"), HOSTS, True, Route.ADASUM),
    (batch(device="cuda:0"), HOSTS, True, Route.DEVICE),
    (batch(device="cuda:0"), ONE_HOST, True, Route.DEVICE),  # shared memory is host memory
    (batch(), ONE_HOST, True, Route.SHM),
    (batch(op="max"), ONE_HOST, True, Route.SHM),
    (batch(wire="float16"), ONE_HOST, True, Route.SHM),  # packed, cast on the way
    (batch(dtype="bool"), ONE_HOST, True, Route.NETWORK),  # no shared-memory sum for it
    (batch(), HOSTS_OF_MANY, True, Route.HIERARCHICAL),
    (batch(op="sum", largest=64), HOSTS_OF_MANY, True, Route.HIERARCHICAL),
    (batch(), HOSTS_OF_MANY, False, Route.IN_FLIGHT),  # the knob off: a flat network
    (batch(op="max"), HOSTS_OF_MANY, True, Route.IN_FLIGHT),  # only sums go hierarchical
    (batch(dtype="int16"), HOSTS_OF_MANY, True, Route.NETWORK),
    (batch(), HOSTS, True, Route.IN_FLIGHT),
    (batch(largest=IN_FLIGHT_MIN_BYTES), HOSTS, True, Route.IN_FLIGHT),
    (batch(largest=IN_FLIGHT_MIN_BYTES - 1), HOSTS, True, Route.NETWORK),
    (batch(wire="float16"), HOSTS, True, Route.NETWORK),  # compressed: packed, one piece
])
def test_each_batch_takes_its_route(facts, links, knob, route):
    assert allreduce_route(facts, links, knob) is route


def test_the_facts_of_a_batch_are_its_agreed_metadata():
    metas = [Meta(kind="allreduce", dtype="float32", shape=(n,), device="cpu", op="sum")
             for n in (10, 1 << 20, 7)]
    facts = Batch.of(metas)
    assert facts == Batch("sum", "float32", "float32", "cpu", 4 << 20)
    assert facts.reduce_op == "sum" and Batch.of(metas[:1]).largest_bytes == 40
    assert allreduce_route(facts, HOSTS, True) is Route.IN_FLIGHT


def test_a_flat_speculative_array_never_goes_in_pieces():
    assert flat_route("float32", HOSTS, True) is Route.NETWORK
    assert flat_route("float32", HOSTS_OF_MANY, True) is Route.HIERARCHICAL
    assert flat_route("float32", ONE_HOST, True) is Route.SHM


@pytest.mark.parametrize("dtype,device,links,knob,route", [
    ("float32", "cpu", ONE_HOST, False, Route.SHM),
    ("int64", "cpu", ONE_HOST, True, Route.SHM),
    ("bool", "cpu", ONE_HOST, False, Route.NETWORK),  # no shared-memory slots for it
    ("float32", "cuda", ONE_HOST, False, Route.NETWORK),  # device memory: the backend
    ("float32", "cpu", HOSTS, True, Route.NETWORK),
    ("float32", "cpu", Links(multi_level=True), True, Route.HIERARCHICAL),
    ("float32", "cpu", Links(multi_level=True), False, Route.NETWORK),
])
def test_an_allgather_or_reducescatter_route_comes_from_agreed_facts_alone(
        dtype, device, links, knob, route):
    # nothing of one rank's own memory (contiguity) is asked: a rank whose array is
    # strided copies it and takes the same route as the others
    assert gather_route(dtype, device, links, knob) is route
