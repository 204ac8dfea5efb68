"""Whole-plan capture (executor.capture): the buffer, lifetime and state rules, checked against the member loop.

Without a GPU the ReplayBackend stands in for the CUDA graph (same static input buffers, same
fixed output tensors, state restored after the capture run); the `gpu` tests capture for real.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.capture import OWN_GRAPHS, ReplayBackend, capture
from stagewise.planner.errors import ExecutionError

from test_silent_mismatch import CountCalls, RunningMean

N = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def built(make, x, strategy=None, device="cpu"):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    reference = copy.deepcopy(members)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=N)
    if strategy is not None:
        plan = plan.with_stages([s.__class__(**{**s.__dict__, "options": planner.StageOptions(strategy=strategy)})
                                 if s.runs_batched else s for s in plan.stages])
    ens = executor.build(plan, members, device=device).eval()
    return ens, [m.to(device).eval() for m in reference]


def loop(reference, x):
    with torch.no_grad():
        return torch.stack([m(x) for m in reference])


def xs(batch, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 8, generator=g).to(device) for _ in range(k)]


@pytest.mark.parametrize("strategy", [None, planner.Strategy.WIDE])
def test_replays_match_the_loop_and_recapture_only_for_a_new_signature(strategy):
    ens, ref = built(MLP, torch.randn(5, 8), strategy)
    cap = capture(ens, backend=ReplayBackend())
    with torch.no_grad():
        for x in xs(5, 3) + xs(7, 2, seed=1) + xs(5, 2, seed=2):
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 2  # batch 5, batch 7; batch 5 again replays the first graph


def test_outputs_are_copies_by_default_and_graph_owned_when_asked():
    ens, ref = built(MLP, torch.randn(5, 8))
    a, b = xs(5, 2)
    with torch.no_grad():
        safe = capture(ens, backend=ReplayBackend())
        first = safe(a)
        safe(b)
        torch.testing.assert_close(first, loop(ref, a), rtol=1e-5, atol=1e-6)  # call 1's result survives call 2
        fast = capture(ens, clone_outputs=False, backend=ReplayBackend())
        first = fast(a)
        second = fast(b)
        assert first is second  # the graph's own tensor: the next call overwrote it
        torch.testing.assert_close(first, loop(ref, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [None, planner.Strategy.WIDE])
def test_state_changed_from_outside_is_seen(strategy):
    ens, ref = built(MLP, torch.randn(5, 8), strategy)
    cap = capture(ens, backend=ReplayBackend())
    x = xs(5, 1)[0]
    with torch.no_grad():
        cap(x)
        for p in ens.parameters():  # an optimizer step, in place
            p.mul_(1.5)
        for m in ref:
            for p in m.parameters():
                p.mul_(1.5)
        torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        assert cap.captures == 2
        ens.load_state_dict({k: v * 0.5 for k, v in ens.state_dict().items()})
        for m in ref:
            m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
        torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        assert cap.captures == 3
        cap(x)
        assert cap.captures == 3  # nothing changed: a replay


@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_state_updated_by_forward_moves_once_per_call(cls):
    x0 = torch.randn(5, 4)
    ens, ref = built(cls, x0)
    cap = capture(ens, backend=ReplayBackend())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(3):  # the warm-up and capture runs must not count
            x = torch.randn(5, 4, generator=g)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    for got, member in zip(ens.member_state_dicts(), ref):
        for k, v in member.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_training_and_gradients_are_refused_with_the_fix():
    ens, _ = built(MLP, torch.randn(5, 8))
    cap = capture(ens, backend=ReplayBackend())
    x = torch.randn(5, 8)
    with pytest.raises(ExecutionError, match="torch.no_grad"):
        cap(x)  # grad enabled and the stacked parameters require grad
    ens.train()
    with torch.no_grad(), pytest.raises(ExecutionError, match=r"\.eval\(\)"):
        cap(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_default_backend_refuses():
    ens, _ = built(MLP, torch.randn(5, 8))
    with pytest.raises(ExecutionError, match="needs the batched module on a CUDA device"):
        capture(ens)


def test_the_oldest_signature_makes_room():
    ens, ref = built(MLP, torch.randn(5, 8))
    cap = capture(ens, max_signatures=2, backend=ReplayBackend())
    with torch.no_grad():
        for batch in (2, 3, 4, 2):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 4 and len(cap._graphs) == 2  # batch 2 was evicted by 4, then captured again


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", [None, planner.Strategy.WIDE])
def test_cuda_graph_of_the_whole_plan_matches_the_loop(strategy):
    ens, ref = built(MLP, torch.randn(5, 8), strategy, device="cuda")
    cap = capture(ens)
    with torch.no_grad():
        for x in xs(5, 3, device="cuda") + xs(7, 2, seed=1, device="cuda"):
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        for p in ens.parameters():
            p.mul_(1.5)
        for m in ref:
            for p in m.parameters():
                p.mul_(1.5)
        x = xs(7, 1, device="cuda")[0]
        torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 3


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_cuda_graph_state_updated_by_forward_moves_once_per_call(cls):
    ens, ref = built(cls, torch.randn(5, 4), device="cuda")
    cap = capture(ens)
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)).cuda()
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)


# --- plans with stages that cannot be captured: maximal runs of capturable stages ------------------

from stagewise.executor.capture import HostSyncDetector, host_sync_in  # noqa: E402
from stagewise.sample_models.data_dependent import DataDependentMLP  # noqa: E402


def _data_dependent(d=16):
    return DataDependentMLP(d=d, d_hidden=24)


def _built_data_dependent():
    torch.manual_seed(0)
    members = [_data_dependent() for _ in range(N)]
    reference = copy.deepcopy(members)
    x = torch.randn(6, 16)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=N)
    return executor.build(plan, members).eval(), [m.eval() for m in reference], plan


def test_the_host_sync_detector_finds_what_a_cuda_graph_cannot_capture():
    x = torch.randn(5)
    found = {name: host_sync_in(f)[1] for name, f in {
        "item": lambda: x.sum().item(), "mask": lambda: x[x > 0], "unique": lambda: torch.unique(x),
        "nonzero": lambda: x.nonzero(), "bool": lambda: bool(x.any()),
        "repeat": lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1, 1])),
        "plain": lambda: (x.relu() * 2).sum(0), "vmap": lambda: torch.func.vmap(lambda a: a * 2)(x),
        "index": lambda: x[torch.tensor([0, 2])]}.items()}
    assert found == {"item": "_local_scalar_dense", "mask": "index", "unique": "_unique2", "nonzero": "nonzero",
                     "bool": "_local_scalar_dense", "repeat": "repeat_interleave", "plain": None, "vmap": None,
                     "index": None}
    assert isinstance(HostSyncDetector(), torch.utils._python_dispatch.TorchDispatchMode)


def test_a_plan_with_host_syncs_replays_its_capturable_runs_between_eager_stages():
    ens, ref, plan = _built_data_dependent()
    cap = capture(ens, backend=ReplayBackend())
    assert cap.layout() == [{"stages": [s.id for s in plan.stages], "mode": "graph", "reason": ""}]  # before a call
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in (6, 6, 9, 6, 9):
            x = torch.randn(batch, 16, generator=g)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    layout = cap.layout()
    modes = [entry["mode"] for entry in layout]
    assert "eager" in modes and "graph" in modes
    eager_ids = {i for entry in layout if entry["mode"] == "eager" for i in entry["stages"]}
    by_id = {s.id: s for s in plan.stages}
    assert all(not by_id[i].runs_batched for i in eager_ids)  # the .item() / branch stages loop over members
    assert all("_local_scalar_dense" in entry["reason"] for entry in layout if entry["mode"] == "eager")
    assert sorted(i for entry in layout for i in entry["stages"]) == sorted(by_id)  # every stage once
    graphs = sum(len(r.graphs) for r in cap._runs)
    assert graphs == 2 * modes.count("graph")  # batch 6 and batch 9, each run; later calls replayed


class Refusing(ReplayBackend):
    """A backend that also refuses to capture `torch.sign`, which the host-sync detector does not know: stands in for
    whatever a real CUDA graph refuses that no detector foresaw."""

    def capture(self, fn, warmup):
        class Spot(torch.utils._python_dispatch.TorchDispatchMode):
            seen = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Spot.seen |= func.overloadpacket is torch.ops.aten.sign
                return func(*args, **(kwargs or {}))

        with Spot():
            fn()
        if Spot.seen:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(fn, warmup)


class SignInTheMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.c(torch.sign(h) * h.abs().sqrt())


def test_a_run_that_fails_to_capture_is_split_and_the_refused_stage_runs_eagerly():
    torch.manual_seed(0)
    members = [SignInTheMiddle() for _ in range(N)]
    ref = [m.eval() for m in copy.deepcopy(members)]
    graph = planner.trace(members[0], (torch.randn(5, 8),))
    plan = planner.propose(graph, n_members=N)
    sign = next(n for s in plan.stages for n in s.nodes if "sign" in n)
    plan = planner.exclude(plan, graph, sign)  # the refused op alone, batched stages either side
    ens = executor.build(plan, members).eval()
    cap = capture(ens, backend=Refusing())
    with torch.no_grad():
        for batch in (5, 5, 3):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    layout = cap.layout()
    eager = [entry for entry in layout if entry["mode"] == "eager"]
    assert len(eager) == 1 and "not permitted" in eager[0]["reason"]
    assert any(entry["mode"] == "graph" for entry in layout)


def test_a_plan_where_nothing_can_be_captured_says_so():
    ens, _ = built(SignInTheMiddle, torch.randn(5, 8))

    class RefuseAll(ReplayBackend):
        def capture(self, fn, warmup):
            raise RuntimeError("operation not permitted when stream is capturing")

    with torch.no_grad(), pytest.raises(ExecutionError, match="no stage of the plan can be captured"):
        capture(ens, backend=RefuseAll())(torch.randn(5, 8))


class CountAfterSync(nn.Module):
    """A buffer updated in forward in a capturable run after an eager (host-sync) stage."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.ones(()))

    def forward(self, x):
        h = self.fc1(x)
        h = h / (h.abs().max().item() + 1.0)
        self.calls.add_(1)
        return self.fc2(h) * self.calls


