"""executor.profile: time a plan stage by stage, check every stage against the member loop,
and time the whole-model baselines on the same inputs in the same run.

Per stage: the plan's strategy and the member loop run on the same stage inputs
(the outputs of the stages before it); the strategy's outputs are compared with
the loop's (normwise, worst member), then timed (median and spread after
warm-up), with peak memory and FLOP/s. A stage whose strategy fails (an
exception, out of memory, a wrong result) is marked failed and the profile goes
on with the loop's outputs. End to end and the baselines are timed round-robin.
"""
from __future__ import annotations

import copy
import math
import os
import platform
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from planner.errors import StagewiseError
from planner.graph import trace
from planner.plan import Plan, StageOptions, Strategy
from executor import baselines as whole
from executor.build import BatchedModule, build, resolve_device
from executor.report import ProfileReport, StageProfile, StrategyResult
from executor.stages import RUNNERS, LoopRunner, Runner, StageProgram
from executor.timing import describe_error, inject_faults, interleaved, is_oom, native_stderr_silenced, peak_memory_bytes
from executor.values import Batched, as_batched, n_first
from executor.verify import DEFAULT_RTOL, member_inputs

Progress = Optional[Callable[[int, int, str], None]]


# --- comparing with the loop ------------------------------------------------------------

def max_rel_error(got: Any, want: Any) -> float:
    """Worst member's normwise error: max|got-want| / max|want| per member, N-first trees."""
    g_leaves, g_spec = tree_flatten(got)
    w_leaves, w_spec = tree_flatten(want)
    if len(g_leaves) != len(w_leaves):
        return math.inf
    worst = 0.0
    for g, w in zip(g_leaves, w_leaves):
        if not isinstance(w, torch.Tensor):
            if g != w and not (isinstance(w, float) and abs(g - w) <= DEFAULT_RTOL * max(abs(w), 1e-30)):
                return math.inf
            continue
        g = torch.as_tensor(g)
        if g.shape != w.shape:
            return math.inf
        if w.numel() == 0:
            continue
        g64, w64 = g.detach().double().reshape(w.shape[0], -1), w.detach().double().reshape(w.shape[0], -1)
        if not g64.isfinite().all() and not torch.equal(g64.isnan(), w64.isnan()):
            return math.inf
        diff = (g64 - w64).abs().nan_to_num(0.0).amax(dim=1)
        scale = w64.abs().nan_to_num(0.0).amax(dim=1)
        rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)
        worst = max(worst, float(rel.max()))
    return worst


def _nfirst_all(values: list, n: int) -> list:
    return [n_first(v, n) for v in values]


# --- running one strategy ------------------------------------------------------------------

def strategy_label(strategy: Strategy, chunk_size: Optional[int]) -> str:
    return strategy.value + (f"/chunk={chunk_size}" if chunk_size and strategy is Strategy.VMAP else "")


def make_runner(program: StageProgram, base: Runner, strategy: Strategy, chunk_size: Optional[int] = None) -> Runner:
    """A runner of `strategy` for the stage `base` runs, sharing base's stacked state."""
    options = StageOptions(strategy=strategy, chunk_size=chunk_size, note=program.stage.options.note)
    prog = replace(program, stage=replace(program.stage, options=options))
    return RUNNERS[strategy](prog, base.n_members, base.stacked, base.member_states)


def try_strategy(label: str, stage_id: str, make: Callable[[], Callable[[], Any]],
                 check: Optional[Callable[[Any], float]], device: torch.device,
                 rtol: float = DEFAULT_RTOL) -> tuple[StrategyResult, Optional[Callable], Any]:
    """Build one candidate and run it once; `check(outputs)` gives its error against the loop.

    Returns (result without timing, the callable, its outputs); the callable is
    None when the candidate failed. Out of memory and wrong results never escape.
    The first call's wall time is kept in compile_s until time_candidates corrects it.
    """
    start = time.perf_counter()
    try:
        inject_faults(stage_id, label)
        call = make()
        out = call()
        first_s = time.perf_counter() - start
        err = check(out) if check is not None else None
    except Exception as e:  # any failure of a candidate is a result, not a crash
        if is_oom(e) and device.type == "cuda":
            torch.cuda.empty_cache()
        return StrategyResult(label, ok=False, error=describe_error(e)), None, None
    if err is not None and not err <= rtol:
        return StrategyResult(label, ok=False, error=f"wrong result: max rel err {err:.2e} > {rtol:g} vs the member loop",
                              max_rel_err=err), None, None
    return StrategyResult(label, ok=True, max_rel_err=err, compile_s=first_s), call, out


