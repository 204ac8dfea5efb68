"""Models that used to give a wrong batched answer without a word (issue: no wrong answer, ever).

Each model shows one class of hole. Every test either compares the batched
module with the plain loop over members on several calls and at least two input
shapes, or asserts that a named StagewiseError is raised before anything runs.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor
from stagewise import planner

CALLS = 3


def loop_reference(members, *inputs):
    with torch.no_grad():
        outs = [m(*inputs) for m in members]
    return torch.stack(outs)


def assert_matches_loop(make, inputs_by_call, n=3, build_kwargs=None):
    """Plan member 0, build the plan, and compare with the loop on every call (state carried across calls)."""
    torch.manual_seed(0)
    members = [make(i) for i in range(n)]
    reference = copy.deepcopy(members)
    graph = planner.trace(members[0], inputs_by_call[0])
    plan = planner.propose(graph, n_members=n)
    ens = executor.build(plan, members, **(build_kwargs or {}))
    for call, inputs in enumerate(inputs_by_call):
        with torch.no_grad():
            got = ens(*inputs)
        want = loop_reference(reference, *inputs)
        assert got.shape == want.shape, f"call {call}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"call {call}: {m}")
    return plan, ens


def calls_with_two_shapes(make_input):
    """CALLS inputs at batch 5, then CALLS at batch 7 (state keeps drifting across all of them)."""
    g = torch.Generator().manual_seed(1)
    return [(make_input(5, g),) for _ in range(CALLS)] + [(make_input(7, g),) for _ in range(CALLS)]


# --- 1. state mutated in forward ---------------------------------------------------------------

class RunningMean(nn.Module):
    """A hand-written running mean: `mul_` runs on the real buffer while fx traces (it never enters the graph)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mu", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        self.mu.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.mu


class CountCalls(nn.Module):
    """A tensor counter bumped with no tensor argument: fx executes it at trace time."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.ones(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x) * self.calls


class PythonCounter(nn.Module):
    """A Python-number counter: no trace can repeat it per member."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return self.fc(x) * self.steps


def randn4(b, g):
    return torch.randn(b, 4, generator=g)


@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_state_updated_in_forward_matches_loop_over_calls_and_shapes(cls):
    plan, ens = assert_matches_loop(lambda i: cls(), calls_with_two_shapes(randn4))
    assert plan.tracer == "export"  # fx would have run the update at trace time


@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_tracing_does_not_change_the_model(cls):
    model = cls()
    before = {k: (t.clone(), t._version) for k, t in model.state_dict().items()}
    planner.trace(model, (torch.randn(5, 4),))
    for k, t in model.state_dict().items():
        assert torch.equal(t, before[k][0]), k


def test_python_attribute_changed_in_forward_is_refused():
    model = PythonCounter()
    with pytest.raises(planner.TraceError, match="steps"):
        planner.trace(model, (torch.randn(5, 4),))
    assert model.steps == 0 or model.steps == 1  # fx ran forward once; the refusal says so before any plan exists


def test_verify_runs_several_calls_so_drift_shows():
    torch.manual_seed(0)
    members = [RunningMean() for _ in range(3)]
    x = torch.randn(5, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=3)
    report = executor.verify(plan, members, (x,))
    assert report.ok and report.calls >= 2
    assert all(torch.equal(m.mu, torch.zeros(4)) for m in members)  # verify leaves the members as they were


# --- 3. tied parameters --------------------------------------------------------------------------

