"""How long executor.autotune takes, and how fast the plans it picks run.

    python -m benchmarks.autotune_speed tune --out DIR [--strategies vmap,wide,loop] [--only resblock]
    python -m benchmarks.autotune_speed compare DIR_A DIR_B [--repeats 30]

`tune` autotunes every workload below once, prints its wall time (and the phases: tuning the
stages, the merged whole-plan comparison) and writes the tuned plans to DIR. Run it once per
version of the code (PYTHONPATH pointing at an older checkout's `stagewise`) to compare wall
times. `compare` builds the plans of two such folders and times them round-robin in one process
(min and median of interleaved samples): the ratio B/A says whether the faster autotune picked
plans as fast as before.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from stagewise import executor, planner
from stagewise.executor.timing import interleaved

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = [  # (name, model file, N, input mode)
    ("cnn N=8", "sample_models/cnn.py", 8, "shared"),
    ("resblock N=8", "sample_models/resblock.py", 8, "shared"),
    ("mlp N=8", "sample_models/mlp.py", 8, "shared"),
    ("transformer_block N=8", "sample_models/transformer_block.py", 8, "shared"),
    ("moe N=8", "sample_models/moe.py", 8, "shared"),
    ("gru N=8", "sample_models/gru.py", 8, "shared"),
    ("resblock N=20 (heaviest conv)", "sample_models/resblock.py", 20, "shared"),
]


def _slug(name: str) -> str:
    return name.split(" (")[0].replace(" ", "_").replace("=", "")


def _setup(model: str, n: int, mode: str):
    src = planner.load_model_file(str(ROOT / model))
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, n, mode)
    members = src.members(n)
    inputs = tuple(src.example_inputs) if mode == "shared" else tuple(torch.stack([x] * n) for x in src.example_inputs)
    return plan, members, inputs


def tune(out: Path, strategies: list[str] | None, only: str, kwargs: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, model, n, mode in WORKLOADS:
        if only and only not in name:
            continue
        plan, members, inputs = _setup(model, n, mode)
        start = time.perf_counter()
        tuned = executor.autotune(plan, members, inputs, strategies=strategies, **kwargs)
        wall = time.perf_counter() - start
        (out / f"{_slug(name)}.json").write_text(tuned.dumps())
        chosen = ", ".join(f"{s.id}={s.options.strategy.value}" for s in tuned.stages)
        rows[name] = wall
        print(f"{name:32s} {wall:7.2f} s   {chosen}", flush=True)
    (out / "walltimes.json").write_text(json.dumps(rows, indent=2))
    print(f"{'total':32s} {sum(rows.values()):7.2f} s")


def compare(a: Path, b: Path, repeats: int, only: str) -> None:
    for name, model, n, mode in WORKLOADS:
        if only and only not in name:
            continue
        fa, fb = a / f"{_slug(name)}.json", b / f"{_slug(name)}.json"
        if not (fa.exists() and fb.exists()):
            continue
        plan, members, inputs = _setup(model, n, mode)
        mods = {k: executor.build(planner.Plan.loads(f.read_text()), members) for k, f in (("A", fa), ("B", fb))}
        with torch.no_grad():
            calls = {k: (lambda m=m: m(*inputs)) for k, m in mods.items()}
            runs = [interleaved(calls, torch.device("cpu"), repeats) for _ in range(3)]
        mins = {k: min(r[k].min_ms for r in runs) for k in calls}
        meds = {k: statistics.median(r[k].median_ms for r in runs) for k in calls}
        print(f"{name:32s} A {mins['A']:8.3f}/{meds['A']:8.3f} ms  B {mins['B']:8.3f}/{meds['B']:8.3f} ms  "
              f"B/A min {mins['B'] / mins['A']:.2f} median {meds['B'] / meds['A']:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--strategies", default="")
    t.add_argument("--only", default="")
    t.add_argument("--budget", default="", help="autotune(budget=...) where this version has it")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--repeats", type=int, default=30)
    c.add_argument("--only", default="")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.cmd == "tune":
        kwargs = {"budget": args.budget} if args.budget else {}
        tune(args.out, args.strategies.split(",") if args.strategies else None, args.only, kwargs)
    else:
        compare(args.a, args.b, args.repeats, args.only)


if __name__ == "__main__":
    main()