def stage_inputs(program: StageProgram, env: dict, n: int) -> Callable[[], list]:
    """The stage's input values from `env`. For a stage that writes in place, a fresh writable
    [N, ...] copy per call (what BatchedModule passes it), so repeated timing calls and the
    reference never see each other's writes; the copy is inside the timed call."""
    args = [env[name] for name in program.input_names]
    if not program.writes_in_place:
        return lambda: args
    base = [as_batched(a, n) for a in args]
    return lambda: [Batched(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, b.tree)) for b in base]


def advance(program: StageProgram, env: dict, fresh: Callable[[], list], outputs: Optional[list],
            run: Callable[[list], list]) -> None:
    """Put the stage's outputs into `env` (and, if it writes in place, the inputs it wrote into)."""
    if program.writes_in_place:
        args = fresh()
        outputs = run(args)
        env.update(zip(program.input_names, args))
    for name, value in zip(program.output_names, outputs):
        env[name] = value


def stage_check(want_values: list, n: int) -> Callable[[list], float]:
    """Error of a stage's boundary outputs against the loop runner's, per member."""
    want = _nfirst_all(want_values, n)
    return lambda out: max_rel_error(_nfirst_all(out, n), want)


def time_candidates(cands: dict[str, tuple[StrategyResult, Callable]], device: torch.device,
                    repeats: Optional[int], warmup: int, compiles: set[str]) -> None:
    """Time the working candidates round-robin; fill time, peak memory and compile_s in place."""
    fns = {label: call for label, (res, call) in cands.items()}
    try:
        timings = interleaved(fns, device, repeats, warmup)
    except Exception:  # a candidate that ran once but fails when repeated (OOM on a second buffer set): find which
        for label, (res, call) in cands.items():
            try:
                res.time = interleaved({label: call}, device, repeats, warmup)[label]
            except Exception as e:
                res.ok, res.error = False, describe_error(e)
                if is_oom(e) and device.type == "cuda":
                    torch.cuda.empty_cache()
        timings = {label: res.time for label, (res, _) in cands.items() if res.ok}
    for label, (res, call) in cands.items():
        if label not in timings or not res.ok:
            continue
        res.time = timings[label]
        first = res.compile_s
        res.compile_s = max(0.0, first - res.time.median_ms / 1e3) if label in compiles else 0.0
        try:
            res.peak_mem_bytes = peak_memory_bytes(call, device)
        except Exception as e:
            res.ok, res.error = False, describe_error(e)


# --- the profile ---------------------------------------------------------------------------------

def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def on_device(x: Any, device: torch.device) -> Any:
    """Tensors of a pytree moved to `device`."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


def members_on(members: Sequence[nn.Module], device: torch.device) -> list[nn.Module]:
    """Members on `device`, copying (never moving) the caller's modules."""
    out = []
    for m in members:
        p = next(iter(list(m.parameters()) + list(m.buffers())), None)
        out.append(m if p is None or p.device == device else copy.deepcopy(m).to(device))
    return out


