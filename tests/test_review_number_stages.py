"""Stages that run as the member loop for a per_member Python number (BatchedModule.number_loops), in the training
profile and in autotune, checked against plain torch (the member loop, each member called with its own number):
profile(train=True) made the [N] tensor of the numbers a gradient leaf, which F.leaky_relu then refused as its slope
("must be Number, not Tensor": a crash, also of profile(train=True, autotune=True)); autotune tried vmap, wide and
compile on such a stage and listed them as failed with vmap's raw `.item()` text, where build already knows the stage
runs as the loop: they are listed as not applicable, with the reason, and loop is chosen."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.autotune import tune
from stagewise.executor.autotune_train import tune_training
from stagewise.executor.profile import Ticks
from stagewise.executor.profile_train import _profile_stages
from test_review_pm_numbers import CALLS, N, SHAPES, TOL, DictSlope, assert_grads_match, members_of, plan_of, quiet_call

torch.set_num_threads(1)
SLOPES = [0.01, 0.2, 0.5]
WHY = "not applicable: the stage takes a per_member Python number ('a' to leaky_relu) where torch needs a Python number"
RAW = (".item()", "vmap:", "must be Number", "data-dependent")  # what a batched candidate's own failure said


class Slope(nn.Module):
    """One stage: F.leaky_relu takes the per_member number as its slope."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, a):
        return self.fc2(F.leaky_relu(self.fc(x), a))


