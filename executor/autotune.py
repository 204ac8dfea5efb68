"""executor.autotune: pick each stage's fastest strategy that matches the member loop.

Stages are tuned in order; each candidate runs on the stage's real inputs (the
outputs of the strategies already chosen upstream, so conversion costs such as
stacking a loop's per-member outputs land on the stage that pays them). Every
candidate is first checked against the member loop of that stage (normwise,
worst member, rtol 1e-4): failures, out-of-memory and wrong results are
recorded and never chosen. The working candidates then race (Budget): by
default all are timed briefly round-robin, those clearly slower than the best
(beyond CLOSE and the best's own spread) are dropped, and the survivors are
timed again with the full sample budget; the fastest by minimum time wins (the
minimum is the estimate least disturbed by other processes; medians are
reported too). The measured times go into each stage's `options.note`.

Candidates (stage_candidates): batched stages try vmap, wide, loop, compile
(skipped for stages under COMPILE_MIN_MS, where it cannot pay, and by the
"quick" budget) and cuda_graph on CUDA. On CUDA compile is tried in each
torch.compile mode (stage_compile_modes: "compile", then "compile/reduce-overhead",
and "compile/max-autotune-no-cudagraphs" where the budget asks for it, each checked
against the loop like any candidate, left out where the default mode failed);
the chosen mode is kept as a "[compile: mode=...]" tag in the stage's note, which
executor.build honours. On CPU compile runs in the default mode only (see
Budget.compile_modes). vmap that runs out of memory is retried with chunk_size
N/2, N/4, ... A stage with convolutions tries wide in each conv form
(wide_layers.CONV_FORMS: "wide" is the device's default form, "wide/conv=bmm"
etc. the others); the chosen form is recorded in the stage's options (a
"[wide: conv=...]" tag in the note), so the saved plan rebuilds it. Excluded
stages try loop and, where every node has a hand-batched rule, wide: this is how
scaled_dot_product_attention, nn.GRU and nn.LSTM (no vmap batching rule on
CPU), nn.MultiheadAttention and nn.TransformerEncoderLayer / TransformerEncoder
(which vmap runs only through its slow per-member fallback) still run batched.
A stage that runs as the member loop whatever its strategy, because an op in it
takes a per_member Python number (BatchedModule.number_loops, decided at build),
tries loop alone: the others are listed as not applicable, with that reason
(number_loop_refusal), and so are the merged alternatives other than merged/loop.
Finally the per-stage plan races the whole model as one stage (merged/compile,
merged/wide, merged/vmap, merged/loop; on a GPU also merged/compile/<mode> for the
torch.compile modes max-autotune-no-cudagraphs and reduce-overhead, the mode kept
as a "[compile: mode=...]" tag) and, where whole-plan capture can run (a
GPU), itself captured as CUDA graphs (plan.capture, "per-stage/whole-plan graph",
captured on redrawn inputs first so the checked call is a replay; a reduce-overhead
stage compiled in the default mode inside it), each built from its plan and
checked end to end.

Side effects: the caller's members are never run (autotune runs private copies),
and every candidate is checked from the state the loop reference started from (a
forward that updates buffers moves it on every run; candidates.SavedTensors puts
it back). The caller's inputs are never written: where forward() writes them in
place (`x.mul_(2)`), every checked, warm-up and timed call of a stage candidate
(candidates.StageInputs) and of a whole-plan candidate (input_writes.FreshInputs)
runs on private copies refilled with the caller's values before it, outside the
timed call, so each sees the values the loop reference saw and its time is the
call's alone.

The planner cannot import the executor, so autotuning lives here:
`executor.autotune(plan, members, inputs)` (or `executor.profile(..., autotune=True)`),
not `planner.propose(..., autotune=True)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from stagewise.planner.errors import ExecutionError
from stagewise.planner.graph import retrace
from stagewise.planner.plan import Plan, Stage, StageMode, StageOptions, Strategy
from stagewise.executor.build import BatchedModule, build, capture_backend, resolve_device, tf32_scope
from stagewise.executor.candidates import (Progress, SavedTensors, advance, compile_mode_of_label, conv_form_of_label, make_runner,
                                           loop_reference, max_rel_error, on_device, private_members, StageInputs, stage_inputs, state_kept,
                                           strategy_label, time_candidates, try_strategy)
from stagewise.executor.input_writes import FreshInputs
from stagewise.executor.report import StrategyResult
from stagewise.executor.stages import Runner, StageProgram
from stagewise.executor.strategies import wide_rule_gaps
from stagewise.executor.strategies.compiled import COMPILE_MODES, compile_mode_of, with_compile_mode
from stagewise.executor.strategies.wide import conv_form_of, wide_conv_forms, with_conv_form
from stagewise.executor.timing import MIN_REPEATS, SAMPLE_BUDGET_S, default_repeats, describe_error, keeps_random_state, peak_memory_bytes
from stagewise.executor.verify import (DEFAULT_RTOL, counting_draws, default_rtol, draw_order_note, fresh, loop_outputs,
                                       member_inputs, same_draws)
from stagewise.executor.baselines import stack_outputs

WHOLE_GRAPH = "per-stage/whole-plan graph"  # the whole-plan candidate: the tuned stages, captured (plan.capture)
# ... with the excluded stages that tuning left to the member loop run `wide` inside the graph: a wide recurrence
# is launch-bound eagerly (an H100 runs 16 cuDNN GRUs faster than 32 wide steps launched from Python) and wins
# once its launches are replayed from one graph
WHOLE_GRAPH_WIDE = "per-stage/whole-plan graph, excluded stages wide"
WHOLE_GRAPHS = (WHOLE_GRAPH, WHOLE_GRAPH_WIDE)
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


CUDA_COMPILE_MODES = ("", "reduce-overhead")  # tried on CUDA unless a budget says otherwise (see stage_compile_modes)


def stage_compile_modes(device: torch.device, budget: "Budget | None" = None) -> tuple[str, ...]:
    """The torch.compile modes autotune tries for a compile candidate on `device` ("" = torch's default first).

    CUDA: the default and reduce-overhead (CUDA graphs); max-autotune-no-cudagraphs (which autotunes GEMM/conv
    kernels: 17-65 s for one convolution stage on an H100, 2026-11-23) only where the budget asks for it
    (`Budget(compile_modes=COMPILE_MODES)`). CPU: the default only, unless `budget.compile_modes` asks for more (reduce-overhead
    never: it needs CUDA).
    """
    modes = budget.compile_modes if budget is not None and budget.compile_modes is not None else (
        CUDA_COMPILE_MODES if device.type == "cuda" else ("",))
    return tuple(m for m in modes if device.type == "cuda" or m != "reduce-overhead")


def stage_candidates(program: StageProgram, device: torch.device, allowed: Optional[set[Strategy]] = None,
                     budget: "Budget | None" = None) -> list[tuple[Strategy, str]]:
    """(strategy, compile mode) pairs a stage's race starts from on `device`: candidate_strategies with
    compile once per stage_compile_modes. Label each with strategy_label(strategy, None, compile_mode=mode).
    Nothing is run here; chunked vmap and wide's conv forms are added while racing, and the slow ones
    (compile, cuda_graph) are pruned by the stage's eager time and the budget (see _tune_stage)."""
    out = []
    for strategy in candidate_strategies(program, device, allowed):
        modes = stage_compile_modes(device, budget) if strategy is Strategy.COMPILE else ("",)
        out += [(strategy, mode) for mode in modes]
    return out


NOT_APPLICABLE = "not applicable: "  # the error of a candidate that cannot run the stage at all, so never tried


def number_loop_refusal(label: str, number_loop: tuple[str, ...]) -> StrategyResult:
    """The result of a batched candidate (`label`) for a stage that runs as the member loop whatever its strategy,
    because an op in it takes a per_member Python number (BatchedModule.number_loops, `number_loop` its words): one
    batched call hands such an op a tensor, so the candidate is not tried (vmap's raw refusal of .item() said nothing
    of why)."""
    return StrategyResult(label, ok=False, error=f"{NOT_APPLICABLE}the stage takes a per_member Python number "
                                                 f"({'; '.join(number_loop)}) where torch needs a Python number")


def _measured(results: list[StrategyResult], unit: str = "") -> str:
    """'wide 1.1/1.2 ms, vmap 1.9/2.0 ms +0.4s compile; loop failed (...)': fastest first, min/median. Candidates not
    applicable for one reason are named once with it ('vmap, wide not applicable: ...')."""
    ok = sorted((r for r in results if r.ok and r.time), key=lambda r: r.time.min_ms)
    parts = [f"{r.strategy} {r.time.min_ms:.3g}/{r.time.median_ms:.3g}{unit}"
             + (f" +{r.compile_s:.1f}s compile" if r.compile_s >= 0.05 else "") for r in ok]
    failed = [f"{r.strategy} failed ({r.error[:80]})" for r in results if not r.ok and not r.error.startswith(NOT_APPLICABLE)]
    why: dict[str, list[str]] = {}
    for r in results:
        if not r.ok and r.error.startswith(NOT_APPLICABLE):
            why.setdefault(r.error[len(NOT_APPLICABLE):], []).append(r.strategy)
    failed += [f"{', '.join(labels)} not applicable ({reason})" for reason, labels in why.items()]
    return ", ".join(parts) + "".join(f"; {f}" for f in failed)


def _note(results: list[StrategyResult], chosen: StrategyResult) -> str:
    return f"autotune chose {chosen.strategy} (min/median ms): " + _measured(results, " ms")


@dataclass(frozen=True)
class Budget:
    """How much measuring autotune spends; `autotune(budget=...)` takes one or a name of BUDGETS.

    With `prune` (successive halving) every working candidate is first timed briefly
    (`quick_repeats` samples, no memory measurement); those whose fastest sample is slower
    than both the best's minimum + CLOSE and the best's p90 (its slow samples: the measured
    spread) are dropped, and only the survivors are timed again with the full sample budget
    (`round_s` per candidate, the round cut at twice that when the machine is loaded). A single
    survivor is not timed again. Without `prune` every candidate gets the full budget (the
    behaviour before pruning existed). Every candidate is still run once and checked against
    the member loop before any timing: pruning only saves timing, never a check.
    """

    prune: bool = True
    quick_repeats: int = 3  # samples per candidate in a pruning round (3: the p90 is the slowest of three)
    round_s: float = SAMPLE_BUDGET_S  # a final round aims at this much wall time per candidate
    compile: bool = True  # try torch.compile candidates (seconds each: per stage and the merged model)
    # torch.compile modes tried wherever compile is (compiled.COMPILE_MODES; "" = torch's default). None: per device,
    # the default and reduce-overhead on CUDA (CUDA_COMPILE_MODES), the default only on CPU; max-autotune-no-cudagraphs
    # only when named here (it autotunes kernels for 10-65 s per stage). reduce-overhead is left out off CUDA whatever
    # this says.
    compile_modes: Optional[tuple[str, ...]] = None


BUDGETS = {
    "default": Budget(),
    "quick": Budget(quick_repeats=2, round_s=0.1, compile=False),  # seconds instead of minutes; no torch.compile
    "thorough": Budget(prune=False),  # every candidate timed in full, as before pruning
}


def budget_of(budget: "str | Budget | None") -> Budget:
    """The Budget for a name of BUDGETS (or a Budget); ExecutionError naming the known ones."""
    if budget is None:
        return BUDGETS["default"]
    if isinstance(budget, Budget):
        return budget
    if budget not in BUDGETS:
        raise ExecutionError(f"unknown autotune budget {budget!r}; use one of {', '.join(BUDGETS)} or an autotune.Budget")
    return BUDGETS[budget]


Cands = dict[str, tuple[StrategyResult, Any]]


def _timing_round(cands: Cands, device: torch.device, repeats: Optional[int], warmup: int, budget: Budget,
                  compiles: set[str], *, final: bool) -> None:
    """One round-robin over `cands`: brief (pruning) or full (`final`, or every round without pruning)."""
    if not cands:
        return
    if budget.prune and not final:
        quick = budget.quick_repeats if repeats is None else min(repeats, budget.quick_repeats)
        time_candidates(cands, device, quick, min(warmup, 1), compiles, memory=False)
        return
    if repeats is None and budget.prune:  # the brief round's times say how many samples fit the budget
        known = [r.time.min_ms / 1e3 for r, _ in cands.values() if r.time]
        repeats = default_repeats(sum(known), budget.round_s * len(cands)) if len(known) == len(cands) else None
    deadline = 2 * budget.round_s * len(cands) if budget.prune else None
    time_candidates(cands, device, repeats, warmup, compiles, memory=not budget.prune, deadline_s=deadline)


def _survivors(cands: Cands, budget: Budget) -> Cands:
    """The timed working candidates that may still win (all of them without pruning)."""
    timed = {k: v for k, v in cands.items() if v[0].ok and v[0].time}
    if not budget.prune or not timed:
        return timed
    best = min((r.time for r, _ in timed.values()), key=lambda t: t.min_ms)
    bar = max(best.min_ms * (1 + CLOSE), best.p90_ms)
    return {k: v for k, v in timed.items() if v[0].time.min_ms <= bar}


def race(cands: Cands, device: torch.device, repeats: Optional[int], warmup: int, budget: Budget,
         compiles: set[str] = frozenset(), timed: bool = False, pool: Optional[Cands] = None) -> Optional[StrategyResult]:
    """The fastest of `cands` (working, checked candidates) by successive halving (see Budget).

    `timed`: the candidates already had their brief round (autotune's eager ones did).
    `pool`: every working candidate, pruned ones too (default `cands`): where the winner fails
    when run again and no survivor is left, the race goes on among these.
    Returns None when none survives its timing.
    """
    pool = cands if pool is None else pool
    if not timed:
        _timing_round(cands, device, repeats, warmup, budget, set(compiles), final=False)
    alive = _survivors(cands, budget)
    if budget.prune and len(alive) > 1:
        _timing_round(alive, device, repeats, 1, budget, set(), final=True)
        alive = _survivors(alive, Budget(prune=False))
    while True:
        chosen = _fastest(alive, device, repeats, budget)
        if chosen is None or chosen.peak_mem_bytes is not None:
            return chosen
        try:  # pruned races measure the winner's memory alone
            chosen.peak_mem_bytes = peak_memory_bytes(alive[chosen.strategy][1], device)
            return chosen
        except Exception as e:  # it failed when run again (out of memory on a second buffer set): not a candidate after all
            chosen.ok, chosen.error = False, describe_error(e)
            del alive[chosen.strategy]
            alive = alive or _survivors(pool, budget)  # the pruned ones are back in the race (their brief times)


def _tune_stage(program: StageProgram, runner: Runner, fresh: StageInputs, n: int, device: torch.device,
                allowed: Optional[set[Strategy]], repeats: Optional[int], warmup: int,
                progress: Progress, done: int, total: int, rtol: float = DEFAULT_RTOL,
                budget: Budget = BUDGETS["default"],
                number_loop: tuple[str, ...] = ()) -> tuple[list[StrategyResult], StrategyResult, Any, Runner]:
    """Every candidate of one stage on its real inputs; returns (results, chosen, its outputs, its runner).

    Eager candidates are run, checked and timed briefly first; their best time decides
    whether the slow ones (compile, cuda_graph) are worth building; then the race (Budget).
    `number_loop`: what in the stage takes a per_member Python number (BatchedModule.number_loops): the stage runs as
    the member loop whatever its strategy, so only loop is tried, the others listed as not applicable.
    """
    stage = program.stage
    start = SavedTensors(runner.stacked.values())  # forward may update buffers: each candidate starts where the loop did
    reference, ref, check = loop_reference(program, runner, fresh)
    results: list[StrategyResult] = []
    working: Cands = {}
    outputs: dict[str, Any] = {}
    runners: dict[str, Runner] = {}

    def attempt(strategy: Strategy, chunk: Optional[int] = None, form: str = "", mode: str = "") -> StrategyResult:
        label = strategy_label(strategy, chunk, form, mode)
        if progress is not None:
            progress(done, total, f"{stage.id}: {label}")

        def make():
            start.restore()
            r = make_runner(program, runner, strategy, chunk, form, mode)
            runners[label] = r
            return fresh.timed(r)  # a stage writing its inputs: refilled copies, outside the timed call

        res, call, out = try_strategy(label, stage.id, make, check, device, rtol=rtol)
        res.chunk_size = chunk
        results.append(res)
        if call is not None:
            working[label], outputs[label] = (res, call), out
        return res

    candidates = stage_candidates(program, device, allowed, budget)
    if number_loop:
        results += [number_loop_refusal(strategy_label(s, None, compile_mode=m), number_loop)
                    for s, m in candidates if s is not Strategy.LOOP]
        candidates = [(s, m) for s, m in candidates if s is Strategy.LOOP]
    for strategy in [s for s, _ in candidates if s in EAGER]:
        res = attempt(strategy)
        if strategy is Strategy.VMAP and not res.ok and is_oom_text(res.error):
            chunk = n // 2
            while chunk >= 1 and not attempt(Strategy.VMAP, chunk).ok:
                chunk //= 2
        if strategy is Strategy.WIDE and res.ok:  # the stage's convolutions in each other form ("wide" is the default one)
            for form in wide_conv_forms(program, device)[1:]:
                attempt(Strategy.WIDE, form=form)
    _timing_round(dict(working), device, repeats, warmup, budget, set(), final=False)
    alive = _survivors(working, budget)
    best_eager = min((r.time.min_ms for r, _ in alive.values()), default=math.inf)
    slow = [(s, m) for s, m in candidates if s not in EAGER]
    label_of = lambda s, m: strategy_label(s, None, compile_mode=m)  # noqa: E731

    def skip(kept: list, why: str) -> list:
        results.extend(StrategyResult(label_of(s, m), ok=False, error=f"not tried: {why}") for s, m in slow if (s, m) not in kept)
        return kept

    if not budget.compile:  # the budget's choice first: its reason does not depend on how fast the machine was
        slow = skip([(s, m) for s, m in slow if s is not Strategy.COMPILE], "the autotune budget skips torch.compile")
    if slow and best_eager < COMPILE_MIN_MS:
        slow = skip([], f"the stage takes {best_eager:.3f} ms, under {COMPILE_MIN_MS} ms")
    late: Cands = {}
    default_compile: Optional[StrategyResult] = None
    for strategy, mode in slow:
        if strategy is Strategy.COMPILE and mode and default_compile is not None and not default_compile.ok:
            # the other modes lower the same graph through the same compiler: each would fail alike, seconds apiece
            results.append(StrategyResult(label_of(strategy, mode), ok=False,
                                          error=f"not tried: compile failed in its default mode ({default_compile.error[:80]})"))
            continue
        before = set(working)
        res = attempt(strategy, mode=mode)
        if strategy is Strategy.COMPILE and not mode:
            default_compile = res
        late.update({k: v for k, v in working.items() if k not in before})
    if late:  # the newcomers and the eager survivors in one round-robin, so load changes between rounds cannot decide
        racing = {**alive, **late}
        _timing_round(racing, device, repeats, warmup, budget, set(late), final=False)
        for label, (res, _) in late.items():
            if label.startswith(Strategy.COMPILE.value):
                res.compile_s = getattr(runners.get(label), "compile_seconds", res.compile_s)
        alive = racing
    chosen = race(alive, device, repeats, warmup, budget, timed=True, pool=working)
    start.restore()  # the timing runs moved it; the caller's advance() runs the chosen once from here
    if chosen is None:  # even the loop failed (e.g. injected faults everywhere): keep the loop's outputs
        return results, StrategyResult("loop", ok=False, error="no strategy worked"), ref, reference
    return results, chosen, outputs[chosen.strategy], runners[chosen.strategy]


def _fastest(cands: Cands, device: torch.device, repeats: Optional[int], budget: Budget) -> Optional[StrategyResult]:
    """The candidate with the lowest minimum time. When the best two are within CLOSE of
    each other they are timed again, head to head with twice the samples, before deciding."""
    ok = sorted((r for r, _ in cands.values() if r.ok and r.time), key=lambda r: r.time.min_ms)
    if len(ok) >= 2 and ok[1].time.min_ms <= ok[0].time.min_ms * (1 + CLOSE):
        pair = {r.strategy: cands[r.strategy] for r in ok[:2]}
        deadline = 4 * budget.round_s if budget.prune else None
        time_candidates(pair, device, 2 * (repeats or MIN_REPEATS), 1, set(), memory=not budget.prune, deadline_s=deadline)
        ok = sorted((r for r, _ in cands.values() if r.ok and r.time), key=lambda r: r.time.min_ms)
    return ok[0] if ok else None


def is_oom_text(error: str) -> bool:
    return error.startswith("out of memory")


def tuning_start(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], dev: torch.device,
                 allowed: Optional[set[Strategy]], budget: Optional[Budget] = None) -> tuple[tuple, list[nn.Module], Any, dict, int]:
    """(inputs on `dev`, private copies of the members there, the plan's batched module, its bound inputs,
    the number of candidates). The caller's members are never run (see candidates.private_members)."""
    inputs = on_device(tuple(inputs), dev)
    members = private_members(members, dev)
    module = build(plan, members, example_inputs=member_inputs(plan, inputs, 0), device=dev)
    total = sum(len(stage_candidates(p, dev, allowed, budget)) for p in module.programs)
    return inputs, members, module, module.bind_inputs(inputs), total


