"""The baseline a PyTorch user would pick: ``DistributedDataParallel`` on gloo with the
embedding as ``nn.Embedding(sparse=True)``, so DDP reduces its COO gradient by gloo's sparse allreduce (its
own one-parameter bucket) and the dense parameters in its usual buckets. DDP keeps no sparsync ``CommLog``, so
the bytes it puts on the wire are computed here from what gloo sends:

- each dense bucket by gloo's ring allreduce (reduce-scatter, then allgather): every rank sends and receives
  2(P-1)/P of the bucket's bytes, so the buckets together send 2(P-1)/P of the dense gradients' bytes (the
  same count sparsync's ``dense`` algorithm logs);
- the sparse gradient by ``ProcessGroupGloo``'s sparse allreduce: it coalesces the local gradient (one entry
  per touched row), allgathers a 9 x int64 metadata record (4 sparse dims, 4 dense dims, nnz), then allgathervs
  every rank's int64 row indices and its rows of values, and sums the P tensors locally. gloo's allgather(v)
  is a ring: rank r sends its own block and forwards P-2 others (every block but rank r+1's) and receives
  every block but its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

GLOO_SPARSE_METADATA_BYTES = 9 * 8  # ProcessGroupGloo's SparseTensorMetadata: 9 int64 per rank
INDEX_BYTES = 8  # int64 row index per touched row (one sparse dim)


@dataclass(frozen=True)
class WireBytes:
    """What one rank put on (``sent``) and took off (``recv``) the wire."""

    sent: float
    recv: float

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent + other.sent, self.recv + other.recv)


def ring_allreduce_bytes(nbytes: int, P: int) -> WireBytes:
    """gloo's ring allreduce of ``nbytes``: 2(P-1)/P · nbytes each way per rank."""
    b = 2 * (P - 1) * nbytes / P
    return WireBytes(b, b)


def gloo_sparse_allreduce_bytes(rows: Sequence[int], row_bytes: int, rank: int) -> WireBytes:
    """gloo's sparse allreduce of a one-sparse-dim COO tensor: ``rows[i]`` is rank i's count of touched rows
    (after coalescing), ``row_bytes`` the bytes of one row of values; what ``rank`` sends and receives."""
    P = len(rows)
    if not 0 <= rank < P:
        raise ValueError(f"rank {rank} out of range for {P} ranks")
    if P == 1:
        return WireBytes(0.0, 0.0)
    block = [n * (INDEX_BYTES + row_bytes) for n in rows]
    meta = (P - 1) * GLOO_SPARSE_METADATA_BYTES
    return WireBytes(meta + sum(block) - block[(rank + 1) % P], meta + sum(block) - block[rank])


def sparse_grad_params(module: nn.Module) -> set[str]:
    """Names of the parameters whose gradient is sparse COO (``nn.Embedding``/``EmbeddingBag`` with
    ``sparse=True``): the ones DDP puts in a bucket of their own and reduces by gloo's sparse allreduce."""
    out: set[str] = set()
    for mname, m in module.named_modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse:
            out.update(f"{mname}.{p}" if mname else p for p, _ in m.named_parameters(recurse=False))
    return out


def ddp_step_bytes(module: nn.Module, rows: Sequence[int], rank: int) -> WireBytes:
    """Bytes one DDP step puts on the wire at ``rank`` for ``module`` with one sparse-gradient parameter
    touched at ``rows[i]`` rows on rank i (every dense parameter gets a gradient every step)."""
    sparse = sparse_grad_params(module)
    if len(sparse) != 1:
        raise ValueError(f"expected one sparse-gradient parameter, found {sorted(sparse)}")
    params = dict(module.named_parameters())
    dense = sum(p.numel() * p.element_size() for n, p in params.items() if n not in sparse and p.requires_grad)
    emb = params[next(iter(sparse))]
    row_bytes = emb[0].numel() * emb.element_size()
    return ring_allreduce_bytes(dense, len(rows)) + gloo_sparse_allreduce_bytes(rows, row_bytes, rank)
