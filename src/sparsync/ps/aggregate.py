"""Local aggregation (Parallax §4.3): the workers of one machine sum their sparse gradients before one push.

An all-gather of (rows, grads) over a per-machine torch subgroup; the table coalesces the concatenation before
sending, and only the machine's first rank (its local chief) pushes. Ranks [k·m, (k+1)·m) form machine k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MachineAggregator:
    """The per-machine subgroups of a world of ``world`` ranks, ``procs_per_machine`` per machine. Collective at
    construction: every rank creates every machine's group, in the same order."""

    def __init__(self, rank: int, world: int, procs_per_machine: int) -> None:
        m = procs_per_machine
        if world % m:
            raise ValueError(f"world size {world} is not a multiple of procs_per_machine={m}")
        self.procs_per_machine, self.machine = m, rank // m
        self.is_chief = rank % m == 0
        self.group: dist.ProcessGroup | None = None
        for k in range(world // m):
            g = dist.new_group(list(range(k * m, (k + 1) * m)))
            if k == self.machine:
                self.group = g

    def gather(self, rows: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All of the machine's (rows, grads), concatenated in rank order. Collective over the machine."""
        g, m = self.group, self.procs_per_machine
        rows, vals = rows.cpu(), vals.cpu()  # the push goes to the servers from host memory anyway
        n = torch.tensor([rows.numel()])
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(m)]
        dist.all_gather(counts, n, group=g)
        top = int(max(c.item() for c in counts))
        pr = torch.zeros(top, dtype=torch.int64)
        pv = torch.zeros(top, vals.shape[1], dtype=vals.dtype)
        pr[: rows.numel()], pv[: rows.numel()] = rows, vals
        ar, av = [torch.empty_like(pr) for _ in range(m)], [torch.empty_like(pv) for _ in range(m)]
        dist.all_gather(ar, pr, group=g)
        dist.all_gather(av, pv, group=g)
        k = [int(c.item()) for c in counts]
        return torch.cat([a[:c] for a, c in zip(ar, k, strict=True)]), torch.cat(
            [a[:c] for a, c in zip(av, k, strict=True)]
        )
