"""Models from the s31 reviews, each against the plain member loop.

- A tensor made from a constant torch.fx bakes (`torch.arange(6.).repeat(B, 1)`) that forward() writes per-member
  values into (`index_put_(..., accumulate=True)`): the proposed plan put it in a vmap stage, where it is one tensor
  for every member, and every call failed (an InputError blaming the inputs). It is now made once per member, as a
  fresh `torch.zeros(n)` is.
- In-place foreach ops in forward() (`torch._foreach_lerp_(key_params, query_params, 0.1)`, a MoCo / BYOL momentum
  encoder; `torch._foreach_mul_` on activations): the planner orders a tensor's reads after the op writing it through
  the op's first argument, a list here, so a stage read the key encoder before its update (0.354 off under
  torch.export, 1.76 under fx). Refused at trace, naming the op and the per-tensor form, which runs as the loop.
- `chunk_size` on a stage handing on a view (`self.buf[0]`, `x[:, :4]`, `h.t()`) that another stage writes in place:
  a chunked vmap hands on concatenated copies, so the write missed the stacked buffer or the caller's input (1.13 /
  0.5 / 0.28 off). Such a stage now runs unchunked, with a warning.
- A fresh tensor of fixed sizes written through `out=` (`c = torch.zeros(6); torch.add(c, v, out=c)`): torch.fx bakes
  `c` as one constant, which the write then kept from call to call (0.77, 0.96, 1.16 off on calls 1-3) and every member
  shared (a Gram matrix `torch.matmul(h.t(), h, out=c)`: members read the last member's, 0.85 off). Such a write is
  now seen as one into a baked constant, as `c.add_(v)` always was: torch.export traces it.
- `torch.save(ens)` of a torch.export plan whose graph passes a traced size in a list (a GRU's h0, `aten.zeros([1, B,
  h])`) wrote a file `torch.load` could not read (fx's re-trace of the graph code raised a raw RuntimeError, often in
  another process). Refused at the save, naming the state-dict route, which loads; deepcopy is unaffected.
- `wide` set by hand on a stage excluded for a shape that depends on the values (a top-1 MoE dispatch, `x[idx == e]`):
  every call failed with an InputError telling the user to check the inputs; it now names the shape per member and
  the loop strategy.
- A fresh tensor written per member inside a `with torch.no_grad():` block of a torch.export plan
  (`c = torch.zeros(6)` then `torch.add(c, h.mean(0), out=c)`, `c.add_(...)`, `c[:3] = ...` in the block): `zeros`
  was made once in a vmap stage and every member's loop write landed in it (0.21 / 0.55 / 0.42 off, or a failing
  call). Now made once per member, as outside a block; a chunked stage handing on a view such a block writes runs
  unchunked, as for a write outside one.
- verify's reference loop ran a per_member Python-number input on its float32-rounded values (`x[i].item()` of the
  [N] tensor it made): a discount sweep `fc(x) / (1 - gamma)` with gammas 0.999 .. 0.99999 is 1.4e-3 off the loop on
  the numbers given (the batched module holds them at its float precision), and verify said MATCH. The loop now
  runs on the numbers as given, so verify says MISMATCH.
- Profile and autotune judged a member whose loop output holds an inf (masked -inf logits) against a scale of
  1.8e308 (nan_to_num), so any error of it passed: measured on the finite values now, as verify measures.
- verify compared a Python-number output (`s * 1e40` of an `.item()`) with a float32 reference, so a value past
  float32's range was inf on both sides: MATCH where the batched module answered inf and the loop a finite number.
  Such a number now comes back as the loop's double.
- Numbers read from each member's tensors (`.item()`) handed to an op that takes a Python number (`math.exp(s)`,
  `torch.full_like(h, s)`): the proposal batched the op (its probe took the number as a constant) and every call
  failed. The probe now hands such a number per member, as the batched module does: those ops run
  as the member loop. Python arithmetic on them in a batched stage runs in double, as the loop's (tests/test_exact_numbers.py).
"""
from __future__ import annotations

import torch
from torch import nn

import copy
import io
import math
import warnings

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


class BufferView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(2, 8))

    def forward(self, x):
        h = self.fc(x)
        v = self.buf[0]
        v.add_(h.mean(0))
        return h + self.buf[0]


class InputView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        v = x[:, :4]
        h = self.fc(x)
        v.mul_(2.0)
        return h, x * 1.0


class ActivationView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        t = torch.relu(h[:, :4])
        u = h.t()
        u[0].add_(1.0)
        return self.fc2(h), t


@pytest.mark.parametrize("cls, excluded, chunked", [(BufferView, None, "getitem"), (InputView, "mul_", "getitem"),
                                                    (ActivationView, "add_", "t")])
