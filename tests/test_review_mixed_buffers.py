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


# --- which buffers are read, and whether forward() writes them ----------------------------------------------------

class WarmUp(nn.Module):
    """A warm-up switch on BatchNorm's step count, read after the layer ran (the loop switches at call 1005)."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.bn(self.fc(x))
        if self.bn.num_batches_tracked.item() < 1005:
            h = h * 0.5
        return h


def test_a_branch_on_a_buffer_forward_writes_in_training_is_refused_at_trace():
    # before: traced (no tried value crosses 1005), and after 1003 training calls the batched module kept damping
    # where the loop had switched: 0.50 off, silently
    torch.manual_seed(0)
    with pytest.raises(planner.TraceError, match=r"buffer.s values into Python \(bn\.num_batches_tracked.*forward\(\) itself writes it"):
        planner.trace(WarmUp().train(), (torch.randn(5, 8),))


def test_a_branch_on_a_statistic_traced_in_eval_watches_loads_and_refuses_training_calls():
    torch.manual_seed(0)
    members = [WarmUp().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
        sd = members[1].state_dict()
        sd["bn.num_batches_tracked"] = torch.tensor(5000)
        ens.load_member_state_dict(1, sd)  # before: not watched (BatchNorm writes it in training), 0.41 off
        with pytest.raises(ExecutionError, match=r"member 1's buffers changed since build"):
            ens(x)
        sd["bn.num_batches_tracked"] = torch.tensor(0)
        ens.load_member_state_dict(1, sd)
        ens.train()
        with pytest.raises(ExecutionError, match=r"bn\.num_batches_tracked into Python.*in training mode"):
            ens(x)


class SizedMask(EncodedById):
    """A mask made from the traced size after the positional table (the recorded reads once took pe through T)."""

    def __init__(self, act_id: int = 0, kind: str = "eye"):
        super().__init__(act_id)
        self.kind = kind

    def forward(self, x):
        h = self.fc(self.pos(x))
        t = h.size(-2)
        mask = torch.eye(t) if self.kind == "eye" else nn.Transformer.generate_square_subsequent_mask(t)
        h = torch.softmax(h @ h.transpose(-1, -2) + mask, -1) @ h
        return torch.tanh(h) if int(self.act_id) == 2 else torch.relu(h)


@pytest.mark.parametrize("kind", ["eye", "causal"])
def test_a_mask_made_from_a_traced_size_beside_the_table_and_the_read_traces(kind):
    members = [SizedMask(v, kind) for v in (0, 1, 5)]
    x = torch.randn(N, 4, 10, 16)
    graph, plan = _plan(members[0], x)
    assert graph.tracer == "fx" and graph.gm.meta[graph_module.REAL_BUFFERS] == ("act_id",)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]), rtol=1e-5, atol=1e-6)


class ConstantAndRead(nn.Module):
    """A constant tensor made in forward() beside a buffer read (refused as if the constant came from a buffer)."""

    def __init__(self, act_id: int = 0):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("act_id", torch.tensor(act_id))

    def forward(self, x):
        h = self.fc(x) * torch.tensor([1.0, -1.0]).repeat(8)
        return torch.tanh(h) if int(self.act_id) == 2 else torch.relu(h)


class WrittenBesideRead(nn.Module):
    """A flag read into Python beside state forward() writes (a running mean), and BatchNorm in training."""

    def __init__(self, flag: bool = True):
        super().__init__()
        self.fc, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)
        self.register_buffer("use_ema", torch.tensor(flag))
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = self.bn(self.fc(x))
        if self.use_ema:
            self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
            h = h - self.ema
        return h


@pytest.mark.parametrize("cls,arg", [(ConstantAndRead, 0), (WrittenBesideRead, True), (WrittenBesideRead, False)])
def test_reads_beside_constants_or_other_written_state_trace_and_run_as_the_loop(cls, arg):
    # before: refused (a constant from no buffer counted as baked from one; any state written counted as the read one)
    torch.manual_seed(0)
    members = [cls(arg).train() for _ in range(N)]
    x = torch.randn(5, 16)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    for k, v in ens.stacked_state.items():
        torch.testing.assert_close(v, torch.stack([m.state_dict()[k] for m in members]), rtol=1e-5, atol=1e-6)


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("temp", torch.tensor(0.1))
        self.register_buffer("gain", torch.ones(8))

    def forward(self, x):
        return self.fc(x) * self.gain * float(self.temp)


def test_a_bfloat16_plan_reading_a_float_is_not_refused_when_another_buffer_changes():
    # before: the watch compared bfloat16-rounded values' trace (0.10009765625) with the float32 one (0.1): refused
    torch.manual_seed(0)
    members = [Temperature() for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.set_dtype(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), "bfloat16")
    ens = executor.build(plan, members)
    with torch.no_grad():
        ens.stacked_state["gain"][1].mul_(2)
        members[1].gain.mul_(2)
        torch.testing.assert_close(ens(x).float(), torch.stack([m(x) for m in members]), rtol=3e-2, atol=3e-2)


class DerivedAndRead(ConstantAndRead):
    def forward(self, x):
        h = self.fc(x) * (self.act_id.float() + 1)
        return torch.tanh(h) if self.act_id.item() == 2 else torch.relu(h)


def test_a_tensor_made_of_a_read_buffer_alone_is_refused_naming_both():
    # before: the generic "keep the computation on tensors ... write self.t.item()" though the model does just that
    with pytest.raises(planner.TraceError, match=r"\(act_id: a branch.*_tensor_constant0.*torch\.where"):
        planner.trace(DerivedAndRead(), (torch.randn(5, 16),))
