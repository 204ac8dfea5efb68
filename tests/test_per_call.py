"""The per-call path made cheap at build time (executor.stages.stateless_call, flat_vmap; the module's steps).

Each shortcut is checked against what it replaces: stateless_call against functional_call,
flat_vmap against torch.func.vmap, and the built module against the member loop.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from stagewise import executor, planner
from stagewise.executor.stages import flat_vmap, stateless_call
from stagewise.executor.values import Batched, PerMember, Shared, member_rows, member_value

N = 3


class TwoNames(nn.Module):
    """One Linear reachable as `a` and `b` (a tied submodule), used twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.b(self.a(x))))


def _stage_module(model: TwoNames) -> torch.fx.GraphModule:
    """A stage module calling the tied Linear under both its names (symbolic_trace would keep one)."""
    g = torch.fx.Graph()
    h = g.call_module("b", (g.call_module("a", (g.placeholder("x"),)),))
    g.output((g.call_module("head", (g.call_function(torch.relu, (h,)),)),))
    return torch.fx.GraphModule(model, g)


def test_stateless_call_matches_functional_call_and_puts_the_state_back():
    torch.manual_seed(0)
    gm = _stage_module(TwoNames())
    assert gm.a is gm.b
    names = [k for k, _ in gm.named_parameters(remove_duplicate=False)]
    before = {k: v for k, v in gm.named_parameters(remove_duplicate=False)}
    state = {k: torch.randn_like(v) for k, v in before.items()}
    state["b.weight"], state["b.bias"] = state["a.weight"], state["a.bias"]  # one tensor under both names, as build stacks it
    x = torch.randn(5, 4)
    call = stateless_call(gm, names)
    got = call(*[state[k] for k in names], x)
    assert all(p is before[k] for k, p in gm.named_parameters(remove_duplicate=False))
    # on a copy: functional_call itself leaves a tensor of `state` behind in a module reachable under two names
    want = functional_call(copy.deepcopy(gm), state, (x,), tie_weights=False)
    torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError):
        call(*[state[k] for k in names], torch.randn(5, 3))  # a failing call puts the state back too
    assert all(p is before[k] for k, p in gm.named_parameters(remove_duplicate=False))


def test_flat_vmap_matches_vmap():
    w = torch.randn(N, 4, 4)
    x = torch.randn(2, 4)

    def f(w, x):
        return x @ w, x.sum() + torch.zeros(3)  # the second output does not depend on the members

    got = flat_vmap(f, (0, None), N, "error")(w, x)
    want = vmap(f, in_dims=(0, None), randomness="error")(w, x)
    for g, h in zip(got, want):
        assert g.shape == h.shape and g.stride() == h.stride()
        torch.testing.assert_close(g, h)
    with pytest.raises(ValueError):  # a batched argument of another size: vmap's own error
        flat_vmap(f, (0, None), N + 1, "error")(w, x)
    with pytest.raises(RuntimeError, match="randomness"):
        flat_vmap(lambda w: (torch.nn.functional.dropout(w, 0.5, training=True),), (0,), N, "error")(w)


def test_member_rows_are_member_value_for_every_member():
    x = torch.randn(N, 2)
    for v in (Shared(x[0]), Batched(x), Batched((x, 7)), PerMember([1.0, 2.0, 3.0])):
        for views in (True, False):
            rows = member_rows(v, N, views)
            assert len(rows) == N
            for i, row in enumerate(rows):
                torch.utils._pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b) if isinstance(a, torch.Tensor) else None,
                                             row, member_value(v, i))


def _mlp_module(mode: str = "shared"):
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    plan = planner.propose(graph, n_members=N, input_mode=mode)
    return plan, members


def test_a_tied_submodule_matches_the_loop_over_calls():
    torch.manual_seed(0)
    members = [TwoNames().eval() for _ in range(N)]
    reference = copy.deepcopy(members)
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 4),)), n_members=N, input_mode="shared")
    module = executor.build(plan, members)
    for b in (5, 2, 5):
        x = torch.randn(b, 4)
        with torch.no_grad():
            torch.testing.assert_close(module(x), torch.stack([m(x) for m in reference]))


def test_assigned_runners_are_what_the_module_runs():
    """profile labels the runners by assigning module.runners; the module's steps must follow."""
    plan, members = _mlp_module()
    module = executor.build(plan, members)
    calls = []
    saved = module.runners
    module.runners = [lambda args, r=r: calls.append(r) or r(args) for r in saved]
    x = torch.randn(5, 4)
    with torch.no_grad():
        got = module(x)
    assert calls == saved
    module.runners = saved
    with torch.no_grad():
        torch.testing.assert_close(module(x), got)


def test_training_forward_and_gradients_match_the_loop():
    plan, members = _mlp_module("per_member")
    reference = copy.deepcopy(members)
    module = executor.build(plan, members).train()
    x = torch.randn(N, 5, 4)
    module(x).square().sum().backward()
    for i, m in enumerate(reference):
        m.train()
        m(x[i]).square().sum().backward()
    for name, p in module.named_stacked_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in reference])
        torch.testing.assert_close(p.grad, want)
