"""executor.profile: time a plan stage by stage, check every stage against the member loop,
and time the whole-model baselines on the same inputs in the same run.

Per stage: the plan's strategy and the member loop run on the same stage inputs
(the outputs of the stages before it); the strategy's outputs are compared with
the loop's (normwise, worst member), then timed (median and spread after
warm-up), with peak memory and FLOP/s. A stage whose strategy fails (an
exception, out of memory, a wrong result) is marked failed and the profile goes
on with the loop's outputs. End to end and the baselines are timed round-robin.

State: the caller's members are never run. The profile runs private copies
(candidates.private_members, made once per call and handed on to autotune), and
a forward that updates buffers (BatchNorm in training mode, a call counter)
moves the state on every run, so the batched module's state is saved once
(SavedTensors) and put back before each checked run: every stage's strategy,
its loop, the plan end to end and each baseline are checked from the state the
loop reference started from.
"""
from __future__ import annotations

import copy
import os
import platform
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from stagewise.planner.errors import StagewiseError
from stagewise.planner.graph import trace
from stagewise.planner.plan import Plan, Strategy
from stagewise.executor import baselines as whole
from stagewise.executor.autotune import tune
from stagewise.executor.build import BatchedModule, build, resolve_device, tf32_scope
from stagewise.executor.candidates import (Progress, SavedTensors, advance, make_runner, loop_reference, max_rel_error,
                                           member_tensors, on_device, private_members, stage_inputs, state_kept, strategy_label,
                                           time_candidates, try_strategy)
from stagewise.executor.input_writes import FreshInputs
from stagewise.executor.report import ProfileReport, StageProfile, StrategyResult
from stagewise.executor.stages import Runner, StageProgram
from stagewise.executor.timing import Prepared, keeps_random_state, native_stderr_silenced
from stagewise.executor.verify import (DEFAULT_RTOL, counting_draws, default_rtol, draw_order_note, fresh as copy_inputs,
                                       member_inputs, members_rtol, same_draws)


# --- the profile ---------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo (platform's guess elsewhere)."""
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



