"""Wide rules for functions and methods: one call on N-first tensors.

Layout: a batched value is `NFirst(t)` with `t` of shape [N, *member_shape]
(any strides); shared values are plain Python/tensors without a member axis.
Per-member dims are shifted by one; negative dims already count from the end,
so they stay. Anything without a rule here falls back to `torch.func.vmap` of
that one op (see executor.strategies.wide).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map


class NFirst:
    """A batched tensor inside a wide stage: `t` is [N, *member_shape]."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    @property
    def rank(self) -> int:
        """Rank of one member's tensor."""
        return self.t.dim() - 1


def is_nf(x: Any) -> bool:
    return isinstance(x, NFirst)


def has_nf(tree: Any) -> bool:
    return any(is_nf(x) for x in tree_flatten(tree, is_leaf=is_nf)[0])


def as_nfirst(x: Any, n: int) -> torch.Tensor:
    """A tensor operand as [N, ...]: batched ones as they are, shared ones expanded (no copy)."""
    if is_nf(x):
        return x.t
    return x.unsqueeze(0).expand(n, *x.shape)


def op_name(target: Any) -> str:
    """'add' for operator.add, torch.add, Tensor.add, 'add' (method) and aten.add.Tensor alike."""
    if isinstance(target, str):
        name = target
    elif isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name.split("::")[-1]
    else:
        name = getattr(target, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("r") and name[1:] in _REVERSIBLE:
            name = "r" + name[1:]
    return name


_REVERSIBLE = {"add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "mod"}

ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "floordiv", "pow", "neg", "mod", "radd", "rsub", "rmul", "rtruediv",
    "relu", "gelu", "tanh", "sigmoid", "silu", "exp", "log", "sqrt", "rsqrt", "abs", "clamp", "clip",
    "leaky_relu", "elu", "softplus", "hardtanh", "mish", "erf", "sin", "cos", "reciprocal", "square", "sign",
    "maximum", "minimum", "where", "masked_fill", "lerp", "addcmul", "logsigmoid", "softsign", "hardswish",
    "hardsigmoid", "relu6", "selu", "celu", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "nan_to_num", "float", "double", "half", "bfloat16", "contiguous", "clone",
    "detach", "to", "type_as", "_to_copy", "alias",
}

# op -> [(arg position, kwarg name, default)] of the arguments that index dims of the first input
DIM_ARGS: dict[str, list[tuple[int, str, Optional[int]]]] = {
    "softmax": [(1, "dim", None)], "log_softmax": [(1, "dim", None)], "_softmax": [(1, "dim", None)],
    "_log_softmax": [(1, "dim", None)], "sum": [(1, "dim", None)], "mean": [(1, "dim", None)],
    "amax": [(1, "dim", None)], "amin": [(1, "dim", None)], "prod": [(1, "dim", None)], "cumsum": [(1, "dim", None)],
    "logsumexp": [(1, "dim", None)], "var": [(1, "dim", None)], "std": [(1, "dim", None)],
    "transpose": [(1, "dim0", None), (2, "dim1", None)], "swapaxes": [(1, "axis0", None), (2, "axis1", None)],
    "unsqueeze": [(1, "dim", None)], "squeeze": [(1, "dim", None)], "select": [(1, "dim", None)],
    "narrow": [(1, "dim", None)], "flatten": [(1, "start_dim", 0), (2, "end_dim", -1)],
    "chunk": [(2, "dim", 0)], "split": [(2, "dim", 0)], "unbind": [(1, "dim", 0)], "movedim": [(1, "source", None), (2, "destination", None)],
    "normalize": [(2, "dim", 1)],
}
REDUCE_ALL_WITHOUT_DIM = {"sum", "mean", "amax", "amin", "prod", "logsumexp", "var", "std"}
META = {"size", "dim", "ndimension", "numel", "sym_size", "sym_numel", "nelement"}
META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}
MATMUL = {"matmul", "mm", "bmm", "rmatmul"}


def _shift(d: Any) -> Any:
    if isinstance(d, (list, tuple)):
        return type(d)(_shift(x) for x in d)
    return d + 1 if isinstance(d, int) and d >= 0 else d


