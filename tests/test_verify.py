"""executor.verify must be able to say MISMATCH: batched results made wrong on purpose (a tampered
stacked state, a runner that swaps members) are caught in the outputs and at the stage boundaries,
with the error the comparison should measure, and real tolerances decide both ways."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from stagewise import executor
from stagewise import planner
from stagewise.executor.stages import RUNNERS, VmapRunner
from stagewise.executor.values import Batched
from stagewise.planner.plan import Strategy

from conftest import RunningTotal

verify_module = importlib.import_module("stagewise.executor.verify")  # `executor.verify` is the function
N = 3


@pytest.fixture(scope="module")
def two_stages(sample):
    """mlp as s0 (fc1) | s1 (act, fc2): boundaries fc1 and fc2."""
    src, graph = sample("mlp")
    plan = planner.split(planner.propose(graph, N), graph, "s0", at="act")
    assert [s.nodes for s in plan.stages] == [("fc1",), ("act", "fc2")]
    return src, plan


def loop_scale(src, members) -> float:
    """max |loop output| over all members: the normwise denominator verify divides by."""
    with torch.no_grad():
        return torch.stack([m(*src.example_inputs) for m in members]).abs().max().item()


def tampered_build(monkeypatch, key: str, member: int, delta: float) -> None:
    """verify builds the batched module, then one member's slice of one stacked tensor is shifted."""
    real = verify_module.build

    def build(*args, **kwargs):
        module = real(*args, **kwargs)
        with torch.no_grad():
            module.stacked_state[key][member] += delta
        return module

    monkeypatch.setattr(verify_module, "build", build)


def rows(report, kind: str) -> dict[str, verify_module.ErrorRow]:
    return {r.name: r for r in getattr(report, kind)}


def test_untouched_plan_matches_with_small_errors(two_stages):
    src, plan = two_stages
    report = executor.verify(plan, src.members(N), src.example_inputs)
    assert report.ok and report.to_text().splitlines()[-1].startswith("MATCH:")
    assert list(rows(report, "boundaries")) == ["fc1", "fc2"]
    first, second = src.example_inputs[0].shape[0], executor.resized_inputs(plan, src.example_inputs)[0].shape[0]
    # by default a second batch size too (shapes can be baked into a trace)
    assert list(rows(report, "outputs")) == ["out", "out (call 2)", f"out @ [{second}, 64]", f"out @ [{second}, 64] (call 2)"]
    assert len(report.shapes) == 2 and first != second
    assert report.calls == 2 and "2 consecutive calls" in report.to_text()
    assert all(r.max_rel <= 1e-6 and r.ok for r in report.outputs + report.boundaries)


def test_a_tampered_output_stage_is_a_mismatch_in_the_output_and_its_boundary(two_stages, monkeypatch):
    src, plan = two_stages
    members = src.members(N)
    delta = 0.5
    tampered_build(monkeypatch, "fc2.bias", 1, delta)
    report = executor.verify(plan, members, src.example_inputs)
    assert not report.ok and report.to_text().splitlines()[-1].startswith("MISMATCH:")
    for name in ("out", "out (call 2)"):  # every call compared shows it
        out = rows(report, "outputs")[name]
        assert not out.ok
        assert out.max_abs == pytest.approx(delta, rel=1e-5)
        assert out.max_rel == pytest.approx(delta / loop_scale(src, members), rel=1e-5)
    bounds = rows(report, "boundaries")
    assert bounds["fc1"].ok and bounds["fc1"].max_abs <= 1e-6  # upstream of the tampered weight: unaffected
    assert not bounds["fc2 (member 1)"].ok and bounds["fc2 (member 1)"].max_abs == pytest.approx(delta, rel=1e-5)


def test_a_tampered_first_stage_is_a_mismatch_at_its_boundary(two_stages, monkeypatch):
    src, plan = two_stages
    tampered_build(monkeypatch, "fc1.bias", 2, 1.0)
    report = executor.verify(plan, src.members(N), src.example_inputs)
    assert not report.ok
    bad = [r for r in report.boundaries if not r.ok]
    assert [r.name for r in bad] == ["fc1 (member 2)", "fc2 (member 2)"]  # the first member that differs is named
    assert bad[0].max_abs == pytest.approx(1.0, rel=1e-5)
    assert not rows(report, "outputs")["out"].ok


class SwappingRunner(VmapRunner):
    """Correct values, but members 0 and 1 of every output swapped: a member mix-up."""

    def run(self, args):
        out = []
        for v in super().run(args):
            t = v.tree
            out.append(Batched(torch.cat([t[1:2], t[0:1], t[2:]])))
        return out


