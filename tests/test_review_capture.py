"""Review of whole-plan capture (executor.capture, plan.capture, the cuda_graph strategy): probes for answers or
module state that differ from the plain loop over members without an error.

Without a GPU the ReplayBackend stands in for the CUDA graph; the `gpu` tests check what only a real graph bakes in.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from stagewise import executor, planner
from stagewise.executor.capture import NotCapturableError, ReplayBackend, _signature, capture

build_module = importlib.import_module("stagewise.executor.build")
N = 3
SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


def assert_leaves_close(got, want, rtol=1e-5, atol=1e-5):
    g, w = tree_flatten(got)[0], tree_flatten(want)[0]
    assert len(g) == len(w)
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)
        else:
            assert a == b


def stacked(outs):
    return tree_map(lambda *t: torch.stack(t) if isinstance(t[0], torch.Tensor) else t[0], *outs)


def loop(ref, *inputs):
    with torch.no_grad():
        return stacked([m(*inputs) for m in ref])


def members_and_plan(make, x, n=N, exclude=(), mode="shared"):
    torch.manual_seed(0)
    members = [make() for _ in range(n)]
    graph = planner.trace(members[0], (x,))
    ref = [copy.deepcopy(m).eval() for m in members]
    plan = planner.propose(graph, n_members=n, input_mode=mode)
    for node in exclude:
        plan = planner.exclude(plan, graph, node)
    return members, ref, plan


# --- every sample model, N in {1, 3}, two batch sizes, several calls ------------------------------------------

@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(p.stem for p in SAMPLES.glob("*.py") if p.stem != "__init__"))
def test_every_sample_model_replays_like_the_loop(name, n):
    src = planner.load_model_file(str(SAMPLES / f"{name}.py"))
    members = src.members(n)
    ref = [copy.deepcopy(m).eval() for m in members]
    plan = planner.propose(planner.trace(src.model, src.example_inputs), n_members=n)
    cap = capture(executor.build(plan, members).eval(), backend=ReplayBackend())
    ex = src.example_inputs
    other = ex[0].shape[0] if plan.tracer == "export" else max(1, ex[0].shape[0] // 2)  # export: traced shapes only
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in (ex[0].shape[0], other, ex[0].shape[0], other):
            x = tuple(torch.randn(batch, *t.shape[1:], generator=g) if t.is_floating_point() else t for t in ex)
            assert_leaves_close(cap(*x), loop(ref, *x))
    if name == "data_dependent":
        assert [e["mode"] for e in cap.layout()] == ["graph", "eager", "graph", "eager", "graph"]


# --- new storage or new runners after a capture ------------------------------------------------------------

class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class SyncThenLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        h = h / (h.abs().max().item() + 1)
        return self.c(torch.relu(self.b(h)))


@pytest.mark.parametrize("make", [TwoLinear, SyncThenLinears])
def test_new_storage_under_a_loop_stage_is_seen(make):
    """Was wrong: the graph (or the runs) kept the old runners, whose per-member views read the old storage."""
    members, ref, plan = members_and_plan(make, torch.randn(5, 8), exclude=("b",))
    ens = executor.build(plan, members).eval()
    new_storage_is_seen(capture(ens, backend=ReplayBackend()), ens, ref, torch.randn(5, 8))


def new_storage_is_seen(cap, ens, ref, x):
    """Replays match the loop before and (twice) after every weight gets new storage (`p.data = ...`)."""
    with torch.no_grad():
        assert_leaves_close(cap(x), loop(ref, x))
        for p in ens.parameters():
            p.data = p.data * 2
        for m in ref:
            for p in m.parameters():
                p.data = p.data * 2
        for _ in range(2):
            assert_leaves_close(cap(x), loop(ref, x))


def test_to_another_dtype_after_runs_were_captured():
    """Was a dtype error from the runs' old runners (float32 state) after .double()."""
    members, ref, plan = members_and_plan(SyncThenLinears, torch.randn(5, 8), exclude=("b",))
    ens = executor.build(plan, members).eval()
    cap = capture(ens, backend=ReplayBackend())
    x = torch.randn(5, 8)
    with torch.no_grad():
        cap(x)
        ens.double()
        ref = [m.double() for m in ref]
        for _ in range(2):
            got = cap(x.double())
            assert got.dtype == torch.float64
            assert_leaves_close(got, ens(x.double()), rtol=0, atol=0)
            # per-member .item() floats enter vmapped stages as a float32 tensor (values.stack_member_values), in the
            # module itself too: float64 plans are off the loop by float32 rounding there
            assert_leaves_close(got, loop(ref, x.double()), rtol=1e-6, atol=1e-7)


