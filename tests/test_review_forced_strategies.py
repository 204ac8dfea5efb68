"""Review: strategies forced by hand in a plan (`planner.set_options(..., strategy=...)`) that answered wrong without
a word, or failed where the loop runs, each compared with the member loop (float32, outputs and state, more than one
call) or checked for a build-time refusal that names the stage, the reason and the fix.

`wide` reduced the member axis too for an empty dim list (`x.amax(dim=())`: torch reduces every dim); `compile` ran
a stage updating running statistics through F.batch_norm / F.instance_norm, or holding a BatchNorm put back in
training inside an eval model, three times on its first call; `wide` handed on a copy as the result of an in-place
op, so a chained write (`mem[:, :3].mul_(0.5).add_(h)`) missed the buffer; `h.__setitem__(i, v)` failed under
`wide`; `compile` on a stage the planner excluded (a GRU vmap cannot run) failed at the first call with a message
about input shapes; a first-order gradient through torch.func.grad was refused as a "backward with create_graph".
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from stagewise import executor, planner
from stagewise.executor.strategies import compiled
from stagewise.planner import StageMode

N = 3
TIGHT = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _one_thread_and_quick_compile(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # the compile plumbing, without inductor's codegen time


def _members(cls, n=N, **kw):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        m = cls(**kw).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))  # members apart, biases too
        out.append(m)
    return out


def _forced(members, example, strategy, input_mode="shared", which=None):
    """The proposed plan with `strategy` set on every stage (`which`: those ids only; vmap on batched ones only)."""
    graph = planner.trace(copy.deepcopy(members[0]), example)
    plan = planner.propose(graph, n_members=len(members), input_mode=input_mode)
    for s in plan.stages:
        if (which is None or s.id in which) and not (strategy == "vmap" and s.mode is StageMode.EXCLUDED):
            plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    return plan, graph


def _loop(members, x, per_member):
    with torch.no_grad():
        return torch.stack([m(x[i] if per_member else x) for i, m in enumerate(members)])


def _assert_like_the_loop(ens, reference, inputs, per_member):
    """Each call's outputs and every member's state after it equal the member loop's on the same inputs."""
    for x in inputs:
        with torch.no_grad():
            got = ens(x)
        torch.testing.assert_close(got, _loop(reference, x, per_member), **TIGHT)
        for i, m in enumerate(reference):
            for k, v in m.state_dict().items():
                torch.testing.assert_close(ens.member_state_dicts()[i][k], v, **TIGHT, msg=f"member {i} {k}")


# --- 1. wide: an empty dim list reduces every dim of each member, not the member axis -------------------------------