class TiedHead(nn.Module):
    """Embedding tied to the output head, with a stage boundary (an `.item()`) between their readers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t):
        h = torch.relu(self.mid(self.emb(t)))
        h = h / (h.abs().max().item() + 1.0)
        return self.head(h)


def tokens(b, g):
    return torch.randint(0, 10, (b,), generator=g)


def test_tied_parameters_reach_every_stage():
    plan, ens = assert_matches_loop(lambda i: TiedHead(), calls_with_two_shapes(tokens))
    assert len(plan.stages) > 1
    state = ens.stacked_state
    assert state["head.weight"] is state["emb.weight"]  # one tensor: an update reaches both readers


def test_tied_parameters_stay_tied_after_in_place_update_and_to():
    torch.manual_seed(0)
    members = [TiedHead() for _ in range(2)]
    graph = planner.trace(members[0], (torch.arange(5),))
    ens = executor.build(planner.propose(graph, n_members=2), members).to(torch.float64)
    with torch.no_grad():
        ens.stacked_state["emb.weight"].mul_(2)
        for m in members:
            m.emb.weight.mul_(2)
    x = torch.arange(6)
    assert ens.stacked_state["head.weight"] is ens.stacked_state["emb.weight"]
    torch.testing.assert_close(ens(x), loop_reference([m.double() for m in members], x))


# --- 2. members that differ in non-tensor attributes (a sweep) -----------------------------------

class Sweep(nn.Module):
    """A slope and a temperature per member: both are baked into an fx or export graph as numbers."""

    def __init__(self, slope: float, temperature: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(slope)
        self.temperature = temperature

    def forward(self, x):
        return self.act(self.fc(x)) / self.temperature


class FunctionalSweep(Sweep):
    def forward(self, x):
        return torch.nn.functional.leaky_relu(self.fc(x), self.act.negative_slope) * (2.0 / self.temperature) + self.temperature


class ShapeSweep(nn.Module):
    """Members differ in a number used as a size: no tensor can stand in for it."""

    def __init__(self, groups: int):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.groups = groups

    def forward(self, x):
        return self.fc(x).reshape(x.shape[0], self.groups, -1).sum(1)


class ScaleAttribute(nn.Module):
    """A plain tensor attribute (not a buffer): a get_attr constant that members hold differently."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = torch.full((4,), scale)

    def forward(self, x):
        return self.fc(x) * self.scale


@pytest.mark.parametrize("cls", [Sweep, FunctionalSweep])
def test_sweep_constants_are_lifted_per_member(cls):
    assert_matches_loop(lambda i: cls(0.05 * (i + 1), 1.0 + i), calls_with_two_shapes(randn4), n=4)


