"""executor.profile(..., train=True): time a training step of the plan against the two ways users train N models.

End to end, one step = forward of all members + backward + optimizer step, timed round-robin in
the same run for:

- "stagewise": the plan's batched module in train() mode, loss = sum over members of each
  member's loss, one stacked optimizer (executor.StackedSGD / StackedAdam) over its [N, ...] parameters;
- "loop": N separate models, each with its own torch.optim optimizer (torch's defaults), one after another;
- "torch.func": the functorch recipe: `vmap(grad(loss of functional_call(member 0, params_i, inputs_i)))`
  over the stacked parameters, then one torch.optim optimizer with foreach=True over the stacked
  parameters (scalar hyper-parameters: the recipe has no per-member lr).

The loss is a surrogate that every model has: the mean square of each floating-point output
leaf, summed over leaves (over members for the batched ways). Before timing, each way's per-member
gradients of one step are compared with the loop's (normwise, worst member), the plan's at
verify(grads=True)'s tolerance for its precision and the members' (stage_grads.grads_tolerance: 1e-4
in float32, 0.25 for a bfloat16 / float16 plan or members), torch.func's at the members' own
(members_grads_rtol), as each stage's: that checks forward and backward; the optimizers themselves
are checked in tests/test_optim.py. A model with dropout is compared in eval() mode (masks differ between ways) and timed in train() mode.

Per stage, forward + backward through the stage alone: its runner on its real inputs (the outputs
of the stages before it, float ones made leaves that require grad, a per_member Python number never:
stage_grads.per_member_numbers), surrogate loss = its float outputs weighted by fixed random
numbers (the same for both sides), `torch.autograd.grad` for its parameters and those inputs; the plan's strategy and
the stage's member loop, their gradients compared. No optimizer step per stage. A stage that writes
into its inputs in place has only its parameters differentiated.

State: as executor.profile, the caller's members are never run (private copies, made once per call),
and the batched module's state is put back before each checked run (stage candidates, the loop's,
the training step end to end), so a forward that updates buffers is checked from one starting state.
"""
from __future__ import annotations

import copy
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from stagewise.planner.errors import ExecutionError, StagewiseError
from stagewise.planner.plan import Plan, Strategy
from stagewise.executor.autotune_train import tune_training
from stagewise.executor.build import BatchedModule, build, resolve_device
from stagewise.executor.input_writes import FreshInputs
from stagewise.executor.candidates import (SavedTensors, advance, loop_reference, max_rel_error, on_device, private_members,
                                           stage_inputs, state_kept, strategy_label, time_candidates, try_strategy)
from stagewise.executor.optim import StackedAdam, StackedSGD
from stagewise.executor.profile import Ticks, device_name, number_loop_note, stage_flops, write_chrome_trace
from stagewise.executor.report import ProfileReport, StageProfile, StrategyResult
from stagewise.executor.stage_grads import (GRADS_RTOL, float_leaves, fwd_bwd, grads_check, grads_tolerance,
                                            members_grads_rtol, per_member_numbers)
from stagewise.executor.stages import LoopRunner, Runner, StageProgram
from stagewise.executor.verify import member_inputs

OPTIMIZERS = ("adam", "sgd")


# --- losses ----------------------------------------------------------------------------------------

def member_loss(out: Any) -> torch.Tensor:
    """One member's surrogate loss: mean square of each float output leaf, summed over leaves."""
    leaves = float_leaves(out)
    if not leaves:
        raise ExecutionError("the model returns no floating-point tensor to take a training loss of; profile it without train=True")
    return sum((x.float() ** 2).mean() for x in leaves)


def batched_loss(out: Any, n: int) -> torch.Tensor:
    """Sum over members of member_loss of member i's output (every leaf N-first)."""
    leaves = float_leaves(out)
    if not leaves:
        raise ExecutionError("the model returns no floating-point tensor to take a training loss of; profile it without train=True")
    return sum((x.float() ** 2).reshape(n, -1).mean(1).sum() for x in leaves)


# --- the three training steps ------------------------------------------------------------------------

def stacked_optimizer(name: str, params: list, n: int, lr: float) -> torch.optim.Optimizer:
    return StackedAdam(params, n, lr=lr) if name == "adam" else StackedSGD(params, n, lr=lr, momentum=0.9)


def torch_optimizer(name: str, params, lr: float, **kw) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, **kw) if name == "adam" else torch.optim.SGD(params, lr=lr, momentum=0.9, **kw)


