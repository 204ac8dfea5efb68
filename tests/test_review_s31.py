"""Models from the s31 reviews, each against the plain member loop.

- A tensor made from a constant torch.fx bakes (`torch.arange(6.).repeat(B, 1)`) that forward() writes per-member
  values into (`index_put_(..., accumulate=True)`): the proposed plan put it in a vmap stage, where it is one tensor
  for every member, and every call failed (an InputError blaming the inputs). It is now made once per member, as a
  fresh `torch.zeros(n)` is.
- In-place foreach ops in forward() (`torch._foreach_lerp_(key_params, query_params, 0.1)`, a MoCo / BYOL momentum
  encoder; `torch._foreach_mul_` on activations): the planner orders a tensor's reads after the op writing it through
  the op's first argument, a list here, so a stage read the key encoder before its update (0.354 off under
  torch.export, 1.76 under fx). Refused at trace, naming the op and the per-tensor form, which runs as the loop.
"""
from __future__ import annotations

import torch
from torch import nn

import pytest

from stagewise import executor, planner
from stagewise.planner.errors import TraceError

N = 3


class ArangeWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        a = torch.arange(6.).repeat(x.shape[0], 1)
        a.index_put_((torch.tensor([0]),), h[0:1], accumulate=True)
        return a * h


def test_a_baked_constant_written_per_member_is_made_per_member():
    torch.manual_seed(0)
    members = [ArangeWritten() for _ in range(N)]
    x = torch.randn(4, 6)
    graph = planner.trace(members[0], (x,))
    for mode, given in (("shared", x), ("per_member", torch.randn(N, 4, 6))):
        plan = planner.propose(graph, n_members=N, input_mode=mode)
        ens = executor.build(plan, members)
        for _ in range(2):
            out = ens(given)
            ref = torch.stack([m(given if mode == "shared" else given[i]) for i, m in enumerate(members)])
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        report = executor.verify(plan, members, (given,), grads=True)
        assert report.ok, report.to_text()


class Momentum(nn.Module):
    """A key encoder following the query encoder by EMA inside forward(), as MoCo's does."""

    def __init__(self, foreach):
        super().__init__()
        self.q, self.k, self.foreach = nn.Linear(8, 4), nn.Linear(8, 4), foreach
        self.k.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            if self.foreach:
                torch._foreach_lerp_(list(self.k.parameters()), list(self.q.parameters()), 0.1)
            else:
                for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                    pk.lerp_(pq, 0.1)
        return self.q(x) * self.k(x)


class ForeachActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h1, h2 = self.a(x), self.b(x)
        torch._foreach_mul_([h1, h2], 2.0)
        return self.c(torch.relu(h1)) + h2[:, :4]


@pytest.mark.parametrize("model", [Momentum(True), ForeachActivations()], ids=["export-state", "fx-activations"])
def test_an_inplace_foreach_op_is_refused_at_trace(model):
    with pytest.raises(TraceError, match=r"in place with torch\._foreach_(lerp|mul)_.*its own in-place op"):
        planner.trace(model, (torch.randn(5, 8),))


def test_the_per_tensor_momentum_update_runs_as_the_loop():
    torch.manual_seed(0)
    members = [Momentum(False) for _ in range(N)]
    x = torch.randn(N, 5, 8)
    plan = planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")
    report = executor.verify(plan, members, (x,), calls=3)
    assert report.ok, report.to_text()
