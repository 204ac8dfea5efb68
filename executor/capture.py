"""Whole-plan capture: a built plan's forward (every stage and every boundary) as one CUDA graph.

`executor.capture(ens)` wraps a BatchedModule. The first call with a new input signature
(shapes, dtypes, devices and the non-tensor arguments) warms the plan up on a side stream,
captures one forward into a CUDA graph with static input buffers, and every later call
copies its inputs into those buffers and replays the graph: one launch for the whole plan,
no Python per stage. Up to `max_signatures` graphs are kept (one per signature), sharing one
memory pool.

Rules, each one a way a replay could otherwise answer wrongly without a word:
- **Outputs** live in the graph's memory and the next replay overwrites them. The default,
  `clone_outputs=True`, hands out copies (safe: the result of call k is still call k's after
  call k+1). `clone_outputs=False` returns the graph's own tensors: faster, valid until the
  next call of this module — keep them only if you consume them first.
- **State changed from outside** (an optimizer step, `load_state_dict`, `.to()`, a manual
  `p.add_()`): the wrapper records every stacked parameter's and buffer's storage and
  version counter at capture and checks them on each call; any change means a re-capture,
  because a graph replays the kernels of capture time on the storages of capture time. (A
  write through `.data` bumps no version counter; the replay still reads it, since no
  runner keeps copies derived from the weights across calls.)
- **State changed by forward itself** (buffers a model updates in forward, recorded by
  torch.export as graph nodes): the warm-up runs would apply those updates extra times, so
  every buffer is saved before warming up and put back before the first replay; a replay
  then updates them exactly once per call, as the plan does. Parameters updated inside
  forward are refused.
- **Inference only**: capture refuses when autograd would record (grad enabled and any
  stacked parameter requires grad; run under `torch.no_grad()` / `torch.inference_mode()`)
  and in training mode (`ens.eval()` first); training goes through the BatchedModule itself.
- **Stages that cannot be captured** (a host sync such as `.item()` or `if x.any():`,
  data-dependent shapes such as `x[mask]` or `nonzero`): when the whole plan fails to
  capture, each stage is run once under a host-sync detector, and the plan becomes
  maximal *runs* of capturable stages, one graph each (per signature of the run's own
  inputs, which may change from call to call after an eager stage), with the other
  stages eager between them. A run whose capture still fails is split stage by stage.
  `cap.layout()` says which stages replay in which graph and why the others run eagerly;
  when no stage can be captured, the call raises ExecutionError naming the reasons.
- **Stages with CUDA graphs of their own** (compile in mode reduce-overhead, the `[compile:
  mode=reduce-overhead]` tag): a graph cannot be recorded inside another graph's capture, so
  such a stage is known to run eagerly from its options, before anything is captured: the plan
  starts as runs around it (it replays its own graphs between them), as above.

`backend` is the capture mechanism: `CudaGraphBackend` on CUDA (the default). Tests on
machines without a GPU pass `ReplayBackend`, which keeps the same static-buffer
semantics (inputs copied in, outputs written into fixed tensors, state restored after the
capture run) by re-running the plan eagerly, and refuses to capture what a CUDA graph
refuses (the host-sync ops `HostSyncDetector` knows), so everything above but the CUDA
graph itself is checked everywhere.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from stagewise.planner.errors import ExecutionError
from stagewise.planner.errors import first_line as _first_line
from stagewise.planner.plan import Strategy
from stagewise.executor.stages import VmapRunner
from stagewise.executor.values import (Batched, PerMember, as_batched, number_dtype, tagged as _tagged,
                                      untagged as _untagged)

DEFAULT_MAX_SIGNATURES = 8
# the keyword a CapturedPlan calls its batched module with, naming itself: the module makes its per-call checks and runs
# its hooks, then replays this plan's graphs (a keyword no forward() parameter of a plan has: fx names none so)
CAPTURED_CALL = "__stagewise_captured_plan"
WARMUP_CALLS = 2  # lazy initialisation and cuBLAS/cuDNN workspace choices happen outside the graph




OWN_GRAPHS = "reduce-overhead compile records its own CUDA graphs (one cannot be recorded inside another's capture)"


def eager_reason(program: Any) -> str | None:
    """Why a stage must run outside every captured graph, known from its options before anything runs (None: it
    may be captured; host syncs are found by running it, see CapturedPlan._split)."""
    from stagewise.executor.strategies.compiled import compile_mode_of  # the strategies package imports this module

    options = program.stage.options
    if options.strategy is Strategy.COMPILE and compile_mode_of(options) == "reduce-overhead":
        return OWN_GRAPHS
    return None


class _NotCapturable(Exception):
    """The backend refused to capture (the message says why)."""


class NotCapturableError(ExecutionError):
    """Nothing of the plan can be captured, or capturing would repeat a parameter update forward makes."""


aten = torch.ops.aten
# ops whose result the host must wait for: a CUDA graph cannot capture them (the stream may not sync while capturing)
_SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
             aten.unique_consecutive, aten.unique_dim_consecutive}
_SYNC_OVERLOADS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _to_host(func, args: tuple, kwargs: dict) -> bool:
    """A copy from a GPU tensor to the CPU (`.cpu()`, `.tolist()` go through here or `.item()`)."""
    if func.overloadpacket not in (aten._to_copy, aten.copy_):
        return False
    src = args[1] if func.overloadpacket is aten.copy_ else args[0]
    dst = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"


class HostSyncDetector(TorchDispatchMode):
    """Runs ops unchanged and records the first one a CUDA graph cannot capture (`found`, None if none): ops whose
    result the host reads (`.item()`, `bool(t)`, `tolist`), ops with data-dependent output shapes (`nonzero`,
    boolean-mask indexing, `masked_select`, `unique`, `repeat_interleave` by a tensor) and copies to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.found: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and (func.overloadpacket in _SYNC_OPS or func in _SYNC_OVERLOADS
                                   or (func.overloadpacket is aten.index and _bool_index(args))
                                   or _to_host(func, args, kwargs)):
            self.found = str(func.overloadpacket).replace("aten.", "")
        return func(*args, **kwargs)


