"""A write in place through a view inside a torch.export region (`with torch.no_grad(): self.m[:2].lerp_(...)`) is a
write of the region's operand: every later read of it runs after the region (planner.graph.inplace_order_edges).

The region hands nothing back for such a write, so later reads use the operand itself, with no data edge from the
region; where the region became an excluded stage of its own, the batched stage reading the operand ran before it
(0.05-1.2 off, outputs and gradients). Reference: the plain loop over members."""
import copy
import operator
import warnings

import pytest
import torch
import torch.fx
from torch import nn

from stagewise import executor, planner
from stagewise.planner.graph import inplace_order_edges

torch.set_num_threads(1)
warnings.filterwarnings("ignore")


def _model(body, buffer_shape=(4,)):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.l2 = nn.Linear(4, 4)
            self.register_buffer("m", torch.zeros(buffer_shape))

        def forward(self, x):
            return body(self, x)
    return M


def _check(body, mode, n, train=True, buffer_shape=(4,), calls=2):
    """Batched outputs (and parameter gradients, in training) against the member loop, over `calls` calls."""
    torch.manual_seed(0)
    cls = _model(body, buffer_shape)
    members = [cls().train(train) for _ in range(n)]
    x = torch.randn(5, 4)
    xs = torch.randn(n, 5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), ((xs[0] if mode == "per_member" else x).clone(),))
    plan = planner.propose(graph, n_members=n, input_mode=mode)
    ens = executor.build(plan, copy.deepcopy(members))
    ens.train(train)
    ref = copy.deepcopy(members)
    for _ in range(calls):
        xb = x.clone() if mode == "shared" else xs.clone()
        xl = [x.clone() for _ in range(n)] if mode == "shared" else [xs[i].clone() for i in range(n)]
        got = ens(xb)
        want = torch.stack([m(xi) for m, xi in zip(ref, xl)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if mode == "per_member":  # the caller's rows are written as the loop writes them
            torch.testing.assert_close(xb, torch.stack(xl), rtol=0, atol=0)
        if train:
            w = torch.randn_like(want)
            (got * w).sum().backward()
            (want * w).sum().backward()
            for name, p in ens.named_stacked_parameters():
                want_grad = [dict(m.named_parameters())[name].grad for m in ref]
                if want_grad[0] is None:  # a layer forward() does not use
                    assert p.grad is None or not p.grad.any()
                    continue
                torch.testing.assert_close(p.grad, torch.stack(want_grad), rtol=1e-5, atol=1e-5)
                p.grad = None
            for m in ref:
                m.zero_grad(set_to_none=True)
    state = ens.member_state_dicts()
    for i in range(n):
        torch.testing.assert_close(state[i]["m"], ref[i].m, rtol=1e-6, atol=1e-6)


def _buffer_slice_lerp(s, x):  # a running-mean normaliser updated through a slice of its buffer
    if s.training:
        with torch.no_grad():
            s.m[:2].lerp_(x.mean(0)[:2], 0.5)
    return s.l(x - s.m)


def _input_slice_clamp(s, x):  # README's `x.clamp_(0, 1)` in no_grad on a per_member input, on two columns
    with torch.no_grad():
        x[:, :2].clamp_(min=0.1)
    return s.l(x)


def _buffer_diagonal_clamp(s, x):
    with torch.no_grad():
        s.m.diagonal().clamp_(min=0.2)
    return s.l(x) * s.m.mean()


def _buffer_transposed_row(s, x):
    with torch.no_grad():
        s.m.t()[1].addcdiv_(x.mean(0)[:2], torch.ones(2) * 3)
    return s.l(x) - s.m[:, 1].sum()


def _activation_slice_clamp(s, x):
    h = s.l(x)
    with torch.no_grad():
        h[:, :2].clamp_(min=0.1)
    return s.l2(h)


def _buffer_view_made_outside(s, x):  # the view made before the block, written inside it
    v = s.m.view(2, 2)
    with torch.no_grad():
        v[0].lerp_(x.mean(0)[:2], 0.5)
    return s.l(x - s.m)


def _autocast_region_slice(s, x):  # an autocast region writing a slice of a buffer
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        with torch.no_grad():
            s.m[:2].lerp_(torch.ones(2), 0.5)
    return s.l(x - s.m)


@pytest.mark.parametrize("mode,n", [("shared", 3), ("per_member", 3), ("shared", 1)])
def test_buffer_slice_update_in_no_grad_is_read_after(mode, n):
    _check(_buffer_slice_lerp, mode, n)


@pytest.mark.parametrize("n", [1, 3])
def test_per_member_input_slice_clamped_in_no_grad(n):
    _check(_input_slice_clamp, "per_member", n, train=False)


def test_buffer_diagonal_clamped_in_no_grad():
    _check(_buffer_diagonal_clamp, "per_member", 3, buffer_shape=(2, 2))


def test_buffer_transposed_row_written_in_no_grad():
    _check(_buffer_transposed_row, "shared", 3, buffer_shape=(2, 4))


def test_activation_slice_clamped_in_no_grad():
    _check(_activation_slice_clamp, "shared", 3, calls=2)


def test_view_made_outside_the_block_written_inside():
    _check(_buffer_view_made_outside, "shared", 3)


def test_autocast_region_writing_a_buffer_slice():
    _check(_autocast_region_slice, "shared", 3, train=False)


def test_region_orders_later_reads_of_the_operand():
    torch.manual_seed(0)
    graph = planner.trace(_model(_buffer_slice_lerp)().train(), (torch.randn(5, 4),))
    region = next(n for n in graph.gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator))
    edges = set(inplace_order_edges(graph.gm))
    readers = [u.name for a in graph.gm.graph.nodes if a.op == "get_attr" and a.target == "m" for u in a.users
               if u is not region]
    assert readers and all((region.name, r) in edges for r in readers)


def test_nested_region_write_is_followed_out():
    """A region inside a region: the inner sub-graph's write of a slice of its placeholder is the outer call's operand."""
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    inner = torch.fx.Graph()
    p = inner.placeholder("b")
    inner.call_function(torch.ops.aten.clamp_.default, (inner.call_function(torch.ops.aten.slice.Tensor, (p, 0, 0, 2)), 0.1))
    inner.output(())
    outer = torch.fx.Graph()
    q, r = outer.placeholder("a"), outer.placeholder("unused")
    outer.call_function(hop, (False, outer.get_attr("sub"), q))
    outer.output(())
    outer_gm = torch.fx.GraphModule({"sub": torch.fx.GraphModule({}, inner)}, outer)
    top = torch.fx.Graph()
    x, y = top.placeholder("x"), top.placeholder("y")
    call = top.call_function(hop, (False, top.get_attr("region"), x, y))
    top.call_function(operator.add, (x, 1))
    top.output(())
    root = torch.fx.GraphModule({"region": outer_gm}, top)
    edges = set(inplace_order_edges(root))
    assert (call.name, "add") in edges  # x read after the region writes it
    assert not any(call.name in e and "y" in e for e in edges)  # y is handed in, never written