class TrainingStep:
    """One way of training N members: `grads()` runs forward + backward and returns the per-member
    gradients {name: [N, ...]}; `step()` is grads() plus the optimizer step (what is timed)."""

    def grads(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def step(self) -> None:
        self.grads()
        self.opt.step()

    def train(self, mode: bool) -> None:
        raise NotImplementedError


class StagewiseStep(TrainingStep):
    def __init__(self, module: BatchedModule, inputs: tuple, optimizer: str, lr: float):
        self.module, self.inputs, self.n = module, inputs, module.n_members
        self.params = module.named_stacked_parameters()
        self.opt = stacked_optimizer(optimizer, [p for _, p in self.params], self.n, lr)

    def grads(self):
        self.opt.zero_grad(set_to_none=True)
        batched_loss(self.module(*self.inputs), self.n).backward()
        return {k: p.grad for k, p in self.params}

    def train(self, mode):
        self.module.train(mode)


class LoopStep(TrainingStep):
    def __init__(self, plan: Plan, members: Sequence[nn.Module], inputs: tuple, optimizer: str, lr: float):
        self.models = [copy.deepcopy(m) for m in members]
        self.per_member = [member_inputs(plan, inputs, i) for i in range(len(members))]
        self.opts = [torch_optimizer(optimizer, m.parameters(), lr) for m in self.models]

    def grads(self):
        for m, x, opt in zip(self.models, self.per_member, self.opts):
            opt.zero_grad(set_to_none=True)
            member_loss(m(*x)).backward()
        names = [k for k, p in self.models[0].named_parameters() if p.requires_grad]
        return {k: torch.stack([dict(m.named_parameters())[k].grad for m in self.models]) for k in names}

    def step(self):
        for m, x, opt in zip(self.models, self.per_member, self.opts):
            opt.zero_grad(set_to_none=True)
            member_loss(m(*x)).backward()
            opt.step()

    def train(self, mode):
        for m in self.models:
            m.train(mode)


class TorchFuncStep(TrainingStep):
    """vmap(grad(...)) over stacked parameters, then one foreach torch.optim step over them."""

    def __init__(self, plan: Plan, members: Sequence[nn.Module], inputs: tuple, optimizer: str, lr: float):
        from torch.func import functional_call, grad, vmap

        self.base = copy.deepcopy(members[0])
        named = [(k, p) for k, p in members[0].named_parameters() if p.requires_grad]
        with torch.no_grad():
            self.params = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in members]) for k, _ in named}
            self.buffers = {k: torch.stack([dict(m.named_buffers())[k] for m in members]) for k, _ in members[0].named_buffers()}
        for p in self.params.values():
            p.grad = None
        base, self.inputs = self.base, inputs

        def loss(params, buffers, *xs):
            return member_loss(functional_call(base, (params, buffers), xs))

        dims = tuple(0 if spec.mode.value == "per_member" else None for spec in plan.inputs)
        self._grad = lambda: vmap(grad(loss), in_dims=(0, 0, *dims), randomness="different")(self.params, self.buffers, *inputs)
        self.opt = torch_optimizer(optimizer, list(self.params.values()), lr, foreach=True)

    def grads(self):
        g = self._grad()
        for k, p in self.params.items():
            p.grad = g[k]
        return g

    def train(self, mode):
        self.base.train(mode)