class _KeepBeforeWrite(TorchDispatchMode):
    """Runs ops unchanged; before the first op that writes into one of `tensors` (by storage), keeps a copy of it,
    so that runs made only to warm up, capture or detect can be undone (`restore`)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.by_storage = {t.untyped_storage().data_ptr(): t for t in tensors if t.numel()}
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                x = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
                if isinstance(x, torch.Tensor):
                    ptr = x.untyped_storage().data_ptr()
                    t = self.by_storage.get(ptr)
                    if t is not None and ptr not in self.kept:
                        self.kept[ptr] = (t, t.detach().clone())
        return func(*args, **kwargs)

    def restore(self) -> bool:
        """Put back what was written; whether anything was."""
        with torch.no_grad():
            for t, saved in self.kept.values():
                t.copy_(saved)
        return bool(self.kept)


def host_sync_in(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), the first op in it a CUDA graph cannot capture, or None)."""
    with HostSyncDetector() as detector:
        out = fn()
    return out, detector.found


class CudaGraphBackend:
    """Warm up on a side stream, then capture `fn()` into a torch.cuda.CUDAGraph (one pool for all graphs)."""

    name = "cuda_graph"

    def __init__(self) -> None:
        self.pool = None
        self.pool_bytes = 0  # device memory the graphs' private pool took (held while they live; no allocator peak shows it)

    def capture(self, fn: Callable[[], Any], warmup: Callable[[], None]) -> tuple[Callable[[], None], Any]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warmup()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved()  # a private pool takes segments of its own: they are its size
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool_bytes += max(0, torch.cuda.memory_reserved() - reserved)
        self.pool = graph.pool()
        return graph.replay, out


