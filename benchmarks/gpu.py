"""The GPU benchmark: `python -m benchmarks.gpu [--device cuda] [--smoke] [--only NAME] [--budget-s 480] [--out DIR]`.

Every way of running N members, per workload, in one process on the same inputs (float32 with TF32 off,
bf16 rows at the plan dtype "bfloat16"):

- loop: the eager member loop (the reference every way is checked against);
- vmap: `vmap(functional_call)` of the whole model over stacked parameters (the torch.func recipe);
- compile / compile RO: `torch.compile` of that, default mode and mode="reduce-overhead" (CUDA graphs);
- default: the proposed plan built by executor.build, untuned;
- auto: executor.autotune on the device, then build;
- auto+capture: the auto plan as one CUDA graph (executor.capture, graph-owned outputs like reduce-overhead's);
- floor: one member on N x the batch, eager (same FLOPs, shared weights; not checked).

Two timings per way: *throughput* (K calls back to back between two CUDA events, ms per call: the headline,
how inference loops run) and *latency* (a synchronize after each call, median of the calls). Compile, tune
and capture happen before timing and are reported apart. Each way's output is compared once with the float32
loop (worst member's normwise error, tolerance executor.verify.DTYPE_RTOL of the row's dtype); a wrong or
failing way is marked, never fatal. Results go to benchmarks/results/cuda.{md,json} (`<device>-gpu` elsewhere),
rewritten after every workload so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import types
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_map

from stagewise import executor, planner
from stagewise.executor import baselines
from stagewise.executor.candidates import max_rel_error
from stagewise.executor.profile import device_name
from stagewise.executor.strategies.compiled import compile_mode_of
from stagewise.executor.timing import describe_error
from stagewise.executor.verify import DTYPE_RTOL, member_inputs
from stagewise.planner.plan import InputMode
from benchmarks.workloads import ROOT, WORKLOADS

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE_ENV = "STAGEWISE_BENCH_SMOKE"  # benchmarks/models/*: tiny sizes when "1"

WAYS = {"loop": "eager loop", "vmap": "vmap", "compile": "vmap+compile", "compile_ro": "compile reduce-overhead",
        "default": "stagewise default", "auto": "stagewise auto", "capture": "auto+capture", "floor": "floor"}
PEERS = ("loop", "vmap", "compile", "compile_ro")  # what a user would write instead of stagewise
CUDA_ONLY = {"compile_ro": "reduce-overhead is CUDA graphs: CUDA only",
             "capture": "executor.capture records a CUDA graph: CUDA only"}


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # model file, relative to the repository root
    n: int
    input_mode: str = "shared"
    dtype: str = "float32"  # plan dtype; peers run with members and inputs cast to it
    large: bool = False  # the issue's larger workloads: the small-workload targets (floor, default vs vmap) skip them


LARGE = [Row("wide MLP 1024-4096-1024, N=16, b128", "benchmarks/models/wide_mlp.py", 16, large=True),
         Row("CIFAR ResNet-14 16/32/64ch, N=8, b128", "benchmarks/models/cifar_resnet.py", 8, large=True),
         Row("nn.TransformerEncoder 2L d256 h8 s128, N=8, b16", "benchmarks/models/transformer_encoder_2l.py", 8, large=True)]
# bf16 rows for the two largest by FLOPs per call (traced: encoder ~7.3 GFLOP x 8, ResNet 6.8 x 8, wide MLP 2.1 x 16)
BF16 = [Row(r.name + " [bf16]", r.model, r.n, r.input_mode, "bfloat16", True) for r in (LARGE[2], LARGE[1])]
_FIRST = ("MLP 64-128-64, N=100, b32, shared", "conv resblock", "GRU", "nn.TransformerEncoderLayer")  # the targets' rows
FIRST = [Row(w.name, w.model, w.n, w.input_mode) for p in _FIRST for w in WORKLOADS if w.name.startswith(p)]
# Run order is priority order: a run cut short by --budget-s loses the rows at the end. Rows with targets first,
# then the larger workloads and their bf16 twins, then the rest of benchmarks/workloads.py and two more samples.
ROWS = (FIRST + LARGE + BF16 + [Row(w.name, w.model, w.n, w.input_mode) for w in WORKLOADS if w.name not in {r.name for r in FIRST}]
        + [Row("CNN conv16-conv32 32x32, N=16, b8", "sample_models/cnn.py", 16),
           Row("dense MoE 4x(64-128-64), N=16, b32", "sample_models/moe.py", 16)])


@dataclass(frozen=True)
class Config:
    """How hard to measure: the full run, or --smoke (tiny models, few calls, no compile in autotune)."""

    smoke: bool = False
    latency_calls: int = 30  # synchronised calls per way (round-robin), median reported
    blocks: int = 5  # throughput blocks per way (round-robin), median reported
    block_s: float = 0.03  # target length of one throughput block; K = block_s / per-call latency, clamped
    k_min: int = 5
    k_max: int = 500
    tune_repeats: int | None = None  # autotune's timed samples (None: its adaptive default)
    tune_strategies: tuple[str, ...] | None = None  # None: every candidate autotune knows
    compile_backend: str = "inductor"  # of the vmap+compile peers
    peak_size: int = 8192  # square matmul for the peak TFLOP/s
    max_n: int | None = None  # cap on N (smoke)
    min_row_s: float = 20.0  # skip a workload when less than this is left of the budget

    @staticmethod
    def for_smoke() -> "Config":
        return Config(True, latency_calls=3, blocks=2, block_s=0.002, k_min=2, k_max=5, tune_repeats=3,
                      tune_strategies=("vmap", "wide", "loop"), compile_backend="aot_eager", peak_size=256, max_n=3,
                      min_row_s=0.0)


# --- timing -----------------------------------------------------------------------------------------

def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def latency_s(fn: Callable[[], Any], dev: torch.device) -> float:
    """One call, synchronised before and after (CUDA events on GPU, perf_counter on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def block_s(fn: Callable[[], Any], dev: torch.device, k: int) -> float:
    """Seconds per call of `k` calls back to back between two events (no synchronize inside)."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / k
    start = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - start) / k


def time_ways(calls: dict[str, Callable[[], Any]], dev: torch.device, cfg: Config) -> tuple[dict, dict, dict]:
    """Latency then throughput of every callable, round-robin. Returns (throughput ms, latency ms, errors)."""
    lat: dict[str, list[float]] = {k: [] for k in calls}
    thr: dict[str, list[float]] = {k: [] for k in calls}
    errors: dict[str, str] = {}

    def guarded(name: str, measure: Callable[[], float], into: dict) -> None:
        if name in errors:
            return
        try:
            into[name].append(measure())
        except Exception as e:  # a way that fails while timed (out of memory...) is reported, the others go on
            errors[name] = "while timing: " + describe_error(e)
            _free(dev)

    for _ in range(cfg.latency_calls):
        for name, fn in calls.items():
            guarded(name, lambda fn=fn: latency_s(fn, dev), lat)
    ks = {name: min(cfg.k_max, max(cfg.k_min, int(cfg.block_s / max(statistics.median(v), 1e-7))))
          for name, v in lat.items() if v}
    for _ in range(cfg.blocks):
        for name, fn in calls.items():
            if name in ks:
                guarded(name, lambda fn=fn, k=ks[name]: block_s(fn, dev, k), thr)
    med = lambda d: {k: statistics.median(v) * 1e3 for k, v in d.items() if v and k not in errors}  # noqa: E731
    return med(thr), med(lat), errors


def peak_tflops(dev: torch.device, dtype: torch.dtype, size: int, cfg: Config) -> float | None:
    """The best of a few throughput blocks of a size x size matmul, in TFLOP/s."""
    try:
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        fn = lambda: a @ b  # noqa: E731
        for _ in range(3):
            fn()
        one = latency_s(fn, dev)
        k = min(cfg.k_max, max(cfg.k_min, int(0.3 / max(one, 1e-7)) if not cfg.smoke else cfg.k_min))
        best = min(block_s(fn, dev, k) for _ in range(3))
        return 2 * size ** 3 / best / 1e12
    except Exception as e:  # bf16 matmul on an old CPU build, out of memory: no peak, the ratio column says so
        print(f"  peak {dtype}: {describe_error(e)}", flush=True)
        return None


# --- the ways ---------------------------------------------------------------------------------------

def _fresh_code(fn: Callable, name: str) -> Callable:
    """`fn` behind a wrapper with a code object of its own, so dynamo's per-code recompile limit never
    turns a later workload's compile into eager (as executor.strategies.compiled.compile_fresh)."""
    def call(*args):
        return fn(*args)

    code = call.__code__.replace(co_name=name)
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)


