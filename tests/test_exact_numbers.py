"""Python arithmetic on numbers forward() reads from its tensors (`.item()`), against the plain member loop.

In the loop such numbers are Python floats, so `m2 - m * m` of two moments runs in double. A batched stage gets them
as one [N] tensor per number at the plan's float precision, where the variance of values near 100 came out 1.2e-3
off in float32, and a number forward() returned past float32's range came back inf. Build now runs that arithmetic
on float64 operands (executor.exact_numbers), rounds a number where an op takes it beside tensors (as torch rounds a
Python float operand), and returns Python-float outputs as float64.
"""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.exact_numbers import number_op, number_operand, read_numbers

N = 3


class Moments(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        with torch.no_grad():
            self.fc.bias.add_(100.0)

    def forward(self, x):
        h = self.fc(x)
        m, m2 = h.mean().item(), (h * h).mean().item()
        var = m2 - m * m
        # a 0-d tensor beside the number: the loop's result is float32 (a Python float takes the tensor's dtype)
        return (h - m) / (var + 1e-3), var, h.sum() * var, torch.where(h > m, h, h * (var > 1.0))


class Flags(nn.Module):
    """Comparisons of numbers added up: Python's True + True is 2 (torch's bool + bool is `or`)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        a, b = h.mean().item(), h.max().item()
        return h * ((a > -10) + (b > -10))


def test_comparisons_of_numbers_add_up_as_python_ints():
    members = _members(Flags)
    x = torch.randn(N, 4, 6)
    ens = executor.build(_plan(members, x), members)
    out, ref = ens(x), _loop(members, x)
    assert all(torch.equal(out[i], ref[i]) for i in range(N))  # was h * 1: 1.25 off


class Counts(nn.Module):
    """Whole numbers stay whole: `n // 2` of a count is int64 as Python's int, `n / 4` a double."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        n = (h > 0).sum().item()
        return h * (n // 2), n // 2, n / 4 - 0.1


def _members(cls, dtype=torch.float32):
    torch.manual_seed(0)
    return [cls().to(dtype).eval() for _ in range(N)]


def _loop(members, x):
    return [m(x[i]) for i, m in enumerate(members)]


def _plan(members, x):
    return planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")


def _check(out, ref, k, *, ulps=0):
    """Output k of the batched module equals each member's in the loop's dtype: bit for bit, or within `ulps` units
    in the last place of the output's scale (a batched matmul may round the activations by one)."""
    for i in range(N):
        want = ref[i][k]
        got = out[k][i]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
            bound = ulps * torch.finfo(want.dtype).eps * want.abs().max() if want.is_floating_point() else 0
            assert (got - want).abs().max() <= bound, (k, i, (got - want).abs().max())
        else:
            assert got.item() == want, (k, i, got.item(), want)
            assert got.dtype == (torch.float64 if isinstance(want, float) else torch.int64)


def test_variance_of_two_moments_matches_the_loop_bit_for_bit():
    members = _members(Moments)
    x = torch.randn(N, 4, 6)
    plan = _plan(members, x)
    ens = executor.build(plan, members)
    out, ref = ens(x), _loop(members, x)
    for k in range(4):
        _check(out, ref, k)
    report = executor.verify(plan, members, (x,), rtol=1e-12)
    assert report.ok, report.to_text()


def test_whole_numbers_stay_int64_and_true_division_is_a_double():
    members = _members(Counts)
    x = torch.randn(N, 5, 6)
    ens = executor.build(_plan(members, x), members)
    out, ref = ens(x), _loop(members, x)
    for k in range(3):
        _check(out, ref, k)


def test_a_float64_model_keeps_doubles_throughout():
    members = _members(Moments, torch.float64)
    x = torch.randn(N, 4, 6, dtype=torch.float64)
    ens = executor.build(_plan(members, x), members)
    out, ref = ens(x), _loop(members, x)
    for k in range(4):
        _check(out, ref, k)


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_every_strategy_of_the_arithmetic_stages_matches(strategy):
    members = _members(Moments)
    x = torch.randn(N, 4, 6)
    graph = planner.trace(members[0], (x[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    options = {"strategy": strategy} if strategy == "loop" else {"strategy": strategy, "chunk_size": 2}
    for s in plan.stages[1:]:
        if s.mode is planner.StageMode.BATCHED:
            plan = planner.set_options(plan, graph, s.id, **options)
    ens = executor.build(plan, members)
    out, ref = ens(x), _loop(members, x)
    for k in range(4):
        _check(out, ref, k)


def test_a_saved_module_keeps_the_double_arithmetic():
    members = _members(Moments)
    x = torch.randn(N, 4, 6)
    ens = executor.build(_plan(members, x), members)
    buf = io.BytesIO()
    torch.save(ens, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out, ref = loaded(x), _loop(members, x)
    _check(out, ref, 1)
    _check(out, ref, 2)


def test_read_numbers_follows_arithmetic_on_numbers_alone():
    members = _members(Moments)
    x = torch.randn(N, 4, 6)
    gm = planner.trace(members[0], (x[0],)).gm
    names = read_numbers(gm)
    ops = {n.name: n for n in gm.graph.nodes}
    assert {"item", "item_1"} <= names
    # `m2 - m * m` and `var > 1.0` are numbers; `h - m` and `h * ...` read a tensor, so are not
    assert any(ops[n].target.__name__ == "sub" for n in names if ops[n].op == "call_function" and n not in ("item", "item_1"))
    assert all(not isinstance(planner.trace(members[0], (x[0],)).example_values.get(n), torch.Tensor) for n in names)


def test_the_helpers_compute_as_python_does():
    a, b = torch.tensor([100.123456], dtype=torch.float32), torch.tensor([10024.7], dtype=torch.float32)
    got = number_op("sub", b, number_op("mul", a, a))
    assert got.dtype == torch.float64
    assert got.item() == b.item() - a.item() * a.item()
    assert number_op("floordiv", torch.tensor([7]), 2).dtype == torch.int64
    assert number_op("truediv", torch.tensor([7]), 2).dtype == torch.float64
    assert number_op("add", 1.5, 2) == 3.5  # Python numbers: plain arithmetic
    assert number_operand(got).dtype == torch.float32
    assert number_operand(2.5) == 2.5


@torch.fx.wrap
def _rounded(s):
    return round(s, 3)  # a Python float's method: a 0-d tensor has no __round__


@torch.fx.wrap
def _steps(s):
    return sum(range(int(s * 1000) % 5))


class Rounded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        s = h.abs().max().item() / 100.0  # computed in a batched stage, read by loop stages
        return h * _rounded(s), h + _steps(s)


def test_a_loop_stage_gets_python_numbers_from_a_batched_one():
    members = _members(Rounded)
    x = torch.randn(N, 4, 6)
    plan = _plan(members, x)
    assert any(s.options.strategy is planner.Strategy.LOOP and "_rounded" in s.nodes for s in plan.stages)
    ens = executor.build(plan, members)  # every call failed: round() of a 0-d tensor
    out, ref = ens(x), _loop(members, x)
    _check(out, ref, 0)
    _check(out, ref, 1)


class Doubles(nn.Module):
    """A number beside a float64 tensor stays double (a Python float does not round there); a number divided by a size
    (`h.sum().item() / h.numel()`) is still a number."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x) + 100.0
        m = h.sum().item() / h.numel()
        m2 = (h * h).sum().item() / x.shape[0] / 8
        d = h.double() + 1e4
        md = d.mean().item()
        return h * (m2 - m * m), (d - md).float(), torch.where(d > md, d, d * 2)


def test_a_number_takes_the_precision_of_the_tensor_beside_it():
    members = _members(Doubles)
    x = torch.randn(N, 6, 8)
    ens = executor.build(_plan(members, x), members)
    out, ref = ens(x), _loop(members, x)
    _check(out, ref, 0, ulps=2)  # was 4.5e-3 relative: the size division dropped to float32
    # the number beside float64 was rounded to float32: 2.6e-4 off; now the activations' own rounding (h ~ 100, one
    # float32 ulp 7.6e-6) is all that is left
    assert max((out[1][i] - ref[i][1]).abs().max() for i in range(N)) <= 2e-5
    assert max((out[2][i] - ref[i][2]).abs().max() for i in range(N)) <= 4e-5  # d ~ 1e4 from those activations


class Powers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x)
        n = (h[0] > 0).sum().item() + 1  # a whole number per member
        return h * (n ** -1), h * (n ** 2), h.argmax(-1) + 2 ** (n + 30)  # a float, a whole number, an int64 id


def test_a_power_of_a_whole_number_is_pythons():
    members = _members(Powers)
    x = torch.randn(N, 4, 6)
    ens = executor.build(_plan(members, x), members)
    out, ref = ens(x), _loop(members, x)
    for k in range(3):
        _check(out, ref, k, ulps=2)  # (2 ** (n + 30) beside int64 ids: int64, as Python's int, not a float)


class ThroughLoops(nn.Module):
    """Numbers that leave a loop stage: `.item()` of a float64 tensor, a `round()` (it needs a Python float)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x) + 100.0
        hd = h.double()
        m, m2 = hd.mean().item(), (hd * hd).mean().item()
        r = round(h.mean().item(), 2)
        return h * (m2 - m * m), h * (r - h.mean().item()) * 100


def test_numbers_leaving_a_loop_stage_stay_doubles():
    members = _members(ThroughLoops)
    x = torch.randn(N, 5, 8)
    ens = executor.build(_plan(members, x), members)  # (fx cannot trace round(): torch.export, as given)
    out, ref = ens(x), _loop(members, x)
    for k in range(2):  # were stacked at float32 between the loop stage and the arithmetic: 0.095 / 0.028 off
        assert max((out[k][i] - ref[i][k]).abs().max() for i in range(N)) <= 4 * 7.7e-6 * ref[0][k].abs().max()


class HandsOnANumber(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        m, m2 = h.mean().item(), (h * h).mean().item()
        return self.b(h * (m2 - m * m)), m * 2


def test_profile_and_autotune_accept_a_stage_handing_on_a_double():
    members = _members(HandsOnANumber)
    x = torch.randn(N, 6, 8)
    plan = _plan(members, x)
    report = executor.profile(plan, members, (x,), repeats=2, warmup=1)
    assert report.end_to_end.ok, report.end_to_end.error  # was "wrong result: max rel err inf" (float64 vs float32)
    assert all(s.result.ok for s in report.stages if getattr(s, "result", None) is not None)
    tuned = executor.autotune(plan, members, (x,), budget="quick")
    assert executor.verify(tuned, members, (x,)).ok


class Discount(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x, g: float):
        return self.a(x) * ((1 - g) * 1e6 - 1e5)


def test_a_float32_tensor_of_numbers_is_taken_as_it_holds_them():
    members = _members(Discount)
    x = torch.randn(N, 4, 6)
    plan = planner.propose(planner.trace(members[0], (x[0], 0.9)), n_members=N, input_mode="per_member")
    gam = torch.tensor([0.9, 0.9, 0.9]) + torch.tensor([0.0, 1e-7, -2e-7])  # float32 values, not 0.9000001
    with torch.no_grad():
        got = executor.build(plan, members)(x, gam)
        want = torch.stack([m(x[i], g) for i, (m, g) in enumerate(zip(members, gam.tolist()))])
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # was 0.029: numbers rounded to "shortest decimals"


class NegativePowers(nn.Module):
    """`2 ** -k` with a whole k per member: Python's is a float (0.25), torch's int64 power of a negative exponent 0."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x)
        k = (h[0] > 0).sum().item() - 3  # a whole number per member, negative for some
        return h * 2 ** k, h * (k ** 2), h * (2 ** -abs(k))


def test_a_whole_number_to_a_per_member_negative_power_is_a_float():
    members = _members(NegativePowers)
    x = torch.randn(N, 4, 6)
    ref = _loop(members, x)
    assert any(((members[i].a(x[i])[0] > 0).sum().item() - 3) < 0 for i in range(N)), "the test needs a negative k"
    ens = executor.build(_plan(members, x), members)
    for rows in (4, 7, 4):  # calls after the first, and another batch size
        x = torch.randn(N, rows, 6)
        out, ref = ens(x), _loop(members, x)
        for k in range(3):
            _check(out, ref, k, ulps=2)


def moments_of(h):
    """Two numbers read from tensors, inside a function the trace keeps closed."""
    return h.mean().item(), (h * h).mean().item()


def scaled_by(h, v):
    return h / (v + 1e-3)


torch.fx.wrap("moments_of")
torch.fx.wrap("scaled_by")


class OwnFunctionNumbers(Moments):
    """Numbers a torch.fx.wrap'd function returns, and one handed to such a function: Python doubles in the loop."""

    def forward(self, x):
        h = self.fc(x)
        m, m2 = moments_of(h)
        var = m2 - m * m
        return scaled_by(h - m, var), var, h * var


def test_numbers_a_wrapped_function_returns_are_the_loops():
    members = _members(OwnFunctionNumbers)
    x = torch.randn(N, 4, 6)
    graph = planner.trace(members[0], (x[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    ens = executor.build(plan, members)
    for rows in (4, 7, 4):  # calls after the first, and another batch size
        x = torch.randn(N, rows, 6)
        out, ref = ens(x), _loop(members, x)
        for k in range(3):
            _check(out, ref, k)  # float32 arithmetic on the numbers was 3.1e-3 off the loop's (var 2.6e-4)
    assert any("function of the model's own" in s.reason for s in plan.stages)  # the plan says why they loop


def half_width(h):
    return h.shape[-1] // 2  # a whole number: the same in every member


torch.fx.wrap("half_width")


class OwnFunctionSizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        k = half_width(h) + 1
        return h[..., :k] * 2


def test_whole_numbers_a_wrapped_function_returns_stay_batched():
    members = _members(OwnFunctionSizes)
    x = torch.randn(N, 4, 6)
    graph = planner.trace(members[0], (x[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    assert not any("function of the model's own" in s.reason for s in plan.stages)  # int64 arithmetic is exact
    out, ref = executor.build(plan, members)(x), _loop(members, x)
    torch.testing.assert_close(out, torch.stack(ref))


class MathOfATensor(nn.Module):
    """math.* of a per-member 0-d tensor reads its value, as .item() does (a log-space temperature schedule)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, obs, tau0):
        tau = math.exp(math.log(tau0) * 0.5)
        return torch.softmax(self.l(obs) / tau, -1)


def test_math_of_a_per_member_tensor_is_a_number_read_per_member():
    """Two nested math calls on a per-member tensor were planned batched: every call failed inside vmap."""
    torch.manual_seed(0)
    members = [MathOfATensor() for _ in range(N)]
    obs, tau0 = torch.randn(N, 5, 4), torch.tensor([0.9, 0.5, 2.0])
    plan = planner.propose(planner.trace(members[0], (obs[0], torch.tensor(1.0))), n_members=N, input_mode="per_member")
    ens = executor.build(plan, members)
    for rows, taus in ((5, tau0), (9, tau0 * 0.5), (5, tau0)):  # calls after the first, another batch size
        obs = torch.randn(N, rows, 4)
        torch.testing.assert_close(ens(obs, taus), torch.stack([m(obs[i], taus[i]) for i, m in enumerate(members)]))