class ReplayBackend:
    """The static-buffer semantics of a CUDA graph without one (for CPU tests): the capture run's outputs are the
    fixed output tensors, and each replay runs `fn` again and copies its results into them."""

    name = "replay"

    def capture(self, fn: Callable[[], Any], warmup: Callable[[], None]) -> tuple[Callable[[], None], Any]:
        warmup()
        out, sync = host_sync_in(fn)
        if sync is not None:  # what torch.cuda.graph raises on a GPU, where the stream may not sync while capturing
            raise RuntimeError(f"operation not permitted when stream is capturing ({sync} makes the host wait)")
        static, spec = tree_flatten(out)

        def replay() -> None:
            fresh, fresh_spec = tree_flatten(fn())
            if fresh_spec != spec:
                raise ExecutionError("the plan's output structure changed between replays; it cannot be captured")
            for s, f in zip(static, fresh):
                if isinstance(s, torch.Tensor):
                    s.copy_(f)

        return replay, out


@dataclass
class _Graph:
    replay: Callable[[], None]
    static_inputs: list  # flat: tensors are the static buffers, other leaves are baked in
    static_out: Any
    state_key: tuple
    pinned: frozenset = frozenset()  # positions of state tensors (or views of them) the graph reads as themselves


@dataclass
class _Run:
    """Consecutive stages replayed as one graph (`eager`: run as the plan runs them, `reason` why)."""
    steps: list  # a slice of the BatchedModule's flat step list
    inputs: tuple  # boundary names the run reads from before it
    outputs: tuple  # boundary names it makes (or writes in place) that later stages or the model's outputs read
    eager: bool = False
    reason: str = ""
    graphs: dict = None  # signature of the run's inputs -> _Graph
    numbers: frozenset = frozenset()  # inputs only vmapped stages read: per-member floats enter them as a [N] tensor
    written: tuple = ()  # inputs a stage of the run writes in place

    @property
    def stage_ids(self) -> list[str]:
        return [step[0].stage.id for step in self.steps]


