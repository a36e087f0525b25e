"""Module-level workers, the reference model and a raw client for the parameter-server / hybrid tests (see
_workers.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq
from torch import nn

from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.ps import OptimizerConfig, ServerProcess, start_servers, wire
from sparsync.ps.wire import CurveKeys, Header

VOCAB, DIM, CLASSES, SEQ, BATCH = 50, 8, 5, 6, 4


class TinyLM(nn.Module):
    """Sparse embedding + dense MLP head: the smallest model with both kinds of parameters."""

    def __init__(self, bag: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb: nn.Module = (
            nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True) if bag else nn.Embedding(VOCAB, DIM, sparse=True)
        )
        self.bag = bag
        self.head = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.bag else self.emb(x).mean(1)
        return self.head(h)


def start_pairs(n: int, **kw: Any) -> list[list[ServerProcess]]:
    """``n`` fresh pairs of servers (``start_servers(2, **kw)`` each), two pairs at a time: each server's start
    waits for its interpreter's imports, mostly on one core (more at once could pass the 30 s a server gets to
    start on a busy host). The run's client key is made first, so that every pair admits it."""
    wire.run_client_keys()
    with ThreadPoolExecutor(min(n, 2)) as pool:
        futures = [pool.submit(start_servers, 2, **kw) for _ in range(n)]
        pairs = []
        try:
            for f in futures:
                pairs.append(f.result())
        except BaseException:
            for f in futures:
                if f.exception() is None:
                    for s in f.result():
                        s.kill()
            raise
    return pairs


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB // 2, (BATCH, SEQ), generator=g) * 2 // 2  # duplicates within a batch
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x, y


def dense_opt(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01) if name == "adam" else torch.optim.SGD(params, lr=0.1)


def sparse_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=0.01)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1)
    return torch.optim.SGD(params, lr=0.1)


def server_opt(name: str) -> OptimizerConfig:
    return OptimizerConfig(name, lr=0.01 if name == "adam" else 0.1)


def reference(
    world: int, steps: int, opt: str, reduce: str, bag: bool = False
) -> tuple[torch.Tensor, list[float]]:
    """Single-process training on all workers' batches: loss = sum (or mean) of the per-worker losses."""
    model = TinyLM(bag)
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb")]
    o_d, o_s = dense_opt(opt, dense), sparse_opt(opt, [model.emb.weight])
    losses = []
    for s in range(steps):
        o_d.zero_grad()
        o_s.zero_grad()
        parts = [nn.functional.cross_entropy(model(batch(s, r)[0]), batch(s, r)[1]) for r in range(world)]
        loss = sum(parts) / (world if reduce == "mean" else 1)
        loss.backward()  # type: ignore[union-attr]
        o_d.step()
        o_s.step()
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
    return model.emb.weight.detach().clone(), losses


