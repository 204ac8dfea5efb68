"""A number members hold differently (a sweep over `self.k`) used as a size or a slice bound, checked against the member
loop: `F.pad(h[:, :self.k], (0, 8 - self.k))` and `x.view(-1, self.k, 8 // self.k)` run their stage as the member loop,
each member with its own number, named in `number_loops` and the warning (were refused at build: "It is not a number",
of a slice holding one); where the members' results then differ in shape (`h[:, :self.k]` returned as it is), build
refuses naming the node, the shapes and the number; the same for a per_member number input at the call."""
from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.planner import ExecutionError, MemberError

torch.set_num_threads(1)
N = 3
BATCHES = (5, 2)  # two batch sizes: nothing may be baked in at the traced one
CALLS = 2
TOL = dict(rtol=1e-5, atol=1e-6)


class Keep(nn.Module):
    """Keep the first k features, pad back to 8."""

    def __init__(self, k: int):
        super().__init__()
        self.fc, self.k = nn.Linear(8, 8), k

    def forward(self, x):
        h = self.fc(x)
        return F.pad(h[:, : self.k], (0, 8 - self.k)).sum(-1)


class Groups(Keep):
    def forward(self, x):
        return self.fc(x).view(-1, self.k, 8 // self.k).sum(1).square().sum(-1)


class Window(Keep):
    def forward(self, x):
        return self.fc(x)[:, : self.k]


def members_of(cls, ks):
    torch.manual_seed(0)
    return [cls(k) for k in ks]


def plan_of(model, example, **kw):
    return planner.propose(planner.trace(copy.deepcopy(model), example), n_members=N, **kw)


def assert_matches_the_loop(ens, ref, extra=lambda i: ()):
    """Forward over two calls at two batch sizes, then the parameters' gradients, against each member's own call."""
    for b in BATCHES:
        for _ in range(CALLS):
            x = torch.randn(b, 8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = ens(x, *extra(None))
            want = torch.stack([m(x, *extra(i)) for i, m in enumerate(ref)])
            torch.testing.assert_close(got.detach(), want.detach(), **TOL)
    x = torch.randn(BATCHES[1], 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ens(x, *extra(None)).square().sum().backward()
    for i, m in enumerate(ref):
        m.zero_grad()
        m(x, *extra(i)).square().sum().backward()
    for name, p in ens.named_stacked_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in ref])
        torch.testing.assert_close(p.grad, want, **TOL, msg=name)


@pytest.mark.parametrize("cls, ks, op", [(Keep, (2, 4, 6), "pad"), (Groups, (2, 4, 1), "view")])
def test_a_size_members_hold_differently_runs_its_stage_as_the_loop(cls, ks, op):
    members = members_of(cls, ks)
    ref = copy.deepcopy(members)
    ens = executor.build(plan_of(members[0], (torch.randn(BATCHES[0], 8),)), members)  # was: MemberError
    (words,) = ens.number_loops.values()
    assert f"'self.k' to {op}" in words
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            ens(torch.randn(BATCHES[0], 8))
    (said,) = [str(w.message) for w in caught if "per_member number" in str(w.message)]
    assert "'self.k' to" in said and "runs as the member loop" in said
    assert_matches_the_loop(ens, ref)


def test_members_whose_sizes_give_results_of_other_shapes_are_refused_naming_node_and_shapes():
    members = members_of(Window, (2, 4, 6))
    plan = plan_of(members[0], (torch.randn(BATCHES[0], 8),))
    with pytest.raises(MemberError, match=r"node 'getitem' .*differ in shape \(member 0: \[5, 2\], member 1: \[5, 4\], "
                                          r"member 2: \[5, 6\]\).*self\.k: member 0: 2, member 1: 4, member 2: 6.*"
                                          r"cannot be stacked N-first\. Pad them to one size .*or plan the members"):
        executor.build(plan, members)
    ens = executor.build(plan, members_of(Window, (3, 3, 3)))  # one size: no loop, nothing refused
    assert ens.number_loops == {}


class Sometimes(Keep):
    def forward(self, x):
        return self.fc(x)[:, : self.k].sum(-1)


def test_a_slice_bound_that_is_no_number_in_some_members_says_what_it_is():
    members = members_of(Sometimes, (2, 4, None))
    with pytest.raises(MemberError, match=r"It is a slice whose bounds differ in something other than whole numbers "
                                          r"\(None in some members\)"):  # was: "It is not a number."
        executor.build(plan_of(members[0], (torch.randn(BATCHES[0], 8),)), members)


class KeepInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, k):
        h = self.fc(x)
        return F.pad(h[:, :k], (0, 8 - k)).sum(-1)


class GroupsInput(KeepInput):
    def forward(self, x, k):
        return self.fc(x).view(-1, k, 8 // k).sum(1).square().sum(-1)


class WindowInput(KeepInput):
    def forward(self, x, k):
        return self.fc(x)[:, :k]


def test_a_per_member_size_input_runs_as_the_loop_and_other_shapes_name_the_node():
    for cls, ks in ((KeepInput, [2, 4, 6]), (GroupsInput, [2, 4, 1])):
        torch.manual_seed(0)
        members = [cls() for _ in range(N)]
        ref = copy.deepcopy(members)
        plan = plan_of(members[0], (torch.randn(BATCHES[0], 8), 2), input_mode={"x": "shared", "k": "per_member"})
        ens = executor.build(plan, members)
        assert ens.number_loops
        assert_matches_the_loop(ens, ref, lambda i: (ks,) if i is None else (ks[i],))
    torch.manual_seed(0)
    members = [WindowInput() for _ in range(N)]
    plan = plan_of(members[0], (torch.randn(BATCHES[0], 8), 2), input_mode={"x": "shared", "k": "per_member"})
    ens = executor.build(plan, members)
    with pytest.raises(ExecutionError, match=r"different shapes at node 'getitem' \(member 0: \[5, 2\], member 1: \[5, 4\], "
                                             r"member 2: \[5, 6\]\): a per_member number reaches .*\('k' to getitem\).*"
                                             r"Pad them to one size"):  # was: "a shape that depends on the values (boolean masking...)"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ens(torch.randn(BATCHES[0], 8), [2, 4, 6])


class Heads(nn.Module):
    """A sweep over the number of attention heads (self.h in view): the members' outputs have one shape."""

    def __init__(self, h):
        super().__init__()
        self.q, self.o, self.h = nn.Linear(8, 24), nn.Linear(8, 8), h

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = [z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in self.q(x).split(8, -1)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


def test_a_heads_sweep_names_every_stage_to_exclude_and_excluding_them_runs_as_the_loop():
    # before: the refusal named s1 alone, and excluding it gave the same refusal for s2; its number part said thrice
    members = [Heads(h) for h in (1, 2, 4)]
    x = torch.randn(N, 2, 5, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x[0].clone(),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    with pytest.raises(MemberError) as refused:
        executor.build(plan, members)
    said = str(refused.value)
    parts = re.findall(r"the number there, from self\.h: [^;)]*", said)
    assert parts and len(parts) == len(set(parts)), said  # each number once
    named = re.findall(r"planner\.exclude\(plan, graph, '(s\d+)'\)", said)
    assert len(named) > 1, said
    for sid in named:
        plan = planner.exclude(plan, graph, sid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the number stages' note
        ens = executor.build(plan, members)
        with torch.no_grad():
            torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]),
                                       rtol=1e-5, atol=1e-6)
