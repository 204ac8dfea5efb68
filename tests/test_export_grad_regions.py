"""torch.export plans whose forward() has a `with torch.no_grad():` block: export keeps it as a sub-graph
(`wrap_with_set_grad_enabled(False, submod_1, ...)`), and the checks that look for state writes, batch norms and the
training flag look inside it (executor.subgraphs), as they do at the top level. Each against the member loop."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.optim.swa_utils as swa_utils
from torch import nn
import torch.nn.functional as F

from stagewise import executor, planner
from stagewise.executor.subgraphs import region_calls, root_outside, walk
from stagewise.planner.errors import ExecutionError, MemberError

N = 3


def _build(members, example, **kw):
    plan = planner.propose(planner.trace(members[0], example), n_members=len(members))
    assert plan.tracer == "export"
    return executor.build(plan, members, **kw), plan


def _close(a, b, tol=1e-5):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() <= tol


# --- the walk itself -------------------------------------------------------------------------------

class _BnInBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        with torch.no_grad():
            h = self.bn(self.fc(x))  # a frozen feature block
        return self.out(F.relu(h))


def test_walk_follows_a_block_placeholder_to_the_buffer_its_call_passes():
    torch.manual_seed(0)
    gm = planner.trace(_BnInBlock(), (torch.randn(6, 4),)).gm
    inner = [(s, n) for s, n in walk(gm) if s.parent is not None]
    assert inner and any(region_calls(gm, n) for n in gm.graph.nodes)
    norm = next((s, n) for s, n in inner if "batch_norm" in str(n.target))
    scope, mean = norm[0], norm[1].args[3]
    assert mean.op == "placeholder"
    top, root = root_outside(scope, mean, lambda v: v)
    assert top.parent is None and root.op == "get_attr" and str(root.target) == "bn.running_mean"


# --- finding 2: a buffer all members share, written inside the block -------------------------------

class _Stats(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))


class _Normalised(nn.Module):
    def __init__(self, stats):
        super().__init__()
        self.stats, self.fc = stats, nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            self.stats.mean.mul_(0.9).add_(0.1 * x.mean(0))  # a running input normaliser (RL idiom)
        return self.fc(x - self.stats.mean)


def test_buffer_shared_by_members_and_written_inside_no_grad_is_refused():
    torch.manual_seed(0)
    shared = _Stats()
    members = [_Normalised(shared) for _ in range(N)]
    x = torch.randn(5, 4) + 2
    with pytest.raises(MemberError, match=r"hold one tensor as buffer `stats.mean`"):
        _build(members, (x,))


def test_buffer_each_member_holds_written_inside_no_grad_matches_the_loop():
    torch.manual_seed(0)
    members = [_Normalised(_Stats()) for _ in range(N)]
    loop = copy.deepcopy(members)
    x = torch.randn(5, 4) + 2
    ens, _ = _build(members, (x,))
    for _ in range(3):
        out, ref = ens(x), torch.stack([m(x) for m in loop])
        assert _close(out, ref)
    mean = ens.member_state_dicts()
    for i, m in enumerate(loop):
        torch.testing.assert_close(mean[i]["stats.mean"], m.stats.mean, rtol=1e-6, atol=1e-6)


def test_shared_batchnorm_updating_inside_no_grad_is_refused():
    torch.manual_seed(0)
    shared = _BnInBlock().train()
    members = [copy.copy(shared) for _ in range(N)]
    for m in members:  # each member its own head, one BatchNorm object for all
        m._modules = dict(m._modules, out=copy.deepcopy(shared.out), fc=copy.deepcopy(shared.fc))
    with pytest.raises(MemberError, match=r"hold one tensor as buffer `bn.running_(mean|var)`"):
        _build(members, (torch.randn(6, 4),))


def test_verify_keeps_a_buffer_shared_between_members():
    """verify's reference loop copies the members together: sharing between them survives, so the batched module is
    held to the loop the caller would run (here: refused at build, as executor.build refuses it)."""
    torch.manual_seed(0)
    shared = _Stats()
    members = [_Normalised(shared) for _ in range(N)]
    x = torch.randn(5, 4) + 2
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    try:
        report = executor.verify(plan, members, (x,))
    except MemberError as e:
        assert "stats.mean" in str(e)
    else:
        assert not report.ok, "verify said MATCH where the loop over the caller's members updates one shared buffer"
    assert torch.equal(shared.mean, torch.zeros(4))  # the caller's members never run


# --- finding 4: Dropout inside the block follows no .eval() / .train() -------------------------------

class _DropInBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)

    def forward(self, x):
        with torch.no_grad():
            h = self.drop(self.fc(x))  # a noisy teacher branch
        return self.out(F.relu(h))


@pytest.mark.parametrize("built_training", [True, False])
def test_dropout_inside_no_grad_refuses_the_other_mode(built_training):
    torch.manual_seed(0)
    members = [_DropInBlock().train(built_training) for _ in range(N)]
    loop = copy.deepcopy(members)
    x = torch.randn(6, 4)
    ens, _ = _build(members, (x,))
    with pytest.raises(ExecutionError, match="dropout"):
        ens.train(not built_training)
    if not built_training:  # the traced mode still runs, as the loop
        with torch.no_grad():
            assert _close(ens(x), torch.stack([m(x) for m in loop]), 1e-6)


# --- finding 3: update_bn with the BatchNorm inside the block ---------------------------------------

def test_update_bn_reaches_a_batchnorm_inside_no_grad():
    torch.manual_seed(0)
    members = [_BnInBlock().train() for _ in range(N)]
    loop = copy.deepcopy(members)
    ens, _ = _build(members, (torch.randn(6, 4),))
    ens.train()
    loader = [torch.randn(6, 4) * (1 + k) + k for k in range(4)]
    swa_utils.update_bn(loader, ens)  # (looked up at the call: stagewise's wrapped one)
    for m in loop:
        swa_utils.update_bn(loader, m)
    got = ens.member_state_dicts()
    for i, m in enumerate(loop):
        for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            torch.testing.assert_close(got[i][k], m.state_dict()[k], rtol=1e-5, atol=1e-6)
        assert not torch.equal(got[i]["bn.running_mean"], torch.zeros(8))


class _StatsByHand(nn.Module):
    """A BatchNorm whose statistics forward() moves itself, with no batch norm op: no layer update_bn can reset."""

    def __init__(self):
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            self.bn.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc(x - self.bn.running_mean)


def test_update_bn_refuses_statistics_it_cannot_attribute_to_a_layer():
    torch.manual_seed(0)
    members = [_StatsByHand() for _ in range(N)]
    ens, _ = _build(members, (torch.randn(6, 4),))
    before = ens.member_state_dicts()[0]["bn.running_mean"].clone()
    with pytest.raises(ExecutionError, match="update_bn"):
        swa_utils.update_bn([torch.randn(6, 4) for _ in range(2)], ens)
    torch.testing.assert_close(ens.member_state_dicts()[0]["bn.running_mean"], before)


# --- finding 1: a train() override on an export plan ------------------------------------------------

class _FreezeBn(nn.Module):
    """Fine-tuning's `freeze_bn`: train() keeps BatchNorm in eval. torch.export because of a branch on a size."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, x):
        if x.shape[-1] > 8:
            x = F.interpolate(x, size=(8, 8))
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _freeze_bn_members(train_first: bool):
    torch.manual_seed(0)
    members = [_FreezeBn() for _ in range(N)]
    for m in members:
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        if train_first:
            m.train()
    return members


