"""wide's convolution forms (wide_layers.CONV_FORMS): each one against the member loop.

Every form runs every member's own Conv1d/Conv2d; the reference is each member module
called on its own input. float32, tight tolerance (normwise per member).
"""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.baselines import stack_outputs
from stagewise.executor.candidates import max_rel_error
from stagewise.executor.strategies import WideRunner
from stagewise.executor.strategies.wide import conv_form_of, wide_conv_forms, with_conv_form
from stagewise.executor.strategies.wide_layers import CONV_FORMS, conv, conv_forms, default_conv_form
from stagewise.executor.strategies.wide_ops import NFirst
from stagewise.planner.errors import PlanFileError
from stagewise.planner.plan import StageOptions, Strategy

autotune_module = importlib.import_module("stagewise.executor.autotune")

RTOL = 2e-6  # float32: the forms sum the same products in another order
CPU = torch.device("cpu")

CONV2D = {  # name -> kwargs of nn.Conv2d(in=8, out=6, ...)
    "3x3 pad1": dict(kernel_size=3, padding=1),
    "1x1 pointwise": dict(kernel_size=1),
    "1x1 stride2": dict(kernel_size=1, stride=2),
    "3x3 stride2 no bias": dict(kernel_size=3, stride=2, padding=1, bias=False),
    "5x3 dilation2 pad(2,1)": dict(kernel_size=(5, 3), dilation=2, padding=(2, 1)),
    "groups2": dict(kernel_size=3, padding=1, groups=2),
    "depthwise": dict(kernel_size=3, padding=1, groups=8, out_channels=8),
    "padding same": dict(kernel_size=3, padding="same"),
}
CONV1D = {
    "k3 pad1": dict(kernel_size=3, padding=1),
    "k1": dict(kernel_size=1),
    "k5 stride2 dilation2": dict(kernel_size=5, stride=2, dilation=2, padding=2),
    "groups2 no bias": dict(kernel_size=3, groups=2, bias=False),
}


def members_of(cls, n: int, **kw) -> list[nn.Module]:
    kw = dict(kw)
    out_c = kw.pop("out_channels", 6)
    torch.manual_seed(0)
    return [cls(8, out_c, **kw).eval() for _ in range(n)]


def stacked_state(members: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([m.state_dict()[k] for m in members]) for k in members[0].state_dict()}


def loop(members, x, per_member: bool) -> torch.Tensor:
    return torch.stack([m(x[i] if per_member else x) for i, m in enumerate(members)])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    n = want.shape[0]
    g, w = got.double().reshape(n, -1), want.double().reshape(n, -1)
    return float(((g - w).abs().amax(1) / w.abs().amax(1)).max())


def run_form(members, x, per_member: bool, form: str) -> torch.Tensor:
    n = len(members)
    out = conv(members[0], stacked_state(members), (NFirst(x) if per_member else x,), {}, n, form)
    assert isinstance(out, NFirst)
    return out.t


CASES = [(nn.Conv2d, name, kw, (4, 8, 9, 11)) for name, kw in CONV2D.items()] + \
        [(nn.Conv1d, name, kw, (4, 8, 13)) for name, kw in CONV1D.items()]


@pytest.mark.parametrize("form", CONV_FORMS)
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per_member"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("cls, name, kw, shape", CASES, ids=[f"{c.__name__} {name}" for c, name, _, _ in CASES])
def test_every_conv_form_matches_the_member_loop(cls, name, kw, shape, n, per_member, form):
    members = members_of(cls, n, **kw)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((n, *shape) if per_member else shape, generator=g)
    with torch.no_grad():
        want = loop(members, x, per_member)
        got = run_form(members, x, per_member, form)
    assert got.shape == want.shape
    assert rel_err(got, want) <= RTOL, (name, form)


def test_conv_forms_offered_fit_the_module_and_device():
    assert conv_forms(nn.Conv2d(4, 4, 3), CPU) == ["loop", "grouped", "grouped_nhwc"]
    assert conv_forms(nn.Conv2d(4, 4, 1), CPU) == ["loop", "grouped", "grouped_nhwc", "bmm"]
    assert conv_forms(nn.Conv1d(4, 4, 1), CPU) == ["loop", "grouped", "bmm"]  # no channels_last for 1-d
    assert conv_forms(nn.Conv2d(4, 4, 1, stride=2), CPU) == ["loop", "grouped", "grouped_nhwc"]  # bmm: pointwise only
    assert conv_forms(nn.Conv2d(4, 4, 1, groups=2), CPU) == ["loop", "grouped", "grouped_nhwc"]
    cuda = conv_forms(nn.Conv2d(4, 4, 3), torch.device("cuda"))
    assert cuda == ["grouped", "loop", "grouped_nhwc", "im2col", "grouped_bench", "grouped_nhwc_bench"]
    assert "im2col" not in conv_forms(nn.Conv2d(4, 4, 3, padding="same"), torch.device("cuda"))
    assert default_conv_form(CPU) == "loop"


def test_the_form_is_recorded_in_the_options_and_read_back():
    options = with_conv_form(StageOptions(strategy=Strategy.WIDE, note="autotune chose wide/conv=bmm"), "bmm")
    assert conv_form_of(options) == "bmm" and options.note.endswith("[wide: conv=bmm]")
    again = with_conv_form(options, "grouped_nhwc")
    assert conv_form_of(again) == "grouped_nhwc" and again.note.count("[wide:") == 1
    assert conv_form_of(with_conv_form(again, "")) == ""
    assert conv_form_of(StageOptions.from_json(again.to_json())) == "grouped_nhwc"  # the plan JSON keeps it
    with pytest.raises(PlanFileError, match="unknown wide conv form"):
        conv_form_of(StageOptions(strategy=Strategy.WIDE, note="[wide: conv=fft]"))


