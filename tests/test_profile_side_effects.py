"""executor.profile (inference and train=True) and executor.verify never change the caller's members, and
measure every error against the member loop from the state the loop started from.

Each of them runs the member loop as the reference, and profile runs each stage's strategy and its loop
on the same stage inputs: for a model whose forward updates buffers (BatchNorm in training mode, a call
counter, a running total the output reads) or counts its calls in a Python attribute, every such run moves
the state. The caller's members (every parameter and buffer, torch.equal, and those attributes) must be
exactly as before, and no stage or end-to-end result may report an error that only comes from the
reference having moved the state first.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.candidates import private_members
from stagewise.executor.verify import DEFAULT_RTOL

from test_autotune_side_effects import Normed  # BatchNorm between two linears

N = 3


class CallCounter(nn.Module):
    """Counts its calls in a buffer, keeps a running total of the input mean in a buffer (the output reads it, so a
    reference that ran first changes what a later run returns), and counts eager calls in a Python attribute
    (left alone while torch.fx traces it: a log of calls the graph need not repeat)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(4))
        self.python_calls = 0

    def forward(self, x):
        if not torch.fx._symbolic_trace.is_fx_tracing():
            self.python_calls += 1
        self.calls.add_(1)
        self.total.add_(x.detach().mean(0))
        return self.fc(x) + self.total


CASES = [pytest.param(CallCounter, False, "shared", id="counter-shared"),
         pytest.param(CallCounter, False, "per_member", id="counter-per-member"),
         pytest.param(Normed, True, "shared", id="batchnorm-train-shared"),
         pytest.param(Normed, True, "per_member", id="batchnorm-train-per-member")]


def _members(cls, train: bool):
    torch.manual_seed(0)
    return [cls().train(train) for _ in range(N)]


def _inputs(mode: str):
    torch.manual_seed(1)
    return (torch.randn(N, 6, 4),) if mode == "per_member" else (torch.randn(6, 4),)


def _plan(members, mode: str):
    example = (torch.randn(6, 4),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return planner.propose(planner.trace(copy.deepcopy(members[0]), example), n_members=N, input_mode=mode)


def _state(members) -> list[dict]:
    """Every state tensor (cloned), the Python counter and the mode of each member."""
    return [({k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()},
             getattr(m, "python_calls", None), [s.training for s in m.modules()]) for m in members]


def _assert_same_state(before, members, what: str) -> None:
    for i, ((tensors, calls, modes), (t_after, c_after, m_after)) in enumerate(zip(before, _state(members))):
        assert tensors.keys() == t_after.keys()
        changed = [k for k in tensors if not torch.equal(tensors[k], t_after[k])]
        assert not changed, f"{what} changed member {i}'s {changed}"
        assert calls == c_after, f"{what} ran member {i}'s forward ({calls} -> {c_after} calls)"
        assert modes == m_after, f"{what} changed member {i}'s train/eval mode"


def _setup(cls, train, mode):
    """Members, inputs, the proposed plan, and the members' state before anything ran."""
    members = _members(cls, train)
    inputs = _inputs(mode)
    return members, inputs, _plan(members, mode), _state(members)


def _profile(plan, members, inputs, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap fallback warnings are expected here
        return executor.profile(plan, members, inputs, repeats=2, warmup=1, **kwargs)


@pytest.mark.parametrize("cls, train, mode", CASES)
def test_profile_leaves_the_members_as_they_were_and_reports_no_false_error(cls, train, mode):
    members, inputs, plan, before = _setup(cls, train, mode)
    report = _profile(plan, members, inputs)
    _assert_same_state(before, members, "profile")
    for s in report.stages:
        assert s.result.ok and s.result.max_rel_err <= DEFAULT_RTOL, (s.id, s.result.error, s.result.max_rel_err)
        assert s.loop.ok, (s.id, s.loop.error)
    assert report.end_to_end.ok and report.end_to_end.max_rel_err <= DEFAULT_RTOL, report.end_to_end.error
    for b in report.baselines:
        assert b.ok and (b.max_rel_err is None or b.max_rel_err <= DEFAULT_RTOL), (b.strategy, b.error, b.max_rel_err)


def test_every_stage_strategy_of_a_stateful_plan_is_checked_from_the_loops_starting_state():
    """Stage strategies other than the plan's own vmap: the loop strategy and an excluded stage are judged
    against the same loop reference, so any error they report comes from a moved state."""
    members = _members(CallCounter, False)
    inputs = _inputs("shared")
    plan = _plan(members, "shared")
    plan = planner.Plan.from_json({**plan.to_json(), "stages": [
        {**s, "options": {**s.get("options", {}), "strategy": "loop"}} for s in plan.to_json()["stages"]]})
    before = _state(members)
    report = _profile(plan, members, inputs, baselines=False)
    _assert_same_state(before, members, "profile")
    assert all(s.result.ok for s in report.stages), [(s.id, s.result.error) for s in report.stages]
    assert report.end_to_end.ok, report.end_to_end.error


@pytest.mark.parametrize("cls, train, mode", [CASES[0], CASES[3]])
def test_profile_with_autotune_leaves_the_members_as_they_were(cls, train, mode):
    members = _members(cls, train)
    inputs = _inputs(mode)
    before = _state(members)
    report = _profile(_plan(members, mode), members, inputs, autotune=True, budget="quick")
    _assert_same_state(before, members, "profile(autotune=True)")
    assert report.end_to_end.ok, report.end_to_end.error


@pytest.mark.parametrize("cls, train, mode", CASES)
def test_training_profile_leaves_the_members_as_they_were_and_reports_no_false_error(cls, train, mode):
    members, inputs, plan, before = _setup(cls, train, mode)
    report = _profile(plan, members, inputs, train=True, optimizer="sgd")
    _assert_same_state(before, members, "profile(train=True)")
    for s in report.stages:
        assert s.result.ok, (s.id, s.result.error)
    assert report.end_to_end.ok, report.end_to_end.error
    assert all(b.ok for b in report.baselines), [(b.strategy, b.error) for b in report.baselines]


@pytest.mark.parametrize("cls, train, mode", CASES)
def test_verify_leaves_the_members_as_they_were(cls, train, mode):
    members, inputs, plan, before = _setup(cls, train, mode)
    more = (torch.randn(N, 9, 4),) if mode == "per_member" else (torch.randn(9, 4),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = executor.verify(plan, members, inputs, calls=3, more_inputs=[more])
    _assert_same_state(before, members, "verify")
    assert report.ok, report.to_text()


def test_private_members_copies_the_callers_members_once():
    """profile hands its private copies on to autotune: copying them again would double the members' memory."""
    members = _members(Normed, True)
    copies = private_members(members, torch.device("cpu"))
    assert all(c is not m for c, m in zip(copies, members))
    again = private_members(copies, torch.device("cpu"))
    assert all(a is c for a, c in zip(again, copies))


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x)))


