"""Values that are not plain activations crossing a stage boundary, for every strategy.

- A size (`h.shape[0]`, a Python int) made by one stage and read by the next:
  every runner must recompute it per call, or specialise on the input signature
  and re-record it for a new one (compile once reused the first call's size).
- Per-member Python numbers (`.item()` in a loop stage) entering a batched stage:
  the [N] tensor made from them must live on the stage's device (it was made
  on the CPU, which fails under vmap on CUDA; the "meta" device shows the same
  class of failure on a machine without a GPU).

Every case runs the batched module over several calls and at least two batch
sizes and compares each call with the plain loop over the same members.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor
from stagewise import planner
from stagewise.executor import values
from stagewise.executor.strategies import compiled, cudagraph
from stagewise.executor.values import Batched, PerMember, Shared
from stagewise.planner.plan import StageMode, Strategy

N = 3
BATCH_SIZES = (5, 7, 2, 7)  # a new size, another, a third, then back to an earlier one
CPU_STRATEGIES = [s for s in Strategy if s is not Strategy.CUDA_GRAPH]  # cuda_graph is refused on CPU


@pytest.fixture(autouse=True)
def fast_compile(monkeypatch):
    """torch.compile without inductor's C++ build: the same plumbing, in seconds."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


class SizeAcross(nn.Module):
    """A batch size read in one stage and used, as a number and as a shape, after the boundary."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        b = h.shape[0]
        return self.fc2(h) * b + h.new_ones(b, 1) / b


def size_plan(how: str, strategy: Strategy, graph):
    """SizeAcross cut so that the size crosses a boundary, every stage set to `strategy` where allowed.

    "split": batched stage -> batched stage (the int leaves a vmapped stage as a non-tensor leaf);
    "exclude": the `getitem` taking the size is a loop stage of its own (its int reaches a batched stage per member).
    """
    plan = planner.propose(graph, N, "shared")
    assert len(plan.stages) == 1
    plan = planner.split(plan, graph, plan.stages[0].id, "fc2") if how == "split" else planner.exclude(plan, graph, "getitem")
    for stage in plan.stages:
        if stage.mode is StageMode.BATCHED or strategy in (Strategy.LOOP, Strategy.WIDE, Strategy.COMPILE):
            plan = planner.set_options(plan, graph, stage.id, strategy=strategy.value)
    return plan


def assert_matches_loop_per_call(plan, members, batch_sizes=BATCH_SIZES, device="cpu"):
    """Build once, then compare every call with the loop over copies of the same members."""
    reference = copy.deepcopy(members)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = executor.build(plan, members, device=device)
        g = torch.Generator().manual_seed(1)
        for call, b in enumerate(batch_sizes):
            x = torch.randn(b, 4, generator=g).to(device)
            with torch.no_grad():
                got = module(x)
                want = torch.stack([m(x) for m in reference])
            assert got.shape == want.shape, f"call {call} (batch {b}): {tuple(got.shape)} vs the loop's {tuple(want.shape)}"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"call {call} (batch {b}): {m}")
    return module


@pytest.mark.parametrize("how", ["split", "exclude"])
@pytest.mark.parametrize("strategy", CPU_STRATEGIES, ids=lambda s: s.value)
def test_size_crossing_a_stage_matches_the_loop_at_every_batch_size(how, strategy):
    torch.manual_seed(0)
    members = [SizeAcross().eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    plan = size_plan(how, strategy, graph)
    assert len(plan.stages) >= 2
    module = assert_matches_loop_per_call(plan, members)
    if strategy is Strategy.COMPILE:  # compiled, not run eager: the specialisations are what is under test
        assert any(getattr(r, "_compiled", None) for r in module.runners)


def test_compile_records_the_output_structure_per_signature():
    """One compiled specialisation per input signature, each with its own recorded size."""
    torch.manual_seed(0)
    members = [SizeAcross().eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    module = assert_matches_loop_per_call(size_plan("split", Strategy.COMPILE, graph), members)
    first = module.runners[0]
    sizes = sorted(leaf for _, meta in first._compiled.values() for leaf in meta["leaves"] if isinstance(leaf, int))
    assert sizes == [2, 5, 7]  # batch 7 came twice and was compiled once


def test_compile_beyond_its_specialisations_runs_vmap(monkeypatch):
    monkeypatch.setattr(compiled, "MAX_SIGNATURES", 1)
    torch.manual_seed(0)
    members = [SizeAcross().eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    module = assert_matches_loop_per_call(size_plan("split", Strategy.COMPILE, graph), members)
    assert all(len(r._compiled) <= 1 for r in module.runners)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["split", "exclude"])
@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.value)
def test_size_crossing_a_stage_matches_the_loop_on_gpu(how, strategy):
    torch.manual_seed(0)
    members = [SizeAcross().eval().cuda() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4, device="cuda"),))
    assert_matches_loop_per_call(size_plan(how, strategy, graph), members, device="cuda")


# --- per-member numbers entering a batched stage ------------------------------------------------

class ScaledByItem(nn.Module):
    """A per-member Python float (`.item()`, a loop stage) divides a batched activation."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        scale = h.abs().max().item()
        return self.fc2(h / (scale + 1.0))


