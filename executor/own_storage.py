"""Each member's own copy of the memory its values share with other members', for a stage run member by member.

A loop stage's per-member values are often rows of one tensor (a batched stage's [N, ...] output) or views of such
rows (a loop stage handed on `r = h.add_(1)` and `h`). Rows of one tensor share its version counter: when member 1
writes its row, autograd counts member 0's row as modified too, and an op of member 0 that saved it for backward
(ReLU(inplace=True), a Linear reading a value written later) fails at backward with "modified by an inplace
operation", where the member loop, whose members hold tensors of their own, trains.

`own_storage` gives each member a private copy of the stretch of each such storage its values cover, and re-makes the
member's values as the same views of the copy (same sizes, strides and offsets relative to the stretch): values that
shared memory still do, so one write reaches all of them, as in the loop, and no other member's write moves the copy's
version counter. After the stage ran, `write_back` copies each stretch a member wrote into the original memory, and
`as_original` re-makes the stage's outputs that view a copy as the same views of the original, so that later stages
read and write the memory the other values hold.

Left as they are (the version counter stays shared): memory two members' values overlap in (one tensor every member
reads), values of different element types over one storage, and storages no written value reaches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from stagewise.executor.values import Batched, PerMember, Shared
from stagewise.planner.errors import ExecutionError


@dataclass(frozen=True)
class OwnStretch:
    """One member's private copy of [lo, hi) of a storage (`copy`), and that stretch of the original (`original`)."""

    copy: torch.Tensor
    original: torch.Tensor
    always: bool  # write back whatever the version counter says (a write through `.data` moves none)
    # the copy's grad_fn when made (None: it records no gradients): a member's write that records gradients replaces
    # it (CopySlices, ClampBackward...), one under torch.no_grad() or through `.data` does not (write_back's leaf check)
    made_by: Any = field(default=None, compare=False)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # torch.func's wrappers hold no storage of their own
        return None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) of the elements `t` reaches in its storage (strides are never negative in torch)."""
    lo = t.storage_offset()
    return lo, lo + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _base_covering(values: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose memory the `values` view (their common `._base`, or one of them that is no view). Values of
    one memory may come from two such tensors where one is a detached alias of the other (`h` and `h.detach()`,
    handed on both): the one that records gradients then, whose history the copy must carry on (a copy of the
    detached one would hand `h`'s readers a value no gradient reaches `h` through)."""
    bases = {id(b): b for b in (x._base if x._base is not None else x for x in values)}
    if len(bases) == 1:
        return next(iter(bases.values()))
    recording = [b for b in bases.values() if b.requires_grad]
    return recording[0] if len(recording) == 1 else None


def _covers(base: torch.Tensor, extent: tuple[int, int]) -> bool:
    """Whether `base` is laid out densely (no gaps, no overlap) over a stretch holding `extent`."""
    lo, hi = _extent(base)
    if not (lo <= extent[0] and extent[1] <= hi):
        return False
    step = 1  # dense: each dimension, by growing stride, steps over all the ones before it exactly
    for size, stride in sorted(((sz, st) for sz, st in zip(base.shape, base.stride()) if sz != 1), key=lambda d: d[1]):
        if stride != step:
            return False
        step *= size
    return True


def _member_leaves(args: list, n: int) -> list[list[list[Any]]] | None:
    """For each argument, each member's leaves (a batched value's are its rows); None where no member has its own."""
    out = []
    for a in args:
        if type(a) is Batched:
            flat, _ = tree_flatten(a.tree)
            out.append([[x[i] if isinstance(x, torch.Tensor) else x for x in flat] for i in range(n)])
        elif type(a) is PerMember:
            out.append([tree_flatten(v)[0] for v in a.values])
        else:
            out.append(None)
    return out


def own_storage(args: list, n: int, written: Iterable[int], always: bool = False) -> tuple[list, list[OwnStretch]]:
    """(`args` with each member's values in the memory it shares with other members re-made over a private copy,
    the copies with their originals). `written`: the positions of the arguments the stage may write; only storages
    one of their tensors lives in are copied (a write into a tensor that records no gradient may still make it record
    one, `x.mul_(w)`). Batched arguments with a copied row become
    PerMember. See the module's docstring."""
    per_arg = _member_leaves(args, n)
    written = {k for k in written if per_arg[k] is not None}
    shared_keys = {_storage_key(x) for a in args if type(a) is Shared for x in tree_flatten(a.value)[0]
                   if isinstance(x, torch.Tensor)}
    # storage -> member -> [(arg, leaf index, tensor)]
    by_storage: dict[int, dict[int, list[tuple[int, int, torch.Tensor]]]] = {}
    wanted: set[int] = set()
    for k, members in enumerate(per_arg):
        if members is None:
            continue
        for i, leaves in enumerate(members):
            for j, x in enumerate(leaves):
                if not isinstance(x, torch.Tensor) or x.numel() == 0:
                    continue
                key = _storage_key(x)
                if key is None:
                    return args, []
                by_storage.setdefault(key, {}).setdefault(i, []).append((k, j, x))
                if k in written:
                    wanted.add(key)
    replaced: dict[tuple[int, int, int], torch.Tensor] = {}  # (arg, member, leaf index) -> the view of the copy
    stretches: list[OwnStretch] = []
    for key in wanted:
        members = by_storage[key]
        if key in shared_keys or len({x.dtype for found in members.values() for _, _, x in found}) != 1:
            continue
        extents = {i: (min(_extent(x)[0] for _, _, x in found), max(_extent(x)[1] for _, _, x in found))
                   for i, found in members.items()}
        spans = sorted(extents.values())
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            continue  # two members' values overlap in memory: one tensor they all hold, a write must reach every one
        base = _base_covering(x for found in members.values() for _, _, x in found)
        if base is None or any(not _covers(base, extents[i]) for i in members):
            continue
        for i, found in members.items():
            lo, hi = extents[i]
            # a stretch of the base, not of the value: a stretch reaching past the value (the rows of h between those
            # of v = h[:3] of a transposed h) has gradients only the base can take back
            original = base.as_strided((hi - lo,), (1,), lo)
            own = original.clone()
            stretches.append(OwnStretch(own, original, always, own.grad_fn))
            # a detached alias (`h.detach()`, written in place to change h's values out of autograd's sight) stays
            # one: the same memory, the same version counter, no history
            untracked = own.detach() if own.requires_grad else own
            for k, j, x in found:
                replaced[(k, i, j)] = (own if x.requires_grad else untracked).as_strided(
                    x.size(), x.stride(), x.storage_offset() - lo)
    if not replaced:
        return args, []
    out = list(args)
    for k, members in enumerate(per_arg):
        if members is None or not any((k, i, j) in replaced for i in range(n) for j in range(len(members[i]))):
            continue
        spec = tree_flatten(args[k].tree if type(args[k]) is Batched else args[k].values[0])[1]
        specs = [spec] * n if type(args[k]) is Batched else [tree_flatten(v)[1] for v in args[k].values]
        out[k] = PerMember([tree_unflatten([replaced.get((k, i, j), x) for j, x in enumerate(leaves)], specs[i])
                            for i, leaves in enumerate(members)])
    return out, stretches


