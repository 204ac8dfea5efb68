"""torch.fx's graph checked against forward() on what they leave in the model, not only on what they return: a
branch fx takes wrongly before a BatchNorm in training changes nothing in the output (the batch statistics take the
shift out) but moves the running statistics, which every later eval call reads."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner

N = 3


class ShiftedBN(nn.Module):
    """`if not isinstance(x, torch.Tensor)` is true for an fx proxy: the graph adds 1 where forward() does not."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        if not isinstance(x, torch.Tensor):  # a numpy image in [0, 1], centred (fx: true for a proxy)
            x = x - 0.5
        return self.head(self.bn(self.conv(x)).relu().mean((2, 3)))


def test_running_statistics_written_by_the_graph_match_forward():
    torch.manual_seed(0)
    members = [ShiftedBN().train() for _ in range(N)]
    ref = [copy.deepcopy(m) for m in members]
    x = torch.randn(4, 3, 8, 8)
    graph = planner.trace(members[0], (x,))
    assert graph.tracer == "export", graph.tracer_note
    ens = executor.build(planner.propose(graph, n_members=N), members)
    ens.train()
    for _ in range(2):
        out = ens(x)
        want = torch.stack([m(x) for m in ref])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ens.stacked.bn.running_mean, torch.stack([m.bn.running_mean for m in ref]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ens.stacked.bn.running_var, torch.stack([m.bn.running_var for m in ref]), rtol=1e-5, atol=1e-6)


def test_an_agreeing_graph_stays_with_fx():
    torch.manual_seed(0)

    class Plain(ShiftedBN):
        def forward(self, x):
            return self.head(self.bn(self.conv(x)).relu().mean((2, 3)))

    model = Plain().train()
    before = copy.deepcopy(model.state_dict())
    graph = planner.trace(model, (torch.randn(4, 3, 8, 8),))
    assert graph.tracer == "fx"
    for k, v in model.state_dict().items():  # the check's runs leave the model as it was
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


# --- a leaf module writing its own state, read elsewhere in forward() -------------------------------------------

class RewardScaledByStatistics(nn.Module):
    """RL: a BatchNorm normalising encoded observations, whose running_var (after this call's update) scales the
    reward: the read is ordered after the layer that writes it, which the graph shows as no in-place op."""

    def __init__(self):
        super().__init__()
        self.enc, self.obs_norm, self.q = nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 1)

    def forward(self, obs, reward):
        q = self.q(self.obs_norm(self.enc(obs))).squeeze(-1)
        return q, reward / torch.sqrt(self.obs_norm.running_var.mean() + 1e-5)


class CatalogueScores(nn.Module):
    """A two-tower recommender: the lookup with max_norm renormalises the item rows it reads, then the whole
    catalogue is scored with the renormalised table (and, before it, with the table as it was)."""

    def __init__(self, functional=False):
        super().__init__()
        self.functional = functional
        self.user = nn.Linear(6, 6)
        self.item = nn.Embedding(12, 6, max_norm=1.0)
        nn.init.normal_(self.item.weight, std=3.0)

    def forward(self, u, pos):
        before = self.user(u) @ self.item.weight.t()
        p = (nn.functional.embedding(pos, self.item.weight, max_norm=1.0) if self.functional else self.item(pos))
        return before, (self.user(u) * p).sum(-1), self.user(u) @ self.item.weight.t()


def _loop(ref, *inputs):
    outs = [m(*inputs) for m in ref]
    return [torch.stack(t) for t in zip(*outs)]


def test_statistics_read_after_the_layer_that_updates_them():
    torch.manual_seed(0)
    members = [RewardScaledByStatistics().train() for _ in range(N)]
    ref = copy.deepcopy(members)
    g = torch.Generator().manual_seed(0)
    obs, rew = torch.randn(8, 4, generator=g) * 5, torch.randn(8, generator=g)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (obs, rew)), N), members).train()
    for _ in range(3):
        obs, rew = torch.randn(8, 4, generator=g) * 5, torch.randn(8, generator=g)
        with torch.no_grad():
            for a, b in zip(ens(obs, rew), _loop(ref, obs, rew)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("functional", [False, True])
def test_rows_renormalised_by_a_lookup_are_read_after_it(functional):
    torch.manual_seed(0)
    members = [CatalogueScores(functional) for _ in range(N)]
    ref = copy.deepcopy(members)
    u, pos = torch.randn(4, 6), torch.tensor([1, 3, 3, 7])
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (u, pos)), N), members)
    for ids in (pos, torch.tensor([0, 2, 5, 11, 2, 9])):
        u = torch.randn(len(ids), 6)
        with torch.no_grad():
            for a, b in zip(ens(u, ids), _loop(ref, u, ids)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- torch.utils.checkpoint around a layer that updates running statistics --------------------------------------------

class CheckpointedBN(nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        self.fc1, self.bn1, self.fc2 = nn.Linear(6, 8), (nn.BatchNorm1d(8) if bn else nn.LayerNorm(8)), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: self.bn1(self.fc1(t)).relu(), x, use_reentrant=False)
        return self.fc2(h)


def test_a_checkpointed_batchnorm_updates_its_statistics_as_the_loop():
    """Eager torch recomputes the checkpointed region in backward, updating the BatchNorm a second time: the batched
    module repeats that update (it warned and updated once before, num_batches_tracked 1 against the loop's 2)."""
    torch.manual_seed(0)
    members = [CheckpointedBN().train() for _ in range(N)]
    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    ens = executor.build(plan, copy.deepcopy(members)).train()
    ref = copy.deepcopy(members)
    ens(x).sum().backward()
    for m in ref:
        m(x).sum().backward()
    assert ens.stacked.bn1.num_batches_tracked.tolist() == [2] * N
    assert [int(m.bn1.num_batches_tracked) for m in ref] == [2] * N
    for k in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(ens.stacked.bn1, k), torch.stack([getattr(m.bn1, k) for m in ref]))


