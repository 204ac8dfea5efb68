"""Per-call overhead of a plan: `python -m benchmarks.overhead [--device cuda] [--only mlp] [--threads 1]`.

For each small workload, the untuned default plan (`planner.propose`, built with
`executor.build`, default strategies) against the torch.func recipe for the same
computation: `vmap(functional_call(member0, stacked_state, inputs))` of the whole
model (executor.baselines.whole_vmap). Small batches, so the executor's per-call
Python, not the arithmetic, is what differs. Both run under torch.no_grad() on the
same inputs; their outputs are checked equal first.

Timing: round-robin in one process (each round times `inner` calls of each way, the
order alternating between rounds); a round's ratio is plan / recipe of that round,
so a noisy neighbour disturbs both sides of a ratio alike. The table gives medians
and the interquartile range of the per-round ratios. Target (the GPU-first issue,
"cheap per call"): ratio <= 1.1 on every row. Writes benchmarks/results/overhead.md
(overhead-<device>.md for a non-CPU device).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from stagewise import executor, planner
from stagewise.executor import baselines
from stagewise.executor.profile import device_name
from benchmarks.run import keep_freed_memory
from benchmarks.workloads import WORKLOADS, Workload

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 1.1
# the small workloads; the CNN is a sample model without a row in the full suite
SMALL = [w for w in WORKLOADS if w.model.startswith("sample_models/") and "GRU" not in w.name]
SMALL.append(Workload("CNN conv16-conv32-fc10 32x32, N=20, b8", "sample_models/cnn.py", 20, "shared"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(fn, inner: int, device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) per call, over `inner` calls."""
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(inner):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / inner, (time.process_time() - cpu) / inner


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def _close(a, b) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.allclose(x, y, rtol=1e-4, atol=1e-5) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def measure(w: Workload, device: torch.device, rounds: int, sample_s: float, batch: int | None = None) -> dict:
    """Round-robin per-call times of the default plan and the recipe for one workload
    (at `batch` rows of the example inputs, default all of them)."""
    src = planner.load_model_file(w.path)
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, n_members=w.n, input_mode=w.input_mode)
    members = src.members(w.n)
    example = tuple(x[:batch] if isinstance(x, torch.Tensor) and x.dim() and batch else x for x in src.example_inputs)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in executor.batched_inputs(plan, example))
    module = executor.build(plan, members, device=device)
    recipe = baselines.whole_vmap(plan, [m.to(device) for m in members], inputs, device)
    ways = {"plan": lambda: module(*inputs), "recipe": recipe}
    with torch.no_grad():
        if not _close(ways["plan"](), ways["recipe"]()):
            raise AssertionError(f"{w.name}: the plan's outputs differ from the recipe's")
        inner = {}
        for name, fn in ways.items():
            for _ in range(3):
                fn()
            one = min(_sample(fn, 1, device)[0] for _ in range(5))
            inner[name] = max(1, int(sample_s / max(one, 1e-7)))
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for name in order:
                times[name].append(_sample(ways[name], inner[name], device))
    stages = ", ".join(f"{s.id}:{s.options.strategy.value}({len(s.nodes)})" for s in plan.stages)
    rows = example[0].shape[0] if example and isinstance(example[0], torch.Tensor) and example[0].dim() else "-"
    out = {"workload": w.name, "batch": rows, "stages": stages}
    for clock, k in (("wall", 0), ("cpu", 1)):
        plan_s, recipe_s = [t[k] for t in times["plan"]], [t[k] for t in times["recipe"]]
        out[clock] = {"plan": _quartiles(plan_s), "recipe": _quartiles(recipe_s),
                      "ratio": _quartiles([p / max(v, 1e-12) for p, v in zip(plan_s, recipe_s)])}
    return out


def markdown(rows: list[dict], device: torch.device, threads: int, rounds: int, malloc_tuned: bool = False) -> list[str]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Per-call overhead: default plan vs the torch.func recipe",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · {device_name(device)} ({os.cpu_count()} cores) · "
        f"torch {torch.__version__} · Python {platform.python_version()} · {threads} thread(s) · {rounds} rounds · "
        f"load average at the end {load:.2f}" + (" · glibc keeps freed memory (as `make bench`)" if malloc_tuned else ""),
        "",
        "*plan*: `planner.propose` + `executor.build` (default strategies, untuned); *recipe*: "
        "`vmap(functional_call(member0, stacked, inputs))` of the whole model (executor.baselines.whole_vmap); "
        "both under `torch.no_grad()`, same inputs, outputs checked equal. Times are per call, median "
        "[interquartile range] of the rounds; *ratio* = plan / recipe per round, median [IQR]. *wall*: "
        "perf_counter; *CPU*: this process's CPU time (time.process_time), which other processes on a shared "
        "machine do not inflate; with one thread it is the steadier measure of per-call Python on the CPU "
        f"(on CUDA only wall time means anything). Target: ratio <= {TARGET}.",
        "",
        "| workload | batch | stages (strategy, nodes) | plan ms (wall) | recipe ms (wall) | ratio (wall) | "
        "plan ms (CPU) | recipe ms (CPU) | ratio (CPU) | |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cells = []
        for clock in ("wall", "cpu"):
            p, v, q = r[clock]["plan"], r[clock]["recipe"], r[clock]["ratio"]
            cells.append(f"{p[1] * 1e3:.3f} [{p[0] * 1e3:.3f}-{p[2] * 1e3:.3f}] | {v[1] * 1e3:.3f} [{v[0] * 1e3:.3f}-{v[2] * 1e3:.3f}] | "
                         f"{q[1]:.3f} [{q[0]:.3f}-{q[2]:.3f}]")
        ok = "ok" if r["cpu" if device.type == "cpu" else "wall"]["ratio"][1] <= TARGET else "over"
        lines.append(f"| {r['workload']} | {r['batch']} | {r['stages']} | {' | '.join(cells)} | {ok} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="", help="workloads whose name contains this text")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: per-call overhead, steady on a shared machine; 0: torch's own)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--sample-ms", type=float, default=20.0, help="time per sample of one way")
    ap.add_argument("--batches", default="native,1",
                    help="comma-separated batch sizes per workload: 'native' (the workload's own) or a number of example rows")
    ap.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc as it is (see benchmarks.run.keep_freed_memory)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    malloc_tuned = False if args.default_malloc else keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = executor.resolve_device(args.device)
    rows = []
    batches = [None if b.strip() == "native" else int(b) for b in args.batches.split(",")]
    for w in SMALL:
        for batch in batches if args.only.lower() in w.name.lower() else []:
            rows.append(measure(w, device, args.rounds, args.sample_ms / 1e3, batch))
            print(markdown(rows[-1:], device, torch.get_num_threads(), args.rounds)[-1], flush=True)
    text = "\n".join(markdown(rows, device, torch.get_num_threads(), args.rounds, malloc_tuned)) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / ("overhead.md" if device.type == "cpu" else f"overhead-{device.type}.md")).write_text(text)


if __name__ == "__main__":
    main()