def test_state_updated_in_a_captured_run_moves_once_per_call():
    ens, ref = built(CountAfterSync, torch.randn(5, 4))
    cap = capture(ens, backend=ReplayBackend())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch in (5, 5, 2, 5):
            x = torch.randn(batch, 4, generator=g)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert any(entry["mode"] == "eager" for entry in cap.layout())
    for got, member in zip(ens.member_state_dicts(), ref):
        torch.testing.assert_close(got["calls"], member.calls)


@pytest.mark.gpu
def test_cuda_graph_runs_around_host_syncs_match_the_loop():
    torch.manual_seed(0)
    members = [_data_dependent() for _ in range(N)]
    ref = [copy.deepcopy(m).cuda().eval() for m in members]
    x = torch.randn(6, 16)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    cap = capture(executor.build(plan, members, device="cuda").eval())
    with torch.no_grad():
        for batch in (6, 6, 9):
            x = torch.randn(batch, 16).cuda()
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert {"eager", "graph"} <= {entry["mode"] for entry in cap.layout()}


# --- the per-stage cuda_graph strategy: the same state rules (checked with the ReplayBackend) ------------

from stagewise.executor.strategies.cudagraph import CudaGraphRunner  # noqa: E402


@pytest.fixture
def replayed_stages(monkeypatch):
    monkeypatch.setattr(CudaGraphRunner, "backend_class", ReplayBackend)