class HalfSlope(nn.Module):
    """Split into two stages at leaky_relu: s0 (vmap) makes the number `a * 0.5` and hands it, an [N] tensor, to s1."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, a):
        s = a * 0.5
        return self.fc2(F.leaky_relu(self.fc(x), s))


def one_stage():
    members = members_of(Slope)
    return members, plan_of(members, (torch.randn(*SHAPES[0]), 0.1), {"x": "shared", "a": "per_member"})


def two_stages():
    members = members_of(HalfSlope)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(*SHAPES[0]), 0.1))
    plan = planner.propose(graph, n_members=N, input_mode={"x": "shared", "a": "per_member"})
    plan = planner.split(plan, graph, "s0", at="leaky_relu")
    assert [s.nodes for s in plan.stages] == [("mul", "fc"), ("leaky_relu", "fc2")]
    return members, plan


def inputs_of(shape=SHAPES[0]):
    return torch.randn(*shape), torch.tensor(SLOPES)


def quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def assert_timed(result):
    t = result.time
    assert result.ok and t is not None and t.repeats >= 2, result
    assert 0 < t.min_ms <= t.p10_ms <= t.median_ms <= t.p90_ms, t


def assert_trains_as_the_loop(plan, members):
    """A training step through the built module: the stacked parameters' gradients are the members' own (1e-5)."""
    ens = executor.build(plan, members)
    ref = copy.deepcopy(members)
    ens.train()
    for shape in SHAPES:
        ens.zero_grad(set_to_none=True)
        for m in ref:
            m.zero_grad(set_to_none=True)
        x, a = inputs_of(shape)
        assert_grads_match(ens, ref, quiet_call(ens, x, a).square().sum(),
                           [m(x, float(v)).square().sum() for m, v in zip(ref, a)])


# --- 1. profile(train=True) -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [one_stage, two_stages], ids=["one_stage", "number_made_upstream"])
def test_the_training_profile_times_a_number_stage_as_the_loop(make):
    members, plan = make()
    keep = copy.deepcopy(members)
    report = quietly(executor.profile, plan, members, inputs_of(), train=True, repeats=3)  # was: a crash
    *before, stage = report.stages
    assert stage.strategy == "loop" and "per_member Python number ('a' to leaky_relu)" in stage.note, stage.note
    assert_timed(stage.result)
    assert stage.loop is stage.result  # the loop it runs is its own loop column: speedup 1.00x
    assert stage.result.max_rel_err is not None and stage.result.max_rel_err <= 1e-6  # gradients: the loop's own
    assert stage.flops > 0
    for s in before:  # the stage making the number batches (vmap), its gradients the loop's
        assert s.strategy == "vmap" and s.result.ok and s.result.max_rel_err <= 1e-5, s.result
        assert_timed(s.loop)
    assert report.train and report.end_to_end.ok, report.end_to_end.error
    assert_timed(report.end_to_end)
    assert report.end_to_end.max_rel_err <= 1e-5  # the stacked training step's gradients against N torch models'
    (loop,) = [b for b in report.baselines if b.strategy == "loop"]
    assert_timed(loop)
    for a, b in zip(members, keep):  # the caller's members untouched
        for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(p, q), k
    assert_trains_as_the_loop(plan, members)


def test_the_training_profile_autotuned_keeps_a_number_stage_the_loop():
    members, plan = two_stages()
    report = quietly(executor.profile, plan, members, inputs_of(), train=True, autotune=True, repeats=3, budget="quick")
    s0, s1 = report.stages  # was: a crash in the training autotune
    assert all(c.ok for c in s0.candidates) and {c.strategy for c in s0.candidates} == {"vmap", "wide", "loop"}
    assert s1.strategy == "loop" and s1.result.ok and report.end_to_end.ok, report.end_to_end.error
    refused = {c.strategy: c.error for c in s1.candidates if not c.ok}
    assert refused == {"vmap": WHY, "wide": WHY}, refused
    assert "  vmap" in report.to_text() and "failed: not applicable" not in report.to_text()
    assert_trains_as_the_loop(planner.Plan.from_json(report.plan), members)


def test_a_number_inside_a_dict_input_is_no_gradient_leaf():
    """(profile() itself refuses a dict input before any stage runs: verify.member_inputs indexes it [i]; the stages'
    profile is what this checks: cfg['slope'], an [N] leaf, made a grad leaf, crashed it alike.)"""
    members = members_of(DictSlope)
    b = SHAPES[0][0]
    plan = plan_of(members, (torch.randn(*SHAPES[0]), {"scale": torch.ones(b), "slope": 0.1}), {"x": "shared", "cfg": "per_member"})
    inputs = (torch.randn(*SHAPES[0]), {"scale": torch.rand(N, b), "slope": torch.tensor(SLOPES)})
    ens = executor.build(plan, members)
    ens.train()
    (stage,) = quietly(_profile_stages, ens, inputs, torch.device("cpu"), 3, 1, Ticks(None, 1), {}, {})  # was: a crash
    assert stage.strategy == "loop" and "cfg['slope']" in stage.note
    assert_timed(stage.result)
    assert stage.result.max_rel_err <= 1e-6
    from stagewise.executor.stage_grads import per_member_numbers  # (new with the fix)

    assert per_member_numbers(ens, ens.bind_inputs(inputs)) == {"cfg": frozenset({("slope",)})}


# --- 2. autotune ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [one_stage, two_stages], ids=["one_stage", "number_made_upstream"])
def test_autotune_does_not_try_batched_strategies_on_a_number_stage(make):
    members, plan = make()
    tuned, found = quietly(tune, plan, members, inputs_of(), repeats=2, budget="quick")
    stage_results = found.get(f"per-stage {plan.stages[-1].id}", found.get(plan.stages[-1].id))
    refused = {c.strategy: c.error for c in stage_results if not c.ok}
    assert refused == {"vmap": WHY, "wide": WHY, "compile": WHY}, refused  # were vmap's and wide's own errors
    assert [c.strategy for c in stage_results if c.ok] == ["loop"]
    every = [c.error for results in found.values() for c in results] + [s.options.note for s in tuned.stages]
    assert not [e for e in every if any(raw in e for raw in RAW)], every
    for stage in tuned.stages:
        assert stage.options.strategy is planner.Strategy.LOOP or stage.id == "s0" and len(tuned.stages) == 2
    assert "not applicable (the stage takes a per_member Python number ('a' to leaky_relu)" in tuned.stages[-1].options.note
    if len(plan.stages) == 2:  # one merged stage holds the number too: only merged/loop is tried (said in the note)
        assert "merged/compile, merged/wide, merged/vmap not applicable (the stage takes" in tuned.stages[-1].options.note
    ens = executor.build(tuned, members)
    assert ens.number_loops == {}  # the tuned plan says loop itself
    ref = copy.deepcopy(members)
    for shape in SHAPES:
        for _ in range(CALLS):
            x, a = inputs_of(shape)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no number-loop warning: the plan runs the stage as the loop it is
                with torch.no_grad():
                    got = ens(x, a)
            with torch.no_grad():
                want = torch.stack([m(x, float(v)) for m, v in zip(ref, a)])
            torch.testing.assert_close(got, want, **TOL)
    assert_trains_as_the_loop(tuned, members)


def test_autotune_for_training_does_not_try_batched_strategies_on_a_number_stage():
    members, plan = two_stages()
    tuned, found = quietly(tune_training, plan, members, inputs_of(), repeats=2, budget="quick")
    assert {c.strategy: c.error for c in found["s1"] if not c.ok} == {"vmap": WHY, "wide": WHY}
    assert [s.options.strategy.value for s in tuned.stages][1] == "loop"
    assert not any(raw in tuned.stages[1].options.note for raw in RAW), tuned.stages[1].options.note
    assert_trains_as_the_loop(tuned, members)
