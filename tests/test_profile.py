"""executor.profile and executor.n_sweep: report contents, JSON round trip, faults (never timings)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from stagewise import executor
from stagewise import planner
from stagewise.executor.profile import max_rel_error
from stagewise.executor.report import ProfileReport, SweepReport
from stagewise.executor.stages import RUNNERS, VmapRunner
from stagewise.executor.timing import Timing, fault_hook, peak_memory_bytes, simulate_oom
from stagewise.executor.values import Batched
from stagewise.planner.plan import StageOptions, Strategy

N = 3
FAST = dict(repeats=3, warmup=1)


@pytest.fixture(scope="module")
def mlp_plan(sample):
    src, graph = sample("mlp")
    return src, planner.propose(graph, N, model="sample_models/mlp.py")


def plain_json(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and plain_json(v) for k, v in x.items())
    if isinstance(x, list):
        return all(plain_json(v) for v in x)
    return x is None or isinstance(x, (str, int, float, bool)) and not (isinstance(x, float) and not math.isfinite(x))


def test_profile_reports_stages_end_to_end_and_baselines(mlp_plan):
    src, plan = mlp_plan
    report = executor.profile(plan, src.members(N), src.example_inputs, **FAST)
    (stage,) = report.stages
    assert stage.id == "s0" and stage.strategy == "vmap" and stage.result.ok
    assert stage.result.max_rel_err <= 1e-4 and stage.loop.ok
    assert stage.flops > 0 and stage.gflops_per_s > 0
    assert stage.result.time.repeats == 3 and stage.result.time.p10_ms <= stage.result.time.p90_ms
    assert stage.result.peak_mem_bytes is not None
    assert report.end_to_end.ok and report.end_to_end.max_rel_err <= 1e-4
    assert {b.strategy for b in report.baselines} == {"loop", "vmap"}
    assert all(b.ok for b in report.baselines)
    assert report.n_members == N and report.device == "cpu" and report.torch_version == torch.__version__
    text = report.to_text()
    for needle in ("s0", "whole vmap", "loop (eager)", "stagewise plan", "GFLOP/s"):
        assert needle in text


def test_report_json_round_trip_is_plain_and_fits_in_a_plan_file(mlp_plan, tmp_path):
    src, plan = mlp_plan
    report = executor.profile(plan, src.members(N), src.example_inputs, **FAST)
    d = report.to_json()
    assert plain_json(d)
    again = ProfileReport.from_json(json.loads(json.dumps(d)))
    assert again.to_json() == d
    assert again.to_text() == report.to_text()
    path = plan.with_profile(d).save(tmp_path / "plan.json")
    assert planner.Plan.load(path).profile == d


def test_progress_counts_up_to_the_total(mlp_plan):
    src, plan = mlp_plan
    calls = []
    executor.profile(plan, src.members(N), src.example_inputs, progress=lambda d, t, label: calls.append((d, t, label)), **FAST)
    assert calls[-1][0] == calls[-1][1]
    assert all(0 <= d <= t for d, t, _ in calls)
    assert [d for d, _, _ in calls] == sorted(d for d, _, _ in calls)


def test_chrome_trace_has_one_label_per_stage(sample, tmp_path):
    src, graph = sample("data_dependent")  # five stages, batched and excluded
    plan = planner.propose(graph, N)
    path = tmp_path / "trace.json"
    report = executor.profile(plan, src.members(N), src.example_inputs, baselines=False, trace_path=str(path), **FAST)
    assert report.trace_path == str(path)
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    for s in plan.stages:
        assert any(str(n).startswith(f"stage {s.id} [") for n in names), s.id


def test_simulated_oom_marks_the_stage_failed_and_the_profile_goes_on(mlp_plan):
    src, plan = mlp_plan
    with simulate_oom(stage="s0", strategy="vmap"):
        report = executor.profile(plan, src.members(N), src.example_inputs, **FAST)
    (stage,) = report.stages
    assert not stage.result.ok and stage.result.error.startswith("out of memory")
    assert stage.loop.ok  # the loop of the stage still ran, and so did the baselines
    assert not report.end_to_end.ok and "s0" in report.end_to_end.error
    assert all(b.ok for b in report.baselines)
    assert "FAILED: out of memory" in report.to_text()


def test_simulated_oom_in_a_baseline_is_reported(mlp_plan):
    src, plan = mlp_plan
    with simulate_oom(stage="whole", strategy="vmap"):
        report = executor.profile(plan, src.members(N), src.example_inputs, **FAST)
    assert report.end_to_end.ok
    assert report.baseline("vmap").error.startswith("out of memory")
    assert report.baseline("loop").ok


class WrongRunner(VmapRunner):
    """A fast, wrong strategy: vmap plus one."""

    def run(self, args):
        return [Batched(v.tree + 1.0) for v in super().run(args)]


def test_a_wrong_strategy_is_reported_with_its_error(mlp_plan, monkeypatch):
    src, plan = mlp_plan
    monkeypatch.setitem(RUNNERS, Strategy.WIDE, WrongRunner)
    wide = plan.with_stages([replace(s, options=StageOptions(strategy=Strategy.WIDE)) for s in plan.stages])
    report = executor.profile(wide, src.members(N), src.example_inputs, **FAST)
    (stage,) = report.stages
    assert not stage.result.ok and stage.result.error.startswith("wrong result")
    assert stage.result.max_rel_err > 1e-4
    assert not report.end_to_end.ok


def test_cuda_without_cuda_is_a_device_error(mlp_plan):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    src, plan = mlp_plan
    with pytest.raises(planner.DeviceError, match="no CUDA device"):
        executor.profile(plan, src.members(N), src.example_inputs, device="cuda")


def test_excluded_stages_are_profiled_as_loops(sample):
    src, graph = sample("data_dependent")
    plan = planner.propose(graph, N)
    report = executor.profile(plan, src.members(N), src.example_inputs, **FAST)
    assert all(s.result.ok for s in report.stages)
    assert [s.strategy for s in report.stages if s.mode == "excluded"] == ["loop"] * sum(s.mode == "excluded" for s in report.stages)
    assert not report.baseline("vmap").ok  # whole-model vmap cannot do .item()
    assert report.end_to_end.ok


class ItemOutput(torch.nn.Module):
    """Returns a per-member Python number next to a tensor (the module gives it back as an [N] tensor)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, y.sum().item()


