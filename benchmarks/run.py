"""Run the benchmark suite and write one table: `python -m benchmarks.run [--device cuda] [--only mlp]`.

For every workload (benchmarks.workloads) one `executor.profile(..., autotune=True,
compile_baseline=True, floor=True)` times, in the same run and on the same inputs:
the member loop, whole-model vmap, whole-model vmap + torch.compile, the autotuned
stagewise plan, and the floor (one member on N x the batch). Ratios come from that
one run. Results go to benchmarks/results/<device>.json and .md with the machine
and library versions; the Markdown table is also printed.

Training rows (TRAINING): one `executor.profile(..., train=True, autotune=True)` per workload
chooses each stage's strategy by its forward + backward time and times a training step (forward +
backward + Adam step, loss = mean square of the outputs) of that plan with one executor.StackedAdam, of the member loop with N torch.optim.Adam, and of the torch.func recipe
(vmap(grad) over stacked parameters + one foreach Adam), each checked by its gradients against the
loop's; the table gives samples/s (N members x the batch per step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

from stagewise import executor
from stagewise import planner
from benchmarks.workloads import WORKLOADS, Workload
from stagewise.executor.profile import device_name

RESULTS = Path(__file__).resolve().parent / "results"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS.

    By default every temporary above ~128 KB-32 MB is mmap'ed and unmapped again,
    so each call page-faults its large tensors in afresh; on this VM that made a
    10 MB elementwise op 10x slower than the op itself (it hits batched strategies,
    whose tensors are N times larger, far more than the member loop). Same effect
    as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ in the environment; applies
    to every strategy and baseline alike. Returns False where glibc is absent.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False
WHOLE = ("loop", "vmap", "vmap+compile")
TRAINING = ("MLP 64-128-64, N=100, b32, shared x", "conv resblock 64ch 16x16, N=20, b8", "transformer block d64 h4 s16, N=16, b8")
TRAIN_WAYS = ("loop", "torch.func")  # the two ways users train N models, against which the plan is compared


def cold_compile_caches() -> str:
    """Give torch.compile an empty cache folder and turn off its FX-graph and AOT-autograd caches,
    which would make repeated runs' compile times look free. Returns the folder (removed at exit)."""
    import atexit
    import shutil
    import tempfile

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    folder = tempfile.mkdtemp(prefix="stagewise-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder  # compiled kernels (.so) are cached here by source hash
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    functorch_config.enable_autograd_cache = False
    return folder


def run_workload(w: Workload, device: str, repeats: int | None) -> executor.ProfileReport:
    src = planner.load_model_file(w.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(src.model, src.example_inputs)
        plan = planner.propose(graph, w.n, w.input_mode, model=w.model)
        members = src.members(w.n)
        inputs = executor.batched_inputs(plan, src.example_inputs)

        def progress(done: int, total: int, label: str) -> None:
            print(f"\r  [{done:>2}/{total}] {label:<48}", end="", file=sys.stderr, flush=True)

        report = executor.profile(plan, members, inputs, device=device, repeats=repeats, autotune=True,
                                  compile_baseline=True, floor=True, progress=progress)
    print(file=sys.stderr)
    return report


def run_training(w: Workload, device: str, repeats: int | None) -> tuple[executor.ProfileReport, executor.ProfileReport | None, int]:
    """Training profiles: (the training-autotuned plan with the baselines, the proposed plan alone or None, samples per step).

    The auto plan is what `executor.profile(..., train=True, autotune=True)` chooses from the proposed plan (each
    stage's strategy by forward + backward time, gradients checked against the loop); when it differs from the
    proposed plan, the proposed plan's step is timed again, without baselines."""
    src = planner.load_model_file(w.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(src.model, src.example_inputs)
        proposed = planner.propose(graph, w.n, w.input_mode, model=w.model)
        members = src.members(w.n)
        inputs = executor.batched_inputs(proposed, src.example_inputs)

        def progress(done: int, total: int, label: str) -> None:
            print(f"\r  [{done:>2}/{total}] {label:<48}", end="", file=sys.stderr, flush=True)

        report = executor.profile(proposed, members, inputs, device=device, repeats=repeats, train=True, optimizer="adam",
                                  autotune=True, progress=progress)
        plain = None
        if planner.Plan.from_json(report.plan, source="the autotuned plan").stages != proposed.stages:
            plain = executor.profile(proposed, members, inputs, device=device, repeats=repeats, train=True, optimizer="adam",
                                     baselines=False, progress=progress)
    print(file=sys.stderr)
    batch = next(x.shape[0] for x in src.example_inputs if isinstance(x, torch.Tensor) and x.dim())
    return report, plain, w.n * batch


def training_row_of(w: Workload, r: executor.ProfileReport, samples: int, stat: str = "median",
                    proposed: executor.ProfileReport | None = None) -> dict:
    """One training row: ms per step and samples/s of loop, torch.func and stagewise (the auto plan, timed in the same
    run as those two); ratio vs the faster of the two. `proposed`: the proposed plan's own profile, when it differs."""
    times = {b.strategy: _ms(b, stat) for b in r.baselines}
    stagewise = _ms(r.end_to_end, stat)
    ways = {k: times[k] for k in TRAIN_WAYS if times.get(k) is not None}
    best_name = min(ways, key=ways.get) if ways else None
    per_s = lambda ms: samples / (ms / 1e3) if ms else None  # noqa: E731
    return {
        "workload": w.name, "n": w.n, "samples_per_step": samples, "optimizer": r.optimizer,
        "loop_ms": times.get("loop"), "torch_func_ms": times.get("torch.func"), "stagewise_ms": stagewise,
        "loop_samples_per_s": per_s(times.get("loop")), "torch_func_samples_per_s": per_s(times.get("torch.func")),
        "stagewise_samples_per_s": per_s(stagewise), "best_other": best_name,
        "auto_is": "the training-autotuned plan" if r.autotuned else "the proposed plan",
        "proposed_ms": _ms(proposed.end_to_end, stat) if proposed is not None else stagewise,
        "proposed_strategies": " ".join(f"{s.id}:{s.strategy}" for s in proposed.stages) if proposed is not None else None,
        "ratio_vs_best": (ways[best_name] / stagewise) if best_name and stagewise else None,  # >1: stagewise is faster
        "strategies": " ".join(f"{s.id}:{s.strategy}" for s in r.stages),
        "errors": {b.strategy: b.error for b in r.baselines + [r.end_to_end] if not b.ok},
        "median_ms": {b.strategy: _ms(b, "median") for b in r.baselines + [r.end_to_end]},
        "min_ms": {b.strategy: _ms(b, "min") for b in r.baselines + [r.end_to_end]},
    }


def training_markdown(rows: list[dict], stat: str) -> list[str]:
    if not rows:
        return []
    lines = ["", "## Training step", "",
             f"Forward + backward + Adam step of all N members (loss = mean square of the outputs, summed over members), "
             f"the {stat} of the round-robin samples; samples/s = N x the batch / step time. *loop*: N models with N "
             "torch.optim.Adam; *torch.func*: vmap(grad) over stacked parameters + one foreach torch.optim.Adam; "
             "*stagewise auto*: the strategies autotune(train=True) chose by forward + backward time, with one "
             "executor.StackedAdam, timed in the same run as loop and torch.func; "
             "*proposed*: the proposed plan (vmap stages, loops where vmap has no rule), timed in a run of its own. "
             "Every way's gradients are checked against the loop's. "
             "*ratio* = the faster of loop / torch.func divided by stagewise auto (>1: stagewise faster).", "",
             "| workload | loop ms (samples/s) | torch.func ms (samples/s) | stagewise auto ms (samples/s) | ratio vs best | stages | proposed plan ms |",
             "|---|---:|---:|---:|---:|---|---:|"]
    cell = lambda ms, per_s: f"{_f(ms)} ({_f(per_s, ',.0f', '-')})" if ms else "fail"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['workload']} | {cell(r['loop_ms'], r['loop_samples_per_s'])} | "
                     f"{cell(r['torch_func_ms'], r['torch_func_samples_per_s'])} | "
                     f"**{cell(r['stagewise_ms'], r['stagewise_samples_per_s'])}** | {_f(r['ratio_vs_best'])}x ({r['best_other']}) | "
                     f"{r['strategies']} | {_f(r['proposed_ms'])}" + (f" ({r['proposed_strategies']})" if r["proposed_strategies"] else "")
                     + " |")
    return lines


def training_verdicts(rows: list[dict]) -> list[str]:
    ratios = [r["ratio_vs_best"] for r in rows if r["ratio_vs_best"]]
    if not rows:
        return []
    bad = [r for r in rows if not r["ratio_vs_best"] or r["ratio_vs_best"] < 0.95]
    out = [("MET" if not bad else "NOT MET") + ": training step >= 0.95x the faster of loop / torch.func on every training row"
           + (f" (below: {', '.join(r['workload'] + ' ' + _f(r['ratio_vs_best']) + 'x' for r in bad)})" if bad else "")]
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        out.append(f"{'MET' if geo >= 1.3 else 'NOT MET'}: training geometric mean speedup over the faster of loop / torch.func "
                   f"{geo:.2f}x (target >= 1.3x)")
    return out


def _ms(res, stat: str):
    if not res.ok or res.time is None:
        return None
    return res.time.min_ms if stat == "min" else res.time.median_ms


def row_of(w: Workload, r: executor.ProfileReport, stat: str = "min") -> dict:
    """One table row: times in ms (`stat` of the samples), the best whole-model strategy and the ratios."""
    times = {b.strategy: _ms(b, stat) for b in r.baselines}
    stagewise = _ms(r.end_to_end, stat)
    whole = {k: times.get(k) for k in WHOLE if times.get(k) is not None}
    best_name = min(whole, key=whole.get) if whole else None
    best = whole.get(best_name) if best_name else None
    compile_b = r.baseline("vmap+compile")
    return {
        "workload": w.name, "n": w.n, "input_mode": w.input_mode, "linear_heavy": w.linear_heavy,
        "loop_ms": times.get("loop"), "vmap_ms": times.get("vmap"), "vmap_compile_ms": times.get("vmap+compile"),
        "vmap_compile_s": compile_b.compile_s if compile_b and compile_b.ok else None,
        "stagewise_ms": stagewise, "floor_ms": times.get("floor"),
        "best_whole": best_name, "best_whole_ms": best,
        "ratio_vs_best": (best / stagewise) if best and stagewise else None,  # >1: stagewise is faster
        "vs_floor": (stagewise / times["floor"]) if stagewise and times.get("floor") else None,  # <=1.5 is the target
        "strategies": " ".join(f"{s.id}:{s.strategy}" for s in r.stages),
        "errors": {b.strategy: b.error for b in r.baselines if not b.ok},
        "median_ms": {b.strategy: _ms(b, "median") for b in r.baselines + [r.end_to_end]},
        "min_ms": {b.strategy: _ms(b, "min") for b in r.baselines + [r.end_to_end]},
    }


def _f(x, spec=".2f", dash="fail") -> str:
    return dash if x is None else format(x, spec)


def markdown(rows: list[dict], meta: dict, verdicts: list[str], train_rows: list[dict] | None = None) -> str:
    lines = [f"# stagewise benchmark: {meta['device_name']} ({meta['device']})", "",
             f"{meta['date']} · torch {meta['torch']} · Python {meta['python']} · torch intra-op threads: {meta['threads']} · "
             f"{meta['cpus']} CPUs · {meta['platform']} · glibc keeps freed memory: {meta['malloc_keeps_freed_memory']} · "
             f"torch.compile caches {meta['compile_caches']} · load average at the end {meta['load_average'][0]:.1f}"]
    if rows:
        lines += ["", f"ms per forward of all N members (no grad): the {meta['stat']} of {meta['repeats']} round-robin samples after warm-up"
                 + (" (the estimate least disturbed by other processes on a shared machine; medians are in the JSON)" if meta["stat"] == "min" else "")
                 + ". *ratio* = best of loop / whole vmap / whole vmap + compile divided by stagewise (>1: stagewise faster). "
                 "*floor* = one member on N x the batch (same FLOPs, shared weights).", "",
                 "| workload | loop | whole vmap | vmap + compile (compile s) | stagewise auto | ratio vs best | floor | stagewise / floor | stages |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        comp = f"{_f(r['vmap_compile_ms'])} ({_f(r['vmap_compile_s'], '.1f', '-')})" if r["vmap_compile_ms"] else "fail"
        lines.append(f"| {r['workload']} | {_f(r['loop_ms'])} | {_f(r['vmap_ms'])} | {comp} | **{_f(r['stagewise_ms'])}** | "
                     f"{_f(r['ratio_vs_best'])}x ({r['best_whole']}) | {_f(r['floor_ms'])} | {_f(r['vs_floor'])}x | {r['strategies']} |")
    lines += training_markdown(train_rows or [], meta["stat"])
    lines += ["", "## Targets", ""] + [f"- {v}" for v in verdicts]
    fails = [(r["workload"], k, e) for r in rows + (train_rows or []) for k, e in r["errors"].items()]
    if fails:
        lines += ["", "## Baselines that failed", ""] + [f"- {w} / {k}: {e[:200]}" for w, k, e in fails]
    lines += ["", f"Suite wall time {meta['wall_s']:.0f} s (autotune, compile and checks included)."]
    return "\n".join(lines) + "\n"


def verdicts_of(rows: list[dict], device: str) -> list[str]:
    out = []
    ratios = [r["ratio_vs_best"] for r in rows if r["ratio_vs_best"]]
    bad = [r for r in rows if not r["ratio_vs_best"] or r["ratio_vs_best"] < 0.95]
    out.append(("MET" if not bad else "NOT MET") + ": stagewise >= 0.95x the best whole-model strategy on every workload"
               + (f" (below: {', '.join(r['workload'] + ' ' + _f(r['ratio_vs_best']) + 'x' for r in bad)})" if bad else ""))
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        out.append(f"{'MET' if geo >= 1.25 else 'NOT MET'}: geometric mean speedup over the best whole-model strategy "
                   f"{geo:.2f}x (target >= 1.25x)")
    for r in rows:
        if r["linear_heavy"]:
            ok = r["vs_floor"] is not None and r["vs_floor"] <= 1.5
            out.append(f"{'MET' if ok else 'NOT MET'}: {r['workload']} within 1.5x of the floor ({_f(r['vs_floor'])}x)")
    if device.startswith("cuda"):
        for key, target in (("MLP 64-128-64, N=100, b32, shared x", 40), ("conv resblock", 10)):
            r = next((x for x in rows if x["workload"].startswith(key)), None)
            if r and r["loop_ms"] and r["stagewise_ms"]:
                s = r["loop_ms"] / r["stagewise_ms"]
                out.append(f"{'MET' if s >= target else 'NOT MET'}: {r['workload']} {s:.1f}x faster than the eager loop (GPU target {target}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--only", default=None, help="run workloads whose name contains this text")
    ap.add_argument("--repeats", type=int, default=None, help="timed samples per measurement (default adaptive)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (default 0: torch's own default). Use 1 on a machine other jobs share: "
                         "with two OpenMP threads on two cores every op stalls at a barrier whenever another process "
                         "takes a core, which we measured as a 10x spread")
    ap.add_argument("--stat", choices=["min", "median"], default="median",
                    help="statistic of the timed samples for the table (default median; min is the estimate least disturbed by other processes)")
    ap.add_argument("--warm-compile-cache", action="store_true",
                    help="let torch.compile reuse its on-disk caches from earlier runs (default: cold, so the "
                         "compile times shown are what a first run pays)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc as it is (default: keep freed memory, see keep_freed_memory)")
    ap.add_argument("--training", choices=["yes", "no", "only"], default="yes",
                    help="the training rows too (default), not at all, or only them")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        executor.resolve_device(args.device)
    except planner.StagewiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    malloc_tuned = False if args.default_malloc else keep_freed_memory()
    if not args.warm_compile_cache:
        cold_compile_caches()
    started = time.perf_counter()
    workloads = [w for w in WORKLOADS if not args.only or args.only.lower() in w.name.lower()]
    rows, reports, train_rows, train_reports = [], {}, [], {}
    for w in workloads if args.training != "only" else []:
        print(f"{w.name}", file=sys.stderr)
        report = run_workload(w, args.device, args.repeats)
        reports[w.name] = report.to_json()
        rows.append(row_of(w, report, args.stat))
    for w in [w for w in workloads if w.name in TRAINING] if args.training != "no" else []:
        print(f"training: {w.name}", file=sys.stderr)
        report, proposed, samples = run_training(w, args.device, args.repeats)
        train_reports[w.name] = report.to_json()
        train_rows.append(training_row_of(w, report, samples, args.stat, proposed))
    dev = executor.resolve_device(args.device)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": str(dev),
        "device_name": device_name(dev),
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "platform": platform.platform(), "wall_s": time.perf_counter() - started,
        "malloc_keeps_freed_memory": malloc_tuned, "stat": args.stat, "compile_caches": "warm" if args.warm_compile_cache else "cold",
        "repeats": args.repeats or "adaptive (10-40)", "load_average": os.getloadavg(),
    }
    verdicts = (verdicts_of(rows, str(dev)) if rows else []) + training_verdicts(train_rows)
    text = markdown(rows, meta, verdicts, train_rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (dev.type + (f"-threads{args.threads}" if args.threads else "") + ("-" + args.only.replace(" ", "_") if args.only else "")
            + ("-training" if args.training == "only" else ""))
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "verdicts": verdicts, "reports": reports,
                                                  "training_rows": train_rows, "training_reports": train_reports},
                                                 sort_keys=True, indent=2) + "\n")
    print(text)
    print(f"wrote {out / (stem + '.md')} and {stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
