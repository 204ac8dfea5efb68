"""A plan whose forward() reads buffer values into Python (a branch on `int(self.act_id)`, a NaN guard) holds the
branch the members' buffers took at build. Buffers changed after build (load_member_state_dict, as a PBT exploit
step copies a member's state; a write into stacked_state) are traced again before the next call runs: a change
that takes another branch is refused (before: member 1 ran member 0's relu for its new tanh, 0.58 off, silently),
one that takes the same branch runs as the loop. Buffers forward() writes itself (BatchNorm statistics) are not
watched: they change every call."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn
from test_review_trace_values import ActivationById, NanGuard, _plan

from stagewise import executor
from stagewise.planner import ExecutionError, MemberError

torch.set_num_threads(1)
build_module = importlib.import_module("stagewise.executor.build")  # (executor.build is the function)


def _members(cls, ids):
    torch.manual_seed(0)
    return [cls(k) for k in ids]


def _set_id(ens, members, i, value):
    sd = members[i].state_dict()
    sd["act_id"] = torch.tensor(value)
    members[i].load_state_dict(sd)
    ens.load_member_state_dict(i, sd)


def _loop(members, x):
    return torch.stack([m(x) for m in members])


def test_a_loaded_member_state_that_takes_another_branch_is_refused_and_changes_nothing():
    members, x = _members(ActivationById, (0, 1, 5)), torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), _loop(members, x), rtol=1e-5, atol=1e-6)
        _set_id(ens, members, 1, 2)  # member 1 now takes tanh
        before = {k: v.clone() for k, v in ens.stacked_state.items()}
        with pytest.raises(ExecutionError, match=r"member 1's buffers changed since build.*torch\.where"):
            ens(x)
        for k, v in ens.stacked_state.items():
            assert torch.equal(v, before[k]), k
        _set_id(ens, members, 1, 7)  # back to a value that takes member 0's relu: runs again, as the loop
        torch.testing.assert_close(ens(x), _loop(members, x), rtol=1e-5, atol=1e-6)


def test_a_write_into_stacked_state_is_seen_too():
    members, x = _members(ActivationById, (0, 1, 5)), torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    with torch.no_grad():
        ens.stacked_state["act_id"][2] = 3  # sigmoid for member 2
        with pytest.raises(ExecutionError, match="member 2's buffers changed since build"):
            ens(x)


def test_a_copy_of_the_batched_module_keeps_the_watch():
    members, x = _members(ActivationById, (0, 1, 5)), torch.randn(5, 4)
    ens = copy.deepcopy(executor.build(_plan(members[0], x), members))
    with torch.no_grad():
        ens.stacked_state["act_id"][1] = 2
        with pytest.raises(ExecutionError, match="member 1's buffers changed since build"):
            ens(x)


def test_buffer_changes_that_keep_the_branch_run_as_the_loop_and_trace_once_per_change(monkeypatch):
    members, x = _members(NanGuard, (0, 2, 3)), torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    traced = []
    real = build_module.plain_fx_code
    monkeypatch.setattr(build_module, "plain_fx_code", lambda *a, **k: traced.append(1) or real(*a, **k))
    with torch.no_grad():
        for value in (5, 9):
            _set_id(ens, members, 2, value)
            for _ in range(3):
                torch.testing.assert_close(ens(x), _loop(members, x), rtol=1e-5, atol=1e-6)
    assert len(traced) == 2  # once per change, not per call


class GuardedBatchNorm(nn.Module):
    """A NaN guard on a buffer beside a BatchNorm whose statistics forward() updates on every call in training."""

    def __init__(self, k):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.register_buffer("act_id", torch.tensor(k))

    def forward(self, x):
        if torch.isnan(self.act_id.float()).any():
            raise RuntimeError("act_id is NaN")
        return self.bn(self.fc(x))


def test_statistics_forward_updates_are_not_watched(monkeypatch):
    members, x = _members(GuardedBatchNorm, (0, 1, 2)), torch.randn(6, 4)
    loop = copy.deepcopy(members)
    ens = executor.build(_plan(members[0], x), members)
    assert ens.__dict__["_value_reads"] is not None and "bn.running_mean" not in ens.__dict__["_value_reads"].keys
    traced = []
    real = build_module.plain_fx_code
    monkeypatch.setattr(build_module, "plain_fx_code", lambda *a, **k: traced.append(1) or real(*a, **k))
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(ens(x), _loop(loop, x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ens.stacked_state["bn.running_mean"], torch.stack([m.bn.running_mean for m in loop]))
    assert not traced


class BigTableBranch(nn.Module):
    """A branch on one element of a large buffer (over build's 65536-element cut: checked by its version counter)."""

    def __init__(self, sign):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", torch.full((300, 300), float(sign)))

    def forward(self, x):
        h = self.fc(x)
        return torch.tanh(h) if float(self.table[0, 0]) > 0 else torch.relu(h)


def test_a_large_buffer_written_in_place_is_traced_again_and_a_small_one_written_through_data_too():
    torch.manual_seed(0)
    members, x = [BigTableBranch(s) for s in (1, 1, 1)], torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    with torch.no_grad():
        ens.stacked_state["table"][1].fill_(-1.0)  # member 1 now takes relu
        with pytest.raises(ExecutionError, match="member 1's buffers changed since build"):
            ens(x)
    members, x = _members(ActivationById, (0, 1, 5)), torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    ens.stacked_state["act_id"].data[2] = 2  # .data: no version counter moves
    with torch.no_grad(), pytest.raises(ExecutionError, match="member 2's buffers changed since build"):
        ens(x)


class Temperature(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("t", torch.tensor(t))

    def forward(self, x):
        return self.fc(x) / float(self.t)


def test_a_number_made_of_a_buffer_names_item_as_the_fix():
    torch.manual_seed(0)
    members, x = [Temperature(t) for t in (1.0, 2.0, 0.5)], torch.randn(5, 4)
    with pytest.raises(MemberError, match=r"self\.t\.item\(\)"):
        executor.build(_plan(members[0], x), members)