def stage_flops(plan: Plan, member: nn.Module, example: tuple) -> dict[str, int]:
    """FLOPs of each stage for all members (the trace's per-node counts x N); zeros if tracing fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(member, example, probe=False)
    except StagewiseError:
        return {s.id: 0 for s in plan.stages}
    return {s.id: sum(int(graph.dag.nodes[n].get("flops", 0)) for n in s.nodes if n in graph.dag) * plan.n_members
            for s in plan.stages}


class _Labelled:
    """A runner wrapped in a torch.profiler record_function label (for chrome traces)."""

    def __init__(self, runner: Runner, label: str):
        self.runner, self.label = runner, label

    def __call__(self, args: list) -> list:
        with torch.profiler.record_function(self.label):
            return self.runner(args)


def write_chrome_trace(module: BatchedModule, inputs: tuple, path: str, device: torch.device) -> str:
    """Run the plan twice under torch.profiler, one record_function label per stage; write a chrome trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    saved = module.runners
    module.runners = [_Labelled(r, f"stage {p.stage.id} [{p.stage.options.strategy.value}]")
                      for p, r in zip(module.programs, saved)]
    try:
        with native_stderr_silenced(), torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                with torch.profiler.record_function("stagewise forward"):
                    module(*inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        prof.export_chrome_trace(path)
    finally:
        module.runners = saved
    return path


def profile(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
            repeats: Optional[int] = None, warmup: Optional[int] = None, baselines: bool = True,
            compile_baseline: bool = False, trace_path: Optional[str] = None, progress: Progress = None,
            autotune: bool = False, floor: bool = False) -> ProfileReport:
    """Profile `plan` on `inputs`: per stage, end to end, and against the whole-model baselines.

    Args:
        plan, members: as for executor.build (exactly plan.n_members members).
        inputs: the batched module's inputs (shared as-is, per_member [N, ...]).
        device: "cpu" or "cuda"; CUDA on a machine without it raises planner.DeviceError.
        repeats: timed samples per measurement (default: enough for ~0.25 s, 10..40).
        warmup: untimed calls before timing (default 2).
        baselines: also time the member loop and whole-model vmap end to end.
        compile_baseline: also time torch.compile of whole-model vmap (compile time reported apart).
        trace_path: write a chrome trace (torch.profiler, one record_function label per stage) there.
        progress: callable(done, total, label) called before each measurement and at the end.
        autotune: first pick each stage's fastest correct strategy (executor.autotune); the
            report's `plan` is then the tuned plan and each stage lists its candidates.
        floor: also time one member on N x the batch (benchmarks; assumes dim 0 is the batch axis).
    Returns:
        ProfileReport (JSON round trip with to_json/from_json, text table with to_text).
    Raises:
        DeviceError, MemberError, PlanMismatchError, InputError as executor.build does.
    """
    started = time.perf_counter()
    dev = resolve_device(device)
    warmup = 2 if warmup is None else warmup
    inputs = on_device(tuple(inputs), dev)
    members = members_on(list(members), dev)
    ticks = _Ticks(progress, len(plan.stages) + 1 + (2 if baselines else 0) + (1 if baselines and compile_baseline else 0)
                   + (1 if trace_path else 0))
    candidates: dict[str, list[StrategyResult]] = {}
    if autotune:
        from executor.autotune import tune

        plan, candidates = tune(plan, members, inputs, device=dev, progress=ticks.nested("autotune"), repeats=repeats, warmup=warmup)
    example = member_inputs(plan, inputs, 0)
    module = build(plan, members, example_inputs=example, device=dev)
    flops = stage_flops(plan, members[0], example)
    env = module._bind_inputs(inputs)
    with torch.no_grad():
        stages = [_profile_stage(program, runner, env, dev, repeats, warmup, ticks, flops.get(program.stage.id, 0),
                                 candidates.get(program.stage.id, []))
                  for program, runner in zip(module.programs, module.runners)]
        whole_results = _profile_whole(plan, module, members, inputs, dev, stages, repeats, warmup, ticks,
                                       baselines=baselines, compile_baseline=compile_baseline, floor=floor)
        end_to_end = whole_results.pop("stagewise")
        trace_file = None
        if trace_path:
            ticks("chrome trace")
            trace_file = write_chrome_trace(module, inputs, trace_path, dev)
    ticks.finish()
    compile_total = (sum(c.compile_s for cs in candidates.values() for c in cs) + sum(s.result.compile_s for s in stages)
                     + sum(r.compile_s for r in whole_results.values()))
    notes = []
    if dev.type == "cpu":
        notes.append("peak MB on CPU: peak live bytes of torch's CPU allocator during one call, above the level before it")
    return ProfileReport(
        model=plan.model, fingerprint=plan.fingerprint, n_members=plan.n_members, device=str(dev), device_name=_device_name(dev),
        torch_version=torch.__version__, threads=torch.get_num_threads(), stages=stages, end_to_end=end_to_end,
        baselines=list(whole_results.values()), warmup=warmup, autotuned=autotune, plan=plan.to_json(),
        trace_path=trace_file, profile_s=time.perf_counter() - started, compile_s=compile_total, notes=notes,
    )


class _Ticks:
    """Progress reporting: `ticks(label)` before each measurement; nested() for autotune's own steps."""

    def __init__(self, progress: Progress, steps: int):
        self.progress, self.steps, self.done = progress, steps, 0

    def __call__(self, label: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.steps, label)
        self.done += 1

    def nested(self, prefix: str) -> Callable[[int, int, str], None]:
        """A progress callback for a sub-task whose steps come before this one's remaining ones."""
        base, own = self.done, self.steps - self.done

        def report(done: int, total: int, label: str) -> None:
            self.steps = base + total + own
            self.done = base + done
            if self.progress is not None:
                self.progress(self.done, self.steps, f"{prefix} {label}")

        return report

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(self.steps, self.steps, "done")


def _profile_stage(program: StageProgram, runner: Runner, env: dict, dev: torch.device, repeats: Optional[int], warmup: int,
                   ticks: _Ticks, flops: int, candidates: list[StrategyResult]) -> StageProfile:
    """One stage's strategy and its member loop on the stage's real inputs; puts its outputs into `env`."""
    stage, n = program.stage, runner.n_members
    strategy = stage.options.strategy
    label = strategy_label(strategy, stage.options.chunk_size)
    ticks(f"stage {stage.id} ({label})")
    fresh = stage_inputs(program, env, n)
    reference = LoopRunner(program, n, runner.stacked, runner.member_states)  # the trusted reference
    ref = reference(fresh())
    check = stage_check(ref, n)
    res, call, out = try_strategy(label, stage.id, lambda: (lambda: runner(fresh())), check, dev)
    res.chunk_size = stage.options.chunk_size if strategy is Strategy.VMAP else None
    cands = {label: (res, call)} if call is not None else {}
    if label == "loop":
        loop_res = res
    else:  # the stage's own loop strategy on the same inputs, for the speedup column
        loop_res, loop_call, _ = try_strategy(
            "loop", stage.id, lambda: (lambda r=make_runner(program, runner, Strategy.LOOP): r(fresh())), check, dev)
        if loop_call is not None:
            cands["loop"] = (loop_res, loop_call)
    time_candidates(cands, dev, repeats, warmup, {label} if strategy in (Strategy.COMPILE, Strategy.CUDA_GRAPH) else set())
    if strategy is Strategy.COMPILE and res.ok:
        res.compile_s = getattr(runner, "compile_seconds", res.compile_s)
    # a failed strategy's consumers go on with the loop's outputs
    advance(program, env, fresh, out if res.ok else ref, runner if res.ok else reference)
    return StageProfile(id=stage.id, mode=stage.mode.value, strategy=label, nodes=list(stage.nodes), flops=flops,
                        result=res, loop=loop_res, candidates=candidates, note=stage.options.note)


def _profile_whole(plan: Plan, module: BatchedModule, members: list, inputs: tuple, dev: torch.device,
                   stages: list[StageProfile], repeats: Optional[int], warmup: int, ticks: _Ticks, *,
                   baselines: bool, compile_baseline: bool, floor: bool) -> dict[str, StrategyResult]:
    """The plan end to end ("stagewise") and the whole-model baselines, checked, then timed round-robin."""
    ticks("end to end and baselines")
    ref_out = whole.stack_outputs(whole.loop(plan, members, inputs)())
    builders: dict[str, Callable[[], Callable]] = {}
    if all(s.result.ok for s in stages):
        builders["stagewise"] = lambda: (lambda: module(*inputs))
    if baselines:
        builders["loop"] = lambda: whole.loop(plan, members, inputs)
        builders["vmap"] = lambda: whole.whole_vmap(plan, members, inputs, dev)
        if compile_baseline:
            builders["vmap+compile"] = lambda: whole.whole_vmap_compiled(plan, members, inputs, dev)
    if floor:
        builders["floor"] = lambda: whole.floor(plan, members, inputs)
    results: dict[str, StrategyResult] = {}
    working: dict[str, tuple[StrategyResult, Callable]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's slow-fallback warnings: the timing shows what they mean
        for name, make in builders.items():
            if name in ("vmap", "vmap+compile"):
                ticks(f"baseline {name}")
            check = None if name in ("loop", "floor") else (lambda out: max_rel_error(out, ref_out))
            res, call, _ = try_strategy(name, "whole", make, check, dev)
            if name == "loop" and res.ok:
                res.max_rel_err = 0.0  # the reference itself
            results[name] = res
            if call is not None:
                working[name] = (res, call)
        time_candidates(working, dev, repeats, warmup, {"vmap+compile"})
    if baselines:
        ticks("baselines done")
    if "stagewise" not in results:
        failed = "; ".join(f"{s.id}: {s.result.error}" for s in stages if not s.result.ok)
        results["stagewise"] = StrategyResult("stagewise", ok=False, error=f"a stage failed: {failed}")
    return results