def _state_tensors(ens: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in list(ens.parameters()) + list(ens.buffers()):
        seen.setdefault(id(t), t)
    return list(seen.values())


def _signature(flat: list, host_scalars: bool = False) -> tuple:
    """What a graph bakes in: each tensor's shape, dtype, device and strides, and every other value itself.
    `host_scalars`: a CPU tensor's value too (a CUDA kernel takes a 0-d one as a number at launch, and work on CPU
    tensors is not in the graph at all: a replay hands out what it made at capture time), so another value needs
    another graph."""
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            scalar = None
            if host_scalars and x.device.type == "cpu":
                scalar = x.item() if x.dim() == 0 else (
                    x.dtype, x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            out.append((tuple(x.shape), x.dtype, x.device, x.stride(), scalar))
        else:
            try:
                hash(x)
                out.append(("value", type(x), x))
            except TypeError:
                out.append(("value", type(x), repr(x)))
    return tuple(out)


def _static_copy(flat: list) -> list:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat]


def _run_of(steps: list, i: int, j: int, read_after: Callable[[int], set], reason: str | None = None) -> _Run:
    """steps[i:j] as one run (eager when a `reason` is given): what it reads from before it, what it hands on."""
    chunk = steps[i:j]
    made: set = set()
    inputs: list = []
    for step in chunk:
        inputs += [name for name in step[2] if name not in made and name not in inputs]
        made |= set(step[3]) | (set(step[2]) if step[4] else set())  # inputs written in place are new values too
    numbers = {name for name in inputs if all(isinstance(step[1], VmapRunner) for step in chunk if name in step[2])}
    written = tuple(name for name in inputs if any(step[4] and name in step[2] for step in chunk))
    return _Run(chunk, tuple(inputs), tuple(sorted(made & read_after(j))), eager=reason is not None,
                reason=reason or "", graphs={}, numbers=frozenset(numbers), written=written)


def _runs_of(steps: list, eager: dict[int, str], read_after: Callable[[int], set]) -> list[_Run]:
    """Maximal runs of consecutive steps not in `eager` (step index -> reason), each eager step a run of its own."""
    runs, i = [], 0
    while i < len(steps):
        j = i + 1
        if i not in eager:
            while j < len(steps) and j not in eager:
                j += 1
        runs.append(_run_of(steps, i, j, read_after, eager.get(i)))
        i = j
    return runs


class CapturedPlan(nn.Module):
    """A BatchedModule whose forward replays one captured graph per input signature, or one per run of capturable
    stages when some stage cannot be captured (see the module docstring)."""

    def __init__(self, ens: nn.Module, *, clone_outputs: bool = True, max_signatures: int = DEFAULT_MAX_SIGNATURES,
                 backend: Any = None):
        super().__init__()
        if max_signatures < 1:
            raise ValueError(f"max_signatures must be at least 1, got {max_signatures}")
        self.ens = ens
        self.clone_outputs = clone_outputs
        self.max_signatures = max_signatures
        self.backend = backend if backend is not None else CudaGraphBackend()
        self._host_scalars = isinstance(self.backend, CudaGraphBackend)
        self._graphs: dict[tuple, _Graph] = {}
        self._state = _state_tensors(ens)
        self._params = [t for t in self._state if isinstance(t, nn.Parameter)]
        self._tensors_of = getattr(ens, "_stacked", None)  # BatchedModule replaces this dict when .to() replaces tensors
        self._state_ids = {id(t) for t in self._state}
        self._steps_of = ens._steps  # BatchedModule re-makes its steps (new runners) after .to() or new storage
        in_place = {name for step in ens._steps if step[4] for name in step[2]}
        # per_member model inputs a stage writes in place: the plan writes into the caller's tensor (the loop does too)
        self._written_inputs = [i for i, (name, per_member) in enumerate(zip(ens._input_names, ens._per_member_at))
                                if per_member and name in in_place]
        self._runs: list[_Run] | None = None  # None: the whole plan is one graph
        # why stages must run outside every graph, read from their options (compile mode reduce-overhead)
        self._known_eager = [r for r in (eager_reason(step[0]) for step in ens._steps) if r is not None]
        self.captures = 0  # how many graphs were captured (a re-capture counts again)

    def __deepcopy__(self, memo: dict) -> "CapturedPlan":
        """A capture of a copy of the batched module, with the same settings, capturing its own graphs at its first
        call (a graph replays into the tensors it was captured on, which a copy does not share)."""
        new = CapturedPlan(copy.deepcopy(self.ens, memo), **self._settings(memo))
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict:
        """Pickled (torch.save) as the batched module and the settings: the graphs are captured again after loading."""
        return {"ens": self.ens, **self._settings({})}

    def __setstate__(self, state: dict) -> None:
        CapturedPlan.__init__(self, state.pop("ens"), **state)

    def _settings(self, memo: dict) -> dict:
        kind = type(self.backend)
        backend = kind() if kind in (CudaGraphBackend, ReplayBackend) else copy.deepcopy(self.backend, memo)
        return {"clone_outputs": self.clone_outputs, "max_signatures": self.max_signatures, "backend": backend}

    def _state_key(self) -> tuple:
        """When a graph must be captured again: the state's storages (a graph reads those of capture time), and the
        parameters' versions (an optimizer step: re-captured to be safe). Not the buffers' versions: forward's own
        updates, eager stages' and the put-back after every capture move them, and a replay reads their storage
        anyway (keying on them re-captured at every switch between two signatures of a model with buffers)."""
        return tuple(t.data_ptr() for t in self._state) + tuple(p._version for p in self._params)

    def _check_mode(self) -> None:
        if self.ens.training:
            raise ExecutionError("whole-plan capture is for inference: call .eval() on the batched module first "
                                 "(training runs through the BatchedModule itself)")
        if torch.is_grad_enabled() and any(t.requires_grad for t in self._state):
            raise ExecutionError("whole-plan capture cannot record gradients: call it under torch.no_grad() or "
                                 "torch.inference_mode() (training runs through the BatchedModule itself)")

    def layout(self) -> list[dict[str, Any]]:
        """How calls run: one entry per graph or eager stage, in run order: {"stages": [ids], "mode": "graph" |
        "eager", "reason": why a stage runs eagerly}. Before the first call, and when the whole plan is one graph,
        a single "graph" entry holding every stage."""
        if self._runs is None:
            return [{"stages": [p.stage.id for p in self.ens.programs], "mode": "graph", "reason": ""}]
        return [{"stages": r.stage_ids, "mode": "eager" if r.eager else "graph", "reason": r.reason} for r in self._runs]

    def forward(self, *inputs):
        """The batched module's call, its checks and its hooks included (a module-level setting changed since build,
        a buffer whose value forward() reads, hooks registered on it), replayed from this module's graphs."""
        self._check_mode()
        return self.ens(*inputs, **{CAPTURED_CALL: self})

    def replay(self, *inputs):
        """The call itself, from the graphs (captured on the first call of a signature), without the batched module's
        per-call checks: BatchedModule.forward calls it after making them."""
        self._check_mode()
        if getattr(self.ens, "_state_replaced", [False])[0]:  # a tensor of the state tree replaced: re-read first
            self.ens._follow_replaced_state()
        if getattr(self.ens, "_stacked", None) is not self._tensors_of:  # `.to()` replaced the state tensors
            self._state, self._tensors_of = _state_tensors(self.ens), getattr(self.ens, "_stacked", None)
            self._params = [t for t in self._state if isinstance(t, nn.Parameter)]
            self._state_ids = {id(t) for t in self._state}
            self._graphs.clear()
            for run in self._runs or []:
                run.graphs.clear()
        if getattr(self.ens, "_storage", None):  # `p.data = ...` under a loop stage: the module re-makes its runners
            self.ens._follow_new_storage()
        self._follow_steps()
        if (self._written_inputs and (self._aliased(inputs) or self._overlapping(inputs))) or _one_tensor_twice(inputs):
            # the plan writes an input in place, and the inputs share memory with each other or with a graph's
            # buffers (`ens(x, x)`; `x = fast(x)` without clone_outputs): static copies would break that sharing
            # (the write to one argument no longer reaching the other, or the copy back overwriting this call's
            # output). Such a call runs stage by stage, as the batched module does
            # Also where an input the plan writes shares memory within itself (`base.expand(N, ...)`: the batched module
            # refuses rows shared between members, and writes through rows shared within a member as the loop does)
            # Also when one tensor is passed as two inputs (`ens(x, x, x)`): the graphs' static copies would be
            # separate tensors, and torch's attention takes another path for `query is key is value`
            out = self.ens.run_stages(*inputs)[0]
        else:
            if self._runs is None:
                out = self._whole(inputs)
            if self._runs is not None:  # the whole plan did not capture (now or earlier): its runs
                out = self.ens.run_stages(*inputs, run=self._run_runs)[0]
        if self.clone_outputs:
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        return out

    def _overlapping(self, inputs: tuple) -> bool:
        """Whether an input the plan writes in place has elements sharing memory (a static copy would give them apart)."""
        return any(isinstance(t, torch.Tensor) and torch._debug_has_internal_overlap(t) != 0
                   for i in self._written_inputs if i < len(inputs) for t in tree_flatten(inputs[i])[0])

    def _aliased(self, inputs: tuple) -> bool:
        """Whether two input tensors share a storage, or one shares a storage with a captured graph's buffers."""
        storages = [x.untyped_storage().data_ptr() for x in tree_flatten(list(inputs))[0] if isinstance(x, torch.Tensor)]
        if len(set(storages)) < len(storages):
            return True
        graphs = [*self._graphs.values(), *(g for run in self._runs or [] for g in run.graphs.values())]
        owned = {t.untyped_storage().data_ptr() for g in graphs for t in [*tree_flatten(g.static_out)[0], *g.static_inputs]
                 if isinstance(t, torch.Tensor)}
        return not owned.isdisjoint(storages)

    def _follow_steps(self) -> None:
        """New runners (after `.to()`, new storage under a loop stage, runners assigned): graphs and runs captured
        with the old ones would replay stale state (a loop stage's per-member views of the old storage)."""
        steps = self.ens._steps
        if steps is self._steps_of:
            return
        self._steps_of = steps
        self._graphs.clear()
        if self._runs is not None:
            inside = self._inside()
            at = {id(step): k for k, step in enumerate(self._steps)}
            for run in self._runs:
                run.steps = [inside[at[id(step)]] for step in run.steps]
                run.graphs.clear()
            self._steps = inside

    def _plan_writes_into(self, x: Any) -> bool:
        """Whether the plan, run stage by stage, writes a per_member input `x` in place into the caller's tensor
        (not into the copy bind_inputs casts to a low precision, or as_batched makes of an expanded tensor)."""
        low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(getattr(self.ens.plan, "dtype", None))
        if not isinstance(x, torch.Tensor) or (low is not None and x.is_floating_point() and x.dtype != low):
            return False
        return not (x.dim() and x.shape[0] > 1 and x.stride(0) == 0)

    # --- the whole plan as one graph ---------------------------------------------------------------

    def _whole(self, inputs: tuple) -> Any:
        if self._known_eager:  # never captured whole: start from the runs around the stages that cannot be inside a graph
            self._runs = self._runs_or_refusal(inputs, self._known_eager[0])
            return None
        flat, spec = tree_flatten(list(inputs))
        key = (spec, _signature(flat, self._host_scalars))
        g = self._graphs.get(key)
        if g is None or g.state_key != self._state_key():
            static_inputs = _static_copy(flat)
            args = tree_unflatten(static_inputs, spec)
            steps = self._inside()
            try:
                replay, out = self._capture(lambda: self.ens.run_stages(*args, run=lambda env: self.ens._run_steps(env, steps))[0])
            except _NotCapturable as e:
                self._runs = self._runs_or_refusal(inputs, str(e))
                return None
            g = self._keep(self._graphs, key, _Graph(replay, static_inputs, out, self._state_key()))
        for static, x in zip(g.static_inputs, flat):
            if isinstance(static, torch.Tensor):
                static.copy_(x, non_blocking=True)
        g.replay()
        if self._written_inputs:  # the graph wrote into its static copies: hand the writes on as the plan does
            offsets = [0]
            for x in inputs:
                offsets.append(offsets[-1] + len(tree_flatten(x)[0]))
            for i in self._written_inputs:
                if self._plan_writes_into(inputs[i]):
                    inputs[i].copy_(g.static_inputs[offsets[i]])
        return g.static_out

    def _runs_or_refusal(self, inputs: tuple, why: str) -> list[_Run]:
        """The plan split into runs (see _split); NotCapturableError when every stage must run eagerly."""
        runs = self._split(inputs)
        if all(r.eager for r in runs):
            raise NotCapturableError(f"no stage of the plan can be captured in a CUDA graph ({why}; "
                                     + "; ".join(f"stage {r.stage_ids[0]}: {r.reason}" for r in runs)
                                     + "): run the batched module itself")
        return runs

    def _inside(self) -> list:
        """The module's steps as a capture runs them: a stage with a graph of its own (the cuda_graph strategy)
        runs its plain vmapped call instead, inside this graph (a graph cannot be captured inside another)."""
        return [(p, getattr(r, "inside_capture", r), *rest) for p, r, *rest in self.ens._steps]

    def _keep(self, graphs: dict, key: tuple, g: _Graph) -> _Graph:
        if len(graphs) >= self.max_signatures and key not in graphs:
            graphs.pop(next(iter(graphs)))  # the oldest signature makes room
        graphs[key] = g
        self.captures += 1
        return g

    def _capture(self, run: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        """Warm up and capture `run()`; the state forward updates is put back afterwards (the warm-up and, for
        ReplayBackend, the capture run executed it). _NotCapturable when the backend refuses."""
        buffers = list(self.ens.buffers())
        saved = [b.detach().clone() for b in buffers]
        versions = [p._version for p in self._params]
        params = _KeepBeforeWrite(self._params)  # the warm-up writes what the capture would (a parameter forward updates)

        def warmup() -> None:
            with params:
                for _ in range(WARMUP_CALLS):
                    run()

        try:
            replay, out = self.backend.capture(run, warmup)
        except ExecutionError:
            raise
        except Exception as e:  # capture raises many types; the reason is what the user needs
            raise _NotCapturable(f"{type(e).__name__}: {_first_line(e)}") from e
        finally:
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    if b.shape == s.shape:
                        b.copy_(s)
            params.restore()  # also when the capture failed: falling back must start from the state of this call
        if any(p._version != v for p, v in zip(self._params, versions)):
            raise NotCapturableError("forward() updates parameters in place, which a captured graph would repeat "
                                 "unseen; run the batched module itself")
        return replay, out

    # --- runs of capturable stages -----------------------------------------------------------------

    def _split(self, inputs: tuple) -> list[_Run]:
        """The plan's steps as runs: each step run once (eagerly, state put back after) under the host-sync detector;
        a step eager_reason names runs eagerly for that reason (and plainly here: nothing to detect)."""
        ens, steps = self.ens, self._inside()
        self._steps = steps
        eager: dict[int, str] = {i: r for i, r in enumerate(eager_reason(step[0]) for step in steps) if r is not None}

        def detect(env: dict) -> None:
            for i, step in enumerate(steps):
                if i in eager:
                    ens._run_steps(env, [step])
                    continue
                found = host_sync_in(lambda: ens._run_steps(env, [step]))[1]
                if found is not None:
                    eager[i] = f"{found} makes the host wait for the device"

        buffers = list(ens.buffers())
        saved = [b.detach().clone() for b in buffers]
        params = _KeepBeforeWrite(self._params)
        try:
            with torch.no_grad(), params:
                ens.run_stages(*inputs, run=detect)
        finally:
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)
            if params.restore():
                raise NotCapturableError("forward() updates parameters in place, which a captured graph would repeat "
                                         "unseen; run the batched module itself")
        read = [set(step[2]) for step in steps]
        outputs = {name for name, _ in ens._output_leaves if name is not None}

        def read_after(j: int) -> set:
            return set().union(outputs, *read[j:])

        self._read_after = read_after
        return _runs_of(steps, eager, read_after)

    def _run_runs(self, env: dict) -> None:
        """Run every run on the bound inputs in `env`: eager ones as the plan does, the others by replaying."""
        i = 0
        while i < len(self._runs):
            run = self._runs[i]
            if run.eager:
                self.ens._run_steps(env, run.steps)
                i += 1
                continue
            for name in run.written:  # where the plan writes (as _run_steps does): state stays itself, a Shared gets a copy
                env[name] = as_batched(env[name], self.ens.n_members, self._device())
            beside = [env[name] for name in run.inputs if name not in run.numbers]
            values = [_tagged(self._numbers_as_tensor(env[name], beside) if name in run.numbers else env[name])
                      for name in run.inputs]
            flat, spec = tree_flatten(values)
            # state tensors (handed on by an earlier stage) and views of them enter the graph as themselves: a copy
            # would take the run's in-place updates away from the module's state
            pinned = frozenset(k for k, x in enumerate(flat) if isinstance(x, torch.Tensor)
                               and (id(x) in self._state_ids or (x._base is not None and id(x._base) in self._state_ids)))
            key = (spec, _signature(flat, self._host_scalars),
                   tuple((k, id(flat[k]._base if flat[k]._base is not None else flat[k]), flat[k].storage_offset())
                         for k in sorted(pinned)))
            g = run.graphs.get(key)
            if g is None or g.state_key != self._state_key():
                try:
                    g = self._capture_run(run, flat, spec, key, pinned)
                except _NotCapturable as e:  # the detector missed something: split the run, or run the stage eagerly
                    self._runs[i:i + 1] = self._split_run(run, str(e))
                    if not any(not r.eager for r in self._runs):
                        raise NotCapturableError("no stage of the plan can be captured in a CUDA graph ("
                                             + "; ".join(f"stage {r.stage_ids[0]}: {r.reason}" for r in self._runs)
                                             + "): run the batched module itself") from e
                    continue
            for k, (static, x) in enumerate(zip(g.static_inputs, flat)):
                if isinstance(static, torch.Tensor) and k not in g.pinned:
                    static.copy_(x, non_blocking=True)
            g.replay()
            if run.written:  # the graph wrote into its static copies: into the values themselves, as the plan does
                at = 0
                for name, value in zip(run.inputs, values):
                    count = len(tree_flatten(value)[0])
                    if name in run.written:
                        for k in range(at, at + count):
                            if isinstance(flat[k], torch.Tensor) and k not in g.pinned:
                                flat[k].copy_(g.static_inputs[k])
                    at += count
            env.update({name: _untagged(v) for name, v in g.static_out.items() if name not in run.written})
            i += 1

    def _numbers_as_tensor(self, value: Any, beside: list) -> Any:
        """Per-member floats (an eager stage's `.item()`, new every call) as one [N] tensor on the plan's device: a
        graph input like any other, where a Python number would be baked into the graph and force a capture per
        call. Only for inputs that vmapped stages alone read (vmap turns such numbers into this tensor itself).
        Its dtype is the one the loop computes such a float in beside the module's state and the run's other
        inputs (`beside`; values.number_dtype): float64 in a float64 model, where float32 would drop digits.
        Ints and bools stay as they are (the run's stages stack them as int64 / bool, as the plan does)."""
        if isinstance(value, PerMember) and value.values and all(type(x) is float for x in value.values):
            return Batched(torch.tensor(value.values, dtype=number_dtype(self._state, *beside), device=self._device()))
        return value

    def _device(self) -> torch.device:
        return next(iter(self.ens.stacked_state.values())).device

    def _capture_run(self, run: _Run, flat: list, spec: Any, key: tuple, pinned: frozenset = frozenset()) -> _Graph:
        static_inputs = [x if k in pinned else s for k, (x, s) in enumerate(zip(flat, _static_copy(flat)))]
        values = [_untagged(t) for t in tree_unflatten(static_inputs, spec)]

        def once() -> dict:
            local = dict(zip(run.inputs, values))
            self.ens._run_steps(local, run.steps)
            return {name: _tagged(local[name]) for name in run.outputs}

        replay, out = self._capture(once)
        return self._keep(run.graphs, key, _Graph(replay, static_inputs, out, self._state_key(), pinned))

    def _split_run(self, run: _Run, reason: str) -> list[_Run]:
        """A run whose capture failed: one run per stage, or the stage eager when it was alone."""
        steps = self._steps
        first = next(k for k, step in enumerate(steps) if step is run.steps[0])
        if len(run.steps) == 1:
            return [_run_of(steps, first, first + 1, self._read_after, reason)]
        return [_run_of(steps, k, k + 1, self._read_after) for k in range(first, first + len(run.steps))]


def _one_tensor_twice(inputs: tuple) -> bool:
    """Whether one tensor object is among the inputs twice (the caller's identity a module may test)."""
    ids = [id(x) for x in tree_flatten(list(inputs))[0] if isinstance(x, torch.Tensor)]
    return len(set(ids)) < len(ids)


def capture(ens: nn.Module, *, clone_outputs: bool = True, max_signatures: int = DEFAULT_MAX_SIGNATURES,
            backend: Any = None) -> CapturedPlan:
    """The whole plan of `ens` (a BatchedModule from executor.build) as one CUDA graph per input signature.

    Args:
        ens: the batched module, on a CUDA device, in eval mode.
        clone_outputs: hand out copies of the graph's outputs (default; safe), or the graph's own
            tensors, which the next call overwrites.
        max_signatures: graphs kept at once (one per input signature); the oldest makes room.
        backend: the capture mechanism; CudaGraphBackend() by default (ReplayBackend() checks the
            same buffer rules without a GPU).
    Returns:
        a module with the same forward(*inputs) -> N-first outputs.
    """
    if type(ens).__name__ == "ShardedModule" or not hasattr(ens, "_steps"):
        raise ExecutionError(
            f"executor.capture takes the BatchedModule executor.build returns, got a {type(ens).__name__}; for a "
            "ShardedModule capture this rank's module, fast = capture(sharded.module), and call it with this rank's "
            "inputs, fast(*sharded.local_inputs(inputs))")
    if backend is None:
        devices = {t.device.type for t in _state_tensors(ens)}
        if not torch.cuda.is_available() or devices - {"cuda"}:
            raise ExecutionError("whole-plan capture needs the batched module on a CUDA device (a CUDA graph records "
                                 "GPU kernels); on CPU run the module itself, or pass backend=ReplayBackend() to test")
    return CapturedPlan(ens, clone_outputs=clone_outputs, max_signatures=max_signatures, backend=backend)