@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_a_cuda_graph_stage_updates_state_once_per_call(replayed_stages, cls):
    ens, ref = built(cls, torch.randn(5, 4), planner.Strategy.CUDA_GRAPH)
    assert any(isinstance(r, CudaGraphRunner) for r in ens.runners)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch in (5, 5, 2, 5):  # a new shape captures again: its warm-up must not count either
            x = torch.randn(batch, 4, generator=g)
            torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    for got, member in zip(ens.member_state_dicts(), ref):
        for k, v in member.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_cuda_graph_stage_sees_weights_given_new_storage(replayed_stages):
    ens, ref = built(MLP, torch.randn(5, 8), planner.Strategy.CUDA_GRAPH)
    x = torch.randn(5, 8)
    with torch.no_grad():
        first = ens(x)
        torch.testing.assert_close(first, loop(ref, x), rtol=1e-5, atol=1e-6)
        y = torch.randn(5, 8)
        torch.testing.assert_close(ens(y), loop(ref, y), rtol=1e-5, atol=1e-6)  # a replay with new inputs
        for p in ens.parameters():
            p.data = p.data * 2  # new storage: a graph of the old one would read stale weights
        for m in ref:
            for p in m.parameters():
                p.data = p.data * 2
        torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)


# --- plan.capture: the plan asks for whole-plan capture; build honours it; autotune offers it -----------