def hybrid_worker(rank: int, addresses: list[str], cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run each case (sync hybrid training) and return the final weights and dense parameters."""
    out = []
    for c in cases:
        model = TinyLM(c.get("bag", False))
        dense = [p for n, p in model.named_parameters() if not n.startswith("emb")]
        cfg = HybridConfig(
            mode="sync",
            sparse_reduce=c["reduce"],
            dense_reduce=c["reduce"],
            optimizer=server_opt(c["opt"]),
            procs_per_machine=c.get("ppm", 1),
            local_aggregation=c.get("local_agg", True),
            partitions=c.get("partitions"),
            ps_dense=c.get("ps_dense", False),
            dense_whole=c.get("dense_whole", False),
            split=c.get("split", "stride"),
            timeout=30.0,
        )
        tr = HybridTrainer(model, c.get("addresses", addresses), cfg,
                           dense_optimizer=dense_opt(c["opt"], dense))  # fmt: skip
        losses = []
        for s in range(c["steps"]):
            x, y = batch(s, rank)
            nxt = batch(s + 1, rank)[0] if c.get("prefetch") else None
            losses.append(tr.step(lambda x=x, y=y, m=model: nn.functional.cross_entropy(m(x), y), prefetch=nxt))
        dist.barrier()
        table = tr.tables["emb.weight"].read_all() if rank == 0 else None
        head = [p.detach().clone() for p in dense]
        tr.close()
        servers = {n: sorted({t.server_of(p) for p in range(t.partitions)}) for n, t in tr.tables.items()}
        out.append({"table": table, "head": head, "losses": losses, "servers": servers, "phases": dict(tr.phases)})
        dist.barrier()
    return out


def async_worker(rank: int, addresses: list[str], steps: int, fault: str) -> dict[str, Any]:
    """Async training; the last rank is slow (sleeps each step) or dies after one step."""
    model = TinyLM()
    cfg = HybridConfig(mode="async", optimizer=OptimizerConfig("sgd", lr=0.2), timeout=20.0)
    tr = HybridTrainer(model, addresses, cfg)
    world = dist.get_world_size()
    faulty = rank == world - 1
    t0 = time.monotonic()
    done, losses = 0, []
    for s in range(steps):
        if faulty and fault == "dead" and s == 1:
            tr.client.close()
            return {"steps": done, "dead": True, "seconds": time.monotonic() - t0, "losses": losses}
        if faulty and fault == "slow":
            time.sleep(2.0)
        x, y = batch(s % 3, rank)  # a few repeated batches: the loss must fall
        losses.append(tr.step(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y)))
        done += 1
        if faulty and fault == "slow" and time.monotonic() - t0 > 4:
            break
    seconds = time.monotonic() - t0
    tr.close()
    return {"steps": done, "dead": False, "seconds": seconds, "losses": losses}


# --- a raw client for hostile frames ---------------------------------------------------------------------------
class RawClient:
    """A bare DEALER socket that sends any frame. It speaks CURVE with ``keys`` (default: the run's, from the
    environment) when the address carries a server key, unless ``curve=False``."""

    def __init__(self, address: str, *, keys: CurveKeys | None = None, curve: bool = True) -> None:
        endpoint, server_key = wire.split_address(address)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys = keys or wire.client_keys_from_env()
        if curve and server_key is not None and keys is not None:
            self.sock.curve_serverkey = server_key.encode()
            self.sock.curve_publickey = keys.public.encode()
            self.sock.curve_secretkey = keys.secret.encode()
        self.sock.connect(endpoint)
        self.incoming = wire.Reassembler(max_message=2**31, max_total=2**31)

    def send(self, message: bytes) -> None:
        """Send ``message`` in fragments, as PSClient does (``sock.send`` sends one raw frame)."""
        for part in wire.fragments(message):
            self.sock.send(part)

    def replies(self, timeout: float) -> list[tuple[Header, str]]:
        """Every reply that arrives within ``timeout`` seconds."""
        out = []
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            got = self._reply()
            if got is not None:
                out.append(got)
        return out

    def _reply(self) -> tuple[Header, str] | None:
        whole = self.incoming.feed(b"server", self.sock.recv())
        if whole is None:
            return None
        h, body = wire.decode(whole, max_bytes=2**31)
        return h, bytes(body).decode(errors="replace")

    def ask(self, frame: bytes | None, timeout: float = 5.0, rid: int | None = None) -> tuple[Header, str] | None:
        """Send ``frame`` (None: nothing, just wait); the reply (header, body as text), or None when none came
        within ``timeout``. With ``rid``, replies to other requests (parked ones answered late) are skipped."""
        if frame is not None:
            self.send(frame)
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            got = self._reply()
            if got is not None and (rid is None or got[0].rid == rid):
                return got
        return None

    def ping(self, rid: int, timeout: float = 5.0) -> bool:
        """Whether the server answers a PING (replies to earlier frames are skipped)."""
        got = self.ask(wire.encode(Header(op=wire.Op.PING, rid=rid)), timeout, rid)
        return got is not None and got[0].op == wire.Op.PING | wire.REPLY_BIT and got[0].status == 0

    def ping_next(self, rid: int, timeout: float = 5.0) -> None:
        """Send a PING and check that the next reply, of any request id, answers it (``ping`` skips others). The
        server answers in order: a reply that comes first answers a frame sent earlier."""
        got = self.ask(wire.encode(Header(op=wire.Op.PING, rid=rid)), timeout)
        assert got is not None, f"no reply to PING {rid}"
        h = got[0]
        assert (h.rid, h.op, h.status) == (rid, wire.Op.PING | wire.REPLY_BIT, 0), (
            f"the reply before PING {rid}'s answers an earlier frame that had to go unanswered: {got}"
        )

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/{pid}/status")


def probe_worker(rank: int, addresses: list[str]) -> tuple[float, float]:
    """``measure_server`` from every rank at once (test_ps.py)."""
    from sparsync.ps import PSClient, measure_server

    with PSClient(addresses, sender=rank) as client:
        t = measure_server(client, rows=200, dim=16, repeats=2)
    return t.round_trip, t.per_byte
