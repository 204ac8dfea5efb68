"""Every stage strategy of every sample model against the member loop (float32, rel err <= 1e-4),
plus the wide kernels one by one against N separate layers."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor
from stagewise import planner
from stagewise.executor.baselines import stack_outputs
from stagewise.executor.profile import max_rel_error
from stagewise.executor.stages import LoopRunner, runner_for
from stagewise.executor.strategies import CPU_REFUSAL, CompileRunner, WideRunner, compiled, wide_layers, wide_rule_gaps
from stagewise.executor.strategies.wide_layers import gru
from stagewise.executor.strategies.wide_ops import NFirst, linear
from stagewise.planner.plan import StageMode, StageOptions, Strategy

from conftest import SAMPLE_NAMES

N = 3
RTOL = 1e-4


def with_strategy(plan, strategy: Strategy, excluded_too: bool = False):
    """All batched stages (and, for wide, excluded ones when asked) set to `strategy`."""
    stages = [replace(s, options=StageOptions(strategy=strategy))
              if s.mode is StageMode.BATCHED or excluded_too else s for s in plan.stages]
    return plan.with_stages(stages)


def check(src, plan):
    """The plan's outputs vs the member loop's, worst member normwise (executor.verify also checks
    every stage boundary, at the price of a retrace per member: too slow for this many cases)."""
    inputs = executor.batched_inputs(plan, src.example_inputs)
    members = src.members(plan.n_members)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = executor.build(plan, members, example_inputs=executor.member_inputs(plan, inputs, 0))
        with torch.no_grad():
            got = module(*inputs)
    want = stack_outputs(executor.loop_outputs(plan, members, inputs))
    err = max_rel_error(got, want)
    assert err <= RTOL, f"{plan.model}: max rel err {err:.2e} vs the member loop"


@pytest.fixture
def fast_compile(monkeypatch):
    """torch.compile through dynamo + AOT autograd but without inductor's C++ build: the plumbing, in seconds."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


@pytest.mark.parametrize("strategy, mode", [(Strategy.VMAP, "shared"), (Strategy.VMAP, "per_member"), (Strategy.WIDE, "shared"),
                                            (Strategy.WIDE, "per_member"), (Strategy.LOOP, "per_member")])
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_eager_strategies_match_the_loop(sample, name, strategy, mode):
    src, graph = sample(name)
    plan = with_strategy(planner.propose(graph, N, mode), strategy)
    check(src, plan)


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("name", ["cnn", "resblock"])
def test_wide_grouped_convolution_matches_the_loop(sample, name, mode, monkeypatch):
    """The grouped-conv path GPUs take (CPU loops the conv per member), checked here on CPU."""
    monkeypatch.setattr(wide_layers, "GROUPED_CONV_ON_CPU", True)
    src, graph = sample(name)
    check(src, with_strategy(planner.propose(graph, N, mode), Strategy.WIDE))


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_compile_strategy_matches_the_loop(sample, name, fast_compile):
    src, graph = sample(name)
    check(src, with_strategy(planner.propose(graph, N, "per_member"), Strategy.COMPILE))


@pytest.mark.slow
def test_compile_with_inductor_matches_the_loop(sample):
    src, graph = sample("mlp")
    check(src, with_strategy(planner.propose(graph, N), Strategy.COMPILE))


@pytest.mark.parametrize("name", ["transformer_block", "gru"])
def test_wide_batches_stages_vmap_cannot(sample, name):
    """SDPA and nn.GRU have no vmap batching rule on CPU; wide runs their excluded stages batched."""
    src, graph = sample(name)
    plan = planner.propose(graph, N)
    excluded = [s for s in plan.stages if s.mode is StageMode.EXCLUDED]
    assert excluded
    wide = with_strategy(plan, Strategy.WIDE, excluded_too=True)
    module = executor.build(wide, src.members(N))
    for program, runner in zip(module.programs, module.runners):
        assert isinstance(runner, WideRunner)
        assert wide_rule_gaps(program) == []
    check(src, wide)