def _vmapped(plan: planner.Plan, members: list, dev: torch.device) -> tuple[Callable, dict]:
    """(vmap of member 0's functional_call over stacked state and the plan's input modes, that state)."""
    dims = tuple(0 if spec.mode is InputMode.PER_MEMBER else None for spec in plan.inputs)
    base = members[0]
    fn = vmap(lambda state, *xs: functional_call(base, state, xs, tie_weights=False), in_dims=(0, *dims), randomness="error")
    return fn, executor.stack_member_state(members, dev)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def way_setups(plan: planner.Plan, members: list, inputs: tuple, dev: torch.device, dtype: str, cfg: Config,
               info: dict) -> dict[str, Callable[[], tuple[Callable[[], Any], int]]]:
    """For each way, a setup returning (the call, warm-up calls to make before checking its output).

    Peers run with members and inputs cast to the row's dtype; stagewise builds plan.with_dtype(dtype) from the
    float32 members (the module casts its state once) and autotunes on the float32 inputs, whose loop it checks
    against. `info` receives the tuned plan's strategies and the auto module (for capture)."""
    low = dtype != "float32"
    tdtype = getattr(torch, dtype)
    peers = [copy.deepcopy(m).to(tdtype) for m in members] if low else members
    xs = _cast(inputs, tdtype) if low else inputs
    splan = plan.with_dtype(dtype) if low else plan
    example = member_inputs(plan, inputs, 0)
    serial = f"{abs(hash(plan.fingerprint)) % 10**6}_{dtype}"

    def loop():
        return baselines.loop(splan, peers, xs), 1

    def whole_vmap():
        fn, state = _vmapped(splan, peers, dev)
        return (lambda: fn(state, *xs)), 1

    def compiled(mode: str | None):
        def setup():
            fn, state = _vmapped(splan, peers, dev)
            for t in state.values():  # weights keep their addresses: CUDA graphs must not copy them in per call
                torch._dynamo.mark_static_address(t)
            c = torch.compile(_fresh_code(fn, f"gpu_bench_{mode or 'default'}_{serial}"), backend=cfg.compile_backend,
                              mode=mode, dynamic=False)
            if mode == "reduce-overhead":  # each call a new cudagraph-tree step: the previous outputs may be overwritten
                return (lambda: (torch.compiler.cudagraph_mark_step_begin(), c(state, *xs))[1]), 3
            return (lambda: c(state, *xs)), 2
        return setup

    def default():
        m = executor.build(splan, members, example_inputs=example, device=dev)
        return (lambda: m(*xs)), 1

    def auto():
        tuned = executor.autotune(splan, members, inputs, device=dev, repeats=cfg.tune_repeats, strategies=cfg.tune_strategies)
        # a compile stage's torch.compile mode too ("s0:compile/reduce-overhead"), as autotune labels its candidates
        info["strategies"] = " ".join(f"{s.id}:{s.options.strategy.value}" + (f"/{m}" if (m := compile_mode_of(s.options)) else "")
                                      for s in tuned.stages)
        info["tuned_plan"] = tuned.to_json()
        m = executor.build(tuned, members, example_inputs=example, device=dev)
        info["auto_module"] = m
        return (lambda: m(*xs)), 1

    def capture():
        m = info.get("auto_module")
        if m is None:
            raise RuntimeError("no auto plan to capture (stagewise auto failed or was skipped)")
        cap = executor.capture(m.eval(), clone_outputs=False)
        return (lambda: cap(*xs)), 2

    def floor():
        return baselines.floor(splan, peers, xs), 1

    return {"loop": loop, "vmap": whole_vmap, "compile": compiled(None), "compile_ro": compiled("reduce-overhead"),
            "default": default, "auto": auto, "capture": capture, "floor": floor}