def test_per_member_number_outputs_are_checked_in_the_modules_layout():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    plan = planner.propose(planner.trace(ItemOutput().eval(), (x,)), N)
    members = [ItemOutput().eval() for _ in range(N)]
    report = executor.profile(plan, members, (x,), baselines=False, **FAST)
    assert report.end_to_end.ok, report.end_to_end.error
    assert report.end_to_end.max_rel_err <= 1e-4


@pytest.mark.gpu
def test_profile_on_gpu(mlp_plan):
    src, plan = mlp_plan
    report = executor.profile(plan, src.members(N), src.example_inputs, device="cuda", **FAST)
    assert report.device.startswith("cuda") and report.end_to_end.ok
    assert report.stages[0].result.peak_mem_bytes > 0


# --- pieces -------------------------------------------------------------------------------------

def test_max_rel_error_is_normwise_per_member():
    want = torch.stack([torch.full((4,), 1e-3), torch.full((4,), 1e3)])
    got = want.clone()
    got[0, 0] += 1e-6  # tiny in absolute terms, 1e-3 relative to member 0's scale
    assert max_rel_error(got, want) == pytest.approx(1e-3, rel=1e-3)
    assert max_rel_error(want, want) == 0.0
    assert max_rel_error(torch.zeros(2, 3), torch.zeros(2, 4)) == math.inf


def test_timing_summary():
    t = Timing.of([0.003, 0.001, 0.002, 0.010])
    assert t.min_ms == pytest.approx(1.0) and t.median_ms == pytest.approx(2.5) and t.repeats == 4
    assert Timing.from_json(t.__dict__) == t


