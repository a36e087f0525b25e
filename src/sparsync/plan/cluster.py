"""The machines a plan is priced on (Parallax §3.1, Table 3): their count, workers per machine, links, the
parameter servers' measured costs and the sharded exchange's CPU. The placement kinds' estimates
(``plan.kinds``) and the planner read it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsync.costmodel import LinkModel


@dataclass(frozen=True)
class ServerModel:
    """A parameter server's measured costs (``sparsync.ps.measure_server``: every rank pulling at once): the
    round trip of a request and the seconds per byte pulled. A sync step costs three round trips (pull, push,
    the chief's apply; Parallax §5) plus the bytes both ways: ``step_seconds``. The split of a step into these
    terms is ours; the paper prices servers by bytes alone (Table 3)."""

    round_trip: float
    per_byte: float

    def __post_init__(self) -> None:
        if not (self.round_trip >= 0 and self.per_byte >= 0 and math.isfinite(self.round_trip + self.per_byte)):
            raise ValueError(
                f"round_trip and per_byte must be finite and >= 0, got {self.round_trip}, {self.per_byte}"
            )

    def step_seconds(self, pull_bytes: float) -> float:
        """One sync step of a table whose rows pulled per machine weigh ``pull_bytes`` (pushed back the same)."""
        return 3 * self.round_trip + 2 * self.per_byte * pull_bytes


@dataclass(frozen=True)
class ExchangeCPU:
    """A rank's CPU seconds in one sharded step's exchange (``sparsync.shard``), apart from its bytes on the
    wire: the ids' dedupe and routing, the owners' ``index_select``, the pooling, the owners' sort and sum of
    the gradient rows, the rounds' copies. Linear in what a rank handles, ``per_step + per_table·T +
    per_key·K`` for T tables and K distinct keys a rank looks up (the owners serve K keys on average too), as
    the α-β-γ model charges a collective's computation per element (Chan et al. 2007, γ) and Parallax §3.2
    fits its iteration time from sampled runs. The exchange runs on the step's path, so the step pays it
    whole. ``fit`` gives the constants of a host from timed exchanges."""

    per_step: float  # seconds per exchange step (the rounds' set-up, the stages' fixed work)
    per_table: float  # seconds per table looked up (its call's registration, its slices of each stage)
    per_key: float  # seconds per distinct key a rank looks up (its row read, sent, pooled, its gradient summed)

    def __post_init__(self) -> None:
        terms = (self.per_step, self.per_table, self.per_key)
        if not all(math.isfinite(t) and t >= 0 for t in terms):
            raise ValueError(f"ExchangeCPU terms must be finite and >= 0, got {terms}")

    def seconds(self, tables: float, keys: float) -> float:
        """CPU seconds of a step that looks up ``keys`` distinct keys in ``tables`` tables."""
        return self.per_step + self.per_table * tables + self.per_key * keys

    def scaled(self, factor: float) -> ExchangeCPU:
        """Every term times ``factor`` (e.g. P ranks sharing C < P cores: P/C)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be finite and > 0, got {factor}")
        return ExchangeCPU(self.per_step * factor, self.per_table * factor, self.per_key * factor)

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float, float]]) -> ExchangeCPU:
        """Least squares over (tables, keys, seconds) ``samples``, float64; a term fitted below zero is
        dropped and the rest fitted again (the constants are costs)."""
        if len(samples) < 3 or len({(t, k) for t, k, _ in samples}) < 3:
            raise ValueError(f"fit needs >= 3 samples at 3 distinct (tables, keys), got {len(samples)}: {samples}")
        if any(not (math.isfinite(x) and x >= 0) for row in samples for x in row):
            raise ValueError(f"samples must be finite and >= 0, got {samples}")
        a = torch.tensor([[1.0, t, k] for t, k, _ in samples], dtype=torch.float64)
        b = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
        keep = [0, 1, 2]
        while True:
            x = torch.linalg.lstsq(a[:, keep], b, driver="gelsd").solution[:, 0].tolist()
            if min(x) >= 0 or len(keep) == 1:
                break
            del keep[min(range(len(keep)), key=lambda i: x[i])]
        terms = [0.0, 0.0, 0.0]
        for i, v in zip(keep, x, strict=True):
            terms[i] = max(v, 0.0)
        return cls(*terms)