def _align(args: Any, n: int) -> Any:
    """Give every batched operand the same per-member rank, so broadcasting pairs member with member."""
    leaves = [x for x in tree_flatten((args,), is_leaf=is_nf)[0] if is_nf(x) or isinstance(x, torch.Tensor)]
    rank = max((x.rank if is_nf(x) else x.dim()) for x in leaves)

    def fix(x):
        if is_nf(x):
            extra = rank - x.rank
            return x.t.reshape(x.t.shape[0], *([1] * extra), *x.t.shape[1:]) if extra else x.t
        return x

    return tree_map(fix, args, is_leaf=is_nf)


def elementwise(fn: Callable, args: tuple, kwargs: dict, n: int) -> NFirst:
    dtypes = _member_dtypes(fn, args, kwargs)
    if dtypes is not None:
        args, kwargs = _as_member_promotes((args, kwargs), dtypes[0])
    a, kw = _align((args, kwargs), n)
    out = fn(*a, **kw)
    return NFirst(out if dtypes is None or out.dtype == dtypes[1] else out.to(dtypes[1]))


def _member_dtypes(fn: Callable, args: tuple, kwargs: dict) -> Optional[tuple[torch.dtype, torch.dtype]]:
    """(the dtype one member's `fn(*args, **kwargs)` computes in, the dtype it returns), where the wide call could
    promote differently; else None.

    A per-member scalar (a per_member number, a 0-dim buffer or parameter, a lifted sweep attribute) is 0-dim in each
    member's op, and torch's type promotion lets a 0-dim tensor of the same category not promote a dimensioned one
    (float32 activations / a float64 temperature stay float32; bfloat16 ones / a float32 number stay bfloat16).
    Stacked it is [N] (aligned [N, 1, ...]), dimensioned, and would promote the whole activation: a float64 output
    where the loop's is float32, or the next Linear refusing the mixed dtypes. Only operands of more than one dtype
    beside a per-member scalar can differ; then one member's call is run on meta tensors (no data) to get the dtype.
    A comparison returns bool either way but compares in the promoted dtype (x > t with a float64 t = 0.1 and a
    float32 x = 0.1 is False per member, True in float64): for two operands, torch.result_type of one member's."""
    if not any(is_nf(x) and x.rank == 0 for x in (*args, *kwargs.values())):
        return None  # the common case, checked first and cheaply (an elementwise op's operands are its arguments)
    leaves = tree_flatten((args, kwargs), is_leaf=is_nf)[0]
    if len({(x.t if is_nf(x) else x).dtype for x in leaves if is_nf(x) or isinstance(x, torch.Tensor)}) < 2:
        return None
    try:  # what promotion sees: dtypes, which operands are 0-dim per member, the Python numbers' types
        key = (fn, tuple(kwargs), tuple((x.t.dtype, x.rank == 0) if is_nf(x) else (x.dtype, x.dim() == 0)
                                        if isinstance(x, torch.Tensor) else type(x) if isinstance(x, (bool, int, float,
                                        complex)) else x for x in leaves))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _MEMBER_DTYPES:
        return _MEMBER_DTYPES[key]
    found = _member_dtypes_on_meta(fn, args, kwargs)
    if key is not None:
        if len(_MEMBER_DTYPES) > 4096:
            _MEMBER_DTYPES.clear()
        _MEMBER_DTYPES[key] = found
    return found


# _member_dtypes' answers (a meta call costs some 100s of microseconds; a forward makes the same calls every time)
_MEMBER_DTYPES: dict[tuple, Optional[tuple[torch.dtype, torch.dtype]]] = {}


def _member_dtypes_on_meta(fn: Callable, args: tuple, kwargs: dict) -> Optional[tuple[torch.dtype, torch.dtype]]:
    """_member_dtypes from one member's call on meta tensors of its shapes and dtypes."""
    def member(x):
        if is_nf(x):
            return torch.empty(x.t.shape[1:], dtype=x.t.dtype, device="meta")
        return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

    try:
        margs, mkwargs = tree_map(member, args, is_leaf=is_nf), tree_map(member, kwargs, is_leaf=is_nf)
        out = fn(*margs, **mkwargs)
        if not isinstance(out, torch.Tensor):
            return None
        if out.dtype is torch.bool and len(margs) == 2 and not mkwargs:
            return torch.result_type(*margs), out.dtype
    except Exception:  # noqa: BLE001 - no meta kernel (or a call one member refuses too): the wide call decides as before
        return None
    return out.dtype, out.dtype