def write_back(stretches: list[OwnStretch], state: set[int] = frozenset()) -> None:
    """Copy each stretch a member wrote (its copy's version counter moved) into the original memory, through a view
    taken now (after one member's write that records gradients, a view taken before it is refused by autograd).
    `state`: storage keys of the module's stacked state. ExecutionError, before any write, where a member wrote a
    value that records gradients into state that records none (a buffer: `self.ema.copy_(0.9 * self.ema + 0.1 * f)`
    without .detach()); an activation so written (`out.index_add_(0, tok, y)` into zeros_like(x)) records them.
    ExecutionError too, before any write, where a member's write that records gradients went into (a view of) a leaf
    that requires grad (`x.clamp_(0, 1)` on an input given with requires_grad=True): the member loop raises torch's
    RuntimeError there, and a member's copy is no leaf, so torch said nothing in the stage. A leaf written under
    torch.no_grad() (a max_norm lookup renormalising a parameter's rows) is written back, under no_grad, as torch lets
    the loop."""
    written = [s for s in stretches if s.always or s.copy.is_inference() or s.copy._version != 0]
    if torch.is_grad_enabled() and any(s.copy.requires_grad and not s.original.requires_grad
                                       and _storage_key(s.original) in state for s in written):
        raise ExecutionError(
            "forward() writes a value that records gradients into state that records none (a buffer: "
            "`self.ema.copy_(0.9 * self.ema + 0.1 * f)`, a recurrent state `self.h.copy_(h)`, without .detach()): the "
            "member loop's buffer would then carry this call's graph into the next one, whose backward fails there. "
            "Write a detached value (`.detach()`), or call the module under torch.no_grad()")
    leaf = next((s for s in written if s.copy.grad_fn is not s.made_by and _grad_leaf(s.original) is not None), None)
    if leaf is not None:
        raise _leaf_write_refusal(_grad_leaf(leaf.original))
    for s in written:
        target, root = s.original, s.original._base
        if root is not None and root.is_leaf and root.requires_grad:  # a parameter written in place (a max_norm
            with torch.no_grad():  # lookup renormalises its rows under no_grad): written as the member's was
                target.copy_(s.copy)
            continue
        if root is not None and s.copy.requires_grad:
            target = root.as_strided(target.size(), target.stride(), target.storage_offset())
        target.copy_(s.copy)


def _grad_leaf(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf that requires grad `t` is (or views), or None."""
    root = t._base if t._base is not None else t
    return root if root.is_leaf and root.requires_grad else None


def _leaf_write_refusal(leaf: torch.Tensor) -> ExecutionError:
    """The member loop's own refusal (torch's RuntimeError at the write), said by what was written and how to fix it."""
    shape = list(leaf.shape)
    return ExecutionError(
        f"forward() writes in place, with gradients recorded, a tensor that is (a view of) a leaf that requires grad, of "
        f"shape {shape} (a model input given with requires_grad=True, the image an input optimisation updates, or a "
        f"parameter): the member loop fails at that write with torch's RuntimeError \"a view of a leaf Variable that "
        f"requires grad is being used in an in-place operation.\", so the batched module refuses it too, before anything "
        f"is written. Pass a non-leaf (x.clone(), whose gradient still reaches x), or clone it in forward() "
        f"(x = x.clone() before the in-place op)")


def as_original(stretches: list[OwnStretch]) -> Callable[[Any], Any]:
    """A map taking a tensor that views a member's copy to the same view of the original memory (others unchanged)."""
    by_key = {_storage_key(s.copy): s for s in stretches}

    def back(t: Any) -> Any:
        s = by_key.get(_storage_key(t)) if isinstance(t, torch.Tensor) else None
        if s is None:
            return t
        return s.original.as_strided(t.size(), t.stride(), s.original.storage_offset() + t.storage_offset()
                                     - s.copy.storage_offset())
    return back
