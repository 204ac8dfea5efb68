"""Executor: the batched module against the trusted reference, the plain loop over members.

Input layout: shared inputs as one member takes them, per_member inputs [N, ...].
Output layout: every output tensor N-first.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from stagewise import executor
import stagewise.executor.stages
from stagewise import planner
import stagewise.planner.graph
from stagewise.executor.values import PerMember
from stagewise.executor.verify import compare
from stagewise.planner import InputError, MemberError, PlanMismatchError, StageMode
from conftest import SAMPLE_NAMES, RunningTotal, ScaleInPlace

RTOL = 1e-4


def plan_for(sample, name, n, mode="shared"):
    src, graph = sample(name)
    return src, graph, planner.propose(graph, n_members=n, input_mode=mode)


def loop_stack(members, inputs_per_member):
    with torch.no_grad():
        return torch.stack([m(*x) for m, x in zip(members, inputs_per_member)])


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_matches_member_loop(sample, name, n, mode):
    src, _, plan = plan_for(sample, name, n, mode)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    report = executor.verify(plan, src.members(n), inputs)
    assert report.ok, report.to_text()
    assert report.rtol == RTOL and report.n_members == n
    assert report.outputs and all(r.max_rel <= RTOL for r in report.outputs + report.boundaries), report.to_text()


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_output_is_n_first_stack_of_the_loop(sample, name):
    n = 3
    src, _, plan = plan_for(sample, name, n, "per_member")
    members = src.members(n)
    inputs = executor.batched_inputs(plan, src.example_inputs, seed=1)
    module = executor.build(plan, members, example_inputs=src.example_inputs)
    with torch.no_grad():
        got = module(*inputs)
    want = loop_stack(members, [tuple(x[i] for x in inputs) for i in range(n)])
    assert got.shape == (n, *src.model(*src.example_inputs).shape)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5)
    assert not torch.allclose(got[0], got[1]), "members with different weights and inputs must differ"


def test_shared_inputs_equal_each_member_on_the_same_input(sample):
    src, _, plan = plan_for(sample, "cnn", 3)
    members = src.members(3)
    got = executor.build(plan, members)(*src.example_inputs)
    want = loop_stack(members, [src.example_inputs] * 3)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5)


def test_module_is_reusable_and_nothing_is_retraced_per_call(sample, monkeypatch):
    src, _, plan = plan_for(sample, "data_dependent", 3)
    members = src.members(3)
    module = executor.build(plan, members)
    x = src.example_inputs[0]
    first = module(x)

    def forbidden(*a, **k):
        raise AssertionError("re-traced or re-stacked during forward")

    monkeypatch.setattr(torch.fx, "symbolic_trace", forbidden)
    monkeypatch.setattr(torch.export, "export", forbidden)
    monkeypatch.setattr(torch.func, "stack_module_state", forbidden)
    monkeypatch.setattr(executor.stages, "vmap", forbidden)  # vmapped callables are made once and cached
    monkeypatch.setattr(planner.graph, "retrace", forbidden)
    for _ in range(2):
        torch.testing.assert_close(module(x), first)
    torch.testing.assert_close(module(2 * x), loop_stack(members, [(2 * x,)] * 3), rtol=RTOL, atol=1e-5)


def test_stacked_state_is_n_first(sample):
    src, _, plan = plan_for(sample, "mlp", 3)
    members = src.members(3)
    module = executor.build(plan, members)
    stacked = module.stacked_state
    assert set(stacked) == set(dict(members[0].named_parameters()))
    for i, m in enumerate(members):
        assert torch.equal(stacked["fc1.weight"][i], m.fc1.weight)
    assert stacked["fc1.weight"].shape == (3, 128, 64)


# --- values that are not tensors cross stage boundaries ------------------------------

def test_item_values_cross_stages_per_member(sample):
    n = 3
    src, _, plan = plan_for(sample, "data_dependent", n, "per_member")
    assert plan.stage_of("item").mode is StageMode.EXCLUDED
    members = src.members(n)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    module = executor.build(plan, members)
    with torch.no_grad():
        out, env = module.run_stages(*inputs, keep=True)
    scale = env["item"]
    assert isinstance(scale, PerMember) and len(scale.values) == n
    assert all(isinstance(v, float) for v in scale.values)
    assert len(set(scale.values)) == n, "each member computes its own .item()"
    for i, m in enumerate(members):
        h = torch.relu(m.fc1(inputs[0][i]))
        assert scale.values[i] == pytest.approx(h.abs().max().item(), rel=1e-6)
    torch.testing.assert_close(out, loop_stack(members, [(inputs[0][i],) for i in range(n)]), rtol=RTOL, atol=1e-5)


class ItemOut(nn.Module):
    """Returns a tensor, a per-member Python float, a size and a dict."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h.sum().item(), x.shape[0], {"relu": h.relu()}


