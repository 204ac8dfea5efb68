"""Tensors a trace computes from what a member holds and bakes into the graph as constants.

torch.fx runs forward() with real buffers and plain tensor attributes: `x @ self.B.t()` ran `self.B.t()` once, on
member 0's buffer, and the graph kept the result as `_tensor_constant0`. Every member then ran with member 0's
random features (outputs off by ~1), and the constant went stale whenever the buffer changed. Buffers are now
graph values in such a trace (the computation is recorded), and what stays baked is compared per member and
stacked where members differ. Tracing also no longer leaves `_tensor_constant*` attributes on the model, which
made a second trace of the same model name its constants otherwise and `executor.build` refuse the plan.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import MemberError
from stagewise.planner.graph import baked_constants

N = 3


class RandomFeatures(nn.Module):
    """Random Fourier features: a fixed random projection per member, held as a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("B", torch.randn(8, 4))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        z = x @ self.B.t()
        return self.head(torch.cat([z.sin(), z.cos()], -1))


class SlicedBuffer(nn.Module):
    """A buffer sliced with fixed bounds and combined with a literal tensor made in forward()."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(10, 4))

    def forward(self, x):
        return self.lin(x) + self.table[:1] * 2 + torch.tensor([1.0, 2.0, 3.0, 4.0])


class HeldTensors(nn.Module):
    """Tensors held outside parameters and buffers: a plain attribute and one in a list, used through ops."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log_scale = torch.randn(4)
        self.tables = [torch.randn(4)]

    def forward(self, x):
        return self.lin(x) * self.log_scale.exp() + self.tables[0].tanh()


class ExportedFeatures(RandomFeatures):
    """The same computation in a forward() torch.fx cannot trace (a branch on a shape): torch.export's graph."""

    def forward(self, x):
        z = x @ self.B.t()
        if x.shape[0] > 2:
            z = z * 2
        return self.head(torch.cat([z.sin(), z.cos()], -1))


def members_of(cls, n=N):
    out = []
    for i in range(n):
        torch.manual_seed(100 + i)
        out.append(cls())
    return out


def build(members, x):
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), len(members))
    return plan, executor.build(plan, members, example_inputs=(x,))


@pytest.mark.parametrize("cls", [RandomFeatures, SlicedBuffer, HeldTensors, ExportedFeatures])
def test_what_forward_computes_from_held_tensors_is_each_members_own(cls):
    members = members_of(cls)
    reference = copy.deepcopy(members)
    _, ens = build(members, torch.randn(5, 4))
    for shape in ((5, 4), (7, 4)):
        for _ in range(2):
            x = torch.randn(*shape)
            got = ens(x)
            want = torch.stack([m(x) for m in reference])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_through_a_buffer_derived_projection_match_the_loop():
    members = members_of(RandomFeatures)
    reference = copy.deepcopy(members)
    x = torch.randn(6, 4)
    _, ens = build(members, x)
    (ens(x) ** 2).sum().backward()
    sum((m(x) ** 2).sum() for m in reference).backward()
    for name, p in ens.named_stacked_parameters():
        for i, m in enumerate(reference):
            torch.testing.assert_close(p.grad[i], dict(m.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)


def test_the_graph_reads_the_buffer_so_a_changed_buffer_is_seen():
    members = members_of(RandomFeatures)
    x = torch.randn(5, 4)
    plan, ens = build(members, x)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    assert baked_constants(graph.gm) == []
    assert any(n.op == "get_attr" and n.target == "B" for n in graph.gm.graph.nodes)
    with torch.no_grad():
        ens.stacked_state["B"].mul_(-1.0)  # e.g. new features loaded into the batched module
        for m in members:
            m.B.mul_(-1.0)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


def test_tracing_leaves_no_constants_on_the_model_and_traces_alike():
    model = members_of(HeldTensors, 1)[0]
    before = set(vars(model))
    x = torch.randn(5, 4)
    first = planner.trace(model, (x,))
    assert set(vars(model)) == before
    assert planner.trace(model, (x,)).fingerprint == first.fingerprint
    assert baked_constants(first.gm)  # HeldTensors' computation stays baked: it reads no buffer
    # building from a plan traced on the model itself (not a copy) works: it used to be refused as another model's plan
    members = [model, *members_of(HeldTensors, 2)]
    ens = executor.build(planner.propose(first, 3), members)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


def test_held_tensors_of_another_shape_are_refused_by_name():
    members = members_of(HeldTensors)
    members[2].log_scale = torch.randn(5)
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    with pytest.raises((MemberError, planner.errors.TraceError)) as info:
        executor.build(plan, members)
    assert "member" in str(info.value)


def test_identical_held_tensors_are_not_stacked():
    torch.manual_seed(0)
    one = HeldTensors()
    members = [copy.deepcopy(one) for _ in range(N)]
    for i, m in enumerate(members):
        torch.manual_seed(i)
        m.lin.reset_parameters()
    x = torch.randn(5, 4)
    _, ens = build(members, x)
    assert not any(k.startswith("_tensor_constant") for k in ens.stacked_state)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class ParameterPenalty(nn.Module):
    """A term computed from parameters reached by iteration, not attribute access (fx used to bake member 0's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + 0.1 * sum(p.pow(2).sum() for p in self.parameters())


class BufferIteration(nn.Module):
    """A term computed from buffers reached by iteration (no gradient: found by tracing a changed copy)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x):
        return self.lin(x) + sum(b.tanh() for b in self.buffers())


