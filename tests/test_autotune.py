"""executor.autotune: picks only strategies that ran and matched the loop; never asserts timings."""
from __future__ import annotations

import importlib

import pytest
import torch

from stagewise import executor
from stagewise import planner
from stagewise.executor.autotune import candidate_strategies, tune

autotune_module = importlib.import_module("stagewise.executor.autotune")  # `executor.autotune` is the function
from stagewise.executor.stages import RUNNERS, VmapRunner
from stagewise.executor.strategies import compiled
from stagewise.executor.timing import fault_hook, simulate_oom
from stagewise.executor.values import Batched
from stagewise.planner.plan import StageMode, Strategy

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
    from stagewise.executor.autotune import merged_alternatives

    # the GRU stage starts as wide (planner.propose.excluded_default), so the whole model may run wide too (checked)
    for name, expect in (("transformer_block", {Strategy.COMPILE, Strategy.WIDE, Strategy.LOOP}), ("gru", {Strategy.WIDE, Strategy.LOOP}),
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


# --- the choice, with controlled timings (the candidates still run and are checked for real) ----------

class FakeTimer:
    """Stands in for time_candidates: each label's time is read from `times` (ms), one entry per
    timing round of that label (the last entry repeats), so which candidate is fastest is known."""

    def __init__(self, times: dict[str, list[float]], fail_when_repeated: frozenset = frozenset()):
        self.times, self.rounds, self.fail = times, {}, fail_when_repeated

    def __call__(self, cands, device, repeats, warmup, compiles, **_):
        from stagewise.executor.timing import Timing

        for label, (res, call) in cands.items():
            call()
            k = self.rounds.get(label, 0)
            self.rounds[label] = k + 1
            seq = self.times[label]
            ms = seq[min(k, len(seq) - 1)]
            res.time, res.compile_s = Timing(ms, ms, ms, ms, 1), 0.0
            if label in self.fail:  # as time_candidates records a candidate that fails on a later call
                res.ok, res.error = False, "out of memory: simulated on the second buffer set"


def fake_times(monkeypatch, times: dict[str, list[float]], fail_when_repeated: frozenset = frozenset()) -> FakeTimer:
    timer = FakeTimer(times, fail_when_repeated)
    monkeypatch.setattr(autotune_module, "time_candidates", timer)
    return timer


@pytest.mark.parametrize("fastest, middle, slowest", [("vmap", "wide", "loop"), ("wide", "loop", "vmap"), ("loop", "vmap", "wide")])
def test_autotune_chooses_the_fastest_working_candidate(sample, monkeypatch, fastest, middle, slowest):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    timer = fake_times(monkeypatch, {fastest: [1.0], middle: [2.0], slowest: [3.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    (stage,) = tuned.stages
    assert stage.options.strategy.value == fastest
    assert stage.options.note.startswith(f"autotune chose {fastest} (min/median ms): {fastest} 1/1 ms, {middle} 2/2 ms, {slowest} 3/3 ms")
    assert all(r.ok for r in found["s0"]) and timer.rounds == {fastest: 1, middle: 1, slowest: 1}  # 2x apart: no re-timing


def test_a_wrong_candidate_is_never_chosen_when_timed_fastest(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    monkeypatch.setitem(RUNNERS, Strategy.WIDE, FastWrongRunner)
    timer = fake_times(monkeypatch, {"wide": [0.1], "loop": [1.0], "vmap": [2.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert tuned.stage("s0").options.strategy is Strategy.LOOP
    assert "wide" not in timer.rounds  # a wrong result is not even timed
    wide = next(r for r in found["s0"] if r.strategy == "wide")
    assert not wide.ok and wide.error.startswith("wrong result") and wide.max_rel_err > 1e-4


def test_a_candidate_that_fails_while_timed_is_never_chosen(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    fake_times(monkeypatch, {"vmap": [1.0], "wide": [2.0], "loop": [3.0]}, fail_when_repeated=frozenset({"vmap"}))
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert tuned.stage("s0").options.strategy is Strategy.WIDE
    assert "vmap failed (out of memory" in tuned.stage("s0").options.note


@pytest.mark.parametrize("second_round, winner", [({"vmap": [1.0, 1.5], "wide": [1.03, 1.0]}, "wide"),
                                                  ({"vmap": [1.0, 1.0], "wide": [1.03, 1.2]}, "vmap"),
                                                  ({"vmap": [1.0, 1.0], "wide": [1.05, 0.9]}, "wide")],  # exactly CLOSE apart
                         ids=["flips", "stays", "at-the-bound"])
def test_close_candidates_are_timed_again_and_the_second_timing_decides(sample, monkeypatch, second_round, winner):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    assert autotune_module.CLOSE == 0.05
    timer = fake_times(monkeypatch, {**second_round, "loop": [5.0]})
    tuned, _ = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert tuned.stage("s0").options.strategy.value == winner
    assert timer.rounds == {"vmap": 2, "wide": 2, "loop": 1}  # within CLOSE: the best two again, head to head


def test_two_close_candidates_alone_are_timed_again(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    timer = fake_times(monkeypatch, {"vmap": [1.0, 1.5], "wide": [1.03, 1.0]})
    tuned, _ = tune(plan, src.members(N), src.example_inputs, strategies=["vmap", "wide"], repeats=3)
    assert tuned.stage("s0").options.strategy is Strategy.WIDE and timer.rounds == {"vmap": 2, "wide": 2}


def test_candidates_further_apart_than_close_are_not_timed_again(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.propose(graph, N)
    timer = fake_times(monkeypatch, {"vmap": [1.0], "wide": [1.0 * (1 + autotune_module.CLOSE) + 0.01], "loop": [5.0]})
    tuned, _ = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert tuned.stage("s0").options.strategy is Strategy.VMAP and timer.rounds == {"vmap": 1, "wide": 1, "loop": 1}


@pytest.fixture
def mlp_two_stages(sample):
    src, graph = sample("mlp")
    return src, graph, planner.split(planner.propose(graph, N), graph, "s0", at="act")


PER_STAGE = {"vmap": [1.0], "wide": [2.0], "loop": [3.0]}


def test_a_faster_merged_stage_replaces_the_per_stage_plan(mlp_two_stages, monkeypatch):
    src, graph, plan = mlp_two_stages
    fake_times(monkeypatch, {**PER_STAGE, "per-stage": [2.0], "merged/vmap": [3.0], "merged/wide": [1.0], "merged/loop": [4.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    (stage,) = tuned.stages
    assert stage.options.strategy is Strategy.WIDE and stage.options.note.startswith("autotune merged all stages and chose wide")
    assert {r.strategy for r in found["s0"]} == {"per-stage", "merged/vmap", "merged/wide", "merged/loop"}
    planner.validate(tuned, graph)
    tuned_ok(src, tuned)


def test_the_per_stage_plan_stays_when_it_is_fastest(mlp_two_stages, monkeypatch):
    src, graph, plan = mlp_two_stages
    fake_times(monkeypatch, {**PER_STAGE, "per-stage": [1.0], "merged/vmap": [3.0], "merged/wide": [2.0], "merged/loop": [4.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert [s.options.strategy for s in tuned.stages] == [Strategy.VMAP, Strategy.VMAP]
    assert set(found) == {"s0", "s1"} and all("whole plan" in s.options.note for s in tuned.stages)


def test_a_wrong_merged_stage_is_never_chosen(mlp_two_stages, monkeypatch):
    """merged/wide runs wrong and is timed fastest: the tuned plan keeps the working per-stage plan."""
    src, graph, plan = mlp_two_stages
    real = RUNNERS[Strategy.WIDE]

    class WrongWhenMerged(real):
        def run(self, args):
            out = super().run(args)
            return [Batched(torch.zeros_like(v.tree)) for v in out] if len(self.program.stage.nodes) == 3 else out

    monkeypatch.setitem(RUNNERS, Strategy.WIDE, WrongWhenMerged)
    fake_times(monkeypatch, {**PER_STAGE, "per-stage": [2.0], "merged/vmap": [3.0], "merged/wide": [0.1], "merged/loop": [4.0]})
    tuned, found = tune(plan, src.members(N), src.example_inputs, strategies=EAGER, repeats=3)
    assert len(tuned.stages) == 2 and all(s.options.strategy is Strategy.VMAP for s in tuned.stages)
    tuned_ok(src, tuned)