import importlib  # noqa: E402
build_module = importlib.import_module("stagewise.executor.build")
from stagewise.executor.autotune import WHOLE_GRAPH, tune  # noqa: E402
from stagewise.planner.plan import Plan  # noqa: E402


@pytest.fixture
def replay_capture(monkeypatch):
    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", ReplayBackend)


def _members_and_plan(make=MLP, x=None):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    x = torch.randn(5, 8) if x is None else x
    return members, planner.propose(planner.trace(members[0], (x,)), n_members=N)


def test_capture_is_a_plan_field_that_survives_json_and_is_refused_when_not_boolean():
    _, plan = _members_and_plan()
    assert "capture" not in plan.to_json()  # plans without it read as before
    on = planner.set_capture(plan)
    assert on.capture and Plan.loads(on.dumps()).capture and Plan.loads(on.dumps()) == on
    assert not planner.set_capture(on, False).capture
    with pytest.raises(planner.EditError, match="True or False"):
        planner.set_capture(plan, "yes")
    bad = {**on.to_json(), "capture": "yes"}
    with pytest.raises(planner.PlanFileError, match="capture must be true or false"):
        Plan.from_json(bad)
    assert [c.field for c in planner.diff_plans(plan, on).plan_changes] == ["capture"]


def test_a_capture_plan_replays_inference_and_runs_training_stage_by_stage(replay_capture):
    members, plan = _members_and_plan()
    ref = copy.deepcopy(members)
    ens = executor.build(planner.set_capture(plan), members).eval()
    cap = ens.__dict__["_captured"]
    assert cap is not None
    with torch.no_grad():
        for x in xs(5, 2) + xs(3, 1, seed=1):
            torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 2
    x = xs(5, 1, seed=2)[0]
    out = ens(x)  # grad enabled and parameters require grad: stage by stage, gradients flow
    out.sum().backward()
    assert all(p.grad is not None for p in ens.parameters()) and cap.captures == 2
    ens.train()
    with torch.no_grad():
        ens(x)
    assert cap.captures == 2  # training mode never replays


def test_without_a_capture_backend_a_capture_plan_runs_stage_by_stage():
    members, plan = _members_and_plan()
    ref = copy.deepcopy(members)
    ens = executor.build(planner.set_capture(plan), members).eval()
    assert ens.__dict__["_captured"] is None  # CPU: nothing to capture with
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)


def test_a_capture_plan_that_cannot_capture_warns_once_and_runs_stage_by_stage(monkeypatch):
    class RefuseAll(ReplayBackend):
        def capture(self, fn, warmup):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", RefuseAll)
    members, plan = _members_and_plan()
    ref = copy.deepcopy(members)
    ens = executor.build(planner.set_capture(plan), members).eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="running stage by stage"):
            torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)  # no second warning needed


def test_autotune_races_the_whole_plan_graph_and_checks_it_against_the_loop(replay_capture):
    members, plan = _members_and_plan()
    x = torch.randn(5, 8)
    best, found = tune(plan, [m.eval() for m in members], (x,), strategies=["vmap", "loop"], budget="quick")
    notes = " ".join(s.options.note for s in best.stages)
    assert WHOLE_GRAPH in notes  # measured beside the per-stage plan (whichever won)
    ens = executor.build(best, members).eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x), rtol=1e-5, atol=1e-6)


