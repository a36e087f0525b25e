"""What ``sparsync demo`` says beyond its table: each run's step time and bytes against the baselines, each
priced run's predicted step against its measured one, the step-time ratios per interleaved block with their
spread, why each plan won or lost, and why the automatic plan chose its placements.

The runs take turns in blocks of steps (``train_demo``), so host drift reaches every plan alike within a block;
a block's time is the median of its steps' slowest replica, and a ratio between two plans is taken block by
block. "won" means the whole spread (min-max over the blocks) lies below 1, "lost" above 1, else a tie. The
reason is the part of the step whose difference is largest in the verdict's direction: bandwidth (the measured
bytes per step at the link's bandwidth), latency (the plan priced with infinite bandwidth,
``demo_plan.predicted_split``), local compute (measured), or the rest of the measured step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparsync.plan.planner import Plan
from sparsync.plan.registry import KINDS
from sparsync_bench.demo_plan import DDP_PLAN, PLACEMENT_WORDS, RUNS, predicted_split, predicted_steps
from sparsync_bench.fmt import short_ms

# Short names of the runs (``demo_plan.RUNS``) in the lines on ratios and verdicts.
NAMES = {"dense": "dense allreduce", "ddp_sparse": "DDP", "sparse": "sparsync plan", "auto": "auto plan"}
# (run, baseline) pairs whose step-time ratio is taken per block: each plan against DDP with sparse gradients,
# the sparsync plan against dense allreduce, and the automatic plan against the sparsync plan (it should beat it).
PAIRS = (("dense", "ddp_sparse"), ("sparse", "ddp_sparse"), ("auto", "ddp_sparse"), ("sparse", "dense"),
         ("auto", "sparse"))  # fmt: skip


@dataclass(frozen=True)
class Spread:
    """A ratio measured once per block: its median over the blocks and its spread (min and max)."""

    median: float
    low: float
    high: float
    blocks: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one block's value, got none")
        return cls(statistics.median(values), min(values), max(values), len(values))

    @property
    def verdict(self) -> str:
        """The verdict: "won" (every block below 1), "lost" (every block above 1), or "tie" (1 within the
        spread)."""
        return "won" if self.high < 1 else "lost" if self.low > 1 else "tie"


def block_sizes(steps: int, warmup: int, block: int) -> list[int]:
    """The timed blocks' lengths in steps: ``steps - warmup`` cut into blocks of ``block``; a remainder shorter
    than ``block`` joins the last block, so every block's median has at least ``block`` steps (or all of them)
    (150 steps, 5 warm-up, block 10: 13 blocks of 10 and one of 15)."""
    timed = steps - warmup
    if timed < 1 or block < 1:
        raise ValueError(f"need steps > warmup and block >= 1, got steps={steps}, warmup={warmup}, block={block}")
    sizes = [block] * max(1, timed // block)
    sizes[-1] += timed - sum(sizes)
    return sizes


def block_medians(steps_ms: Sequence[float], warmup: int, sizes: Sequence[int]) -> list[float]:
    """Per timed block (``sizes``, from step ``warmup`` on) the median of ``steps_ms`` over its steps."""
    out, start = [], warmup
    for n in sizes:
        out.append(statistics.median(steps_ms[start : start + n]))
        start += n
    return out


def block_ratios(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[float]]:
    """Per ``PAIRS`` pair of separately measured runs (a run with ``same_as`` is another's numbers), the
    run's block times over the baseline's, block by block."""
    by = {r["run"]: r for r in runs if "same_as" not in r and "block_ms" in r}
    return {(a, b): [x / y for x, y in zip(by[a]["block_ms"], by[b]["block_ms"], strict=True)]
            for a, b in PAIRS if a in by and b in by}  # fmt: skip


def ratio_lines(runs: list[dict[str, Any]], sizes: Sequence[int]) -> list[str]:
    """Each plan's step time against DDP's, and the automatic plan's against the sparsync plan's: the median of
    the per-block ratios and their min-max, e.g. 'sparsync plan: 0.95x DDP (min-max 0.88-1.03 over 14
    interleaved blocks of 10 steps)'; ``sizes``: the timed blocks' lengths (``block_sizes``). An automatic
    plan that trained no run of its own says whose run it is."""
    steps = f"{min(sizes)} steps" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)} steps"
    out = ["step-time ratios block by block (a block's time: the median of its steps' slowest replica; DDP: "
           f"{DDP_PLAN}):"]  # fmt: skip
    for (a, b), v in block_ratios(runs).items():
        if (a, b) == ("sparse", "dense"):
            continue  # in its verdict line
        s = Spread.of(v)
        out.append(f"{NAMES[a]}: {s.median:.2f}x {NAMES[b]} (min-max {s.low:.2f}-{s.high:.2f} over {s.blocks} "
                   f"interleaved blocks of {steps})")  # fmt: skip
    same = next((r["same_as"] for r in runs if r["run"] == RUNS[3] and "same_as" in r), None)
    if same is not None:
        out.append(f"{NAMES['auto']}: trains the {NAMES[same]}'s placements (the same run, not measured again)")
    return out


@dataclass(frozen=True)
class StepParts:
    """One run's step in parts, milliseconds: measured step, compute and bytes; bandwidth = the bytes at the
    link's bandwidth; latency = the plan's communication priced with infinite bandwidth (None: not priced)."""

    step_ms: float  # measured: median over the timed steps of the slowest replica's step
    compute_ms: float  # measured: one forward and backward pass, no communication
    bytes_per_step: float  # measured: sent per rank
    bandwidth_ms: float  # bytes_per_step at the link's bandwidth
    latency_ms: float | None = None  # predicted (``demo_plan.predicted_split``); None: torch's path, not priced

    @property
    def rest_ms(self) -> float:
        """The measured remainder: step - compute - bandwidth."""
        return self.step_ms - self.compute_ms - self.bandwidth_ms

    @property
    def unpriced_ms(self) -> float:
        """The remainder the model leaves: step - compute - bandwidth - priced latency."""
        return self.rest_ms - (self.latency_ms or 0.0)


def step_parts(runs: list[dict[str, Any]], plan: Plan) -> dict[str, StepParts]:
    """Every run's ``StepParts`` by run id (its ``compute_ms``: ``demo_plan.run_compute``), at ``plan``'s link
    (its measured or assumed bandwidth)."""
    split, beta = predicted_split(plan), plan.cluster.link.beta
    latency = {k: 1e3 * v[0] for k, v in split.items()}
    return {r["run"]: StepParts(r["step_ms"], r["compute_ms"], r["bytes_per_step"],
                                1e3 * beta * r["bytes_per_step"], latency.get(r["run"]))
            for r in runs}  # fmt: skip


def why_line(name: str, a: StepParts, base: str, b: StepParts, ratio: Spread, link: str) -> str:
    """'<name> vs <base>: <verdict> (<median>x, <min>-<max>): <reason>': the part of the step whose difference
    from ``b`` is largest in the verdict's direction (the most saved for a win, the most lost for a loss, the
    largest either way for a tie). ``link``: the bandwidth's words, e.g. 'the measured 598 MB/s'."""
    diffs = _differences(name, a, base, b, link)
    verdict = ratio.verdict
    if verdict == "won":
        reason = min(diffs)[1]
    elif verdict == "lost":
        reason = max(diffs)[1]
    else:
        reason = ("the steps differ by less than they vary block to block; largest difference in their parts: "
                  + max(diffs, key=lambda d: abs(d[0]))[1])  # fmt: skip
    return f"{name} vs {base}: {verdict} ({ratio.median:.2f}x, {ratio.low:.2f}-{ratio.high:.2f}): {reason}"