@pytest.mark.parametrize("tool", ["profile", "autotune", "n_sweep"])
def test_the_tools_leave_the_callers_random_stream_where_it_was(tool):
    torch.manual_seed(0)
    members = [Dropped().train() for _ in range(N)]
    x = torch.randn(4, 6)
    plan = planner.propose(planner.trace(members[0], (x,)), N)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    if tool == "profile":
        executor.profile(plan, members, (x,), repeats=2)
    elif tool == "autotune":
        executor.autotune(plan, members, (x,), budget="quick")
    else:
        executor.n_sweep(plan, lambda n: [Dropped().train() for _ in range(n)], lambda n: (x,), [1, 2], repeats=2)
    torch.testing.assert_close(torch.rand(3), want, rtol=0, atol=0)


def test_n_sweep_says_where_the_plan_answers_otherwise_than_the_loop(monkeypatch):
    import sys

    profile_module = sys.modules["stagewise.executor.profile"]
    real = profile_module.build

    def corrupt(*args, **kwargs):  # any build bug: the last member's stacked weight off by half
        module = real(*args, **kwargs)
        module.stacked_state["fc2.weight"].data[-1].mul_(1.5)
        return module

    torch.manual_seed(0)
    make = lambda n: [Dropped().eval() for _ in range(n)]  # noqa: E731
    x = torch.randn(4, 6)
    plan = planner.propose(planner.trace(make(1)[0], (x,)), 2)
    monkeypatch.setattr(profile_module, "build", corrupt)
    report = executor.n_sweep(plan, make, lambda n: (x,), [2], repeats=2)
    assert "wrong result" in report.points[0].error and "failed: end to end" in report.to_text()


def test_profile_says_when_the_plan_end_to_end_is_not_compared():
    class TwoDrops(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = nn.functional.dropout(self.fc1(x), 0.2, True)
            return self.fc3(nn.functional.dropout(self.fc2(h), 0.2, True))

    torch.manual_seed(0)
    members = [TwoDrops() for _ in range(N)]
    x = torch.randn(4, 6)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, N)
    for s in plan.stages:
        plan = planner.set_options(plan, graph, s.id, strategy="loop")
    plan = planner.split(plan, graph, plan.stages[0].id, "fc2") if len(plan.stages) == 1 else plan
    report = executor.profile(plan, members, (x,), repeats=2)
    assert any("end to end not compared" in n for n in report.notes), report.notes