def _as_member_promotes(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with its per-member scalars cast to `dtype`, the dtype one member's op computes and returns in (its
    0-dim operand is converted to it there too), so the stacked [N] scalar promotes nothing. Bool ones (a mask, a
    `where` condition) are left as they are, and all of them where the op computes in bool."""
    if dtype is torch.bool:
        return tree

    def cast(x):
        return NFirst(x.t.to(dtype)) if x.rank == 0 and x.t.dtype not in (dtype, torch.bool) else x

    return tree_map(lambda x: cast(x) if is_nf(x) else x, tree, is_leaf=is_nf)


def with_dims(fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """Call `fn` on the N-first first operand with its dim arguments shifted past the member axis."""
    args, kwargs = list(args), dict(kwargs)
    x = args[0]
    if _empty_dims(name, args, kwargs):
        # torch reads an empty dim list (`x.amax(dim=())`, `sum(x, [])`) as "every dim": shifted, it would still be
        # empty and reduce the member axis too. Name the member's dims instead, as a missing dim is handled below.
        if name not in REDUCE_ALL_WITHOUT_DIM or name in ("logsumexp", "prod") or x.rank == 0:
            return None  # torch refuses it (logsumexp, prod) or a scalar member has no dims to name: vmap's rules
        args, kwargs = _with_dims_given(name, args, kwargs, list(range(1, x.t.dim())))
        args[0] = x.t
        return _wrap_out(fn(*args, **kwargs))
    given = False
    for pos, key, default in DIM_ARGS[name]:
        if pos < len(args) and (args[pos] is None or isinstance(args[pos], bool)):
            # `h.var(False)` (unbiased), `torch.mean(h, None, True)`: another overload's arguments at the dim's place,
            # which a dim added by name would not fit: vmap's rules
            return None
        if pos < len(args):
            args[pos] = _shift(args[pos]) if args[pos] is not None else None
            given = given or args[pos] is not None
        elif key in kwargs:
            kwargs[key] = _shift(kwargs[key]) if kwargs[key] is not None else None
            given = given or kwargs[key] is not None
        elif default is not None:
            kwargs[key] = _shift(default)
            given = True
    if "axis" in kwargs or (name == "prod" and not given):
        return None  # numpy's alias (dim and axis would both be given); prod takes one dim: vmap
    if not given and name in REDUCE_ALL_WITHOUT_DIM:
        if x.rank == 0:
            return None  # dim=[] would reduce the member axis too
        if isinstance(fn, torch._ops.OpOverload):  # an aten overload without dim (aten.sum.default): torch's own function
            if len(args) > 1 or set(kwargs) - {"dtype"} or not hasattr(torch, name):
                return None
            fn = getattr(torch, name)
        kwargs["dim"] = list(range(1, x.t.dim()))
        if name in ("sum", "mean", "prod") and len(args) > 1 and not isinstance(args[1], (int, list, tuple)):
            kwargs["dtype"] = args.pop(1)  # sum(x, dtype) form
    elif not given:
        return None  # e.g. squeeze() or softmax without dim: semantics differ, use vmap
    args[0] = x.t
    return _wrap_out(fn(*args, **kwargs))


def _empty_dims(name: str, args: list, kwargs: dict) -> bool:
    """Whether the call names its reduction dims as an empty list or tuple (torch: all of them)."""
    pos, key, _ = DIM_ARGS[name][0]
    value = args[pos] if pos < len(args) else kwargs.get(key)
    return isinstance(value, (list, tuple)) and len(value) == 0


def _with_dims_given(name: str, args: list, kwargs: dict, dims: list) -> tuple[list, dict]:
    """`args`, `kwargs` with the first dim argument of `name` replaced by `dims` (where it was given)."""
    pos, key, _ = DIM_ARGS[name][0]
    if pos < len(args):
        args[pos] = dims
    else:
        kwargs[key] = dims
    return args, kwargs


def _wrap_out(out: Any) -> Any:
    return tree_map(lambda t: NFirst(t) if isinstance(t, torch.Tensor) else t, out)


def _sizes(args: tuple) -> list:
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return list(rest[0])
    return list(rest)


def view_like(name: str, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    n = x.t.shape[0]
    if name in ("view", "reshape", "_unsafe_view") and not kwargs:
        sizes = _sizes(args)
        if any(isinstance(s, torch.dtype) for s in sizes):
            return None
        if name == "view":
            try:
                return NFirst(x.t.view(n, *sizes))
            except RuntimeError:  # a slice of a fused GEMM's output cannot always be viewed: same values, copied
                pass
        return NFirst(x.t.reshape(n, *sizes))
    if name == "expand" and not kwargs:
        sizes = _sizes(args)
        # new leading dims go between the member axis and the member's own dims (torch right-aligns: a [N, D]
        # tensor expanded to (N, B, D) with B == N would give every member all members' rows)
        extra = len(sizes) - x.rank
        t = x.t.reshape(n, *([1] * extra), *x.t.shape[1:]) if extra > 0 else x.t
        return NFirst(t.expand(n, *sizes))
    if name == "permute":
        dims = _sizes(args) if args[1:] else list(kwargs.get("dims", []))
        return NFirst(x.t.permute(0, *[(d % x.rank) + 1 for d in dims]))
    if name in ("t", "numpy_T") and x.rank <= 2:
        return NFirst(x.t.transpose(1, 2) if x.rank == 2 else x.t)
    if name == "repeat":
        sizes = _sizes(args)
        return NFirst(x.t.repeat(1, *sizes)) if len(sizes) == x.rank else None
    return None


def getitem(args: tuple) -> Any:
    x, idx = args
    if not is_nf(x):
        if has_nf(idx if isinstance(idx, tuple) else (idx,)):
            return None  # a shared tensor indexed by a per-member index: vmap's rules
        return x[idx]  # a container (tuple of outputs, chunks) indexed by a Python int
    idx = idx if isinstance(idx, tuple) else (idx,)
    if has_nf(idx) or sum(isinstance(i, (torch.Tensor, list)) for i in idx) > 1:
        return None  # advanced indexing across members (or two advanced indices, which torch moves to the front): vmap
    return NFirst(x.t[(slice(None), *idx)])


def join(name: str, args: tuple, kwargs: dict, n: int) -> Any:
    """cat / stack of a list that holds batched tensors."""
    tensors = [as_nfirst(t, n) for t in args[0]]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    fn = torch.cat if name in ("cat", "concat", "concatenate") else torch.stack
    return NFirst(fn(tensors, dim=_shift(dim)))


def matmul(name: str, args: tuple, n: int) -> Any:
    a, b = args[:2]
    if name == "rmatmul":
        a, b = b, a
    ranks = [x.rank if is_nf(x) else x.dim() for x in (a, b)]
    if min(ranks) < 2:
        return None
    a_t, b_t = _align((a, b), n)
    return NFirst(torch.matmul(a_t, b_t))


def sdpa(args: tuple, kwargs: dict, n: int, training: bool = False) -> Any:
    """scaled_dot_product_attention accepts any leading dims: fold the member axis into them."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    if bound.get("dropout_p", 0.0):
        return None  # dropout needs a random stream per member
    q, k, v = (bound.pop(x) for x in ("query", "key", "value"))
    mask = bound.get("attn_mask")
    # one member's operands broadcast right-aligned: every batched one (the mask too) is lifted to the
    # common per-member rank, so the member axis lines up with the member axis (a per-member [N, L, S]
    # mask beside [N, B, H, L, D] queries would otherwise pair members with heads or batch rows)
    rank = max(x.rank if is_nf(x) else x.dim() for x in (q, k, v, mask) if x is not None)
    q_t, k_t, v_t = (_lift(x, rank, n) for x in (q, k, v))
    if is_nf(mask):
        bound["attn_mask"] = _lift(mask, rank, n)
    if mask is None and q_t.dim() > 4:
        # PyTorch's fused CPU kernel takes 4-D inputs only (5-D goes to the slower math path):
        # fold the member axis into the batch axis, [N, B, H, S, D] -> [N*B, H, S, D] (a view here)
        lead = q_t.shape[:-3]
        fold = lambda t: t.reshape(-1, *t.shape[-3:])  # noqa: E731
        out = F.scaled_dot_product_attention(fold(q_t), fold(k_t), fold(v_t), **bound)
        return NFirst(out.view(*lead, *out.shape[-3:]))
    return NFirst(F.scaled_dot_product_attention(q_t, k_t, v_t, **bound))