def _differences(name: str, a: StepParts, base: str, b: StepParts, link: str) -> list[tuple[float, str]]:
    """(a's part - b's part in ms, the two in words) for each part of the step: compute, bandwidth, and the
    priced latency and the unpriced rest when both are priced, else the measured rest."""
    mb_a, mb_b = a.bytes_per_step / 1e6, b.bytes_per_step / 1e6

    def vs(x: float, y: float) -> str:
        return f"{short_ms(x)} ms instead of {short_ms(y)} ms"

    out = [
        (a.compute_ms - b.compute_ms, f"local compute {vs(a.compute_ms, b.compute_ms)}"),
        (a.bandwidth_ms - b.bandwidth_ms,
         f"{mb_a:.3g} MB/step instead of {mb_b:.3g} MB, {vs(a.bandwidth_ms, b.bandwidth_ms)} at {link}"),
    ]  # fmt: skip
    if a.latency_ms is not None and b.latency_ms is not None:
        out.append((a.latency_ms - b.latency_ms,
                    f"latency {vs(a.latency_ms, b.latency_ms)} (priced with infinite bandwidth)"))  # fmt: skip
        rest = f"the unpriced rest {vs(a.unpriced_ms, b.unpriced_ms)}"
        out.append(
            (a.unpriced_ms - b.unpriced_ms, f"{rest} (measured step - compute - bandwidth - priced latency)")
        )
        return out
    priced = [f"{n} priced at {short_ms(p.latency_ms)} ms with infinite bandwidth"
              for n, p in ((name, a), (base, b)) if p.latency_ms is not None]  # fmt: skip
    note = "".join(f"; {x}" for x in priced)
    out.append((a.rest_ms - b.rest_ms,
                f"the rest {vs(a.rest_ms, b.rest_ms)} (measured: step - compute - bandwidth{note})"))  # fmt: skip
    return out


def link_words(plan: Plan) -> str:
    """The bandwidth the why lines price bytes at: 'the measured 598 MB/s', or with ``plan_pricing="assumed"``
    'the assumed 125 MB/s' (the nominal link's, not the one the runs used)."""
    beta = plan.cluster.link.beta
    if beta == 0:
        return "an unlimited bandwidth (one process)"
    return f"the {'measured' if plan.cluster.measured else 'assumed'} {1 / beta / 1e6:.0f} MB/s"


