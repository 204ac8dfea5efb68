"""torch.compile modes for compile stages ("[compile: mode=...]" in the stage's options), and the compile-mode
candidates autotune adds on a GPU: for each stage ("compile/reduce-overhead", ...) and for the whole model
("merged/compile/reduce-overhead", ...). Without a GPU the plumbing is checked: the candidate lists per device
(nothing run), the tag's round trip, the mode reaching torch.compile (through the aot_eager backend: inductor's
max-autotune-no-cudagraphs takes 10-25 s per stage on CPU), the chosen mode recorded and rebuilt, the pruning,
the refusals; the GPU tier compiles and races for real."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.autotune import (BUDGETS, Budget, _merged_label, merged_alternatives, stage_candidates, stage_compile_modes,
                                         tune, whole_plan_graph)
from stagewise.executor.candidates import compile_mode_of_label, strategy_label
from stagewise.executor.strategies import compiled
from stagewise.executor.strategies.compiled import COMPILE_MODES, compile_mode_of, cudagraph_tree_graphs, with_compile_mode
from stagewise.executor.timing import fault_hook
from stagewise.planner import Strategy

autotune_module = importlib.import_module("stagewise.executor.autotune")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")

N = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _plan(mode: str, members):
    device = next(members[0].parameters()).device  # trace where the members live
    graph = planner.trace(members[0], (torch.randn(5, 8, device=device),))
    plan = planner.propose(graph, n_members=N)
    stage = plan.stages[0]
    options = with_compile_mode(planner.StageOptions(strategy=planner.Strategy.COMPILE, note="tuned"), mode)
    return plan.with_stages([planner.Stage(stage.id, stage.nodes, stage.mode, stage.reason, options)])


def test_the_mode_tag_round_trips_and_an_unknown_one_is_refused():
    options = planner.StageOptions(strategy=planner.Strategy.COMPILE, note="autotune chose compile")
    for mode in COMPILE_MODES:
        tagged = with_compile_mode(options, mode)
        assert compile_mode_of(tagged) == mode
        assert compile_mode_of(with_compile_mode(tagged, "")) == "" and "autotune chose compile" in tagged.note
    bad = planner.StageOptions(strategy=planner.Strategy.COMPILE, note="[compile: mode=fastest]")
    with pytest.raises(planner.PlanFileError, match="unknown compile mode 'fastest'"):
        compile_mode_of(bad)


def test_the_mode_survives_the_plan_json_and_reaches_torch_compile(recorded_modes):
    torch.manual_seed(0)
    members = [MLP().eval() for _ in range(N)]
    plan = planner.Plan.loads(_plan("max-autotune-no-cudagraphs", members).dumps())
    ens = executor.build(plan, copy.deepcopy(members))
    x = torch.randn(5, 8)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    assert recorded_modes == ["max-autotune-no-cudagraphs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_reduce_overhead_needs_a_gpu():
    members = [MLP().eval() for _ in range(N)]
    with pytest.raises(planner.ExecutionError, match="reduce-overhead.*CUDA device"):
        executor.build(_plan("reduce-overhead", members), members)(torch.randn(5, 8))


def test_on_a_gpu_the_whole_model_is_also_compiled_in_each_mode():
    members = [MLP() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 8),))
    plan = planner.propose(graph, n_members=N)
    plan = planner.split(plan, graph, plan.stages[0].id, "relu")  # two stages: merged alternatives exist
    order = list(graph.node_names)
    cpu = [_merged_label(p) for p in merged_alternatives(plan, order, None)]
    gpu = [_merged_label(p) for p in merged_alternatives(plan, order, None, torch.device("cuda"))]
    assert cpu == ["merged/compile", "merged/wide", "merged/vmap", "merged/loop"]
    assert gpu == ["merged/compile", "merged/compile/reduce-overhead", "merged/wide", "merged/vmap", "merged/loop"]
    every = [_merged_label(p) for p in merged_alternatives(plan, order, None, torch.device("cuda"), Budget(compile_modes=COMPILE_MODES))]
    assert every == ["merged/compile", "merged/compile/max-autotune-no-cudagraphs", "merged/compile/reduce-overhead",
                     "merged/wide", "merged/vmap", "merged/loop"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_compile_modes_match_the_loop_on_cuda(mode):
    torch.manual_seed(0)
    members = [MLP().cuda().eval() for _ in range(N)]
    ens = executor.build(_plan(mode, members), copy.deepcopy(members), device="cuda")
    outs = []
    with torch.no_grad():
        for batch in (5, 5, 7, 5):
            x = torch.randn(batch, 8, device="cuda")
            out = ens(x)
            outs.append((x, out))
            torch.testing.assert_close(out, torch.stack([m(x) for m in members]), rtol=1e-4, atol=1e-5)
        for x, out in outs:  # outputs of earlier calls are still theirs (cloned out of the graph's memory)
            torch.testing.assert_close(out, torch.stack([m(x) for m in members]), rtol=1e-4, atol=1e-5)


# --- per-stage compile-mode candidates ------------------------------------------------------------------------------

def _labels(program, device, allowed=None, budget=None) -> list[str]:
    return [strategy_label(s, None, compile_mode=m) for s, m in stage_candidates(program, device, allowed, budget)]


def test_a_stage_races_compile_in_each_mode_on_cuda_and_in_the_default_mode_on_cpu():
    """The candidate lists per device, read without running anything (the programs are built on CPU)."""
    members = [MLP().eval() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 8),))
    (program,) = executor.build(planner.propose(graph, n_members=N), members).programs
    assert _labels(program, CUDA) == ["vmap", "wide", "loop", "compile", "compile/reduce-overhead", "cuda_graph"]
    assert _labels(program, CUDA, None, Budget(compile_modes=COMPILE_MODES)) == [
        "vmap", "wide", "loop", "compile", "compile/max-autotune-no-cudagraphs", "compile/reduce-overhead", "cuda_graph"]
    assert _labels(program, CPU) == ["vmap", "wide", "loop", "compile"]  # as before the modes existed
    assert _labels(program, CUDA, {Strategy.VMAP, Strategy.COMPILE}) == ["vmap", "compile", "compile/reduce-overhead"]
    assert _labels(program, CUDA, {Strategy.VMAP}) == ["vmap"]
    # a budget may narrow the modes, or ask for more on CPU; reduce-overhead needs CUDA whatever it says
    assert _labels(program, CUDA, None, Budget(compile_modes=("",))) == ["vmap", "wide", "loop", "compile", "cuda_graph"]
    assert stage_compile_modes(CPU, Budget(compile_modes=COMPILE_MODES)) == ("", "max-autotune-no-cudagraphs")
    assert stage_compile_modes(CUDA) == ("", "reduce-overhead") and stage_compile_modes(CPU, BUDGETS["quick"]) == ("",)
    for s, m in stage_candidates(program, CUDA):  # each label names its mode and the mode comes back out of it
        assert compile_mode_of_label(strategy_label(s, None, compile_mode=m)) == m
    assert compile_mode_of_label("merged/compile/reduce-overhead") == "" and compile_mode_of_label("wide/conv=bmm") == ""


@pytest.fixture
def recorded_modes(monkeypatch):
    """torch.compile's `mode` argument of every compile, compiled with aot_eager (seconds, not minutes, on CPU)."""
    seen = []
    real = torch.compile

    def recording(fn, **kwargs):
        seen.append(kwargs.get("mode"))
        return real(fn, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", 0.0)  # the MLP's stage is all launch overhead
    return seen


def test_the_chosen_stage_mode_is_recorded_in_the_plan_and_rebuilt_from_its_json(recorded_modes):
    """On CPU a budget can ask for max-autotune-no-cudagraphs: the stage's race runs it, checks it against the loop,
    records it as the stage's "[compile: mode=...]" tag, and a build of the saved plan compiles in that mode."""
    torch.manual_seed(0)
    members = [MLP().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    start = copy.deepcopy(members)
    budget = Budget(compile_modes=("max-autotune-no-cudagraphs",))
    tuned, found = tune(plan, members, (x,), strategies=["compile"], budget=budget, repeats=3)
    (result,) = found["s0"]
    assert result.strategy == "compile/max-autotune-no-cudagraphs" and result.ok and result.max_rel_err <= 1e-4
    assert "max-autotune-no-cudagraphs" in recorded_modes
    (stage,) = tuned.stages
    assert stage.options.strategy is Strategy.COMPILE and compile_mode_of(stage.options) == "max-autotune-no-cudagraphs"
    assert "autotune chose compile/max-autotune-no-cudagraphs" in stage.options.note
    loaded = planner.Plan.loads(tuned.dumps())
    assert loaded == tuned and compile_mode_of(loaded.stages[0].options) == "max-autotune-no-cudagraphs"
    recorded_modes.clear()
    ens = executor.build(loaded, copy.deepcopy(start))
    with torch.no_grad():
        for batch in (5, 5, 3):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in start]), rtol=1e-5, atol=1e-6)
    assert recorded_modes and set(recorded_modes) == {"max-autotune-no-cudagraphs"}


