"""torch.compile modes for compile stages ("[compile: mode=...]" in the stage's options) and the whole-model
compile candidates autotune adds on a GPU. Without a GPU the plumbing is checked: the tag's round trip, the mode
reaching torch.compile, the refusals; the GPU tier compiles for real."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.autotune import _merged_label, merged_alternatives
from stagewise.executor.strategies import compiled
from stagewise.executor.strategies.compiled import COMPILE_MODES, compile_mode_of, with_compile_mode

N = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _plan(mode: str, members):
    graph = planner.trace(members[0], (torch.randn(5, 8),))
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


def test_the_mode_survives_the_plan_json_and_reaches_torch_compile(monkeypatch):
    seen = []
    real = torch.compile

    def recording(fn, **kwargs):
        seen.append(kwargs.get("mode"))
        return real(fn, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    torch.manual_seed(0)
    members = [MLP().eval() for _ in range(N)]
    plan = planner.Plan.loads(_plan("max-autotune-no-cudagraphs", members).dumps())
    ens = executor.build(plan, copy.deepcopy(members))
    x = torch.randn(5, 8)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    assert seen == ["max-autotune-no-cudagraphs"]


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
    assert gpu == ["merged/compile", "merged/compile/max-autotune-no-cudagraphs", "merged/compile/reduce-overhead",
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