def test_excluded_stage_runs_as_loop_unless_wide(sample):
    src, graph = sample("transformer_block")
    plan = planner.propose(graph, N)
    module = executor.build(with_strategy(plan, Strategy.VMAP, excluded_too=True), src.members(N))
    kinds = {p.stage.mode: type(r) for p, r in zip(module.programs, module.runners)}
    assert issubclass(kinds[StageMode.EXCLUDED], LoopRunner)


def test_wide_on_data_dependent_stage_fails_with_a_named_error(sample):
    src, graph = sample("data_dependent")
    plan = with_strategy(planner.propose(graph, N), Strategy.WIDE, excluded_too=True)
    item_stage = next(s for s in plan.stages if any("item" in n for n in s.nodes))
    module = executor.build(plan, src.members(N))
    program = next(p for p in module.programs if p.stage.id == item_stage.id)
    assert wide_rule_gaps(program)  # .item() has no wide rule: autotune does not offer wide here
    with pytest.raises(planner.ExecutionError, match=rf"stage {item_stage.id} .*failed \(wide\)"):
        with torch.no_grad():
            module(*src.example_inputs)


def test_cuda_graph_is_refused_on_cpu_with_the_reason(sample):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    src, graph = sample("mlp")
    plan = with_strategy(planner.propose(graph, N), Strategy.CUDA_GRAPH)
    with pytest.raises(planner.ExecutionError, match="cuda_graph needs a CUDA device"):
        executor.build(plan, src.members(N))
    assert "on CPU use" in CPU_REFUSAL


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlp", "resblock", "transformer_block"])
def test_cuda_graph_matches_the_loop_on_gpu(sample, name):
    src, graph = sample(name)
    plan = with_strategy(planner.propose(graph, N), Strategy.CUDA_GRAPH)
    inputs = executor.batched_inputs(plan, tuple(x.cuda() for x in src.example_inputs))
    members = [m.cuda() for m in src.members(N)]
    report = executor.verify(plan, members, inputs, device="cuda")
    assert report.ok, report.to_text()


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", [Strategy.VMAP, Strategy.WIDE, Strategy.COMPILE])
def test_strategies_match_the_loop_on_gpu(sample, strategy):
    src, graph = sample("resblock")
    plan = with_strategy(planner.propose(graph, N), strategy)
    members = [m.cuda() for m in src.members(N)]
    report = executor.verify(plan, members, tuple(x.cuda() for x in src.example_inputs), device="cuda")
    assert report.ok, report.to_text()


def test_compile_runner_reports_compile_time(sample, fast_compile):
    src, graph = sample("mlp")
    plan = with_strategy(planner.propose(graph, N), Strategy.COMPILE)
    module = executor.build(plan, src.members(N))
    with torch.no_grad():
        module(*src.example_inputs)
    (runner,) = module.runners
    assert isinstance(runner, CompileRunner) and runner.compile_seconds > 0


# --- the wide kernels against N separate layers -----------------------------------------------

def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("shared_x", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_wide_linear_matches_separate_layers(shared_x, bias):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5, bias=bias) for _ in range(4)]
    x = torch.randn(2, 3, 6) if shared_x else torch.randn(4, 2, 3, 6)
    w = NFirst(torch.stack([m.weight for m in layers]))
    b = NFirst(torch.stack([m.bias for m in layers])) if bias else None
    with torch.no_grad():
        got = linear(x if shared_x else NFirst(x), w, b, 4)
        want = torch.stack([m(x if shared_x else x[i]) for i, m in enumerate(layers)])
    assert got.shape == want.shape == (4, 2, 3, 5)
    assert rel_err(got, want) <= RTOL


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("layers", [1, 2])
def test_wide_gru_matches_separate_grus(batch_first, layers):
    torch.manual_seed(0)
    grus = [nn.GRU(5, 7, num_layers=layers, batch_first=batch_first).eval() for _ in range(3)]
    x = torch.randn(3, 2, 4, 5)  # [N, B, T, in] or [N, T, B, in]
    state = {k: torch.stack([dict(g.named_parameters())[k] for g in grus]) for k, _ in grus[0].named_parameters()}
    with torch.no_grad():
        out, h = gru(grus[0], state, (NFirst(x),), {}, 3)
        want = [g(x[i]) for i, g in enumerate(grus)]
    assert rel_err(out.t, torch.stack([w[0] for w in want])) <= RTOL
    assert rel_err(h.t, torch.stack([w[1] for w in want])) <= RTOL


