"""executor.autotune: picks only strategies that ran and matched the loop; never asserts timings."""
from __future__ import annotations

import importlib

import pytest
import torch

import executor
import planner
from executor.autotune import candidate_strategies, tune

autotune_module = importlib.import_module("executor.autotune")  # `executor.autotune` is the function
from executor.stages import RUNNERS, VmapRunner
from executor.strategies import compiled
from executor.timing import fault_hook, simulate_oom
from executor.values import Batched
from planner.plan import StageMode, Strategy

N = 3
EAGER = ["vmap", "wide", "loop"]


def tuned_ok(src, plan):
    report = executor.verify(plan, src.members(plan.n_members), src.example_inputs)
    assert report.ok, report.to_text()


@pytest.mark.parametrize("name", ["mlp", "resblock", "moe"])
def test_autotune_picks_a_checked_strategy_and_writes_the_times(sample, name):
    src, graph = sample(name)
    plan = planner.propose(graph, N)
    tuned = executor.autotune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    for s in tuned.stages:
        assert s.options.strategy.value in EAGER
        assert s.options.note.startswith(f"autotune chose {s.options.strategy.value}")
        assert "ms" in s.options.note
    planner.validate(tuned, graph)
    tuned_ok(src, tuned)
    assert planner.Plan.loads(tuned.dumps()) == tuned


def test_excluded_sdpa_stage_gets_wide_as_a_candidate(sample):
    src, graph = sample("transformer_block")
    plan = planner.propose(graph, N)
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    sdpa = next(s for s in plan.stages if s.mode is StageMode.EXCLUDED)
    tried = {r.strategy for r in found.get(sdpa.id if len(tuned.stages) > 1 else f"per-stage {sdpa.id}")}
    assert tried == {"loop", "wide"}
    if len(tuned.stages) > 1:
        chosen = tuned.stage(sdpa.id)
        assert chosen.mode is StageMode.EXCLUDED and chosen.options.strategy in (Strategy.LOOP, Strategy.WIDE)
    else:  # merging everything into one stage won
        (chosen,) = tuned.stages
        assert chosen.options.strategy in (Strategy.WIDE, Strategy.LOOP) and chosen.options.note.startswith("autotune merged")
        assert {r.strategy for r in found["s0"]} == {"per-stage", "merged/wide", "merged/loop"}
    tuned_ok(src, tuned)


def test_merged_alternatives_cover_compile_only_where_vmap_can_run(sample):
    from executor.autotune import merged_alternatives

    for name, expect in (("transformer_block", {Strategy.COMPILE, Strategy.WIDE, Strategy.LOOP}), ("gru", {Strategy.LOOP}),
                         ("mlp", set()), ("data_dependent", {Strategy.LOOP})):
        src, graph = sample(name)
        plan = planner.propose(graph, N)
        got = {p.stages[0].options.strategy for p in merged_alternatives(plan, graph.node_names, None)}
        assert got == expect, name
        for p in merged_alternatives(plan, graph.node_names, None):
            planner.validate(p, graph)


def test_data_dependent_stages_stay_loops(sample):
    src, graph = sample("data_dependent")
    plan = planner.propose(graph, N)
    module = executor.build(plan, src.members(N))
    for program in module.programs:
        if program.stage.mode is StageMode.EXCLUDED:
            assert candidate_strategies(program, torch.device("cpu")) == [Strategy.LOOP]
    tuned = executor.autotune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert all(s.options.strategy is Strategy.LOOP for s in tuned.stages if s.mode is StageMode.EXCLUDED)
    tuned_ok(src, tuned)


def test_out_of_memory_strategies_are_never_chosen(sample):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)

    def no_batching(stage, strategy):
        if strategy in ("vmap", "wide"):
            raise torch.OutOfMemoryError("simulated out of memory (fault injection)")

    with fault_hook(no_batching):
        tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    (stage,) = tuned.stages
    results = {r.strategy: r for r in found[stage.id]}
    assert not results["vmap"].ok and results["vmap"].error.startswith("out of memory")
    assert not results["wide"].ok
    chunked = [r for r in found[stage.id] if r.strategy.startswith("vmap/chunk=")]
    assert chunked and chunked[0].ok and chunked[0].chunk_size == N // 2  # out-of-memory vmap is retried in chunks
    assert stage.options.strategy in (Strategy.VMAP, Strategy.LOOP)
    if stage.options.strategy is Strategy.VMAP:
        assert stage.options.chunk_size == N // 2
    assert "failed" in stage.options.note
    tuned_ok(src, tuned)


class FastWrongRunner(VmapRunner):
    """Returns zeros without computing anything: the fastest strategy there is, and wrong."""

    def run(self, args):
        return [Batched(torch.zeros_like(v.tree)) for v in super().run(args)]


def test_a_wrong_strategy_is_never_chosen_even_when_fastest(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    monkeypatch.setitem(RUNNERS, Strategy.WIDE, FastWrongRunner)
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    wide = next(r for r in found["s0"] if r.strategy == "wide")
    assert not wide.ok and wide.error.startswith("wrong result")
    assert tuned.stage("s0").options.strategy is not Strategy.WIDE
    tuned_ok(src, tuned)


def test_compile_is_a_candidate_and_its_compile_time_is_kept_apart(sample, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", 0.0)
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    tuned, found = tune(plan, src.members(N), src.example_inputs, repeats=3)
    comp = next(r for r in found["s0"] if r.strategy == "compile")
    assert comp.ok and comp.compile_s > 0 and comp.time.median_ms < comp.compile_s * 1e3
    tuned_ok(src, tuned)


def test_compile_is_skipped_for_stages_too_small_to_gain(sample, monkeypatch):
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", 1e9)
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    _, found = tune(plan, src.members(N), src.example_inputs, repeats=3)
    comp = next(r for r in found["s0"] if r.strategy == "compile")
    assert not comp.ok and comp.error.startswith("not tried")


def test_profile_with_autotune_lists_candidates_and_the_tuned_plan(sample):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    with simulate_oom(strategy="compile"):
        report = executor.profile(plan, src.members(N), src.example_inputs, autotune=True, repeats=3, warmup=1)
    assert report.autotuned
    (stage,) = report.stages
    assert {c.strategy for c in stage.candidates} >= {"vmap", "wide", "loop", "compile"}
    assert stage.strategy != "compile"
    tuned = planner.Plan.from_json(report.plan)
    assert tuned.stage("s0").options.note.startswith("autotune chose")
    assert "*" in report.to_text()


def test_profile_progress_covers_autotune_and_ends_at_the_total(sample):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    calls = []
    with simulate_oom(strategy="compile"):
        executor.profile(plan, src.members(N), src.example_inputs, autotune=True, repeats=3, warmup=1,
                         progress=lambda d, t, label: calls.append((d, t, label)))
    assert any(label.startswith("autotune") for _, _, label in calls)
    assert calls[-1][0] == calls[-1][1]
    assert all(0 <= d <= t for d, t, _ in calls)
    assert [d for d, _, _ in calls] == sorted(d for d, _, _ in calls)
