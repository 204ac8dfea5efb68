"""verify(grads=True) compares the gradients of the floating tensors inside a container input (a batch dict, a list
of tensors passed as one forward() argument), each in a row of its own named as the trace names it (`input
batch['x']`): a per_member container member by member (member i's leaf is row i), a shared one against the members'
summed gradient. Before: such gradients were not compared at all (a note said so), so a batched module giving a wrong
x.grad for a dict input passed as MATCH.

The wrong gradient is made on purpose: a hook on the input's use inside forward() scaling grad_input by 0.1, which no
graph records, so the batched module (running the traced graph) gives 10x the loop's gradient (9 of its norm off).
The trace's own check of input gradients (planner.graph._input_grads_disagree), which would refuse such a model, is
switched off for these plans, as in tests/test_review_input_grads.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner

torch.set_num_threads(1)
N = 3


def _damp(gi, go):
    return (gi[0] * 0.1 if gi[0] is not None else None,) + tuple(gi[1:])


def _hook(t: torch.Tensor) -> torch.Tensor:
    """`t * 1.0` whose backward damps the gradient of `t` tenfold where forward() runs eagerly (fx does not see it)."""
    h = t * 1.0
    if not isinstance(h, torch.fx.Proxy) and h.grad_fn is not None:
        h.grad_fn.register_hook(_damp)
    return h


class DictNet(nn.Module):
    """A batch dict input: x and a float weight w (both compared), an integer mask (not: no gradient)."""

    def __init__(self, damp: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.damp = nn.Linear(4, 8), nn.Linear(8, 2), damp

    def forward(self, batch):
        x = _hook(batch["x"]) if self.damp else batch["x"]
        h = self.fc2(torch.tanh(self.fc1(x))) * batch["w"]
        return h * batch["mask"].unsqueeze(-1)


class ListNet(nn.Module):
    """A list of two tensors as one argument; the hook (when on) on the second alone."""

    def __init__(self, damp: bool = False):
        super().__init__()
        self.fc_a, self.fc_b, self.damp = nn.Linear(4, 3), nn.Linear(2, 3), damp

    def forward(self, xs):
        b = _hook(xs[1]) if self.damp else xs[1]
        return torch.tanh(self.fc_a(xs[0])) + self.fc_b(b).sin()


def _members(cls, damp):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(cls(damp))
    return out


@pytest.fixture(autouse=True)
def _no_trace_refusal(monkeypatch):
    """The trace's own comparison of input gradients off: it would refuse the damped models at trace."""
    import stagewise.planner.graph as graph_module
    monkeypatch.setattr(graph_module, "_input_grads_disagree", lambda *a: None, raising=False)


def _plan(members, example, mode):
    return planner.propose(planner.trace(copy.deepcopy(members[0]), example), n_members=N, input_mode=mode)


def _dict_inputs(mode):
    g = torch.Generator().manual_seed(5)
    lead = (N,) if mode == "per_member" else ()
    return {"x": torch.randn(*lead, 5, 4, generator=g), "w": torch.rand(*lead, 5, 1, generator=g) + 0.5,
            "mask": (torch.rand(*lead, 5, generator=g) > 0.3).long()}


def _loop_rel(members, plan, batch, key, mode):
    """Plain torch: the batched module's batch[key].grad against the loop's (each member's own backward; a shared
    input's summed), of one fixed weighting of the outputs, normwise (per member for per_member: the worst)."""
    ens = executor.build(plan, members)
    given = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in batch.items()}
    out = ens(given)
    wts = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * wts).sum().backward()
    want = []
    for i, m in enumerate(members):
        own = {k: (v[i] if mode == "per_member" else v).clone() for k, v in batch.items()}
        own = {k: (v.requires_grad_(True) if v.is_floating_point() else v) for k, v in own.items()}
        (m(own) * wts[i]).sum().backward()
        want.append(own[key].grad)
    got = given[key].grad
    if mode == "per_member":
        return max(float((got[i] - w).norm() / w.norm()) for i, w in enumerate(want))
    return float((got - sum(want)).norm() / sum(want).norm())


def _row(report, name):
    rows = [r for r in report.gradients if r.name == name]
    assert len(rows) == 1, (name, report.to_text())
    return rows[0]


@pytest.mark.parametrize("mode", ["per_member", "shared"])
def test_dict_input_gradient_rows_match_the_loop(mode):
    """Honest model: a row for batch['x'] and batch['w'] each, MATCH at float32 noise; the integer mask has none, and
    no note says container gradients are not compared (before: no rows, and that note)."""
    members = _members(DictNet, False)
    batch = _dict_inputs(mode)
    plan = _plan(members, ({k: (v[0] if mode == "per_member" else v) for k, v in batch.items()},), mode)
    given = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in batch.items()}
    report = executor.verify(plan, members, (given,), grads=True)
    assert report.ok, report.to_text()
    suffix = " (shared: the members' summed)" if mode == "shared" else ""
    for key in ("x", "w"):
        row = _row(report, f"input batch['{key}']{suffix}")
        assert row.ok and row.max_rel < 1e-5, report.to_text()
        assert _loop_rel(members, plan, batch, key, mode) < 1e-5  # plain torch agrees: the gradients are the loop's
    assert not any("mask" in r.name for r in report.gradients), report.to_text()
    assert not any("not compared" in n for n in report.notes), report.notes
    assert "grad input batch['x']" in report.to_text()


