"""The checks themselves (verify, profile, autotune's comparisons with the loop), as review found them reporting
a match for wrong answers, or a mismatch for right ones: output structure and dtype, Python-number outputs,
inputs forward() writes, random draws, members the check cannot tell apart, the capture path of forward()."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import importlib

from stagewise import executor, planner
from stagewise.executor.candidates import max_rel_error
from stagewise.planner.errors import MemberError

verify_module = importlib.import_module("stagewise.executor.verify")  # `executor.verify` is the function

N = 3


def _members(make, seeds=range(N), train=False):
    out = []
    for i in seeds:
        torch.manual_seed(i)
        out.append(make().train(train))
    return out


def _plan(members, example, mode="shared"):
    return planner.propose(planner.trace(copy.deepcopy(members[0]), example), n_members=N, input_mode=mode)


# --- structure and dtype of outputs --------------------------------------------------------------------------

def test_outputs_in_another_structure_or_dtype_are_a_mismatch():
    """Was: only the leaves were compared; {'a': t} against {'b': t}, or a float32 output where the loop returns
    float64, matched."""
    t = torch.ones(N, 2)
    report = verify_module.VerifyReport(n_members=N, rtol=1e-4)
    verify_module._compare_outputs(report, {"a": t}, [{"b": t[i]} for i in range(N)], "")
    verify_module._compare_outputs(report, t.float(), [t[i].double() for i in range(N)], "")
    assert [r.ok for r in report.outputs] == [False, False]
    assert "'b'" in report.outputs[0].name and "float32, the loop's float64" in report.outputs[1].name
    assert max_rel_error({"a": t}, {"b": t}) == math.inf and max_rel_error(t.float(), t.double()) == math.inf


def test_python_number_comparisons_take_nans_and_other_types():
    """Was: a str against a float raised TypeError, and two NaN floats counted as a mismatch."""
    assert verify_module.same_number(float("nan"), float("nan"), 1e-4)
    assert not verify_module.same_number("a", 1.0, 1e-4) and not verify_module.same_number(1.0, float("nan"), 1e-4)
    assert verify_module.same_number(1.00001, 1.0, 1e-4) and not verify_module.same_number(True, 1, 1e-4)


class ListAndDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        y = self.l(x)
        return [y, y.double().sum(-1)]


def test_a_list_output_comes_back_a_list_and_a_float64_output_stays_float64_in_bfloat16():
    """Was: fx's immutable_list came back (it cannot be changed), and a bfloat16 plan cast float64 outputs to float32."""
    members = _members(ListAndDouble)
    x = torch.randn(4, 8)
    plan = planner.set_dtype(_plan(members, (x,)), "bfloat16")
    with torch.no_grad():
        out = executor.build(plan, members)(x)
    assert type(out) is list and out[0].dtype == torch.float32 and out[1].dtype == torch.float64
    assert executor.verify(plan, members, (x,)).ok


class ItemOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x), x.abs().mean().item()


def test_a_python_float_output_is_judged_at_the_plans_tolerance():
    """Was: judged at float32's 1e-4 in a bfloat16 plan, so profile said "wrong result" and autotune raised."""
    members = _members(ItemOut)
    x = torch.randn(4, 8)
    plan = planner.set_dtype(_plan(members, (x,)), "bfloat16")
    assert executor.verify(plan, members, (x,)).ok
    tuned = executor.autotune(plan, members, (x,), budget="quick", strategies=["vmap", "loop"])
    assert len(tuned.stages) >= 1
    assert max_rel_error((torch.ones(2), 0.7969), (torch.ones(2), 0.7954)) == pytest.approx(0.0015 / 0.7954, rel=1e-3)


# --- inputs forward() writes in place --------------------------------------------------------------------------

class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, a):
        a.mul_(4)
        return self.l(a)


def test_a_per_member_input_written_in_place_is_checked_on_copies():
    """Was: the batched run wrote the caller's tensor, then the loop ran on the written one: verify MISMATCH (0.5),
    profile "wrong result", autotune raised, and verify left the caller's input multiplied by 64."""
    members = _members(WritesInput)
    x = torch.randn(N, 4, 8)
    before = x.clone()
    plan = _plan(members, (x[0],), mode="per_member")
    torch.testing.assert_close(x, before)  # the trace ran the model on a copy of its example
    assert executor.verify(plan, members, (x,)).ok
    torch.testing.assert_close(x, before)
    report = executor.profile(plan, members, (x,), repeats=2, baselines=False)
    assert report.end_to_end.ok, report.end_to_end.error
    executor.autotune(plan, members, (x,), budget="quick", strategies=["vmap", "loop"])


# --- random draws -------------------------------------------------------------------------------------------

class Dropped(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.fc1, self.fc2, self.twice = nn.Linear(8, 8), nn.Linear(8, 8), twice
        self.d1, self.d2 = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x):
        h = self.fc2(self.d1(torch.relu(self.fc1(x))))
        return self.d2(h) if self.twice else h


def test_one_stage_drawing_random_numbers_matches_from_one_seed_and_leaves_the_callers_stream():
    """Was: verify said MISMATCH and autotune raised "the tuned plan differs ... report this" for any Dropout in
    training: the batched module and the loop drew from different random states."""
    members = _members(Dropped, train=True)
    x = torch.randn(4, 8)
    plan = _plan(members, (x,))
    torch.manual_seed(7)
    report = executor.verify(plan, members, (x,))
    after = torch.rand(1)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(1))  # verify drew from its own seeded state, not the caller's
    assert report.ok, report.to_text()
    executor.autotune(plan, members, (x,), budget="quick", strategies=["vmap", "wide", "loop"])