def test_a_whole_plan_graph_with_wrong_results_is_never_chosen(monkeypatch):
    class Stale(ReplayBackend):
        """Replays without running anything: the outputs of capture time, whatever the inputs."""

        def capture(self, fn, warmup):
            out = fn()
            return (lambda: None), out

    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", Stale)
    members, plan = _members_and_plan()
    best, _ = tune(plan, [m.eval() for m in members], (torch.randn(5, 8),), strategies=["vmap", "loop"], budget="quick")
    assert not best.capture
    note = " ".join(s.options.note for s in best.stages)
    assert WHOLE_GRAPH in note


def test_a_cuda_graph_stage_that_writes_into_its_input_hands_the_write_on(replayed_stages):
    from conftest import ScaleInPlace

    torch.manual_seed(0)
    members = [ScaleInPlace().eval() for _ in range(N)]
    ref = copy.deepcopy(members)
    x = torch.randn(3, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, N)
    plan = planner.split(plan, graph, "s0", "mul_")
    plan = planner.split(plan, graph, "s1", "sub")
    stage = next(s.id for s in plan.stages if "mul_" in s.nodes)
    ens = executor.build(planner.set_options(plan, graph, stage, strategy="cuda_graph"), members)
    with torch.no_grad():
        for batch in (3, 3, 5):
            x = torch.randn(batch, 4)
            got = ens(x)
            want = [torch.stack(o) for o in zip(*[m(x) for m in ref])]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_host_scalar_is_part_of_a_cuda_graph_signature():
    from stagewise.executor.capture import _signature

    a, b = [torch.tensor(0.5)], [torch.tensor(0.7)]
    assert _signature(a, host_scalars=True) != _signature(b, host_scalars=True)  # baked in at launch: a new graph
    assert _signature(a) == _signature(b)  # ReplayBackend reads it each time
    assert _signature([torch.ones(3, device="meta")], True) == _signature([torch.zeros(3, device="meta")], True)


def test_whole_plan_capture_runs_cuda_graph_stages_inside_its_own_graph(replayed_stages):
    ens, ref = built(MLP, torch.randn(5, 8), planner.Strategy.CUDA_GRAPH)
    cap = capture(ens, backend=ReplayBackend())
    inner = [s[1] for s in cap._inside()]
    assert not any(isinstance(r, CudaGraphRunner) for r in inner)
    with torch.no_grad():
        for x in xs(5, 2) + xs(2, 1, seed=4):
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.layout()[0]["mode"] == "graph" and cap._runs is None


def test_profile_shows_how_a_capture_plan_replayed(replay_capture):
    from stagewise.executor.report import ProfileReport

    torch.manual_seed(0)
    members = [_data_dependent() for _ in range(N)]
    x = torch.randn(6, 16)
    plan = planner.set_capture(planner.propose(planner.trace(members[0], (x,)), n_members=N))
    report = executor.profile(plan, [m.eval() for m in members], (x,), repeats=3, baselines=False)
    assert report.end_to_end.ok and report.capture is not None
    assert [e["mode"] for e in report.capture] == ["graph", "eager", "graph", "eager", "graph"]
    text = report.to_text()
    assert "whole-plan capture: 3 CUDA graphs: graph s0 · eager s1 (_local_scalar_dense" in text
    assert ProfileReport.from_json(report.to_json()).capture == report.capture
    plain = executor.profile(planner.set_capture(plan, False), [m.eval() for m in members], (x,), repeats=3, baselines=False)
    assert plain.capture is None and "whole-plan capture" not in plain.to_text()


def test_capture_text_names_one_graph_or_each_run():
    from stagewise.executor.report import capture_text

    assert capture_text([{"stages": ["s0", "s1", "s2"], "mode": "graph", "reason": ""}]) == "one CUDA graph (s0-s2)"
    assert capture_text([{"stages": ["s0"], "mode": "graph", "reason": ""},
                         {"stages": ["s1"], "mode": "eager", "reason": "nonzero makes the host wait"}]) == (
        "1 CUDA graph: graph s0 · eager s1 (nonzero makes the host wait)")


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x)).relu()


def test_switching_between_two_signatures_of_a_model_with_buffers_replays_both():
    """was: every capture puts the buffers back (moving their version counters), and graphs were keyed on those
    counters, so each switch of signature captured again, forever."""
    torch.manual_seed(0)
    members = [Normed() for _ in range(N)]
    for m in members:
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    ref = [m.eval() for m in copy.deepcopy(members)]
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 8),)), n_members=N)
    cap = capture(executor.build(plan, members).eval(), backend=ReplayBackend())
    with torch.no_grad():
        for batch in (5, 3, 5, 3, 5, 3):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 2


