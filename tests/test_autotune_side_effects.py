"""autotune never changes the caller's members, and checks every candidate from the state the loop started from.

autotune runs each stage's candidates many times, the member loop as the reference, a whole-plan graph
first on redrawn inputs: for a model whose forward updates buffers (BatchNorm in training mode, a
call counter, a running total) each of those runs moves the state. The caller's members and buffers
must be exactly as before, no candidate may be judged against the loop from another state (a
correct one then fails as a "wrong result"), and the tuned plan built afterwards must match the
member loop from the same starting state, call after call.
"""
from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.autotune import WHOLE_GRAPH, tune
from stagewise.executor.capture import ReplayBackend

build_module = importlib.import_module("stagewise.executor.build")
autotune_module = importlib.import_module("stagewise.executor.autotune")
N = 3


class CallCounter(nn.Module):
    """Counts its calls and keeps a running total of the input mean in buffers; the output reads the total."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.calls.add_(1)
        self.total.add_(x.detach().mean(0))
        return self.fc(x) + self.total


class Normed(nn.Module):
    """BatchNorm between two linears: in training mode forward updates the running statistics."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


CASES = [pytest.param(CallCounter, False, id="counter-eval"), pytest.param(Normed, True, id="batchnorm-train"),
         pytest.param(Normed, False, id="batchnorm-eval")]


def _members(cls, train: bool):
    torch.manual_seed(0)
    return [cls().train(train) for _ in range(N)]


def _state(members) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in members]


def _assert_same_state(before, members) -> None:
    after = _state(members)
    for i, (b, a) in enumerate(zip(before, after)):
        assert b.keys() == a.keys()
        changed = [k for k in b if not torch.equal(b[k], a[k])]
        assert not changed, f"autotune changed member {i}'s {changed}"


def _tune(plan, members, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap fallback and export warnings are expected here
        return tune(plan, members, (x,), budget="quick", **kwargs)


def _plan(members, x):
    return planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)


def _matches_the_loop(plan, start, x, train: bool, calls: int = 3) -> None:
    """`plan` built from copies of `start` against the member loop over other copies, call after call."""
    ens = executor.build(plan, copy.deepcopy(start)).train(train)
    ref = copy.deepcopy(start)
    with torch.no_grad():
        for call in range(calls):
            want = torch.stack([m(x) for m in ref])
            torch.testing.assert_close(ens(x), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"call {call}: {m}")


@pytest.mark.parametrize("cls, train", CASES)
def test_autotune_leaves_the_members_and_their_buffers_as_they_were(cls, train):
    members = _members(cls, train)
    x = torch.randn(6, 4)
    plan = _plan(members, x)
    before, start = _state(members), copy.deepcopy(members)
    tuned, _ = _tune(plan, members, x)
    _assert_same_state(before, members)
    assert [m.training for m in members] == [train] * N
    _matches_the_loop(tuned, start, x, train)


def test_with_per_member_inputs_too():
    members = _members(Normed, True)
    x = torch.randn(N, 6, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    before, start = _state(members), copy.deepcopy(members)
    tuned, _ = _tune(plan, members, x)
    _assert_same_state(before, members)
    ens = executor.build(tuned, copy.deepcopy(start)).train(True)
    ref = copy.deepcopy(start)
    with torch.no_grad():
        for call in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(ref)]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls, train", CASES)
def test_every_candidate_is_checked_from_the_state_the_loop_started_from(cls, train):
    """The member loop itself is a candidate: judged against the loop from one starting state it must match,
    so a "wrong result" for it means the reference and the candidate ran from different states."""
    members = _members(cls, train)
    x = torch.randn(6, 4)
    _, found = _tune(_plan(members, x), members, x)
    wrong = [(stage, r.strategy, r.error) for stage, results in found.items() for r in results
             if r.error.startswith("wrong result")]
    assert not wrong, wrong
    loops = [(stage, r.ok) for stage, results in found.items() for r in results if r.strategy in ("loop", "merged/loop")]
    assert loops and all(ok for _, ok in loops), loops


def test_the_whole_plan_graph_is_checked_from_the_starting_state_after_its_capture_call(monkeypatch):
    """The whole-plan graph candidate first runs on redrawn inputs (so the checked call is a replay): that call
    updates the buffers, and the check must still start from the state the loop started from."""
    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", ReplayBackend)
    results, real = {}, autotune_module.try_strategy

    def recording(label, stage_id, *args, **kwargs):
        res = real(label, stage_id, *args, **kwargs)
        if stage_id == "whole":
            results[label] = res[0]
        return res

    monkeypatch.setattr(autotune_module, "try_strategy", recording)
    members = _members(CallCounter, False)
    x = torch.randn(6, 4)
    before, start = _state(members), copy.deepcopy(members)
    tuned, _ = _tune(_plan(members, x), members, x, strategies=["vmap", "loop"])
    assert results[WHOLE_GRAPH].ok, results[WHOLE_GRAPH].error
    assert results["per-stage"].ok, results["per-stage"].error
    _assert_same_state(before, members)
    _matches_the_loop(tuned, start, x, False)
