"""Review: the forced `wide` strategy on a functional batch norm whose running statistics are views of one buffer,
verify's member loop with per_member inputs that forward() writes in place before an op saves them for backward, and a
sweep of forced strategies (vmap, wide, compile, loop) over models that update state, three consecutive calls at two
input shapes, each against the plain member loop (float32, tight).

verify handed each member a row x[i] of one stacked input: the rows share one version counter, so member 1's
`x.mul_(2)` bumped the version member 0's Linear had saved and verify(..., grads=True) raised the loop's own
"modified by an inplace operation" RuntimeError, where the plain loop, each member given its own tensor, runs.
"""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.strategies import compiled
from stagewise.planner import StageMode
from stagewise.planner.errors import StagewiseError

verify_module = importlib.import_module("stagewise.executor.verify")  # the module: executor.verify is the function
N = 3
TIGHT = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _one_thread_and_quick_compile(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # the compile plumbing, without inductor's codegen time


def _members(cls, n=N, train=False):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        m = cls()
        m.train(train)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))  # members apart, biases too
        out.append(m)
    return out


def _forced(members, example, strategy, input_mode="per_member"):
    """The proposed plan with `strategy` on every stage (vmap on batched stages only: excluded ones keep their loop)."""
    graph = planner.trace(copy.deepcopy(members[0]), example)
    plan = planner.propose(graph, n_members=len(members), input_mode=input_mode)
    for s in plan.stages:
        if not (strategy == "vmap" and s.mode is StageMode.EXCLUDED):
            plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    return plan


def _assert_like_the_loop(ens, reference, inputs):
    """Each call's outputs and every member's state after it equal the member loop's on the same per_member inputs."""
    for call, x in enumerate(inputs):
        with torch.no_grad():
            got = ens(x.clone())
            want = torch.stack([m(x[i].clone()) for i, m in enumerate(reference)])
        torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"call {call}: {m}")
        for i, m in enumerate(reference):
            for k, v in m.state_dict().items():
                torch.testing.assert_close(ens.member_state_dicts()[i][k], v, **TIGHT,
                                           msg=lambda msg: f"call {call} member {i} {k}: {msg}")


# --- 1. wide on running statistics held as views of one buffer ------------------------------------------------------

class ViewStats(nn.Module):
    """F.batch_norm / F.instance_norm updating running statistics handed as rows of one buffer ([mean; var])."""

    def __init__(self, instance=False):
        super().__init__()
        self.fc, self.instance = nn.Linear(4, 4), instance
        self.register_buffer("stats", torch.stack([torch.zeros(4), torch.ones(4)]))

    def forward(self, x):
        if self.instance:  # x [B, 4, L]
            h = F.instance_norm(x, self.stats[0], self.stats[1], use_input_stats=True, momentum=0.1).mean(-1)
        else:  # x [B, 4]
            h = F.batch_norm(x, self.stats[0], self.stats[1], None, None, True, 0.1, 1e-5)
        return self.fc(h) + self.stats[0]  # the statistics are read again


class ViewInstanceStats(ViewStats):
    def __init__(self):
        super().__init__(instance=True)


@pytest.mark.parametrize("cls, shapes", [(ViewStats, [(6, 4), (9, 4)]), (ViewInstanceStats, [(2, 4, 5), (3, 4, 7)])])
@pytest.mark.parametrize("merged", [False, True], ids=["own stage", "one stage"])
def test_forced_wide_updates_running_statistics_held_as_views_like_the_loop(cls, shapes, merged):
    # The planner excludes the norm (vmap drops the update of a view of a stacked buffer); wide forced on every stage,
    # the norm alone or merged with the buffer's rows and the reads, must move each member's buffer as the loop does
    members = _members(cls)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(*shapes[0]),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    assert any(s.mode is StageMode.EXCLUDED and "view of buffer 'stats'" in s.reason for s in plan.stages)
    while merged and len(plan.stages) > 1:
        plan = planner.merge(plan, graph, plan.stages[0].id, plan.stages[1].id)
    for s in plan.stages:
        plan = planner.set_options(plan, graph, s.id, strategy="wide")
    ens = executor.build(plan, copy.deepcopy(members))
    torch.manual_seed(5)
    inputs = [torch.randn(N, *shapes[k % 2]) * 2 + 3 for k in range(3)]
    _assert_like_the_loop(ens, members, inputs)
    assert not torch.equal(members[0].stats, torch.stack([torch.zeros(4), torch.ones(4)]))  # the update happened