def test_wide_sdpa_folds_members_into_leading_dims(sample):
    src, graph = sample("transformer_block")
    plan = with_strategy(planner.propose(graph, N), Strategy.WIDE, excluded_too=True)
    sdpa_stage = next(s for s in plan.stages if s.mode is StageMode.EXCLUDED)
    module = executor.build(plan, src.members(N))
    program = next(p for p in module.programs if p.stage.id == sdpa_stage.id)
    runner = runner_for(program, N, {}, [{}] * N)
    assert isinstance(runner, WideRunner)
    q = torch.randn(N, 2, 4, 5, 8)
    from stagewise.executor.values import Batched, PerMember

    (out,) = runner([Batched(q), Batched(q), Batched(q)])
    (ref,) = LoopRunner(program, N, {}, [{}] * N)([Batched(q), Batched(q), Batched(q)])
    assert isinstance(ref, PerMember)
    assert rel_err(out.tree, torch.stack(ref.values)) <= RTOL
    assert rel_err(out.tree, F.scaled_dot_product_attention(q, q, q)) <= RTOL


def test_bound_loop_sees_in_place_updates_of_the_stacked_state(sample):
    """The loop's per-member copies read the stacked state itself, not a snapshot."""
    src, graph = sample("mlp")
    plan = with_strategy(planner.propose(graph, N), Strategy.LOOP)
    module = executor.build(plan, src.members(N))
    x = src.example_inputs[0]
    with torch.no_grad():
        before = module(x)
        module.stacked_state["fc2.bias"].add_(1.0)
        after = module(x)
    assert torch.allclose(after, before + 1.0, atol=1e-5)


def test_sibling_linears_run_as_one_gemm(sample):
    """q, k and v read one value: the wide runner computes them with one concatenated GEMM."""
    src, graph = sample("transformer_block")
    plan = with_strategy(planner.propose(graph, N), Strategy.WIDE, excluded_too=True)
    module = executor.build(plan, src.members(N))
    groups = [g for r in module.runners for g in r._fused.values()]
    assert ["q", "k", "v"] in groups
    check(src, plan)


# --- the wide runner's direct Linear steps (weights transposed once, activation in place) -------

class _LinearChain(nn.Module):
    """Linear -> act (fused in place) -> Linear read twice (not fused) -> act -> Linear on a 4-D input."""

    def __init__(self, act: nn.Module, bias: bool):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(6, 8, bias=bias), act
        self.fc2, self.act2 = nn.Linear(8, 8, bias=bias), nn.Tanh()
        self.fc3 = nn.Linear(8, 5, bias=bias)

    def forward(self, x):
        h = self.fc2(self.act1(self.fc1(x)))
        return self.fc3(self.act2(h) + h)


def _wide_chain(act, bias, mode, shape=(4, 6)):
    torch.manual_seed(0)
    members = [_LinearChain(act, bias).eval() for _ in range(N)]
    example = (torch.randn(*shape),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(members[0], example)
        plan = with_strategy(planner.propose(graph, N, mode), Strategy.WIDE)
        inputs = executor.batched_inputs(plan, example)
        module = executor.build(plan, members)
    return plan, members, inputs, module


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.LeakyReLU(0.2), nn.Sigmoid()],
                         ids=lambda m: repr(m))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6), (6,)])
def test_wide_linear_steps_match_the_loop(act, bias, mode, shape):
    plan, members, inputs, module = _wide_chain(act, bias, mode, shape)
    runner = module.runners[0]
    assert isinstance(runner, WideRunner) and len(plan.stages) == 1
    assert len(runner._program[2]) < len(runner.program.module.graph.nodes) - 2  # fc1 + act1 are one step
    with torch.no_grad():
        got = module(*inputs)
        again = module(*inputs)  # the in-place activation never touches an input or a cached weight
    want = stack_outputs(executor.loop_outputs(plan, members, inputs))
    assert max_rel_error(got, want) <= RTOL
    assert torch.equal(got, again)