# --- a stage compiled in mode reduce-overhead (CUDA graphs of its own) ------------------------------------------------

class OwnGraphsBackend(ReplayBackend):
    """ReplayBackend that refuses, as a CUDA capture would, when a reduce-overhead stage runs inside the capture
    (`inside` is set while capturing; the stand-in stage's runner raises when it runs then)."""

    inside = False

    def capture(self, fn, warmup):
        OwnGraphsBackend.inside = True
        try:
            return super().capture(fn, warmup)
        finally:
            OwnGraphsBackend.inside = False


@pytest.fixture
def reduce_overhead_on_cpu(monkeypatch):
    """Compile stages tagged reduce-overhead build on CPU (the CUDA refusal skipped: compiled in the default mode with
    the aot_eager backend; the plan keeps the tag, which is what capture reads) and raise if run inside a capture."""
    from dataclasses import replace

    from stagewise.executor.strategies import compiled
    from stagewise.executor.strategies.compiled import compile_mode_of, with_compile_mode

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    real_init, real_run = compiled.CompileRunner.__init__, compiled.CompileRunner.run

    def init(self, program, *args, **kwargs):
        self.own_graphs = compile_mode_of(program.stage.options) == "reduce-overhead"
        plain = replace(program, stage=replace(program.stage, options=with_compile_mode(program.stage.options, "")))
        real_init(self, plain, *args, **kwargs)

    def run(self, args):
        if self.own_graphs and OwnGraphsBackend.inside:
            raise RuntimeError("CUDA graph trees: cannot record a graph while another stream capture is under way")
        return real_run(self, args)

    monkeypatch.setattr(compiled.CompileRunner, "__init__", init)
    monkeypatch.setattr(compiled.CompileRunner, "run", run)
    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", OwnGraphsBackend)


def _reduce_overhead_plan(members, x, device="cpu"):
    """MLP split into s0 (fc1), s1 (act), s2 (fc2); s1 compiled in mode reduce-overhead; whole-plan capture on."""
    from stagewise.executor.strategies.compiled import with_compile_mode

    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    plan = planner.split(plan, graph, plan.stages[0].id, "act")
    plan = planner.split(plan, graph, plan.stages[-1].id, "fc2")
    ro = with_compile_mode(planner.StageOptions(strategy=planner.Strategy.COMPILE, note="by hand"), "reduce-overhead")
    stages = [s.__class__(**{**s.__dict__, "options": ro}) if s.id == "s1" else s for s in plan.stages]
    return planner.set_capture(plan.with_stages(stages))


def test_eager_reason_names_reduce_overhead_stages_only():
    from stagewise.executor.capture import OWN_GRAPHS, eager_reason
    from stagewise.executor.strategies.compiled import with_compile_mode

    class Program:
        def __init__(self, options):
            self.stage = planner.Stage("s0", ("fc1",), planner.StageMode.BATCHED, "", options)

    compile_ = planner.StageOptions(strategy=planner.Strategy.COMPILE)
    assert eager_reason(Program(with_compile_mode(compile_, "reduce-overhead"))) == OWN_GRAPHS
    assert "reduce-overhead compile records its own CUDA graphs" in OWN_GRAPHS
    assert eager_reason(Program(compile_)) is None
    assert eager_reason(Program(with_compile_mode(compile_, "max-autotune-no-cudagraphs"))) is None
    assert eager_reason(Program(planner.StageOptions())) is None


