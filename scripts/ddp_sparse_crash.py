"""scripts/ddp_sparse_crash_torch.py's training (torch's DDP with sparse gradients: 26 `EmbeddingBag(sparse=True)`
tables, Zipf ids, gloo) in rounds of ranks started by `sparsync.launch`; counts the rounds a rank died of a signal
and prints the first lines of each error (faulthandler's stacks included). It runs nothing of sparsync's but the
launcher: a crash here is in torch.

    .venv/bin/python scripts/ddp_sparse_crash.py --procs 3 --steps 100 --rounds 60 [--start-method spawn]
"""

from __future__ import annotations

import argparse

from ddp_sparse_crash_torch import train  # the same training, run here in ranks sparsync's launcher starts

from sparsync import LaunchError, launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"))
    a = ap.parse_args()
    crashes = 0
    for r in range(a.rounds):
        try:
            launch(train, nprocs=a.procs, args=(a.steps, a.batch), timeout=120, start_method=a.start_method)
            print(f"round {r}: ok", flush=True)
        except LaunchError as e:
            crashes += 1
            print(f"round {r}: {str(e)[:3000]}", flush=True)
    print(f"{crashes} of {a.rounds} rounds ended by a crash ({a.procs} ranks x {a.steps} steps a round)")


if __name__ == "__main__":
    main()