# --- 2. verify: each member's per_member input is its own tensor ----------------------------------------------------

class ScaleInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x.mul_(2)  # writes its input in place; the Linear then saves it for backward
        return self.fc(x)


def test_verify_with_grads_runs_members_that_write_their_input_before_saving_it():
    # Was: RuntimeError "one of the variables needed for gradient computation has been modified by an inplace
    # operation ... is at version 3; expected version 1": the members' rows of one stacked input share a version
    members = _members(ScaleInput, train=True)
    x = torch.randn(N, 5, 4)
    plain = [m(x[i].clone()) for i, m in enumerate(copy.deepcopy(members))]
    sum(o.sum() for o in plain).backward()  # the plain loop, own tensors, runs
    graph = planner.trace(copy.deepcopy(members[0]), (x[0].clone(),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    report = executor.verify(plan, members, (x,), grads=True, calls=3)
    assert report.ok, report.to_text()
    assert {r.name for r in report.gradients} >= {"fc.weight", "fc.bias"}, report.to_text()
    assert all(r.max_rel <= 1e-6 for r in report.gradients), report.to_text()


def test_verify_with_grads_still_reports_a_real_mismatch_there(monkeypatch):
    # the copies must not hide a batched module that differs: member 1's stacked weight nudged after build
    members = _members(ScaleInput, train=True)
    x = torch.randn(N, 5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x[0].clone(),)), n_members=N,
                           input_mode="per_member")
    real_build = verify_module.build

    def nudged_build(*args, **kwargs):
        module = real_build(*args, **kwargs)
        with torch.no_grad():
            dict(module.named_stacked_parameters())["fc.weight"][1].add_(0.01)
        return module

    monkeypatch.setattr(verify_module, "build", nudged_build)
    report = executor.verify(plan, members, (x,), grads=True)
    assert not report.ok
    assert any(not r.ok for r in report.outputs if "(with gradients)" in r.name), report.to_text()


def test_own_member_inputs_copies_per_member_rows_only():
    members = _members(ScaleInput)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(5, 4),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    x = torch.randn(N, 5, 4)
    own = verify_module.own_member_inputs(plan, (x,), 1)
    assert torch.equal(own[0], x[1]) and own[0].data_ptr() != x[1].data_ptr()


# --- 3. forced strategies x 3 calls x 2 shapes on models that update state --------------------------------------------

class TrainBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.fc(x) * self.count


class SliceWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.register_buffer("mem", torch.randn(4, 5))

    def forward(self, x):
        h = self.fc(x)
        self.mem[:, :2].mul_(0.5).add_(h.mean(0)[:2].detach())
        return h + self.mem.sum(0)


class NormStats(nn.Module):
    """F.batch_norm on whole running-statistics buffers (test-time adaptation style)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(5))
        self.register_buffer("var", torch.ones(5))
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = F.batch_norm(x, self.mean, self.var, None, None, True, 0.1, 1e-5)
        return self.fc(h + self.mean)


@pytest.mark.parametrize("strategy", ["vmap", "wide", "compile", "loop"])
@pytest.mark.parametrize("cls, train", [(TrainBN, True), (Counter, False), (SliceWrite, False), (NormStats, False)],
                         ids=["bn-train", "counter", "slice-write", "norm-stats"])
def test_forced_strategies_match_the_loop_over_calls_and_shapes(cls, train, strategy):
    members = _members(cls, train=train)
    plan = _forced(members, (torch.randn(4, 5),), strategy)
    try:
        ens = executor.build(plan, copy.deepcopy(members))
    except StagewiseError as e:  # compile refuses a stage vmap cannot run, by name: a refusal, not an answer
        assert strategy == "compile" and "cannot run strategy 'compile'" in str(e), e
        return
    torch.manual_seed(7)
    _assert_like_the_loop(ens, members, [torch.randn(N, (4, 9)[k % 2], 5) * 2 + 1 for k in range(3)])
