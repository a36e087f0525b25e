"""torchrec as a ``bench dlrm`` baseline: ``torchrec_tw`` (table-wise) and ``torchrec_rw`` (row-wise), the
embedding tables sharded by torchrec's ``DistributedModelParallel``, the MLPs by DDP (``torchrec_runner``).

torchrec pins its own torch and fbgemm-gpu, so it lives in its own environment (``scripts/torchrec_env.sh``
makes ``.venv-torchrec`` beside this checkout's ``src``; ``SPARSYNC_TORCHREC_PYTHON`` names another
interpreter). Each bench rank starts its torchrec rank as a subprocess of that interpreter, inheriting the
rank's network namespace (``--net``) and environment, on the rank's own samples; the rows come back as JSON.
Where the environment is missing or the run fails, every rank returns the same row with ``unavailable`` set
to the reason, and the bench prints it in place of the figures.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparsync_bench.criteo import CriteoBatch, table_rows
from sparsync_bench.dlrm import MLPS

TORCHREC_METHODS = {"torchrec_tw": "table_wise", "torchrec_rw": "row_wise"}
_SRC = Path(__file__).resolve().parents[1]  # the folder that holds sparsync_bench
ENV_SCRIPT = "scripts/torchrec_env.sh"


def torchrec_python() -> Path:
    """The interpreter of torchrec's environment: ``SPARSYNC_TORCHREC_PYTHON``, else the checkout's
    ``.venv-torchrec`` (it may not exist: ``unavailable`` says so)."""
    named = os.environ.get("SPARSYNC_TORCHREC_PYTHON")
    return Path(named) if named else _SRC.parent / ".venv-torchrec" / "bin" / "python"


def unavailable() -> str | None:
    """Why the torchrec rows cannot run here (None when its environment exists)."""
    python = torchrec_python()
    if not python.exists():
        return f"no torchrec environment ({python} is missing; make it with {ENV_SCRIPT})"
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def train_torchrec(
    method: str, cfg: Any, shard: CriteoBatch, rank: int, P: int, *, timeout: float = 600.0
) -> dict[str, Any]:
    """``method``'s row (the same on every rank): this rank's torchrec process on ``shard`` (a
    ``CriteoBatch``) with ``cfg``'s (a ``DlrmBenchConfig``) steps, widths and seed. Collective: every rank of
    the default group calls it."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    reason = unavailable()
    meta: list[Any] = [_free_port(host) if rank == 0 and reason is None else None]
    dist.broadcast_object_list(meta, src=0)
    row: dict[str, Any] = {"method": method}
    if reason is None:
        bottom, top = MLPS[cfg.mlp]
        with tempfile.TemporaryDirectory(prefix="sparsync-torchrec-") as tmp:
            torch.save({"dense": shard.dense, "sparse": shard.sparse, "label": shard.label}, f"{tmp}/shard.pt")
            spec = {"rank": rank, "world_size": P, "master_addr": host, "master_port": meta[0],
                    "threads": torch.get_num_threads(), "timeout": timeout / 2, "shard": f"{tmp}/shard.pt",
                    "steps": cfg.steps, "batch": cfg.batch, "warmup": cfg.warmup, "tail": cfg.tail, "lr": cfg.lr,
                    "seed": cfg.seed, "table_rows": table_rows(cfg.max_rows), "dim": cfg.dim,
                    "bottom": [*bottom, cfg.dim], "top": list(top),
                    "sharding": TORCHREC_METHODS[method], "method": method}  # fmt: skip
            Path(f"{tmp}/spec.json").write_text(json.dumps(spec))
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            env["PYTHONPATH"] = os.pathsep.join([str(_SRC), *filter(None, [env.get("PYTHONPATH")])])
            cmd = [str(torchrec_python()), "-m", "sparsync_bench.torchrec_runner", f"{tmp}/spec.json"]
            try:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                reason = f"rank {rank}: torchrec run still going after {timeout:.0f} s"
            else:
                found = [ln for ln in res.stdout.splitlines() if ln.startswith("TORCHREC_ROW ")]
                refused = [ln for ln in res.stdout.splitlines() if ln.startswith("TORCHREC_UNAVAILABLE ")]
                if refused:
                    reason = refused[-1][len("TORCHREC_UNAVAILABLE ") :]
                elif res.returncode != 0:
                    reason = f"rank {rank}: {_last_error(res.stderr + res.stdout)} (exit {res.returncode})"
                    print(res.stderr[-3000:], file=sys.stderr)
                elif rank == 0 and not found:
                    reason = "rank 0 printed no row"
                elif found:
                    row.update(json.loads(found[-1][len("TORCHREC_ROW ") :]))
    # every rank returns rank 0's row, or the first failure any rank saw
    everyone: list[Any] = [None] * P
    dist.all_gather_object(everyone, (reason, row))
    failed = [r for r, _ in everyone if r is not None]
    if failed:
        return {"method": method, "unavailable": failed[0], "step_s": None, "bytes_per_step": None, "loss": None}
    out: dict[str, Any] = everyone[0][1]
    return out
