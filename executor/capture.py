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
- A plan that cannot be captured (a host sync such as `.item()`, data-dependent shapes,
  a CPU tensor) raises ExecutionError naming the reason; run `ens` itself instead.

`backend` is the capture mechanism: `CudaGraphBackend` on CUDA (the default). Tests on
machines without a GPU pass `ReplayBackend`, which keeps the same static-buffer
semantics (inputs copied in, outputs written into fixed tensors, state restored after the
capture run) by re-running the plan eagerly, so everything above but the CUDA graph itself
is checked everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from stagewise.planner.errors import ExecutionError

DEFAULT_MAX_SIGNATURES = 8
WARMUP_CALLS = 2  # lazy initialisation and cuBLAS/cuDNN workspace choices happen outside the graph


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class CudaGraphBackend:
    """Warm up on a side stream, then capture `fn()` into a torch.cuda.CUDAGraph (one pool for all graphs)."""

    name = "cuda_graph"

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn: Callable[[], Any], warmup: Callable[[], None]) -> tuple[Callable[[], None], Any]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warmup()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph.replay, out


class ReplayBackend:
    """The static-buffer semantics of a CUDA graph without one (for CPU tests): the capture run's outputs are the
    fixed output tensors, and each replay runs `fn` again and copies its results into them."""

    name = "replay"

    def capture(self, fn: Callable[[], Any], warmup: Callable[[], None]) -> tuple[Callable[[], None], Any]:
        warmup()
        out = fn()
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


def _state_tensors(ens: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in list(ens.parameters()) + list(ens.buffers()):
        seen.setdefault(id(t), t)
    return list(seen.values())


def _signature(flat: list) -> tuple:
    """What a graph bakes in: each tensor's shape, dtype, device and strides, and every other value itself."""
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, x.device, x.stride()))
        else:
            try:
                hash(x)
                out.append(("value", type(x), x))
            except TypeError:
                out.append(("value", type(x), repr(x)))
    return tuple(out)


class CapturedPlan(nn.Module):
    """A BatchedModule whose forward replays one captured graph per input signature (see the module docstring)."""

    def __init__(self, ens: nn.Module, *, clone_outputs: bool = True, max_signatures: int = DEFAULT_MAX_SIGNATURES,
                 backend: Any = None):
        super().__init__()
        if max_signatures < 1:
            raise ValueError(f"max_signatures must be at least 1, got {max_signatures}")
        self.ens = ens
        self.clone_outputs = clone_outputs
        self.max_signatures = max_signatures
        self.backend = backend if backend is not None else CudaGraphBackend()
        self._graphs: dict[tuple, _Graph] = {}
        self._state = _state_tensors(ens)
        self._tensors_of = getattr(ens, "_stacked", None)  # BatchedModule replaces this dict when .to() replaces tensors
        self.captures = 0  # how many graphs were captured (a re-capture counts again)

    def _state_key(self) -> tuple:
        return tuple((t.data_ptr(), t._version) for t in self._state)

    def _check_mode(self) -> None:
        if self.ens.training:
            raise ExecutionError("whole-plan capture is for inference: call .eval() on the batched module first "
                                 "(training runs through the BatchedModule itself)")
        if torch.is_grad_enabled() and any(t.requires_grad for t in self._state):
            raise ExecutionError("whole-plan capture cannot record gradients: call it under torch.no_grad() or "
                                 "torch.inference_mode() (training runs through the BatchedModule itself)")

    def forward(self, *inputs):
        self._check_mode()
        flat, spec = tree_flatten(list(inputs))
        key = (spec, _signature(flat))
        if getattr(self.ens, "_stacked", None) is not self._tensors_of:  # `.to()` replaced the state tensors
            self._state, self._tensors_of = _state_tensors(self.ens), getattr(self.ens, "_stacked", None)
            self._graphs.clear()
        g = self._graphs.get(key)
        if g is None or g.state_key != self._state_key():
            g = self._capture(flat, spec, key)
        for static, x in zip(g.static_inputs, flat):
            if isinstance(static, torch.Tensor):
                static.copy_(x, non_blocking=True)
        g.replay()
        if self.clone_outputs:
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, g.static_out)
        return g.static_out

    def _capture(self, flat: list, spec: Any, key: tuple) -> _Graph:
        static_inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat]
        args = tree_unflatten(static_inputs, spec)
        buffers = list(self.ens.buffers())
        saved = [b.detach().clone() for b in buffers]
        params = [p for p in self.ens.parameters()]
        versions = [p._version for p in params]

        def run() -> Any:
            return self.ens(*args)

        def warmup() -> None:
            for _ in range(WARMUP_CALLS):
                run()

        try:
            replay, out = self.backend.capture(run, warmup)
        except ExecutionError:
            raise
        except Exception as e:  # capture raises many types; the reason is what the user needs
            raise ExecutionError(
                f"the plan cannot be captured as one graph ({type(e).__name__}: {_first_line(e)}); it needs static "
                "shapes, no host sync (.item(), data-dependent shapes) and every tensor on the GPU: run the batched "
                "module itself, or give the stages that sync the loop/vmap strategy") from e
        finally:
            with torch.no_grad():  # the warm-up (and a ReplayBackend capture) ran forward: undo its state updates
                for b, s in zip(buffers, saved):
                    if b.shape == s.shape:
                        b.copy_(s)
        if any(p._version != v for p, v in zip(params, versions)):
            raise ExecutionError("forward() updates parameters in place, which a captured graph would repeat "
                                 "unseen; run the batched module itself")
        if len(self._graphs) >= self.max_signatures and key not in self._graphs:
            self._graphs.pop(next(iter(self._graphs)))  # the oldest signature makes room
        g = _Graph(replay, static_inputs, out, self._state_key())
        self._graphs[key] = g
        self.captures += 1
        return g


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
    if backend is None:
        devices = {t.device.type for t in _state_tensors(ens)}
        if not torch.cuda.is_available() or devices - {"cuda"}:
            raise ExecutionError("whole-plan capture needs the batched module on a CUDA device (a CUDA graph records "
                                 "GPU kernels); on CPU run the module itself, or pass backend=ReplayBackend() to test")
    return CapturedPlan(ens, clone_outputs=clone_outputs, max_signatures=max_signatures, backend=backend)