class EmptyDims(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.how = nn.Linear(5, 6), how

    def forward(self, x):
        h = self.fc(x)
        if self.how == "amax":
            return h.amax(dim=())  # torch: dim=() reduces over every dim
        if self.how == "sum":
            return torch.sum(h, [])
        if self.how == "mean keepdim":
            return h.mean((), True) * h
        return h.var(dim=[]) + h.amin(dim=[], keepdim=True)


@pytest.mark.parametrize("how", ["amax", "sum", "mean keepdim", "var amin"])
def test_wide_reduces_each_member_over_an_empty_dim_list(how):
    # Was: amax(dim=()) under wide reduced the member axis too: a 0-dim output holding the largest member's value
    # ([1.29] for the loop's [0.80, 1.29, 0.88]), and verify crashed indexing it
    members = _members(EmptyDims, how=how)
    x = torch.randn(4, 5)
    plan, _ = _forced(members, (x,), "wide")
    ens = executor.build(plan, copy.deepcopy(members))
    _assert_like_the_loop(ens, members, [x, torch.randn(7, 5)], per_member=False)


# --- 2. compile: running statistics a stage updates are updated once per call ----------------------------------------

class ObsNorm(nn.Module):
    """An observation normaliser that keeps tracking its statistics in eval (F.batch_norm with training=True)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(6))
        self.register_buffer("var", torch.ones(6))
        self.pi = nn.Linear(6, 3)

    def forward(self, obs):
        F.batch_norm(obs, self.mean, self.var, None, None, True, 0.01, 1e-5)
        return self.pi(((obs - self.mean) / torch.sqrt(self.var + 1e-5)).clamp(-5, 5))


class InstanceStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))
        self.fc = nn.Linear(8, 2)

    def forward(self, x):  # x [B, 4, 8]
        h = F.instance_norm(x, self.rm, self.rv, use_input_stats=True, momentum=0.1)
        return self.fc(h + self.rm[:, None])


@pytest.mark.parametrize("cls, shape", [(ObsNorm, (5, 6)), (InstanceStats, (2, 4, 8))])
def test_compile_updates_functional_norm_statistics_once_per_call(cls, shape):
    # Was: compile ran the stage eagerly once and compiled twice on its first call, so F.batch_norm's running mean
    # moved three times (member 0's mean[0] 0.052 where the loop has 0.0175; outputs 8% off)
    members = _members(cls)
    plan, _ = _forced(members, (torch.randn(*shape),), "compile", input_mode="per_member")
    ens = executor.build(plan, copy.deepcopy(members))
    _assert_like_the_loop(ens, members, [torch.randn(N, *shape) * 3 + 2 for _ in range(3)], per_member=True)


class AdaptedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.c(x))).mean((2, 3)))


def test_compile_updates_a_training_batch_norm_inside_an_eval_model_once_per_call():
    # Was: test-time BN adaptation (model.eval(), its BatchNorm .train()): compile looked at the stage's own flag
    # (eval) only and compiled the BatchNorm, applying its update three times on the first call
    members = _members(AdaptedNet)
    for m in members:
        m.bn.train()
    plan, _ = _forced(members, (torch.randn(4, 3, 8, 8),), "compile", input_mode="per_member")
    ens = executor.build(plan, copy.deepcopy(members))
    _assert_like_the_loop(ens, members, [torch.randn(N, 4, 3, 8, 8) + k for k in range(2)], per_member=True)


# --- 3. wide: an in-place op hands on the value it wrote ------------------------------------------------------------

class MemoryWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("mem", torch.randn(4, 6))

    def forward(self, x):
        h = self.fc(x)
        self.mem[:, :3].mul_(0.5).add_(h[:, :3].detach())  # EMA-style write into part of a memory
        return h + self.mem


@pytest.mark.parametrize("strategies", [("wide", "loop"), ("wide", "wide"), ("loop", "wide"), ("compile", "compile")])
def test_forced_strategies_on_excluded_buffer_writes_match_the_loop(strategies):
    # Was: with wide on the excluded mul_ stage, its result was a stacked copy of mem's slice, so the next stage's
    # add_ wrote the copy: outputs 77% off and mem wrong in every member
    members = _members(MemoryWrite)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 6),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    excluded = [s.id for s in plan.stages if s.mode is StageMode.EXCLUDED]
    assert len(excluded) == 2, [(s.id, s.nodes, s.reason) for s in plan.stages]
    for sid, strategy in zip(excluded, strategies):
        plan = planner.set_options(plan, graph, sid, strategy=strategy)
    ens = executor.build(plan, copy.deepcopy(members))
    _assert_like_the_loop(ens, members, [torch.randn(N, 4, 6) for _ in range(2)], per_member=True)


class GruPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, x):
        o, _ = self.gru(x)
        return self.head(o[:, -1])


def test_compile_on_a_stage_vmap_cannot_run_is_refused_at_build():
    # Was: accepted at build, then failed at the first call with vmap's "Batching rule not implemented" and the
    # advice to check the input shapes or exclude the stage (it was excluded)
    members = _members(GruPolicy)
    x = torch.randn(2, 6, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    gru = next(s.id for s in plan.stages if s.mode is StageMode.EXCLUDED)
    forced = planner.set_options(plan, graph, gru, strategy="compile")
    with pytest.raises(planner.ExecutionError, match=rf"stage {gru} is excluded \(no batching rule for gru.*cannot run "
                                                     r"strategy 'compile'.*strategy='loop'"):
        executor.build(forced, copy.deepcopy(members))
    # the default (loop) and wide still run it as the loop does; a stage excluded by hand that vmap runs compiles
    for strategy in ("loop", "wide"):
        ens = executor.build(planner.set_options(plan, graph, gru, strategy=strategy), copy.deepcopy(members))
        _assert_like_the_loop(ens, members, [x], per_member=False)
    other = next(s.id for s in plan.stages if s.mode is StageMode.BATCHED)
    by_hand = planner.set_options(planner.exclude(plan, graph, other), graph, other, strategy="compile")
    _assert_like_the_loop(executor.build(by_hand, copy.deepcopy(members)), members, [x], per_member=False)


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(5, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.out(F.dropout(self.fc(x), 0.5, training=True))


def test_wide_on_a_stage_excluded_for_randomness_draws_as_the_loop():
    """Not a regression (it held before): the proof that wide on a stage the planner excluded for its random draws
    draws member by member, as the loop does from the same seed (one such stage; see verify's draw-order note)."""
    members = _members(Dropped)
    x = torch.randn(4, 5)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    drop = [s for s in plan.stages if s.mode is StageMode.EXCLUDED]
    assert len(drop) == 1 and drop[0].reason.startswith("randomness"), [(s.id, s.reason) for s in plan.stages]
    ens = executor.build(planner.set_options(plan, graph, drop[0].id, strategy="wide"), copy.deepcopy(members))
    for seed in (7, 8):
        torch.manual_seed(seed)
        with torch.no_grad():
            got = ens(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, _loop(members, x, per_member=False), **TIGHT)


class ValueShaped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.register_buffer("acc", torch.zeros(6))

    def forward(self, x):
        h = self.fc(x)
        keep = h[h.sum(-1) > 0]  # how many rows differs per member
        return self.acc + keep.sum(0)


def test_compile_on_a_value_shaped_stage_is_refused_at_build():
    members = _members(ValueShaped)
    x = torch.randn(8, 5)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    shaped = [s for s in plan.stages if s.mode is StageMode.EXCLUDED and "depends on the values" in s.reason]
    assert shaped, [(s.id, s.reason) for s in plan.stages]
    forced = planner.set_options(plan, graph, shaped[0].id, strategy="compile")
    with pytest.raises(planner.ExecutionError, match=rf"stage {shaped[0].id} is excluded \(a shape that depends on the "
                                                     r"values.*cannot run strategy 'compile'.*strategy='loop'"):
        executor.build(forced, copy.deepcopy(members))


# --- 4. wide: h.__setitem__ writes each member's rows ----------------------------------------------------------------

class SetItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(5, 6), nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.fc(x).clone()
        h.__setitem__((slice(None), 0), self.w[0])  # torch.fx keeps it a method call (`h[:, 0] = v` needs export)
        return h * self.w


def test_wide_dunder_setitem_writes_each_members_value():
    # Was: ExecutionError "ValueError: vmap(<lambda>, ...) must only return Tensors, got NoneType" (wide caught only
    # RuntimeError from vmap, and __setitem__ returns None), where vmap and the loop run it
    members = _members(SetItem)
    x = torch.randn(4, 5)
    plan, _ = _forced(members, (x,), "wide")
    ens = executor.build(plan, copy.deepcopy(members))
    _assert_like_the_loop(ens, members, [x, torch.randn(2, 5)], per_member=False)


# --- 5. compile under torch.func.grad: refused, and named for what it is --------------------------------------------

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_compile_under_torch_func_grad_names_the_transform():
    # Was: refused as "a backward with create_graph=True: a gradient penalty, a Hessian-vector product", which the
    # user (a first-order torch.func.grad) did not write
    members = _members(Mlp)
    x = torch.randn(N, 4, 5)
    plan, _ = _forced(members, (x[0],), "compile", input_mode="per_member")
    ens = executor.build(plan, copy.deepcopy(members))
    params = {k: v.detach() for k, v in ens.named_parameters()}
    with pytest.raises(planner.ExecutionError, match=r"stage s0 runs strategy 'compile'.*torch\.func transform.*"
                                                     r"loss\.backward\(\).*strategy='vmap'"):
        grad(lambda p: functional_call(ens, p, (x,)).square().sum())(params)
    with pytest.raises(planner.ExecutionError, match=r"create_graph=True: a gradient penalty"):
        torch.autograd.grad(ens(x).square().sum(), list(ens.parameters()), create_graph=True)
