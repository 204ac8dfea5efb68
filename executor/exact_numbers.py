"""executor.exact_numbers: Python arithmetic on numbers read from tensors, in double as the member loop does it.

`m, m2 = h.mean().item(), (h * h).mean().item()` then `m2 - m * m`: in the member loop these are Python floats, so
the arithmetic runs in double. A batched stage gets such numbers as one [N] tensor (one number per member) at the
plan's float precision, where `m * m` near 1e4 loses the digits the subtraction needs (1.2e-3 off the loop's variance
in float32). Build rewrites each such arithmetic node (`number_op`) to run on float64 operands, and wraps where its
result leaves number arithmetic, an op that takes it beside tensors or the stage's outputs (`number_operand`), in a
cast back to the precision a Python number has there: a float32 tensor rounds a Python float operand to float32, and
an [N] float64 tensor would turn a 0-d float32 result float64. On Python numbers (a loop stage) both are plain
arithmetic and the identity.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch

from stagewise.executor.values import Batched, PerMember

# Python's arithmetic and comparisons, by name (a node's target must print as code: a name, not the function)
_OPS = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs, "add": operator.add, "sub": operator.sub,
        "mul": operator.mul, "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
        "pow": operator.pow, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
        "eq": operator.eq, "ne": operator.ne}
OP_NAMES = {fn: name for name, fn in _OPS.items()}


# how forward() reads a tensor's value into Python: `t.item()`, `t.tolist()`, torch.export's aten._local_scalar_dense
_READS = frozenset({"item", "_local_scalar_dense", "tolist"})


def read_numbers(gm: torch.fx.GraphModule, inputs: Iterable[str] = ()) -> frozenset[str]:
    """Names of the nodes of `gm` whose value is a Python number read from a tensor (`h.mean().item()`, `float(t)`),
    one of the per_member Python-number `inputs` (placeholder names: a discount per member), or computed from such
    numbers alone by Python arithmetic or comparisons (`m2 - m * m`, `1 - gamma`, `s > 0.5`): said by the graph's
    structure (a build's trace runs nothing). A node reading a tensor besides such numbers (`h - m`) is not one: its
    value is a tensor, which torch computes as the loop does."""
    out: set[str] = set()
    sizes: set[str] = set()  # a tensor's sizes (`h.numel()`, `x.shape[0]`): the same Python int in every member
    given = set(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in given:
            out.add(node.name)
        if node.op not in ("call_function", "call_method"):
            continue
        if _is_size(node, sizes):
            sizes.add(node.name)
            continue
        inputs = node.all_input_nodes
        if node.op == "call_method" and node.target in _READS or (
                isinstance(node.target, torch._ops.OpOverload)
                and node.target._schema.name.split("::")[-1] in _READS):
            out.add(node.name)
        elif node.op == "call_function" and node.target is operator.getitem and inputs and inputs[0].name in out:
            out.add(node.name)  # `m, m2 = t.tolist()`: a number of the list read (or a list of them)
        elif node.op == "call_function" and node.target in (float, int, bool) and len(inputs) == 1 and not node.kwargs:
            out.add(node.name)  # float(t): a tensor's value, or a number already (float(n) of a size: plain arithmetic)
        elif node.op == "call_function" and getattr(node.target, "__module__", None) == "math" and inputs:
            out.add(node.name)  # math.log(t) of a 0-d tensor reads its value too; of numbers: a number of them
        elif node.op == "call_function" and (node.target in OP_NAMES or node.target in _NUMBER_FUNCTIONS
                                             or getattr(node.target, "__module__", None) == "math") \
                and any(a.name in out for a in inputs) and all(a.name in out or a.name in sizes for a in inputs):
            out.add(node.name)  # (`h.sum().item() / h.numel()`: a number and a size; `round(m, 2)`, `math.exp(s)`)
    return frozenset(out)


_NUMBER_FUNCTIONS = (round, abs, min, max)  # Python's, on numbers: a number (run per member, as they need Python's)


def stacked_numbers(args: list, positions: tuple[int, ...], device: torch.device | None) -> list:
    """`args` with each value at `positions` (a number read from tensors, handed on by a loop stage as one Python
    number per member) as one [N] tensor for a batched stage: floats as float64, the loop's doubles (stacked at the
    plan's precision they would lose digits before the arithmetic that follows, exact_numbers' number_op)."""
    out = list(args)
    for k in positions:
        v = out[k]
        if type(v) is PerMember and v.values and all(type(x) is float for x in v.values):
            out[k] = Batched(torch.tensor(v.values, dtype=torch.float64, device=device))
    return out


def python_numbers(args: list, positions: tuple[int, ...], keep_grad: bool = True) -> list:
    """`args` with each value at `positions` (a number forward() read from a tensor, handed on by a batched stage as an
    [N] tensor) as one Python number per member, as the member loop has them: `round(s, 1)`, `range(n)` and ops that
    take a Python number refuse a 0-d tensor. float64 and int64 rows give the numbers exactly (number_op)."""
    out = list(args)
    for k in positions:
        v = out[k]
        if type(v) is Batched and isinstance(v.tree, torch.Tensor) and v.tree.dim() == 1:
            # (a tensor that records gradients, `temps = torch.tensor([...], requires_grad=True)` passed per member: its
            # rows, 0-d tensors carrying the graph, as the loop's `temps[i]`; numbers would drop the gradient)
            out[k] = PerMember(list(v.tree.unbind(0)) if keep_grad and _carries_derivative(v.tree) else v.tree.tolist())
    return out


def _carries_derivative(t: torch.Tensor) -> bool:
    """Whether `t` records a gradient, carries a forward-mode tangent (torch.func.jvp / jacfwd, a forward_ad dual), or
    is mapped by a transform of the caller's (torch.func.vmap over a batch of calls): its rows are then kept as 0-d
    tensors, as the loop's `w[i]`; numbers would drop the derivative (or cannot be read)."""
    if t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    from torch.autograd import forward_ad  # noqa: PLC0415
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None