def test_a_member_mix_up_is_a_mismatch(two_stages, monkeypatch):
    src, plan = two_stages
    monkeypatch.setitem(RUNNERS, Strategy.VMAP, SwappingRunner)
    report = executor.verify(plan, src.members(N), src.example_inputs)
    assert not report.ok
    assert {r.name for r in report.boundaries if not r.ok} == {"fc1 (member 0)", "fc2 (member 0)"}
    assert not rows(report, "outputs")["out"].ok


@pytest.mark.parametrize("per_member_input", [False, True])
def test_the_tolerance_decides_both_ways(two_stages, monkeypatch, per_member_input):
    """An error of known size passes an rtol just above it and fails one just below it."""
    src, plan = two_stages
    if per_member_input:
        plan = plan.with_input_modes({"x": "per_member"})
    inputs = executor.batched_inputs(plan, src.example_inputs)
    members = src.members(N)
    with torch.no_grad():
        want = torch.stack([m(*executor.member_inputs(plan, inputs, i)) for i, m in enumerate(members)])
    delta = 1e-3
    expected = delta / want[0].abs().max().item()  # member 0's error over member 0's scale: far above float32 noise
    tampered_build(monkeypatch, "fc2.bias", 0, delta)
    above = executor.verify(plan, members, inputs, rtol=expected * 1.05)
    below = executor.verify(plan, members, inputs, rtol=expected * 0.95)
    assert above.ok and above.rtol == expected * 1.05, above.to_text()
    assert not below.ok and not rows(below, "outputs")["out"].ok
    assert rows(below, "boundaries")["fc1"].ok  # the boundary before the error still matches at that rtol
    assert rows(above, "outputs")["out"].max_rel == pytest.approx(expected, rel=1e-3)


def test_default_tolerance_passes_float_noise_and_catches_a_small_error(two_stages, monkeypatch):
    src, plan = two_stages
    assert verify_module.DEFAULT_RTOL == 1e-4
    tampered_build(monkeypatch, "fc2.bias", 1, 1e-3)  # relative error about 1e-3 > 1e-4
    assert not executor.verify(plan, src.members(N), src.example_inputs).ok


def test_a_plan_of_loops_is_exact(two_stages):
    """The loop strategy runs each member's own ops: zero error, so even rtol=0 passes (<=, not <)."""
    src, plan = two_stages
    graph = planner.trace(src.model, src.example_inputs)
    for sid in ("s0", "s1"):
        plan = planner.set_options(plan, graph, sid, strategy="loop")
    report = executor.verify(plan, src.members(N), src.example_inputs, rtol=0.0)
    assert report.ok, report.to_text()
    assert all(r.max_abs == 0.0 for r in report.outputs + report.boundaries)


def test_compare_measures_normwise_error_and_shape_mismatch():
    want = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    (row,) = verify_module.compare("v", want + torch.tensor([[0.0, 0.0], [0.0, 0.2]]), want, rtol=0.06)
    assert row.max_abs == pytest.approx(0.2) and row.max_rel == pytest.approx(0.05) and row.ok
    (row,) = verify_module.compare("v", want + torch.tensor([[0.0, 0.0], [0.0, 0.2]]), want, rtol=0.04)
    assert not row.ok
    (row,) = verify_module.compare("v", want[:1], want, rtol=1.0)
    assert not row.ok and "shape [1, 2] vs [2, 2]" in row.name
    assert [r.ok for r in verify_module.compare("t", (want, 3), (want, 4), rtol=1.0)] == [True, False]
    assert not verify_module.compare("t", (want,), (want, 1), rtol=1.0)[0].ok  # a missing leaf


def test_verify_leaves_members_buffers_as_they_were():
    """forward() updates a buffer; verify runs the members several times and restores it each time."""
    torch.manual_seed(0)
    members = [RunningTotal().eval() for _ in range(N)]
    x = torch.randn(5, 4)
    graph = planner.trace(RunningTotal().eval(), (x,))
    plan = planner.propose(graph, N)
    before = [m.total.clone() for m in members]
    report = executor.verify(plan, members, (x,))
    assert report.ok, report.to_text()
    for m, b in zip(members, before):
        assert torch.equal(m.total, b)


def test_report_json_carries_the_verdict(two_stages, monkeypatch):
    src, plan = two_stages
    tampered_build(monkeypatch, "fc2.bias", 1, 0.5)
    d = executor.verify(plan, src.members(N), src.example_inputs).to_json()
    assert d["ok"] is False and d["n_members"] == N and d["rtol"] == verify_module.DEFAULT_RTOL and d["calls"] == 2
    assert [r["ok"] for r in d["outputs"]] == [False] * 4  # two calls at two batch sizes


class _DataWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.l1(x) * 1.0
        h.add_(1.0)
        return self.l2(torch.neg(h))


