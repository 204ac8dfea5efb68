"""Member-batched indices out of a member's table are refused, as the member loop refuses them.

torch.func's embedding rule flattens the stacked [N, V, d] table into [N*V, d] and shifts member m's indices by
m*V: member 0's index V read (and trained) member 1's row 0, an index -1 of member 1 read member 0's last row, and
F.one_hot's vmap decomposition gave a zero row for a class >= num_classes, where the loop raises. executor.stages puts
a check_member_indices node before each embedding / one_hot (CompileRunner checks the indices its compiled call hands
back). In range, every strategy still matches the loop: outputs and gradients. Also: a float64 input to a float32
plan is named as a dtype mismatch, not a shape one.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.strategies import compiled
from stagewise.planner.plan import Strategy

N, V, D = 3, 5, 4


class ModuleLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(V, D, padding_idx=0), nn.Linear(D, 2)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)))


class FunctionalLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.fc = nn.Parameter(torch.randn(V, D)), nn.Linear(D, 2)

    def forward(self, ids):
        return self.fc(torch.tanh(F.embedding(ids, self.table)))


class OneHot(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(V, D))

    def forward(self, ids):
        return torch.tanh(F.one_hot(ids, V).float() @ self.w)


MODELS = [ModuleLookup, FunctionalLookup, OneHot]
STRATEGIES = [Strategy.VMAP, Strategy.WIDE, Strategy.COMPILE]
IDS = torch.tensor([[0, 1, 2, 4], [3, 0, 0, 1]])


def _ensemble(make, strategy, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    graph = planner.trace(copy.deepcopy(members[0]), (IDS,))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    for s in plan.stages:
        plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    return members, executor.build(plan, copy.deepcopy(members))


def _member_ids(member, bad):
    ids = torch.stack([IDS] * N).clone()
    for m in range(N):
        ids[m] = (IDS + m) % V  # each member its own indices
    ids[member, 1, 2] = bad
    return ids


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.value)
@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_in_range_indices_match_the_loop_forward_and_gradients(make, strategy, monkeypatch):
    members, ens = _ensemble(make, strategy, monkeypatch)
    ids = _member_ids(0, 3)
    for training in (False, True):  # eval: compile's compiled call; training: its eager vmap
        ens.train(training)
        for m in members:
            m.train(training)
            m.zero_grad()
        ens.zero_grad()
        out = ens(ids)
        loop = torch.stack([m(i) for m, i in zip(members, ids)])
        torch.testing.assert_close(out, loop, rtol=0, atol=0)
        (out * torch.arange(1.0, out.numel() + 1).view_as(out)).sum().backward()
        (loop * torch.arange(1.0, loop.numel() + 1).view_as(loop)).sum().backward()
        for name, p in ens.named_stacked_parameters():
            torch.testing.assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in members]),
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [V, N * V - 1, -1], ids=lambda b: f"id{b}")
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.value)
@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_an_index_the_loop_refuses_is_refused_naming_member_and_index(make, strategy, bad, monkeypatch):
    members, ens = _ensemble(make, strategy, monkeypatch)
    ens.eval()
    for m in members:
        m.eval()
    ens(_member_ids(1, 0))  # compile: the first call compiles; the refused one below is a compiled call
    ids = _member_ids(1, bad)
    with pytest.raises((IndexError, RuntimeError)):  # what the member loop does with member 1's indices
        members[1](ids[1])
    size = "num_classes" if make is OneHot else "num_embeddings"
    with pytest.raises(planner.InputError, match=rf"member 1's indices into .* hold {bad}, outside \[0, {V}\).*below {size}"):
        ens(ids)
    with pytest.raises(planner.InputError, match=rf"member 1's indices .* hold {bad}"):
        ens.train()(ids)  # training runs eager vmap (compile too)
    ens.eval()
    ok = _member_ids(1, 2)
    torch.testing.assert_close(ens(ok), torch.stack([m(i) for m, i in zip(members, ok)]), rtol=0, atol=0)


def test_member_0s_index_v_no_longer_trains_member_1s_row_0(monkeypatch):
    """The review's case: member 0's id V answered member 1's row 0 and put a second gradient into it."""
    members, ens = _ensemble(ModuleLookup, Strategy.VMAP, monkeypatch)
    ids = _member_ids(0, V)
    with pytest.raises(planner.InputError, match=rf"member 0's indices into embedding emb hold {V}"):
        ens(ids).sum().backward()
    for name, p in ens.named_stacked_parameters():
        assert p.grad is None, name


def test_shared_indices_are_left_to_torch(monkeypatch):
    """Indices without a member axis carry no check (the op checks them against the member's own table)."""
    torch.manual_seed(0)
    members = [ModuleLookup() for _ in range(N)]
    graph = planner.trace(copy.deepcopy(members[0]), (IDS,))
    ens = executor.build(planner.propose(graph, n_members=N), copy.deepcopy(members))
    torch.testing.assert_close(ens(IDS), torch.stack([m(IDS) for m in members]), rtol=0, atol=0)
    bad = IDS.clone()
    bad[0, 0] = V
    with pytest.raises(planner.StagewiseError):
        ens(bad)


@pytest.mark.parametrize("model, x", [
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), torch.randn(4, 8)),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.randn(2, 3, 8, 8)),
], ids=["mlp", "conv"])
def test_a_float64_input_to_a_float32_plan_is_named_as_a_dtype_mismatch(model, x):
    torch.manual_seed(0)
    members = [model() for _ in range(N)]
    with pytest.raises(RuntimeError):  # the member loop refuses it too
        members[0](x.double())
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), members)
    with pytest.raises(planner.StagewiseError, match=r"float64.*float32.*\.to\(torch\.float32\)") as caught:
        ens(x.double())
    assert "exclude the stage" not in str(caught.value)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)


def test_a_saved_and_loaded_module_keeps_the_check_and_the_padding_guard(monkeypatch):
    """torch.load traces each stage again from its code (StageRetracer): the guard calls stay in the graph."""
    import io
    members, ens = _ensemble(ModuleLookup, Strategy.VMAP, monkeypatch)
    buf = io.BytesIO()
    torch.save(ens, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    code = "".join(p.module.code for p in loaded.programs)
    assert "check_member_indices" in code and "no_grad_at_padding" in code
    with pytest.raises(planner.InputError, match=rf"member 0's indices into embedding emb hold {V}"):
        loaded(_member_ids(0, V))
    ids = _member_ids(0, 0)  # padding ids in every member: no member's padding row trains
    out, loop = loaded(ids), torch.stack([m(i) for m, i in zip(members, ids)])
    torch.testing.assert_close(out, loop, rtol=0, atol=0)
    out.sum().backward()
    loop.sum().backward()
    for name, p in loaded.named_stacked_parameters():
        torch.testing.assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in members]),
                                   rtol=1e-6, atol=1e-6)