def has_dropout(module: nn.Module) -> bool:
    """True when some dropout layer would draw a random mask in train() mode (the ways would then differ)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


# --- the profile -------------------------------------------------------------------------------------

def profile_training(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, device, repeats: Optional[int],
                     warmup: int, baselines: bool, progress, autotune: bool, optimizer: str, lr: float,
                     trace_path: Optional[str], budget: str = "default") -> ProfileReport:
    """executor.profile(..., train=True); see the module docstring. Args as executor.profile's."""
    if optimizer not in OPTIMIZERS:
        raise StagewiseError(f"profile(train=True, optimizer={optimizer!r}): unknown optimizer; use one of {', '.join(OPTIMIZERS)}")
    started = time.perf_counter()
    dev = resolve_device(device)
    inputs = on_device(tuple(inputs), dev)
    members = private_members(members, dev, "profile")  # the caller's modules are never run
    ticks = Ticks(progress, len(plan.stages) + 2 + (1 if trace_path else 0))
    candidates: dict[str, list[StrategyResult]] = {}
    notes = []
    if autotune:
        plan, candidates = tune_training(plan, members, inputs, device=dev, progress=ticks.nested("autotune"), repeats=repeats,
                                         warmup=warmup, budget=budget)
        notes.append("autotune chose each stage's strategy by its forward + backward time (training-capable strategies only)")
    example = member_inputs(plan, inputs, 0)
    module = build(plan, members, example_inputs=example, device=dev)  # stacks copies of the members' state
    module.train()
    with state_kept(members[:1]):  # a torch.export trace may run forward
        flops = {k: 3 * v for k, v in stage_flops(plan, members[0], example).items()}  # backward ~ 2x the forward
    start = SavedTensors(module.stacked_state.values())  # every check starts from the state the loop starts from
    rtol = grads_tolerance(plan, members)  # verify(grads=True)'s, at the plan's and the members' own precision
    stages = _profile_stages(module, inputs, dev, repeats, warmup, ticks, flops, candidates, start, rtol=rtol)
    start.restore()  # the stages' runs moved it: the training step end to end is checked from the start
    del start
    fresh = FreshInputs(inputs, bool(module.__dict__.get("_written_inputs")))  # forward() writes them: copies
    end_to_end, base = _profile_steps(plan, module, members, fresh, dev, repeats, warmup, ticks, baselines, optimizer, lr, notes)
    trace_file = None
    if trace_path:
        ticks("chrome trace")
        step = StagewiseStep(module, fresh.values, optimizer, lr)
        trace_file = write_chrome_trace(module, fresh.values, trace_path, dev, step=fresh.timed(step.step))
    ticks.finish()
    notes += [f"training step: forward + backward + {'Adam' if optimizer == 'adam' else 'SGD (momentum 0.9)'} step, lr {lr:g}; "
              "loss = mean square of the outputs, summed over members",
              "per stage: forward + backward through the stage alone (loss = a fixed random weighting of its outputs), no optimizer step; "
              "FLOPs = 3x the forward's"]
    if dev.type == "cpu":
        notes.append("peak MB on CPU: peak live bytes of torch's CPU allocator during one call, above the level before it")
    return ProfileReport(
        model=plan.model, fingerprint=plan.fingerprint, n_members=plan.n_members, device=str(dev), device_name=device_name(dev),
        torch_version=torch.__version__, threads=torch.get_num_threads(), stages=stages, end_to_end=end_to_end,
        baselines=base, warmup=warmup, autotuned=autotune, plan=plan.to_json(), trace_path=trace_file,
        profile_s=time.perf_counter() - started, compile_s=sum(s.result.compile_s for s in stages), notes=notes,
        train=True, optimizer=optimizer,
    )


def _profile_steps(plan, module, members, fresh: FreshInputs, dev, repeats, warmup, ticks, baselines, optimizer, lr, notes):
    """(stagewise end to end, [loop, torch.func]): each checked by its gradients against the loop's, then timed round-robin.
    Every way runs on `fresh.values`; where forward() writes its inputs in place they are copies, refilled with the
    caller's values before each checked and each timed step, outside the timed step (FreshInputs.timed)."""
    ticks("training step end to end and baselines")
    inputs = fresh.values
    builders: dict[str, Callable[[], TrainingStep]] = {"stagewise": lambda: StagewiseStep(module, inputs, optimizer, lr)}
    builders["loop"] = lambda: LoopStep(plan, members, inputs, optimizer, lr)  # the reference; timed with the baselines
    if baselines:
        builders["torch.func"] = lambda: TorchFuncStep(plan, members, inputs, optimizer, lr)
    dropout = has_dropout(members[0])
    if dropout:
        notes.append("the model has dropout: gradients were compared in eval() mode (masks differ between ways), steps timed in train() mode")
    made: dict[str, TrainingStep] = {}
    results: dict[str, StrategyResult] = {}
    ref: dict[str, torch.Tensor] = {}
    working = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ["loop"] + [k for k in builders if k != "loop"]:  # the loop first: it is the reference
            def make(name=name):
                made[name] = step = builders[name]()
                fresh.restore()
                step.train(not dropout)
                g = step.grads()
                step.train(True)
                return lambda: g

            check = None if name == "loop" else (lambda g: max_rel_error(_concat(g, ref), _concat(ref, ref)))
            # the plan at verify(grads=True)'s tolerance; torch.func runs the members as they are: their precision's
            rtol = grads_tolerance(plan, members) if name == "stagewise" else members_grads_rtol(members)
            res, call, out = try_strategy(name, "whole", make, check, dev, rtol=rtol)
            if name == "loop" and res.ok:
                ref.update(out)
                res.max_rel_err = 0.0
            results[name] = res
            if call is not None and (baselines or name == "stagewise"):
                working[name] = (res, fresh.timed(made[name].step))
        time_candidates(working, dev, repeats, warmup, set())
    end_to_end = results.pop("stagewise")
    end_to_end.compile_s = 0.0
    for r in results.values():
        r.compile_s = 0.0
    return end_to_end, [results[k] for k in ("loop", "torch.func") if k in results and baselines]


