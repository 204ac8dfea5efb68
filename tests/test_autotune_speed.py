"""autotune's budget: successive halving, skipped candidates, one end-to-end check; never an unchecked choice.

Timings are controlled (a fake time_candidates) wherever a test needs to know which candidate
is fastest; the candidates still run and are checked against the member loop for real.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from stagewise import executor, planner
from stagewise.executor.autotune import BUDGETS, Budget, budget_of, tune
from stagewise.executor.candidates import time_candidates
from stagewise.executor.report import StrategyResult
from stagewise.executor.stages import RUNNERS, VmapRunner
from stagewise.executor.timing import MIN_DEADLINE_ROUNDS, Timing, interleaved
from stagewise.executor.values import Batched
from stagewise.planner.errors import ExecutionError
from stagewise.planner.plan import Strategy

autotune_module = importlib.import_module("stagewise.executor.autotune")
N = 3
EAGER = ["vmap", "wide", "loop"]
CPU = torch.device("cpu")


class Timer:
    """Stands in for time_candidates: label -> ms per round (the last repeats); records each call's kwargs."""

    def __init__(self, times: dict[str, list[float]], spread: float = 0.0):
        self.times, self.spread, self.rounds, self.calls = times, spread, {}, []

    def __call__(self, cands, device, repeats, warmup, compiles, **kwargs):
        self.calls.append((sorted(cands), repeats, kwargs))
        for label, (res, call) in cands.items():
            call()
            k = self.rounds[label] = self.rounds.get(label, 0) + 1
            ms = self.times[label][min(k - 1, len(self.times[label]) - 1)]
            res.time = Timing(ms * (1 + self.spread / 2), ms, ms * (1 + self.spread), ms, 3)


def timed(monkeypatch, times, spread=0.0) -> Timer:
    timer = Timer(times, spread)
    monkeypatch.setattr(autotune_module, "time_candidates", timer)
    return timer


def test_budget_names_and_an_unknown_one():
    assert budget_of(None) is BUDGETS["default"] and budget_of("quick") is BUDGETS["quick"]
    custom = Budget(quick_repeats=5)
    assert budget_of(custom) is custom
    assert BUDGETS["default"].prune and not BUDGETS["thorough"].prune and not BUDGETS["quick"].compile
    with pytest.raises(ExecutionError, match="unknown autotune budget 'fast'.*default, quick, thorough"):
        budget_of("fast")


