"""A loop stage that hands on views of the members' state (`self.mem[0]`), written in place by a later stage.

Each member's view is a view of its row of the stacked tensor; the in-place stage must write into those rows
(as vmap's `select` of the stacked tensor does), not into a stacked copy of the views, which lost the write."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.values import rows_of_one_tensor

N = 3


class Memory(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.l, self.where = nn.Linear(6, 6), where
        self.register_buffer("mem", torch.randn(4, 6))

    def forward(self, x):
        y = self.l(x)
        if self.where == "row":
            self.mem[0] = y.mean(0)
        elif self.where == "column":
            self.mem[:, 1] = y.mean()  # a strided view of each member's row
        else:
            self.mem[1:3].mul_(0.5)
        return y @ self.mem.t()


def _members(where):
    torch.manual_seed(0)
    return [Memory(where).eval() for _ in range(N)]


@pytest.mark.parametrize("where", ["row", "column", "block"])
@pytest.mark.parametrize("loop_stages", [["s0"], "all"])
def test_a_loop_stage_handing_on_state_views_keeps_the_later_write(where, loop_stages):
    members = _members(where)
    x = torch.randn(2, 6)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    for stage in (plan.stages if loop_stages == "all" else [s for s in plan.stages if s.id in loop_stages]):
        if stage.mode.value == "batched":
            plan = planner.set_options(plan, graph, stage.id, strategy="loop")
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        for _ in range(3):  # the write of one call is read by the next
            got = ens(x)
            want = torch.stack([m(x) for m in members])
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for state, m in zip(ens.member_state_dicts(), members):
        torch.testing.assert_close(state["mem"], m.mem)
    assert executor.verify(plan, _members(where), (x,)).ok


def test_rows_of_one_tensor_takes_only_the_same_view_of_every_row():
    base = torch.randn(3, 4, 5)
    assert rows_of_one_tensor([base[i] for i in range(3)]) is base
    view = rows_of_one_tensor([base[i][1:3, ::2] for i in range(3)])
    assert view is not None and view.data_ptr() == base[0][1:3, ::2].data_ptr()
    torch.testing.assert_close(view, base[:, 1:3, ::2])
    assert rows_of_one_tensor([base[0][1], base[1][2], base[2][3]]) is None  # other views per member
    assert rows_of_one_tensor([base[0][1], base[0][2], base[0][3]]) is None  # all in member 0's row
    assert rows_of_one_tensor([base[2], base[1], base[0]]) is None
    assert rows_of_one_tensor([base[i].clone() for i in range(3)]) is None


class WritesThroughAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = self.fc1(x)
        v = h[:, :3]
        v.mul_(2)  # writes h through the view
        return self.fc2(h)


@pytest.mark.parametrize("first", ["loop", "wide", "vmap"])
def test_a_write_through_a_view_handed_on_by_a_loop_stage_reaches_its_base(first):
    """Was: the loop stage's h and v = h[:, :3] were stacked into two copies, so the next stage's write through v
    never reached h (off by 1.0)."""
    torch.manual_seed(0)
    members = [WritesThroughAView() for _ in range(N)]
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.split(planner.propose(graph, n_members=N), graph, "s0", at="mul_")
    plan = planner.set_options(plan, graph, "s0", strategy=first)
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)
    ens(x).square().sum().backward()  # and in training
    for m in members:
        m(x).square().sum().backward()
    got = dict(ens.named_stacked_parameters())
    torch.testing.assert_close(got["fc1.weight"].grad, torch.stack([m.fc1.weight.grad for m in members]),
                               rtol=1e-5, atol=1e-6)