def test_non_tensor_outputs():
    n = 3
    torch.manual_seed(0)
    members = [ItemOut() for _ in range(n)]
    x = torch.randn(2, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n)
    h, total, size, d = executor.build(plan, members)(x)
    assert h.shape == (n, 2, 4) and d["relu"].shape == (n, 2, 4)
    assert size == 2
    assert isinstance(total, torch.Tensor) and total.shape == (n,)  # per-member numbers come back as [N]
    with torch.no_grad():
        assert total.tolist() == pytest.approx([m(x)[1] for m in members], rel=1e-5)
    report = executor.verify(plan, members, (x,))
    assert report.ok, report.to_text()


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return Output(logits=h.relu(), hidden=h)


def test_output_dataclass_is_n_first():
    n = 3
    torch.manual_seed(0)
    members = [DataclassOut() for _ in range(n)]
    x = torch.randn(2, 4)
    plan = planner.propose(planner.trace(members[0], (x,)), n)
    out = executor.build(plan, members)(x)
    assert isinstance(out, Output)
    assert type(out.hidden) is torch.Tensor and out.hidden.shape == (n, 2, 4)  # a plain tensor, not a vmap leftover
    with torch.no_grad():
        torch.testing.assert_close(out.hidden, torch.stack([m(x).hidden for m in members]))
        torch.testing.assert_close(out.logits, torch.stack([m(x).logits for m in members]))
    assert executor.verify(plan, members, (x,)).ok