def test_wide_linear_steps_see_in_place_weight_updates():
    """The [N, in, out] copy made at construction is remade when the stacked weight changes in place."""
    plan, members, inputs, module = _wide_chain(nn.ReLU(), True, "shared")
    with torch.no_grad():
        module(*inputs)
        module.stacked_state["fc1.weight"].mul_(0.5)
        module.stacked_state["fc3.bias"].add_(1.0)
        got = module(*inputs)
        for i, m in enumerate(members):
            m.fc1.weight.mul_(0.5)
            m.fc3.bias.add_(1.0)
    want = stack_outputs(executor.loop_outputs(plan, members, inputs))
    assert max_rel_error(got, want) <= RTOL


def _wide_wherever_it_applies(src, graph, mode: str):
    """The sample's plan on `wide`: every batched stage (ops without a wide rule run under vmap of
    the op there), and every excluded stage whose nodes all have a wide rule (others stay the loop)."""
    plan = planner.propose(graph, N, mode)
    all_wide = with_strategy(plan, Strategy.WIDE, excluded_too=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = executor.build(all_wide, src.members(N), example_inputs=src.example_inputs)
    loop = {p.stage.id for p in module.programs if p.stage.mode is StageMode.EXCLUDED and wide_rule_gaps(p)}
    return plan.with_stages([s if s.id in loop else ws for s, ws in zip(plan.stages, all_wide.stages)])


def _update_members_like_an_optimizer(module, members, how: str, seed: int) -> None:
    """One update of every member's float state, different per member, applied both to the
    stacked state (in place: the version counter moves; or `.data =`: the storage moves) and to
    each member, so the member loop is the reference for the updated weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in module.stacked_state.items():
            if not t.is_floating_point():
                continue
            new = t * (1 + 0.3 * torch.rand(t.shape, generator=gen))
            if not key.endswith("running_var"):  # keep variances positive
                new += 0.1 * torch.randn(t.shape, generator=gen)
            if how == "in_place":
                t.copy_(new)
            else:
                t.data = new
            for i, m in enumerate(members):
                {**dict(m.named_parameters()), **dict(m.named_buffers())}[key].copy_(new[i])


@pytest.mark.parametrize("how, mode", [("in_place", "shared"), ("in_place", "per_member"), ("new_storage", "shared")])
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_wide_sees_updates_of_the_stacked_state(sample, name, how, mode):
    """After an optimizer-style update of BatchedModule.stacked_state the wide path equals the loop
    over members given the same update: every cached re-layout (transposed weights, concatenated
    sibling weights, bias views) is remade, on every sample, twice in a row."""
    src, graph = sample(name)
    plan = _wide_wherever_it_applies(src, graph, mode)
    if how == "new_storage" and any(s.options.strategy is not Strategy.WIDE for s in plan.stages):
        pytest.skip("a stage runs as the loop, whose per-member views do not follow new storage")
    assert any(s.options.strategy is Strategy.WIDE for s in plan.stages)
    members = src.members(N)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = executor.build(plan, members, example_inputs=executor.member_inputs(plan, inputs, 0))
    with torch.no_grad():
        module(*inputs)  # fills the caches
        for step in range(2):
            _update_members_like_an_optimizer(module, members, how, seed=step)
            got = module(*inputs)
            want = stack_outputs(executor.loop_outputs(plan, members, inputs))
            assert max_rel_error(got, want) <= RTOL, f"{name}: update {step + 1}, max rel err {max_rel_error(got, want):.2e}"


def test_wide_linear_steps_keep_autograd():
    """With gradients recorded the steps take the interpreted path: same values, gradients flow to the input."""
    plan, members, inputs, module = _wide_chain(nn.GELU(), True, "per_member")
    x = inputs[0].clone().requires_grad_(True)
    got = module(x)
    got.sum().backward()
    want = stack_outputs(executor.loop_outputs(plan, members, (x.detach(),)))
    assert max_rel_error(got.detach(), want) <= RTOL
    xs = x.detach().clone().requires_grad_(True)
    torch.stack([m(xs[i]) for i, m in enumerate(members)]).sum().backward()
    assert rel_err(x.grad, xs.grad) <= RTOL
