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


import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.planner.errors import ExecutionError, first_line
from stagewise.executor.capture import CudaGraphBackend
from stagewise.executor.stages import Runner, VmapRunner
from stagewise.executor.values import Batched, PerMember, signature, stack_member_values, tagged as _tree, untagged as _untree

CPU_REFUSAL = "cuda_graph needs a CUDA device (a CUDA graph captures GPU kernels); on CPU use vmap, wide or compile"


def _signature(args: list) -> tuple:
    return signature([_tree(a) for a in args])


def tensors_first(args: list, device: torch.device | None) -> list:
    """Per-member values as one Batched tree with N-first tensors on `device` (numbers included)."""
    return [Batched(stack_member_values(a.values, device)[0]) if isinstance(a, PerMember) else a for a in args]


class CudaGraphRunner(Runner):
    """Captures VmapRunner's call once per input signature and replays it. Inference only (no gradients).

    The warm-up calls before a capture run the stage for real, so the state the stage updates in place (a
    buffer forward writes) is put back after them: a replay then updates it exactly once per call. A stage
    state tensor that gets new storage (`p.data = ...`, `set_`) is seen and the stage captured again (the
    graph reads the storage of capture time)."""

    trainable = False
    backend_class: type = CudaGraphBackend  # tests without a GPU put capture.ReplayBackend here

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        devices = {t.device.type for t in self.stacked.values()}
        if self.backend_class is CudaGraphBackend and (not torch.cuda.is_available() or (devices and devices != {"cuda"})):
            raise ExecutionError(f"stage {self.program.stage.id}: {CPU_REFUSAL}")
        self._inner = VmapRunner(self.program, self.n_members, self.stacked, self.member_states)
        self._key: tuple | None = None
        self._replay = None
        self.graph_pool_bytes = 0  # of the current graph (see _capture)

    @property
    def inside_capture(self) -> VmapRunner:
        """What whole-plan capture runs for this stage: its vmapped call (captured with the rest of the plan)."""
        return self._inner

    def run(self, args: list) -> list:
        args = tensors_first(args, self.device_for(args))
        key = (_signature(args), tuple(t.data_ptr() for t in self.stacked.values()))
        if key != self._key:
            self._capture(args)
            self._key = key
        new = [x for x in tree_flatten([_tree(a) for a in args])[0] if isinstance(x, torch.Tensor)]
        for static, x in zip(self._static_in, new):
            static.copy_(x, non_blocking=True)
        self._replay()
        if self.program.writes_in_place:  # the stage wrote into its inputs' static copies: later stages read the inputs
            for x, static in zip(new, self._static_in):
                x.copy_(static)
        return [_untree(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, t)) for t in self._static_out]

    def _capture(self, args: list) -> None:
        static_args = [_untree(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, _tree(a))) for a in args]
        if self.backend_class is CudaGraphBackend and any(
                isinstance(x, torch.Tensor) and not x.is_cuda for x in tree_flatten([_tree(a) for a in static_args])[0]):
            raise ExecutionError(f"stage {self.program.stage.id}: not capturable: an input is not on the GPU; {CPU_REFUSAL}")
        state = list({id(t): t for t in self.stacked.values()}.values())  # a parameter forward updates too
        saved = [t.detach().clone() for t in state]

        def warmup() -> None:
            for _ in range(2):  # outside the graph: lazy inits and autotuned kernels
                self._inner.run(static_args)

        self._replay, self._key = None, None
        backend = self.backend_class()
        try:
            replay, static_out = backend.capture(lambda: [_tree(v) for v in self._inner.run(static_args)], warmup)
        except Exception as e:  # capture raises many types; the reason is what the user needs
            raise ExecutionError(
                f"stage {self.program.stage.id}: not capturable in a CUDA graph ({type(e).__name__}: {first_line(e)}); "
                "needs static shapes and no host sync (.item(), data-dependent shapes): use vmap or compile"
            ) from e
        finally:  # the warm-up (and a ReplayBackend's capture run) updated the stage's buffers: put them back
            with torch.no_grad():
                for t, v in zip(state, saved):
                    if not torch.equal(t, v):  # a copy would move the version counter for nothing
                        t.copy_(v)
        self._replay = replay
        # the graph's private pool (its intermediates and outputs), held while the graph lives: replays allocate
        # nothing there, so an allocator peak around a call misses it (profile adds it to the stage's peak)
        self.graph_pool_bytes = getattr(backend, "pool_bytes", 0)
        self._static_in = [x for x in tree_flatten([_tree(a) for a in static_args])[0] if isinstance(x, torch.Tensor)]
        self._static_out = static_out  # tagged trees (values.tagged): the graph's output tensors