def test_verify_with_grads_compares_outputs_and_gradients_with_gradients_on(monkeypatch):
    # A plan can answer right without gradients and wrong with them (a loop stage's own rows in training): the
    # training-mode call and every parameter's gradient are compared against each member's own backward.
    build_module = importlib.import_module("stagewise.executor.build")

    torch.manual_seed(0)
    members = [_DataWrite() for _ in range(3)]
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=3)
    plan = planner.split(plan, graph, plan.stages[0].id, at="add_")
    plan = planner.split(plan, graph, plan.stages[1].id, at="neg")  # the write alone in a loop stage, read after it
    plan = planner.set_options(plan, graph, plan.stages[1].id, strategy="loop")
    report = executor.verify(plan, members, (x,), grads=True)
    assert report.ok, report.to_text()
    assert {r.name for r in report.gradients} == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}
    assert "grad l1.weight" in report.to_text() and report.to_json()["gradients"]
    # the same plan with the write-back of a loop stage's own rows lost: fine without gradients, caught with them
    monkeypatch.setattr(build_module, "_write_back", lambda copies, state=frozenset(): None)
    assert executor.verify(plan, members, (x,)).ok
    broken = executor.verify(plan, members, (x,), grads=True)
    assert not broken.ok and any(not r.ok for r in broken.outputs if "with gradients" in r.name)


def test_verify_with_grads_on_a_model_with_nothing_to_train():
    members = [nn.Sequential(nn.Linear(4, 3)).requires_grad_(False) for _ in range(3)]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    report = executor.verify(plan, members, (x,), grads=True)
    assert report.ok and not report.gradients and any("no parameter requires grad" in n for n in report.notes)


def test_verify_with_grads_catches_outputs_that_record_no_gradient_and_a_failing_backward(monkeypatch):
    build_module = importlib.import_module("stagewise.executor.build")
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)) for _ in range(3)]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    outputs = build_module.BatchedModule._outputs
    monkeypatch.setattr(build_module.BatchedModule, "_outputs", lambda self, env: outputs(self, env).detach())
    report = executor.verify(plan, members, (x,), grads=True)  # was: only a note, and MATCH
    assert not report.ok and any("records no gradient" in r.name for r in report.gradients)

    monkeypatch.setattr(build_module.BatchedModule, "_outputs", outputs)
    monkeypatch.setattr(torch.autograd, "grad", _raising_grad(torch.autograd.grad))  # the batched backward fails
    report = executor.verify(plan, members, (x,), grads=True)  # was: the RuntimeError itself
    assert not report.ok and any(r.name.startswith("gradients: RuntimeError") for r in report.gradients)


def _raising_grad(grad):
    calls = []

    def first_call_raises(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace operation")
        return grad(*args, **kwargs)
    return first_call_raises


# --- the state forward() moves --------------------------------------------------------------------------------------

def test_verify_compares_the_running_statistics_training_calls_leave():
    V = importlib.import_module("stagewise.executor.verify")

    torch.manual_seed(0)
    n = 3
    members = [nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).train() for _ in range(n)]
    x = torch.randn(16, 6)
    plan = planner.propose(planner.trace(members[0], (x,)), n)
    report = executor.verify(plan, members, (x,), calls=3)
    names = {r.name for r in report.state}
    assert report.ok and {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= names, names
    assert "0.weight" not in names  # what forward() does not move is not listed
    # a module whose statistics moved otherwise than the members': the row says so (the outputs of a training-mode
    # BatchNorm read the batch's statistics, so they alone would not)
    module = executor.build(plan, [copy.deepcopy(m) for m in members])
    before = V._module_state(module)
    ref = [copy.deepcopy(m) for m in members]
    with torch.no_grad():
        module(x)
        for m in ref:
            m(x)
        module.stacked.get_submodule("1").running_mean[1] += 0.1
    bad = V.VerifyReport(n_members=n, rtol=1e-4)
    V._compare_state(bad, module, ref, before, 1e-4)
    assert not bad.ok and [r.name for r in bad.state if not r.ok] == ["1.running_mean"]


def test_verify_given_a_module_says_what_it_takes(two_stages):
    src, plan = two_stages
    members = src.members(N)
    ens = executor.build(plan, members)
    for args in ((ens, members), (plan, ens)):
        with pytest.raises(TypeError, match="takes the plan and the N member modules"):
            executor.verify(*args, src.example_inputs)


def test_verify_state_near_zero_by_cancellation_is_a_match():
    class PostBNMean(nn.Module):  # the mean activation after BatchNorm: zero up to rounding
        def __init__(self):
            super().__init__()
            self.a, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)
            self.register_buffer("act_mean", torch.zeros(6), persistent=False)

        def forward(self, x):
            h = self.bn(self.a(x))
            self.act_mean.mul_(0.9).add_(0.1 * h.detach().mean(0))
            return h * 2

    V = importlib.import_module("stagewise.executor.verify")
    torch.manual_seed(0)
    members = [PostBNMean() for _ in range(3)]
    x = torch.randn(8, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), 3)
    report = V.VerifyReport(n_members=3, rtol=1e-4)
    module = executor.build(plan, [copy.deepcopy(m) for m in members])
    before = V._module_state(module)
    with torch.no_grad():
        module(x)
        for m in members:
            m(x)
    V._compare_state(report, module, members, before, 1e-4)
    assert {r.name for r in report.state} >= {"act_mean", "bn.running_mean"} and report.ok, report.to_text()


