"""Review: `wide` rules that answered wrong (or crashed where vmap runs), each set by hand on every stage and
compared with the member loop at a batch of N and another size, with every member's weights apart.

Sibling Linears fused into one GEMM ran before an in-place write to their input between them; `w.type_as(x)` with a
shared x of higher rank gave a per-member w x's rank; two list indices split by a slice put the member axis in the
wrong place; a whole-tensor reduction of a per-member 0-dim value reduced across members; `sum(axis=)` and `prod()`
failed and blamed the inputs.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner

N = 4


class SiblingsAroundAWrite(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), how
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc(x)
        a = self.a(h)
        if self.how == "method":
            h.relu_()
        elif self.how == "functional":
            F.relu(h, inplace=True)
        else:
            self.act(h)
        return a * self.b(h)


class TypeAsShared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(4, 4), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.fc(x) + self.w.type_as(x).sum(0) + self.w.to(x).softmax(0)


class TwoListIndices(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 12)

    def forward(self, x):
        return self.fc(x).view(-1, 3, 4)[[0, 1, 1, 0], :, [1, 2, 3, 0]]


class Reductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.sum(axis=-1) + h.prod() + h.pow(2).mean().sum()


MODELS = {
    "siblings around relu_": lambda: SiblingsAroundAWrite("method"),
    "siblings around F.relu(inplace)": lambda: SiblingsAroundAWrite("functional"),
    "siblings around nn.ReLU(inplace)": lambda: SiblingsAroundAWrite("module"),
    "type_as a shared input": TypeAsShared,
    "two list indices": TwoListIndices,
    "reductions": Reductions,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_wide_matches_the_loop(name):
    members = []
    for i in range(N):
        torch.manual_seed(i)
        m = MODELS[name]().eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))  # biases apart too
        members.append(m)
    x = torch.randn(N, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    for s in list(plan.stages):
        if s.mode.value == "batched":
            plan = planner.set_options(plan, graph, s.id, strategy="wide")
    ens = executor.build(plan, members)
    shapes = ((N, 4),) if name == "two list indices" else ((N, 4), (5, 4))
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape)
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-5)


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.fc = nn.LSTMCell(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h, c = self.cell(x)
        return torch.column_stack([self.fc(h), c])


class CumulativeNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("cls, train", [(Cell, False), (CumulativeNorm, True)])
def test_wide_runs_what_vmap_cannot_once_per_member(cls, train):
    """No batching rule (nn.LSTMCell, torch.column_stack) or a host read (BatchNorm's cumulative average reads its
    count): wide runs the call once per member instead of failing."""
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(cls().train(train))
    reference = copy.deepcopy(members)
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    for s in list(plan.stages):
        plan = planner.set_options(plan, graph, s.id, strategy="wide")
    ens = executor.build(plan, members).train(train)
    for _ in range(2):
        x = torch.randn(5, 4)
        got, want = ens(x), torch.stack([m(x) for m in reference])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for i, m in enumerate(reference):  # running statistics too: a first try under vmap must not count twice
            for k, v in m.state_dict().items():
                torch.testing.assert_close(ens.member_state_dicts()[i][k], v, rtol=1e-5, atol=1e-6, msg=k)
    got.square().sum().backward()
    want.square().sum().backward()
    for name, p in ens.named_stacked_parameters():
        for i, m in enumerate(reference):
            # a bias right before BatchNorm has a gradient of 0 up to float noise: atol covers that noise
            torch.testing.assert_close(p.grad[i], dict(m.named_parameters())[name].grad, rtol=1e-4, atol=1e-4)


def test_wide_batch_norm_refuses_an_input_rank_the_module_refuses():
    # Was: an unbatched image ([3, 8, 8]) through Conv2d then BatchNorm2d: the module raises "expected 4D input", but
    # wide's BatchNorm read dim 2 (H) as channels and, with H equal to the channels, answered without a word.
    class ConvNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn(self.c(x))

    members = []
    for i in range(3):
        torch.manual_seed(i)
        m = ConvNorm().eval()
        with torch.no_grad():
            m.bn.running_mean.normal_()
            m.bn.running_var.uniform_(0.5, 2.0)
        members.append(m)
    example = (torch.randn(4, 3, 8, 8),)
    graph = planner.trace(copy.deepcopy(members[0]), example)
    plan = planner.propose(graph, n_members=3)
    plan = planner.set_options(plan, graph, plan.stages[0].id, strategy="wide")
    ens = executor.build(plan, copy.deepcopy(members), example)
    with torch.no_grad():
        torch.testing.assert_close(ens(*example), torch.stack([m(*example) for m in members]), rtol=1e-5, atol=1e-5)
        with pytest.raises(planner.InputError, match="expected 4D input"):
            ens(torch.randn(3, 8, 8))


# --- wide on stages the planner excluded, and views kept for writes (a second review) --------------------------------

def _members(cls, n=N, **kw):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(cls(**kw).eval())
    return out


class MHANoWeights(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.m, self.o = nn.MultiheadAttention(8, 2, batch_first=True, **kw), nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.m(x, x, x, need_weights=False)
        return self.o(y)


@pytest.mark.parametrize("kw", [dict(add_bias_kv=True), dict(add_zero_attn=True)])
def test_attention_wide_has_no_rule_for_runs_per_member_in_the_default_plan(kw):
    """vmap refused the module's None weights with a ValueError the fallback did not catch: every call failed."""
    members = _members(MHANoWeights, **kw)
    x = torch.randn(2, 5, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    ens = executor.build(plan, copy.deepcopy(members))
    out = ens(x)
    torch.testing.assert_close(out, torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    for m in members:
        m(x).sum().backward()
    torch.testing.assert_close(ens.stacked.m.in_proj_weight.grad, torch.stack([m.m.in_proj_weight.grad for m in members]),
                               rtol=1e-4, atol=1e-6)


class SpectralPaste(nn.Module):
    """An FNO-style paste of low modes into zeros: writes into slices of a 4-D-per-member value (export graph)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 3, 3, padding=1)

    def forward(self, x):
        h = self.a(x)
        out = torch.zeros(x.shape[0], 3, x.shape[2], x.shape[3])
        out[:, :, :3, :3] = h[:, :, :3, :3]
        for _ in range(x.shape[0]):  # (a loop over a shape: torch.export traces it)
            out = out + 0
        return out * 1


def test_wide_keeps_the_views_a_write_goes_through():
    """A non-contiguous 5-D value was made dense before each view op: the paste wrote into a copy (1.0 off: zeros)."""
    members = _members(SpectralPaste)
    x = torch.randn(2, 1, 8, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    for s in plan.stages:
        if s.runs_batched:
            plan = planner.set_options(plan, graph, s.id, strategy="wide")
    with torch.no_grad():
        torch.testing.assert_close(executor.build(plan, copy.deepcopy(members))(x), torch.stack([m(x) for m in members]))


class SolveShared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 9)

    def forward(self, x):
        return torch.linalg.solve(self.fc(x).view(-1, 3, 3) + 3 * torch.eye(3), torch.ones(3))


class AutocastBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def body(self, x):
        return F.silu(self.fc1(x)) @ self.fc2.weight.t()

    def forward(self, x):
        return self.body(x).float() + self.fc2.bias


@pytest.mark.parametrize("cls, shape", [(SolveShared, (2, 3)), (AutocastBody, (6, 8))])
def test_wide_set_by_hand_on_an_excluded_stage_runs_its_unruled_ops_per_member(cls, shape):
    """vmap, wide's fallback, is what the planner found cannot run them: linalg.solve with a shared right-hand side came
    out [N, 2, 3, 3] for [N, 2, 3]; an autocast region ran in float32 (5e-3 off)."""
    members = _members(cls)
    x = torch.randn(*shape)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    excluded = [s for s in plan.stages if not s.runs_batched]
    assert excluded
    for s in excluded:
        plan = planner.set_options(plan, graph, s.id, strategy="wide")
    with torch.no_grad():
        got, want = executor.build(plan, copy.deepcopy(members))(x), torch.stack([m(x) for m in members])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compile_set_by_hand_on_an_autocast_region_is_refused_at_build():
    members = _members(AutocastBody)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(6, 8),))
    plan = planner.propose(graph, N)
    s = next(s for s in plan.stages if not s.runs_batched)
    plan = planner.set_options(plan, graph, s.id, strategy="compile")
    with pytest.raises(planner.ExecutionError, match=r"autocast region.*runs without its autocast.*strategy='loop'"):
        executor.build(plan, members)
