"""executor.autotune(..., train=True): choose each stage's strategy by its forward + backward time.

Training runs every stage forward and backward, so the strategy that is fastest at
inference is not necessarily the one to train with. Stages are tuned in order, on
their real inputs (the outputs of the strategies already chosen upstream). Each
candidate runs the stage forward, takes a surrogate loss (the sum of its float
outputs) and computes the gradients of the stage's member state and of its
batched inputs; those gradients are checked against the member loop's (normwise,
worst member) before anything is timed. Only strategies that carry gradients are
candidates (cuda_graph is inference-only; compile runs eager in training mode, so
it would only repeat vmap). Gradients are checked in eval() mode, where every way
draws the same (no) dropout masks, and timed in train() mode, as training runs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch import nn

from stagewise.planner.plan import Plan, Stage, StageOptions, Strategy
from stagewise.executor.autotune import Budget, _note, budget_of, candidate_strategies, race, tuning_start
from stagewise.executor.build import resolve_device
from stagewise.executor.candidates import Progress, advance, loop_reference, make_runner, stage_inputs, try_strategy
from stagewise.executor.stage_grads import GRAD_RTOL, fwd_bwd, grads_check
from stagewise.executor.report import StrategyResult
from stagewise.executor.stages import LoopRunner

TRAINING_CANDIDATES = (Strategy.VMAP, Strategy.WIDE, Strategy.LOOP)


def tune_training(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device: str | torch.device = "cpu",
                  progress: Progress = None, repeats: Optional[int] = None, warmup: int = 2,
                  strategies: Optional[Sequence[str | Strategy]] = None,
                  budget: "str | Budget | None" = None) -> tuple[Plan, dict[str, list[StrategyResult]]]:
    """The training-mode autotune, also returning every stage's measured candidates (see the module docstring)."""
    dev = resolve_device(device)
    spend = budget_of(budget)
    n = plan.n_members
    allowed = set(TRAINING_CANDIDATES) & ({Strategy(s) for s in strategies} if strategies is not None else set(TRAINING_CANDIDATES))
    inputs, members, module, env, total = tuning_start(plan, members, inputs, dev, allowed)
    done = 0
    tuned: list[Stage] = []
    found: dict[str, list[StrategyResult]] = {}
    for program, runner in zip(module.programs, module.runners):
        stage = program.stage
        fresh = stage_inputs(program, env, n)
        reference = LoopRunner(program, n, runner.stacked, runner.member_states)
        module.eval()
        check = grads_check(fwd_bwd(program, reference, fresh, n)(), n)
        results: list[StrategyResult] = []
        working: dict[str, tuple[StrategyResult, Any]] = {}
        for strategy in candidate_strategies(program, dev, allowed):
            if progress is not None:
                progress(done, total, f"{stage.id}: {strategy.value} forward + backward")
            done += 1
            candidate = make_runner(program, runner, strategy)
            if not candidate.trainable:
                continue
            module.eval()  # the check: no dropout masks, so every way must give the loop's gradients
            res, call, _ = try_strategy(strategy.value, stage.id, lambda c=candidate: fwd_bwd(program, c, fresh, n), check, dev,
                                        rtol=GRAD_RTOL)
            results.append(res)
            if call is not None:
                working[strategy.value] = (res, call)
        module.train()  # timed as training runs
        chosen = race(working, dev, repeats, warmup, spend)  # successive halving, as for inference (autotune.Budget)
        module.eval()
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
