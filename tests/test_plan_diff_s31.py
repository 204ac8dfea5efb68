"""planner.diff_plans / `stagewise diff` compare every plan field that changes what runs (review s31, R4 F4).

Two plans that differed only in a wide stage's conv form or a compile stage's torch.compile mode (the note tags
autotune writes and the executor reads back), in an input's shape / dtype / dynamic dims / value (which calls the
built module accepts, what build retraces with), in the opened modules, or in the reason an excluded wide / compile
stage runs by, were called identical and `stagewise diff` exited 0.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.app import cli
from stagewise.executor.strategies.compiled import COMPILE_MODES, compile_mode_of, with_compile_mode
from stagewise.executor.strategies.wide import CONV_FORMS, conv_form_of, with_conv_form
from stagewise.planner import ChangeKind
from stagewise.planner.plan import DynamicDim, StageOptions, Strategy

N = 3


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.c(x).mean((2, 3)))


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    graph = planner.trace(ConvNet(), (x,))
    plan = planner.propose(graph, n_members=N, input_mode="shared")
    assert len(plan.stages) == 1
    return graph, plan


def with_options(plan, f):
    return plan.with_stages([replace(s, options=f(s.options)) for s in plan.stages])


def with_input(plan, **changes):
    return replace(plan, inputs=tuple(replace(i, **changes) for i in plan.inputs))


def field_triples(changes):
    return [(f.field, f.old, f.new) for f in changes]


# -- stage kernel choices ---------------------------------------------------------------------------------------


def test_a_wide_conv_form_is_a_change(traced):
    graph, plan = traced
    wide = planner.set_options(plan, graph, "s0", strategy="wide")
    im2col = with_options(wide, lambda o: with_conv_form(o, "im2col"))
    diff = planner.diff_plans(wide, im2col)
    assert not diff.identical
    assert [c.kind for c in diff.stages] == [ChangeKind.CHANGED]
    assert field_triples(diff.stages[0].fields) == [("conv_form", "default", "im2col")]
    assert diff.rows()[0]["details"] == "conv form default → im2col"
    assert diff.summary() == "s0 conv form default → im2col."
    other = with_options(wide, lambda o: with_conv_form(o, "bmm"))
    assert planner.diff_plans(other, im2col).summary() == "s0 conv form bmm → im2col."
    # through the file, as `stagewise diff` reads it
    assert not planner.diff_plans(wide, planner.Plan.loads(im2col.dumps())).identical


def test_a_conv_form_shows_beside_a_strategy_change_and_is_not_read_off_wide(traced):
    graph, plan = traced
    im2col = with_options(planner.set_options(plan, graph, "s0", strategy="wide"), lambda o: with_conv_form(o, "im2col"))
    diff = planner.diff_plans(plan, im2col)
    assert field_triples(diff.stages[0].fields) == [("strategy", "vmap", "wide"), ("conv_form", None, "im2col")]
    assert diff.summary() == "s0 now runs wide (was vmap), conv form none → im2col."
    # the default form adds nothing to the strategy change
    wide = planner.set_options(plan, graph, "s0", strategy="wide")
    assert field_triples(planner.diff_plans(plan, wide).stages[0].fields) == [("strategy", "vmap", "wide")]
    # a vmap stage does not read the tag: a stale one runs alike
    stale = with_options(plan, lambda o: with_conv_form(o, "im2col"))
    assert planner.diff_plans(plan, stale).identical


def test_a_compile_mode_is_a_change(traced):
    graph, plan = traced
    compiled = planner.set_options(plan, graph, "s0", strategy="compile")
    tuned = with_options(compiled, lambda o: with_compile_mode(o, "max-autotune-no-cudagraphs"))
    diff = planner.diff_plans(compiled, tuned)
    assert not diff.identical
    assert field_triples(diff.stages[0].fields) == [("compile_mode", "default", "max-autotune-no-cudagraphs")]
    assert diff.summary() == "s0 compile mode default → max-autotune-no-cudagraphs."
    graphs = with_options(compiled, lambda o: with_compile_mode(o, "reduce-overhead"))
    assert planner.diff_plans(tuned, graphs).summary() == ("s0 compile mode max-autotune-no-cudagraphs → "
                                                           "reduce-overhead.")
    assert planner.diff_plans(tuned, planner.Plan.loads(tuned.dumps())).identical
    # a wide stage does not read a compile tag
    wide = planner.set_options(plan, graph, "s0", strategy="wide")
    assert planner.diff_plans(wide, with_options(wide, lambda o: with_compile_mode(o, "reduce-overhead"))).identical


@pytest.mark.parametrize("note", ["", "vmap 1.2 ms; wide 0.8 ms", "tuned (wide inside the whole-plan graph)"])
def test_the_diff_reads_the_tags_as_the_executor_does(note):
    """The planner cannot import the executor: its tag readers must agree with conv_form_of / compile_mode_of."""
    from stagewise.planner.diff import _compile_mode, _conv_form

    for form in CONV_FORMS + ("",):
        options = with_conv_form(StageOptions(strategy=Strategy.WIDE, note=note), form)
        assert _conv_form(options) == (conv_form_of(options) or "default")
    for mode in COMPILE_MODES:
        options = with_compile_mode(StageOptions(strategy=Strategy.COMPILE, note=note), mode)
        assert _compile_mode(options) == (compile_mode_of(options) or "default")
    # an upper-case hand edit is no tag to either reader
    odd = StageOptions(strategy=Strategy.WIDE, note="[wide: conv=IM2COL]")
    assert conv_form_of(odd) == "" and _conv_form(odd) == "default"


def test_the_reason_an_excluded_wide_stage_runs_by_is_a_change(traced):
    graph, plan = traced
    excluded = planner.exclude(plan, graph, "s0")
    wide = planner.set_options(excluded, graph, "s0", strategy="wide")
    edited = wide.with_stages([replace(s, reason="autocast region (vmap would run it without its autocast)")
                               for s in wide.stages])
    diff = planner.diff_plans(wide, edited)
    assert not diff.identical
    assert field_triples(diff.stages[0].fields) == [
        ("reason", "excluded by user", "autocast region (vmap would run it without its autocast)")]
    assert diff.summary() == ('s0 reason "excluded by user" → "autocast region (vmap would run it without its '
                              'autocast)".')
    # the same parts in another order (two merges' joins) are judged alike
    two = wide.with_stages([replace(s, reason="a batching rule; excluded by user") for s in wide.stages])
    assert planner.diff_plans(two, two.with_stages([replace(s, reason="excluded by user; a batching rule")
                                                    for s in two.stages])).identical
    # the member loop reads no reason, nor does a batched stage: words only
    loop_edited = excluded.with_stages([replace(s, reason="something else") for s in excluded.stages])
    assert planner.diff_plans(excluded, loop_edited).identical
    batched = planner.set_options(plan, graph, "s0", strategy="wide")
    assert planner.diff_plans(batched, batched.with_stages([replace(s, reason="x") for s in batched.stages])).identical


# -- plan level ---------------------------------------------------------------------------------------------------


def test_input_specs_are_compared(traced):
    _, plan = traced
    spec = plan.inputs[0]
    assert spec.shape == (2, 3, 8, 8) and spec.dtype == "float32" and spec.dynamic_dims
    dims_text = ", ".join(str(d.dim) for d in spec.dynamic_dims)
    cases = [
        (with_input(plan, shape=(4, 3, 8, 8)), ("input x shape", [2, 3, 8, 8], [4, 3, 8, 8]),
         "input x shape [2, 3, 8, 8] → [4, 3, 8, 8]"),
        (with_input(plan, dtype="float64"), ("input x dtype", "float32", "float64"), "input x dtype float32 → float64"),
        (with_input(plan, dynamic_dims=()), ("input x dynamic dims", [d.to_json() for d in spec.dynamic_dims], []),
         f"input x dynamic dims {dims_text} → none"),
        (with_input(plan, dynamic_dims=(DynamicDim(0, min=2, max=64, symbol="d0"),)),
         ("input x dynamic dims", [d.to_json() for d in spec.dynamic_dims],
          [{"dim": 0, "min": 2, "max": 64, "symbol": "d0"}]),
         f"input x dynamic dims {dims_text} → 0 (min 2, max 64, symbol d0)"),
    ]
    for other, triple, words in cases:
        for b in (other, planner.Plan.loads(other.dumps())):  # as built, and through the file
            diff = planner.diff_plans(plan, b)
            assert not diff.identical
            assert field_triples(diff.plan_changes) == [triple]
            assert diff.summary() == f"{words}; 1 stage unchanged."
            assert [c.kind for c in diff.stages] == [ChangeKind.SAME]


def test_an_input_value_and_the_opened_modules_are_compared(traced):
    _, plan = traced
    scaled = replace(plan, inputs=plan.inputs + (planner.InputSpec("scale", dtype="int", value=2),))
    other = replace(scaled, inputs=scaled.inputs[:1] + (replace(scaled.inputs[1], value=3),))
    diff = planner.diff_plans(scaled, other)
    assert field_triples(diff.plan_changes) == [("input scale value", 2, 3)]
    assert diff.summary() == "input scale value 2 → 3; 1 stage unchanged."
    # an input only one plan holds is its mode change only (as before), not a list of nones
    assert field_triples(planner.diff_plans(plan, scaled).plan_changes) == [("input scale", None, "shared")]
    opened = replace(plan, opened_modules=("c", "fc"))
    diff = planner.diff_plans(plan, opened)
    assert field_triples(diff.plan_changes) == [("opened_modules", [], ["c", "fc"])]
    assert diff.summary() == "opened modules none → c, fc; 1 stage unchanged."


class Counted(nn.Module):
    """A buffer written in forward(): the planner traces it with torch.export, whose plans check each call's inputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


