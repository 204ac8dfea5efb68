"""What a trace sees of member 0 alone, checked against plain torch: a hook on an autograd node or a lossy
saved-tensor hook (gradients no graph holds), a branch on a buffer's value that no probed value flips (an activation
chosen per member by an integer buffer), and a tensor forward() leaves in a dict or namespace attribute."""
from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagewise import executor, planner
from stagewise.planner import ExecutionError, MemberError, TraceError

torch.set_num_threads(1)
N = 3


def _plan(model, x):
    return planner.propose(planner.trace(copy.deepcopy(model), (x,)), n_members=N)


def _grads_both(members, x, plan):
    """(batched, loop) gradients of sum(out**2), per parameter name stacked over members."""
    ens = executor.build(plan, members)
    ens(x).pow(2).sum().backward()
    got = {k: p.grad for k, p in ens.named_stacked_parameters()}
    want = {}
    for m in [copy.deepcopy(m) for m in members]:
        m(x).pow(2).sum().backward()
        for k, p in m.named_parameters():
            want.setdefault(k, []).append(p.grad)
    return got, {k: torch.stack(v) for k, v in want.items()}


# --- 1. gradients changed outside any graph ---------------------------------------------------------------------

class NodePrehook(nn.Module):
    """A gradient reversal written on the autograd node (DANN): each member's own backward runs it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.requires_grad:
            h.grad_fn.register_prehook(lambda go: (-0.1 * go[0],))
        return self.fc2(h)


class NodeHook(NodePrehook):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.requires_grad:
            h.grad_fn.register_hook(lambda gi, go: tuple(None if g is None else 3.0 * g for g in gi))
        return self.fc2(h)


class RoundedSaved(NodePrehook):
    """Saved-tensor hooks made of torch's own functions: the pack rounds what backward reads."""

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(torch.round, torch.clone):
            h = torch.tanh(self.fc1(x)) * 3
        return self.fc2(h)


@pytest.mark.parametrize("cls", [NodePrehook, NodeHook, RoundedSaved])
def test_gradients_no_graph_holds_are_refused_at_trace(cls):
    torch.manual_seed(0)
    members, x = [cls() for _ in range(N)], torch.randn(5, 8)
    # what silently happened before: the batched module trained with the plain gradient (fc1 11x off for the prehook)
    before = copy.deepcopy(members[0].state_dict())
    with pytest.raises(TraceError, match=r"other parameter gradients than forward\(\).*fc1\.(weight|bias).*autograd\.Function"):
        planner.trace(members[0], (x,))
    assert all(torch.equal(v, before[k]) for k, v in members[0].state_dict().items())  # the model is left as it was
    assert all(p.grad is None for p in members[0].parameters())


class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.save_for_backward(lam)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.saved_tensors[0] * g, None


class FunctionReversal(nn.Module):
    """The fix the refusal names, with the scale a buffer that differs per member."""

    def __init__(self, lam):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("lam", torch.tensor(lam))

    def forward(self, x):
        return self.fc2(Reverse.apply(torch.relu(self.fc1(x)), self.lam))


class DropoutCheckpointed(nn.Module):
    """Random draws and a recomputed region: eager and graph gradients agree, nothing to refuse."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 4), nn.Dropout(0.3)

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.fc1(t)), x, use_reentrant=False)
        return self.fc2(self.drop(h))


def test_function_reversal_trains_as_the_loop():
    torch.manual_seed(0)
    members, x = [FunctionReversal(lam) for lam in (0.1, 0.5, 1.0)], torch.randn(5, 8)
    got, want = _grads_both(members, x, _plan(members[0], x))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_dropout_and_checkpoint_still_trace_and_train_as_the_loop_in_eval():
    torch.manual_seed(0)
    members, x = [DropoutCheckpointed() for _ in range(N)], torch.randn(5, 8)
    _plan(members[0], x)  # traced in training mode (dropout draws): no refusal
    for m in members:
        m.eval()
    got, want = _grads_both(members, x, _plan(members[0], x))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# --- 2. a branch on a buffer's value ------------------------------------------------------------------------------

class ActivationById(nn.Module):
    """An activation chosen per member by an integer buffer (a sweep's categorical hyper-parameter)."""

    def __init__(self, act_id):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.register_buffer("act_id", torch.tensor(act_id))

    def forward(self, x):
        h = self.fc1(x)
        a = int(self.act_id)
        if a == 2:
            h = torch.tanh(h)
        elif a == 3:
            h = torch.sigmoid(h)
        else:
            h = torch.relu(h)
        return self.fc2(h)


class ActivationByFlag(ActivationById):
    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h) if self.act_id == 2 else torch.relu(h))