def _record_failure(rec: dict, e: Exception, dev: torch.device) -> None:
    """A way's setup or check failed: its record says why, and the memory it held goes back."""
    rec["error"] = describe_error(e)
    _free(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _flops(graph: planner.ModelGraph, member: torch.nn.Module, example: tuple, n: int) -> dict:
    """FLOPs per call for all N members: the traced graph's node counts, and torch's FlopCounterMode on one member
    (leaf modules such as nn.TransformerEncoder count 0 in the graph); `flops` is the larger."""
    from torch.utils.flop_counter import FlopCounterMode

    from_graph = sum(int(graph.dag.nodes[v].get("flops", 0)) for v in graph.dag) * n
    try:
        with FlopCounterMode(display=False) as counter:
            member(*example)
        counted = counter.get_total_flops() * n
    except Exception:  # a counter gap is no reason to lose the row
        counted = 0
    return {"flops_graph": from_graph, "flops_counted": counted, "flops": max(from_graph, counted),
            "flops_source": "graph" if from_graph >= counted else "FlopCounterMode (graph counts leaf modules as 0)"}


def compile_diagnostics(module: Any, dev: torch.device) -> dict:
    """What the auto module's compiled stages did while timed, and torch's compile counters for the row: each compile
    stage's mode, compiled signatures, compile seconds and calls run as plain vmap instead (eager_calls); dynamo's
    recompiles and graph breaks; the cudagraph trees' graph count. A compiled stage slower than autotune measured it
    shows here first (a fallback to eager, recompiles, a tree that keeps recording)."""
    from torch._dynamo.utils import counters

    from stagewise.executor.strategies.compiled import CompileRunner, cudagraph_tree_graphs

    stages = [{"stage": program.stage.id, "mode": runner.mode or "default", "signatures": len(runner._compiled),
               "compile_s": round(runner.compile_seconds, 2), "eager_calls": runner.eager_calls}
              for program, runner, *_ in getattr(module, "_steps", ()) if isinstance(runner, CompileRunner)]
    out: dict[str, Any] = {"compile_stages": stages,
                           "dynamo": {group: dict(counters[group]) for group in ("stats", "recompiles", "graph_break")
                                      if counters.get(group)}}
    if dev.type == "cuda":
        try:
            out["cudagraph_tree_graphs"] = cudagraph_tree_graphs(dev.index or 0)
        except Exception as e:  # a private API of torch's: its absence is no reason to lose the row
            out["cudagraph_tree_graphs"] = f"unknown ({type(e).__name__})"
    return out


def run_row(row: Row, dev: torch.device, cfg: Config, deadline: float) -> dict:
    """Every way of one workload: setup (timed), one output check against the float32 loop, then the timings."""
    started = time.perf_counter()
    n = min(row.n, cfg.max_n) if cfg.max_n else row.n
    out: dict[str, Any] = {"workload": row.name, "n": n, "input_mode": row.input_mode, "dtype": row.dtype,
                           "large": row.large, "ways": {}, "strategies": None, "error": None}
    torch._dynamo.reset()  # fresh recompile counters and cudagraph trees per workload
    src = planner.load_model_file(ROOT / row.model)
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, n, row.input_mode, model=row.model)
    members = [m.to(dev) for m in src.members(n)]
    inputs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, executor.batched_inputs(plan, src.example_inputs))
    with torch.no_grad():
        out.update(_flops(graph, members[0], member_inputs(plan, inputs, 0), n))
        want = baselines.stack_outputs(baselines.loop(plan, members, inputs)())
    rtol = DTYPE_RTOL[row.dtype]
    info: dict[str, Any] = {}
    calls: dict[str, Callable[[], Any]] = {}
    for name, setup in way_setups(plan, members, inputs, dev, row.dtype, cfg, info).items():
        rec: dict[str, Any] = {"setup_s": None, "rel_err": None, "wrong": False, "error": None, "skipped": None}
        out["ways"][name] = rec
        if dev.type != "cuda" and name in CUDA_ONLY:
            rec["skipped"] = CUDA_ONLY[name]
        elif time.perf_counter() > deadline:
            rec["skipped"] = "out of the --budget-s time"
        if rec["skipped"]:
            print(f"  {name:<10} skipped: {rec['skipped']}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                call, warm = setup()
                for _ in range(warm):
                    got = call()
                _sync(dev)
                rec["setup_s"] = time.perf_counter() - t0
                if name == "loop":
                    got = baselines.stack_outputs(got)
                if name != "floor":
                    rec["rel_err"] = max_rel_error(got, want)
                    rec["wrong"] = not rec["rel_err"] <= rtol
                del got
            calls[name] = call
        except planner.StagewiseError as e:
            if name != "capture":
                _record_failure(rec, e, dev)
            else:  # executor.capture refuses plans it cannot record (a host sync, a CPU tensor): skipped, with its reason
                rec["skipped"] = f"capture refused: {describe_error(e)}"
        except Exception as e:  # every way is reported, none may end the run
            _record_failure(rec, e, dev)
        state = rec["error"] or rec["skipped"] or (f"WRONG, rel err {rec['rel_err']:.1e} > {rtol:g}" if rec["wrong"] else
                                 f"ok, rel err {rec['rel_err']:.1e}" if rec["rel_err"] is not None else "ok (not compared)")
        print(f"  {name:<10} setup {time.perf_counter() - t0:6.1f} s  {state}", flush=True)
    out["strategies"] = info.get("strategies")
    out["tuned_plan"] = info.get("tuned_plan")
    with torch.no_grad():
        thr, lat, errors = time_ways(calls, dev, cfg)
    for name, rec in out["ways"].items():
        rec["throughput_ms"], rec["latency_ms"] = thr.get(name), lat.get(name)
        if name in errors:
            rec["error"] = errors[name]
    if info.get("auto_module") is not None:
        out["diagnostics"] = compile_diagnostics(info["auto_module"], dev)
        print(f"  diagnostics {json.dumps(out['diagnostics'], default=str)[:600]}", flush=True)
    out["wall_s"] = time.perf_counter() - started
    del calls, info
    _free(dev)
    return out


# --- the report -------------------------------------------------------------------------------------

def ms_of(row: dict, way: str, mode: str) -> float | None:
    """A way's time, only when it ran, was timed and matched the loop."""
    rec = row.get("ways", {}).get(way)
    if not rec or rec["error"] or rec["skipped"] or rec["wrong"]:
        return None
    return rec.get(f"{mode}_ms")


def best_peer(row: dict, mode: str) -> tuple[str | None, float | None]:
    times = {w: ms_of(row, w, mode) for w in PEERS}
    times = {w: t for w, t in times.items() if t}
    if not times:
        return None, None
    w = min(times, key=times.get)
    return w, times[w]


def stagewise_of(row: dict, mode: str) -> tuple[str | None, float | None]:
    """The faster correct one of stagewise auto and auto+capture."""
    times = {w: ms_of(row, w, mode) for w in ("auto", "capture")}
    times = {w: t for w, t in times.items() if t}
    if not times:
        return None, None
    w = min(times, key=times.get)
    return w, times[w]


def ratios(row: dict, mode: str) -> dict:
    peer, peer_ms = best_peer(row, mode)
    sw, sw_ms = stagewise_of(row, mode)
    loop, floor = ms_of(row, "loop", mode), ms_of(row, "floor", mode)
    auto, default, whole_vmap = ms_of(row, "auto", mode), ms_of(row, "default", mode), ms_of(row, "vmap", mode)
    return {"best_peer": peer, "best_peer_ms": peer_ms, "stagewise": sw, "stagewise_ms": sw_ms,
            "vs_best_peer": peer_ms / sw_ms if peer_ms and sw_ms else None,  # >1: stagewise faster
            "vs_loop": loop / sw_ms if loop and sw_ms else None,
            "vs_floor": sw_ms / floor if sw_ms and floor else None,  # <=1.5 is the small-workload target
            "default_vs_vmap": default / whole_vmap if default and whole_vmap else None,  # <=1.1 on small workloads
            "auto_tflops": row["flops"] / (auto * 1e-3) / 1e12 if auto and row.get("flops") else None}


def _f(x: float | None, spec: str = ".3g", dash: str = "-") -> str:
    return dash if x is None else format(x, spec)


def _cell(row: dict, way: str, mode: str) -> str:
    rec = row["ways"].get(way)
    if rec is None or rec["skipped"]:
        return "-"
    if rec["error"]:
        return "fail"
    t = rec.get(f"{mode}_ms")
    return (f"WRONG ({rec['rel_err']:.0e}) " if rec["wrong"] else "") + _f(t)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def targets(rows: list[dict], mode: str) -> list[str]:
    """The issue's targets as MET / NOT MET / NOT EVALUATED lines (stagewise = the faster of auto and auto+capture)."""
    done = [r for r in rows if not r.get("skipped") and not r.get("error")]
    rs = {r["workload"]: ratios(r, mode) for r in done}
    verdict = lambda ok, text: f"{'MET' if ok else 'NOT MET'}: {text}"  # noqa: E731
    lines = []
    if not done:
        lines += ["NOT EVALUATED: stagewise >= 1.0x the best peer on every workload (nothing measured)",
                  "NOT EVALUATED: geometric mean over the best peer >= 1.5x (nothing measured)"]
    else:
        below = [f"{w} {_f(x['vs_best_peer'], '.2f')}x" for w, x in rs.items() if not x["vs_best_peer"] or x["vs_best_peer"] < 1.0]
        got = [x["vs_best_peer"] for x in rs.values() if x["vs_best_peer"]]
        lines.append(verdict(not below, "stagewise >= 1.0x the best peer on every workload"
                             + (f" (below or unmeasured: {', '.join(below)})" if below else "")))
        geo = _geomean(got) if got else None
        lines.append(verdict(geo and geo >= 1.5, f"geometric mean over the best peer {_f(geo, '.2f')}x (target >= 1.5x)"))

    def one(prefix: str, key: str, target: float, text: str, below_ok: bool = False) -> None:
        name = next((w for w in rs if w.startswith(prefix) and "[bf16]" not in w), None)
        x = rs[name][key] if name else None
        if x is None:
            lines.append(f"NOT EVALUATED: {text} (not measured{': ' + name if name else ''})")
            return
        ok = x <= target if below_ok else x >= target
        lines.append(verdict(ok, f"{text}: {x:.2f}x"))

    one("MLP 64-128-64, N=100, b32, shared x", "vs_loop", 250, "MLP N=100 (shared x) >= 250x the eager loop")
    one("conv resblock", "vs_loop", 12, "conv resblock >= 12x the eager loop")
    one("GRU", "vs_loop", 5, "GRU >= 5x the eager loop")
    one("nn.TransformerEncoderLayer", "vs_best_peer", 1.0, "nn.TransformerEncoderLayer row >= 1.0x the best peer")
    small = [r for r in done if not r["large"]]
    if not small:
        return lines + ["NOT EVALUATED: small workloads within 1.5x of the floor (none measured)",
                        "NOT EVALUATED: untuned default <= 1.1x plain vmap on small workloads (none measured)"] + _bf16_targets(done, mode)
    far = [f"{r['workload']} {_f(rs[r['workload']]['vs_floor'], '.2f')}x" for r in small
           if not rs[r["workload"]]["vs_floor"] or rs[r["workload"]]["vs_floor"] > 1.5]
    lines.append(verdict(small and not far, "small workloads within 1.5x of the floor"
                         + (f" (outside or unmeasured: {', '.join(far)})" if far else "")))
    slow = [(r["workload"], rs[r["workload"]]["default_vs_vmap"]) for r in small
            if rs[r["workload"]]["default_vs_vmap"] and rs[r["workload"]]["default_vs_vmap"] > 1.1]
    compared = [r for r in small if rs[r["workload"]]["default_vs_vmap"]]
    lines.append(verdict(compared and not slow, f"untuned default <= 1.1x plain vmap on small workloads ({len(compared)} where both ran)"
                         + (f" (slower: {', '.join(f'{w} {x:.2f}x' for w, x in slow)})" if slow else "")))
    return lines + _bf16_targets(done, mode)


def _bf16_targets(done: list[dict], mode: str) -> list[str]:
    lines = []
    for r in [r for r in done if r["dtype"] == "bfloat16"]:
        base = next((x for x in done if x["workload"] == r["workload"].replace(" [bf16]", "")), None)
        f32, b16 = (stagewise_of(base, mode)[1] if base else None), stagewise_of(r, mode)[1]
        if f32 and b16:
            lines.append(f"{'MET' if f32 / b16 >= 3 else 'NOT MET'}: {r['workload']} >= 3x faster than float32: {f32 / b16:.2f}x")
        else:
            lines.append(f"NOT EVALUATED: {r['workload']} >= 3x faster than float32 (one of the two not measured)")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    peak = meta["peak_tflops"]
    lines = [f"# stagewise GPU benchmark: {meta['device_name']} ({meta['device']})", "",
             f"{meta['date']} · torch {meta['torch']} · CUDA {meta['cuda']} · cuDNN {meta['cudnn']} · Python {meta['python']} · "
             f"{meta['platform']} · TF32 off · measured peak {_f(peak['float32'], '.3g')} TFLOP/s float32, "
             f"{_f(peak['bfloat16'], '.3g')} bfloat16 ({meta['peak_size']}² matmul)"
             + (" · **smoke run: tiny models, few calls, torch.compile backend aot_eager, autotune without compile: "
                "the numbers mean nothing**" if meta["smoke"] else ""), ""]
    lines += ["Ways: " + ", ".join(f"*{v}*" for v in WAYS.values()) + " (see benchmarks/README.md). *stagewise* in the ratios is the "
              "faster of auto and auto+capture (marked c). ms per call; WRONG: output differs from the float32 loop beyond "
              "the dtype's tolerance (excluded from ratios); fail: error (listed below); -: skipped (reason below).", ""]
    for mode, title in (("throughput", "Throughput: K calls back to back between two events, ms per call (the headline)"),
                        ("latency", "Per-call latency: a synchronize after each call, median")):
        lines += [f"## {title}", "",
                  "| workload | " + " | ".join(WAYS.values()) + " | stagewise vs best peer | x loop | / floor | auto TFLOP/s (% peak) |",
                  "|---|" + "---:|" * (len(WAYS) + 4)]
        for r in rows:
            if r.get("skipped") or r.get("error"):
                lines.append(f"| {r['workload']} | " + " | ".join(["-"] * len(WAYS)) + f" | {r.get('skipped') or 'fail'} | | | |")
                continue
            x = ratios(r, mode)
            pk = peak.get(r["dtype"])
            tf = f"{_f(x['auto_tflops'], '.3g')} ({_f(100 * x['auto_tflops'] / pk if x['auto_tflops'] and pk else None, '.1f')}%)"
            mark = " c" if x["stagewise"] == "capture" else ""
            lines.append(f"| {r['workload']} | " + " | ".join(_cell(r, w, mode) for w in WAYS)
                         + f" | {_f(x['vs_best_peer'], '.2f')}x{mark} ({x['best_peer'] and WAYS[x['best_peer']]}) | "
                         f"{_f(x['vs_loop'], '.1f')}x | {_f(x['vs_floor'], '.2f')}x | {tf} |")
        lines += ["", f"### Targets ({mode})", ""] + [f"- {t}" for t in targets(rows, mode)] + [""]
    lines += ["## Setup time and plans", "", "Seconds before timing (compile, autotune + build, capture; first calls included); "
              "GFLOP per call for all N members.", "",
              "| workload | GFLOP | vmap+compile s | reduce-overhead s | default build s | auto tune+build s | capture s | auto strategies |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("skipped") or r.get("error"):
            continue
        s = lambda w: _f(r["ways"][w]["setup_s"], ".1f")  # noqa: E731
        lines.append(f"| {r['workload']} | {_f(r['flops'] / 1e9, '.2f')} | {s('compile')} | {s('compile_ro')} | {s('default')} | "
                     f"{s('auto')} | {s('capture')} | {r['strategies'] or '-'} |")
    diag = [r for r in rows if (r.get("diagnostics") or {}).get("compile_stages")]
    if diag:
        lines += ["", "## Compiled stages of the auto plans", "",
                  "Each compile stage after timing: mode, signatures compiled, calls run as plain vmap instead; torch's "
                  "recompiles and graph breaks in the row; graphs held by the cudagraph trees.", "",
                  "| workload | compile stages (mode, signatures, eager calls) | recompiles | graph breaks | cudagraph tree graphs |",
                  "|---|---|---:|---:|---:|"]
        for r in diag:
            d = r["diagnostics"]
            st = ", ".join(f"{c['stage']} {c['mode']} {c['signatures']} sig {c['eager_calls']} eager" for c in d["compile_stages"])
            count = lambda group: sum((d["dynamo"].get(group) or {}).values())  # noqa: E731
            lines.append(f"| {r['workload']} | {st} | {count('recompiles')} | {count('graph_break')} | "
                         f"{d.get('cudagraph_tree_graphs', '-')} |")
    notes = [f"- {r['workload']}: {r.get('skipped') or r.get('error')}" for r in rows if r.get("skipped") or r.get("error")]
    notes += [f"- {r['workload']} / {WAYS[w]}: {rec['error'] or rec['skipped']}" for r in rows if "ways" in r
              for w, rec in r["ways"].items() if rec["error"] or (rec["skipped"] and rec["skipped"] != CUDA_ONLY.get(w))]
    skipped_cuda = sorted({w for r in rows if "ways" in r for w, rec in r["ways"].items() if rec["skipped"] and rec["skipped"] == CUDA_ONLY.get(w)})
    notes += [f"- {WAYS[w]} skipped on every row: {CUDA_ONLY[w]}" for w in skipped_cuda]
    if notes:
        lines += ["", "## Failures and skips", ""] + notes
    lines += ["", f"Wall time {meta['wall_s']:.0f} s of a {meta['budget_s']:.0f} s budget."]
    return "\n".join(lines) + "\n"


def write(out: Path, stem: str, rows: list[dict], meta: dict) -> str:
    """The JSON and Markdown results (rewritten after every workload); returns the Markdown.

    The measurements are written first and a fault in the report itself is written into the report: a GPU run
    happens once, and a formatting bug must not cost its numbers."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        verdicts = {m: targets(rows, m) for m in ("throughput", "latency")}
    except Exception as e:  # see the docstring
        verdicts = {"error": f"{type(e).__name__}: {e}"}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": verdicts},
                                                 sort_keys=True, indent=2, default=str) + "\n")
    try:
        text = markdown(rows, meta)
    except Exception:  # see the docstring
        import traceback

        text = f"# the report failed; the numbers are in {stem}.json\n\n```\n{traceback.format_exc()}```\n"
    (out / f"{stem}.md").write_text(text)
    return text


def set_precision() -> tuple:
    """float32 means float32: TF32 off for cuBLAS and cuDNN (the issue's rule for every way). Returns the flags
    as they were, for restore_precision: they are process-wide (cuDNN's TF32 is on by default), and a caller in
    the same process (the smoke test, the rest of a pytest session) must not inherit them."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return saved


def restore_precision(saved: tuple) -> None:
    """Put back the flags set_precision returned."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision = saved
    torch.set_float32_matmul_precision(precision)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny models and few calls (runs on CPU in seconds; tests the script)")
    ap.add_argument("--only", action="append", default=None, metavar="TEXT",
                    help="workloads whose name contains TEXT (case-insensitive; repeat for several)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="wall-time budget: workloads (and ways) not started in time are skipped and listed (default 480)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    try:
        dev = executor.resolve_device(args.device)
    except planner.StagewiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = Config.for_smoke() if args.smoke else Config()
    started = time.perf_counter()
    deadline = started + args.budget_s
    rows_to_run = [r for r in ROWS if not args.only or any(s.lower() in r.name.lower() for s in args.only)]
    saved_precision = set_precision()
    saved_env = os.environ.get(SMOKE_ENV)
    if args.smoke:
        os.environ[SMOKE_ENV] = "1"
    try:
        return _run(args, dev, cfg, rows_to_run, started, deadline)
    finally:
        restore_precision(saved_precision)
        if saved_env is None:
            os.environ.pop(SMOKE_ENV, None)
        else:
            os.environ[SMOKE_ENV] = saved_env


def _run(args: argparse.Namespace, dev: torch.device, cfg: Config, rows_to_run: list[Row], started: float, deadline: float) -> int:
    if not rows_to_run:
        print(f"error: no workload matches --only {args.only}; the workloads are:\n" + "\n".join(f"  {r.name}" for r in ROWS),
              file=sys.stderr)
        return 2
    stem = ("cuda" if dev.type == "cuda" else f"{dev.type}-gpu") + ("-smoke" if args.smoke else "") \
        + ("-only" if args.only else "")
    print(f"stagewise GPU benchmark on {device_name(dev)}: {len(rows_to_run)} workloads, budget {args.budget_s:.0f} s", flush=True)
    peak = {name: peak_tflops(dev, getattr(torch, name), cfg.peak_size, cfg) for name in ("float32", "bfloat16")}
    print(f"peak: {_f(peak['float32'], '.3g')} TFLOP/s float32, {_f(peak['bfloat16'], '.3g')} bfloat16", flush=True)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": str(dev), "device_name": device_name(dev),
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
            "python": platform.python_version(), "platform": platform.platform(), "smoke": args.smoke, "budget_s": args.budget_s,
            "peak_tflops": peak, "peak_size": cfg.peak_size, "config": asdict(cfg), "wall_s": 0.0}
    rows: list[dict] = []
    out = Path(args.out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap fallback and export warnings: the timings show what they mean
        for i, row in enumerate(rows_to_run):
            left = deadline - time.perf_counter()
            print(f"[{i + 1}/{len(rows_to_run)}] {row.name}  (t={time.perf_counter() - started:.0f} s, {left:.0f} s left)", flush=True)
            if left < cfg.min_row_s:
                rows.append({"workload": row.name, "dtype": row.dtype, "large": row.large,
                             "skipped": f"skipped: {max(left, 0):.0f} s of the --budget-s left"})
                print("  skipped (budget)", flush=True)
            else:
                try:
                    rows.append(run_row(row, dev, cfg, deadline))
                except Exception as e:  # loading, tracing or the loop itself failed: the row says so, the run goes on
                    rows.append({"workload": row.name, "dtype": row.dtype, "large": row.large, "error": describe_error(e)})
                    print(f"  failed: {describe_error(e)}", flush=True)
                    _free(dev)
            meta["wall_s"] = time.perf_counter() - started
            text = write(out, stem, rows, meta)
    print(text, flush=True)
    print(f"wrote {out / (stem + '.md')} and {stem}.json", flush=True)
    left = [r["workload"] for r in rows if r.get("skipped")]
    if left:  # names contain no quotes; each --only is a substring of exactly its row (and its [bf16] twin)
        print("skipped for time; to run them: python -m benchmarks.gpu --device " + str(dev.type) + "".join(f' --only "{w}"' for w in left),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