def test_clear_losers_are_timed_once_and_survivors_again_in_full(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    timer = timed(monkeypatch, {"vmap": [1.0, 1.2], "wide": [1.04, 1.0], "loop": [3.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER)
    assert tuned.stage("s0").options.strategy is Strategy.WIDE
    assert timer.rounds == {"vmap": 2, "wide": 2, "loop": 1}
    brief, full = timer.calls[0], timer.calls[1]
    assert brief[0] == ["loop", "vmap", "wide"] and brief[1] == BUDGETS["default"].quick_repeats and brief[2]["memory"] is False
    assert full[0] == ["vmap", "wide"] and full[2]["memory"] is False and full[2]["deadline_s"] > 0
    results = {r.strategy: r for r in found["s0"]}
    assert results["wide"].peak_mem_bytes is not None  # the winner's memory, measured once
    assert results["loop"].time.min_ms == 3.0  # a pruned candidate keeps its brief timing for the note


def test_a_candidate_within_the_best_ones_spread_survives_the_brief_round(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    # vmap's samples spread 50% above its minimum: loop at 1.3x its minimum may be just as fast
    timer = timed(monkeypatch, {"vmap": [1.0], "wide": [2.0], "loop": [1.3]}, spread=0.5)
    tune(plan, src.members(N), src.example_inputs, strategies=EAGER)
    assert timer.rounds == {"vmap": 2, "wide": 1, "loop": 2}


def test_thorough_times_every_candidate_in_full_once(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    timer = timed(monkeypatch, {"vmap": [1.0], "wide": [2.0], "loop": [3.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, budget="thorough")
    assert timer.rounds == {"vmap": 1, "wide": 1, "loop": 1}
    (call,) = timer.calls
    assert call[1] is None and call[2] == {"memory": True, "deadline_s": None}


def test_quick_skips_compile_per_stage_and_merged(sample, monkeypatch):
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", 0.0)
    src, graph = sample("mlp")
    plan = planner.split(planner.propose(graph, N), graph, "s0", at="act")
    timed(monkeypatch, {"vmap": [1.0], "wide": [2.0], "loop": [3.0], "per-stage": [2.0], "merged/vmap": [3.0],
                        "merged/wide": [4.0], "merged/loop": [5.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, budget="quick")
    for stage_id in ("s0", "s1"):
        comp = next(r for r in found[stage_id] if r.strategy == "compile")
        assert not comp.ok and "budget skips torch.compile" in comp.error
    assert [s.options.strategy for s in tuned.stages] == [Strategy.VMAP, Strategy.VMAP]
    assert "merged/compile failed (not tried: the autotune budget skips torch.compile)" in tuned.stages[0].options.note


class FastWrongRunner(VmapRunner):
    def run(self, args):
        return [Batched(torch.zeros_like(v.tree)) for v in super().run(args)]


@pytest.mark.parametrize("budget", ["default", "quick", "thorough"])
def test_no_budget_chooses_an_unchecked_or_wrong_candidate(sample, monkeypatch, budget):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    monkeypatch.setitem(RUNNERS, Strategy.WIDE, FastWrongRunner)
    timer = timed(monkeypatch, {"wide": [0.01], "vmap": [1.0], "loop": [2.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, budget=budget)
    assert "wide" not in timer.rounds  # wrong: never timed, so never in a race
    chosen = tuned.stage("s0").options.strategy.value
    assert chosen == "vmap"
    res = next(r for r in found["s0"] if r.strategy == chosen)
    assert res.ok and res.max_rel_err is not None and res.max_rel_err <= 1e-4


def test_the_whole_plan_race_is_the_end_to_end_check(sample, monkeypatch):
    """Each alternative is built from its plan and checked there; no second build of the winner."""
    src, graph = sample("mlp")
    plan = planner.split(planner.propose(graph, N), graph, "s0", at="act")
    timed(monkeypatch, {"vmap": [1.0], "wide": [2.0], "loop": [3.0], "per-stage": [1.0], "merged/vmap": [3.0],
                        "merged/wide": [2.0], "merged/loop": [4.0]})
    calls = []
    monkeypatch.setattr(autotune_module, "_check_end_to_end", lambda *a: calls.append(a))
    tuned, _ = tune(plan, src.members(N), src.example_inputs, strategies=EAGER)
    assert len(tuned.stages) == 2 and not calls
    single = planner.propose(graph, N)  # one stage: no whole-plan race, so the separate check runs
    tune(single, src.members(N), src.example_inputs, strategies=EAGER)
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_quick_and_default_budgets_tune_real_models_to_checked_plans(sample, name):
    src, graph = sample(name)
    plan = planner.propose(graph, N)
    for budget in ("quick", "default"):
        tuned = executor.autotune(plan, src.members(N), src.example_inputs, strategies=EAGER, budget=budget)
        planner.validate(tuned, graph)
        assert executor.verify(tuned, src.members(N), src.example_inputs).ok


def test_a_deadline_cuts_the_round_robin_but_not_below_its_minimum():
    calls = {"a": 0, "b": 0}

    def slow(name):
        def f():
            calls[name] += 1
            torch.ones(1000).sum()
        return f

    out = interleaved({"a": slow("a"), "b": slow("b")}, CPU, repeats=50, warmup=1, deadline_s=0.0)
    assert out["a"].repeats == out["b"].repeats == MIN_DEADLINE_ROUNDS
    assert interleaved({"a": slow("a")}, CPU, repeats=5, warmup=1)["a"].repeats == 5


def test_later_rounds_keep_the_compile_time_the_first_measured():
    res = StrategyResult("compile", ok=True, compile_s=2.0)  # first call: 2 s with compiling
    cands = {"compile": (res, lambda: None)}
    time_candidates(cands, CPU, 3, 1, {"compile"}, memory=False)
    first = res.compile_s
    assert 1.9 < first <= 2.0 and res.peak_mem_bytes is None
    time_candidates(cands, CPU, 3, 1, set(), memory=True)
    assert res.compile_s == first and res.peak_mem_bytes is not None


def test_the_end_to_end_checks_run_the_runners_tuning_made(sample, monkeypatch):
    """A compiled stage is not compiled again for the whole-plan race or the final check."""
    real, seen = autotune_module.build_reusing, []

    def spy(plan, members, inputs, device, made):
        module = real(plan, members, inputs, device, made)
        seen.append((dict(made), list(module.runners)))
        return module

    monkeypatch.setattr(autotune_module, "build_reusing", spy)
    src, graph = sample("mlp")
    tune(planner.propose(graph, N), src.members(N), src.example_inputs, strategies=EAGER)
    made, runners = seen[-1]  # the final check of a one-stage plan
    assert runners[0] is made["s0"]
    seen.clear()
    split = planner.split(planner.propose(graph, N), graph, "s0", at="act")
    tune(split, src.members(N), src.example_inputs, strategies=EAGER)
    made, runners = seen[0]  # the per-stage candidate of the whole-plan race
    assert [r is made[s] for r, s in zip(runners, ("s0", "s1"))] == [True, True]


def test_a_runner_is_reused_only_for_the_same_kernels(sample):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    members = src.members(N)
    tuned_vmap = executor.build(plan, members).runners[0]
    loop_plan = planner.set_options(plan, graph, "s0", strategy="loop")
    module = autotune_module.build_reusing(loop_plan, members, src.example_inputs, CPU, {"s0": tuned_vmap})
    assert module.runners[0] is not tuned_vmap  # the plan says loop: the tuned vmap runner is not what it makes
    module = autotune_module.build_reusing(plan, members, src.example_inputs, CPU, {"s0": tuned_vmap})
    assert module.runners[0] is tuned_vmap


def test_a_winner_that_fails_when_its_memory_is_measured_is_not_chosen(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    timed(monkeypatch, {"vmap": [1.0], "wide": [3.0], "loop": [3.1]})

    def peak(call, device):
        call()
        if peak.calls == 0:
            peak.calls += 1
            raise torch.OutOfMemoryError("simulated out of memory on the memory run")
        return 123

    peak.calls = 0
    monkeypatch.setattr(autotune_module, "peak_memory_bytes", peak)
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER)
    results = {r.strategy: r for r in found["s0"]}
    assert not results["vmap"].ok and results["vmap"].error.startswith("out of memory")
    assert tuned.stage("s0").options.strategy is Strategy.WIDE and results["wide"].peak_mem_bytes == 123