def test_a_plan_without_modes_keeps_its_json():
    """Default-mode compile stages and other strategies carry no tag: their plan files are as before."""
    members = [MLP().eval() for _ in range(N)]
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 8),)), n_members=N)
    default = _plan("", members)
    assert "[compile:" not in plan.dumps() and "[compile:" not in default.dumps()
    assert compile_mode_of(planner.Plan.loads(default.dumps()).stages[0].options) == ""


def _results(found) -> dict:
    return {r.strategy: r for results in found.values() for r in results}


def test_the_other_modes_are_not_tried_where_the_default_mode_failed(recorded_modes):
    members = [MLP().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)

    def no_default_compile(stage, label):
        if label == "compile":
            raise RuntimeError("injected: inductor cannot lower this stage")

    with fault_hook(no_default_compile):
        tuned, found = tune(plan, members, (x,), strategies=["vmap", "compile"], repeats=3,
                            budget=Budget(compile_modes=("", "max-autotune-no-cudagraphs")))
    results = _results(found)
    assert not results["compile"].ok
    skipped = results["compile/max-autotune-no-cudagraphs"]
    assert not skipped.ok and skipped.error.startswith("not tried: compile failed in its default mode")
    assert "max-autotune-no-cudagraphs" not in recorded_modes
    assert tuned.stages[0].options.strategy is Strategy.VMAP


