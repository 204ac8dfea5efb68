"""A forward() that reads one buffer's value into Python (`int(self.act_id)`, Glow ActNorm's `.item()` flag) and
slices another by a traced size (the PyTorch tutorial's PositionalEncoding, `self.pe[:, :x.size(1)]`, or a causal
mask's `self.bias[:, :, :T, :T]`): each alone traced, both together were refused with export's raw
GuardOnDataDependentSymNode ("Could not extract specialized integer"). The trace now keeps the buffers read into
Python real tensors and makes every other buffer a graph value; the build still traces each member with its own
buffers (refusing one that takes another branch), and the per-call watch still sees a buffer changed after build."""
from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner import ExecutionError, MemberError

torch.set_num_threads(1)
graph_module = importlib.import_module("stagewise.planner.graph")
N = 3


class PositionalEncoding(nn.Module):
    """The PyTorch tutorial's: a table of max_len rows, forward() adds the first x.size(1) of them."""

    def __init__(self, d: int, max_len: int = 64):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(1, max_len, d)
        pe[0, :, 0::2] = torch.sin(pos * div)
        pe[0, :, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[:, :x.size(1)]


class EncodedById(nn.Module):
    """A per-member activation chosen by an integer buffer, after a positional encoding."""

    def __init__(self, act_id: int = 0):
        super().__init__()
        self.pos = PositionalEncoding(16)
        self.fc = nn.Linear(16, 16)
        self.register_buffer("act_id", torch.tensor(act_id))

    def forward(self, x):
        h = self.fc(self.pos(x))
        return torch.tanh(h) if int(self.act_id) == 2 else torch.relu(h)


class MaskedFlag(nn.Module):
    """nanoGPT's causal mask sliced to the sequence, and an ActNorm-style flag read with .item()."""

    def __init__(self, initialized: int = 1):
        super().__init__()
        self.qk = nn.Linear(8, 8)
        self.register_buffer("bias", torch.tril(torch.ones(32, 32)).view(1, 32, 32))
        self.register_buffer("initialized", torch.tensor(initialized))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        t = x.size(1)
        if self.initialized.item() == 0:
            h = x
        else:
            h = self.qk(x) * self.scale
        att = (h @ h.transpose(-1, -2)).masked_fill(self.bias[:, :t, :t] == 0, float("-inf"))
        return torch.softmax(att, -1) @ h


def _members(cls, values):
    torch.manual_seed(0)
    return [cls(v) for v in values]


def _plan(member, x):
    graph = planner.trace(copy.deepcopy(member), (x[0],))
    return graph, planner.propose(graph, n_members=N, input_mode="per_member")


def _both(ens, members, x):
    """(batched, loop) outputs and the parameters' gradients of sum(out**2), stacked over members."""
    xs = x.clone().requires_grad_(True)
    out = ens(xs)
    out.pow(2).sum().backward()
    got = {k: p.grad for k, p in ens.named_stacked_parameters()}
    loop, want = [], {}
    for i, m in enumerate(copy.deepcopy(members)):
        o = m(x[i])
        o.pow(2).sum().backward()
        loop.append(o)
        for k, p in m.named_parameters():
            want.setdefault(k, []).append(p.grad)
    return (out, got), (torch.stack(loop), {k: torch.stack(v) for k, v in want.items()})


@pytest.mark.parametrize("cls,values,kept", [(EncodedById, (0, 1, 5), ("act_id",)),
                                             (MaskedFlag, (1, 1, 1), ("initialized",))])
def test_a_buffer_read_beside_a_buffer_sliced_by_a_traced_size_traces_with_fx_and_runs_as_the_loop(cls, values, kept):
    members = _members(cls, values)
    x = torch.randn(N, 4, 10, 16 if cls is EncodedById else 8)
    graph, plan = _plan(members[0], x)
    assert graph.tracer == "fx"
    assert graph.gm.meta[graph_module.REAL_BUFFERS] == kept  # only the buffer read into Python is a real tensor
    (out, got), (want_out, want) = _both(executor.build(plan, members), members, x)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_member_whose_read_buffer_takes_another_branch_is_still_refused_at_build():
    members = _members(EncodedById, (0, 2, 5))
    x = torch.randn(N, 4, 10, 16)
    _, plan = _plan(members[0], x)
    with pytest.raises(MemberError, match=r"member 1 with its own buffers traces to another graph"):
        executor.build(plan, members)


def test_members_positional_tables_may_differ_as_graph_values():
    # pe is a graph value: each member's own table is used (a plain trace would have compared them as code)
    members = _members(EncodedById, (0, 1, 5))
    with torch.no_grad():
        members[2].pos.pe.mul_(3.0)
    x = torch.randn(N, 4, 10, 16)
    _, plan = _plan(members[0], x)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]), rtol=1e-5, atol=1e-6)


def test_a_read_buffer_changed_after_build_is_traced_again_with_the_others_as_graph_values():
    members = _members(EncodedById, (0, 1, 5))
    x = torch.randn(N, 4, 10, 16)
    _, plan = _plan(members[0], x)
    ens = executor.build(plan, members)
    with torch.no_grad():
        ens.stacked_state["act_id"][1] = 2  # tanh for member 1
        with pytest.raises(ExecutionError, match=r"member 1's buffers changed since build"):
            ens(x)
        ens.stacked_state["act_id"][1] = 7  # relu again
        members[1].act_id.fill_(7)
        torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]), rtol=1e-5, atol=1e-6)
