"""In-place writes into values a loop stage handed on, made by a later stage of any strategy.

The loop over members writes each member's own tensor, and every other value viewing it (a view taken before,
its base, another view) sees the write. A loop stage hands on each member's tensors as they are; a batched stage
that writes one of them works on a stacked copy. These tests pin that the write still reaches every value that
shares the member's storage, whatever the view (non-contiguous bases, only views handed on, the base written
while a later stage reads a view), and that in-place activations (`nn.ReLU(inplace=True)`) count as writes."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner

N = 3


class ActivationInPlace(nn.Module):
    """h from a loop stage; ReLU(inplace=True) writes h; l2 reads the written h."""

    def __init__(self):
        super().__init__()
        self.l1, self.act, self.l2 = nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 6)

    def forward(self, x):
        h = self.l1(x)
        r = self.act(h)
        return self.l2(h) + 0.5 * r


class ThroughIdentity(ActivationInPlace):
    """The write reaches h through a module handing it back (nn.Identity; Dropout in eval does the same)."""

    def __init__(self):
        super().__init__()
        self.same = nn.Identity()

    def forward(self, x):
        h = self.l1(x)
        r = self.act(self.same(h))
        return self.l2(h) + 0.5 * r


class NonContiguousBase(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(5, 3)

    def forward(self, x):
        h = self.l1(x).t() * 1.0  # [6, 5], a transposed (non-contiguous) view of a fresh tensor
        v = h[:3]
        v.add_(1.0)
        return self.l2(h)


class BaseWrittenViewReadLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(3, 3)

    def forward(self, x):
        h = self.l1(x)
        v = h[:, :3]
        h.add_(1.0)
        return self.l2(v)


class OnlyViewsHandedOn(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(3, 3)

    def forward(self, x):
        h = self.l1(x)
        v, w = h[:, :4], h[:, 1:4]  # overlapping views of h, which the loop stage does not hand on
        v.mul_(2.0)
        return self.l2(w) + v.sum(1, keepdim=True)


class BothHandedOn(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(5, 3)

    def forward(self, x):
        h = self.l1(x).t() * 1.0
        v = h[:3]
        v.add_(1.0)  # one stage writes h through v and reads h after it: h and v cannot be stacked apart
        y = h * 2.0
        return self.l2(y)


class OutputIsTheWrittenInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.l1(x)
        r = h.add_(1.0)  # r is h: a stage handing r on must hand on h itself, not a copy the next write misses
        h.mul_(2.0)
        return self.l2(r) + self.l2(h)


class ViewsOfWrittenRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(3, 3)

    def forward(self, x):
        h = self.l1(x)
        h.mul_(1.5)
        a = h[:, :3]  # a view of the rows the stage wrote, handed on beside h; the next stage writes h again
        h.add_(0.25)
        return self.l2(a) * h[:, 3:]


CASES = {
    # the model, and the nodes each of which starts a stage (the first stage runs as a loop)
    "activation": (ActivationInPlace, ["act", "l2"]),
    "through_identity": (ThroughIdentity, ["same", "l2"]),
    "non_contiguous_base": (NonContiguousBase, ["add_", "l2"]),
    "base_written": (BaseWrittenViewReadLater, ["add_", "l2"]),
    "only_views": (OnlyViewsHandedOn, ["mul_", "l2"]),
    "both_handed_on": (BothHandedOn, ["add_", "l2"]),
    "views_of_written_rows": (ViewsOfWrittenRows, ["mul_", "add_"]),
}


def _ensemble(case, second, first="loop"):
    cls, cuts = CASES[case] if isinstance(case, str) else case
    torch.manual_seed(0)
    members = [cls() for _ in range(N)]
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    for at in cuts:
        plan = planner.split(plan, graph, plan.stages[-1].id, at=at)
    plan = planner.set_options(plan, graph, plan.stages[0].id, strategy=first)
    for stage in plan.stages[1:]:
        if stage.mode.value == "batched":
            plan = planner.set_options(plan, graph, stage.id, strategy=second)
    return plan, members, x


@pytest.mark.parametrize("first, second", [("loop", "vmap"), ("loop", "wide"), ("loop", "loop"),
                                           ("vmap", "loop"), ("wide", "loop")])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_write_after_a_loop_stage_reaches_every_value_sharing_the_members_storage(case, first, second):
    plan, members, x = _ensemble(case, second, first)
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)
    ens(x).square().sum().backward()  # and in training: the same values, the same gradients
    for m in members:
        m(x).square().sum().backward()
    got = dict(ens.named_stacked_parameters())
    for name in ("l1.weight", "l2.weight"):
        torch.testing.assert_close(got[name].grad, torch.stack([dict(m.named_parameters())[name].grad for m in members]),
                                   rtol=1e-5, atol=1e-6)
    assert executor.verify(plan, members, (x,)).ok


@pytest.mark.parametrize("first, second", [("loop", "vmap"), ("loop", "wide"), ("loop", "loop"), ("vmap", "loop"),
                                           ("wide", "loop"), ("vmap", "vmap")])
def test_a_stage_handing_on_the_input_it_wrote_hands_on_the_value_itself(first, second):
    # Was: a batched stage wrote a copy of h and handed the copy on as r, and a loop stage in training handed on its
    # own rows: the later h.mul_(2) missed r (off 1.8 without a word).
    plan, members, x = _ensemble((OutputIsTheWrittenInput, ["add_", "mul_"]), second, first)
    ens = executor.build(plan, copy.deepcopy(members))
    want = torch.stack([m(x) for m in members])
    with torch.no_grad():
        torch.testing.assert_close(ens(x), want, rtol=1e-6, atol=1e-6)
    got = ens(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    want.square().sum().backward()
    # was (vmap/loop/loop): torch's "modified by an inplace operation" at backward, the rows of one tensor sharing
    # a version counter; each member now writes its own copy of its memory
    got.square().sum().backward()
    stacked = dict(ens.named_stacked_parameters())
    for name in ("l1.weight", "l2.weight"):
        torch.testing.assert_close(stacked[name].grad, torch.stack([dict(m.named_parameters())[name].grad for m in members]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first, second", [("loop", "vmap"), ("loop", "wide"), ("vmap", "loop")])
@pytest.mark.parametrize("case", sorted(CASES))
def test_writes_after_a_loop_stage_under_inference_mode(case, first, second):
    # Was: torch.inference_mode() made the stacked copies inference tensors, which keep no version counter:
    # RuntimeError ("Inference tensors do not track version counter") on every call.
    plan, members, x = _ensemble(case, second, first)
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.inference_mode():
        got = ens(x)
        want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- a batched stage handing on a view of a loop stage's value, which a later stage writes ------------------------------

class SetItemAfterScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.mul_(0.5)
        h[:, 0] = h[:, 1] * 2
        return self.b(h)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_a_view_handed_on_from_a_loop_value_carries_a_later_write(n):
    torch.manual_seed(0)
    members = [SetItemAfterScale().eval() for _ in range(n)]
    x = torch.randn(5, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n)
    for name in ("mul_", "copy_"):  # each in a loop stage of its own: the views between them run batched
        plan = planner.exclude(plan, graph, name)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class NoGradRegionEMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h + self.ema


def test_a_region_subgraph_excluded_by_an_edit_is_read_where_the_region_runs():
    torch.manual_seed(0)
    members = [NoGradRegionEMA().eval() for _ in range(N)]
    ref = copy.deepcopy(members)
    x = torch.randn(4, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    subgraph = next(n for s in plan.stages for n in s.nodes if n.startswith("submod"))
    ens = executor.build(planner.exclude(plan, graph, subgraph), members)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in ref]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ens.stacked.ema, torch.stack([m.ema for m in ref]), rtol=1e-6, atol=1e-7)