_SIZE_METHODS = frozenset({"size", "numel", "dim", "nelement", "ndimension"})
_SIZE_OPS = frozenset({"sym_size", "sym_numel", "sym_stride", "sym_storage_offset"})


def _is_size(node: torch.fx.Node, sizes: set[str]) -> bool:
    """`node` gives a tensor's sizes, or a part of them: `x.size()`, `x.numel()`, `x.shape`, `x.shape[0]`, `len(x)`,
    torch.export's aten.sym_size."""
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1] in _SIZE_OPS
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] in ("shape", "ndim")
    if node.target is len:
        return True
    return node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0].name in sizes


def number_op(name: str, *args: Any) -> Any:
    """`operator.<name>(*args)` with tensor operands as float64 where Python would compute in double: any operand a
    float (a floating tensor, a Python float), or true division. Whole numbers among whole numbers stay int64, as
    Python's ints do (a float64 would drop digits past 2**53)."""
    op = _OPS[name]
    if not any(isinstance(a, torch.Tensor) for a in args):
        return op(*args)
    # (a whole number to a negative whole power, `n ** -1` or `2 ** -k` with k per member, is a float in Python; to
    # a non-negative one, a whole number: torch's int64 power gives 0 for a negative exponent)
    floats = name == "truediv" or (name == "pow" and _negative_exponent(args[1])) or any(
        isinstance(a, float) or (isinstance(a, torch.Tensor) and a.is_floating_point()) for a in args)
    if not floats:
        if name in _BOOLS_AS_INTS:  # Python's True + True is 2; torch's bool + bool is `or`
            args = tuple(a.long() if isinstance(a, torch.Tensor) and a.dtype is torch.bool else a for a in args)
        return op(*args)
    return op(*(a.double() if isinstance(a, torch.Tensor) and a.dtype is not torch.float64 and not a.is_complex()
                else a for a in args))


@torch.compiler.disable  # (a compiled stage runs it eagerly: it reads the exponents)
def _negative_exponent(e: Any) -> bool:
    """A whole-number exponent below 0 for some member (the powers are then Python floats, one number per member
    holding them all). A tensor's is read once on the host; while a CUDA graph captures (no reads) it is taken as
    negative: float64 holds any whole power below 2**53 exactly."""
    if not isinstance(e, torch.Tensor):
        return e < 0
    if e.is_floating_point() or e.is_complex():
        return False  # floats already
    if e.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    while torch._C._functorch.is_batchedtensor(e):  # inside vmap: the exponents of every member at once
        e = torch._C._functorch.get_unwrapped(e)
    return bool((e < 0).any())


_BOOLS_AS_INTS = frozenset({"add", "sub", "mul", "floordiv", "mod", "pow", "neg", "pos", "abs"})


def number_operand(x: Any, *beside: Any) -> Any:
    """A number number_op made, where an op takes it beside the tensors `beside` (the op's other operands): a float64
    tensor back at the precision a Python float operand has there, the floating dtype of those tensors (a Python
    float does not promote them: beside float32 it is rounded to float32, beside float64 it stays double), else
    (none floating: integer tensors, or none) torch's default dtype, as a Python float makes there; anything else
    as it is."""
    if not (isinstance(x, torch.Tensor) and x.dtype is torch.float64):
        return x
    want = None
    for t in beside:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            want = t.dtype if want is None else torch.promote_types(want, t.dtype)
    if want is None:
        # beside integer tensors (or none), a Python float makes torch's default dtype, whatever the model's
        want = torch.get_default_dtype()
    elif want.is_complex:
        want = torch.float64 if want is torch.complex128 else torch.float32
    return x if want is torch.float64 else x.to(want)