def test_sweep_constants_are_lifted_in_export_graphs():
    class ExportSweep(Sweep):
        def forward(self, x):
            h = self.act(self.fc(x)) / self.temperature
            for _ in range(x.shape[1] // 4):  # fx cannot trace range() of a size: export is used
                h = h * 0.5
            return h

    plan, _ = assert_matches_loop(lambda i: ExportSweep(0.05 * (i + 1), 1.0 + i), [(torch.randn(5, 4),)] * CALLS, n=3)
    assert plan.tracer == "export"


def test_sweep_constants_survive_every_strategy():
    from stagewise.planner.plan import Strategy

    torch.manual_seed(0)
    members = [Sweep(0.1 * (i + 1), 1.0 + i) for i in range(3)]
    x = torch.randn(5, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=3)
    for strategy in (Strategy.VMAP, Strategy.LOOP, Strategy.WIDE):
        edited = plan
        for s in plan.stages:
            edited = planner.set_options(edited, graph, s.id, strategy=strategy)
        ens = executor.build(edited, members)
        with torch.no_grad():
            torch.testing.assert_close(ens(x), loop_reference(members, x), msg=lambda m: f"{strategy}: {m}")


def test_sweep_in_a_number_used_as_a_size_is_refused_naming_it():
    torch.manual_seed(0)
    members = [ShapeSweep(2), ShapeSweep(2), ShapeSweep(4)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    plan = planner.propose(graph, n_members=3)
    with pytest.raises(planner.MemberError, match=r"groups.*member 2: 4|member 2: 4.*groups"):
        executor.build(plan, members)


def test_plain_tensor_attributes_are_per_member():
    assert_matches_loop(lambda i: ScaleAttribute(1.0 + i), calls_with_two_shapes(randn4))


def test_members_in_different_modes_are_refused():
    torch.manual_seed(0)
    members = [Sweep(0.1, 1.0), Sweep(0.1, 1.0).train()]
    graph = planner.trace(members[0].eval(), (torch.randn(5, 4),))
    plan = planner.propose(graph, n_members=2)
    with pytest.raises(planner.MemberError, match="training"):
        executor.build(plan, members)


def test_dropout_rate_differences_do_not_matter_in_eval():
    class Drop(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.fc(x))

    assert_matches_loop(lambda i: Drop(0.1 * i).eval(), calls_with_two_shapes(randn4))


# --- verify: several calls, a second input shape ---------------------------------------------------

class BakedBatch(nn.Module):
    """Bakes the batch size into the graph (fx records the literal 5): the model itself takes no other batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).reshape(5, 2, 2)


def plan_for(cls, x, n=3):
    torch.manual_seed(0)
    members = [cls() for _ in range(n)]
    graph = planner.trace(members[0], (x,))
    return planner.propose(graph, n_members=n), members


def test_verify_compares_a_second_batch_size():
    x = torch.randn(5, 4)
    plan, members = plan_for(RunningMean, x)
    other = executor.resized_inputs(plan, (x,))
    assert other[0].shape == (7, 4) and torch.equal(other[0][:5], x)
    report = executor.verify(plan, members, (x,), more_inputs=[other])
    assert report.ok, report.to_text()
    assert report.shapes == ["[5, 4]", "[7, 4]"]
    assert sum("@ [7, 4]" in r.name for r in report.outputs) == report.calls == 2


def test_verify_notes_a_shape_the_model_itself_cannot_take():
    x = torch.randn(5, 4)
    plan, members = plan_for(BakedBatch, x)
    report = executor.verify(plan, members, (x,), more_inputs=[executor.resized_inputs(plan, (x,))])
    assert report.ok and report.shapes == ["[5, 4]"]
    assert "member loop itself fails" in report.notes[0]


def test_verify_catches_a_batched_module_that_is_wrong_only_at_another_shape(monkeypatch):
    x = torch.randn(5, 4)
    plan, members = plan_for(RunningMean, x)
    real_forward = executor.BatchedModule.forward

    def wrong_at_batch_7(self, *inputs):
        out = real_forward(self, *inputs)
        return out + 1 if inputs[0].shape[0] == 7 else out

    monkeypatch.setattr(executor.BatchedModule, "forward", wrong_at_batch_7)
    report = executor.verify(plan, members, (x,), more_inputs=[executor.resized_inputs(plan, (x,))])
    assert not report.ok
    assert [r.name for r in report.outputs if not r.ok] == ["out @ [7, 4]", "out @ [7, 4] (call 2)"]


@pytest.mark.parametrize("strategy", ["loop", "vmap", "wide"])
def test_new_storage_for_stacked_state_reaches_every_strategy(strategy):
    """`p.data = ...` gives a stacked tensor new storage: loop stages read per-member views of it, which
    must follow (an optimizer's in-place update needs nothing; a replaced tensor must not be missed)."""
    from stagewise.planner.plan import Strategy

    torch.manual_seed(0)
    members = [TiedHead() for _ in range(3)]
    graph = planner.trace(members[0], (torch.arange(5),))
    plan = planner.propose(graph, n_members=3)
    for s in plan.stages:
        if s.mode is planner.StageMode.BATCHED:
            plan = planner.set_options(plan, graph, s.id, strategy=Strategy(strategy))
    ens = executor.build(plan, members)
    x = torch.arange(6)
    with torch.no_grad():
        ens(x)  # runners and caches made
        new = ens.stacked_state["mid.weight"] * 2 + 0.5
        ens.stacked_state["mid.weight"].data = new
        for i, m in enumerate(members):
            m.mid.weight.copy_(new[i])
        torch.testing.assert_close(ens(x), loop_reference(members, x))