class Spectral(torch.nn.Module):
    """An FNO-style layer: complex weights on the low Fourier modes."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 5, dtype=torch.cfloat) * 0.3)

    def forward(self, x):
        return torch.fft.irfft(torch.fft.rfft(x) * self.w, n=x.shape[-1])


def test_verify_and_the_stage_check_see_the_imaginary_part_of_a_gradient(monkeypatch):
    """`.double()` of a complex gradient kept its real part: a gradient conjugated (wrong only in its imaginary part)
    compared equal."""
    import importlib

    verify_module = importlib.import_module("stagewise.executor.verify")
    from stagewise.executor.stage_grads import grads_check

    torch.manual_seed(0)
    members = [Spectral() for _ in range(3)]
    x = torch.randn(2, 4, 8)
    plan = planner.propose(planner.trace(members[0], (x,)), 3)
    assert executor.verify(plan, members, (x,), grads=True).ok
    built = verify_module.build

    def conjugating(*args, **kwargs):
        module = built(*args, **kwargs)
        for _, p in module.named_stacked_parameters():
            p.register_hook(lambda g: g.conj())
        return module

    monkeypatch.setattr(verify_module, "build", conjugating)
    report = executor.verify(plan, members, (x,), grads=True)
    assert not report.ok and any(not row.ok for row in report.gradients)
    g = torch.randn(3, 4, 5, dtype=torch.cfloat)
    assert grads_check([g], 3)([g.conj()]) > 0.5


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, scale: float):
        return self.fc(x) * scale


def test_a_python_number_planned_per_member_is_verified_as_an_n_vector():
    """batched_inputs passed the number on as it was and member_inputs indexed it: a raw TypeError in verify, run and
    profile."""
    torch.manual_seed(0)
    members = [Scaled() for _ in range(2)]
    example = (torch.randn(4, 8), 0.5)
    plan = planner.propose(planner.trace(members[0], example), 2, input_mode={"scale": "per_member"})
    inputs = executor.batched_inputs(plan, example)
    assert inputs[1].shape == (2,) and inputs[1][0] != inputs[1][1]
    assert executor.verify(plan, members, inputs, grads=True).ok


def test_integer_per_member_inputs_differ_per_member():
    """Token ids per member were N copies of one row: a plan feeding member i another member's ids matched."""
    plan = planner.propose(planner.trace(torch.nn.Embedding(10, 4), (torch.tensor([[1, 2, 3]]),)), 3,
                           input_mode="per_member")
    ids = executor.batched_inputs(plan, (torch.tensor([[3, 1, 2], [0, 4, 1], [2, 2, 0]]),))[0]
    assert ids.shape == (3, 3, 3) and len({tuple(r.flatten().tolist()) for r in ids}) == 3
    actions = torch.tensor([[2, 4], [0, 1], [1, 3]])  # MultiDiscrete (3, 5): each column its own range
    rolled = executor.batched_inputs(plan, (actions,))[0]
    assert all((r[:, 0] < 3).all() for r in rolled)  # rows rolled, not columns


def test_integer_per_member_inputs_in_order_keep_their_order():
    """Offsets, cumulative lengths, positions and padding masks mean what their order says: not rolled."""
    plan = planner.propose(planner.trace(torch.nn.Embedding(10, 4), (torch.tensor([[1, 2, 3]]),)), 3,
                           input_mode="per_member")
    for x in (torch.tensor([[0, 2, 5], [0, 1, 6]]), torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()):
        got = executor.batched_inputs(plan, (x,))[0]
        assert all(torch.equal(row, x) for row in got)


class KeywordOnlyMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, *, mask):
        return self.fc(x) * mask


def test_a_keyword_only_input_is_given_to_the_members_by_name():
    """verify and autotune called each member with every input in order: a raw TypeError."""
    torch.manual_seed(0)
    members = [KeywordOnlyMask() for _ in range(2)]
    x, mask = torch.randn(3, 4), (torch.rand(3, 4) > 0.5).float()
    plan = planner.propose(planner.trace(members[0], (x, mask)), 2)
    assert executor.verify(plan, members, (x, mask)).ok
    executor.autotune(plan, members, (x, mask), budget="quick")