def item_module(strategy: Strategy = Strategy.VMAP):
    torch.manual_seed(0)
    members = [ScaledByItem().eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    plan = planner.propose(graph, N, "shared")
    for stage in plan.stages:
        if stage.mode is StageMode.BATCHED:
            plan = planner.set_options(plan, graph, stage.id, strategy=strategy.value)
    return plan, members


@pytest.mark.parametrize("strategy", CPU_STRATEGIES, ids=lambda s: s.value)
def test_per_member_numbers_into_a_batched_stage_match_the_loop(strategy):
    plan, members = item_module(strategy)
    assert any(s.mode is StageMode.EXCLUDED for s in plan.stages) and any(s.mode is StageMode.BATCHED for s in plan.stages)
    assert_matches_loop_per_call(plan, members)


def _consumer(module):
    """(runner, its arguments) of the stage that reads the `.item()` number."""
    for program, runner in zip(module.programs, module.runners):
        if "item" in program.input_names:
            return program, runner
    raise AssertionError("no stage reads the .item() node")


@pytest.mark.parametrize("strategy", [Strategy.VMAP, Strategy.COMPILE, Strategy.WIDE], ids=lambda s: s.value)
def test_per_member_numbers_land_on_the_stage_device(strategy):
    """The CPU stand-in for CUDA: with the stage's state on "meta", numbers made on the CPU fail
    ("Tensor on device cpu is not on the expected device meta"), as on CUDA ("cuda:0 and cpu")."""
    plan, members = item_module(strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = executor.build(plan, members).to("meta")
    program, runner = _consumer(module)
    args = [PerMember([0.5, 1.5, 2.5]) if name == "item" else Batched(torch.ones(N, 5, 8, device="meta"))
            for name in program.input_names]
    outs = runner(args)  # the numbers made on the CPU: "Tensor on device cpu is not on the expected device meta"
    leaves = [x for o in outs for x in torch.utils._pytree.tree_flatten(o.tree)[0] if isinstance(x, torch.Tensor)]
    assert leaves and all(x.device.type == "meta" for x in leaves)
    assert runner.device_for(args) == torch.device("meta")


def test_stack_member_values_puts_numbers_on_the_given_device():
    tree, dims = values.stack_member_values([1.0, 2.0, 3.0], torch.device("meta"))
    assert tree.device.type == "meta" and dims == 0
    tree, _ = values.stack_member_values([(torch.ones(2, device="meta"), 1.0), (torch.ones(2, device="meta"), 2.0)])
    assert tree[1].device.type == "meta"  # no device given: where the members' own tensors are
    same, dims = values.stack_member_values([4, 4, 4], torch.device("meta"))
    assert same == 4 and dims is None  # equal numbers stay one plain number


def test_stage_device_is_the_default_inside_a_run():
    with values.stage_device(torch.device("meta")):
        tree, _ = values.stack_member_values([1.0, 2.0])
    assert tree.device.type == "meta"
    assert values.stack_member_values([1.0, 2.0])[0].device.type == "cpu"  # and only inside it


def test_cuda_graph_signature_and_static_inputs():
    """What a captured graph bakes in (CPU-checkable parts of the cuda_graph runner)."""
    h = Batched(torch.ones(N, 5, 8))
    base = cudagraph._signature([h, Shared(5)])
    assert cudagraph._signature([h, Shared(7)]) != base  # a size from another stage: re-capture
    assert cudagraph._signature([Batched(torch.ones(N, 7, 8)), Shared(5)]) != base
    assert cudagraph._signature([Batched(torch.zeros(N, 5, 8)), Shared(5)]) == base  # new data: replay
    numbers, same = cudagraph.tensors_first([PerMember([0.5, 1.5, 2.5]), PerMember([4, 4, 4])], torch.device("meta"))
    assert isinstance(numbers, Batched) and numbers.tree.device.type == "meta" and numbers.tree.shape == (N,)
    assert same.tree == 4  # equal numbers are a constant of the graph, so part of its signature


def test_a_stage_without_state_takes_the_device_of_its_inputs():
    plan, members = item_module()
    module = executor.build(plan, members)
    program, runner = _consumer(module)
    runner.stacked = {}
    assert runner.device_for([Shared(1.0), Batched(torch.ones(1, device="meta"))]) == torch.device("meta")
    assert runner.device_for([Shared(1.0)]) is None


class InPlaceScaledByItem(ScaledByItem):
    """The per-member float enters a stage that writes in place (its inputs are made [N, ...] before it runs)."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        scale = h.abs().max().item()
        y = self.fc2(h)
        y.mul_(scale)
        return y


def in_place_module():
    torch.manual_seed(0)
    members = [InPlaceScaledByItem().eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    return planner.propose(graph, N, "shared"), members


def test_numbers_for_an_in_place_stage_are_made_on_its_device(monkeypatch):
    """Every tensor made from per-member numbers is made with the stage's device named (on CPU: "cpu");
    none falls back to where the numbers came from (the CPU, wrong on CUDA)."""
    asked = []
    real = values.stack_member_values
    monkeypatch.setattr(values, "stack_member_values", lambda v, device=None: asked.append(device) or real(v, device))
    plan, members = in_place_module()
    module = assert_matches_loop_per_call(plan, members)
    assert any(p.writes_in_place and "item" in p.input_names for p in module.programs)
    assert asked and all(d == torch.device("cpu") for d in asked), asked


@pytest.mark.gpu
def test_numbers_for_an_in_place_stage_on_gpu():
    plan, members = in_place_module()
    assert_matches_loop_per_call(plan, [m.cuda() for m in members], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.value)
def test_per_member_numbers_into_a_batched_stage_on_gpu(strategy):
    plan, members = item_module(strategy)
    assert_matches_loop_per_call(plan, [m.cuda() for m in members], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 5])
def test_data_dependent_sample_on_gpu(sample, n):
    src, graph = sample("data_dependent")
    plan = planner.propose(graph, n, "shared")
    members = [m.cuda() for m in src.members(n)]
    x = src.example_inputs[0].cuda()
    report = executor.verify(plan, members, (x,), device="cuda")
    assert report.ok, report.to_text()
