"""executor.autotune: pick each stage's fastest strategy that matches the member loop.

Stages are tuned in order; each candidate runs on the stage's real inputs (the
outputs of the strategies already chosen upstream, so conversion costs such as
stacking a loop's per-member outputs land on the stage that pays them). Every
candidate is first checked against the member loop of that stage (normwise,
worst member, rtol 1e-4): failures, out-of-memory and wrong results are
recorded and never chosen. The working candidates are timed round-robin and the
fastest by minimum time wins (the minimum is the estimate least disturbed by
other processes; medians are reported too). The measured times go into each
stage's `options.note`.

Candidates: batched stages try vmap, wide, loop, compile (skipped for stages
under COMPILE_MIN_MS, where it cannot pay) and cuda_graph on CUDA; vmap that
runs out of memory is retried with chunk_size N/2, N/4, ... Excluded stages try
loop and, where every node has a hand-batched rule, wide (this is how
scaled_dot_product_attention and nn.GRU, which have no vmap batching rule on
CPU, still run batched).

The planner cannot import the executor, so autotuning lives here:
`executor.autotune(plan, members, inputs)` (or `executor.profile(..., autotune=True)`),
not `planner.propose(..., autotune=True)`.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from stagewise.planner.errors import ExecutionError
from stagewise.planner.graph import retrace
from stagewise.planner.plan import Plan, Stage, StageMode, StageOptions, Strategy
from stagewise.executor.build import build, resolve_device
from stagewise.executor.candidates import (Progress, advance, make_runner, loop_reference, max_rel_error, members_on, on_device,
                                 stage_inputs, strategy_label, time_candidates, try_strategy)
from stagewise.executor.report import StrategyResult
from stagewise.executor.stages import Runner, StageProgram
from stagewise.executor.strategies import wide_rule_gaps
from stagewise.executor.timing import MIN_REPEATS
from stagewise.executor.verify import DEFAULT_RTOL, DTYPE_RTOL, loop_outputs, member_inputs
from stagewise.executor.baselines import stack_outputs

COMPILE_MIN_MS = 0.1  # below this a stage is all launch overhead; compiling it costs seconds for nothing
CLOSE = 0.05  # two candidates this close (relative) are timed again head to head
EAGER = (Strategy.VMAP, Strategy.WIDE, Strategy.LOOP)


def vmap_falls_back(stage: Stage) -> bool:
    """Excluded only because vmap would run an op through its slow per-member fallback.

    Such a stage is still correct under vmap, and torch.compile may decompose the op
    into batchable pieces, so `compile` is worth a try (checked against the loop).
    """
    return stage.mode is StageMode.EXCLUDED and "slow per-member loop" in stage.reason


def candidate_strategies(program: StageProgram, device: torch.device, allowed: Optional[set[Strategy]] = None) -> list[Strategy]:
    """Strategies worth trying for this stage on `device`, eager ones first."""
    if program.stage.mode is StageMode.EXCLUDED:
        found = [Strategy.LOOP] + ([Strategy.WIDE] if not wide_rule_gaps(program) else [])
        found += [Strategy.COMPILE] if vmap_falls_back(program.stage) else []
    else:
        found = [Strategy.VMAP, Strategy.WIDE, Strategy.LOOP, Strategy.COMPILE]
        if device.type == "cuda":
            found.append(Strategy.CUDA_GRAPH)
    return [s for s in found if allowed is None or s in allowed]


def _measured(results: list[StrategyResult], unit: str = "") -> str:
    """'wide 1.1/1.2 ms, vmap 1.9/2.0 ms +0.4s compile; loop failed (...)': fastest first, min/median."""
    ok = sorted((r for r in results if r.ok and r.time), key=lambda r: r.time.min_ms)
    parts = [f"{r.strategy} {r.time.min_ms:.3g}/{r.time.median_ms:.3g}{unit}"
             + (f" +{r.compile_s:.1f}s compile" if r.compile_s >= 0.05 else "") for r in ok]
    failed = [f"{r.strategy} failed ({r.error[:80]})" for r in results if not r.ok]
    return ", ".join(parts) + "".join(f"; {f}" for f in failed)


def _note(results: list[StrategyResult], chosen: StrategyResult) -> str:
    return f"autotune chose {chosen.strategy} (min/median ms): " + _measured(results, " ms")


def _tune_stage(program: StageProgram, runner: Runner, fresh: Callable[[], list], n: int, device: torch.device,
                allowed: Optional[set[Strategy]], repeats: Optional[int], warmup: int,
                progress: Progress, done: int, total: int, rtol: float = DEFAULT_RTOL) -> tuple[list[StrategyResult], StrategyResult, Any, Runner]:
    """Every candidate of one stage on its real inputs; returns (results, chosen, its outputs, its runner)."""
    stage = program.stage
    reference, ref, check = loop_reference(program, runner, fresh)
    results: list[StrategyResult] = []
    working: dict[str, tuple[StrategyResult, Any]] = {}
    outputs: dict[str, Any] = {}
    runners: dict[str, Runner] = {}

    def attempt(strategy: Strategy, chunk: Optional[int] = None) -> StrategyResult:
        label = strategy_label(strategy, chunk)
        if progress is not None:
            progress(done, total, f"{stage.id}: {label}")

        def make():
            r = make_runner(program, runner, strategy, chunk)
            runners[label] = r
            return lambda: r(fresh())

        res, call, out = try_strategy(label, stage.id, make, check, device, rtol=rtol)
        res.chunk_size = chunk
        results.append(res)
        if call is not None:
            working[label], outputs[label] = (res, call), out
        return res

    candidates = candidate_strategies(program, device, allowed)
    for strategy in [s for s in candidates if s in EAGER]:
        res = attempt(strategy)
        if strategy is Strategy.VMAP and not res.ok and is_oom_text(res.error):
            chunk = n // 2
            while chunk >= 1 and not attempt(Strategy.VMAP, chunk).ok:
                chunk //= 2
    time_candidates(working, device, repeats, warmup, set())
    best_eager = min((r.time.min_ms for r, _ in working.values() if r.ok and r.time), default=math.inf)
    slow = [s for s in candidates if s not in EAGER]
    if slow and best_eager < COMPILE_MIN_MS:
        for s in slow:
            results.append(StrategyResult(s.value, ok=False, error=f"not tried: the stage takes {best_eager:.3f} ms, under {COMPILE_MIN_MS} ms"))
        slow = []
    late: dict[str, tuple[StrategyResult, Any]] = {}
    for strategy in slow:
        before = set(working)
        attempt(strategy)
        late.update({k: v for k, v in working.items() if k not in before})
    if late:  # re-time everything that works in one round-robin, so load changes between rounds cannot decide
        time_candidates({k: v for k, v in working.items() if v[0].ok}, device, repeats, warmup, set(late))
        for label, (res, _) in late.items():
            res.compile_s = getattr(runners.get(label), "compile_seconds", res.compile_s) if label == "compile" else res.compile_s
    chosen = _fastest(results, working, device, repeats, warmup)
    if chosen is None:  # even the loop failed (e.g. injected faults everywhere): keep the loop's outputs
        return results, StrategyResult("loop", ok=False, error="no strategy worked"), ref, reference
    return results, chosen, outputs[chosen.strategy], runners[chosen.strategy]


def _fastest(results: list[StrategyResult], calls: dict[str, tuple[StrategyResult, Any]], device: torch.device,
             repeats: Optional[int], warmup: int) -> Optional[StrategyResult]:
    """The working candidate with the lowest minimum time. When the best two are within CLOSE of
    each other they are timed again, head to head with twice the samples, before deciding."""
    ok = sorted((r for r in results if r.ok and r.time), key=lambda r: r.time.min_ms)
    if len(ok) >= 2 and ok[1].time.min_ms <= ok[0].time.min_ms * (1 + CLOSE):
        pair = {r.strategy: calls[r.strategy] for r in ok[:2] if r.strategy in calls}
        kept = {label: res.compile_s for label, (res, _) in pair.items()}
        time_candidates(pair, device, 2 * (repeats or MIN_REPEATS), warmup, set())
        for label, (res, _) in pair.items():
            res.compile_s = kept[label]  # one-time costs were measured the first time
        ok = sorted((r for r in results if r.ok and r.time), key=lambda r: r.time.min_ms)
    return ok[0] if ok else None


def is_oom_text(error: str) -> bool:
    return error.startswith("out of memory")


def tuning_start(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], dev: torch.device,
                 allowed: Optional[set[Strategy]]) -> tuple[tuple, list[nn.Module], Any, dict, int]:
    """(inputs and members on `dev`, the plan's batched module, its bound inputs, the number of candidates)."""
    inputs = on_device(tuple(inputs), dev)
    members = members_on(list(members), dev)
    module = build(plan, members, example_inputs=member_inputs(plan, inputs, 0), device=dev)
    total = sum(len(candidate_strategies(p, dev, allowed)) for p in module.programs)
    return inputs, members, module, module.bind_inputs(inputs), total


def tune(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
         progress: Progress = None, repeats: Optional[int] = None, warmup: int = 2,
         strategies: Optional[Sequence[str | Strategy]] = None) -> tuple[Plan, dict[str, list[StrategyResult]]]:
    """autotune, also returning the measured candidates: stage id of the tuned plan -> results.

    When merging all stages into one won, "s0" holds the whole-plan candidates
    ("per-stage", "merged/compile", ...) and "per-stage s<k>" each original stage's.
    """
    dev = resolve_device(device)
    n = plan.n_members
    allowed = {Strategy(s) for s in strategies} if strategies is not None else None
    inputs, members, module, env, total = tuning_start(plan, members, inputs, dev, allowed)
    done = 0
    tuned: list[Stage] = []
    found: dict[str, list[StrategyResult]] = {}
    with torch.no_grad():
        for program, runner in zip(module.programs, module.runners):
            fresh = stage_inputs(program, env, n)
            results, chosen, out, chosen_runner = _tune_stage(program, runner, fresh, n, dev, allowed, repeats, warmup,
                                                              progress, done, total, DTYPE_RTOL[plan.dtype])
            done += len(candidate_strategies(program, dev, allowed))
            found[program.stage.id] = results
            advance(program, env, fresh, out, chosen_runner)
            stage = program.stage
            if not chosen.ok:
                tuned.append(stage)
                continue
            strategy = Strategy(chosen.strategy.split("/")[0])
            tuned.append(replace(stage, options=StageOptions(strategy=strategy, chunk_size=chosen.chunk_size,
                                                             note=_note(results, chosen))))
    per_stage = plan.with_stages(tuned)
    if progress is not None:
        progress(total, total, "comparing with one merged stage")
    with torch.no_grad():
        best, merged_results = _best_of_merged(per_stage, members, inputs, dev, allowed, repeats, warmup)
    if merged_results is not None:  # one merged stage won: its candidates are whole plans
        found = {"s0": merged_results, **{f"per-stage {k}": v for k, v in found.items()}}
    _check_end_to_end(best, members, inputs, dev)
    return best, found


def merged_alternatives(plan: Plan, graph_order: list[str], allowed: Optional[set[Strategy]]) -> list[Plan]:
    """The whole model as one stage, with each strategy that could run it.

    Per-stage choices cannot see what fusing across stage boundaries gains (one
    compiled graph instead of several) or what boundaries cost; these
    alternatives let the end-to-end measurement decide. They include the plain
    member loop, so a tuned plan is never knowingly slower than not batching.
    """
    if len(plan.stages) < 2:
        return []  # one stage: its own candidates already were these
    order = {n: i for i, n in enumerate(graph_order)}
    nodes = tuple(sorted((n for s in plan.stages for n in s.nodes), key=lambda n: order.get(n, len(order))))
    excluded = [s for s in plan.stages if s.mode is StageMode.EXCLUDED]
    mode = StageMode.EXCLUDED if excluded else StageMode.BATCHED
    reason = "; ".join(dict.fromkeys(s.reason for s in excluded))
    compilable = all(vmap_falls_back(s) for s in excluded)
    widenable = all(vmap_falls_back(s) or s.options.strategy is Strategy.WIDE for s in excluded)
    strategies = (([Strategy.COMPILE] if compilable else []) + ([Strategy.WIDE] if widenable else [])
                  + ([Strategy.VMAP] if not excluded else []) + [Strategy.LOOP])
    out = []
    for strategy in strategies:
        if allowed is None or strategy in allowed:
            stage = Stage(id="s0", nodes=nodes, mode=mode, reason=reason, options=StageOptions(strategy=strategy))
            out.append(plan.with_stages([stage]))
    return out


def _best_of_merged(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device,
                    allowed: Optional[set[Strategy]], repeats: Optional[int], warmup: int) -> tuple[Plan, Optional[list[StrategyResult]]]:
    """The per-stage plan, or one merged stage if that is faster end to end and matches the loop.

    Returns (plan, the whole-plan candidates if the merged stage won, else None).
    """
    example = member_inputs(plan, inputs, 0)
    alternatives = merged_alternatives(plan, retrace(members[0], plan.tracer, example, opened=plan.opened_modules).node_names, allowed)
    if not alternatives:
        return plan, None
    want = stack_outputs(loop_outputs(plan, members, inputs))
    check = lambda out: max_rel_error(out, want)  # noqa: E731
    cands: dict[str, tuple[StrategyResult, Any]] = {}
    plans = {"per-stage": plan}
    results = []
    for label, p in [("per-stage", plan)] + [(f"merged/{a.stages[0].options.strategy.value}", a) for a in alternatives]:
        plans[label] = p
        make = lambda p=p: (lambda m: (lambda: m(*inputs)))(build(p, members, example_inputs=example, device=device))  # noqa: E731
        res, call, _ = try_strategy(label, "whole", make, check, device, rtol=DTYPE_RTOL[plan.dtype])
        results.append(res)
        if call is not None:
            cands[label] = (res, call)
    time_candidates(cands, device, repeats, warmup, {k for k in cands if k == "merged/compile"})
    chosen = _fastest(results, cands, device, repeats, warmup)
    if chosen is None:
        return plan, None
    summary = "; whole plan (min/median ms): " + _measured(results)
    best = plans[chosen.strategy]
    if chosen.strategy == "per-stage":
        return best.with_stages([replace(s, options=replace(s.options, note=s.options.note + summary)) for s in best.stages]), None
    (stage,) = best.stages
    note = f"autotune merged all stages and chose {stage.options.strategy.value}" + summary
    return best.with_stages([replace(stage, options=replace(stage.options, note=note))]), results


def _check_end_to_end(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device) -> None:
    """The tuned plan as a whole must match the member loop (each stage already did)."""
    module = build(plan, members, example_inputs=member_inputs(plan, inputs, 0), device=device)
    with torch.no_grad():
        got = module(*inputs)
    want = stack_outputs(loop_outputs(plan, members, inputs))
    err = max_rel_error(got, want)
    if not err <= DTYPE_RTOL[plan.dtype]:
        raise ExecutionError(f"autotune: the tuned plan differs from the member loop (max rel err {err:.2e}) although each stage matched; "
                             "profile the plan with its default strategies and report this")


def autotune(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
             progress: Progress = None, repeats: Optional[int] = None,
             strategies: Optional[Sequence[str | Strategy]] = None, train: bool = False) -> Plan:
    """Choose each stage's fastest strategy that matches the member loop.

    Args:
        plan, members: as for executor.build.
        inputs: the batched module's inputs (shared as-is, per_member [N, ...]).
        device: "cpu" or "cuda" (DeviceError without CUDA).
        progress: callable(done, total, label) while measuring.
        repeats: timed samples per candidate (default: enough for ~0.25 s).
        strategies: restrict the candidates (e.g. ["vmap", "wide", "loop"] to skip compile).
        train: choose by forward + backward time among strategies that carry gradients, each
            candidate's gradients checked against the loop's (executor.autotune_train).
    Returns:
        A new Plan: each stage's options.strategy/chunk_size set to the winner and
        options.note holding the measured times of every candidate.
    """
    if train:
        # imported here: autotune_train builds on this module's helpers (a module-level import would be a cycle)
        from stagewise.executor.autotune_train import tune_training

        return tune_training(plan, members, inputs, device=device, progress=progress, repeats=repeats, strategies=strategies)[0]
    return tune(plan, members, inputs, device=device, progress=progress, repeats=repeats, strategies=strategies)[0]
