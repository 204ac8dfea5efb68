"""The `compile` strategy: `torch.compile` of the stage's vmapped callable.

Compiled once per input signature (values.signature: in_dims, every tensor
input's shape, dtype and device, every non-tensor input's value). The compiled
callable returns tensors only; the stage's non-tensor outputs (a size such as
`x.shape[0]` handed to the next stage) come from an eager call with inputs of
the same signature, recorded beside it: they depend on nothing else, so they
are right for every call of that signature and re-recorded for a new one.
Beyond MAX_SIGNATURES signatures the stage runs as plain vmap (same results).

The first call per signature compiles; its wall time minus one steady-state
call is kept in `compile_seconds` so that profiles show it separately instead
of hiding it in a median. Input/output format as VmapRunner (N-first).
"""
from __future__ import annotations

import copy
import itertools
import re
import time
import types
from dataclasses import replace
from typing import Callable

import torch
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten

from stagewise.planner.capability import _AUTOCAST_TARGETS
from stagewise.planner.edits import USER_EXCLUDED
from stagewise.planner.errors import ExecutionError, PlanFileError
from stagewise.planner.plan import Stage, StageMode, StageOptions
from stagewise.planner.validate import VMAP_RUNS_RIGHT
from stagewise.executor.stages import VmapRunner, check_index_rows, check_member_indices
from stagewise.executor.values import signature

BACKEND = "inductor"  # torch.compile backend; tests switch to "aot_eager" to check the plumbing quickly
MAX_SIGNATURES = 8  # compiled specialisations kept per stage (dynamo's own recompile limit is 8 too)
_serial = itertools.count()


# torch.compile modes a compile stage may use, recorded in the stage's options as a "[compile: mode=...]" note tag
# (like wide's conv form): "" is torch's default; "max-autotune-no-cudagraphs" autotunes GEMM/conv kernels;
# "reduce-overhead" adds CUDA graphs (torch's cudagraph trees: GPU only; outputs are cloned out of the graph's memory)
COMPILE_MODES = ("", "max-autotune-no-cudagraphs", "reduce-overhead")
_MODE_TAG = re.compile(r"\[compile: mode=([a-z-]+)\]")


def compile_mode_of(options: StageOptions) -> str:
    """The torch.compile mode recorded in a stage's options ("" = default); PlanFileError for an unknown one."""
    found = _MODE_TAG.search(options.note)
    mode = found.group(1) if found else ""
    if mode not in COMPILE_MODES:
        raise PlanFileError(f"unknown compile mode {mode!r} in the stage options; use one of "
                            f"{', '.join(m for m in COMPILE_MODES if m)} or remove the [compile: mode=...] tag from the note")
    return mode


def with_compile_mode(options: StageOptions, mode: str) -> StageOptions:
    """`options` with torch.compile `mode` recorded as a note tag ("" removes it)."""
    note = _MODE_TAG.sub("", options.note).rstrip()
    return replace(options, note=f"{note} [compile: mode={mode}]".lstrip() if mode else note)


def new_cudagraph_step() -> None:
    """Tell torch's cudagraph trees that a new inference step begins (a reduce-overhead stage's call, no grad).

    The trees start a new step on their own at each compiled call only until anyone in the process calls
    torch.compiler.cudagraph_mark_step_begin (a user's loop, a peer in a benchmark); from then on the step counter
    is what they go by, and back-to-back calls of the stage would count as one step: each call one node deeper in
    the tree (warm-up, a new recording, memory held for outputs nobody reads) instead of the replay of one graph.
    The stage clones its outputs out of the graph's memory, so nothing of the previous step is needed. Not under
    grad: a forward whose backward is still to come must keep its step (torch would otherwise overwrite the
    activations the backward reads)."""
    torch.compiler.cudagraph_mark_step_begin()