@pytest.mark.parametrize("budget, compile_min_ms, why", [
    (Budget(compile_modes=("", "max-autotune-no-cudagraphs")), 1e9, "not tried: the stage takes"),
    (Budget(compile=False, compile_modes=("", "max-autotune-no-cudagraphs")), 0.0, "not tried: the autotune budget skips"),
])
def test_compile_modes_are_pruned_by_the_rules_compile_is(monkeypatch, budget, compile_min_ms, why):
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", compile_min_ms)
    members = [MLP().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    _, found = tune(plan, members, (x,), strategies=["vmap", "compile"], repeats=3, budget=budget)
    results = _results(found)
    for label in ("compile", "compile/max-autotune-no-cudagraphs"):
        assert not results[label].ok and results[label].error.startswith(why), results[label]
    assert results["vmap"].ok


def test_the_whole_plan_graph_candidate_compiles_reduce_overhead_stages_in_the_default_mode():
    """reduce-overhead's own CUDA graphs cannot be recorded inside the whole-plan graph's capture."""
    members = [MLP() for _ in range(N)]
    graph = planner.trace(members[0], (torch.randn(5, 8),))
    plan = planner.split(planner.propose(graph, n_members=N), graph, "s0", "relu")
    ro = with_compile_mode(planner.StageOptions(strategy=Strategy.COMPILE, note="autotune chose compile/reduce-overhead"),
                           "reduce-overhead")
    mat = with_compile_mode(planner.StageOptions(strategy=Strategy.COMPILE), "max-autotune-no-cudagraphs")
    plan = plan.with_stages([planner.Stage(s.id, s.nodes, s.mode, s.reason, o) for s, o in zip(plan.stages, (ro, mat))])
    whole = whole_plan_graph(plan)
    assert whole.capture and [compile_mode_of(s.options) for s in whole.stages] == ["", "max-autotune-no-cudagraphs"]
    assert all(s.options.strategy is Strategy.COMPILE for s in whole.stages)
    assert whole_plan_graph(plan.with_stages([planner.Stage(s.id, s.nodes, s.mode, s.reason, mat) for s in plan.stages])) \
        == plan.with_stages([planner.Stage(s.id, s.nodes, s.mode, s.reason, mat) for s in plan.stages]).with_capture(True)


@pytest.mark.gpu
def test_on_cuda_a_stage_races_compile_in_every_mode_against_the_loop(monkeypatch):
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", 0.0)  # the small stage would skip compile otherwise
    torch.manual_seed(0)
    members = [MLP().cuda().eval() for _ in range(N)]
    x = torch.randn(64, 8, device="cuda")
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    start = copy.deepcopy(members)
    tuned, found = tune(plan, members, (x,), device="cuda", strategies=["vmap", "loop", "compile"], repeats=5,
                        budget=Budget(compile_modes=COMPILE_MODES))
    results = _results(found)
    for label in ("compile", "compile/max-autotune-no-cudagraphs", "compile/reduce-overhead"):
        assert results[label].ok, (label, results[label].error)  # run and checked against the member loop
        assert results[label].max_rel_err <= 1e-4
    stage = tuned.stages[0]
    chosen = stage.options.note.split("autotune chose ")[1].split(" ")[0]
    # the whole-plan graph (tuned.capture) compiles a reduce-overhead stage in the default mode inside it
    want = "" if tuned.capture and compile_mode_of_label(chosen) == "reduce-overhead" else compile_mode_of_label(chosen)
    assert compile_mode_of(stage.options) == want
    ens = executor.build(planner.Plan.loads(tuned.dumps()), copy.deepcopy(start), device="cuda")
    with torch.no_grad():
        for batch in (64, 64, 32):
            x = torch.randn(batch, 8, device="cuda")
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in start]), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_on_cuda_the_chosen_stage_mode_is_recorded_and_rebuilt(monkeypatch, mode):
    monkeypatch.setattr(autotune_module, "COMPILE_MIN_MS", 0.0)
    torch.manual_seed(0)
    members = [MLP().cuda().eval() for _ in range(N)]
    x = torch.randn(64, 8, device="cuda")
    graph = planner.trace(members[0], (x,))
    plan = planner.split(planner.propose(graph, n_members=N), graph, "s0", "relu")  # two stages: whole-plan candidates too
    start = copy.deepcopy(members)
    tuned, found = tune(plan, members, (x,), device="cuda", strategies=["compile"], repeats=5,
                        budget=Budget(compile_modes=(mode,)))
    raced = [r for results in found.values() for r in results if r.strategy == f"compile/{mode}"]
    assert len(raced) == 2 and all(r.ok for r in raced), [(r.strategy, r.error) for r in raced]
    modes = {compile_mode_of(s.options) for s in tuned.stages if s.options.strategy is Strategy.COMPILE}
    assert modes <= {mode, ""}  # "" only where the whole-plan graph won (reduce-overhead runs default inside it)
    ens = executor.build(planner.Plan.loads(tuned.dumps()), copy.deepcopy(start), device="cuda")
    outs = []
    with torch.no_grad():
        for batch in (64, 64, 32, 64):
            x = torch.randn(batch, 8, device="cuda")
            outs.append((x, ens(x)))
        for x, out in outs:  # earlier outputs are still theirs
            torch.testing.assert_close(out, torch.stack([m(x) for m in start]), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_a_reduce_overhead_stage_replays_one_graph_back_to_back_after_someone_marked_a_step():
    """Once anyone in the process calls torch.compiler.cudagraph_mark_step_begin (a user's own loop, a benchmark's
    peer), cudagraph trees go by that counter: back-to-back calls of a reduce-overhead stage were one step, each call
    a node deeper in the tree (warm-up, a new recording) instead of a replay. Each no-grad call is a step of its own."""
    torch.manual_seed(0)
    members = [MLP().cuda().eval() for _ in range(N)]
    ens = executor.build(_plan("reduce-overhead", members), copy.deepcopy(members), device="cuda")
    x = torch.randn(5, 8, device="cuda")
    want = torch.stack([m(x) for m in members]).detach()
    with torch.no_grad():
        torch.compiler.cudagraph_mark_step_begin()  # as a user's loop or another compiled model would
        for _ in range(4):  # compile, warm up, record
            ens(x)
        held = cudagraph_tree_graphs(torch.cuda.current_device())
        outs = [ens(x) for _ in range(12)]
    assert held >= 1 and cudagraph_tree_graphs(torch.cuda.current_device()) == held, "back-to-back calls recorded new graphs instead of replaying"
    for out in outs:  # every output its own copy, none overwritten by a later replay
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_a_gradient_penalty_through_a_compile_stage_names_the_stage_and_the_fix(monkeypatch):
    """torch.compile's backward cannot be differentiated again: a bare RuntimeError from torch before."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).eval() for _ in range(3)]
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(5, 6),))
    plan = planner.propose(graph, n_members=3, input_mode="per_member")
    for s in plan.stages:
        plan = planner.set_options(plan, graph, s.id, strategy=Strategy.COMPILE)
    ens = executor.build(plan, copy.deepcopy(members)).eval()
    x = torch.randn(3, 5, 6, requires_grad=True)
    with pytest.raises(planner.ExecutionError, match=r"stage s0 runs strategy 'compile'.*create_graph=True.*strategy='vmap'"):
        torch.autograd.grad(ens(x).sum(), x, create_graph=True)
    ens(x).square().sum().backward()  # a plain backward still runs, as the loop's
    for m, xi in zip(members, x.detach()):
        m(xi).square().sum().backward()
    for name, p in ens.named_stacked_parameters():
        torch.testing.assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in members]),
                                   rtol=1e-5, atol=1e-6)
