"""Logical devices of one replica (TF-Replicator §3.3) in eager PyTorch: tensors that cross a model split go
forward by point-to-point send and their gradients come back through autograd.

The mechanism (docs/architecture.md, "Replicator"): all k processes of a replica run the same step_fn.
``on_device(j, fn, *args)`` runs ``fn`` on logical device j only; elsewhere it returns a ``Remote`` that stands
for the result. Before ``fn`` runs, every argument leaf that lives on another device o (a ``Remote`` on j, a
tensor tagged as o's on o) is sent o -> j:

- on o, a ``_Send`` autograd function sends the tensor and returns a 0-d *token* that depends on it; its
  backward receives the gradient from j. Tokens ride on the ``Remote`` results that o hands to the user.
- on j, a ``_Recv`` autograd function returns the received tensor, anchored on the token of the ``Remote`` it
  replaces; its backward sends the gradient to o and passes a zero on to the anchor.

So ``loss.backward()`` works on every process: where the loss lives it is an ordinary backward that ends in
``_Recv`` nodes (sending gradients upstream); elsewhere ``loss`` is a ``Remote`` whose ``backward()`` runs the
token's graph, whose ``_Send`` nodes wait for those gradients and continue into the local part of the model.
Every transfer carries a per-replica sequence number (all processes of a replica count every transfer), so a
step_fn that diverges across devices is reported as a ``ValueError`` instead of mixing up tensors. DCT-MP
(``dctmp.py``) compresses a transfer: forward sends the top-k values per row and their mask, backward the
gradient values under the same mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.comm import Comm
from sparsync.replicator import dctmp
from sparsync.replicator.dctmp import DCTMP

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
TAG = "_sparsync_logical_device"  # attribute naming the logical device that owns a tensor (set on its owner)
_MAGIC = 0x5350
_HDR = 16
_MAX_NDIM = _HDR - 9


@dataclass(frozen=True)
class SplitRecord:
    """One tensor crossing a model split, as its sender saw it (bytes this process put on the wire)."""

    name: str  # the split's name ("0->1" unless on_device(name=...) was given)
    src: int  # logical device that sent
    dst: int
    direction: str  # "forward" (activations) or "backward" (their gradients)
    shape: tuple[int, ...]
    kept_per_row: int  # k of DCT-MP; the row width when uncompressed
    value_bytes: int
    mask_bytes: int
    header_bytes: int
    seconds: float

    @property
    def total_bytes(self) -> int:
        return self.value_bytes + self.mask_bytes + self.header_bytes


class Remote:
    """A value that lives on another logical device of this replica. ``backward()`` runs this process's part
    of the backward pass (it waits for the gradients of what this process sent towards that value);
    ``ReplicaContext.fetch`` copies the value here. Indexing gives a Remote of the same device."""

    def __init__(self, device: int, token: torch.Tensor | None) -> None:
        self.device = device
        self.token = token

    def backward(self, gradient: Any = None, retain_graph: bool | None = None) -> None:
        if self.token is not None and self.token.requires_grad:
            self.token.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]

    def detach(self) -> Remote:
        return Remote(self.device, None)

    def __getitem__(self, key: Any) -> Remote:
        # A part of a remote value lives on the same device, and depends on the same transfers.
        return self

    def __repr__(self) -> str:
        return f"Remote(device={self.device})"


def _join(tokens: list[torch.Tensor]) -> torch.Tensor | None:
    live = [t for t in tokens if t is not None and t.requires_grad]
    if not live:
        return None
    out = live[0]
    for t in live[1:]:
        out = out + t
    return out


class LogicalDevices:
    """This process's view of its replica's logical devices: the model-parallel group (group rank = logical
    device id), the transfer counter, and the split records."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: int,
        count: int,
        timeout: float | None,
        compression: DCTMP | None = None,
        keep_records: bool = False,
    ) -> None:
        self.group = group
        self.device = device
        self.count = count
        self.timeout = timeout
        self.compression = compression
        self.seq = 0
        self.keep_records = keep_records
        self.records: list[SplitRecord] = []
        self.totals: dict[str, dict[str, int]] = {}  # split name -> direction -> bytes sent, always kept

    def add(self, rec: SplitRecord) -> None:
        d = self.totals.setdefault(rec.name, {"forward": 0, "backward": 0})
        d[rec.direction] += rec.total_bytes
        if self.keep_records:
            self.records.append(rec)

    # --- placement ------------------------------------------------------------------------------------------
    def owner(self, leaf: Any) -> int | None:
        if isinstance(leaf, Remote):
            return leaf.device
        if isinstance(leaf, torch.Tensor):
            o = getattr(leaf, TAG, None)
            return o if isinstance(o, int) else None
        return None

    def check_device(self, j: int) -> None:
        if not (isinstance(j, int) and 0 <= j < self.count):
            raise ValueError(f"unknown logical device {j!r}; this replica has devices 0..{self.count - 1}")

    def on_device(
        self,
        j: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        compression: DCTMP | None,
        name: str | None,
    ) -> Any:
        self.check_device(j)
        comp = compression if compression is not None else self.compression
        leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, Remote))
        tokens: list[torch.Tensor] = []
        for i, leaf in enumerate(leaves):
            o = self.owner(leaf)
            if isinstance(leaf, Remote) and leaf.token is not None and self.device != j:
                tokens.append(leaf.token)
            if o is None or o == j:
                continue
            seq = self._next_seq()
            split = name or f"{o}->{j}"
            if self.device == o:
                tok = self._send(leaf, j, seq, comp, split)
                if tok is not None:
                    tokens.append(tok)
            elif self.device == j:
                if not isinstance(leaf, Remote):  # j holds a Remote for o's value when all run one program
                    raise ValueError(
                        f"argument {i} of on_device({j}) is a tensor of logical device {o} on device {j}"
                    )
                leaves[i] = self._recv(o, seq, leaf.token, split)
        if self.device != j:
            return Remote(j, _join(tokens))
        a, kw = pytree.tree_unflatten(leaves, spec)
        out = fn(*a, **kw)
        return pytree.tree_map(self._tag, out)

    def _tag(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            # A fresh alias, so an input or a parameter returned by fn is not itself marked as this device's.
            x = x.view_as(x)
            setattr(x, TAG, self.device)
        return x

    def _next_seq(self) -> int:
        s = self.seq
        self.seq += 1
        return s

    # --- wire -------------------------------------------------------------------------------------------------
    def _comm(self, what: str) -> Comm:
        if self.group is None:
            raise RuntimeError("no model-parallel group: devices_per_replica is 1")
        c = Comm(self.group, self.timeout)
        c.op = what
        return c

    def _send(self, x: torch.Tensor, dst: int, seq: int, comp: DCTMP | None, name: str) -> torch.Tensor | None:
        if x.dim() > _MAX_NDIM:
            raise ValueError(f"tensors crossing a split have at most {_MAX_NDIM} dims, got shape {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            out: torch.Tensor = _Send.apply(self, x, dst, seq, comp, name)  # type: ignore[no-untyped-call]
            return out
        _send_forward(self, x.detach(), dst, seq, comp, name, req=False)
        return None

    def _recv(self, src: int, seq: int, anchor: torch.Tensor | None, name: str) -> torch.Tensor:
        comm = self._comm(f"receive from logical device {src}")
        hdr = torch.empty(_HDR, dtype=torch.int64)
        comm.recv(src, hdr)
        _check_header(hdr, seq, 0, src, self.device)
        kind, req, dt, k, mk, nd = (int(v) for v in hdr[3:9])
        shape = tuple(int(v) for v in hdr[9 : 9 + nd])
        dtype = DTYPES[dt]
        rows, d = _rows(shape)
        if kind == 0:
            buf = torch.empty(shape, dtype=dtype)
            comm.recv(src, buf)
            data, idx = buf, None
        else:
            vals = torch.empty(rows, k, dtype=dtype)
            comm.recv(src, vals)
            mbuf = torch.empty(dctmp.mask_nbytes(rows, d, k, dctmp.MASK_KINDS[mk]), dtype=torch.uint8)
            comm.recv(src, mbuf)
            idx = dctmp.decode_mask(mbuf, rows, d, k, dctmp.MASK_KINDS[mk])
            data = dctmp.scatter_rows(vals, idx, d).view(shape)
        if not (req and torch.is_grad_enabled()):
            return data
        if anchor is None or not anchor.requires_grad:
            anchor = torch.zeros((), requires_grad=True)
        out: torch.Tensor = _Recv.apply(anchor, data, self, src, seq, idx, name)  # type: ignore[no-untyped-call]
        return out

    def fetch_leaf(self, leaf: Any) -> Any:
        """The value of ``leaf`` on every device of the replica (broadcast from its owner), detached."""
        o = self.owner(leaf)
        if o is None:
            return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
        comm = self._comm(f"fetch from logical device {o}")
        assert self.group is not None
        seq = self._next_seq()
        mine = isinstance(leaf, torch.Tensor) and self.device == o
        hdr = torch.zeros(_HDR, dtype=torch.int64)
        if mine:
            hdr = _header(seq, 2, 0, False, leaf.dtype, 0, 0, tuple(leaf.shape))
        comm.run_collective("fetch header", dist.broadcast, hdr, group_src=o)
        _check_header(hdr, seq, 2, o, self.device)
        shape = tuple(int(v) for v in hdr[9 : 9 + int(hdr[8])])
        buf = leaf.detach().clone() if mine else torch.empty(shape, dtype=DTYPES[int(hdr[5])])
        comm.run_collective("fetch payload", dist.broadcast, buf, group_src=o)
        return buf


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    rows = shape[0]
    d = 1
    for s in shape[1:]:
        d *= s
    return rows, d


def _header(
    seq: int, direction: int, kind: int, req: bool, dtype: torch.dtype, k: int, mk: int, shape: Any
) -> Any:
    h = torch.zeros(_HDR, dtype=torch.int64)
    h[:9] = torch.tensor([_MAGIC, seq, direction, kind, int(req), DTYPES.index(dtype), k, mk, len(shape)])
    if len(shape):
        h[9 : 9 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return h


def _check_header(h: torch.Tensor, seq: int, direction: int, peer: int, me: int) -> None:
    what = ("activation", "gradient", "fetch")[direction]
    if int(h[0]) != _MAGIC or int(h[1]) != seq or int(h[2]) != direction:
        raise ValueError(
            f"logical device {me} expected {what} transfer #{seq} from logical device {peer}, got transfer "
            f"#{int(h[1])} (direction {int(h[2])}): the devices of this replica ran their step_fn differently "
            "(every device must make the same on_device calls in the same order)"
        )


def _send_forward(
    dev: LogicalDevices, x: torch.Tensor, dst: int, seq: int, comp: DCTMP | None, name: str, *, req: bool
) -> torch.Tensor | None:
    """Send an activation; returns the DCT-MP mask indices (None when sent whole)."""
    t0 = time.perf_counter()
    comm = dev._comm(f"send to logical device {dst}")
    x = x.contiguous()
    rows, d = _rows(tuple(x.shape))
    idx = None
    if comp is not None and x.dim() >= 1 and x.is_floating_point():
        k = comp.kept(d)
        mk = dctmp.mask_kind(rows, d, k)
    else:
        k, mk = d, "none"
    if mk == "none":
        hdr = _header(seq, 0, 0, req, x.dtype, d, 0, x.shape)
        comm.send(dst, hdr)
        comm.send(dst, x)
        vb, mb = x.numel() * x.element_size(), 0
    else:
        x2 = x.view(rows, d)
        idx = dctmp.select(x2, k)
        vals = dctmp.gather_rows(x2, idx).contiguous()
        mbuf = dctmp.encode_mask(idx, d, mk)
        hdr = _header(seq, 0, 1, req, x.dtype, k, dctmp.MASK_KINDS.index(mk), x.shape)
        comm.send(dst, hdr)
        comm.send(dst, vals)
        comm.send(dst, mbuf)
        vb, mb = vals.numel() * vals.element_size(), mbuf.numel()
    dev.add(
        SplitRecord(
            name, dev.device, dst, "forward", tuple(x.shape), k, vb, mb, _HDR * 8, time.perf_counter() - t0
        )
    )
    return idx


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dev: LogicalDevices, x: torch.Tensor, dst: int, seq: int, comp: Any, name: str) -> Any:
        ctx.idx = _send_forward(dev, x.detach(), dst, seq, comp, name, req=True)  # receiver builds a _Recv
        ctx.dev, ctx.dst, ctx.seq, ctx.shape, ctx.dtype = dev, dst, seq, tuple(x.shape), x.dtype
        return torch.zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor) -> Any:
        dev: LogicalDevices = ctx.dev
        comm = dev._comm(f"receive gradient from logical device {ctx.dst}")
        hdr = torch.empty(_HDR, dtype=torch.int64)
        comm.recv(ctx.dst, hdr)
        _check_header(hdr, ctx.seq, 1, ctx.dst, dev.device)
        rows, d = _rows(ctx.shape)
        if ctx.idx is None:
            g = torch.empty(ctx.shape, dtype=ctx.dtype)
            comm.recv(ctx.dst, g)
        else:
            vals = torch.empty(rows, ctx.idx.shape[1], dtype=ctx.dtype)
            comm.recv(ctx.dst, vals)
            g = dctmp.scatter_rows(vals, ctx.idx, d).view(ctx.shape)  # Alg. 2 line 14: zero outside M
        return None, g, None, None, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        data: torch.Tensor,
        dev: LogicalDevices,
        src: int,
        seq: int,
        idx: Any,
        name: str,
    ) -> Any:
        ctx.dev, ctx.src, ctx.seq, ctx.idx, ctx.name = dev, src, seq, idx, name
        ctx.anchor_shape = anchor.shape
        return data.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        dev: LogicalDevices = ctx.dev
        t0 = time.perf_counter()
        comm = dev._comm(f"send gradient to logical device {ctx.src}")
        g = g.contiguous()
        comm.send(ctx.src, _header(ctx.seq, 1, 0, False, g.dtype, 0, 0, g.shape))
        if ctx.idx is None:
            comm.send(ctx.src, g)
            vb, k = g.numel() * g.element_size(), _rows(tuple(g.shape))[1]
        else:
            rows, d = _rows(tuple(g.shape))
            vals = dctmp.gather_rows(g.view(rows, d), ctx.idx).contiguous()  # Alg. 2 line 13: X_grad ⊙ M
            comm.send(ctx.src, vals)
            vb, k = vals.numel() * vals.element_size(), ctx.idx.shape[1]
        dev.add(
            SplitRecord(
                ctx.name, dev.device, ctx.src, "backward", tuple(g.shape), k, vb, 0, _HDR * 8,
                time.perf_counter() - t0,
            )
        )  # fmt: skip
        return torch.zeros(ctx.anchor_shape), None, None, None, None, None, None