def cudagraph_tree_graphs(device_index: int) -> int:
    """How many CUDA graphs torch's cudagraph trees hold on one device (every node of every tree; 0 before any).
    A reduce-overhead stage called the same way again replays a graph it holds: a count that grows call after
    call means recordings instead of replays. Reads torch's private tree manager."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(device_index).tree_manager
    todo = [node for nodes in manager.roots.values() for node in nodes] if manager is not None else []
    count = 0
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(child for children in node.children.values() for child in children)
    return count


def compile_fresh(fn: Callable, name: str, mode: str = "") -> Callable:
    """torch.compile of `fn` through a wrapper with a code object of its own.

    Dynamo caches compiled graphs per code object and stops compiling one after
    a few recompiles (`recompile_limit`); every vmap shares one wrapper code
    object, so without this the ninth compiled stage in a process would quietly
    run eager.
    """
    def call(*args):
        return fn(*args)

    code = call.__code__.replace(co_name=f"{name}_{next(_serial)}")
    wrapper = types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
    if mode and BACKEND == "inductor":  # modes are inductor's (tests' aot_eager backend takes none)
        return torch.compile(wrapper, backend=BACKEND, dynamic=False, mode=mode)
    return torch.compile(wrapper, backend=BACKEND, dynamic=False)


# why the planner excludes a stage (a part of its reason) where torch.compile(vmap(stage)) still runs it as each member
# does: vmap's slow per-member fallback (what autotune compiles); writes into buffers (a stage that writes in place,
# BatchNorm in training mode among them, runs as plain vmap, which writes each member's rows); random draws (in
# training plain vmap, each member drawing its own numbers, in another order than the loop: executor.verify names
# that); an exclusion by hand of nodes the planner found vmap runs
_COMPILE_SAFE_REASONS = VMAP_RUNS_RIGHT + (USER_EXCLUDED,)
# the second halves of planner reasons that hold "; " themselves (merged stages join their reasons with "; " too)
_REASON_TAILS = ("members' state would be shared", "call .eval() or exclude")


def excluded_compile_refusal(stage: Stage) -> str:
    """Why strategy 'compile' cannot run an excluded stage ("" where it can): compile runs the stage under vmap, which
    the planner found fails there or computes otherwise than each member (no batching rule and no fallback, a
    data-dependent value or shape, an in-place write vmap cannot batch). Any reason not known to be safe
    (_COMPILE_SAFE_REASONS) is refused: a plan set by hand is refused at build rather than failing, or answering
    wrong, at its first call. At build `stage.reason` holds the members' own graph's verdicts beside the plan file's
    (planner.validate.with_fresh_verdicts): an exclusion by hand counts as safe only where that graph agrees."""
    if stage.mode is not StageMode.EXCLUDED:
        return ""
    parts = [p for p in stage.reason.split("; ") if p and p not in _REASON_TAILS]
    bad = [p for p in parts if not any(ok in p for ok in _COMPILE_SAFE_REASONS)]
    if not bad:
        return ""
    return (f"stage {stage.id} is excluded ({bad[0]}) and cannot run strategy 'compile': compile runs the stage under "
            "vmap (torch.compile(vmap(...))), which fails there or does not compute what each member computes. Run it "
            f"as the member loop, its default (planner.set_options(plan, graph, {stage.id!r}, strategy='loop')), or "
            "try 'wide', which executor.verify and autotune check against the loop")


def with_checked_indices(module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[tuple]]:
    """(`module`, or a twin of it that also returns what its check_member_indices nodes check, and those checks'
    (bound, what, where)). The check cannot run inside torch.compile (it reads the member axis off vmap's batched
    tensor, which dynamo cannot trace): the twin hands each one's indices (and the weight whose row count bounds them
    where that is not a number) out of the compiled vmap, N-first, after the stage's own outputs, for CompileRunner
    to check after the call."""
    checks = [n for n in module.graph.nodes if n.op == "call_function" and n.target is check_member_indices]
    if not checks:
        return module, []
    graph = copy.deepcopy(module.graph)
    named = {n.name: n for n in graph.nodes}
    output = next(n for n in graph.nodes if n.op == "output")
    extra = []
    with graph.inserting_before(output):
        for check in checks:
            ids, bound = named[check.name].args[:2]
            extra.append(ids)
            if isinstance(bound, torch.fx.Node):
                extra.append(graph.call_method("detach", (bound,)))
    output.args = ((output.args[0], tuple(extra)),)
    twin = torch.fx.GraphModule(module, graph, class_name=type(module).__name__)
    return twin, [(c.args[1], c.args[2], c.args[3]) for c in checks]


class CompileRunner(VmapRunner):
    """torch.compile(vmap(stage)) over stacked state; compile time in `compile_seconds`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        module = self.program.module
        checked, self._index_checks = with_checked_indices(module)

        def tensors_only(state, inputs):
            # dynamo-friendly twin of VmapRunner's one_member: no side effects, tensors out
            out = functional_call(checked, state, tuple(inputs), tie_weights=False)
            return tuple(x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))

        self._tensors_only = tensors_only
        self._compiled: dict[tuple, tuple[Callable, dict]] = {}  # signature -> (compiled fn, recorded output structure)
        self.compile_seconds = 0.0
        self.eager_calls = 0  # calls that ran as plain vmap (training, in-place state, past MAX_SIGNATURES)
        self.mode = compile_mode_of(self.program.stage.options)
        self._modules = list(module.modules())  # the stage and its submodules, whose training flags run() reads
        regions = [n.name for n in module.graph.nodes if n.op == "call_function"
                   and any(n.target is t for t in _AUTOCAST_TARGETS)]
        if regions:  # vmap, which compile traces, does not apply autocast: the region would compute in float32
            raise ExecutionError(
                f"stage {self.program.stage.id} holds an autocast region (with torch.autocast(...) inside forward()), "
                "which torch.compile(vmap(...)) runs without its autocast, in another dtype than each "
                f"member's: run the stage as loop or wide (planner.set_options(plan, graph, {self.program.stage.id!r}, "
                "strategy='loop'))")
        refused = excluded_compile_refusal(self.program.stage)
        if refused:
            raise ExecutionError(refused)
        if self.mode == "reduce-overhead":
            if not all(t.is_cuda for t in self.stacked.values()):
                raise ExecutionError(f"stage {self.program.stage.id}: compile mode reduce-overhead adds CUDA graphs and "
                                     "needs the stage on a CUDA device; use the default mode on CPU")
            for t in self.stacked.values():  # the stacked state stays where it is: no copy into graph buffers per call
                torch._dynamo.mark_static_address(t)

    def _call_compiled(self, fn: Callable, inputs: list, new_step: bool) -> tuple:
        """One call of a compiled specialisation; a reduce-overhead one under no grad as a cudagraph step of its own."""
        if new_step:
            new_cudagraph_step()
        return fn(self.stacked, inputs)

    def run(self, args: list) -> list:
        inputs, dims, per_member = self._vmap_args(args)
        if not per_member or self._in_training() or self.program.writes_in_place:
            # nothing per member: computed once, nothing to compile. Training (per-member randomness,
            # BatchNorm statistics) and in-place state updates run eager: compiling runs the stage
            # more than once on its first call, which would apply an update two or three times
            if per_member:  # (nothing per member is no fallback: there is nothing to compile)
                self.eager_calls += 1
            return super().run(args)
        key = (repr(dims), signature(inputs))
        entry = self._compiled.get(key)
        new_step = self.mode == "reduce-overhead" and not torch.is_grad_enabled()
        if entry is None:
            if len(self._compiled) >= MAX_SIGNATURES:
                self.eager_calls += 1
                return super().run(args)  # one more specialisation would only add compile time
            super().run(args)  # eager once: records the output structure (non-tensor leaves too) for this signature
            meta = dict(self._meta)
            start = time.perf_counter()
            fn = compile_fresh(vmap(self._tensors_only, in_dims=(0, dims), randomness="error",
                                    chunk_size=self.program.stage.options.chunk_size), f"stage_{self.program.stage.id}",
                               self.mode)
            self._call_compiled(fn, inputs, new_step)
            first = time.perf_counter() - start
            start = time.perf_counter()
            tensors = self._call_compiled(fn, inputs, new_step)
            self.compile_seconds += max(0.0, first - (time.perf_counter() - start))
            self._compiled[key] = (fn, meta)
        else:
            fn, meta = entry
            try:
                tensors = self._call_compiled(fn, inputs, new_step)
            except (IndexError, RuntimeError):
                if not self._index_checks:
                    raise
                # an index the compiled lookup refused itself (beyond all members' rows): the eager stage names the
                # member and the index (check_member_indices); it writes nothing (such stages run eager here)
                super().run(args)
                raise
        if self._index_checks:
            tensors = self._check_indices(tensors)
        if self.mode == "reduce-overhead":  # the graph's memory: the next replay overwrites it
            tensors = tuple(t.clone() for t in tensors)
        if torch.is_grad_enabled():
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._refuse_double_backward)
        return self._rebuild(tensors, meta)

    def _check_indices(self, tensors: tuple) -> tuple:
        """The stage's own outputs of a compiled call, after check_index_rows on the indices it handed back after them
        (with_checked_indices): an index that the member loop refuses raises InputError here, as the eager stage's
        check node does (which does nothing under torch.compile)."""
        k = sum(1 + (type(bound) is not int) for bound, _, _ in self._index_checks)
        extra = iter(tensors[len(tensors) - k:])
        for bound, what, where in self._index_checks:
            ids = next(extra)
            check_index_rows(ids, 0, bound if type(bound) is int else next(extra).shape[1], what, where)
        return tensors[:len(tensors) - k]

    def _in_training(self) -> bool:
        """Whether the stage or any module in it is in training mode now: a BatchNorm put back in training inside an
        eval model (test-time adaptation) updates its running statistics on every call, as the stage's own flag does
        not show. Read per call: `.train()` / `.eval()` on a submodule may come after the build."""
        return any(m.training for m in self._modules)

    def _refuse_double_backward(self, grad: torch.Tensor) -> None:
        """torch.compile's backward cannot be differentiated again: say so, naming the stage and the fix, before its
        backward raises a bare RuntimeError."""
        if torch.is_grad_enabled():  # a backward with create_graph=True
            stage = self.program.stage.id
            # torch.func.grad / vjp / jacrev take every gradient as one that may be differentiated again (grad mode
            # on in the backward), a first-order one too: say which the user wrote
            how = ("a gradient taken through a torch.func transform (torch.func.grad, vjp, jacrev, ...), which "
                   "records the backward so that it could be differentiated again, even for a first-order gradient; "
                   "take a first-order gradient with loss.backward() or torch.autograd.grad instead, or"
                   if torch._C._functorch.peek_interpreter_stack() is not None else
                   "a backward with create_graph=True: a gradient penalty, a Hessian-vector product;")
            raise ExecutionError(
                f"stage {stage} runs strategy 'compile', whose backward torch.compile cannot differentiate again "
                f"({how} run the stage with vmap: plan = planner.set_options(plan, graph, {stage!r}, "
                "strategy='vmap'), or executor.autotune(..., train=True), which keeps compile out of a plan for "
                "training)")
        return None
