"""executor.n_sweep's answers (break-even N, largest N in a memory budget) from controlled numbers:
profile is replaced by a table of times and peak memory per N, so each answer is unique."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from stagewise import executor
from stagewise import planner
from stagewise.executor.report import StrategyResult
from stagewise.executor.timing import Timing
from stagewise.planner.plan import Strategy

sweep_module = importlib.import_module("stagewise.executor.sweep")


def timed(ms: float, peak: int | None = None) -> StrategyResult:
    return StrategyResult("x", ok=True, time=Timing(ms, ms, ms, ms, 1), peak_mem_bytes=peak)


class FakeProfile:
    """profile() as a table: n -> ({stage id: (stage ms, loop ms)}, peak bytes), or an exception to raise."""

    def __init__(self, table: dict):
        self.table, self.calls = table, []

    def __call__(self, plan, members, inputs, **kwargs):
        n = plan.n_members
        self.calls.append(n)
        assert len(members) == n and inputs == ("inputs", n)
        entry = self.table[n]
        if isinstance(entry, Exception):
            raise entry
        stages, peak = entry
        loop = timed(10.0 * n)
        return SimpleNamespace(
            stages=[SimpleNamespace(id=sid, result=timed(ms), loop=timed(loop_ms)) for sid, (ms, loop_ms) in stages.items()],
            end_to_end=timed(float(n), peak), baseline=lambda name: loop if name == "loop" else None)


@pytest.fixture(scope="module")
def three_stages(sample):
    """mlp as s0 (fc1) | s1 (act) | s2 (fc2)."""
    _, graph = sample("mlp")
    plan = planner.propose(graph, 1)
    plan = planner.split(planner.split(plan, graph, "s0", at="act"), graph, "s1", at="fc2")
    assert [s.nodes for s in plan.stages] == [("fc1",), ("act",), ("fc2",)]
    return plan, graph


# s0 beats its loop from N=4 on; s1 wins at 2, loses at 4, wins again at 8 (break-even 8: every larger N must win);
# s2 never wins (a tie at 8 is no win)
TIMES = {1: {"s0": (2.0, 1.0), "s1": (2.0, 1.0), "s2": (3.0, 1.0)},
         2: {"s0": (2.0, 1.5), "s1": (1.0, 2.0), "s2": (3.0, 2.0)},
         4: {"s0": (1.0, 2.0), "s1": (3.0, 2.0), "s2": (3.0, 2.5)},
         8: {"s0": (1.0, 3.0), "s1": (1.0, 3.0), "s2": (3.0, 3.0)}}
PEAK = {1: 1100, 2: 1200, 4: 1400, 8: 1800}  # 1000 + 100 N bytes


def sweep(monkeypatch, plan, table, ns=(1, 2, 4, 8), **kwargs):
    fake = FakeProfile(table)
    monkeypatch.setattr(sweep_module, "profile", fake)
    report = executor.n_sweep(plan, lambda n: [None] * n, lambda n: ("inputs", n), list(ns), **kwargs)
    return report, fake


def table(times=TIMES, peak=PEAK) -> dict:
    return {n: (times[n], peak[n]) for n in times}


def test_break_even_is_the_smallest_n_from_which_every_larger_n_wins(monkeypatch, three_stages):
    plan, _ = three_stages
    report, fake = sweep(monkeypatch, plan, table(), ns=(8, 1, 4, 2, 4))
    assert fake.calls == [1, 2, 4, 8]  # sorted, each once
    assert [p.n for p in report.points] == [1, 2, 4, 8]
    assert report.break_even == {"s0": 4, "s1": 8, "s2": None}
    assert report.points[2].stage_ms == {"s0": 1.0, "s1": 3.0, "s2": 3.0} and report.points[2].loop_ms["s0"] == 2.0
    assert report.points[3].end_to_end_ms == 8.0 and report.points[3].loop_end_to_end_ms == 80.0
    text = report.to_text()
    assert "s0: batching beats the loop from N=4" in text and "s2: batching never beat the loop" in text


def test_a_stage_that_wins_everywhere_breaks_even_at_the_smallest_n(monkeypatch, three_stages):
    plan, _ = three_stages
    wins = {n: {sid: (1.0, 2.0) for sid in ("s0", "s1", "s2")} for n in TIMES}
    report, _ = sweep(monkeypatch, plan, table(wins))
    assert report.break_even == {"s0": 1, "s1": 1, "s2": 1}


def test_a_failed_n_is_reported_and_left_out_of_the_answers(monkeypatch, three_stages):
    plan, _ = three_stages
    rows = table()
    rows[16] = RuntimeError("out of memory while stacking\nmore detail")
    report, _ = sweep(monkeypatch, plan, rows, ns=(1, 2, 4, 8, 16), memory_budget=1650)
    assert report.points[-1].n == 16 and report.points[-1].error == "RuntimeError: out of memory while stacking"
    assert report.break_even == {"s0": 4, "s1": 8, "s2": None}
    assert (report.max_n_in_budget, report.max_n_estimate) == (4, 6)


def test_looped_stages_have_no_break_even(monkeypatch, three_stages):
    plan, graph = three_stages
    plan = planner.set_options(plan, graph, "s0", strategy=Strategy.LOOP)
    report, _ = sweep(monkeypatch, plan, table())
    assert report.break_even == {"s0": None, "s1": 8, "s2": None}
    assert report.notes == ["s0 runs as a member loop in this plan (no break-even)"]


@pytest.mark.parametrize("budget, fits, estimate", [
    (1650, 4, 6),     # 1400 <= 1650 < 1800; (1650 - 1000) / 100 = 6.5
    (1800, 8, 8),     # exactly the peak at N=8 fits
    (1799, 4, 7),
    (5000, 8, 40),
    (1050, None, 0),  # nothing measured fits; the line says 0.5 members
    (None, None, None),
])
def test_memory_budget_answers(monkeypatch, three_stages, budget, fits, estimate):
    plan, _ = three_stages
    report, _ = sweep(monkeypatch, plan, table(), memory_budget=budget)
    assert (report.memory_budget, report.max_n_in_budget, report.max_n_estimate) == (budget, fits, estimate)


def test_memory_that_does_not_grow_gives_no_estimate(monkeypatch, three_stages):
    plan, _ = three_stages
    report, _ = sweep(monkeypatch, plan, table(peak={n: 1000 for n in TIMES}), memory_budget=1500)
    assert (report.max_n_in_budget, report.max_n_estimate) == (8, None)
    report, _ = sweep(monkeypatch, plan, {2: (TIMES[2], 1200)}, ns=(2,), memory_budget=1500)
    assert (report.max_n_in_budget, report.max_n_estimate) == (2, 2)  # one point: no line to fit


def test_progress_counts_every_n(monkeypatch, three_stages):
    plan, _ = three_stages
    calls = []
    sweep(monkeypatch, plan, table(), progress=lambda done, total, label: calls.append((done, total, label)))
    assert calls == [(0, 4, "N=1"), (1, 4, "N=2"), (2, 4, "N=4"), (3, 4, "N=8"), (4, 4, "done")]


def test_a_real_sweep_reports_answers_consistent_with_its_points(sample):
    """Measured on the real profiler: the answers are the ones its own points imply (no timing asserted)."""
    src, graph = sample("mlp")
    plan = planner.propose(graph, 1, "per_member")
    inputs_for = lambda n: executor.batched_inputs(plan.with_n_members(n), src.example_inputs)  # noqa: E731
    probe = executor.n_sweep(plan, src.members, inputs_for, [1, 3], memory_budget=2**40, repeats=3)
    assert all(not p.error and p.peak_mem_bytes > 0 and p.stage_ms["s0"] > 0 and p.loop_ms["s0"] > 0 for p in probe.points)
    assert probe.max_n_in_budget == 3
    wins = [p.stage_ms["s0"] < p.loop_ms["s0"] for p in probe.points]
    assert probe.break_even["s0"] == (1 if all(wins) else 3 if wins[1] else None)