def test_several_stages_drawing_random_numbers_are_named_as_the_cause_and_autotune_keeps_the_stages():
    members = _members(lambda: Dropped(twice=True), train=True)
    x = torch.randn(4, 8)
    plan = _plan(members, (x,))
    report = executor.verify(plan, members, (x,))
    assert not report.ok and any("draw random numbers" in n and "eval mode" in n for n in report.notes)
    tuned = executor.autotune(plan, members, (x,), budget="quick", strategies=["vmap", "wide", "loop"])
    assert [s.nodes for s in tuned.stages] == [s.nodes for s in plan.stages]
    assert all("end to end not compared" in s.options.note for s in tuned.stages)
    for m in members:
        m.eval()
    assert executor.verify(plan, members, (x,)).ok  # in eval mode nothing is drawn


# --- members the check cannot tell apart ----------------------------------------------------------------------

def test_identical_members_are_noted():
    members = _members(lambda: nn.Linear(8, 8), seeds=[0, 0, 1])
    x = torch.randn(4, 8)
    report = executor.verify(_plan(members, (x,)), members, (x,))
    assert report.ok and any(n.startswith("members 0 and 1 give the same outputs") for n in report.notes)
    distinct = _members(lambda: nn.Linear(8, 8))
    assert not any("same outputs" in n for n in executor.verify(_plan(distinct, (x,)), distinct, (x,)).notes)


# --- forward(), where a whole-plan capture replays ------------------------------------------------------------

def test_later_calls_are_checked_through_forward(monkeypatch):
    """Was: every call ran stage by stage (run_stages), past a whole-plan capture's replay, so a wrong replay
    passed. A replay standing in here answers 123 everywhere."""
    build_module = importlib.import_module("stagewise.executor.build")

    class WrongReplay:
        def __init__(self, ens, backend=None):
            self.ens = ens

        def __call__(self, *inputs):
            return self.ens.run_stages(*inputs)[0] * 0 + 123.0

    monkeypatch.setattr(build_module, "capture_backend", lambda device: object())
    monkeypatch.setattr(build_module, "CapturedPlan", WrongReplay)
    members = _members(lambda: nn.Linear(8, 8))
    x = torch.randn(4, 8)
    plan = planner.set_capture(_plan(members, (x,)), True)
    report = executor.verify(plan, members, (x,))
    by_name = {r.name: r.ok for r in report.outputs}
    assert not report.ok and by_name["out"] and not by_name["out (call 2)"]  # the first call runs stage by stage


def test_one_small_low_precision_parameter_does_not_loosen_the_check():
    """Was: any bfloat16 parameter gave the whole float32 model bfloat16's rtol (3e-2, 300x looser)."""
    float32 = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    gated = copy.deepcopy(float32)
    gated.register_parameter("gate", nn.Parameter(torch.ones(1, dtype=torch.bfloat16)))
    assert verify_module.members_rtol([gated]) == verify_module.DEFAULT_RTOL
    assert verify_module.members_rtol([copy.deepcopy(float32).to(torch.bfloat16)]) == verify_module.DTYPE_RTOL["bfloat16"]


class TwoFunctionalDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.fc(x), 0.5, self.training)
        return torch.nn.functional.dropout(h * 2, 0.5, self.training)


def test_a_wide_stage_drawing_in_two_ops_is_named_as_the_cause():
    """Was a MISMATCH with no note: wide draws op by op for every member, the loop member by member."""
    members = _members(TwoFunctionalDropouts, train=True)
    x = torch.randn(4, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    while len(plan.stages) > 1:
        plan = planner.merge(plan, graph, plan.stages[0].id, plan.stages[1].id)
    plan = planner.set_options(plan, graph, plan.stages[0].id, strategy="wide")
    report = executor.verify(plan, members, (x,))
    assert not report.ok and any("more than one place" in n for n in report.notes)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)

    def forward(self, x):
        return self.layer(x)


def test_a_compiled_stage_drawing_random_numbers_is_named_as_the_cause():
    """Was a MISMATCH with no note (off by 0.6): a compile stage draws op by op for every member, as wide does."""
    members = _members(EncoderLayer, train=True)
    x = torch.randn(2, 5, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    while len(plan.stages) > 1:
        plan = planner.merge(plan, graph, plan.stages[0].id, plan.stages[1].id)
    plan = planner.set_options(plan, graph, plan.stages[0].id, strategy="compile")
    report = executor.verify(plan, members, (x,), more_inputs=())
    assert not report.ok and any("in one wide or compile stage" in n for n in report.notes), report.to_text()


def test_members_on_other_devices_or_on_meta_are_named_at_build():
    """Was: torch's "Tensor on device meta is not on the expected device cpu!" from deep inside build."""
    members = [torch.nn.Linear(4, 3) for _ in range(3)]
    plan = planner.propose(planner.trace(members[0], (torch.randn(2, 4),)), 3)
    members[1].to("meta")
    with pytest.raises(MemberError, match=r"member 1's weight is on the meta device, which holds no values .* load its weights"):
        executor.build(plan, members)