def test_a_reduce_overhead_stage_runs_eagerly_between_captured_runs(reduce_overhead_on_cpu):
    """A hand-made plan asking for whole-plan capture and a reduce-overhead stage: the stage is never run inside a
    capture; it runs eagerly between the graphs of the stages either side, and layout() says why."""
    torch.manual_seed(0)
    members = [MLP().eval() for _ in range(N)]
    ref = copy.deepcopy(members)
    x = torch.randn(5, 8)
    ens = executor.build(_reduce_overhead_plan(members, x), members).eval()
    cap = ens.__dict__["_captured"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "cannot capture, running stage by stage" fallback
        with torch.no_grad():
            for batch in (5, 5, 7, 5):
                x = torch.randn(batch, 8)
                torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert ens.__dict__["_captured"] is cap
    assert cap.layout() == [
        {"stages": ["s0"], "mode": "graph", "reason": ""},
        {"stages": ["s1"], "mode": "eager", "reason": OWN_GRAPHS},
        {"stages": ["s2"], "mode": "graph", "reason": ""}]
    from stagewise.executor.report import capture_text

    assert capture_text(cap.layout()) == f"2 CUDA graphs: graph s0 · eager s1 ({OWN_GRAPHS}) · graph s2"


def test_profile_of_a_capture_plan_with_a_reduce_overhead_stage_shows_it_eager(reduce_overhead_on_cpu):
    torch.manual_seed(0)
    members = [MLP().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    report = executor.profile(_reduce_overhead_plan(members, x), members, (x,), repeats=2, warmup=1, baselines=False)
    assert report.end_to_end.ok, report.end_to_end.error
    assert [e["mode"] for e in report.capture] == ["graph", "eager", "graph"]
    assert "eager s1 (reduce-overhead compile records its own CUDA graphs" in report.to_text()


def test_a_capture_plan_of_reduce_overhead_stages_only_runs_stage_by_stage_with_a_warning(reduce_overhead_on_cpu):
    from stagewise.executor.strategies.compiled import with_compile_mode

    torch.manual_seed(0)
    members = [MLP().eval() for _ in range(N)]
    ref = copy.deepcopy(members)
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    ro = with_compile_mode(planner.StageOptions(strategy=planner.Strategy.COMPILE), "reduce-overhead")
    plan = planner.set_capture(plan.with_stages([s.__class__(**{**s.__dict__, "options": ro}) for s in plan.stages]))
    ens = executor.build(plan, members).eval()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="reduce-overhead compile records its own CUDA graphs"):
        torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), loop(ref, x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_whole_plan_capture_with_a_reduce_overhead_stage_matches_the_loop():
    """On a GPU for real: the reduce-overhead stage replays torch's own CUDA graphs between the plan's graphs."""
    torch.manual_seed(0)
    members = [MLP().cuda().eval() for _ in range(N)]
    ref = copy.deepcopy(members)
    x = torch.randn(5, 8, device="cuda")
    ens = executor.build(_reduce_overhead_plan(members, x), members, device="cuda").eval()
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.no_grad():
            for batch in (5, 5, 7, 5, 7):
                x = torch.randn(batch, 8, device="cuda")
                out = ens(x)
                outs.append((x, out))
                torch.testing.assert_close(out, loop(ref, x), rtol=1e-4, atol=1e-5)
    for x, out in outs:  # earlier outputs are still theirs
        torch.testing.assert_close(out, loop(ref, x), rtol=1e-4, atol=1e-5)
    cap = ens.__dict__["_captured"]
    assert cap is not None and [e["mode"] for e in cap.layout()] == ["graph", "eager", "graph"]
    assert cap.layout()[1]["reason"] == OWN_GRAPHS


# --- the whole-plan graph with excluded stages run wide (a recurrence launch-bound eagerly) ----------------------------

from stagewise.executor.autotune import WHOLE_GRAPH_WIDE, whole_plan_graph_wide  # noqa: E402


class GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(8, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def _gru_stage_as_loop(plan):
    """The plan with its excluded (GRU) stage as the member loop, as a per-stage race may leave it (it starts wide)."""
    return plan.with_stages([replace(s, options=planner.StageOptions(strategy=planner.Strategy.LOOP))
                             if s.mode is planner.StageMode.EXCLUDED else s for s in plan.stages])


def test_the_wide_whole_plan_graph_switches_only_excluded_loop_stages_and_matches_the_loop(replay_capture):
    members, plan = _members_and_plan(GRUHead, torch.randn(2, 5, 8))
    plan = _gru_stage_as_loop(plan)
    excluded = [s for s in plan.stages if s.mode is planner.StageMode.EXCLUDED]
    assert excluded and all(s.options.strategy is planner.Strategy.LOOP for s in excluded)  # the GRU stage
    wide = whole_plan_graph_wide(plan)
    assert wide.capture
    for before, after in zip(plan.stages, wide.stages):
        switched = before.mode is planner.StageMode.EXCLUDED
        assert after.options.strategy is (planner.Strategy.WIDE if switched else before.options.strategy)
    assert whole_plan_graph_wide(wide) is None  # nothing left to switch
    ens = executor.build(wide, copy.deepcopy(members)).eval()
    with torch.no_grad():
        for seed, shape in ((0, (2, 5, 8)), (1, (2, 5, 8)), (2, (3, 7, 8)), (3, (2, 5, 8))):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(ens(x), loop(members, x), rtol=1e-5, atol=1e-6)
    assert ens.__dict__["_captured"].captures == 2  # one graph per input shape, replayed


def test_autotune_races_the_wide_whole_plan_graph_when_a_stage_stays_a_loop(replay_capture):
    """The whole-plan race of a per-stage plan whose GRU stage runs as the loop offers (and checks) the graph
    with that stage wide; not where wide is not allowed."""
    from stagewise.executor.autotune import BUDGETS, _best_of_merged

    members, plan = _members_and_plan(GRUHead, torch.randn(2, 5, 8))
    plan = _gru_stage_as_loop(plan)
    members = [m.eval() for m in members]
    x = torch.randn(2, 5, 8)

    def labels(allowed):
        best, results, _ = _best_of_merged(plan, members, (x,), torch.device("cpu"), allowed, None, 1, BUDGETS["quick"])
        if results is not None:
            return {r.strategy: r for r in results}, best
        return best.stages[0].options.note.split("whole plan (min/median ms): ")[1], best

    found, best = labels(None)
    assert WHOLE_GRAPH_WIDE in found
    if isinstance(found, dict):
        assert found[WHOLE_GRAPH_WIDE].ok, found[WHOLE_GRAPH_WIDE].error
    ens = executor.build(best, copy.deepcopy(members)).eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x), loop(members, x), rtol=1e-5, atol=1e-6)
    found, _ = labels({planner.Strategy.VMAP, planner.Strategy.LOOP})
    assert WHOLE_GRAPH_WIDE not in found