def _lift(x: Any, rank: int, n: int) -> torch.Tensor:
    """[N, 1.., *shape] of per-member rank `rank` (shared tensors expanded without copying)."""
    t = as_nfirst(x, n)
    extra = rank - (t.dim() - 1)
    return t.reshape(n, *([1] * extra), *t.shape[1:]).expand(n, *([-1] * rank)) if extra else t


_RELAYOUTS = {
    "bmm": lambda w: w.transpose(1, 2),
    "conv_nhwc": lambda w: w.reshape(-1, *w.shape[2:]).contiguous(memory_format=torch.channels_last),
}


def relaid(w: torch.Tensor, kind: str) -> torch.Tensor:
    """A stacked weight in the layout its kernel wants, made on every call.

    kind "bmm": [N, out, in] -> [N, in, out], a transposed view (no copy; BLAS reads it as an NT GEMM).
    kind "conv_nhwc": a conv weight [N, out, in/g, kh, kw] -> [N*out, in/g, kh, kw] in channels_last
    (the grouped convolution of wide_layers.conv's "grouped_nhwc" form): a copy per call.
    Nothing is cached across calls: a copy kept while its source is "unchanged" goes stale when the
    source is written through `.data` (EMA code, older optimizers), which bumps no version counter and
    keeps the storage, so no cheap check can see it. A contiguous [N, in, out] copy made once measured
    5-8% faster GEMMs on CPU; correctness first.
    """
    assert kind in _RELAYOUTS, kind
    return _RELAYOUTS[kind](w)