def test_a_chunked_stage_handing_on_a_view_written_later_runs_as_the_loop(cls, excluded, chunked):
    torch.manual_seed(0)
    members = [cls() for _ in range(N)]
    x = torch.randn(N, 5, 8)
    graph = planner.trace(members[0], (x[0].clone(),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    if excluded:
        plan = planner.exclude(plan, graph, excluded)
    stage = plan.stage_of(chunked)
    assert stage.mode.value == "batched"
    plan = planner.set_options(plan, graph, stage.id, chunk_size=2)
    with pytest.warns(UserWarning, match=f"stage {stage.id}: chunk_size=2 is not applied"):
        ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    ref = [copy.deepcopy(m) for m in members]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            xb, xl = x.clone(), x.clone()
            out = ens(xb)
            want = [m(xl[i]) for i, m in enumerate(ref)]
            want = torch.stack(want) if isinstance(want[0], torch.Tensor) else tuple(torch.stack(w) for w in zip(*want))
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(xb, xl)  # the caller's input, written as the loop writes it
    for i, m in enumerate(ref):
        for name, t in m.state_dict().items():
            torch.testing.assert_close(ens.member_state_dicts()[i][name], t, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():  # two calls and a second batch size, from the members' own state
        warnings.simplefilter("ignore")
        report = executor.verify(plan, [copy.deepcopy(m) for m in members], (x,))
    assert report.ok, report.to_text()


class OutAccumulated(nn.Module):
    def __init__(self, gram):
        super().__init__()
        self.lin, self.gram = nn.Linear(6, 6), gram

    def forward(self, x):
        h = self.lin(x)
        if self.gram:
            c = torch.zeros(6, 6)
            torch.matmul(h.detach().t(), h.detach(), out=c)
            return h @ c
        c = torch.zeros(6)
        torch.add(c, h.detach().mean(0), out=c)
        return h + c


@pytest.mark.parametrize("gram", [False, True], ids=["accumulated", "gram"])
def test_an_out_write_into_a_fresh_fixed_size_tensor_runs_as_the_loop(gram):
    torch.manual_seed(0)
    members = [OutAccumulated(gram) for _ in range(N)]
    x = torch.randn(4, 6)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N, input_mode="shared")
    ens = executor.build(plan, members)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-5)


class CountedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.register_buffer("cnt", torch.zeros(()))

    def forward(self, x):
        self.cnt.add_(1)  # a buffer forward() writes: traced with torch.export
        h, _ = self.gru(x)
        return h * self.cnt


def test_a_batched_module_that_would_not_load_again_is_refused_at_the_save():
    from stagewise.planner.errors import OutputFileError  # noqa: PLC0415

    torch.manual_seed(0)
    members = [CountedGRU() for _ in range(N)]
    x = torch.randn(N, 2, 5, 8)
    plan = planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")
    assert plan.tracer == "export"
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    with pytest.raises(OutputFileError, match=r"cannot be pickled whole.*torch.save\(ens.state_dict\(\), path\)"):
        torch.save(ens, io.BytesIO())
    ens(x)
    twin = copy.deepcopy(ens)  # EMA / SWA copies: no pickling
    torch.testing.assert_close(twin(x), ens(x))
    buffer = io.BytesIO()
    torch.save(ens.state_dict(), buffer)
    buffer.seek(0)
    loaded = executor.build(plan, [copy.deepcopy(m) for m in members])
    loaded.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(loaded(x), ens(x))


class TopOneMoE(nn.Module):
    def __init__(self, experts=3):
        super().__init__()
        self.gate = nn.Linear(8, experts)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))

    def forward(self, x):
        top, idx = self.gate(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            m = idx == e
            out[m] = expert(x[m]) * top[m].unsqueeze(-1)
        return out


def test_wide_on_a_value_shaped_stage_names_the_shapes_and_the_loop():
    from stagewise.planner.errors import ExecutionError  # noqa: PLC0415

    torch.manual_seed(0)
    members = [TopOneMoE().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, N, "shared")
    with torch.no_grad():
        torch.testing.assert_close(executor.build(plan, members)(x), torch.stack([m(x) for m in members]))
    for s in plan.stages:
        plan = planner.set_options(plan, graph, s.id, strategy="wide")
    with torch.no_grad(), pytest.raises(ExecutionError, match=r"each member a tensor of its own shape.*strategy 'loop'"):
        executor.build(plan, members)(x)


def _fill_out(h, c):
    torch.add(c, h.mean(0), out=c)


def _fill_add(h, c):
    c.add_(h.mean(0))


def _fill_set(h, c):
    c[:3] = h.mean(0)[:3]


class FilledInBlock(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.lin, self.fill = nn.Linear(6, 6), fill

    def forward(self, x):
        h = self.lin(x)
        c = torch.zeros(6)
        with torch.no_grad():
            self.fill(h, c)
        return h + c


@pytest.mark.parametrize("fill", [_fill_out, _fill_add, _fill_set], ids=["out", "add_", "setitem"])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_a_fresh_tensor_written_in_a_no_grad_block_is_made_per_member(fill, mode):
    torch.manual_seed(0)
    members = [FilledInBlock(fill).eval() for _ in range(N)]
    x = torch.randn(4, 6) if mode == "shared" else torch.randn(N, 4, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x if mode == "shared" else x[0],)), N, mode)
    assert plan.tracer == "export"
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        for _ in range(2):
            want = torch.stack([m(x if mode == "shared" else x[i]) for i, m in enumerate(members)])
            torch.testing.assert_close(ens(x), want, rtol=1e-5, atol=1e-6)


class SliceUpdatedInBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("m", torch.zeros(4))

    def forward(self, x):
        v = self.m[:2]
        with torch.no_grad():
            v.lerp_(x.mean(0)[:2], 0.5)
        return self.lin(x - self.m)


def test_a_chunked_stage_handing_on_a_view_a_block_writes_runs_as_the_loop():
    torch.manual_seed(0)
    members = [SliceUpdatedInBlock() for _ in range(N)]
    x = torch.randn(N, 5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    for s in plan.stages:
        if s.mode.value == "batched":
            plan = planner.set_options(plan, graph, s.id, chunk_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    ref = [copy.deepcopy(m) for m in members]
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(ref)]), rtol=1e-5, atol=1e-6)
    for i, m in enumerate(ref):
        torch.testing.assert_close(ens.member_state_dicts()[i]["m"], m.m)


class DiscountedCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 1)

    def forward(self, x, gamma: float):
        return self.fc(x) / (1 - gamma)


def test_verify_runs_the_loop_on_the_per_member_numbers_as_given():
    torch.manual_seed(0)
    members = [DiscountedCritic().eval() for _ in range(N)]
    x = torch.randn(N, 8, 6)
    plan = planner.propose(planner.trace(members[0], (x[0], 0.99)), n_members=N, input_mode="per_member")
    gammas = [0.999, 0.9999, 0.99999]
    # float32 numbers lost 1.4e-3 in 1 - gamma; the batched module now holds them as the doubles they are
    report = executor.verify(plan, members, (x, gammas), rtol=1e-6)
    assert report.ok, report.to_text()
    ens = executor.build(plan, members)
    with torch.no_grad():  # a float64 tensor of numbers is the list's numbers
        got = ens(x, torch.tensor(gammas, dtype=torch.float64))
        torch.testing.assert_close(got, ens(x, gammas), rtol=0, atol=0)
        want = torch.stack([m(x[i], g) for i, (m, g) in enumerate(zip(members, gammas))])
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # was 1.4e-3 of the scale


def test_a_member_with_an_inf_in_its_loop_output_is_measured_on_its_finite_values():
    from stagewise.executor.candidates import max_rel_error  # noqa: PLC0415

    want = torch.tensor([[1.0, float("-inf"), 2.0], [1.0, 1.0, 1.0]])
    got = torch.tensor([[1.0, float("-inf"), 3.0], [1.0, 1.0, 1.0]])
    assert max_rel_error(got, want) == pytest.approx(0.5)
    assert max_rel_error(want.clone(), want) == 0.0


class ScaledItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out = self.fc(x)
        s = out.abs().max().item()
        return out, s * 1e40


def test_verify_compares_python_number_outputs_as_doubles():
    torch.manual_seed(0)
    members = [ScaledItem().eval() for _ in range(N)]
    x = torch.randn(N, 4, 6)
    plan = planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")
    report = executor.verify(plan, members, (x,), rtol=1e-12)
    assert report.ok, report.to_text()  # 1e40-sized both: the batched module's number is a double, as the loop's
    assert executor.build(plan, members)(x)[1].dtype == torch.float64


class Moments(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.how = nn.Linear(6, 3), how
        with torch.no_grad():
            self.fc.bias.add_(100.0)

    def forward(self, x):
        h = self.fc(x)
        m, m2 = h.mean().item(), (h * h).mean().item()
        if self.how == "variance":
            return h - m, m2 - m * m
        s = h.abs().max().item() / 100.0
        if self.how == "exp":
            return h * math.exp(s)
        if self.how == "full_like":
            return h + torch.full_like(h, s)
        return h * round(s, 1)


@pytest.mark.parametrize("how", ["exp", "full_like"])
def test_numbers_read_from_tensors_reach_python_number_ops_per_member(how):
    torch.manual_seed(0)
    members = [Moments(how).eval() for _ in range(N)]
    x = torch.randn(N, 4, 6)
    plan = planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")
    report = executor.verify(plan, members, (x,), rtol=1e-6)
    assert report.ok, report.to_text()


def test_python_arithmetic_on_numbers_read_from_tensors_runs_in_double():
    torch.manual_seed(0)
    members = [Moments("variance").eval() for _ in range(N)]
    x = torch.randn(N, 4, 6)
    plan = planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")
    report = executor.verify(plan, members, (x,), rtol=1e-12)  # m2 - m * m near 1e4 in float32 was 1.2e-3 off
    assert report.ok, report.to_text()