def stage_flops(plan: Plan, member: nn.Module, example: tuple) -> dict[str, int]:
    """FLOPs of each stage for all members (the trace's per-node counts x N); zeros if tracing fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(member, example, probe=False, open_modules=plan.opened_modules)
    except StagewiseError:
        return {s.id: 0 for s in plan.stages}
    return {s.id: sum(int(graph.dag.nodes[n].get("flops", 0)) for n in s.nodes if n in graph.dag) * plan.n_members
            for s in plan.stages}


def _labelled(runner: Runner, label: str) -> Runner:
    """A shallow copy of `runner` whose run is inside a torch.profiler record_function label (for chrome traces).
    A copy of its own class, not a wrapper: the module asks its runners for more than a call (device_for, whether a
    stage that writes in place is a LoopRunner), and a wrapper answered otherwise (a writing stage crashed the trace)."""
    twin = copy.copy(runner)
    run = runner.run

    def labelled_run(args: list) -> list:
        with torch.profiler.record_function(label):
            return run(args)

    object.__setattr__(twin, "run", labelled_run)
    return twin


def write_chrome_trace(module: BatchedModule, inputs: tuple, path: str, device: torch.device,
                       step: Optional[Callable[[], Any]] = None) -> str:
    """Run the plan twice under torch.profiler, one record_function label per stage; write a chrome trace.
    `step`: what to run instead of module(*inputs) (a training step that calls the module; a timing.Prepared one
    has its preparation outside the labelled step). Where forward() writes its inputs in place, each forward runs on
    a copy of `inputs` made outside the label (the caller's tensors are never written)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    saved = module.runners
    module.runners = [_labelled(r, f"stage {p.stage.id} [{p.stage.options.strategy.value}]")
                      for p, r in zip(module.programs, saved)]
    try:
        with native_stderr_silenced(), torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                if isinstance(step, Prepared):
                    step.prepare()
                args = copy_inputs(inputs) if step is None and module.__dict__.get("_written_inputs") else inputs
                with torch.profiler.record_function("stagewise forward" if step is None else "stagewise training step"):
                    module(*args) if step is None else step.call() if isinstance(step, Prepared) else step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        prof.export_chrome_trace(path)
    finally:
        module.runners = saved
    return path


@keeps_random_state
def profile(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
            repeats: Optional[int] = None, warmup: Optional[int] = None, baselines: bool = True,
            compile_baseline: bool = False, trace_path: Optional[str] = None, progress: Progress = None,
            autotune: bool = False, floor: bool = False, train: bool = False, optimizer: str = "adam",
            lr: float = 1e-3, budget: str = "default") -> ProfileReport:
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
        budget: how much autotune measures: "default", "quick" (fewer samples, no torch.compile)
            or "thorough" (every candidate timed in full); see executor.autotune.
        floor: also time one member on N x the batch (benchmarks; assumes dim 0 is the batch axis).
        train: profile a training step instead of a forward (executor.profile_train): forward +
            backward + optimizer step end to end for the plan (stacked optimizer), the member loop
            (N torch.optim optimizers) and the torch.func recipe (vmap(grad) + one foreach step);
            per stage forward + backward. compile_baseline and floor are forward-only and ignored.
        optimizer, lr: with train, "adam" (default) or "sgd" (momentum 0.9), and the learning rate.
    Returns:
        ProfileReport (JSON round trip with to_json/from_json, text table with to_text).
    Raises:
        DeviceError, MemberError, PlanMismatchError, InputError as executor.build does; MemberError
        for a member that cannot be deep-copied.
    Side effects: none on `members`: the profile runs private copies of them (one copy of their
    state for the call), so buffers a forward updates, BatchNorm statistics included, stay as they were.
    None on `inputs`: a forward() that writes its inputs in place runs on copies of them (input_writes.FreshInputs).
    """
    warmup = 2 if warmup is None else warmup
    if train:
        from stagewise.executor.profile_train import profile_training  # imports this module

        return profile_training(plan, members, inputs, device=device, repeats=repeats, warmup=warmup, baselines=baselines,
                                progress=progress, autotune=autotune, optimizer=optimizer, lr=lr, trace_path=trace_path,
                                budget=budget)
    started = time.perf_counter()
    dev = resolve_device(device)
    inputs = on_device(tuple(inputs), dev)
    members = private_members(members, dev, "profile")  # the caller's modules are never run
    ticks = Ticks(progress, len(plan.stages) + 1 + (2 if baselines else 0) + (1 if baselines and compile_baseline else 0)
                   + (1 if trace_path else 0))
    candidates: dict[str, list[StrategyResult]] = {}
    if autotune:
        plan, candidates = tune(plan, members, inputs, device=dev, progress=ticks.nested("autotune"), repeats=repeats, warmup=warmup,
                                budget=budget)
    example = member_inputs(plan, inputs, 0)
    module = build(plan, members, example_inputs=example, device=dev)
    with state_kept(members[:1]):  # a torch.export trace may run forward
        flops = stage_flops(plan, members[0], example)
    env = module.bind_inputs(inputs)
    start = SavedTensors(module.stacked_state.values())  # every check starts from the state the loop starts from
    with torch.no_grad(), tf32_scope(plan.dtype, dev):
        loops = module.number_loops  # after bind_inputs: a container input's numbers are known there
        stages = [_profile_stage(program, runner, env, dev, repeats, warmup, ticks, flops.get(program.stage.id, 0),
                                 candidates.get(program.stage.id, []), default_rtol(plan, members), start,
                                 loops.get(program.stage.id, ()))
                  for program, runner in zip(module.programs, module.runners)]
        start.restore()  # the stages' runs moved it; the end-to-end check runs the whole plan from the start
        del start
        unchecked: list[str] = []
        whole_results = _profile_whole(plan, module, members, inputs, dev, stages, repeats, warmup, ticks,
                                       baselines=baselines, compile_baseline=compile_baseline, floor=floor, notes=unchecked)
        end_to_end = whole_results.pop("stagewise")
        captured = module.__dict__.get("_captured")  # plan.capture: how the end-to-end calls replayed
        capture = captured.layout() if captured is not None and captured.captures else None
        trace_file = None
        if trace_path:
            ticks("chrome trace")
            trace_file = write_chrome_trace(module, inputs, trace_path, dev)
    ticks.finish()
    compile_total = (sum(c.compile_s for cs in candidates.values() for c in cs) + sum(s.result.compile_s for s in stages)
                     + sum(r.compile_s for r in whole_results.values()))
    notes = list(unchecked)
    if dev.type == "cpu":
        notes.append("peak MB on CPU: peak live bytes of torch's CPU allocator during one call, above the level before it")
    return ProfileReport(
        model=plan.model, fingerprint=plan.fingerprint, n_members=plan.n_members, device=str(dev), device_name=device_name(dev),
        torch_version=torch.__version__, threads=torch.get_num_threads(), stages=stages, end_to_end=end_to_end,
        baselines=list(whole_results.values()), warmup=warmup, autotuned=autotune, plan=plan.to_json(),
        trace_path=trace_file, profile_s=time.perf_counter() - started, compile_s=compile_total, notes=notes,
        capture=capture,
    )


class Ticks:
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
                   ticks: Ticks, flops: int, candidates: list[StrategyResult], rtol: float = DEFAULT_RTOL,
                   start: Optional[SavedTensors] = None, number_loop: tuple[str, ...] = ()) -> StageProfile:
    """One stage's strategy and its member loop on the stage's real inputs; puts its outputs into `env`.
    `start`: the module's state before any run; the stage's part of it is put back before the loop
    reference and before each candidate, so that a forward updating buffers is checked from one state.
    `number_loop`: what makes the module run this stage as the member loop whatever its strategy (an op taking a
    per_member Python number, BatchedModule.number_loops): profiled as the loop it runs, said in its note."""
    stage, n = program.stage, runner.n_members
    strategy = Strategy.LOOP if number_loop else stage.options.strategy
    label = strategy_label(strategy, stage.options.chunk_size)
    ticks(f"stage {stage.id} ({label})")
    fresh = stage_inputs(program, env, n)
    own = list(runner.stacked.values())
    reset = (lambda: start.restore(own)) if start is not None else (lambda: None)
    reset()
    reference, ref, check = loop_reference(program, runner, fresh)

    def from_start(run: Callable[[], Callable[[], Any]]) -> Callable[[], Callable[[], Any]]:
        def make():
            reset()
            return run()
        return make

    res, call, out = try_strategy(label, stage.id, from_start(lambda: fresh.timed(runner)), check, dev, rtol=rtol)
    res.chunk_size = stage.options.chunk_size if strategy is Strategy.VMAP else None
    cands = {label: (res, call)} if call is not None else {}
    if label == "loop":
        loop_res = res
    else:  # the stage's own loop strategy on the same inputs, for the speedup column
        loop_res, loop_call, _ = try_strategy(
            "loop", stage.id, from_start(lambda: fresh.timed(make_runner(program, runner, Strategy.LOOP))), check, dev,
            rtol=rtol)
        if loop_call is not None:
            cands["loop"] = (loop_res, loop_call)
    time_candidates(cands, dev, repeats, warmup, {label} if strategy in (Strategy.COMPILE, Strategy.CUDA_GRAPH) else set())
    if res.ok and res.peak_mem_bytes is not None:  # a cuda_graph stage's pool, taken at capture, is in use at every call
        res.peak_mem_bytes += getattr(runner, "graph_pool_bytes", 0)
    if strategy is Strategy.COMPILE and res.ok:
        res.compile_s = getattr(runner, "compile_seconds", res.compile_s)
    # a failed strategy's consumers go on with the loop's outputs
    advance(program, env, fresh, out if res.ok else ref, runner if res.ok else reference)
    return StageProfile(id=stage.id, mode=stage.mode.value, strategy=label, nodes=list(stage.nodes), flops=flops,
                        result=res, loop=loop_res, candidates=candidates, note=number_loop_note(stage.options.note, number_loop))


def number_loop_note(note: str, number_loop: tuple[str, ...]) -> str:
    """A stage's note, with why it runs as the member loop whatever its strategy (BatchedModule.number_loops), if so."""
    if not number_loop:
        return note
    why = (f"runs as the member loop: an op takes a per_member Python number ({'; '.join(number_loop)}), which one "
           "batched call cannot give each member")
    return f"{note}; {why}" if note else why


def _profile_whole(plan: Plan, module: BatchedModule, members: list, inputs: tuple, dev: torch.device,
                   stages: list[StageProfile], repeats: Optional[int], warmup: int, ticks: Ticks, *,
                   baselines: bool, compile_baseline: bool, floor: bool,
                   notes: list[str] | None = None) -> dict[str, StrategyResult]:
    """The plan end to end ("stagewise") and the whole-model baselines, checked, then timed round-robin.
    `module` is at the state the members (profile's copies) hold; the members are put back there before
    each baseline is built and checked, since the loop reference and the loop baseline move them.
    Where forward() writes its inputs in place, every run (checked, warm-up, timed) of the plan and of each baseline
    is on private copies of `inputs` refilled with the caller's values before it, outside the timed call
    (FreshInputs.timed): the caller's tensors are never written, each run sees the values the reference saw, and the
    times are the calls' alone, without the copy."""
    ticks("end to end and baselines")
    fresh = FreshInputs(inputs, bool(module.__dict__.get("_written_inputs")))
    work = fresh.values
    kept = SavedTensors(member_tensors(members))
    with same_draws(0):  # the random state try_strategy checks each candidate from
        ref_out = whole.stack_outputs(whole.loop(plan, members, copy_inputs(inputs))())
    drawn: list[str] = []
    own = SavedTensors(module.stacked_state.values())
    with torch.no_grad(), same_draws(0):
        module.run_stages(*copy_inputs(inputs), run=counting_draws(module, drawn))
    if len(drawn) > 1 and notes is not None:  # the plan end to end is timed, not compared: said
        notes.append("end to end not compared with the member loop: " + draw_order_note(drawn))
    own.restore()
    builders: dict[str, Callable[[], Callable]] = {}
    if all(s.result.ok for s in stages):
        builders["stagewise"] = lambda: fresh.timed(lambda: module(*work))
    if baselines:
        builders["loop"] = lambda: fresh.timed(whole.loop(plan, members, work))
        builders["vmap"] = lambda: fresh.timed(whole.whole_vmap(plan, members, work, dev))
        if compile_baseline:
            builders["vmap+compile"] = lambda: fresh.timed(whole.whole_vmap_compiled(plan, members, work, dev))
    if floor:
        flat = FreshInputs(inputs, fresh.written, contiguous=True)  # the floor's [N * B, ...] batch views these copies
        builders["floor"] = lambda: flat.timed(whole.floor(plan, members, flat.values))
    results: dict[str, StrategyResult] = {}
    working: dict[str, tuple[StrategyResult, Callable]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's slow-fallback warnings: the timing shows what they mean
        for name, make in builders.items():
            if name in ("vmap", "vmap+compile"):
                ticks(f"baseline {name}")
            check = None if name in ("loop", "floor") or (name == "stagewise" and len(drawn) > 1) else \
                (lambda out: max_rel_error(out, ref_out))  # several drawing stages: see verify.draw_order_note
            rtol = default_rtol(plan, members) if name == "stagewise" else members_rtol(members)  # baselines: the members' precision
            res, call, _ = try_strategy(name, "whole", lambda make=make: (kept.restore(), make())[1], check, dev, rtol=rtol)
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