def linear(x: Any, weight: Any, bias: Any, n: int) -> torch.Tensor:
    """y[m] = x[m] @ W[m]^T + b[m] for every member m. Returns [N, *batch, out].

    Batched x [N, *batch, in]: one baddbmm over [N, M, in] x [N, in, out].
    Shared x [*batch, in]: the same baddbmm with x broadcast over members (no copy).
    Shared weights (not per member): one F.linear on the N-first x.
    """
    if not is_nf(weight):
        y = F.linear(x.t if is_nf(x) else x, weight, None if is_nf(bias) else bias)
        if not is_nf(x):
            y = y.unsqueeze(0).expand(n, *y.shape)
        return y + bias.t.reshape(n, *([1] * (y.dim() - 2)), -1) if is_nf(bias) else y
    return gemm(x, relaid(weight.t, "bmm"), bias, n)


def gemm(x: Any, wt: torch.Tensor, bias: Any, n: int) -> torch.Tensor:
    """y[m] = x[m] @ wt[m] + b[m] with weights already [N, in, out] (any strides: a column slice of
    a relaid packed weight, e.g. the q part of attention's [N, E, 3E], needs no copy). Returns [N, *batch, out].

    Batched x [N, *batch, in]: one baddbmm over [N, M, in] x [N, in, out].
    Shared x [*batch, in]: the same baddbmm with x broadcast over members (no copy).
    """
    in_f, out_f = wt.shape[1], wt.shape[2]
    b = bias.t if is_nf(bias) else (bias.unsqueeze(0).expand(n, -1) if bias is not None else None)
    if is_nf(x):
        t = x.t
        batch = t.shape[1:-1]
        x3 = t.reshape(n, -1, in_f)
    else:
        # shared x: the same input for every member, broadcast (stride 0, no copy) into one baddbmm.
        # Measured faster on CPU than one GEMM against the concatenated weights ([M, in] x [in, N*out]),
        # whose [M, N, out] result leaves the next layer a strided N-first view (MLP N=100: 1.66 vs 1.87 ms;
        # re-measured with the activation in place, Linear+ReLU+Linear: 1.51 vs 1.57 ms on one thread,
        # 1.03 vs 1.99 ms on two, where MKL splits the single M=32 GEMM poorly; a copy to contiguous
        # [N, M, out] for the next layer is slower still)
        batch = x.shape[:-1]
        x3 = x.reshape(1, -1, in_f).expand(n, -1, -1)
    y = torch.baddbmm(b.unsqueeze(1), x3, wt) if b is not None else torch.bmm(x3, wt)
    return y.view(n, *batch, out_f)


def affine(y: torch.Tensor, weight: Any, bias: Any, n_trailing: int) -> torch.Tensor:
    """y * w + b with per-member w, b of shape [N, *trailing] broadcast over y [N, ..., *trailing]."""
    def shaped(p):
        if not is_nf(p):
            return p
        t = p.t
        return t.reshape(t.shape[0], *([1] * (y.dim() - 1 - n_trailing)), *t.shape[1:])

    w, b = shaped(weight), shaped(bias)
    if w is not None and b is not None:
        return torch.addcmul(b, y, w)
    if w is not None:
        return y * w
    return y + b if b is not None else y