def test_a_checkpoint_without_running_statistics_is_quiet():
    torch.manual_seed(0)
    model = CheckpointedBN(bn=False).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner.trace(model, (torch.randn(8, 6),))


# --- a torch.no_grad() region writing a buffer, under a compiled stage ---------------------------------------------

class NoGradEMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 4)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.fc3(h)


def test_a_region_writing_a_buffer_counts_as_a_write_for_the_stage():
    from stagewise.planner.plan import Strategy

    torch.manual_seed(0)
    members = [NoGradEMA().eval() for _ in range(N)]
    for m in members:
        m.ema.uniform_(0, 1)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(5, 6),))
    assert graph.tracer == "export"
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    for s in plan.stages:
        plan = planner.set_options(plan, graph, s.id, strategy=Strategy.COMPILE)
    ens = executor.build(plan, [copy.deepcopy(m) for m in members]).eval()
    assert all(r.program.writes_in_place for r in ens.runners if any(isinstance(n.target, torch._ops.HigherOrderOperator)
                                                                     for n in r.program.module.graph.nodes))
    x = torch.randn(N, 5, 6)
    with torch.no_grad():
        ens(x)
        for i, m in enumerate(members):
            m(x[i])
    torch.testing.assert_close(ens.stacked.ema, torch.stack([m.ema for m in members]), rtol=1e-6, atol=1e-6)


# --- a derivative taken inside forward() ------------------------------------------------------------------------------

class PINN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, t):
        t = t.clone().requires_grad_(True)
        u = self.net(t)
        du = torch.autograd.grad(u, t, torch.ones_like(u), create_graph=True)[0]
        return u, du + u


class Forces(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, pos):
        with torch.enable_grad():
            pos = pos if pos.requires_grad else pos.requires_grad_(True)
            e = self.net(pos).sum(-2)
            return e, -torch.autograd.grad(e.sum(), pos, create_graph=True)[0]


@pytest.mark.parametrize("make,x", [(PINN, (8, 1)), (Forces, (4, 5, 3))])
def test_a_derivative_inside_forward_is_named_with_the_way_out(make, x):
    with pytest.raises(planner.TraceError, match="calls torch.autograd.grad.*outside the batched module"):
        planner.trace(make(), (torch.randn(*x),))
    assert torch.autograd.grad.__module__ == "torch.autograd"  # torch's own again after the trace


def test_a_checkpointed_batchnorm_traced_in_eval_updates_as_the_loop_once_trained():
    """Traced and built in eval, then trained: the second update is the loop's too (it was only warned about)."""
    torch.manual_seed(0)
    members = [CheckpointedBN().eval() for _ in range(N)]
    x = torch.randn(8, 6)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), copy.deepcopy(members))
    ens.train()
    ref = [copy.deepcopy(m).train() for m in members]
    ens(x).sum().backward()
    for m in ref:
        m(x).sum().backward()
    assert ens.stacked.bn1.num_batches_tracked.tolist() == [int(m.bn1.num_batches_tracked) for m in ref] == [2] * N


class TiedRenorm(nn.Module):
    """A lookup with max_norm of the weight the output head reads afterwards (tied), trained."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(20, 8) * 3)
        self.l = nn.Linear(8, 8)

    def forward(self, i):
        h = nn.functional.embedding(i, self.w, max_norm=2.0)
        return self.l(h) @ self.w.t()


def test_a_renormalising_lookup_of_a_tied_weight_trains_as_the_loop():
    torch.manual_seed(0)
    members = [TiedRenorm() for _ in range(N)]
    ref = copy.deepcopy(members)
    i = torch.randint(0, 20, (4, 5))
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (i,)), N), members)
    ens(i).sum().backward()
    for m in ref:
        m(i).sum().backward()
    for name, p in ens.named_stacked_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in ref])
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(ens.stacked.w, torch.stack([m.w for m in ref]), rtol=1e-6, atol=1e-6)
