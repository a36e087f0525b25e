"""The collective algorithms a backend runs for the calls a step makes, priced on a ``Cluster``: a dense allreduce
of one bucket, and the latency of an all-to-all round.

Dense allreduce:

- gloo runs a ring at every size and P: torch's ``ProcessGroupGloo`` (``torch/csrc/distributed/c10d/
  ProcessGroupGloo.cpp``, ``AsyncAllreduceWork::allreduce``) calls ``gloo::allreduce`` without setting an
  algorithm, and ``gloo/allreduce.cc`` runs ``ring`` for ``UNSPECIFIED`` (``bcube`` only when asked).
- NCCL prices every algorithm for the call's size and runs the fastest (``src/graph/tuning.cc``,
  ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``: time = latency + bytes / bandwidth). Its ring allreduce pays
  2(P-1) steps, 2(nodes-1) of them on the network and the rest inside a node; its tree (a double binary tree
  across nodes, a chain inside one) 2·((ranks per node - 1) intra hops + log2(nodes) network hops), at half
  the bus bandwidth (``ratio = .5``) times 0.9 (``busBw*.9``). So trees win small messages at many nodes and
  rings large ones.

We take those step counts with the cluster's α per message instead of NCCL's per-protocol hardware latencies
(LL, LL128, Simple; the ring's 1.9x plateau and the tree's size corrections left out), and the bandwidth of the
slower of a node's network link and its intra-node link, which every ring or tree edge crosses at once. One
level: nodes are the machines (their ranks aggregate first, ``procs_per_machine``), one hop kind. Two levels
(``Cluster.two_level``): nodes are the machines, ``procs_per_machine`` ranks each on the intra link.

All-to-all (gloo's ``alltoall``, NCCL's grouped send/recv): one message per peer, P-1 of them, each paying its
α: (P-1)·α on one level (or the link's measured ``alpha_a2a``), and (k-1)·α_intra + (P-k)·α_network on two
(k ranks per node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparsync.plan.cluster import Cluster

BACKENDS = ("gloo", "nccl")
# Which dense allreduce algorithms each backend may run (module doc); the first is the one it runs alone.
ALGORITHMS = {"gloo": ("ring",), "nccl": ("ring", "tree")}
TREE_BUS_SHARE = 0.5 * 0.9  # NCCL tuning.cc: a tree's algorithm bandwidth is .5 of its bus bandwidth, itself .9


@dataclass(frozen=True)
class Topology:
    """The terms of a collective on a cluster (module doc)."""

    nodes: int  # machines
    per_node: int  # ranks per node taking part (1 on one level: a machine's ranks aggregate first)
    alpha_intra: float  # seconds per message inside a node
    alpha_inter: float  # seconds per message on the network
    beta: float  # seconds per byte of the slowest edge a ring or tree step crosses
    gamma: float  # seconds per element reduced (a measured link's γ_dense; 0 on a nominal one)

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def topology(c: Cluster) -> Topology:
    """The collective terms of ``c``: two levels when it has an intra-machine link (``Cluster.two_level``), else
    one level of ``c.machines`` nodes."""
    link = c.link
    if not c.two_level:
        return Topology(c.machines, 1, link.alpha, link.alpha, link.beta, link.gamma_dense)
    _, intra, inter = c.level_links()
    m = c.procs_per_machine
    # level_links gives a rank's share of the machine's NIC (β·k); a ring or tree edge has the NIC to itself, and
    # on one machine no edge crosses it
    beta = intra.beta if c.machines == 1 else max(inter.beta / m, intra.beta)
    return Topology(c.machines, m, intra.alpha, inter.alpha, beta, inter.gamma_dense)


def ring_allreduce(nbytes: float, t: Topology, itemsize: int = 4) -> float:
    """A ring over every rank: 2(P-1) steps (2(nodes-1) on the network), 2(P-1)/P of the bytes per rank."""
    P = t.ranks
    if P == 1:
        return 0.0
    latency = 2 * (P - t.nodes) * t.alpha_intra + 2 * (t.nodes - 1) * t.alpha_inter
    return latency + 2 * (P - 1) / P * nbytes * t.beta + t.gamma * nbytes / itemsize


def tree_allreduce(nbytes: float, t: Topology, itemsize: int = 4) -> float:
    """NCCL's tree: up and down a chain inside the node and a binary tree across nodes, at ``TREE_BUS_SHARE``."""
    if t.ranks == 1:
        return 0.0
    hops = (t.per_node - 1) * t.alpha_intra + int(math.log2(t.nodes)) * t.alpha_inter
    return 2 * hops + nbytes * t.beta / TREE_BUS_SHARE + t.gamma * nbytes / itemsize


def allreduce_candidates(nbytes: float, c: Cluster, itemsize: int = 4) -> dict[str, float]:
    """Predicted seconds of a dense allreduce of ``nbytes`` by each algorithm ``c.backend`` may run."""
    t = topology(c)
    price = {"ring": ring_allreduce, "tree": tree_allreduce}
    return {a: price[a](nbytes, t, itemsize) for a in ALGORITHMS[c.backend]}


def dense_allreduce(nbytes: float, c: Cluster, itemsize: int = 4) -> tuple[str, float]:
    """(algorithm, seconds) of the dense allreduce ``c.backend`` runs for ``nbytes``: gloo's ring, NCCL's
    fastest (module doc; a tie goes to the ring)."""
    cand = allreduce_candidates(nbytes, c, itemsize)
    best = min(cand, key=lambda a: cand[a])
    return best, cand[best]


def all_to_all_latency(c: Cluster) -> float:
    """Latency of one all-to-all round over every rank (module doc)."""
    link = c.link
    P, m = c.machines * c.procs_per_machine, c.procs_per_machine
    if not c.two_level:
        return link.alpha_a2a if link.alpha_a2a is not None else (P - 1) * link.alpha
    _, intra, inter = c.level_links()
    return (m - 1) * intra.alpha + (P - m) * inter.alpha