@dataclass(frozen=True)
class Cluster:
    machines: int  # N
    procs_per_machine: int = 1  # workers per machine (they share one NIC and one server)
    bandwidth: float = 1.25e9  # bytes/s per machine link (10 Gbit/s)
    latency: float = 50e-6  # seconds per message
    measured: LinkModel | None = None  # a measured link (α, β); overrides bandwidth and latency when given
    server: ServerModel | None = None  # measured parameter servers (``sparsync.ps.measure_server``): their price
    # the link between the ranks of one machine (shared memory or loopback); given with procs_per_machine > 1,
    # sparse allreduce is priced on two levels: flat over every rank, or hierarchical
    intra_bandwidth: float | None = None  # bytes/s
    intra_latency: float = 5e-6  # seconds per message
    # measured (world, intra-machine, inter-machine) links of a two-level run (``bench allreduce --hosts``'s
    # JSON, ``collectives.hierarchical.measured_levels``): price both levels with them instead, γ included
    levels: tuple[LinkModel, LinkModel, LinkModel] | None = None
    # the backend whose collective algorithms price a dense allreduce (``plan.backend``): "gloo" runs rings,
    # "nccl" rings or trees by message size
    backend: str = "gloo"
    # a rank's CPU in the sharded exchange (``ExchangeCPU``, fitted on the ranks' host); None: the exchange is
    # priced by its bytes and rounds only
    exchange_cpu: ExchangeCPU | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.machines < 1 or self.procs_per_machine < 1:
            raise ValueError(
                f"machines and procs_per_machine must be >= 1, got {self.machines}, {self.procs_per_machine}"
            )
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)) or not self.latency >= 0:
            raise ValueError(f"bandwidth must be > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")
        if self.intra_bandwidth is not None and not (
            self.intra_bandwidth > 0 and math.isfinite(self.intra_bandwidth) and self.intra_latency >= 0
        ):
            raise ValueError(
                f"intra_bandwidth must be > 0 and intra_latency >= 0, got {self.intra_bandwidth}, "
                f"{self.intra_latency}"
            )

    @property
    def two_level(self) -> bool:
        return (self.intra_bandwidth is not None or self.levels is not None) and self.procs_per_machine > 1

    def level_links(self) -> tuple[LinkModel, LinkModel, LinkModel]:
        """(world, intra-machine, inter-machine) links per rank: measured (``levels``), else nominal (γ off):
        a rank's share of the machine's NIC while its k peers send too is bandwidth / k, as the cross groups
        of a hierarchical call see it; the world's link is the intra-machine one (the flat call raises its β
        to the inter-machine share, ``price_levels``)."""
        if self.levels is not None:
            return self.levels
        if self.intra_bandwidth is None:
            raise ValueError("two-level pricing needs intra_bandwidth or measured levels")
        base = self.link
        intra = LinkModel(alpha=self.intra_latency, beta=1.0 / self.intra_bandwidth, gamma_sparse=0,
                          gamma_dense=0, gamma_scatter=0)  # fmt: skip
        return intra, intra, dataclasses.replace(base, beta=base.beta * self.procs_per_machine, beta_exchange=None)

    @property
    def link(self) -> LinkModel:
        # Nominal: γ terms off, the plan compares network costs (Table 3). Measured: as measured (module doc).
        if self.measured is not None:
            return self.measured
        return LinkModel(
            alpha=self.latency, beta=1.0 / self.bandwidth, gamma_sparse=0, gamma_dense=0, gamma_scatter=0
        )
