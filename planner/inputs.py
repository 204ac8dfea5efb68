"""What a trace assumed of the model's inputs: record it, check calls against it, rebuild examples from it.

torch.export specialises a graph to its example inputs: a dim it did not keep
symbolic is baked into the ops (a loop over the sequence length is unrolled 12
times), and its input guard is what refuses other sizes. stagewise drops that
guard node from the graph (it is not batchable), so the plan records each input's
traced shape, dtype and dynamic dims instead, and the batched module checks every
call against them before any stage runs. The plan also lets `executor.build`
trace an export plan again without being handed example inputs.

An fx graph is shape- and dtype-generic (symbolic tracing never sees a size), so
fx plans record the spec with every dim dynamic and calls are not checked: the
graph computes what the model computes at any shape, and a check could only
refuse calls that work (another batch size, a `.double()` batched module).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from stagewise.planner.errors import InputError
from stagewise.planner.plan import DynamicDim, InputMode, InputSpec

REPLAN = "or re-plan with example inputs like this call's (`stagewise plan` / planner.trace)"


def traced_specs(gm: torch.fx.GraphModule, tracer: str, values: dict[str, Any]) -> dict[str, InputSpec]:
    """Input name -> InputSpec (mode left shared) with the traced shape, dtype and dynamic dims.

    Export graphs carry symbolic shapes on their placeholders; fx graphs take them
    from `values` (node name -> value on the example inputs), and without them none are known.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if tracer == "export":
        ranges = gm.meta.get("stagewise_ranges", {})
        small_ok = gm.meta.get("stagewise_small_ok", {})
        symbols: dict[str, str] = {}  # export's symbol names (s77) -> d0, d1... in order of appearance
        for p in placeholders:  # named first: a dim's small_with may name a symbol of a later input
            val = p.meta.get("val")
            for size in val.shape if isinstance(val, torch.Tensor) else ():
                if not isinstance(size, int) and size.node.maybe_as_int() is None and str(size.node.expr) in ranges:
                    symbols.setdefault(str(size.node.expr), f"d{len(symbols)}")
        together = {expr: tuple(symbols[e] for e in others if e in symbols)
                    for expr, others in gm.meta.get("stagewise_small_together", {}).items()}
        return {p.name: _export_spec(p.name, p.meta.get("val"), ranges, symbols, small_ok, together) for p in placeholders}
    specs = {}
    for p in placeholders:
        if p.name not in values:
            continue
        value = values[p.name]
        if isinstance(value, torch.Tensor):
            specs[p.name] = InputSpec(p.name, shape=tuple(value.shape), dtype=_dtype_name(value.dtype),
                                      dynamic_dims=tuple(DynamicDim(d) for d in range(value.dim())))
        else:
            specs[p.name] = InputSpec(p.name, dtype=type(value).__name__)
    return specs


def _export_spec(name: str, val: Any, ranges: dict, symbols: dict[str, str], small_ok: dict[str, int],
                 together: dict[str, tuple[str, ...]]) -> InputSpec:
    if not isinstance(val, torch.Tensor):
        number = val if isinstance(val, (bool, int, float)) else None  # export specialised on it: kept to retrace with
        return InputSpec(name, dtype=type(val).__name__ if val is not None else "NoneType", value=number)
    shape, dynamic = [], []
    for d, size in enumerate(val.shape):
        fixed = size if isinstance(size, int) else size.node.maybe_as_int()  # a SymInt can hold a plain 12
        if fixed is not None:
            shape.append(int(fixed))
            continue
        shape.append(int(size.node.hint) if size.node.hint is not None else 0)
        expr = str(size.node.expr)
        if expr not in ranges:  # a derived size (2*s0): export's own guard (kept as a backstop) checks it
            dynamic.append(DynamicDim(d))
            continue
        lo, hi = ranges[expr]
        symbol = symbols.setdefault(expr, f"d{len(symbols)}")
        # a lower bound of 2 is export's 0/1 specialisation: the graph may hold for sizes 1 and 0 or not;
        # planner.tracers.check_small_sizes ran it there against the model (unchecked: 2)
        dynamic.append(DynamicDim(d, min=small_ok.get(expr, 2) if lo == 2 else lo, max=hi, symbol=symbol,
                                  small_with=together.get(expr, ())))
    return InputSpec(name, shape=tuple(shape), dtype=_dtype_name(val.dtype), dynamic_dims=tuple(dynamic))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def example_inputs_from(specs: Sequence[InputSpec], device: torch.device | str | None = None) -> tuple | None:
    """Zero tensors of each input's traced shape and dtype (token ids 0 are valid ids) on `device` (default CPU:
    where the module traced with them lives); None if a spec lacks them.

    Tracing only looks at shapes and dtypes (export runs on fake tensors), so the
    values do not matter; zeros keep integer inputs in range.
    """
    if not specs or any(s.dtype is None or (s.shape is None and s.dtype != "NoneType" and s.value is None) for s in specs):
        return None  # unknown, or a Python number whose value the plan does not record (fx, or an older file)
    try:
        return tuple((s.value if s.dtype != "NoneType" else None) if s.shape is None
                     else torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs)
    except (AttributeError, TypeError):  # a dtype name this torch does not know
        return None