def test_the_dynamic_dims_decide_which_calls_run():
    """Why they count: the export plan with the batch dim fixed refuses a call the proposed plan runs as the loop does."""
    torch.manual_seed(1)
    graph = planner.trace(Counted(), (torch.randn(2, 4),))
    plan = planner.propose(graph, n_members=N)
    assert plan.tracer == "export" and plan.inputs[0].dynamic_dim(0) is not None
    fixed = with_input(plan, dynamic_dims=())
    diff = planner.diff_plans(plan, fixed)
    assert field_triples(diff.plan_changes) == [("input x dynamic dims", [plan.inputs[0].dynamic_dims[0].to_json()], [])]
    members = [Counted() for _ in range(N)]
    x = torch.randn(5, 4)
    loop = [Counted() for _ in range(N)]
    for m, ref in zip(members, loop):
        ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(executor.build(plan, members)(x), torch.stack([m(x) for m in loop]), rtol=1e-6, atol=1e-6)
    with pytest.raises(planner.StagewiseError, match="size 5 at dim 0"):
        executor.build(fixed, members)(x)


def test_to_json_keeps_the_values_plain(traced):
    graph, plan = traced
    wide = planner.set_options(plan, graph, "s0", strategy="wide")
    other = with_input(with_options(wide, lambda o: with_conv_form(o, "im2col")), shape=(4, 3, 8, 8))
    d = json.loads(json.dumps(planner.diff_plans(wide, other).to_json()))
    assert d["identical"] is False
    assert d["plan_changes"] == [{"field": "input x shape", "old": [2, 3, 8, 8], "new": [4, 3, 8, 8]}]
    assert d["stages"][0]["change"] == "changed" and d["stages"][0]["details"] == "conv form default → im2col"