class ActivationByWhere(ActivationById):
    """The fix the refusal names: the choice kept on tensors."""

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.where(self.act_id == 2, torch.tanh(h), torch.relu(h)))


class ActivationByEqual(ActivationById):
    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h) if torch.equal(self.act_id, torch.tensor(2)) else torch.relu(h))


@pytest.mark.parametrize("cls", [ActivationById, ActivationByFlag, ActivationByEqual])
def test_branch_on_a_buffer_value_no_probe_flips_is_refused_at_build(cls):
    # member 0 holds 0: +1, +1000, -x-1, 0 and -x all take the relu branch, yet members 1 and 2 take others
    # (before: the batched module ran relu for all, members 0.58 and 0.42 off). The trace keeps member 0's graph; the
    # build traces each member with its own buffers
    torch.manual_seed(0)
    members, x = [cls(k) for k in (0, 2, 3)], torch.randn(5, 4)
    plan = _plan(members[0], x)
    with pytest.raises(MemberError, match=r"member 1 with its own buffers .*torch\.where"):
        executor.build(plan, members)
    # members that all take member 0's branch build and run as the loop
    alike = [cls(k) for k in (0, 1, 5)]
    ens = executor.build(plan, alike)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alike]), rtol=1e-5, atol=1e-6)


class NanGuard(ActivationById):
    """Harmless reads of a buffer's value: a guard and a log line (refused by the first version of the read watch)."""

    def forward(self, x):
        if torch.isnan(self.act_id.float()).any():
            raise RuntimeError("act_id is NaN")
        if float(self.act_id) > 1e9:
            print("large id")
        return self.fc2(torch.relu(self.fc1(x)))


def test_harmless_buffer_reads_trace_and_run_as_the_loop():
    torch.manual_seed(0)
    members, x = [NanGuard(k) for k in (0, 2, 3)], torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


def test_plan_traced_without_gradients_refuses_calls_with_gradients_where_a_node_hook_changes_them():
    # traced inside torch.no_grad() (for inference) the hook never ran; trained, fc1 came out 11x off
    torch.manual_seed(0)
    members, x = [NodePrehook() for _ in range(N)], torch.randn(5, 8)
    with torch.no_grad():
        plan = _plan(members[0], x)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"gradients on is refused.*fc1"):
        ens(x)


def test_choice_kept_on_tensors_runs_as_the_loop():
    torch.manual_seed(0)
    members, x = [ActivationByWhere(k) for k in (0, 2, 2)], torch.randn(5, 4)
    ens = executor.build(_plan(members[0], x), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


# --- 3. a tensor left in a dict or namespace attribute ----------------------------------------------------------

class KLInDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu, self.lv = nn.Linear(8, 4), nn.Linear(8, 4)
        self.losses = {"kl": torch.zeros(())}

    def kl(self, mu, lv):
        return -0.5 * (1 + lv - mu.pow(2) - lv.exp()).sum(-1).mean()

    def forward(self, x):
        mu, lv = self.mu(x), self.lv(x)
        self.losses["kl"] = self.kl(mu, lv)
        return mu


class KLInNamespace(KLInDict):
    def __init__(self):
        super().__init__()
        self.aux = types.SimpleNamespace(kl=None)

    def forward(self, x):
        mu, lv = self.mu(x), self.lv(x)
        self.aux.kl = self.kl(mu, lv)
        return mu


class CacheFilledOnce(KLInDict):
    """A table filled on the first call and only read after: not a value the caller misses."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        if "t" not in self.cache:
            self.cache["t"] = torch.arange(4.0)
        return self.mu(x) + self.cache["t"]


@pytest.mark.parametrize("cls, name", [(KLInDict, "KLInDict.losses"), (KLInNamespace, "KLInNamespace.aux")])
def test_tensor_stored_inside_a_dict_or_namespace_attribute_is_warned(cls, name):
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    with pytest.warns(UserWarning, match=rf"stores a tensor it computes as the plain attribute {name}"):
        planner.trace(cls(), (x,))


def test_cache_filled_once_is_not_warned():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        planner.trace(CacheFilledOnce(), (torch.randn(5, 8),))
