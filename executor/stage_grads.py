"""One stage forward and backward, and the check of its gradients against the member loop's.

Used by the training profile (executor.profile_train) and the training-mode autotune
(executor.autotune_train). A stage's float inputs that come from earlier stages are made
leaves that require grad, the surrogate loss is the sum of its float outputs, and
`torch.autograd.grad` gives the gradients of its member state and of those inputs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.executor.candidates import max_rel_error
from stagewise.executor.own_storage import own_storage
from stagewise.executor.stages import LoopRunner, Runner, StageProgram
from stagewise.executor.values import Batched, PerMember, Shared, n_first

GRAD_RTOL = 1e-4  # float32 gradients summed in different orders


def float_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a pytree."""
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _leaf(x: Any) -> Any:
    return x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _with_grad_leaves(args: list) -> tuple[list, list[torch.Tensor]]:
    """The stage's arguments with every float tensor of a batched or per-member value a fresh leaf that requires grad."""
    out, leaves = [], []
    for a in args:
        if isinstance(a, Batched):
            a = Batched(tree_map(_leaf, a.tree))
        elif isinstance(a, PerMember):
            a = PerMember([tree_map(_leaf, v) for v in a.values])
        out.append(a)
        if not isinstance(a, Shared):
            leaves += [x for x in tree_flatten(a.tree if isinstance(a, Batched) else a.values)[0]
                       if isinstance(x, torch.Tensor) and x.requires_grad]
    return out, leaves


def fwd_bwd(program: StageProgram, runner: Runner, fresh: Callable[[], list], n: int) -> Callable[[], list]:
    """A call running the stage forward and backward (surrogate loss = sum of its float outputs); returns the gradients."""
    params = [t for t in runner.stacked.values() if t.requires_grad]
    fixed = None if program.writes_in_place else _with_grad_leaves(fresh())

    by_member = program.writes_in_place and isinstance(runner, LoopRunner)

    def call() -> list:
        args, leaves = fixed if fixed is not None else (fresh(), [])
        if by_member:
            args = _own_rows(args, n)
        outs = runner(args)
        loss = sum((x.float().sum() for v in outs for x in float_leaves(n_first(v, n))), torch.zeros((), device=_device(params, leaves)))
        targets = params + leaves
        if not targets or not loss.requires_grad:
            return []
        grads = torch.autograd.grad(loss, targets, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]

    return call


def _own_rows(args: list, n: int) -> list:
    """Each member's own copy of the memory its values share with other members', for a stage run member by member
    that writes in place, as the batched module hands them (build._Writes, own_storage): rows of one tensor share its
    version counter, so an op that saves a value for backward (ReLU(inplace=True)) would find it changed by the next
    member's write. Nothing is written back: only the gradients are kept."""
    return own_storage(args, n, range(len(args)))[0]


def _device(params: list, leaves: list) -> torch.device | None:
    t = next(iter(params + leaves), None)
    return t.device if t is not None else None


def grads_check(ref: list, n: int) -> Callable[[list], float]:
    """Error of a stage's gradients against the member loop's, normwise over each member's [N, ...] gradients
    (a per-member input's pieces are compared as one row each)."""
    return lambda got: max(max_rel_error(*pair) for pair in zip(_rows(got, n), _rows(ref, n))) if ref else 0.0


def _rows(grads: list, n: int) -> list:
    """(the [N, ...] gradients as one [N, total] tensor, the rest as rows of their own)."""
    # (a complex gradient as its (real, imaginary) pairs: .float() would keep its real part alone)
    stacked = [(torch.view_as_real(g.resolve_conj()) if g.is_complex() else g).reshape(n, -1).float()
               for g in grads if g.dim() and g.shape[0] == n]
    rest = [g.reshape(1, -1) for g in grads if not (g.dim() and g.shape[0] == n)]
    return [torch.cat(stacked, dim=1) if stacked else torch.zeros(n, 0)] + rest