def tune(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
         progress: Progress = None, repeats: Optional[int] = None, warmup: int = 2,
         strategies: Optional[Sequence[str | Strategy]] = None,
         budget: "str | Budget | None" = None) -> tuple[Plan, dict[str, list[StrategyResult]]]:
    """autotune, also returning the measured candidates: stage id of the tuned plan -> results.

    When merging all stages into one won, "s0" holds the whole-plan candidates
    ("per-stage", "merged/compile", ...) and "per-stage s<k>" each original stage's.
    """
    dev = resolve_device(device)
    n = plan.n_members
    spend = budget_of(budget)
    allowed = {Strategy(s) for s in strategies} if strategies is not None else None
    inputs, members, module, env, total = tuning_start(plan, members, inputs, dev, allowed, spend)
    start = SavedTensors(module.stacked_state.values())  # the tuned runners' state before any stage ran
    done = 0
    tuned: list[Stage] = []
    found: dict[str, list[StrategyResult]] = {}
    stage_ms = 0.0
    made: dict[str, Runner] = {}  # stage id -> the chosen runner (compiled/captured already)
    loops = module.number_loops  # after bind_inputs (tuning_start): a container input's numbers are known there
    with torch.no_grad(), tf32_scope(plan.dtype, dev):
        for program, runner in zip(module.programs, module.runners):
            fresh = stage_inputs(program, env, n)
            results, chosen, out, chosen_runner = _tune_stage(program, runner, fresh, n, dev, allowed, repeats, warmup,
                                                              progress, done, total, default_rtol(plan, members), spend,
                                                              loops.get(program.stage.id, ()))
            done += len(stage_candidates(program, dev, allowed, spend))
            found[program.stage.id] = results
            advance(program, env, fresh, out, chosen_runner)
            if chosen.ok:
                made[program.stage.id] = chosen_runner
            stage = program.stage
            stage_ms += chosen.time.min_ms if chosen.ok and chosen.time else math.inf
            if not chosen.ok:
                tuned.append(stage)
                continue
            strategy = Strategy(chosen.strategy.split("/")[0])
            options = StageOptions(strategy=strategy, chunk_size=chosen.chunk_size, note=_note(results, chosen))
            options = with_compile_mode(with_conv_form(options, conv_form_of_label(chosen.strategy)),
                                        compile_mode_of_label(chosen.strategy))
            tuned.append(replace(stage, options=options))
    per_stage = plan.with_stages(tuned)
    if progress is not None:
        progress(total, total, "comparing with one merged stage")
    with torch.no_grad():
        best, merged_results, checked = _best_of_merged(per_stage, members, inputs, dev, allowed, repeats, warmup, spend, stage_ms,
                                                        made, start, tuple(w for words in loops.values() for w in words))
    if merged_results is not None:  # one merged stage won: its candidates are whole plans
        found = {"s0": merged_results, **{f"per-stage {k}": v for k, v in found.items()}}
    if not checked:  # the whole-plan comparison built `best` from its plan and checked it already
        start.restore()
        _check_end_to_end(best, members, inputs, dev, made)
    return best, found


