"""The scaling model's hardware: the GPUs, the links between them, the collectives' costs over
those, and a cluster's network of one link inside nodes and another between them.

Units: seconds, bytes, bytes/s (a link's per GPU, one direction), FLOP/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    memory: float  # bytes
    hbm: float     # bytes/s
    flops: float   # dense bf16 FLOP/s


GPUS = {"h100": GPU(80e9, 3.35e12, 989e12), "h200": GPU(141e9, 4.8e12, 989e12),
        "a100": GPU(80e9, 2.0e12, 312e12)}


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per GPU, one direction
    latency: float    # seconds per message


LINKS = {
    "infiniband-ndr": Link(400e9 / 8, 2e-6),
    "infiniband-hdr": Link(200e9 / 8, 2e-6),
    "ethernet-100g": Link(100e9 / 8, 10e-6),
    "nvlink-h100": Link(450e9, 1e-6),
}


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2 (n-1)/n * bytes / bandwidth + 2 (n-1) * latency."""
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def allgather(nbytes: float, n: int, link: Link) -> float:
    """All-gather of ``nbytes`` in total: (n-1) * latency + bytes / bandwidth."""
    return (n - 1) * link.latency + nbytes / link.bandwidth if n > 1 else 0.0


def ring_allgather(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in total, ``nbytes / n`` a rank:
    (n-1)/n * bytes / bandwidth + (n-1) * latency."""
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency if n > 1 else 0.0


@dataclass(frozen=True)
class Network:
    inter: Link
    intra: Link | None  # None: one flat network
    per_node: int = 8

    def allreduce(self, nbytes: float, n: int) -> float:
        """Flat ring inside one node; beyond it hierarchical: a ring all-reduce inside each
        node (reduce-scatter + all-gather), then ``per_node`` concurrent inter-node rings
        (one NIC per GPU) each on bytes / per_node."""
        if self.intra is None:
            return ring_allreduce(nbytes, n, self.inter)
        if n <= self.per_node:
            return ring_allreduce(nbytes, n, self.intra)
        g = self.per_node
        return ring_allreduce(nbytes, g, self.intra) + \
            ring_allreduce(nbytes / g, math.ceil(n / g), self.inter)

    def slowest(self, n: int) -> Link:
        """The slowest link a collective over ``n`` GPUs crosses."""
        return self.intra if self.intra is not None and n <= self.per_node else self.inter

    def allgather(self, nbytes: float, n: int) -> float:
        """All-gather over the slowest link it crosses (tiny payloads: latency-bound)."""
        return allgather(nbytes, n, self.slowest(n))

    def shard_collective(self, nbytes: float, n: int) -> float:
        """All-gather or reduce-scatter of a sharded model's ``nbytes`` over all ``n`` GPUs:
        one ring over the slowest link (beyond a node every GPU's NIC carries (n-1)/n of the
        bytes, whatever the order inside a node)."""
        return ring_allgather(nbytes, n, self.slowest(n))


def cluster_network(inter: str, intra: str, per_node: int) -> Network:
    """The network of link ``inter`` between nodes and ``intra`` inside them (names of
    :data:`LINKS`); flat where ``intra`` is "none" or ``inter`` is NVLink itself."""
    flat = inter == "nvlink-h100" or intra == "none"
    return Network(LINKS[inter], None if flat else LINKS[intra], per_node)