def test_peak_memory_sees_a_large_temporary():
    size = 16 * 2**20
    peak = peak_memory_bytes(lambda: torch.ones(size // 4).sum(), torch.device("cpu"))
    assert peak >= size * 0.9


def test_fault_hook_sees_every_candidate(mlp_plan):
    src, plan = mlp_plan
    seen = []
    with fault_hook(lambda stage, strategy: seen.append((stage, strategy))):
        executor.profile(plan, src.members(N), src.example_inputs, **FAST)
    assert ("s0", "vmap") in seen and ("whole", "loop") in seen and ("whole", "vmap") in seen


def test_n_sweep_reports_break_even_and_memory_budget(sample):
    src, graph = sample("mlp")
    plan = planner.propose(graph, 1, "per_member")
    inputs_for = lambda n: executor.batched_inputs(plan.with_n_members(n), src.example_inputs)  # noqa: E731
    report = executor.n_sweep(plan, src.members, inputs_for, [1, 2, 4], memory_budget=64 * 2**20, repeats=3)
    assert [p.n for p in report.points] == [1, 2, 4]
    assert all(not p.error and p.stage_ms["s0"] > 0 and p.loop_ms["s0"] > 0 for p in report.points)
    assert set(report.break_even) == {"s0"}
    assert report.break_even["s0"] in (None, 1, 2, 4)
    assert report.max_n_in_budget == 4
    d = report.to_json()
    assert plain_json(d) and SweepReport.from_json(json.loads(json.dumps(d))).to_json() == d
    assert "break" in report.to_text() or "never beat" in report.to_text() or "beats the loop" in report.to_text()


INPLACE_MODEL = '''
"""Two Linears; the second's output is added in place into the first's."""
import torch
import torch.nn as nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h.add_(self.b(x))
        return h * 2


def build_model():
    return M().eval()


def example_inputs():
    return (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),)
'''


def test_a_stage_that_writes_in_place_is_timed_on_fresh_inputs(write_model):
    """Repeated timing calls must not accumulate the in-place write, nor leak it into the reference."""
    src = planner.load_model_file(write_model(INPLACE_MODEL))
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, N)
    add = next(n for n in graph.node_names if "add" in n)
    plan = planner.split(plan, graph, plan.stage_of(add).id, at=add)  # the write lands in a value from another stage
    members = src.members(N)
    report = executor.profile(plan, members, src.example_inputs, repeats=5, warmup=2)
    assert all(s.result.ok for s in report.stages), report.to_text()
    assert report.end_to_end.ok and report.end_to_end.max_rel_err <= 1e-4
    tuned = executor.autotune(plan, members, src.example_inputs, strategies=["vmap", "wide", "loop"], repeats=3)
    assert executor.verify(tuned, members, src.example_inputs).ok


# --- training profile (train=True) ------------------------------------------------------------------

def test_training_profile_times_the_step_of_the_plan_the_loop_and_the_torch_func_recipe(mlp_plan):
    src, plan = mlp_plan
    report = executor.profile(plan, src.members(N), src.example_inputs, train=True, **FAST)
    assert report.train and report.optimizer == "adam"
    assert report.end_to_end.ok and report.end_to_end.max_rel_err <= 1e-4  # gradients vs the loop's
    assert [b.strategy for b in report.baselines] == ["loop", "torch.func"]
    assert all(b.ok and b.time.repeats == 3 for b in report.baselines)
    assert report.baseline("torch.func").max_rel_err <= 1e-4
    (stage,) = report.stages  # forward + backward through the stage, against its member loop
    assert stage.result.ok and stage.result.max_rel_err <= 1e-4 and stage.loop.ok and stage.result.time is not None
    d = report.to_json()
    assert plain_json(d) and d["train"] is True
    back = ProfileReport.from_json(json.loads(json.dumps(d)))
    assert back.train and back.to_text().startswith("training profile (adam step)")
    assert not executor.profile(plan, src.members(N), src.example_inputs, **FAST).train  # inference stays the default


def test_training_profile_leaves_the_callers_members_untouched(mlp_plan):
    src, plan = mlp_plan
    members = src.members(N)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in members]
    executor.profile(plan, members, src.example_inputs, train=True, optimizer="sgd", **FAST)
    for m, b in zip(members, before):
        assert all(torch.equal(v, b[k]) for k, v in m.state_dict().items())


def test_training_profile_of_excluded_stages_and_a_failing_baseline(sample):
    src, graph = sample("transformer_block")  # attention is an excluded (loop) stage on CPU
    plan = planner.propose(graph, N)
    with simulate_oom(stage="whole", strategy="torch.func"):
        report = executor.profile(plan, src.members(N), executor.batched_inputs(plan, src.example_inputs), train=True, **FAST)
    assert any(s.mode == "excluded" for s in report.stages)
    assert all(s.result.ok and s.result.max_rel_err <= 1e-4 for s in report.stages)
    assert report.end_to_end.ok and report.baseline("loop").ok
    assert report.baseline("torch.func").error.startswith("out of memory")


def test_training_profile_reports_a_strategy_with_wrong_gradients(mlp_plan, monkeypatch):
    src, plan = mlp_plan
    monkeypatch.setitem(RUNNERS, Strategy.WIDE, WrongGradRunner)
    wide = plan.with_stages([replace(s, options=StageOptions(strategy=Strategy.WIDE)) for s in plan.stages])
    report = executor.profile(wide, src.members(N), src.example_inputs, train=True, **FAST)
    (stage,) = report.stages
    assert not stage.result.ok and stage.result.error.startswith("wrong result")
    assert not report.end_to_end.ok and report.baseline("loop").ok


class WrongGradRunner(VmapRunner):
    """Right forward, wrong backward: the output's gradient is doubled on its way back."""

    def run(self, args):
        return [Batched(v.tree + v.tree - v.tree.detach()) for v in super().run(args)]


def test_an_unknown_training_optimizer_is_refused(mlp_plan):
    src, plan = mlp_plan
    with pytest.raises(planner.StagewiseError, match="unknown optimizer"):
        executor.profile(plan, src.members(N), src.example_inputs, train=True, optimizer="lbfgs")


def test_training_profile_without_baselines_times_the_plan_alone(mlp_plan):
    src, plan = mlp_plan
    report = executor.profile(plan, src.members(N), src.example_inputs, train=True, baselines=False, **FAST)
    assert report.baselines == [] and report.end_to_end.ok and report.end_to_end.max_rel_err <= 1e-4
