"""Rank functions for tests/launch/test_faults.py (module-level, so spawned ranks can unpickle them)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _pids import write_pid

import sparsync
from sparsync import SparseStream, sparse_allreduce
from sparsync.compress import Identity
from sparsync.compress.hooks import compression_hook


def signal_self_in_loop(rank: int, bad: int, sig: int, algorithm: str, pid_dir: str) -> int:
    """Every rank runs collectives in a loop; at the fourth, rank ``bad`` sends itself ``sig`` (SIGKILL: it
    dies without a report; SIGSTOP: it stays alive and never answers). The others wait on it: with a per-call
    timeout for sparse algorithms, the launch timeout alone for ``dense``."""
    write_pid(pid_dir, rank)
    x = torch.arange(16, dtype=torch.float32)
    for step in range(8):
        if step == 3 and rank == bad:
            (Path(pid_dir) / "signalled").write_text(repr(time.time()))
            os.kill(os.getpid(), sig)
            time.sleep(300)  # SIGSTOP: never reached until the launcher kills it
        if algorithm == "dense":
            sparsync.allreduce(x)
        else:
            sparse_allreduce(SparseStream.from_dense(x), algorithm=algorithm, timeout=5)
    return rank


def listeners(rank: int, launcher: int) -> dict[str, list[tuple[str, int]]]:
    """(address, port) of every TCP socket the launcher process (pid ``launcher``: a forked rank's parent is the
    forkserver) and this rank listen on, while the rank runs."""
    dist.barrier()  # every rank's gloo pairs are up
    return {"launcher": listening_sockets(launcher), "rank": listening_sockets(os.getpid())}


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets (IPv4 and IPv6) that process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = cols[1].split(":")
            out.append((_address(addr), int(port, 16)))
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped IPv6
        return ".".join(str(b) for b in words[12:])
    return ":".join(words[i : i + 2].hex() for i in range(0, 16, 2))


# --- a model that runs its own collective in backward (DLRM's alltoall) ----------------------
class _AllToAll(torch.autograd.Function):
    """Rows to ranks and back: ``all_to_all_single`` on the user's group in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous())
        return out


class _AllToAllModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bottom = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.top = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(_AllToAll.apply(self.bottom(x)))


def alltoall_training(rank: int, modes: tuple[str, ...], steps: int) -> dict[str, list[np.ndarray]]:
    """Train the alltoall model under DDP per mode ("ddp": DDP's own allreduce; "hook": sparsync's async DDP
    hook with the identity compressor, "hook|sync": the blocking hook). One bucket per parameter, so hooks
    fire while autograd still has the alltoall's backward to run. Returns the final parameters per mode."""
    from torch.nn.parallel import DistributedDataParallel

    P = dist.get_world_size()
    out: dict[str, list[np.ndarray]] = {}
    for mode in modes:
        model = _AllToAllModel()
        ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6)
        if mode != "ddp":
            ddp.register_comm_hook(None, compression_hook(Identity(), module=ddp, async_op=mode == "hook"))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(2 * P, 5, generator=gen)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[mode] = [p.detach().numpy().copy() for p in model.parameters()]
    return out


def hook_with_a_stalled_peer(rank: int, stall_step: int, stall: float) -> str:
    """DDP with the identity hook, one bucket per parameter; at ``stall_step`` rank 1's hook sleeps ``stall`` s
    (past the group's timeout) and raises instead of reducing. Returns the error that backward() raised on this
    rank ("" if none): the others' reductions must fail with the peer named, not wait forever."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6)
    real = compression_hook(Identity(), module=ddp)
    step = 0

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        if rank == 1 and step == stall_step:
            time.sleep(stall)
            raise RuntimeError("rank 1 stalled on purpose")
        return real(state, bucket)

    hook.__annotations__ = real.__annotations__  # DDP reads them
    ddp.register_comm_hook(None, hook)
    for step in range(stall_step + 1):  # noqa: B007  # read by the hook
        try:
            ddp(torch.randn(2, 4)).pow(2).mean().backward()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return ""


@dataclass(frozen=True)
class HostTag:
    """A ``launch`` RankSetup that only sets an environment variable per host (no namespaces)."""

    tags: tuple[str, ...]
    store_host: str | None = None

    @property
    def hosts(self) -> int:
        return len(self.tags)

    def __call__(self, host: int) -> dict[str, str]:
        return {"SPARSYNC_TEST_HOST_TAG": self.tags[host]}


def host_tag(rank: int) -> tuple[str, str, int]:
    """This rank's tag from its setup, its torchrun-style host index, and an allreduce over every rank."""
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return os.environ["SPARSYNC_TEST_HOST_TAG"], os.environ["GROUP_RANK"], int(t.item())


def crash_in_native_code(rank: int, bad: int) -> int:
    """Rank ``bad`` reads address 0 from C (a SIGSEGV, as a bug in native code would give); the others wait for
    it in a barrier."""
    if rank == bad:
        _read_address_zero()
    dist.barrier()
    return rank


def _read_address_zero() -> None:
    import ctypes

    ctypes.string_at(0)


def crash_once(rank: int, flag: str) -> int:
    """Rank 1 dies of SIGSEGV the first time (it leaves ``flag`` behind), and returns its rank after that."""
    if rank == 1 and not os.path.exists(flag):
        Path(flag).touch()
        _read_address_zero()
    dist.barrier()
    return rank