def merged_alternatives(plan: Plan, graph_order: list[str], allowed: Optional[set[Strategy]],
                        device: torch.device = torch.device("cpu"), budget: Optional[Budget] = None) -> list[Plan]:
    """The whole model as one stage, with each strategy that could run it.

    Per-stage choices cannot see what fusing across stage boundaries gains (one
    compiled graph instead of several) or what boundaries cost; these
    alternatives let the end-to-end measurement decide. They include the plain
    member loop, so a tuned plan is never knowingly slower than not batching.
    compile comes once per stage_compile_modes(device, budget).
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
    form = next((f for s in plan.stages if s.options.strategy is Strategy.WIDE and (f := conv_form_of(s.options))), "")
    out = []
    for strategy in strategies:
        if allowed is None or strategy in allowed:
            options = with_conv_form(StageOptions(strategy=strategy), form if strategy is Strategy.WIDE else "")
            # on a GPU the whole model compiled also with autotuned kernels, and with CUDA graphs (cudagraph trees)
            modes = stage_compile_modes(device, budget) if strategy is Strategy.COMPILE else ("",)
            for m in modes:
                stage = Stage(id="s0", nodes=nodes, mode=mode, reason=reason, options=with_compile_mode(options, m))
                out.append(plan.with_stages([stage]))
    return out


def whole_plan_graph(plan: Plan) -> Plan:
    """The per-stage plan as the whole-plan graph candidate (plan.capture). A stage compiled with mode
    reduce-overhead replays CUDA graphs of its own (torch's cudagraph trees), which cannot be recorded
    inside another graph's capture: in this candidate it is compiled in the default mode, its kernels
    captured with the rest (what reduce-overhead's graphs would have saved, the one graph saves)."""
    def default_mode(options: StageOptions) -> StageOptions:
        options = with_compile_mode(options, "")
        return replace(options, note=options.note + " (default mode inside the whole-plan graph)")

    stages = [replace(s, options=default_mode(s.options))
              if s.options.strategy is Strategy.COMPILE and compile_mode_of(s.options) == "reduce-overhead" else s
              for s in plan.stages]
    return plan.with_stages(stages).with_capture(True)


def whole_plan_graph_wide(plan: Plan) -> Optional[Plan]:
    """whole_plan_graph with every excluded stage that runs as the member loop switched to `wide`; None where
    there is none. Checked end to end like any candidate: a stage wide cannot batch fails the candidate."""
    stages = [replace(s, options=replace(s.options, strategy=Strategy.WIDE, chunk_size=None,
                                         note=(s.options.note + " (wide inside the whole-plan graph)").lstrip()))
              if s.mode is StageMode.EXCLUDED and s.options.strategy is Strategy.LOOP else s for s in plan.stages]
    if all(a is b for a, b in zip(stages, plan.stages)):
        return None
    return whole_plan_graph(plan.with_stages(stages))


def _merged_label(p: Plan) -> str:
    """"merged/compile", "merged/compile/reduce-overhead", "merged/wide", ..."""
    options = p.stages[0].options
    mode = compile_mode_of(options) if options.strategy is Strategy.COMPILE else ""
    return f"merged/{options.strategy.value}" + (f"/{mode}" if mode else "")


def _best_of_merged(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device,
                    allowed: Optional[set[Strategy]], repeats: Optional[int], warmup: int,
                    budget: Budget = BUDGETS["default"], stage_ms: float = math.inf,
                    made: Optional[dict[str, Runner]] = None,
                    made_state: Optional[SavedTensors] = None,
                    number_loop: tuple[str, ...] = ()) -> tuple[Plan, Optional[list[StrategyResult]], bool]:
    """The per-stage plan, or one merged stage if that is faster end to end and matches the loop.

    Every alternative (the per-stage plan too) is built afresh from its plan and checked
    against the member loop end to end; the per-stage plan runs the runners tuning made
    (`made`, see build_reusing), so its compiled stages are not compiled again. merged/compile is left out where the budget skips
    compile or the per-stage plan takes under COMPILE_MIN_MS (`stage_ms`: its stages' times).
    `members` are autotune's private copies at their starting state (kept there: the loop runs under
    state_kept); `made_state` puts the reused runners' state back to where tuning started, before each
    candidate that reuses them is built and after a whole-plan graph's capture call, so every candidate
    is checked from the state the loop started from.
    `number_loop`: what in the plan takes a per_member Python number (BatchedModule.number_loops): one merged stage
    holds it, so it would run as the member loop whatever its strategy; only merged/loop is tried there.
    Returns (plan, the whole-plan candidates if the merged stage won, else None, whether the
    returned plan was checked end to end here).
    """
    example = member_inputs(plan, inputs, 0)
    plan = plan.with_capture(False) if plan.capture else plan
    with state_kept(members):  # an export retrace may run forward
        order = retrace(members[0], plan.tracer, example, opened=plan.opened_modules).node_names
    drawn = _drawing_stages(plan, members, inputs, device, made, reset=made_state.restore if made_state is not None else None)
    if len(drawn) > 1:
        # each stage matched the loop, but end to end the draws come in another order than the loop's (draw_order_note):
        # no whole-plan check can be made, so no merged or whole-graph alternative is tried
        note = "; end to end not compared with the loop: " + draw_order_note(drawn)
        return plan.with_stages([replace(s, options=replace(s.options, note=s.options.note + note)) for s in plan.stages]), None, True
    alternatives = merged_alternatives(plan, order, allowed, device, budget)
    # the per-stage plan replayed as CUDA graphs (executor.capture): one launch per run of capturable stages
    captured = [(WHOLE_GRAPH, whole_plan_graph(plan))] if capture_backend(device) is not None else []
    wide_graph = whole_plan_graph_wide(plan) if captured and (allowed is None or Strategy.WIDE in allowed) else None
    captured += [(WHOLE_GRAPH_WIDE, wide_graph)] if wide_graph is not None else []
    if not alternatives and not captured:
        return plan, None, False
    with state_kept(members), same_draws(0):  # the random state try_strategy checks each candidate from
        want = stack_outputs(loop_outputs(plan, members, fresh(inputs)))
    check = lambda out: max_rel_error(out, want)  # noqa: E731
    reset = made_state.restore if made_state is not None else (lambda: None)
    # forward() writing its inputs in place (`x.mul_(2)`, the module's _written_inputs, the same for every candidate):
    # every checked, warm-up and timed call on private copies refilled with the caller's values before it, outside
    # the timed call (the caller's tensors are never written, and each call sees the values `want` was computed from)
    copies: list[FreshInputs] = []  # made from the first candidate built
    cands: Cands = {}
    plans = {"per-stage": plan}
    results = []
    for label, p in [("per-stage", plan)] + captured + [(_merged_label(a), a) for a in alternatives]:
        if number_loop and label.startswith("merged/") and label != "merged/loop":
            results.append(number_loop_refusal(label, number_loop))
            continue
        if label.startswith("merged/compile") and (not budget.compile or stage_ms < COMPILE_MIN_MS):
            why = "the autotune budget skips torch.compile" if not budget.compile else f"the plan takes {stage_ms:.3f} ms, under {COMPILE_MIN_MS} ms"
            results.append(StrategyResult(label, ok=False, error=f"not tried: {why}"))
            continue
        plans[label] = p
        reuse = (made or {}) if label in ("per-stage",) + WHOLE_GRAPHS else {}
        other = _redrawn(inputs) if label in WHOLE_GRAPHS else None

        def make(p=p, reuse=reuse, other=other):
            if reuse:
                reset()
            m = build_reusing(p, members, inputs, device, reuse)
            if other is not None:
                own = SavedTensors(m.stacked_state.values())
                m(*other)  # a whole-plan graph is captured on other values: the checked call is a replay on `inputs`
                own.restore()  # that call updated the buffers (warm-ups too, in the reused runners' state): back to the start
                reset()
            if not copies:
                copies.append(FreshInputs(inputs, bool(m.__dict__.get("_written_inputs"))))
            work = copies[0]
            return work.timed(lambda: m(*work.values))
        res, call, _ = try_strategy(label, "whole", make, check, device, rtol=default_rtol(plan, members))
        results.append(res)
        if call is not None:
            cands[label] = (res, call)
    chosen = race(cands, device, repeats, warmup, budget, {k for k in cands if k.startswith("merged/compile")})
    if chosen is None:
        return plan, None, False
    summary = "; whole plan (min/median ms): " + _measured(results)
    best = plans[chosen.strategy]
    if chosen.strategy in ("per-stage",) + WHOLE_GRAPHS:
        return best.with_stages([replace(s, options=replace(s.options, note=s.options.note + summary)) for s in best.stages]), None, True
    (stage,) = best.stages
    note = f"autotune merged all stages and chose {stage.options.strategy.value}" + summary
    options = with_compile_mode(with_conv_form(replace(stage.options, note=note), conv_form_of(stage.options)),
                                compile_mode_of(stage.options))
    return best.with_stages([replace(stage, options=options)]), results, True


def _drawing_stages(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device,
                    made: Optional[dict[str, Runner]], reset: Optional[Callable[[], None]]) -> list[str]:
    """The ids of the stages of `plan` that draw random numbers, from one run (the members' and the tuned runners'
    state put back after it)."""
    if reset is not None:
        reset()
    module = build_reusing(plan, members, inputs, device, made or {})
    own = SavedTensors(module.stacked_state.values())
    drawn: list[str] = []
    try:
        with torch.no_grad(), same_draws(0):
            module.run_stages(*fresh(inputs), run=counting_draws(module, drawn))
    except Exception:  # noqa: BLE001 - the candidates' own runs report a failure, with its reason
        return []
    finally:
        own.restore()
        if reset is not None:
            reset()
    return drawn


def _redrawn(inputs: tuple) -> tuple:
    """`inputs` with every floating tensor redrawn (same shape, dtype, device), the rest as they are. A whole-plan
    graph captured on these and then checked on `inputs` must replay on its inputs: one that ignored them would
    answer with these values' outputs and fail the check against the loop."""
    g = torch.Generator().manual_seed(12345)
    return tree_map(lambda x: torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device)
                    if isinstance(x, torch.Tensor) and x.is_floating_point() else x, inputs)


def _same_kernels(a: StageOptions, b: StageOptions) -> bool:
    """Whether two stage options make the same runner (strategy, chunk size, wide's conv form, compile's mode)."""
    return (a.strategy is b.strategy and a.chunk_size == b.chunk_size and conv_form_of(a) == conv_form_of(b)
            and compile_mode_of(a) == compile_mode_of(b))


def build_reusing(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device,
                  made: dict[str, Runner]) -> BatchedModule:
    """`plan` built afresh, its runners replaced by the ones tuning already made (and compiled) for the
    same stage id where the fresh build made a runner of the same class from the same options.

    The fresh build proves the saved plan makes these kernels; reusing the tuned runners saves
    compiling (or capturing) each stage a second time. Both read equal stacked state.
    """
    module = build(plan, members, example_inputs=member_inputs(plan, inputs, 0), device=device)
    runners = [made[p.stage.id] if p.stage.id in made and type(made[p.stage.id]) is type(r)
               and _same_kernels(made[p.stage.id].program.stage.options, p.stage.options) else r
               for p, r in zip(module.programs, module.runners)]
    module.runners = runners  # assigning a new list re-makes the module's steps (BatchedModule.runners)
    return module


def _check_end_to_end(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device,
                      made: Optional[dict[str, Runner]] = None) -> None:
    """The tuned plan as a whole must match the member loop (each stage already did)."""
    module = build_reusing(plan, members, inputs, device, made or {})
    with torch.no_grad(), same_draws(0):
        got = module(*fresh(inputs))
    with state_kept(members), same_draws(0):
        want = stack_outputs(loop_outputs(plan, members, fresh(inputs)))
    err = max_rel_error(got, want)
    if not err <= default_rtol(plan, members):
        raise ExecutionError(f"autotune: the tuned plan differs from the member loop (max rel err {err:.2e}) although each stage matched; "
                             "profile the plan with its default strategies and report this")


@keeps_random_state
def autotune(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
             progress: Progress = None, repeats: Optional[int] = None,
             strategies: Optional[Sequence[str | Strategy]] = None, train: bool = False,
             budget: "str | Budget | None" = None) -> Plan:
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
        budget: how much measuring to spend: "default" (successive halving: every checked
            candidate timed briefly, clear losers dropped, survivors timed in full), "quick"
            (fewer samples, no torch.compile candidates) or "thorough" (every candidate timed
            in full), or an autotune.Budget. Every candidate that can be chosen is checked
            against the member loop whatever the budget.
    Returns:
        A new Plan: each stage's options.strategy/chunk_size set to the winner and
        options.note holding the measured times of every candidate.
    """
    if train:
        # imported here: autotune_train builds on this module's helpers (a module-level import would be a cycle)
        from stagewise.executor.autotune_train import tune_training

        return tune_training(plan, members, inputs, device=device, progress=progress, repeats=repeats, strategies=strategies,
                             budget=budget)[0]
    return tune(plan, members, inputs, device=device, progress=progress, repeats=repeats, strategies=strategies, budget=budget)[0]
