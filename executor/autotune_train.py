"""executor.autotune(..., train=True): choose each stage's strategy by its forward + backward time.

Training runs every stage forward and backward, so the strategy that is fastest at
inference is not necessarily the one to train with. Stages are tuned in order, on
their real inputs (the outputs of the strategies already chosen upstream). Each
candidate runs the stage forward, takes a surrogate loss (its float outputs weighted
by fixed random numbers, the same for the loop and every candidate) and computes the gradients of the stage's member state and of its
batched inputs; those gradients are checked against the member loop's (normwise,
worst member) before anything is timed, at verify(grads=True)'s tolerance for the plan's
and the members' precision (stage_grads.grads_tolerance: 1e-4 in float32, 0.25 for a
bfloat16 / float16 plan or members). Only strategies that carry gradients are
candidates (cuda_graph is inference-only; compile runs eager in training mode, so
it would only repeat vmap). Gradients are checked in eval() mode, where every way
draws the same (no) dropout masks, and timed in train() mode, as training runs.

A module whose forward() reads self.training refuses the mode it was not traced in
(executor.build): it is checked and timed in the mode it was traced in. Traced in
training mode, the loop and each candidate then run from one seed: a stage without
random ops gives the loop's gradients exactly; one with dropout draws its masks in
another order under vmap and wide (the same distribution, other values), fails the
check and keeps the member loop, which draws as the reference does.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch import nn

from stagewise.planner.errors import ExecutionError
from stagewise.planner.plan import Plan, Stage, StageOptions, Strategy
from stagewise.executor.autotune import Budget, _note, budget_of, candidate_strategies, number_loop_refusal, race, tuning_start
from stagewise.executor.build import resolve_device
from stagewise.executor.candidates import Progress, advance, loop_reference, make_runner, stage_inputs, try_strategy
from stagewise.executor.stage_grads import fwd_bwd, grads_check, grads_tolerance, per_member_numbers
from stagewise.executor.report import StrategyResult
from stagewise.executor.stages import LoopRunner

TRAINING_CANDIDATES = (Strategy.VMAP, Strategy.WIDE, Strategy.LOOP)


def _set_mode(module: nn.Module, training: bool) -> bool:
    """module.train(training), or where it refuses that mode (forward() reads self.training and was traced in the
    other one, see executor.build) the mode it is in. Returns whether the module is in `training` mode now."""
    try:
        module.train(training)
    except ExecutionError:
        pass
    return module.training == training


def _seeded(call: Any, device: torch.device) -> Any:
    """`call` run from one seed, the random streams put back afterwards: the loop and a candidate draw alike
    wherever they draw in the same order."""
    def seeded() -> Any:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return call()
    return seeded


def tune_training(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
                  progress: Progress = None, repeats: Optional[int] = None, warmup: int = 2,
                  strategies: Optional[Sequence[str | Strategy]] = None,
                  budget: "str | Budget | None" = None) -> tuple[Plan, dict[str, list[StrategyResult]]]:
    """The training-mode autotune, also returning every stage's measured candidates (see the module docstring)."""
    dev = resolve_device(device)
    spend = budget_of(budget)
    n = plan.n_members
    allowed = set(TRAINING_CANDIDATES) & ({Strategy(s) for s in strategies} if strategies is not None else set(TRAINING_CANDIDATES))
    rtol = grads_tolerance(plan, members)  # verify(grads=True)'s, at the plan's and the members' own precision
    inputs, members, module, env, total = tuning_start(plan, members, inputs, dev, allowed)
    loops = module.number_loops  # stages running as the member loop for a per_member Python number: loop only
    numbers = per_member_numbers(module, env)  # no gradient leaves: the loop hands each member a Python number
    done = 0
    tuned: list[Stage] = []
    found: dict[str, list[StrategyResult]] = {}
    for program, runner in zip(module.programs, module.runners):
        stage = program.stage
        fresh = stage_inputs(program, env, n)
        reference = LoopRunner(program, n, runner.stacked, runner.member_states)
        in_eval = _set_mode(module, False)  # the check: no dropout masks, so every way must give the loop's gradients
        checked = (lambda call: call) if in_eval else (lambda call: _seeded(call, dev))
        # fwd_bwd on the stage's inputs as they are (fresh.current), refilled before each run outside the timed call
        # (fresh.prepared): a stage writing its inputs then runs every check and timed call on the caller's values
        run = lambda r: fresh.prepared(fwd_bwd(program, r, fresh.current, n, numbers))  # noqa: E731
        check = grads_check(checked(run(reference))(), n)
        results: list[StrategyResult] = []
        working: dict[str, tuple[StrategyResult, Any]] = {}
        number_loop = loops.get(stage.id, ())
        for strategy in candidate_strategies(program, dev, allowed):
            if progress is not None:
                progress(done, total, f"{stage.id}: {strategy.value} forward + backward")
            done += 1
            if number_loop and strategy is not Strategy.LOOP:  # one batched call cannot give each member its number
                results.append(number_loop_refusal(strategy.value, number_loop))
                continue
            candidate = make_runner(program, runner, strategy)
            if not candidate.trainable:
                continue
            _set_mode(module, False)
            res, call, _ = try_strategy(strategy.value, stage.id, lambda c=candidate: checked(run(c)), check, dev, rtol=rtol)
            results.append(res)
            if call is not None:
                working[strategy.value] = (res, call if in_eval else run(candidate))
        _set_mode(module, True)  # timed as training runs
        chosen = race(working, dev, repeats, warmup, spend)  # successive halving, as for inference (autotune.Budget)
        _set_mode(module, False)
        found[stage.id] = results
        with torch.no_grad():  # the next stages' inputs: this stage's forward outputs with the chosen strategy
            _, ref_out, _ = loop_reference(program, runner, fresh)
            if chosen is None:
                advance(program, env, fresh, ref_out, reference)
                tuned.append(stage)
                continue
            chosen_runner = make_runner(program, runner, Strategy(chosen.strategy))
            advance(program, env, fresh, chosen_runner(fresh()), chosen_runner)
        note = _note(results, chosen).replace("autotune chose", "autotune (training: forward + backward) chose")
        tuned.append(replace(stage, options=StageOptions(strategy=Strategy(chosen.strategy), chunk_size=None, note=note)))
    return plan.with_stages(tuned), found
