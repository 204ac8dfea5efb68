"""Custom torch.autograd.Functions (straight-through estimators, gradient reversal) keep their own backward.

fx used to trace through `Fn.apply` and record the forward's ops alone: every strategy trained with the gradient of
those ops, without a word (a straight-through `round` gave zero gradients; a reversal the wrong sign). A Function
called on traced values is now one graph node calling it: vmap batches it where the Function gives a vmap rule,
else its stage runs member by member, each through its own backward. Where the graph cannot keep it (torch.export,
an argument no graph holds), training is refused by name; inference is unaffected."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError
from stagewise.planner.plan import Strategy

from conftest import assert_trains_like_the_loop

N = 3


class RoundSTE(torch.autograd.Function):
    """Rounds forward, passes the gradient straight through (no vmap rule: old-style forward(ctx, ...))."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Reverse(torch.autograd.Function):
    """Identity forward, the gradient reversed and scaled (setup_context with generate_vmap_rule: vmap batches it)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, scale):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return -ctx.scale * g, None


class TakesACallable(torch.autograd.Function):
    """An argument no graph node can hold (a function): traced through, its backward lost."""

    @staticmethod
    def forward(ctx, fn, x):
        return fn(x)

    @staticmethod
    def backward(ctx, g):
        return None, 3 * g


class Uses(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(6, 6), nn.Linear(6, 2), how

    def forward(self, x):
        h = self.a(x) * 4
        if self.how == "ste":
            h = RoundSTE.apply(h)
        elif self.how == "reverse":
            h = Reverse.apply(h, 0.5)
        elif self.how == "callable":
            h = TakesACallable.apply(torch.tanh, h)
        elif self.how == "export_ste":  # a branch on a size: fx cannot trace it, torch.export can
            h = RoundSTE.apply(h + 1 if h.shape[0] > 2 else h)
        elif self.how == "reentrant_checkpoint":
            h = checkpoint(torch.tanh, h, use_reentrant=True)
        return self.b(h)


def _members(how):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(Uses(how).train())
    return out


@pytest.mark.parametrize("strategy", [None, Strategy.VMAP, Strategy.LOOP, Strategy.WIDE])
@pytest.mark.parametrize("how", ["ste", "reverse"])
def test_a_custom_function_trains_with_its_own_backward(how, strategy):
    """Was: a.weight's gradient all zeros (ste) or of the wrong sign and scale (reverse), every member, no error."""
    members = _members(how)
    x = torch.randn(4, 6)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    assert graph.tracer == "fx"
    plan = planner.propose(graph, n_members=N)
    if strategy is not None:
        for stage in plan.stages:
            if stage.mode.value == "batched":
                plan = planner.set_options(plan, graph, stage.id, strategy=strategy.value)
    assert_trains_like_the_loop(executor.build(plan, copy.deepcopy(members)), members, (x,))
    assert executor.verify(plan, members, (x,), grads=True).ok


def test_a_function_without_a_vmap_rule_runs_member_by_member_and_says_why():
    members = _members("ste")
    graph = planner.trace(members[0], (torch.randn(4, 6),))
    plan = planner.propose(graph, n_members=N)
    (stage,) = [s for s in plan.stages if "round_ste" in s.nodes]
    assert stage.mode.value == "excluded" and "RoundSTE" in stage.reason and "own backward" in stage.reason
    (batched,) = [s for s in planner.propose(planner.trace(_members("reverse")[0], (torch.randn(4, 6),)), N).stages]
    assert batched.mode.value == "batched"  # generate_vmap_rule: one vmapped stage, the Function inside it


def test_a_batched_module_with_a_function_node_saves_and_loads():
    members = _members("ste")
    x = torch.randn(4, 6)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), copy.deepcopy(members))
    buf = io.BytesIO()
    torch.save(ens, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(again(x), ens(x), rtol=0, atol=0)


@pytest.mark.parametrize("how, says", [("callable", "TakesACallable"), ("export_ste", "RoundSTE"),
                                       ("reentrant_checkpoint", "use_reentrant=False")])
def test_training_is_refused_where_the_graph_lost_a_functions_backward(how, says):
    """torch.export records a Function's forward ops (and a reentrant checkpoint's region with gradients off); fx
    traces through a Function taking a callable. Was: trained with the forward ops' gradient (or none), silently."""
    members = _members(how)
    x = torch.randn(4, 6)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():  # inference is unaffected
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=says):
        ens(x)
    assert not executor.verify(plan, members, (x,), grads=True).ok


def test_two_functions_of_one_name_stay_apart():
    from stagewise.planner.trace_watch import _function_of, function_key

    def make(k):
        class RoundSTE(torch.autograd.Function):  # noqa: N801 - the same qualified name each time
            @staticmethod
            def forward(ctx, x):
                return x * k

            @staticmethod
            def backward(ctx, g):
                return g * k
        return RoundSTE

    one, two = make(2), make(3)
    assert function_key(one) != function_key(two)
    assert _function_of(function_key(one)) is one and _function_of(function_key(two)) is two


class DoublesInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NormsRows(torch.autograd.Function):
    """A vmap rule, and a backward that calls torch.autograd.grad (which cannot run under vmap)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x / x.norm(dim=-1, keepdim=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = x / x.norm(dim=-1, keepdim=True)
            return torch.autograd.grad(y, x, g)[0]


class Masks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask * 0.5, None


class Uses2(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(6, 6), nn.Linear(6, 2), how
        self.mask = (torch.arange(6) % 2).float()  # a plain tensor attribute, not a buffer

    def forward(self, x):
        h = self.a(x)
        if self.how == "dirty":
            DoublesInPlace.apply(h)
        elif self.how == "grad_in_backward":
            h = NormsRows.apply(h)
        else:
            h = Masks.apply(h, self.mask)
        return self.b(h)


def test_a_function_writing_its_input_is_seen_writing():
    """Was (after the Function became one node): `b` read h before the write, off 1.07 without a word."""
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(Uses2("dirty"))
    x = torch.randn(4, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    with torch.no_grad():
        torch.testing.assert_close(executor.build(plan, copy.deepcopy(members))(x),
                                   torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["grad_in_backward", "tensor_attribute"])
def test_functions_whose_backward_or_arguments_vmap_cannot_take_train_like_the_loop(how):
    """Was: "call Tensor.requires_grad_() inside of a function being transformed by a functorch transform" at backward
    (the vmap rule's backward ran under vmap); a tensor attribute argument made fx trace through the Function and
    training was refused."""
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(Uses2(how).train())
    x = torch.randn(4, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    assert_trains_like_the_loop(executor.build(plan, copy.deepcopy(members)), members, (x,))


# --- a backward marked @once_differentiable under a gradient penalty --------------------------------------------------

class OnceSwish(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class OnceCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(OnceSwish.apply(self.fc1(x)))


def test_a_once_differentiable_backward_runs_per_member_and_refuses_a_second_derivative_as_the_loop():
    torch.manual_seed(0)
    members = [OnceCritic() for _ in range(N)]
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(5, 6),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    assert any(s.mode.value == "excluded" for s in plan.stages), plan.stages
    ens = executor.build(plan, members)
    x = torch.randn(N, 5, 6, requires_grad=True)
    gx, = torch.autograd.grad(ens(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):  # what each member's own backward raises
        gx.norm().backward()
    # first-order training is unchanged
    x = torch.randn(N, 5, 6)
    ens(x).sum().backward()
    for i, m in enumerate(members):
        m(x[i]).sum().backward()
        torch.testing.assert_close(ens.stacked.fc1.weight.grad[i], m.fc1.weight.grad, rtol=1e-5, atol=1e-6)