# --- state handed on between runs, in-place writes across run boundaries ------------------------------------

class StateHandedOn(nn.Module):
    """A buffer read by one stage (get_attr) and updated in place by a later one, a host sync between them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mu", torch.zeros(4))

    def forward(self, x):
        mu = self.mu
        h = self.fc(x) + mu
        h = h / (h.abs().max().item() + 1)
        mu.mul_(0.5).add_(h.mean(0))
        return h * 2 + mu


def test_state_handed_on_and_written_in_a_later_run_reaches_the_module():
    """Was wrong: the run copied the handed-on buffer into a static input and updated the copy (outputs drifted from
    the second call, the buffer never moved)."""
    members, ref, plan = members_and_plan(StateHandedOn, torch.randn(5, 4))
    ens = executor.build(plan, members).eval()
    assert any(ens._state_outputs)
    cap = capture(ens, backend=ReplayBackend())
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for batch in (5, 5, 3, 5):
            x = torch.randn(batch, 4, generator=g)
            assert_leaves_close(cap(x), loop(ref, x))
    assert {"graph", "eager"} <= {e["mode"] for e in cap.layout()}
    torch.testing.assert_close(ens.stacked_state["mu"], torch.stack([m.mu for m in ref]), rtol=1e-5, atol=1e-6)


class WritesItsInput(nn.Module):
    def __init__(self, sync=False):
        super().__init__()
        self.fc, self.sync = nn.Linear(4, 4), sync

    def forward(self, x):
        if self.sync:
            x = x / (x.abs().max().item() + 1)
        y = x.mul_(2)
        return self.fc(y)


@pytest.mark.parametrize("sync", [False, True])
def test_a_per_member_input_written_in_place_is_written_as_the_plan_writes_it(sync):
    """Was wrong (whole plan): the graph wrote into its static copy; the plan and the loop write the caller's tensor."""
    members, ref, plan = members_and_plan(lambda: WritesItsInput(sync), torch.randn(5, 4), mode="per_member")
    ens = executor.build(plan, members).eval()
    cap = capture(ens, backend=ReplayBackend())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch in (5, 5, 2):
            x = torch.randn(N, batch, 4, generator=g)
            a, b, c = x.clone(), x.clone(), x.clone()
            want = torch.stack([m(a[i]) for i, m in enumerate(ref)])
            torch.testing.assert_close(ens(b), want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(cap(c), want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(c, b)  # as the module itself leaves it
    if not sync:
        torch.testing.assert_close(c, a)  # and as the loop (with a sync the members see their own scaled rows)


class SharedWrittenAfterSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        s = x.abs().max().item()
        x.add_(s)
        return self.fc(x)


def test_a_shared_input_written_in_a_run_is_refused_at_build():
    """The member loop writes the caller's x once per member (member i sees i writes before its own); the module
    wrote a per-member copy (its answer matched only a loop given fresh copies), so build refuses it now."""
    members, ref, plan = members_and_plan(SharedWrittenAfterSync, torch.randn(5, 4))
    with pytest.raises(planner.InputError, match=r"writes the shared input 'x' in place.*x = x\.clone\(\)"):
        executor.build(plan, members)


# --- parameters updated by forward --------------------------------------------------------------------------

class ParamCounter(nn.Module):
    def __init__(self, sync):
        super().__init__()
        self.fc, self.sync = nn.Linear(4, 4), sync
        self.c = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x):
        self.c.add_(1)
        h = self.fc(x) * self.c
        return h / (h.abs().max().item() + 1) if self.sync else h


@pytest.mark.parametrize("sync", [False, True])
def test_a_parameter_updated_by_forward_is_refused_without_moving_it(sync):
    """Was wrong: the warm-up and detection runs moved the parameter 3-7 times before the refusal."""
    members, ref, plan = members_and_plan(lambda: ParamCounter(sync), torch.randn(5, 4))
    ens = executor.build(plan, members).eval()
    before = ens.stacked_state["c"].clone()
    with torch.no_grad(), pytest.raises(NotCapturableError, match="updates parameters"):
        capture(ens, backend=ReplayBackend())(torch.randn(5, 4))
    torch.testing.assert_close(ens.stacked_state["c"], before)


@pytest.mark.parametrize("sync", [False, True])
def test_a_capture_plan_whose_forward_updates_a_parameter_falls_back_from_the_state_of_the_call(monkeypatch, sync):
    """Was wrong: the fallback ran stage by stage on a parameter the refused capture had moved (outputs 3.6 off)."""
    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", ReplayBackend)
    members, ref, plan = members_and_plan(lambda: ParamCounter(sync), torch.randn(5, 4))
    ens = executor.build(planner.set_capture(plan), members).eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="running stage by stage"):
            assert_leaves_close(ens(x), loop(ref, x))
        assert_leaves_close(ens(x), loop(ref, x))
    torch.testing.assert_close(ens.stacked_state["c"], torch.stack([m.c for m in ref]))


