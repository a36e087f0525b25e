"""How the split algorithms assign rows to owners (balanced partitions).

SparCML §4.1 cuts the index space into P contiguous ranges. On embedding gradients that is a trap: Zipf-hot
rows sit at low ids in most vocabularies, so the first owner receives nearly every rank's hot rows. We add
the stride partition of Zen (OSDI'25, "hash or stride of the row id"): row r belongs to rank r mod P, its
local index is r div P. Consecutive hot rows land on different owners, and a permuted vocabulary is spread
by the permutation itself. Contiguous ranges stay available (``partition="range"``): they need no
reordering of an element stream, which matters for SparCML's uniform element-sparse vectors.

``"auto"`` takes ``stride`` for row-sparse streams (row > 1: embedding rows) and ``range`` for element
streams (row = 1), a rule every rank evaluates identically from the agreed row width. (Chosen, not measured
per call: detecting skew would need per-partition counts in the metadata round.)

A partition maps a stream to one block per owner (in the owner's local row space) and maps the owners'
disjoint results back to one stream; both are vectorized (one stable sort by owner, no loop over rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsync.stream import SparseStream, concat_disjoint, dense_threshold, index_dtype_for

PARTITIONS = ("auto", "stride", "range")


def resolve_partition(partition: str, row: int) -> str:
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; valid: {', '.join(PARTITIONS)}")
    if partition == "auto":
        return "stride" if row > 1 else "range"
    return partition


@dataclass(frozen=True)
class Partition:
    """``kind`` ("stride" or "range") over ``rows`` rows and ``parts`` owners."""

    kind: str
    rows: int
    parts: int

    def counts(self) -> list[int]:
        """Rows owned by each owner."""
        R, P = self.rows, self.parts
        if self.kind == "stride":
            return [max(0, (R - j + P - 1) // P) for j in range(P)]
        b = self.bounds()
        return [b[j + 1] - b[j] for j in range(P)]

    def bounds(self) -> list[int]:
        """Range partition: P+1 boundaries of ceil(R/P) rows each, trailing ones short or empty."""
        chunk = -(-self.rows // self.parts)
        return [min(j * chunk, self.rows) for j in range(self.parts + 1)]

    def split(self, stream: SparseStream) -> list[SparseStream | None]:
        """One block per owner, in the owner's local row space (None for an owner with no rows)."""
        P, b = self.parts, stream.row
        counts = self.counts()
        if self.kind == "range":
            bnd = self.bounds()
            return [stream.slice(bnd[j], bnd[j + 1]) if counts[j] else None for j in range(P)]
        if stream.indices is None:
            rows2d = stream.rows2d
            return [
                SparseStream(None, rows2d[j::P].reshape(-1), counts[j] * b, row=b) if counts[j] else None
                for j in range(P)
            ]
        idx = stream.indices.to(torch.int64)
        owner = idx % P
        order = torch.sort(owner, stable=True).indices  # idx is sorted, so each owner's rows stay sorted
        per = torch.bincount(owner, minlength=P).tolist()
        local = torch.split(idx[order] // P, per)
        vals = torch.split(stream.rows2d[order], per)
        out: list[SparseStream | None] = []
        for j in range(P):
            if not counts[j]:
                out.append(None)
                continue
            n = counts[j]
            out.append(
                SparseStream(local[j].to(index_dtype_for(n)), vals[j].reshape(-1), n * b, row=b, validate=False)
            )
        return out

    def assemble(
        self,
        parts: list[SparseStream | None],
        dim: int,
        row: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> SparseStream:
        """The stream of ``dim`` values from every owner's disjoint result (None: an owner with no rows), on
        ``device`` (default: the parts', else the host). SparCML §3: sums of disjoint index sets are
        concatenations."""
        if device is None:
            device = next((p.device for p in parts if p is not None), torch.device("cpu"))
        if self.kind == "range":
            bnd = self.bounds()
            present = [(p, bnd[j]) for j, p in enumerate(parts) if p is not None]
            return concat_disjoint([p for p, _ in present], [o for _, o in present], dim)
        P = self.parts
        live = [(j, p) for j, p in enumerate(parts) if p is not None]
        if any(p.is_dense for _, p in live) or sum(p.nrows for _, p in live) >= dense_threshold(dim, dtype, row):
            out = torch.zeros(dim, dtype=dtype, device=device)
            out2d = out.view(-1, row)
            for j, p in live:
                if p.indices is None:
                    out2d[j::P] = p.rows2d
                else:
                    out2d[p.indices.to(torch.int64) * P + j] = p.rows2d
            return SparseStream(None, out, dim, row=row)
        rows = [p.indices.to(torch.int64) * P + j for j, p in live if p.indices is not None]
        if not rows:
            return SparseStream.empty(dim, dtype, row=row, device=device)
        srt, order = torch.sort(torch.cat(rows))
        # Each owner's rows go straight to their sorted places: one pass over the values (a concatenation
        # then a gather made two).
        place = torch.empty_like(order)
        place[order] = torch.arange(order.numel(), device=device)
        vals = torch.empty(order.numel(), row, dtype=dtype, device=device)
        off = 0
        for _, p in live:
            vals[place[off : off + p.nrows]] = p.rows2d
            off += p.nrows
        return SparseStream(srt.to(index_dtype_for(dim // row)), vals.reshape(-1), dim, row=row, validate=False)

    def gather_dense(self, gathered: torch.Tensor, chunk: int, row: int) -> torch.Tensor:
        """DSAR's dense allgather result ([P * chunk rows] in owner order, each owner's rows padded to
        ``chunk``) as the dense vector of ``rows * row`` values."""
        if self.kind == "range":
            return gathered[: self.rows * row]
        # Owner j's m-th row is global row m·P + j: transposing [P, chunk] to [chunk, P] puts it there.
        # reshape copies (the view is not contiguous), so the slice owns fresh memory: no clone (on
        # a 268 MB table each extra pass over fresh memory cost DSAR ~0.3 s).
        g = gathered.view(self.parts, chunk, row).transpose(0, 1).reshape(-1)
        return g[: self.rows * row] if self.parts > 1 and chunk > 1 else g[: self.rows * row].clone()