def layer_norm(args: tuple, kwargs: dict) -> Any:
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x = bound["input"]
    shape = bound["normalized_shape"]
    shape = [shape] if isinstance(shape, int) else list(shape)
    y = F.layer_norm(x.t if is_nf(x) else x, shape, None, None, bound.get("eps", 1e-5))
    if not is_nf(x):
        y = y.unsqueeze(0)
    return NFirst(affine(y, bound.get("weight"), bound.get("bias"), len(shape)))


# memory format -> the rank of one member's tensor it applies to, and the permutation of those dims to contiguous order
_MEMBER_LAYOUTS = {torch.channels_last: (4, (0, 2, 3, 1)), torch.channels_last_3d: (5, (0, 2, 3, 4, 1))}


def _member_layout(x: NFirst, fmt: torch.memory_format) -> NFirst:
    """`x` with each member's slice in memory format `fmt` (the values unchanged): a member's [B, C, H, W] in
    channels_last is [B, H, W, C] in memory, so the stacked tensor is [N, B, H, W, C] in memory."""
    t, order = x.t, _MEMBER_LAYOUTS[fmt][1]
    back = [0] * t.dim()
    for i, d in enumerate((0, *(o + 1 for o in order))):
        back[d] = i
    return NFirst(t.permute(0, *(o + 1 for o in order)).contiguous().permute(*back))


def call_function(fn: Callable, name: str, args: tuple, kwargs: dict, n: int) -> Any:
    """The wide result of `fn(*args, **kwargs)` (a function or method node named `name`) with
    batched operands, or None when there is no rule (the caller falls back to vmap)."""
    if name in META or (name == "getattr" and args[1] in META_ATTRS):
        member0 = tree_map(lambda x: x.t[0] if is_nf(x) else x, (args, kwargs), is_leaf=is_nf)
        return fn(*member0[0], **member0[1])  # sizes are the same for every member
    if name == "getitem":
        return getitem(args)
    if name == "where" and len(args) + len(kwargs) == 1:
        return None  # torch.where(cond): the indices of its nonzero elements, not elementwise (a member axis in them)
    if name in ELEMENTWISE:
        fmt = kwargs.get("memory_format")
        if fmt in _MEMBER_LAYOUTS and args and is_nf(args[0]):
            # a per-member layout (x.contiguous(memory_format=torch.channels_last) on one member's [B, C, H, W]): the
            # op asks it of the [N, B, C, H, W] tensor, a rank it refuses; run it without and lay each member out so
            # (another rank falls back to vmap, which refuses it as the member's op does)
            if args[0].rank != _MEMBER_LAYOUTS[fmt][0]:
                return None
            out = call_function(fn, name, args, {k: v for k, v in kwargs.items() if k != "memory_format"}, n)
            return _member_layout(out, fmt) if is_nf(out) else out
        if name in ("to", "_to_copy", "type_as"):
            if has_nf(args[1:]) or has_nf(kwargs):
                return None
            x = args[0]
            # a conversion, not arithmetic: `w.type_as(x)` takes x's dtype and device, never its shape (elementwise's
            # alignment would give a per-member w the rank of a shared x)
            return NFirst(fn(x.t, *args[1:], **kwargs)) if is_nf(x) else fn(*args, **kwargs)
        return elementwise(fn, args, kwargs, n)
    first = args[0] if args else None
    if name in DIM_ARGS and is_nf(first) and not has_nf((args[1:], kwargs)):
        return with_dims(fn, name, args, kwargs)
    if name in ("view", "reshape", "_unsafe_view", "expand", "permute", "t", "repeat") and is_nf(first) and not has_nf(args[1:]):
        return view_like(name, args, kwargs)
    if name in ("cat", "concat", "concatenate", "stack"):
        return join(name, args, kwargs, n)
    if name in MATMUL and not kwargs:
        return matmul(name, args, n)
    if name == "scaled_dot_product_attention":
        return sdpa(args, kwargs, n)
    if name == "linear":
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        return NFirst(linear(x, w, b, n))
    if name == "layer_norm":
        return layer_norm(args, kwargs)
    return None