# --- train -> eval ------------------------------------------------------------------------------------------

class NormDropSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.d, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 4)

    def forward(self, x):
        h = self.bn(self.a(x))
        h = h / (h.abs().max().item() + 1)
        return self.b(self.d(h))


def test_members_built_in_training_mode_then_eval_run_their_loop_stages_in_eval():
    """Was wrong (plain module too): loop stages call per-member shallow copies of the stage (bound_loop) that kept
    the training flag of build time, so after .eval() BatchNorm normalised with batch statistics and updated its
    running statistics, and dropout dropped."""
    torch.manual_seed(0)
    members = [NormDropSync() for _ in range(N)]  # training mode, as constructed
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    plan = planner.propose(graph, n_members=N)
    ens = executor.build(plan, members)
    ref = [copy.deepcopy(m) for m in members]
    x = torch.randn(5, 4)
    ens.train()
    ens(x)  # a training step: running statistics move
    for m in ref:
        m(x)
    ens.eval()
    for m in ref:
        m.eval()
    cap = capture(ens, backend=ReplayBackend())
    with torch.no_grad():
        for _ in range(2):
            y = torch.randn(6, 4)
            assert_leaves_close(ens(y), loop(ref, y))
            assert_leaves_close(cap(y), loop(ref, y))
    torch.testing.assert_close(ens.stacked_state["bn.running_mean"], torch.stack([m.bn.running_mean for m in ref]))


# --- outputs: containers, dataclasses, aliases; clone_outputs; eviction -------------------------------------

@dataclasses.dataclass
class Pair:
    y: torch.Tensor
    x: torch.Tensor


class RichOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        k = h / (h.abs().max().item() + 1)
        return {"y": self.b(k), "pair": (h, k), "dc": Pair(k, x)}


@pytest.mark.parametrize("clone", [True, False])
def test_containers_dataclasses_and_input_aliases_through_runs_with_eviction(clone):
    members, ref, plan = members_and_plan(RichOutputs, torch.randn(5, 4))
    cap = capture(executor.build(plan, members).eval(), clone_outputs=clone, max_signatures=1, backend=ReplayBackend())
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for batch in (5, 3, 5, 3):
            x = torch.randn(batch, 4, generator=g)
            assert_leaves_close(cap(x), loop(ref, x))
    assert all(len(r.graphs) <= 1 for r in cap._runs)


def test_a_bfloat16_plan_captured_answers_as_the_module_does():
    from stagewise.sample_models.data_dependent import DataDependentMLP

    members, ref, plan = members_and_plan(lambda: DataDependentMLP(16, 24), torch.randn(5, 16))
    ens = executor.build(planner.set_dtype(plan, "bfloat16"), members).eval()
    cap = capture(ens, backend=ReplayBackend())
    with torch.no_grad():
        for batch in (5, 3, 5):
            x = torch.randn(batch, 16)
            got = cap(x)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, ens(x), rtol=0, atol=0)
            torch.testing.assert_close(got, loop(ref, x), rtol=5e-2, atol=5e-2)


# --- autotune picks capture; the saved plan rebuilt ---------------------------------------------------------

def test_an_autotuned_capture_plan_saved_and_rebuilt_matches_the_loop(monkeypatch, tmp_path):
    from stagewise.executor.autotune import tune

    monkeypatch.setattr(build_module, "CAPTURE_BACKEND", ReplayBackend)
    members, ref, plan = members_and_plan(TwoLinear, torch.randn(5, 8))
    best, _ = tune(plan, [m.eval() for m in members], (torch.randn(5, 8),), strategies=["vmap", "loop"], budget="quick")
    best = planner.set_capture(best)  # whichever won the race, the JSON carries capture
    best.save(tmp_path / "plan.json")
    ens = executor.build(planner.Plan.load(tmp_path / "plan.json"), members).eval()
    assert ens.__dict__["_captured"] is not None
    with torch.no_grad():
        for batch in (5, 7, 5):
            x = torch.randn(batch, 8)
            assert_leaves_close(ens(x), loop(ref, x))


# --- what only a real CUDA graph bakes in ------------------------------------------------------------------