def _concat(grads: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every gradient of each member as one row [N, total]: the error is normwise over a member's whole
    gradient (a parameter whose true gradient is 0, like attention's key bias, holds only rounding noise)."""
    n = next(iter(like.values())).shape[0]
    return torch.cat([grads[k].reshape(n, -1).float() for k in like], dim=1)


# --- per stage ---------------------------------------------------------------------------------------

def _profile_stages(module: BatchedModule, inputs: tuple, dev, repeats, warmup, ticks, flops: dict,
                    candidates: dict, start: Optional[SavedTensors] = None, rtol: float = GRADS_RTOL) -> list[StageProfile]:
    """Every stage's forward + backward (_profile_stage); `rtol`: the gradients' tolerance (grads_tolerance)."""
    env = module.bind_inputs(inputs)
    loops = module.number_loops  # after bind_inputs: a container input's numbers are known there
    numbers = per_member_numbers(module, env)  # no gradient leaves: the loop hands each member a Python number
    out = []
    for program, runner in zip(module.programs, module.runners):
        out.append(_profile_stage(program, runner, env, dev, repeats, warmup, ticks, flops.get(program.stage.id, 0),
                                  candidates.get(program.stage.id, []), start, loops.get(program.stage.id, ()), numbers,
                                  rtol=rtol))
    return out


def _profile_stage(program: StageProgram, runner: Runner, env: dict, dev, repeats, warmup, ticks, flops: int,
                   candidates: list[StrategyResult], start: Optional[SavedTensors] = None,
                   number_loop: tuple[str, ...] = (), numbers: Optional[dict[str, frozenset]] = None,
                   rtol: float = GRADS_RTOL) -> StageProfile:
    """One stage's forward + backward: the plan's strategy and the member loop; puts its forward outputs into `env`.
    `start`: the module's state before any run; the stage's part of it is put back before each checked run.
    `number_loop`: as for profile._profile_stage (the stage runs as the member loop: profiled as such).
    `numbers`: the per_member numbers among the boundary values (stage_grads.per_member_numbers), never grad leaves.
    `rtol`: the tolerance of the plan's gradients against the loop's (stage_grads.grads_tolerance)."""
    stage, n = program.stage, runner.n_members
    strategy = Strategy.LOOP if number_loop else stage.options.strategy
    label = strategy_label(strategy, stage.options.chunk_size)
    ticks(f"stage {stage.id} forward + backward ({label})")
    fresh = stage_inputs(program, env, n)
    own = list(runner.stacked.values())
    reset = (lambda: start.restore(own)) if start is not None else (lambda: None)
    reference = LoopRunner(program, n, runner.stacked, runner.member_states)
    loop_call = fwd_bwd(program, reference, fresh, n, numbers)
    reset()
    ref_grads = loop_call()
    check = grads_check(ref_grads, n)
    res, call, _ = try_strategy(label, stage.id, lambda: (reset(), fresh.prepared(fwd_bwd(program, runner, fresh.current, n, numbers)))[1], check, dev,
                                rtol=rtol)
    res.chunk_size = stage.options.chunk_size if strategy is Strategy.VMAP else None
    cands = {label: (res, call)} if call is not None else {}
    if label == "loop":
        loop_res = res
    else:
        loop_res = StrategyResult("loop", ok=True, max_rel_err=0.0)
        cands["loop"] = (loop_res, loop_call)
    time_candidates(cands, dev, repeats, warmup, {label} if strategy is Strategy.COMPILE else set())
    with torch.no_grad():  # the next stages' inputs: this stage's forward outputs (the loop's if it failed)
        reset()
        _, ref_out, _ = loop_reference(program, runner, fresh)
        reset()
        out = runner(fresh()) if res.ok else ref_out
        advance(program, env, fresh, out, runner if res.ok else reference)
    return StageProfile(id=stage.id, mode=stage.mode.value, strategy=label, nodes=list(stage.nodes), flops=flops,
                        result=res, loop=loop_res, candidates=candidates, note=number_loop_note(stage.options.note, number_loop))