@pytest.mark.parametrize("cls", [ParameterPenalty, BufferIteration])
def test_state_reached_by_iteration_is_traced_with_torch_export(cls):
    members = members_of(cls)
    reference = copy.deepcopy(members)
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    assert graph.tracer == "export" and "without attribute access" in graph.tracer_note
    ens = executor.build(planner.propose(graph, N), members, example_inputs=(x,))
    got, want = ens(x), torch.stack([m(x) for m in reference])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    for name, p in ens.named_stacked_parameters():
        for i, m in enumerate(reference):
            torch.testing.assert_close(p.grad[i], dict(m.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)


class BufferNumber(nn.Module):
    """A temperature held as a buffer and read as a Python number (fx wrote member 0's number into the graph)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("temperature", torch.rand(()) + 0.5)

    def forward(self, x):
        return self.lin(x) / self.temperature.item()


class HeldNumber(nn.Module):
    """The same with a plain tensor attribute: the number is computed per member and lifted into per-member state."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.rand(()) + 0.5

    def forward(self, x):
        return self.lin(x) * float(self.scale)


class BufferBranch(nn.Module):
    """A branch on a buffer's value: members whose flags differ need different graphs."""

    def __init__(self, flag=True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("use_tanh", torch.tensor(flag))

    def forward(self, x):
        y = self.lin(x)
        return y.tanh() if self.use_tanh else y


@pytest.mark.parametrize("cls", [BufferNumber, HeldNumber])
def test_numbers_read_from_held_tensors_are_each_members_own(cls):
    members = members_of(cls)
    reference = copy.deepcopy(members)
    x = torch.randn(5, 4)
    _, ens = build(members, x)
    for shape in ((5, 4), (7, 4)):
        x = torch.randn(*shape)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in reference]), rtol=1e-5, atol=1e-6)


def test_a_branch_on_a_buffer_value_is_never_member_0s_for_all():
    members = [BufferBranch(True), BufferBranch(False), BufferBranch(True)]
    x = torch.randn(5, 4)
    try:
        _, ens = build(members, x)
    except planner.errors.StagewiseError as e:  # refused is right too, as long as it says why
        assert "trace" in str(e) or "member" in str(e)
        return
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class _ExportSweep(nn.Module):
    """A sweep's numbers where torch.export puts them: clamp bounds (PPO's clip range), a base raised to a tensor, an
    in-place division. A branch on a size makes fx give up."""

    def __init__(self, eps, base, t):
        super().__init__()
        self.fc, self.eps, self.base, self.t = nn.Linear(6, 4), eps, base, t

    def forward(self, x):
        h = self.fc(x)
        if h.shape[0] > 1:
            h = h + 0
        r = torch.clamp(h.exp(), 1 - self.eps, 1 + self.eps)
        p = torch.pow(self.base, h.tanh())
        q = h.clone()
        q.div_(self.t)
        return r + p + q


def test_numbers_a_sweep_holds_in_export_graphs_clamp_pow_and_in_place_ops_are_lifted():
    """Was: refused under torch.export (fx lifted the same numbers): clamp, pow with a number base, div_."""
    members = [_ExportSweep(e, b, t) for e, b, t in ((0.1, 2.0, 1.0), (0.2, 3.0, 2.0), (0.3, 1.5, 4.0))]
    x = torch.randn(5, 6)
    graph = planner.trace(members[0], (x,))
    assert graph.tracer == "export"
    plan = planner.propose(graph, 3)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    report = executor.verify(plan, members, (x,))  # two calls, two batch sizes
    assert report.ok and len(report.shapes) == 2, report.to_text()
