"""The `cuda_graph` strategy: capture the stage's vmapped call in a CUDA graph, replay it.

GPU only. Capture needs static shapes and no host synchronisation (`.item()`,
data-dependent shapes); when capture fails the runner raises ExecutionError
with the reason, so profile/autotune record it and move on. On CPU the runner
refuses at construction with `CPU_REFUSAL`.

Input/output format: as VmapRunner (N-first). Inputs are copied into the
captured static buffers before each replay; outputs are cloned out of the
graph's memory pool (the next replay overwrites it).

A graph bakes in everything that is not tensor data: shapes, and every
non-tensor value (a size crossing from another stage, equal per-member numbers).
So it is captured per input signature (values.signature) and re-captured for a
new one; per-member numbers that differ become a [N] tensor on the GPU *before*
capture, a static input like any other (made inside the capture, their host
copy would be baked in too).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.planner.errors import ExecutionError
from stagewise.executor.stages import Runner, VmapRunner
from stagewise.executor.values import Batched, PerMember, Shared, signature, stack_member_values

CPU_REFUSAL = "cuda_graph needs a CUDA device (a CUDA graph captures GPU kernels); on CPU use vmap, wide or compile"


def _tree(value: Any) -> Any:
    if isinstance(value, Shared):
        return ("s", value.value)
    if isinstance(value, Batched):
        return ("b", value.tree)
    return ("p", list(value.values))


def _untree(kind_tree: Any) -> Any:
    kind, tree = kind_tree
    return Shared(tree) if kind == "s" else Batched(tree) if kind == "b" else PerMember(tree)


def _signature(args: list) -> tuple:
    return signature([_tree(a) for a in args])


def tensors_first(args: list, device: torch.device | None) -> list:
    """Per-member values as one Batched tree with N-first tensors on `device` (numbers included)."""
    return [Batched(stack_member_values(a.values, device)[0]) if isinstance(a, PerMember) else a for a in args]


class CudaGraphRunner(Runner):
    """Captures VmapRunner's call once per input signature and replays it. Inference only (no gradients)."""

    trainable = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        devices = {t.device.type for t in self.stacked.values()}
        if not torch.cuda.is_available() or (devices and devices != {"cuda"}):
            raise ExecutionError(f"stage {self.program.stage.id}: {CPU_REFUSAL}")
        self._inner = VmapRunner(self.program, self.n_members, self.stacked, self.member_states)
        self._signature: tuple | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def run(self, args: list) -> list:
        args = tensors_first(args, self.device_for(args))
        key = _signature(args)
        if key != self._signature:
            self._capture(args)
            self._signature = key
        new = [x for x in tree_flatten([_tree(a) for a in args])[0] if isinstance(x, torch.Tensor)]
        for static, x in zip(self._static_in, new):
            static.copy_(x, non_blocking=True)
        self._graph.replay()
        return [_untree(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, _tree(v))) for v in self._static_out]

    def _capture(self, args: list) -> None:
        static_args = [_untree(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, _tree(a))) for a in args]
        if any(isinstance(x, torch.Tensor) and not x.is_cuda for x in tree_flatten([_tree(a) for a in static_args])[0]):
            raise ExecutionError(f"stage {self.program.stage.id}: not capturable: an input is not on the GPU; {CPU_REFUSAL}")
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: lazy inits and autotuned kernels
                    self._inner.run(static_args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._inner.run(static_args)
        except Exception as e:  # capture raises many types; the reason is what the user needs
            self._graph = None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ExecutionError(
                f"stage {self.program.stage.id}: not capturable in a CUDA graph ({type(e).__name__}: {first}); "
                "needs static shapes and no host sync (.item(), data-dependent shapes): use vmap or compile"
            ) from e
        self._graph = graph
        self._static_in = [x for x in tree_flatten([_tree(a) for a in static_args])[0] if isinstance(x, torch.Tensor)]
        self._static_out = static_out