def test_a_captured_plan_copies_and_saves_with_its_own_graphs():
    # Was: copy.deepcopy of a captured plan raised (its graphs' tensors are not graph leaves), and torch.save too.
    import io

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval() for _ in range(3)]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    fast = capture(executor.build(plan, copy.deepcopy(members)), backend=ReplayBackend(), clone_outputs=False)
    want = torch.stack([m(x) for m in members]).detach()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), want)
        twin = copy.deepcopy(fast)
        buffer = io.BytesIO()
        torch.save(fast, buffer)
        buffer.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = torch.load(buffer, weights_only=False)
        for other in (twin, loaded):
            assert other.clone_outputs is False and isinstance(other.backend, ReplayBackend)
            torch.testing.assert_close(other(x), want)
            for p in other.ens.parameters():  # its own state: a change reaches its replays, not the original's
                p.add_(1.0)
            assert not torch.allclose(other(x), want)
            torch.testing.assert_close(fast(x), want)


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, q, k, v, kpm):
        return self.mha(q, k, v, key_padding_mask=kpm, need_weights=False)[0]


def test_one_tensor_passed_as_several_inputs_keeps_its_identity_under_capture():
    """Was: the static copies made `q is k is v` false, so the attention took the other path: a fully padded row came
    back 0 where the loop (torch's fast path) gives NaN and the batched module refuses it."""
    torch.manual_seed(0)
    members = [_SelfAttention().eval() for _ in range(3)]
    x = torch.randn(3, 6, 16)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x, x, x, kpm)), 3), members)
    cap = capture(ens, backend=ReplayBackend())
    with torch.no_grad():
        torch.testing.assert_close(cap(x, x, x, kpm), torch.stack([m(x, x, x, kpm) for m in members]))
        kpm[2] = True  # one sequence fully padded
        with pytest.raises(ExecutionError, match="every key masked out"):
            cap(x, x, x, kpm)