# -- the CLI ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit", ["conv form", "compile mode", "dynamic dims"])
def test_cli_diff_exits_1_for_plans_that_run_otherwise(traced, tmp_path, capsys, edit):
    graph, plan = traced
    if edit == "conv form":
        a = planner.set_options(plan, graph, "s0", strategy="wide")
        b = with_options(a, lambda o: with_conv_form(o, "im2col"))
        first = "s0 conv form default → im2col."
    elif edit == "compile mode":
        a = planner.set_options(plan, graph, "s0", strategy="compile")
        b = with_options(a, lambda o: with_compile_mode(o, "max-autotune-no-cudagraphs"))
        first = "s0 compile mode default → max-autotune-no-cudagraphs."
    else:
        a, b = plan, with_input(plan, dynamic_dims=())
        dims = ", ".join(str(d.dim) for d in plan.inputs[0].dynamic_dims)
        first = f"input x dynamic dims {dims} → none; 1 stage unchanged."
    pa, pb = a.save(tmp_path / "a.json"), b.save(tmp_path / "b.json")
    code = cli.main(["diff", str(pa), str(pb)])
    out, err = capsys.readouterr()
    assert code == 1 and err == ""
    assert out.splitlines()[0] == first
    assert cli.main(["diff", str(pa), str(pa)]) == 0
    capsys.readouterr()