@pytest.mark.parametrize("mode", ["per_member", "shared"])
def test_wrong_dict_input_gradient_is_a_mismatch_row(mode):
    """The damped model: the batched batch['x'].grad is 10x the loop's (9 of its norm off, measured with plain torch);
    verify says MISMATCH on that row with that error, MATCH on batch['w'] and the parameters (before: MATCH overall,
    the gradient not compared)."""
    members = _members(DictNet, True)
    batch = _dict_inputs(mode)
    plan = _plan(members, ({k: (v[0] if mode == "per_member" else v) for k, v in batch.items()},), mode)
    assert _loop_rel(members, plan, batch, "x", mode) == pytest.approx(9.0, rel=1e-4)  # the silent wrong answer
    given = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in batch.items()}
    report = executor.verify(plan, members, (given,), grads=True)
    assert not report.ok
    assert "MISMATCH" in report.to_text()
    suffix = " (shared: the members' summed)" if mode == "shared" else ""
    bad = _row(report, f"input batch['x']{suffix}")
    assert not bad.ok and bad.max_rel == pytest.approx(9.0, rel=1e-4), report.to_text()
    assert _row(report, f"input batch['w']{suffix}").ok, report.to_text()
    assert all(r.ok for r in report.gradients if "batch['x']" not in r.name), report.to_text()
    assert all(r.ok for r in report.outputs), report.to_text()


@pytest.mark.parametrize("damp", [False, True])
def test_list_input_leaves_each_get_a_row(damp):
    """A per_member list [a, b]: rows `input xs[0]` and `input xs[1]`; with the hook on b, xs[1] alone MISMATCHes."""
    members = _members(ListNet, damp)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(N, 6, 4, generator=g), torch.randn(N, 6, 2, generator=g)
    plan = _plan(members, ([a[0], b[0]],), "per_member")
    report = executor.verify(plan, members, ([a.clone().requires_grad_(True), b.clone().requires_grad_(True)],),
                             grads=True)
    assert _row(report, "input xs[0]").ok, report.to_text()
    row = _row(report, "input xs[1]")
    assert row.ok is (not damp) and report.ok is (not damp), report.to_text()
    if damp:
        assert row.max_rel == pytest.approx(9.0, rel=1e-3), report.to_text()
    else:
        assert row.max_rel < 1e-5, report.to_text()


def test_only_leaves_given_requiring_grad_are_compared():
    """As for top-level inputs, the call is as given: a leaf not requiring grad gets no row (and no note)."""
    members = _members(DictNet, False)
    batch = _dict_inputs("per_member")
    plan = _plan(members, ({k: v[0] for k, v in batch.items()},), "per_member")
    report = executor.verify(plan, members, ({**batch, "x": batch["x"].clone().requires_grad_(True)},), grads=True)
    assert report.ok, report.to_text()
    assert [r.name for r in report.gradients if r.name.startswith("input")] == ["input batch['x']"]
    assert not any("not compared" in n for n in report.notes), report.notes


class NumberInDict(nn.Module):
    def __init__(self, damp: bool = False):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, batch):
        return self.fc(batch["x"]) * batch["scale"]


def test_a_number_leaf_of_a_per_member_container_is_noted():
    """A 1-D leaf of a per_member container is each member's Python number, which records no gradient on the member's
    side: a note says it is not compared; the tensor beside it is."""
    members = _members(NumberInDict, False)
    plan = _plan(members, ({"x": torch.randn(5, 4), "scale": 0.5},), "per_member")
    batch = {"x": torch.randn(N, 5, 4).requires_grad_(True), "scale": torch.tensor([0.5, 1.0, 2.0], requires_grad=True)}
    report = executor.verify(plan, members, (batch,), grads=True)
    assert _row(report, "input batch['x']").ok, report.to_text()
    assert any("input batch['scale']" in n and "not compared" in n for n in report.notes), report.notes


class Holder:
    """A plain object holding a tensor: torch's pytree does not open it, forward() is given it as it is."""

    def __init__(self, t):
        self.t = t


class HolderNet(nn.Module):
    def __init__(self, damp: bool = False):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, h):
        return self.fc(x) * h.t.sum()


def test_tensors_inside_an_object_pytree_does_not_open_are_noted():
    members = _members(HolderNet, False)
    plan = _plan(members, (torch.randn(5, 4), Holder(torch.randn(3))), "shared")
    report = executor.verify(plan, members, (torch.randn(5, 4), Holder(torch.randn(3, requires_grad=True))), grads=True)
    assert report.ok, report.to_text()
    want = "gradients of the tensors inside input h not compared: a Holder object"
    assert any(n.startswith(want) for n in report.notes), report.notes