def test_train_override_built_fresh_refuses_train():
    members = _freeze_bn_members(train_first=False)  # nn.Module starts in training mode: the override has not run
    ens, _ = _build(members, (torch.rand(4, 3, 8, 8),))
    with pytest.raises(ExecutionError, match=r"overrides train\(\)"):
        ens.train()


def test_train_override_run_before_build_matches_the_loop():
    members = _freeze_bn_members(train_first=True)
    loop = copy.deepcopy(members)
    x = torch.rand(4, 3, 8, 8)
    ens, _ = _build(members, (x,))
    ens.train()
    for m in loop:
        m.train()
    assert _close(ens(x), torch.stack([m(x) for m in loop]), 1e-6)
    got = ens.member_state_dicts()
    for i, m in enumerate(loop):
        torch.testing.assert_close(got[i]["bn.running_mean"], m.bn.running_mean, rtol=0, atol=0)


# --- finding 5: a sweep's per-member number used inside the block -----------------------------------

class _Dino(nn.Module):
    """DINO's teacher: a temperature and a centre momentum per member, both used inside the no_grad block."""

    def __init__(self, t_temp, c_mom):
        super().__init__()
        self.student, self.teacher = nn.Linear(8, 6), nn.Linear(8, 6).requires_grad_(False)
        self.register_buffer("center", torch.zeros(6))
        self.t_temp, self.c_mom = t_temp, c_mom

    def forward(self, x1, x2):
        s = self.student(x1)
        with torch.no_grad():
            tl = self.teacher(x2)
            t = F.softmax((tl - self.center) / self.t_temp, dim=-1)
            self.center.mul_(self.c_mom).add_(tl.mean(0) * (1 - self.c_mom))
        return -(t * F.log_softmax(s / 0.1, dim=-1)).sum(-1).mean()


def test_sweep_number_inside_no_grad_is_each_members_own():
    torch.manual_seed(0)
    members = [_Dino(t, c) for t, c in ((0.04, 0.9), (0.5, 0.5), (2.0, 0.0))]
    loop = copy.deepcopy(members)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    ens, _ = _build(members, (x1, x2))
    opt = executor.StackedSGD([p for p in ens.parameters() if p.requires_grad], N, lr=0.1)
    opts = [torch.optim.SGD(m.student.parameters(), lr=0.1) for m in loop]
    for _ in range(3):
        a, b = torch.randn(4, 8), torch.randn(4, 8)
        out = ens(a, b)
        ref = torch.stack([m(a, b) for m in loop])
        assert _close(out, ref.detach(), 1e-5)
        opt.zero_grad()
        out.sum().backward()
        opt.step()
        for o in opts:
            o.zero_grad()
        ref.sum().backward()
        for o in opts:
            o.step()
    got = ens.member_state_dicts()
    for i, m in enumerate(loop):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[i][k], v, rtol=1e-5, atol=1e-6)


class _SizeInBlock(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.fc, self.k = nn.Linear(4, 8), k

    def forward(self, x):
        with torch.no_grad():
            h = self.fc(x)[:, :self.k]  # a whole number the op needs as Python: not given per member in a block
        return h.sum(-1)


def test_sweep_size_inside_no_grad_is_refused_by_name():
    members = [_SizeInBlock(k) for k in (2, 3, 4)]
    with pytest.raises(MemberError, match=r"inside submod_\d+.*differing attribute\(s\): k.*member 1: 3.*outside the block"):
        _build(members, (torch.randn(5, 4),))