class NoParams(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2


def test_parameter_free_model_still_returns_n_first():
    x = torch.randn(2, 3)
    plan = planner.propose(planner.trace(NoParams(), (x,)), 4)
    out = executor.build(plan, [NoParams() for _ in range(4)])(x)
    assert out.shape == (4, 2, 3)
    torch.testing.assert_close(out, (torch.tanh(x) * 2).expand(4, 2, 3))


def test_inplace_buffer_update_runs_before_its_readers():
    """The excluded add_ stage must run before the stage that reads the updated buffer."""
    n = 2
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    reference = RunningTotal().eval()
    graph = planner.trace(reference, (x,))
    assert torch.equal(reference.total, torch.zeros(4)), "tracing must not run the model's in-place updates"
    plan = planner.propose(graph, n)
    members = [RunningTotal().eval() for _ in range(n)]
    loop_members = [RunningTotal().eval() for _ in range(n)]
    for a, b in zip(members, loop_members):
        b.load_state_dict(a.state_dict())
    module = executor.build(plan, members)
    with torch.no_grad():
        for _ in range(2):  # the update persists across calls, as in the loop
            got = module(x)
            want = torch.stack([m(x) for m in loop_members])
            torch.testing.assert_close(got, want)


# --- refusals -------------------------------------------------------------------------

def test_wrong_member_count(sample):
    src, _, plan = plan_for(sample, "mlp", 3)
    with pytest.raises(MemberError, match=r"plan is for 3 members but 2 were given.*with_n_members\(2\)"):
        executor.build(plan, src.members(2))
    with pytest.raises(MemberError, match="but 0 were given"):
        executor.build(plan, [])


def test_n_below_one(sample):
    _, _, plan = plan_for(sample, "mlp", 3)
    with pytest.raises(planner.StagewiseError, match="n_members must be an integer >= 1"):
        plan.with_n_members(0)


def test_members_with_mismatching_state(sample, write_model):
    src, _, plan = plan_for(sample, "mlp", 3)
    members = src.members(3)
    members[2].fc1 = nn.Linear(64, 128, bias=False)
    with pytest.raises(MemberError, match=r"member 2 does not match member 0: missing \['fc1.bias'\]"):
        executor.build(plan, members)
    members = src.members(3)
    members[1].fc2.weight = nn.Parameter(members[1].fc2.weight.double())
    with pytest.raises(MemberError, match=r"member 1 has fc2.weight of shape \[64, 128\] torch.float64.*share one architecture"):
        executor.build(plan, members)


def test_plan_for_another_model(sample):
    _, _, plan = plan_for(sample, "mlp", 2)
    other_src, other_graph = sample("deep_mlp")
    with pytest.raises(PlanMismatchError) as info:
        executor.build(plan, other_src.members(2))
    msg = str(info.value)
    assert plan.fingerprint in msg and other_graph.fingerprint in msg
    assert "first plan node the model lacks" in msg and "re-plan" in msg


def test_plan_for_same_names_other_shapes(sample):
    _, _, plan = plan_for(sample, "mlp", 2)
    src, _ = sample("mlp")
    wide = src.members(2)
    for m in wide:
        m.fc1, m.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
    with pytest.raises(PlanMismatchError, match="parameter shapes, dtypes or module types differ"):
        executor.build(plan, wide)


def test_export_plans_build_from_the_recorded_input_shapes(sample):
    src, _, plan = plan_for(sample, "shape_loop", 2)
    assert plan.tracer == "export"
    module = executor.build(plan, src.members(2))  # no example_inputs: the plan records shapes and dtypes
    assert module(*src.example_inputs).shape == (2, 8, 32)
    old_file = dataclasses.replace(plan, inputs=tuple(planner.InputSpec(i.name, i.mode) for i in plan.inputs))
    with pytest.raises(planner.TraceError, match="example_inputs="):  # a plan file from before shapes were recorded
        executor.build(old_file, src.members(2))
    module = executor.build(old_file, src.members(2), example_inputs=src.example_inputs)
    assert module(*src.example_inputs).shape == (2, 8, 32)


def test_per_member_input_needs_the_member_axis(sample):
    src, _, plan = plan_for(sample, "mlp", 3, "per_member")
    module = executor.build(plan, src.members(3))
    x = src.example_inputs[0]
    with pytest.raises(InputError, match=r"input 'x' is per_member.*leading member axis of size 3; got \[32, 64\]"):
        module(x)
    with pytest.raises(InputError, match="size 3; got \\[2, 32, 64\\]"):
        module(torch.stack([x, x]))
    with pytest.raises(InputError, match="got float"):
        module(1.0)


def test_wrong_number_of_inputs(sample):
    src, _, plan = plan_for(sample, "mlp", 2)
    module = executor.build(plan, src.members(2))
    with pytest.raises(InputError, match=r"takes 1 inputs \['x'\], got 2"):
        module(src.example_inputs[0], src.example_inputs[0])


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_wrong_input_shape(sample, mode):
    src, _, plan = plan_for(sample, "mlp", 2, mode)
    module = executor.build(plan, src.members(2))
    bad = torch.randn(2, 32, 63) if mode == "per_member" else torch.randn(32, 63)
    with pytest.raises(InputError) as info:
        module(bad)
    msg = str(info.value)
    assert "x" in msg and "63" in msg and "example_inputs" in msg


def test_hand_ordered_plan_file_still_runs(sample):
    """A plan file may list its stages in any order; they still run in dependency order."""
    src, graph, plan = plan_for(sample, "data_dependent", 2)
    shuffled = plan.with_stages(reversed(plan.stages))
    shuffled = planner.Plan.loads(shuffled.dumps())
    members = src.members(2)
    got = executor.build(shuffled, members)(*src.example_inputs)
    torch.testing.assert_close(got, executor.build(plan, members)(*src.example_inputs))


def test_unknown_device_is_refused(sample):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    src, _, plan = plan_for(sample, "mlp", 2)
    with pytest.raises(planner.DeviceError, match="no CUDA device; use device='cpu'"):
        executor.build(plan, src.members(2), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlp", "data_dependent", "transformer_block", "shape_loop"])
def test_cuda_matches_loop(sample, name):
    src, _, plan = plan_for(sample, name, 4, "per_member")
    members = [m.cuda() for m in src.members(4)]
    inputs = tuple(x.cuda() for x in executor.batched_inputs(plan, src.example_inputs))
    report = executor.verify(plan, members, inputs, device="cuda")
    assert report.ok, report.to_text()
    module = executor.build(plan, members, example_inputs=tuple(x[0] for x in inputs), device="cuda")
    assert module(*inputs).device.type == "cuda"


@pytest.mark.parametrize("carve", [False, True])
def test_inplace_activation_update(carve):
    """An in-place op on an activation, batched or carved out as a loop, keeps the reads on either side right."""
    torch.manual_seed(0)
    members = [ScaleInPlace() for _ in range(3)]
    x = torch.randn(3, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, 3)
    if carve:
        plan = planner.exclude(plan, graph, "mul_")
        assert len(plan.stages) == 3
    late, early = executor.build(plan, members)(x)
    with torch.no_grad():
        torch.testing.assert_close(late, torch.stack([m(x)[0] for m in members]))
        torch.testing.assert_close(early, torch.stack([m(x)[1] for m in members]))


def test_build_leaves_the_members_alone(sample):
    """The batched module owns its state: converting it does not convert member 0 (whose graph it re-traced)."""
    src, _, plan = plan_for(sample, "mlp", 2)
    members = src.members(2)
    module = executor.build(plan, members)
    mine = {id(p) for m in members for p in m.parameters()}
    assert not any(id(p) in mine for p in module.parameters())
    module.double()
    assert all(p.dtype == torch.float32 for m in members for p in m.parameters())
    x = src.example_inputs[0]
    out = module(x.double())
    assert out.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(out.float(), torch.stack([m(x) for m in members]), rtol=RTOL, atol=1e-5)


class TwoInputs(nn.Module):
    """forward(x, y): x [B, 4] and y [B, 3]; y only feeds the second branch."""

    def __init__(self):
        super().__init__()
        self.fx, self.fy = nn.Linear(4, 5), nn.Linear(3, 5)

    def forward(self, x, y):
        return torch.relu(self.fx(x)) * self.fy(y)


@pytest.mark.parametrize("modes", [
    {"x": "shared", "y": "shared"}, {"x": "per_member", "y": "shared"},
    {"x": "shared", "y": "per_member"}, {"x": "per_member", "y": "per_member"},
])
def test_mixed_input_modes(modes):
    n = 3
    torch.manual_seed(0)
    members = [TwoInputs() for _ in range(n)]
    example = (torch.randn(2, 4), torch.randn(2, 3))
    plan = planner.propose(planner.trace(members[0], example), n, input_mode=modes)
    assert {i.name: i.mode.value for i in plan.inputs} == modes
    inputs = executor.batched_inputs(plan, example)
    for (name, mode), x, ex in zip(modes.items(), inputs, example):
        assert x.shape == ((n, *ex.shape) if mode == "per_member" else ex.shape)
    out = executor.build(plan, members)(*inputs)
    with torch.no_grad():
        want = torch.stack([m(*executor.member_inputs(plan, inputs, i)) for i, m in enumerate(members)])
    torch.testing.assert_close(out, want)
    assert executor.verify(plan, members, inputs).ok


def test_batched_inputs_differ_per_member(sample):
    src, _, plan = plan_for(sample, "mlp", 4, "per_member")
    (x,) = executor.batched_inputs(plan, src.example_inputs)
    assert x.shape == (4, 32, 64)
    assert all(not torch.equal(x[i], x[j]) for i in range(4) for j in range(i))
    assert torch.equal(executor.batched_inputs(plan, src.example_inputs)[0], x)  # seeded
    shared = plan.with_input_modes({"x": "shared"})
    assert executor.batched_inputs(shared, src.example_inputs)[0] is src.example_inputs[0]


@pytest.mark.parametrize("options", [{"chunk_size": 2}, {"strategy": "loop"}])
def test_stage_options_keep_results(sample, options):
    src, graph, plan = plan_for(sample, "transformer_block", 5, "per_member")
    for stage in ("s0", "s2"):
        plan = planner.set_options(plan, graph, stage, **options)
    report = executor.verify(plan, src.members(5), executor.batched_inputs(plan, src.example_inputs))
    assert report.ok, report.to_text()


def test_verify_reports_a_real_mismatch(sample):
    """The comparison can fail: a member changed after building (its state was stacked) disagrees."""
    src, _, plan = plan_for(sample, "mlp", 2)
    members = src.members(2)
    report = executor.verify(plan, members, src.example_inputs, rtol=-1.0)
    assert not report.ok and "MISMATCH" in report.to_text()
    module = executor.build(plan, members)
    with torch.no_grad():
        members[1].fc2.bias.add_(1.0)
        got = module(*src.example_inputs)
        want = torch.stack([m(*src.example_inputs) for m in members])
    rows = compare("out", got, want, RTOL)
    assert not rows[0].ok and rows[0].max_abs == pytest.approx(1.0, rel=1e-5)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.fc2.weight = self.fc1.weight  # one parameter used by two layers

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class PassThrough(nn.Module):
    """Returns its input, a value using a plain (non-state) tensor attribute, and a buffer as they are."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(4))
        self.c = torch.ones(4)

    def forward(self, x):
        return x, self.fc(x) + self.c, self.b


@pytest.mark.parametrize("cls", [Tied, PassThrough])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_unusual_state_and_outputs(cls, mode):
    torch.manual_seed(0)
    members = [cls() for _ in range(3)]
    x = torch.randn(2, 4)
    plan = planner.propose(planner.trace(members[0], (x,)), 3, input_mode=mode)
    inputs = executor.batched_inputs(plan, (x,))
    report = executor.verify(plan, members, inputs)
    assert report.ok, report.to_text()
    out = executor.build(plan, members)(*inputs)
    leaves = out if isinstance(out, tuple) else (out,)
    assert all(t.shape[0] == 3 for t in leaves)


def test_verify_with_buffer_updates_is_fair_and_leaves_members_alone():
    """Loop and recorder runs start from the same buffers, and verify undoes the members' updates."""
    torch.manual_seed(0)
    members = [RunningTotal().eval() for _ in range(2)]
    x = torch.randn(3, 4)
    plan = planner.propose(planner.trace(members[0], (x,)), 2)
    report = executor.verify(plan, members, (x,))
    assert report.ok, report.to_text()
    assert any(r.name == "add" for r in report.boundaries)
    assert all(torch.equal(m.total, torch.zeros(4)) for m in members)


class InPlaceIntoShared(nn.Module):
    """`h` is computed from the shared input only, then a member-specific value is added into it in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = x * 1.0
        h.add_(self.fc(x))
        return h


class InPlaceAcross(InPlaceIntoShared):
    def forward(self, x):
        h = x * 1.0
        h.add_(self.fc(x))
        return h, h * 2


@pytest.mark.parametrize("cls", [InPlaceIntoShared, InPlaceAcross])
@pytest.mark.parametrize("edit", ["none", "carve", "split"])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_inplace_write_into_a_shared_value(cls, edit, mode):
    """The written value may come from another stage, shared by all members; the update must reach later readers."""
    torch.manual_seed(0)
    members = [cls() for _ in range(3)]
    x = torch.randn(2, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, 3, input_mode=mode)
    assert [s.mode for s in plan.stages] == [StageMode.BATCHED]
    if edit == "carve":
        plan = planner.exclude(plan, graph, "add_")
    elif edit == "split":
        plan = planner.split(plan, graph, "s0", at="add_")
    inputs = executor.batched_inputs(plan, (x,))
    report = executor.verify(plan, members, inputs)
    assert report.ok, report.to_text()
