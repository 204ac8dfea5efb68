"""What the trace's value-read watch sees however forward() reaches the function, checked against the member loop:
a comparison bound before the trace (`self.fn = torch.equal`, functools.partial, Tensor.equal kept unbound, an
`operator.methodcaller`, a name imported from torch) branching on a buffer whose value differs per member, a
buffer's own method bound before the trace (`self.fn = self.mode.equal`), harmless reads through such references,
and BatchNorm with momentum=None (a cumulative average read from num_batches_tracked) opened or closed."""
from __future__ import annotations

import copy
import functools
import logging
import operator

import pytest
import torch
from torch import equal as imported_equal
from torch import nn

from stagewise import executor, planner
from stagewise.planner import ExecutionError, MemberError, TraceError

torch.set_num_threads(1)
N = 3
ONE = torch.ones(1)


class Branch(nn.Module):
    """tanh where `cond(self)` holds, relu otherwise; `mode` is 0 for members 0 and 2, 1 for member 1."""

    def __init__(self, make, cond):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mode", torch.zeros(1))
        self.fn = make(self)
        self.cond = cond

    def forward(self, x):
        if self.cond(self):
            return torch.tanh(self.fc(x))
        return torch.relu(self.fc(x))


def _members(make, cond, modes=(0.0, 1.0, 0.0)):
    out = []
    for i, v in enumerate(modes):
        torch.manual_seed(i)
        m = Branch(make, cond).eval()
        m.mode.fill_(v)
        out.append(m)
    return out


def _batched_matches_or_member_named(members, x):
    """Build from member 0's trace: either the batched output is the loop's, or build's MemberError names member 1."""
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    try:
        ens = executor.build(plan, members)
    except MemberError as e:
        assert "member 1" in str(e)
        return
    with torch.no_grad():
        got, want = ens(x), torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # member 0's branch for member 1: 0.80 off before


# a function reached without torch's namespace at call time: the replaced name was missed, member 0's branch baked in
BOUND_FUNCTIONS = {
    "torch.equal": (lambda m: torch.equal, lambda m: m.fn(m.mode, torch.ones(1))),
    "torch.allclose": (lambda m: torch.allclose, lambda m: m.fn(m.mode, torch.ones(1))),
    "partial(torch.equal, one)": (lambda m: functools.partial(torch.equal, torch.ones(1)), lambda m: m.fn(m.mode)),
    "Tensor.equal unbound": (lambda m: torch.Tensor.equal, lambda m: m.fn(m.mode, torch.ones(1))),
    "methodcaller": (lambda m: operator.methodcaller("equal", torch.ones(1)), lambda m: m.fn(m.mode)),
    "imported equal": (lambda m: None, lambda m: imported_equal(m.mode, ONE)),
}


@pytest.mark.parametrize("variant", list(BOUND_FUNCTIONS))
def test_comparison_bound_before_trace_is_per_member(variant):
    make, cond = BOUND_FUNCTIONS[variant]
    _batched_matches_or_member_named(_members(make, cond), torch.randn(5, 4))


# the buffer itself held by the reference: no trace can swap each member's buffer in there
BOUND_BUFFER = {
    "self.mode.equal": (lambda m: m.mode.equal, lambda m: m.fn(torch.ones(1))),
    "self.mode.item": (lambda m: m.mode.item, lambda m: m.fn() > 0.5),
    "self.mode.__bool__": (lambda m: m.mode.__bool__, lambda m: m.fn()),
    "partial(torch.equal, self.mode)": (lambda m: functools.partial(torch.equal, m.mode), lambda m: m.fn(torch.ones(1))),
}


@pytest.mark.parametrize("variant", list(BOUND_BUFFER))
def test_buffer_bound_before_trace_is_refused(variant):
    make, cond = BOUND_BUFFER[variant]
    members = _members(make, cond)
    # a method bound to the buffer is refused before any trace (a copy keeps it bound to the original's tensor); a
    # partial holding it, as the trace reads its values through it
    with pytest.raises(TraceError, match=r"reads the values of .* through self\.fn|attribute 'fn' is a function that "
                                         r"closes over a tensor \(a method bound to it"):
        planner.trace(copy.deepcopy(members[0]), (torch.randn(5, 4),))


class Guarded(nn.Module):
    """Harmless reads through references bound before the trace: a guard every member passes and a logged value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.close, self.number = torch.allclose, torch.Tensor.item

    def forward(self, x):
        if not self.close(self.mean, self.mean):
            raise RuntimeError("statistics are NaN")
        logging.getLogger("stagewise.test").debug("mean %.3f", self.number(self.mean.sum()))
        return self.fc(x - self.mean)


def test_harmless_bound_read_still_batches():
    members = []
    for i in range(N):
        torch.manual_seed(i)
        m = Guarded().eval()
        m.mean.add_(0.1 * i)
        members.append(m)
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    ens = executor.build(planner.propose(graph, n_members=N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)


# --- BatchNorm with momentum=None: 1 / num_batches_tracked, a buffer's value read each call in training -----------

class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn(self.c(x)).mean((2, 3)))


def _bn_members(train):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(BNNet().train(train))
    return out


def test_open_cumulative_batchnorm_in_training_is_refused_clearly():
    with pytest.raises(TraceError) as e:
        planner.trace(BNNet().train(), (torch.randn(4, 3, 6, 6),), open_modules=["bn"])
    text = str(e.value)
    assert "bn (BatchNorm2d)" in text and "momentum=None" in text and "closed" in text and "momentum=0.1" in text
    assert "GuardOnDataDependent" not in text  # export's message was all it said before


def test_open_cumulative_batchnorm_traced_in_eval_names_why_training_is_refused():
    members = _bn_members(False)
    x = torch.randn(4, 3, 6, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,), open_modules=["bn"]), n_members=N)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"bn \(BatchNorm2d\) has momentum=None"):
        ens.train()


def test_closed_cumulative_batchnorm_trains_as_the_loop():
    members = _bn_members(True)
    loop = copy.deepcopy(members)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 3, 6, 6),)), n_members=N)
    ens = executor.build(plan, members)
    for call in range(2):
        torch.manual_seed(10 + call)
        x = torch.randn(4, 3, 6, 6)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), rtol=1e-5, atol=1e-6)
    states = ens.member_state_dicts()
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        for i, m in enumerate(loop):
            torch.testing.assert_close(states[i][name], dict(m.named_buffers())[name], rtol=1e-5, atol=1e-6)


class ScaleByBoundMul(nn.Module):
    """`self.scale = self.s.mul`: no value read, but a deep copy keeps the method bound to the original's buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("s", torch.tensor(2.0))
        self.scale = self.s.mul

    def forward(self, x):
        return self.scale(self.fc(x))


def test_a_method_bound_to_a_buffer_is_refused_before_the_trace_naming_it():
    # before: traced, then a PlanMismatchError at build ('s' against '_tensor_constant0') that named neither
    with pytest.raises(TraceError, match=r"attribute 'scale' is a function that closes over a tensor \(a method bound"):
        planner.trace(ScaleByBoundMul(), (torch.randn(5, 4),))