def test_a_cpu_tensors_value_is_part_of_a_cuda_graph_signature():
    """CPU work is not in a CUDA graph (a replay hands out what it made at capture time), and a CUDA kernel reads a
    0-d CPU tensor as a number at launch: with the CUDA backend another value needs another graph."""
    one, other = [torch.tensor([5, 3, 2])], [torch.tensor([5, 4, 1])]
    assert _signature(one, host_scalars=True) != _signature(other, host_scalars=True)
    assert _signature(one, host_scalars=True) == _signature([torch.tensor([5, 3, 2])], host_scalars=True)
    assert _signature(one) == _signature(other)  # ReplayBackend re-runs everything: shapes are enough
    bf = torch.ones(4, dtype=torch.bfloat16)[::2]  # non-contiguous, a dtype numpy lacks
    assert _signature([bf], True) != _signature([torch.zeros(2, dtype=torch.bfloat16)], True)


class CpuSide(nn.Module):
    """A GPU Linear and a CPU-side value computed from a CPU input (lengths, say)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, lengths):
        return self.fc(x), lengths * 2


@pytest.mark.gpu
def test_cuda_graph_recomputes_cpu_side_outputs_for_new_cpu_values():
    torch.manual_seed(0)
    members = [CpuSide() for _ in range(N)]
    ref = [copy.deepcopy(m).cuda().eval() for m in members]
    lengths = torch.tensor([3, 2])
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 4), lengths)), n_members=N)
    cap = capture(executor.build(plan, members, device="cuda").eval())
    with torch.no_grad():
        for ls in ([3, 2], [4, 1], [3, 2]):
            x, lengths = torch.randn(5, 4).cuda(), torch.tensor(ls)
            got = cap(x, lengths)
            want = loop(ref, x, lengths)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
            assert torch.equal(got[1].cpu(), want[1].cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("exclude", [(), ("b",)])
def test_cuda_graph_sees_new_storage_under_a_loop_stage(exclude):
    members, ref, plan = members_and_plan(SyncThenLinears, torch.randn(5, 8), exclude=exclude)
    ref = [m.cuda() for m in ref]
    ens = executor.build(plan, members, device="cuda").eval()
    new_storage_is_seen(capture(ens), ens, ref, torch.randn(5, 8).cuda())


@pytest.mark.gpu
def test_cuda_graph_replays_forward_state_updates_without_recapturing():
    """A real replay bumps no version counter, so unlike ReplayBackend a stateful model replays one graph: the
    state must still move once per call, in the graph, across runs."""
    members, ref, plan = members_and_plan(StateHandedOn, torch.randn(5, 4))
    ref = [m.cuda() for m in ref]
    ens = executor.build(plan, members, device="cuda").eval()
    cap = capture(ens)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(5, 4).cuda()
            assert_leaves_close(cap(x), loop(ref, x))
    torch.testing.assert_close(ens.stacked_state["mu"], torch.stack([m.mu for m in ref]), rtol=1e-5, atol=1e-6)
    assert cap.captures == sum(1 for e in cap.layout() if e["mode"] == "graph")  # one capture per run, then replays


# --- an input the plan writes in place, whose elements share memory --------------------------------------------

class ScalesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


class ZeroesFirstRow(ScalesItsInput):
    def forward(self, x):
        x[0].zero_()
        return self.fc(x)


def _per_member_capture(cls):
    torch.manual_seed(0)
    members = [cls().eval() for _ in range(N)]
    plan = planner.propose(planner.trace(members[0], (torch.randn(3, 8),)), N, input_mode="per_member")
    ens = executor.build(plan, copy.deepcopy(members))
    return members, ens, capture(ens, backend=ReplayBackend())


def test_capture_refuses_member_rows_sharing_memory_as_the_module_does():
    _, ens, fast = _per_member_capture(ScalesItsInput)
    base = torch.randn(64)
    for f in (ens, fast):
        with pytest.raises(planner.InputError, match="share memory"):
            with torch.no_grad():
                f(base.clone()[:24].view(1, 3, 8).expand(N, 3, 8))
        with pytest.raises(planner.InputError, match="share memory"):
            with torch.no_grad():
                f(base.clone().as_strided((N, 3, 8), (8, 8, 1)))


def test_capture_writes_through_rows_shared_within_a_member_as_the_loop():
    members, ens, fast = _per_member_capture(ZeroesFirstRow)
    base = torch.randn(N * 8)
    xl = base.clone().view(N, 1, 8).expand(N, 3, 8)
    with torch.no_grad():
        want = torch.stack([m(xl[i]) for i, m in enumerate(members)])
        for f in (ens, fast, fast):
            x = base.clone().view(N, 1, 8).expand(N, 3, 8)
            torch.testing.assert_close(f(x), want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(x, xl, rtol=0, atol=0)