def check_call_inputs(tracer: str, specs: Sequence[InputSpec], values: Sequence[Any]) -> None:
    """Raise InputError if one member's inputs break what an export trace assumed (see the module docstring).

    Args:
        tracer: the plan's tracer; only "export" plans are checked.
        specs: the plan's inputs, in placeholder order.
        values: one member's inputs (per_member ones without the member axis).
    """
    if tracer != "export":
        return
    seen: dict[str, tuple[str, int, int]] = {}  # symbol -> (input, dim, size) of its first use
    small: list[tuple[str, int, int, tuple[str, ...]]] = []  # (input, dim, size, small_with) below 2, checked at the end
    for spec, value in zip(specs, values):
        if spec.dtype is None or spec.shape is None:
            continue  # a plan file from before specs were recorded, or a non-tensor input (export's guard checks those)
        where = _where(spec)
        if not isinstance(value, torch.Tensor):
            raise InputError(f"input {spec.name!r} was traced as a {spec.dtype} tensor of shape {list(spec.shape)}, "
                             f"got {type(value).__name__}; pass a tensor")
        if _dtype_name(value.dtype) != spec.dtype:
            raise InputError(f"input {spec.name!r} is {_dtype_name(value.dtype)}, but the plan's torch.export trace assumed "
                             f"{spec.dtype}; pass .to(torch.{spec.dtype}) {REPLAN}")
        got = list(value.shape)
        if len(got) != len(spec.shape):
            raise InputError(f"input {spec.name!r} has {len(got)} dims {got}{where}, the plan was traced with "
                             f"{len(spec.shape)} dims {list(spec.shape)}; pass that shape {REPLAN}")
        for d, size in enumerate(got):
            dyn = spec.dynamic_dim(d)
            if dyn is None:
                if size != spec.shape[d]:
                    raise InputError(f"input {spec.name!r} has size {size} at dim {d}{where}, but the plan was traced with "
                                     f"torch.export at size {spec.shape[d]} and the trace fixed that dim; "
                                     f"pass size {spec.shape[d]} there {REPLAN}")
                continue
            if size < dyn.min == 2:
                raise InputError(f"input {spec.name!r} has size {size} at dim {d}{where}; torch.export traced that dim for sizes "
                                 f"of 2 and more, and at size {size} forward() does not compute what the traced graph computes "
                                 "(or could not be checked there when it was traced), so the plan refuses it rather than "
                                 f"answer wrong; pass at least 2 there (pad the batch), or plan a model whose forward() "
                                 "takes the same path at every size")
            if size < dyn.min or (dyn.max is not None and size > dyn.max):
                hi = dyn.max if dyn.max is not None else "any"
                raise InputError(f"input {spec.name!r} has size {size} at dim {d}{where}; the plan's torch.export trace "
                                 f"accepts {dyn.min}..{hi} there; pass a size in that range {REPLAN}")
            if dyn.symbol:
                first = seen.setdefault(dyn.symbol, (spec.name, d, size))
                if first[2] != size:
                    raise InputError(f"input {spec.name!r} has size {size} at dim {d}{where}, but input {first[0]!r} has "
                                     f"size {first[2]} at dim {first[1]}, and the plan's torch.export trace requires them "
                                     "equal; pass matching sizes")
            if dyn.small_with and size < 2:
                small.append((spec.name, d, size, dyn.small_with))
    for name, d, size, others in small:
        for symbol in others:
            other = seen.get(symbol)
            if other is not None and other[2] != size:
                raise InputError(f"input {name!r} has size {size} at dim {d}, and input {other[0]!r} size {other[2]} at dim "
                                 f"{other[1]}; torch.export traced these dims for sizes of 2 and more, and below that the "
                                 "plan was checked against forward() only with both at one size, so it refuses this rather "
                                 f"than answer wrong; pass {size} at both, or at least 2 at dim {d} of {name!r}")


def _where(spec: InputSpec) -> str:
    return " (of each member's input, after the member axis)" if spec.mode is InputMode.PER_MEMBER else ""
