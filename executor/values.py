"""Values that cross stage boundaries, each carried per member.

Three forms (member axis N first wherever there is one):
- Shared(v): the same value for every member (a shared model input, a size).
- Batched(tree): a pytree whose tensor leaves are [N, ...]; non-tensor leaves
  are the same for every member (what a vmapped stage returns).
- PerMember(list): N separate values (what a member loop returns; may hold
  Python numbers from `.item()`).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from stagewise.planner.errors import ExecutionError


# the device of the stage whose runner is running (executor.stages.Runner.__call__ sets it), so that
# numbers turned into tensors anywhere inside a stage land on its device, whichever strategy runs it
_stage_device: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("stage_device", default=None)


@contextlib.contextmanager
def stage_device(device: torch.device | None) -> Iterator[None]:
    """Within this block, stack_member_values puts numbers on `device` unless told otherwise."""
    token = _stage_device.set(device)
    try:
        yield
    finally:
        _stage_device.reset(token)


# the same without a context manager, for the per-call path (a generator-based `with` costs microseconds)
set_stage_device = _stage_device.set
reset_stage_device = _stage_device.reset

# what the running stage computes with (its state tensors, its boundary values), looked at only when per-member
# Python floats become a tensor (see number_dtype); set per stage call as cheaply as the device above
_number_context: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("number_context", default=None)
set_number_context = _number_context.set
reset_number_context = _number_context.reset
# the same for the whole forward call (the module's stacked state, its bound inputs; BatchedModule._run_plain), for
# floats stacked where no stage's tensors tell: a stage holding no floating tensor (only numbers come in), the
# model's outputs (stacked after the last stage)
_call_number_context: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("call_number_context", default=None)
set_call_number_context = _call_number_context.set
reset_call_number_context = _call_number_context.reset


def number_dtype(*trees: Any) -> torch.dtype:
    """The dtype per-member Python floats take as one [N] tensor beside the tensors in `trees` (tensors, boundary
    values, pytrees of either): float64 when any floating one is float64, else torch's default dtype.

    A Python float is a double. Beside a float64 tensor the loop computes in double, so the numbers must stay
    float64 (as float32 they lose digits: a silent precision loss); beside float32 ones the loop rounds the
    number to float32 anyway, and a float64 [N] tensor would turn a 0-d float32 result float64."""
    return _floating_dtype(trees) or torch.get_default_dtype()


def _floating_dtype(trees: tuple) -> torch.dtype | None:
    """number_dtype of `trees`, or None when they hold no floating tensor (nothing to follow)."""
    found = None
    for tree in trees:
        if _is_tensor(tree):
            leaves = [tree]
        elif isinstance(tree, dict):
            leaves = list(tree.values())
        else:
            leaves = tree_flatten(_tree_of(tree) if isinstance(tree, (Shared, Batched, PerMember)) else tree)[0]
        for x in leaves:
            dtype = _floating_dtype((x,)) if isinstance(x, (Shared, Batched, PerMember)) else \
                x.dtype if _is_tensor(x) and x.is_floating_point() else None
            if dtype is torch.float64:
                return dtype
            if dtype is not None:
                found = torch.get_default_dtype()
    return found


def _float_dtype() -> torch.dtype:
    """The dtype of per-member floats stacked now: the running stage's number_dtype, else (that stage holds no
    floating tensor, or none runs) the forward call's, else torch's default dtype."""
    for context in (_number_context.get(), _call_number_context.get()):
        dtype = _floating_dtype(context) if context is not None else None
        if dtype is not None:
            return dtype
    return torch.get_default_dtype()


def model_float_dtype() -> torch.dtype:
    """The precision a Python float operand takes in the running stage, judged by the state alone (the stage's own,
    else the forward call's state and inputs): float64 in a float64 model, else torch's default dtype. Unlike
    _float_dtype, the stage's boundary values do not count: an [N] float64 tensor of exact numbers is among them."""
    stage, call = _number_context.get(), _call_number_context.get()
    for context in ((stage[0],) if stage else None, call):
        dtype = _floating_dtype(context) if context is not None else None
        if dtype is not None:
            return dtype
    return torch.get_default_dtype()


@dataclass(frozen=True)
class Shared:
    value: Any


@dataclass(frozen=True)
class Batched:
    tree: Any  # tensor leaves are N-first


@dataclass(frozen=True)
class PerMember:
    values: list


def leaf_paths(tree: Any) -> tuple:
    """Where each leaf of `tree` sits, by keys and positions alone: a dict, an OrderedDict (a model output class),
    a dataclass with the same fields are alike, so are a list and a tuple; other keys are not (`{self.name: y}`)."""
    try:
        flat = tree_flatten_with_path(tree)[0]
    except Exception:  # noqa: BLE001 - a container type registered without key paths: its structure as a whole
        return (repr(tree_flatten(tree)[1]),)
    return tuple(tuple(_key(k) for k in path) for path, _ in flat)


def _key(k: Any) -> Any:
    if isinstance(k, MappingKey):
        return k.key
    if isinstance(k, SequenceKey):
        return k.idx
    if isinstance(k, GetAttrKey):
        return k.name
    return str(k)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def batched_arg(v, device: torch.device | None = None, float_dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(argument, in_dims) for passing a boundary value into vmap; per-member numbers become tensors on `device`
    (floats as `float_dtype`, see stack_member_values)."""
    if isinstance(v, Shared):
        return v.value, None
    if isinstance(v, Batched):
        if _is_tensor(v.tree):  # the common case, without a pytree walk per call
            return v.tree, 0
        return v.tree, tree_map(lambda x: 0 if _is_tensor(x) else None, v.tree)
    return stack_member_values(v.values, device, float_dtype)


def _tree_of(v: Any) -> Any:
    if isinstance(v, Shared):
        return v.value
    if isinstance(v, Batched):
        return v.tree
    return v.values if isinstance(v, PerMember) else v


def device_of(values: list) -> torch.device | None:
    """The device of the first tensor among `values` (boundary values or plain pytrees), or None."""
    for v in values:
        tree = _tree_of(v)
        if _is_tensor(tree):  # the common case, without a pytree walk
            return tree.device
        for x in tree_flatten(tree)[0]:
            if _is_tensor(x):
                return x.device
    return None


def signature(tree: Any) -> tuple:
    """What a specialised (compiled, captured) call depends on besides tensor data: the tree's
    structure, each tensor leaf's shape, dtype and device, and every non-tensor leaf's value."""
    leaves, spec = tree_flatten(tree)
    return repr(spec), tuple((tuple(x.shape), x.dtype, x.device) if _is_tensor(x) else (type(x).__name__, repr(x))
                             for x in leaves)


def stack_member_values(values: list, device: torch.device | str | None = None,
                        float_dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """Turn N per-member values into one tree with N-first tensors (and its in_dims).

    Per-member Python numbers become one [N] tensor on `device` (the device of the
    stage that reads them: a CPU tensor there fails under vmap on CUDA); when None,
    on the device of the stage running now (stage_device), else of the values' own
    tensors, else the CPU. Ints stay int64 and bools bool; floats become `float_dtype`,
    when None the number_dtype of the stage running now (set_number_context), else of
    the forward call running now (set_call_number_context), else torch's default dtype.
    """
    if values and all(_is_tensor(v) for v in values):  # the common case (a loop stage's tensors), without pytree walks
        return _stack(values), 0
    if device is None:
        device = _stage_device.get() or device_of(list(values))
    flat = [tree_flatten(v) for v in values]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise ExecutionError("members returned differently structured values at a stage boundary; this stage must stay a loop to the end")
    leaves, dims = [], []
    for column in zip(*(f[0] for f in flat)):
        first = column[0]
        if _is_tensor(first):
            leaves.append(_stack(column))
            dims.append(0)
        elif all(not _is_tensor(c) and c == first for c in column[1:]):
            leaves.append(first)
            dims.append(None)
        elif isinstance(first, (bool, int, float)):
            # per-member numbers: a [N] tensor, a 0-d scalar per member (floats at the precision the loop computes in)
            floats = any(isinstance(c, float) for c in column)
            leaves.append(torch.tensor(column, device=device, dtype=(float_dtype or _float_dtype()) if floats else None))
            dims.append(0)
        else:
            raise ExecutionError(f"members produced different {type(first).__name__} values at a stage boundary; keep their consumers in a loop stage")
    return tree_unflatten(leaves, spec), tree_unflatten(dims, spec)


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.stack of the members' tensors; ExecutionError when their shapes differ (a shape that depends on the values)."""
    try:
        return torch.stack(tensors)
    except RuntimeError:
        shapes = [tuple(t.shape) for t in tensors]
        layout = next((t.layout for t in tensors if t.layout not in (torch.strided, torch.sparse_coo)), None)
        if layout is not None:
            raise ExecutionError(
                f"members produced tensors of layout {layout}, which torch cannot stack N-first: return them dense, or "
                "as sparse COO (.to_sparse()), from forward(), and convert the batched module's output") from None
        if len(set(shapes)) == 1:
            raise
        raise ExecutionError(
            f"members produced tensors of different shapes ({', '.join(str(list(s)) for s in shapes[:3])}{', ...' if len(shapes) > 3 else ''}): "
            "a shape that depends on the values (boolean masking, nonzero, unique) cannot be stacked N-first. Keep the "
            "ops that use it in one loop stage with their consumers, and return one shape per call from forward() "
            "(pad it, or return the mask with the full tensor)") from None


def member_value(v, i: int) -> Any:
    """The value member `i` sees."""
    if isinstance(v, Shared):
        return v.value
    if isinstance(v, Batched):
        return tree_map(lambda x: x[i] if _is_tensor(x) else x, v.tree)
    return v.values[i]


def member_rows(v, n: int, views: bool = True) -> list:
    """What each of the `n` members sees of `v` (member_value for every i at once).

    `views`: a Batched tensor's rows come from one `unbind` (one call instead of n indexings); such
    rows cannot be written in place under autograd, so a stage that writes in place passes False.
    """
    if type(v) is Shared:
        return [v.value] * n
    if type(v) is Batched:
        x = v.tree
        if _is_tensor(x):
            return list(x.unbind(0)) if views else [x[i] for i in range(n)]
        return [member_value(v, i) for i in range(n)]
    if type(v) is PerMember:
        return v.values
    return [member_value(v, i) for i in range(n)]


def as_batched(v, n: int, device: torch.device | None = None):
    """`v` as a Batched value whose member rows can be written in place.

    Shared tensors become [N, ...] copies, PerMember ones are stacked (numbers onto
    `device`, see stack_member_values), and Batched tensors that are expanded views
    (stride 0 on the member axis) are copied.
    """
    if isinstance(v, Shared):
        return Batched(tree_map(lambda x: x.unsqueeze(0).expand(n, *x.shape).clone() if _is_tensor(x) else x, v.value))
    if isinstance(v, PerMember):
        base = rows_of_one_tensor(v.values)
        if base is not None:  # member rows of one stacked tensor (state a loop stage read): keep writing into it
            return Batched(base)
        return Batched(stack_member_values(v.values, device)[0])
    # vmap returns a value that did not depend on the members as an expanded view (stride 0 on
    # the member axis): all members would share one memory row, so give them their own
    return Batched(tree_map(lambda x: x.clone() if _is_tensor(x) and x.dim() and x.shape[0] > 1 and x.stride(0) == 0 else x, v.tree))


def rows_of_one_tensor(values: list) -> torch.Tensor | None:
    """One [N, ...] view of the tensor `values` are views of, member i's row holding values[i]; None if they are not
    such views. values[i] is base[i] itself (a loop stage read state), or the same view of every member's row
    (`mem[0]` of member i is base[i][0]): a write into the result then lands where it lands in the loop."""
    if not values or not all(_is_tensor(x) for x in values):
        return None
    base = values[0]._base
    n = len(values)
    if base is None or base.dim() == 0 or base.shape[0] != n:
        return None
    first = values[0]
    step = base.stride(0)
    for i, x in enumerate(values):
        if x._base is not base or x.shape != first.shape or x.stride() != first.stride() or x.dtype != first.dtype \
                or x.storage_offset() != first.storage_offset() + i * step:
            return None
    offset = first.storage_offset() - base.storage_offset()
    if not 0 <= offset < step or (first.numel() and span(first) > step):
        return None  # not inside member 0's row: not the same view of every row
    if offset == 0 and first.shape == base.shape[1:] and first.stride() == base.stride()[1:]:
        return base
    return base.as_strided((n, *first.shape), (step, *first.stride()), first.storage_offset())


def span(x: torch.Tensor) -> int:
    """How many elements from its first to its last one `x` spans in its storage, its first one counted."""
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride()))


def n_first(v, n: int, device: torch.device | None = None, float_dtype: torch.dtype | None = None) -> Any:
    """A boundary value as the module's output: tensors N-first, a pytree of them for containers
    (per-member numbers as a [N] tensor on `device`, floats as `float_dtype`, see stack_member_values)."""
    if isinstance(v, Batched):
        return v.tree
    if isinstance(v, Shared):
        return as_batched(v, n).tree
    tree, _ = stack_member_values(v.values, device, float_dtype)  # per-member numbers come back as a [N] tensor, equal ones stay plain
    return tree


def tagged(value: Any) -> tuple:
    """A boundary value (Shared / Batched / PerMember) as a plain pytree that flattens to its tensors (graph buffers)."""
    if isinstance(value, Shared):
        return ("s", value.value)
    if isinstance(value, Batched):
        return ("b", value.tree)
    return ("p", list(value.values))


def untagged(kind_tree: tuple) -> Any:
    """The boundary value `tagged` made a pytree of."""
    kind, tree = kind_tree
    return Shared(tree) if kind == "s" else Batched(tree) if kind == "b" else PerMember(tree)