def wide_plan(sample, name: str, n: int, mode: str, form: str):
    src, graph = sample(name)
    plan = planner.propose(graph, n, mode)
    stages = [s.__class__(s.id, s.nodes, s.mode, s.reason, with_conv_form(StageOptions(strategy=Strategy.WIDE), form))
              for s in plan.stages]
    return src, graph, plan.with_stages(stages)


@pytest.mark.parametrize("form", ["grouped", "grouped_nhwc", "im2col"])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("name", ["cnn", "resblock"])
def test_a_plan_with_a_conv_form_builds_it_and_matches_the_loop(sample, name, mode, form):
    src, graph, plan = wide_plan(sample, name, 3, mode, form)
    plan = planner.Plan.loads(plan.dumps())  # what a saved plan rebuilds
    module = executor.build(plan, src.members(3))
    runners = [r for r in module.runners if isinstance(r, WideRunner)]
    assert runners
    for runner in runners:
        rules = [entry[1] for entry in runner._calls.values() if len(entry) == 3 and isinstance(entry[0], nn.Conv2d)]
        assert rules and all(getattr(rule, "keywords", {}).get("form") == form for rule in rules)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    with torch.no_grad():
        got = module(*inputs)
    want = stack_outputs(executor.loop_outputs(plan, src.members(3), inputs))
    assert max_rel_error(got, want) <= 1e-5


class FakeTimer:
    """Stands in for autotune's time_candidates: label -> ms (the candidates still run and are checked)."""

    def __init__(self, times: dict[str, list[float]]):
        self.times, self.rounds = times, {}

    def __call__(self, cands, device, repeats, warmup, compiles, **_):
        from stagewise.executor.timing import Timing

        for label, (res, call) in cands.items():
            call()
            k = self.rounds[label] = self.rounds.get(label, 0) + 1
            ms = self.times[label][min(k - 1, len(self.times[label]) - 1)]
            res.time = Timing(ms, ms, ms, ms, 1)


def test_autotune_tries_each_conv_form_and_the_plan_reproduces_the_choice(sample, monkeypatch):
    """The forms are candidates of their own ("wide/conv=bmm", ...); the winner is recorded in the plan."""
    src, graph = sample("resblock")
    plan = planner.propose(graph, 3)
    module = executor.build(plan, src.members(3))
    forms = wide_conv_forms(module.programs[0], CPU)
    assert forms == ["loop", "grouped", "grouped_nhwc"]  # 3x3 convs: no bmm form
    timer = FakeTimer({"vmap": [3.0], "wide": [2.0], "loop": [4.0], "wide/conv=grouped": [2.5], "wide/conv=grouped_nhwc": [1.0]})
    monkeypatch.setattr(autotune_module, "time_candidates", timer)
    tuned, found = autotune_module.tune(plan, src.members(3), src.example_inputs, strategies=["vmap", "wide", "loop"], repeats=3)
    (stage,) = tuned.stages
    assert timer.rounds
    assert {r.strategy for r in found["s0"]} == {"vmap", "wide", "loop", "wide/conv=grouped", "wide/conv=grouped_nhwc"}
    assert all(r.ok for r in found["s0"])  # each form ran and matched the loop before it was timed
    assert stage.options.strategy is Strategy.WIDE and conv_form_of(stage.options) == "grouped_nhwc"
    assert timer.rounds["wide/conv=grouped_nhwc"] == 1  # the others were > CLOSE slower: no second round
    again = planner.Plan.loads(tuned.dumps())
    assert conv_form_of(again.stage("s0").options) == "grouped_nhwc"
    runner = executor.build(again, src.members(3)).runners[0]
    assert isinstance(runner, WideRunner)
    assert executor.verify(again, src.members(3), src.example_inputs).ok, "the tuned plan, rebuilt from JSON"


class ConvThenGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.gn = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.gn(self.c(x))


@pytest.mark.parametrize("split", [False, True])
def test_a_channels_last_conv_form_before_a_norm_vmap_runs_matches_the_loop(split):
    """Was: "NYI: querying is_contiguous inside of vmap for memory_format other than torch.contiguous_format" when
    GroupNorm (no wide rule) ran under vmap on grouped_nhwc's rows, in the same wide stage or a vmap stage after it."""
    torch.manual_seed(0)
    members = [ConvThenGroupNorm().eval() for _ in range(3)]
    x = torch.randn(2, 3, 6, 6)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=3)
    if split:
        plan = planner.split(plan, graph, "s0", at="gn")
    plan = planner.set_options(plan, graph, "s0", strategy="wide", note="[wide: conv=grouped_nhwc]")
    ens = executor.build(plan, members)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["loop", "grouped", "grouped_nhwc", "bmm"])
def test_every_conv_form_takes_an_empty_batch(form):
    """Was: "cannot reshape tensor of 0 elements" for bmm, where the loop returns an empty batch."""
    from dataclasses import replace

    members = [nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU()) for _ in range(3)]
    x = torch.randn(2, 8, 8, 8)
    plan = planner.propose(planner.trace(members[0], (x,)), 3)
    plan = plan.with_stages([replace(s, options=with_conv_form(StageOptions(strategy=Strategy.WIDE), form)) for s in plan.stages])
    with torch.no_grad():
        out = executor.build(plan, members)(torch.randn(0, 8, 8, 8))
    assert out.shape == (3, 0, 16, 8, 8)