def why_lines(runs: list[dict[str, Any]], plan: Plan) -> list[str]:
    """A verdict and its reason (``why_line``) for every ``PAIRS`` pair the demo measured separately."""
    parts, link = step_parts(runs, plan), link_words(plan)
    return [why_line(NAMES[a], parts[a], NAMES[b], parts[b], Spread.of(v), link)
            for (a, b), v in block_ratios(runs).items()]  # fmt: skip


def choice_lines(plan: Plan) -> list[str]:
    """Why the plan placed each parameter that had a choice where it did: its priced seconds and bytes under the
    chosen placement against the best alternative (lossy kinds only beside a lossy choice, as ``make_plan``)."""
    lossy = {k.name for k in KINDS if k.lossy}
    out = []
    for e in plan.entries:
        alts = {k: v for k, v in e.candidates.items()
                if k != e.placement and (k not in lossy or e.placement in lossy)}  # fmt: skip
        if not alts:
            continue
        best = min(alts, key=lambda k: (alts[k][1], alts[k][0]))
        out.append(
            f"auto chose {PLACEMENT_WORDS[e.placement]} for {e.name}{' (an override)' if e.overridden else ''}: "
            f"{short_ms(1e3 * e.seconds)} ms and {e.bytes_per_machine / 1e6:.3g} MB per step priced, against "
            f"{short_ms(1e3 * alts[best][1])} ms and {alts[best][0] / 1e6:.3g} MB by {PLACEMENT_WORDS[best]}, "
            "the best alternative"
        )
    return out


def interleaving(runs: list[dict[str, Any]], block: int, sizes: Sequence[int]) -> dict[str, Any]:
    """The JSON record of the interleaving: the block length, the timed blocks' lengths, the run of each turn
    in order (the warm-up turns first), and every ``PAIRS`` ratio per block with its median, min and max."""
    order = [run for _, run in sorted((t, r["run"]) for r in runs for t in r.get("turns", []))]
    ratios = {}
    for (a, b), v in block_ratios(runs).items():
        s = Spread.of(v)
        ratios[f"{a}/{b}"] = {"per_block": v, "median": s.median, "min": s.low, "max": s.high}
    return {"block": block, "sizes": list(sizes), "order": order, "ratios": ratios}


def compare_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Each run's step time and bytes relative to both baselines, dense allreduce and DDP with sparse gradients
    ("0.62x dense allreduce" = 0.62 times its step time)."""
    by = {r["run"]: r for r in runs}
    bases = [by[k] for k in RUNS[:2] if k in by]

    def rel(r: dict[str, Any], key: str) -> str:
        return ", ".join(f"{r[key] / b[key]:.3g}x {b['plan']}" for b in bases if b is not r)

    return [f"{r['plan']}: step time {rel(r, 'step_ms')}; bytes per step {rel(r, 'bytes_per_step')}"
            for r in runs if r is not bases[0]]  # fmt: skip


def headline(runs: list[dict[str, Any]], where: str) -> str:
    """The demo's answer in one line: which run had the shortest step, and how each sparsync run's step compares
    with DDP's (with sparse gradients: what a PyTorch user would run), on ``where`` (the links' words)."""
    by = {r["run"]: r for r in runs}
    fastest = min(runs, key=lambda r: r["step_ms"])
    words = [f"fastest on {where}: {fastest['plan']} ({fastest['step_ms']:.1f} ms a step)"]
    ddp = by.get(RUNS[1])
    if ddp is not None:
        for r in runs:
            if r["run"] in RUNS[2:] and "same_as" not in r:
                q = ddp["step_ms"] / r["step_ms"]
                how = f"{q:.2f}x faster than" if q >= 1 else f"{1 / q:.2f}x slower than"
                words.append(f"{r['plan']} is {how} {ddp['plan']}")
    return "; ".join(words)


def prediction_lines(runs: list[dict[str, Any]], plan: Plan) -> list[str]:
    """Each priced run's predicted step (``demo_plan.predicted_steps``, from each run's ``compute_ms``) against
    its measured one, and how far the predictions are from the measurements. Sets ``predicted_ms`` in each
    priced run."""
    by = {r["run"]: r for r in runs}
    pred = predicted_steps(plan, {k: r["compute_ms"] / 1e3 for k, r in by.items()})
    fb, dense = by["sparse"]["compute_ms"], by["dense"]["compute_ms"]
    parts, ratios = [], []
    for r in runs:
        if r["run"] not in pred:
            parts.append(f"{r['plan']}: torch's path, not priced")
            continue
        r["predicted_ms"] = 1e3 * pred[r["run"]]
        ratios.append(r["predicted_ms"] / r["step_ms"])
        parts.append(f"{r['plan']} {r['predicted_ms']:.1f} ms predicted / {r['step_ms']:.1f} measured "
                     f"({ratios[-1]:.2f}x)")  # fmt: skip
    return [
        f"predicted step = local compute (measured, no communication: forward and backward {fb:.1f} ms; the dense "
        f"run {dense - fb:.1f} ms more to densify the embedding's gradient, fill the bucket and update every row) "
        f"+ the plan's communication as each run sends it: {'; '.join(parts)}",
        f"the cost model's predicted steps are {min(ratios):.2f}x-{max(ratios):.2f}x the measured ones",
    ]
