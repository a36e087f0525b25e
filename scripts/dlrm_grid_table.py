"""The sharded-embeddings issue's grid in one table: per point (P, samples per rank, link) each method's ms per
step, the tables `sparsync_auto` sharded, auto's step against the best of the others and against torchrec's,
the tables' bytes against torchrec's, auto's predicted step over its measured one, the lookahead's step against
the sharded one's, the floor's step rate over torchrec's (``floor_tables_unsent``: the tables never sent, the most
any placement could reach), and the CPU seconds per step of auto, torchrec and the floor, from
`sparsync bench dlrm` JSON files named ``<prefix>_p<P>_b<B>_<net>.json`` (the commands in docs/sharding.md).

    .venv/bin/python scripts/dlrm_grid_table.py docs/data/dlrm_grid7 --out docs/data/dlrm_grid7_table.md

With ``--floor``: per point, each method's step and CPU per step against the floor's (``over_floor``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHODS = ("torch_ddp_sparse", "sparsync", "sparsync_sharded", "sparsync_sharded_lookahead", "sparsync_auto",
           "torchrec_tw", "floor_tables_unsent")  # fmt: skip
OURS = ("sparsync", "sparsync_sharded")  # auto's two single placements


def rows_for(prefix: str) -> list[str]:
    out = [
        "| P | samples | link | " + " | ".join(f"{m} ms" for m in METHODS)
        + " | auto sharded | auto vs best single | torchrec rate / auto rate | auto table MB / torchrec's"
        + " | auto's step predicted / measured | sharded step with lookahead / without"
        + " | floor rate / torchrec rate | CPU ms per step: auto, torchrec, floor |",
        "|" + "---|" * (len(METHODS) + 11),
    ]  # fmt: skip
    for P in (4, 8):
        for B in (128, 512):
            for net in ("loopback", "1gbit"):
                path = Path(f"{prefix}_p{P}_b{B}_{net}.json")
                if not path.exists():
                    continue
                rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
                ms = {m: rows[m]["step_s"] * 1e3 for m in METHODS if rows.get(m, {}).get("step_s")}
                auto = rows["sparsync_auto"]
                best = min(ms[m] for m in OURS)
                tr = rows["torchrec_tw"]
                cells = [f"{ms[m]:.1f}" if m in ms else "-" for m in METHODS]
                out.append(
                    f"| {P} | {B} | {net} | " + " | ".join(cells)
                    + f" | {auto['tables_sharded']} of 26 | {ms['sparsync_auto'] / best:.2f}x"
                    f" | {ms['sparsync_auto'] / ms['torchrec_tw']:.2f}"
                    f" | {auto['table_bytes_per_step'] / tr['table_bytes_per_step']:.2f}"
                    f" | {_predicted(auto)} | {_ratio(ms, 'sparsync_sharded_lookahead', 'sparsync_sharded')}"
                    f" | {_ratio(ms, 'torchrec_tw', 'floor_tables_unsent')}"
                    f" | {_cpu(auto)}, {_cpu(tr)}, {_cpu(rows.get('floor_tables_unsent', {}))} |"
                )  # fmt: skip
    return out


def _ratio(ms: dict[str, float], a: str, b: str) -> str:
    return f"{ms[a] / ms[b]:.2f}" if a in ms and b in ms else "-"


def _cpu(row: dict[str, float]) -> str:
    """The ranks' mean CPU seconds per step (files older than the column have none)."""
    return f"{row['cpu_s'] * 1e3:.1f}" if row.get("cpu_s") else "-"


def _predicted(row: dict[str, float]) -> str:
    """``AutoPlan.step_seconds`` over the measured step (files older than the prediction have none)."""
    predicted = row.get("predicted_step_s")
    return f"{predicted / row['step_s']:.2f}" if predicted else "-"


ORDER = (
    "torch_ddp_sparse", "sparsync", "sparsync_sharded", "sparsync_sharded_fused",
    "sparsync_sharded_fused_lookahead", "sparsync_sharded_lookahead", "sparsync_auto", "sparsync_auto_fused",
    "sparsync_replicated_fused", "sparsync_sharded_fused_ddp", "sparsync_sharded_fused_lookahead_ddp",
    "sparsync_auto_fused_ddp", "torchrec_tw", "floor_tables_unsent",
)  # fmt: skip
FLOOR = "floor_tables_unsent"


def over_floor(prefix: str) -> list[str]:
    """Per point, each method's ms per step and its step over the floor's (``x``), and its CPU ms per step over
    the floor's (``+``): the methods each file holds, in ``ORDER``."""
    points = []
    for P in (4, 8):
        for B in (128, 512):
            for net in ("loopback", "1gbit"):
                path = Path(f"{prefix}_p{P}_b{B}_{net}.json")
                if path.exists():
                    points.append((P, B, net, {r["method"]: r for r in json.loads(path.read_text())["rows"]}))
    methods = [m for m in ORDER if any(m in rows for *_, rows in points)]
    out = [
        "| P | samples | link | " + " | ".join(f"{m}: ms (x floor), CPU ms over floor" for m in methods) + " |",
        "|" + "---|" * (len(methods) + 3),
    ]
    for P, B, net, rows in points:
        floor = rows.get(FLOOR, {})
        cells = []
        for m in methods:
            r = rows.get(m, {})
            if not r.get("step_s") or not floor.get("step_s"):
                cells.append("-")
                continue
            cpu = f"{(r['cpu_s'] - floor['cpu_s']) * 1e3:+.1f}" if r.get("cpu_s") and floor.get("cpu_s") else "-"
            cells.append(f"{r['step_s'] * 1e3:.1f} ({r['step_s'] / floor['step_s']:.2f}x), {cpu}")
        out.append(f"| {P} | {B} | {net} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="path prefix of the JSON files, e.g. docs/data/dlrm_grid7")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--floor", action="store_true", help="the table of each method's step over the floor's")
    a = ap.parse_args()
    text = "\n".join(over_floor(a.prefix) if a.floor else rows_for(a.prefix)) + "\n"
    print(text, end="")
    if a.out is not None:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
