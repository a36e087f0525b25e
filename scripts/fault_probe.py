"""Fault probe for docs/reliability.md: kill the launcher, kill -9 or SIGSTOP a rank, and
count what is left behind and what the user's error says.

    .venv/bin/python scripts/fault_probe.py launcher --runs 3     # orphans after SIGTERM/SIGKILL of the launcher
    .venv/bin/python scripts/fault_probe.py rank-kill --runs 2    # is the killed rank named? (P=3,4 x algorithms)
    .venv/bin/python scripts/fault_probe.py rank-stop --runs 2    # is the stopped rank named, and how fast?
    .venv/bin/python scripts/fault_probe.py exit --runs 16        # aborts at exit of torchrun trainings

To measure an older sparsync, put its ``src`` first: ``PYTHONPATH=/tmp/old/src .venv/bin/python ...``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import sparsync
from sparsync import LaunchError, SparseStream, launch, sparse_allreduce

# The rank pid files of tests/launch/test_faults.py (standard library only, so an older sparsync can be measured too).
TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from _pids import read_pids, running, write_pid  # noqa: E402

ALGORITHMS = ("ssar_recursive_double", "ssar_split_allgather", "allgather", "dense")


def looper(rank: int, algorithm: str, pid_dir: str) -> None:
    """Collectives back to back until a peer fails (per-call timeout 5 s; ``dense``: launch's timeout)."""
    write_pid(pid_dir, rank)
    x = torch.arange(4096, dtype=torch.float32)
    while True:
        if algorithm == "dense":
            sparsync.allreduce(x)
        else:
            sparse_allreduce(SparseStream.from_dense(x), algorithm=algorithm, timeout=5)


def _pids(pid_dir: str, n: int, limit: float = 120.0) -> list[int]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if (pids := read_pids(pid_dir, n)) is not None:
            return pids
        time.sleep(0.05)
    raise TimeoutError("ranks did not start")


def probe_launcher(runs: int) -> None:
    for how, sig in itertools.product(("launch", "replicator"), (signal.SIGTERM, signal.SIGKILL)):
        orphans = 0
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as d:
                main = Path(d) / "main.py"
                call = (
                    f"launch(_pids.sleep_forever, nprocs=3, args=({d!r},))"
                    if how == "launch"
                    else f"Replicator(num_replicas=3).start(_pids.replica_sleep_forever, {d!r})"
                )
                main.write_text(
                    f"import sys; sys.path.insert(0, {str(TESTS)!r})\nimport _pids\n"
                    "from sparsync import launch\nfrom sparsync.replicator import Replicator\n"
                    f"if __name__ == '__main__':\n    {call}\n"
                )
                proc = subprocess.Popen([sys.executable, str(main)], stderr=subprocess.DEVNULL)
                pids = _pids(d, 3)
                proc.send_signal(sig)
                proc.wait()
                time.sleep(5.0)
                left = [p for p in pids if running(p)]
                orphans += len(left)
                for p in left:
                    os.kill(p, signal.SIGKILL)
        print(f"{how:10s} {sig.name}: {orphans} of {3 * runs} ranks still running 5 s later", flush=True)


def _fault_run(
    P: int, algorithm: str, sig: signal.Signals, rng: random.Random
) -> tuple[int, LaunchError | None, float]:
    victim = rng.randrange(P)
    delay = rng.uniform(0.2, 1.5)
    with tempfile.TemporaryDirectory() as d:

        def strike() -> None:
            pid = _pids(d, P)[victim]
            time.sleep(delay)
            os.kill(pid, sig)
            struck.append(time.monotonic())

        struck: list[float] = []
        t = threading.Thread(target=strike, daemon=True)
        t.start()
        try:
            launch(looper, nprocs=P, args=(algorithm, d), timeout=8)
            err = None
        except LaunchError as e:
            err = e
        t.join()
    return victim, err, time.monotonic() - struck[0]


def probe_rank(runs: int, sig: signal.Signals) -> None:
    rng = random.Random(14)
    total = headline = anywhere = 0
    waits = []
    for _, P, algorithm in itertools.product(range(runs), (3, 4), ALGORITHMS):
        victim, err, wait = _fault_run(P, algorithm, sig, rng)
        msg = str(err) if err is not None else "(no error)"
        total += 1
        headline += err is not None and err.rank == victim
        anywhere += bool(re.search(rf"\brank {victim}\b", msg))
        waits.append(wait)
        print(f"P={P} {algorithm:22s} victim={victim} -> {msg.splitlines()[0][:150]} ({wait:.1f} s)", flush=True)
    print(
        f"{sig.name}: error attributed to the victim {headline} of {total}; victim named anywhere in the "
        f"message {anywhere} of {total}; error {min(waits):.1f}-{max(waits):.1f} s after the signal"
    )


def train(ctx: object) -> str:
    """A ``wrap_optimizer`` training of 20 steps (run by ``exit`` under torchrun)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="mean", model=model)  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(ctx.replica_id)  # type: ignore[attr-defined]
    for _ in range(20):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
    return f"replica {ctx.replica_id} w={model[0].weight.sum().item():.6f}"  # type: ignore[attr-defined]


def probe_exit(runs: int) -> None:
    """torchrun, 3 processes: the script makes the process group itself and ends without destroying it, as a
    user's script does; count runs that print "terminate called" or exit non-zero."""
    torchrun = Path(sys.executable).with_name("torchrun")
    aborts = failed = 0
    for _ in range(runs):
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", "3", __file__, "train"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        aborts += "terminate called" in done.stdout + done.stderr
        failed += done.returncode != 0
    print(f"{aborts} of {runs} runs printed 'terminate called'; {failed} of {runs} exited non-zero")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("launcher", "rank-kill", "rank-stop", "exit", "train"))
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if a.what == "launcher":
        probe_launcher(a.runs)
    elif a.what == "exit":
        probe_exit(a.runs)
    elif a.what == "train":
        import torch.distributed as dist

        from sparsync.replicator import Replicator

        dist.init_process_group("gloo")
        for line in Replicator().start(train):
            print(line, flush=True)
    else:
        probe_rank(a.runs, signal.SIGKILL if a.what == "rank-kill" else signal.SIGSTOP)
