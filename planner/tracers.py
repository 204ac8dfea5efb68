"""How each tracer is called and its graph cleaned up (planner.graph picks the tracer and watches the run).

torch.fx: the forward() parameters the given inputs leave out are fixed to their defaults
(`_defaults_not_given`) and fx's placeholders for them removed (`_drop_concrete_placeholders`).
torch.export (`_export`): non-strict, every dim offered as dynamic (static when that fails), quiet
unless it succeeds; the symbol ranges are kept, the input-guard node dropped and sym_size reads made size() calls.
nn.Transformer layers' causal-mask detection is taken as the caller gave it (`_causal_masks_as_given`).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import re
import sys
import threading
import warnings
from typing import Any, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from stagewise.planner.capability import alias_chain, is_inplace
from stagewise.planner.errors import TraceError
from stagewise.planner.opening import cumulative_batchnorm
from stagewise.planner.trace_watch import _may_alias, _autograd_functions_seen, _bound_state_reads_refused, _inference_mode_as_no_grad, storage_root


def _defaults_not_given(model: nn.Module, given: int | Sequence[str]) -> dict[str, Any]:
    """forward() parameters with a default that `given` (a count or names) does not supply -> their defaults."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a readable signature: trace it as it is
        return {}
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if isinstance(given, int):
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            return {}  # forward(x, *rest, ...): extra positionals go to *rest, nothing to fix
        names = {p.name for p in named[:given]}
    else:
        known = {p.name for p in named}
        # fx names a placeholder shadowing a Python builtin `type_1` (`forward(self, x, type=1.0)`): a plan's input
        # named so is forward()'s `type`
        names = set(given) | {m.group(1) for n in given if n not in known and (m := re.fullmatch(r"(.+)_\d+", n))
                              and m.group(1) in known}
    return {p.name: p.default for p in named if p.name not in names and p.default is not p.empty}


def _drop_concrete_placeholders(gm: torch.fx.GraphModule, fixed: dict[str, Any]) -> None:
    """Remove fx's placeholders for `concrete_args` (`mask_1`) and the value checks that are their only users."""
    prefixes = tuple(f"{name}_" for name in fixed)
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and str(n.target).startswith(prefixes)]:
        users = _all_users(node)
        if all(u.op == "call_function" for u in users):  # only fx's `eq`/`_assert` specialisation checks
            for u in reversed(users):
                gm.graph.erase_node(u)
            gm.graph.erase_node(node)
    gm.recompile()


def _all_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node that depends on `node`, in graph order."""
    seen: dict[torch.fx.Node, None] = {}
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen[n] = None
            todo.extend(n.users)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _export(model: nn.Module, example_inputs: tuple) -> torch.fx.GraphModule:
    """torch.export's graph of `model` (non-strict, quiet unless it succeeds), without the input-guard node.

    Every dim of every tensor input is offered to export as dynamic (Dim.AUTO):
    dims the model does not specialise stay symbolic, so the plan accepts other
    batch sizes and sequence lengths; dims it does specialise (a loop over
    x.shape[1]) stay fixed. A model that fails that way is exported static.
    The symbol ranges go to gm.meta["stagewise_ranges"], the guard function stays
    as gm._guards_fn (planner.inputs records and checks what they say).
    """
    args = tuple(example_inputs)
    for path, module in model.named_modules():
        why = cumulative_batchnorm(module, path or type(model).__name__)
        if why:  # export traces inside every module, and stops deep inside this one
            raise TraceError(f"torch.export traces inside every module, and {why}. Give it a momentum (momentum=0.1 is "
                             "BatchNorm's default), or make the rest of forward() traceable by torch.fx, which keeps it "
                             "closed (one module per member, its statistics updated as the member loop does)")
    with _bound_state_reads_refused(model):  # a buffer's values read through a bound reference: refused as fx's trace does
        return _export_watched(model, args)


def _export_watched(model: nn.Module, args: tuple) -> torch.fx.GraphModule:
    """_export's body, inside its watch."""
    auto = tree_map(lambda v: {d: torch.export.Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) else None, args)
    try:
        with _quiet_on_failure(), _inference_mode_as_no_grad(), _autograd_functions_seen() as functions, \
                _causal_masks_as_given():
            ep = torch.export.export(model, args, dynamic_shapes=auto, strict=False)
    except Exception:  # export raises many types; the static export below reports its own failure
        with _quiet_on_failure(), _inference_mode_as_no_grad(), _autograd_functions_seen() as functions, \
                _causal_masks_as_given():
            ep = torch.export.export(model, args, strict=False)
    gm = ep.module()
    gm.meta["stagewise_ranges"] = {str(sym): _range_of(vr) for sym, vr in ep.range_constraints.items()}
    # custom autograd.Functions export recorded as their forward's ops: their own backward is not in the graph
    gm.meta["stagewise_lost_backwards"] = tuple(sorted(functions))
    _drop_guard_nodes(gm)
    _sizes_as_methods(gm)
    detach_out_of_place(gm)
    _drop_self_copies(gm)
    out_as_copies(gm)
    return gm


_causal_lock = threading.Lock()
_causal_depth = 0  # exports inside _causal_masks_as_given now (nested, or on other threads)
_causal_saved: list[tuple[Any, str, Any]] = []  # (owner, name, torch's own) for each function replaced while they run
# id(mask) -> [mask, whether it is the square subsequent mask (a 0-dim bool tensor), the mask with the gradient torch's
# hint leaves it, made at its first use]: the masks the detection was asked about, for the layers' self-attention
_causal_compared: dict[int, list] = {}


def _causal_hint_as_given(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    """torch's _detect_is_causal_mask without turning the mask's values into a Python bool: the caller's is_causal as
    given, False where it gave none (torch's answer for no mask and for every mask that is not the square subsequent
    one). Where torch would have compared, the comparison is kept as a tensor for `_self_attention_as_hinted`."""
    if is_causal is None and mask is not None:
        from torch.nn.modules import transformer
        sz = size if size is not None else mask.size(-2)
        causal = transformer._generate_square_subsequent_mask(sz, device=mask.device, dtype=mask.dtype)
        if mask.size() == causal.size():  # sizes, as torch compares them (a shape guard, not a value read)
            _causal_compared[id(mask)] = [mask, (mask == causal).all(), None]
    return is_causal is True


def _self_attention_as_hinted(sa_block: Any) -> Any:
    """A Transformer{Encoder,Decoder}Layer._sa_block that gives a compared mask the gradient torch gives it.

    Where torch found the mask causal (and no key padding mask), MultiheadAttention drops it and lets
    scaled_dot_product_attention apply its own causal mask: the mask gets no gradient. Here the mask is applied, as
    torch.where(is_causal, mask.detach(), mask): its own values, and a gradient only where torch gives one (each
    member's mask decides for that member)."""
    def block(self, x, attn_mask, key_padding_mask, is_causal=False):
        entry = _causal_compared.get(id(attn_mask)) if attn_mask is not None else None
        if entry is not None and entry[0] is attn_mask and not is_causal and key_padding_mask is None:
            if entry[2] is None:
                entry[2] = torch.where(entry[1], attn_mask.detach(), attn_mask)
            attn_mask = entry[2]
        return sa_block(self, x, attn_mask, key_padding_mask, is_causal)
    return block


@contextlib.contextmanager
def _causal_masks_as_given():
    """Inside: nn.TransformerEncoder / nn.TransformerDecoder take the is_causal their caller gave (False for None)
    instead of comparing the mask with the square subsequent mask in Python; torch's own functions are back
    afterwards, also when export fails.

    Given no is_causal, they call `bool((mask == causal).all())` (torch.nn.modules.transformer._detect_is_causal_mask)
    on the mask's values, which export cannot follow (a GuardOnDataDependentSymNode, Eq(u0, 1)): the PyTorch
    tutorial TransformerModel, whose mask is nn.Transformer.generate_square_subsequent_mask(len(src)), was refused.
    The answer only picks how the same attention is computed: True, MultiheadAttention (no key padding mask, no
    weights) drops the mask and scaled_dot_product_attention applies its own causal one, equal to it by that very
    comparison (the layers' fused inference path reads the mask and ignores the answer). Here the mask is applied:
    the same values up to rounding (1.6e-7 on the tutorial), right for every member (a per-member mask may be
    causal for some only), and, through `_self_attention_as_hinted`, no gradient for a mask torch would have
    dropped. A model whose export never reaches the comparison traces to the same graph: with is_causal given,
    with no mask, or with a mask of another size, torch answered without reading values; a call that read them was
    refused. While an export runs, these modules called on another thread take the same path: the same values."""
    global _causal_depth
    from torch.nn.modules import transformer
    with _causal_lock:
        if _causal_depth == 0 and getattr(transformer, "_detect_is_causal_mask", None) is not None:
            replaced = [(transformer, "_detect_is_causal_mask", _causal_hint_as_given)]
            for layer in (transformer.TransformerEncoderLayer, transformer.TransformerDecoderLayer):
                if "_sa_block" in vars(layer):
                    replaced.append((layer, "_sa_block", _self_attention_as_hinted(vars(layer)["_sa_block"])))
            for owner, name, new in replaced:
                _causal_saved.append((owner, name, vars(owner)[name]))
                setattr(owner, name, new)
        _causal_depth += 1
    try:
        yield
    finally:
        with _causal_lock:
            _causal_depth -= 1
            if _causal_depth == 0:
                while _causal_saved:
                    owner, name, own = _causal_saved.pop()
                    setattr(owner, name, own)
                _causal_compared.clear()


def _functional_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of `op`'s packet that takes the same arguments but writes none (`aten.mul.out` -> `aten.mul.Tensor`)."""
    def writes(arg) -> bool:
        return arg.alias_info is not None and arg.alias_info.is_write

    want = [(a.name, str(a.type)) for a in op._schema.arguments if not writes(a)]
    packet = op.overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        if not any(writes(a) for a in other._schema.arguments) and \
                [(a.name, str(a.type)) for a in other._schema.arguments] == want:
            return other
    return None


def out_as_copies(gm: torch.fx.GraphModule) -> None:
    """`f(..., out=t)` -> `t.copy_(f(...))`, the same write, as an op every part of stagewise reads as one.

    An `out=` keyword writes into `t`, yet nothing else names the write: without this the planner saw a pure op and
    could put a later read of `t` before it. `copy_` writes `t` as its first argument and returns it, as `out=` does.
    A tuple of outs (`torch.max(x, 1, out=(v, i))`) is refused, naming the plain form."""
    changed = False
    for node in list(gm.graph.nodes):
        out = node.kwargs.get("out") if node.op in ("call_function", "call_method") else None
        if out is None:
            continue
        if not isinstance(out, torch.fx.Node):
            raise TraceError(f"forward() calls {getattr(node.target, '__name__', node.target)} with a tuple of out= "
                             "tensors, which stagewise does not follow as writes; assign the results instead "
                             "(`v, i = torch.max(x, 1)`)")
        target = node.target
        if isinstance(target, torch._ops.OpOverload):  # an aten graph's `aten.mul.out`: its functional overload
            target = _functional_overload(target)
            if target is None:
                raise TraceError(f"forward() calls {node.target} with out=, whose functional form stagewise cannot "
                                 "find; assign the result instead of passing out=")
        kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        with gm.graph.inserting_before(node):
            value = gm.graph.create_node(node.op, target, node.args, kwargs)
        node.op, node.target, node.args, node.kwargs = "call_method", "copy_", (out, value), {}
        changed = True
    if changed:
        gm.recompile()


def _aliased(source: torch.fx.Node, detach: torch.fx.Node) -> bool:
    """Whether `source` may be (a view of) another value, or another value (not `detach`) may be `source` itself or
    a view of it (`h.contiguous()`, `.float()` of a float, `nn.ReLU(inplace=True)` hand back their input): detached in
    place, those would lose their history too, which rewriting the reads of `source` alone would not do."""
    return _may_alias(source, every_module=False) or any(
        u is not detach and u.args and u.args[0] is source and _may_alias(u, every_module=False) for u in source.users)


def detach_out_of_place(gm: torch.fx.GraphModule) -> None:
    """`x.detach_()` -> `x.detach()`, later reads of x reading its result instead. Export records
    `torch.tensor(x.shape[0])` as a fresh copy detached in place, and a model detaches a value it computed
    (`h.detach_()`: no gradient back through what made h); per member the value is a view of the stacked one (a
    loop stage's row), which torch cannot detach in place. Same values, and the same gradients: the reads after
    the detach see a tensor without history, as in the member; the reads before it were recorded before it.
    fx's `detach_` of an input or of state (the caller's tensor, a parameter) is left as it is."""
    changed = False
    nodes = list(gm.graph.nodes)
    for i, node in enumerate(nodes):
        traced = (node.op == "call_method" and node.target == "detach_") or (
            node.op == "call_function" and node.target in (torch.detach_, torch.Tensor.detach_))
        if traced and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].op.startswith("call_") and not _aliased(node.args[0], node):
            source = node.args[0]
            node.op, node.target, changed = "call_method", "detach", True
        elif node.op == "call_function" and node.target is torch.ops.aten.detach_.default and node.args:
            source = node.args[0]
            node.target, changed = torch.ops.aten.detach.default, True
        else:
            continue
        later = set(nodes[i + 1:])
        for user in list(getattr(source, "users", ())):
            if user in later:
                user.replace_input_with(source, node)
    if changed:
        gm.recompile()


def _drop_self_copies(gm: torch.fx.GraphModule) -> None:
    """Drop export's `aten.copy_(buf, v)` where `v` is `buf` itself, written in place (`self.n += 1` traces as
    `v = aten.add_(buf, 1)`, then the copy of the mutated buffer back into it): a copy of a tensor into itself changes
    nothing but its version counter, and in training that bump made a later backward fail on a value an op saved
    (`x * self.n` saves n), where the member loop trains."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or node.users \
                or len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        for _ in range(64):  # back through in-place ops on the same tensor (not views), and no_grad regions
            if src is dst or not isinstance(src, torch.fx.Node):
                break
            if src.op == "call_function" and is_inplace(src) and src.args and isinstance(src.args[0], torch.fx.Node):
                src = src.args[0]
                continue
            through = _region_operand(gm, src)  # `with torch.no_grad(): self.n += 1`: the region hands n back
            if through is None:
                break
            src = through
        if src is dst:
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()


def _region_operand(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """For `getitem(wrap_with_set_grad_enabled(flag, submod, *operands), k)`: the operand the region's k-th output is,
    written in place (its output reached from one of its placeholders through in-place ops alone); else None."""
    if not (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
            and isinstance(node.args[1], int)):
        return None
    region = node.args[0]
    if not (region.op == "call_function" and region.target is getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
            and len(region.args) >= 2 and isinstance(region.args[1], torch.fx.Node) and region.args[1].op == "get_attr"):
        return None
    sub = getattr(gm, str(region.args[1].target), None)
    if not isinstance(sub, torch.fx.GraphModule):
        return None
    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
    outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    value = outputs[node.args[1]] if isinstance(outputs, (tuple, list)) and node.args[1] < len(outputs) else None
    for _ in range(64):
        if not isinstance(value, torch.fx.Node) or value.op == "placeholder":
            break
        if not (value.op == "call_function" and is_inplace(value) and value.args and isinstance(value.args[0], torch.fx.Node)):
            return None
        value = value.args[0]
    if not isinstance(value, torch.fx.Node) or value not in placeholders:
        return None
    operand = region.args[2 + placeholders.index(value)] if 2 + placeholders.index(value) < len(region.args) else None
    return operand if isinstance(operand, torch.fx.Node) else None


def _region_subgraphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[list[torch.fx.GraphModule], tuple]:
    """The sub-graphs a higher-order op node of `gm` runs and the operands their placeholders take, in order: the
    call's arguments after its last sub-graph (`wrap_with_set_grad_enabled(False, sub, *operands)`,
    `wrap_with_autocast(..., sub, *operands)`), or the one tuple there (`cond(pred, true_gm, false_gm, (operands,))`);
    ([], ()) for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return [], ()
    at, subs = -1, []
    for k, a in enumerate(node.args):
        obj: Any = gm if isinstance(a, torch.fx.Node) and a.op == "get_attr" else None
        for part in str(a.target).split(".") if obj is not None else ():
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.fx.GraphModule):
            at, subs = k, [*subs, obj]
    operands = tuple(node.args[at + 1:]) if subs else ()
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = tuple(operands[0])
    return subs, operands


def region_written_operands(gm: torch.fx.GraphModule, node: torch.fx.Node, _depth: int = 0) -> list[torch.fx.Node]:
    """The operands (values of `gm`) a higher-order op node's sub-graphs write in place: torch.export keeps
    `with torch.no_grad(): self.m[:2].lerp_(v, .5)` as `wrap_with_set_grad_enabled(False, sub, m, x)` whose sub-graph
    writes a view of its placeholder for `m`, and hands nothing back, so the parent graph shows no write of `m`.
    Each in-place op of a sub-graph (and of regions nested in it) is followed back through views and in-place ops
    (alias_chain, storage_root) to a placeholder, said as the operand the call passes it; a write whose placeholder has
    no operand (a region called otherwise than the forms above) counts as a write of every operand. A value the
    region makes itself is no write outside it. [] for any other node."""
    subs, operands = _region_subgraphs(gm, node)
    if not subs or _depth > 8:
        return []
    every = [a for a in operands if isinstance(a, torch.fx.Node)]
    out: list[torch.fx.Node] = []
    for sub in subs:
        places = [p for p in sub.graph.nodes if p.op == "placeholder"]
        written = [n.args[0] for n in sub.graph.nodes if is_inplace(n)]
        # and through `out=` (`torch.add(c, v, out=c)` is `aten.add.out(c, v, out=c)` in an export sub-graph)
        written += [o for n in sub.graph.nodes for o in tree_flatten(n.kwargs.get("out"))[0] if isinstance(o, torch.fx.Node)]
        for inner in sub.graph.nodes:  # a region nested in this one: what it writes of this sub-graph's values
            written += region_written_operands(sub, inner, _depth + 1)
        for value in written:
            for root in {alias_chain(value)[-1], storage_root(value, every_module=False)}:
                if root.op != "placeholder":
                    continue
                at = places.index(root) if root in places else -1
                hit = operands[at] if 0 <= at < len(operands) and isinstance(operands[at], torch.fx.Node) else None
                out += [hit] if hit is not None else every
    return list(dict.fromkeys(out))


def check_small_sizes(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: tuple, drawn_only: bool = False) -> None:
    """Which sizes below 2 each dynamic dim of an export trace holds for, into gm.meta["stagewise_small_ok"]
    ({symbol: smallest size}); planner.inputs makes that the dim's minimum.

    torch.export traces a dynamic dim for sizes of at least 2 (its 0/1 specialisation): a forward() that does
    something else at size 1 (`if x.shape[0] == 1: ...`, a decode step) has the >= 2 branch in the graph. So each
    symbol's inputs are cut to size 1, then 0, and the graph is run beside the model itself (same random seed,
    state restored after): a size is accepted where both give the same outputs, refused at call time otherwise."""
    from stagewise.planner.snapshot import StateSnapshot  # planner.snapshot imports nothing from here; kept local
    ranges = gm.meta.get("stagewise_ranges", {})
    leaves, spec = tree_flatten(tuple(example_inputs))
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    where: dict[str, list[tuple[int, int]]] = {}  # symbol -> (input leaf, dim) holding it
    if len(placeholders) == len(leaves):
        for i, p in enumerate(placeholders):
            val = p.meta.get("val")
            if isinstance(val, torch.Tensor) and isinstance(leaves[i], torch.Tensor):
                for d, size in enumerate(val.shape):
                    if not isinstance(size, int) and size.node.maybe_as_int() is None:
                        where.setdefault(str(size.node.expr), []).append((i, d))
    def smallest_for(dims: list[tuple[int, int]]) -> int:
        smallest = 2
        for k in (1, 0):
            small = list(leaves)
            for i, d in dims:
                small[i] = small[i].narrow(d, 0, k)
            # the example's own rows, and fresh floating values (a branch taken at size 1 may change only some values)
            drawn = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(device=t.device, dtype=t.dtype)
                     if isinstance(t, torch.Tensor) and t.is_floating_point() else t for i, t in enumerate(small)]
            # (`drawn_only`: the example is zeros standing in for the inputs, which some models cannot take, an
            # input matrix inverted: the fresh floats alone)
            if not all(_same_outputs(model, gm, tree_unflatten(v, spec), StateSnapshot)
                       for v in ((drawn,) if drawn_only else (small, drawn))):
                break
            smallest = k
        return smallest

    checked = [expr for expr in where if ranges.get(expr, (None,))[0] == 2]
    size_of = {expr: leaves[where[expr][0][0]].shape[where[expr][0][1]] for expr in checked}
    ok: dict[str, int] = {}
    together: dict[str, list[str]] = {}
    for expr in checked:
        ok[expr] = smallest_for(where[expr])
        alike = [e for e in checked if e != expr and size_of[e] == size_of[expr]]
        if ok[expr] == 2 and alike:
            # export may give one axis two symbols (input_ids' batch and attention_mask's): cut alone, the model
            # itself fails (a mask of one row for two sequences); cut with every dim of the same example size, and
            # accepted below 2 only with those dims at its size (that is all that was checked)
            ok[expr] = smallest_for([dim for e in (expr, *alike) for dim in where[e]])
            if ok[expr] < 2:
                together[expr] = alike
    gm.meta["stagewise_small_ok"] = ok
    gm.meta["stagewise_small_together"] = together


def _same_outputs(model: nn.Module, gm: torch.fx.GraphModule, args: tuple, snapshot_type: Any) -> bool:
    """Whether `gm` and `model` give the same outputs on `args` (each from the same random seed, their state restored)."""
    outs = []
    for f in (model, gm):
        before = snapshot_type.take(f)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                outs.append(tree_flatten(f(*args))[0])
        except Exception:  # noqa: BLE001 - either cannot run at this size: not accepted there
            return False
        finally:
            before.restore_if_changed(f)
    want, got = outs
    if len(want) != len(got):
        return False
    for a, b in zip(want, got):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor):
            a, b = a.detach(), b.detach()  # forward() may turn gradients on inside (set_grad_enabled(True))
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.is_complex():
                a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
            a, b = a.double(), b.double()
            scale = float(a.abs().nan_to_num(0.0, 0.0, 0.0).max()) if a.numel() else 0.0
            if a.numel() and not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale + 1e-7, equal_nan=True):
                return False
        elif a != b:
            return False
    return True


def views_as_reshapes(gm: torch.fx.GraphModule) -> None:
    """`aten.view(x, shape)` -> `aten.reshape(x, shape)` in an aten-level graph (torch.export's, or an archive's);
    graph.graph_of does it to every traced graph, after the fingerprint (plans saved before keep matching).

    Export records the strides it saw: where the traced tensor happened to be laid out so that a view works
    (nn.MultiheadAttention's `attn.permute(...).contiguous().view(...)`, whose contiguous() was a no-op on the
    attention kernel's output and is not in the graph), the graph keeps a bare view. Batched, the same value may
    be laid out otherwise (vmap's fallback stacks per-member results; torch 2.11 on SDPA), and the view fails.
    reshape is that very view wherever a view is possible, and a copy of the same values only where the view would
    have failed. A copy no longer shares memory with its base, so a view stays a view where anything in the graph
    writes in place into its base or into another view of it (the write must reach both)."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        nodes = list(module.graph.nodes)
        written = {alias_chain(n.args[0])[-1] for n in nodes if is_inplace(n)}
        # and what a region's sub-graph writes through the operands it is handed (a view of x clamped in no_grad)
        written |= {alias_chain(w)[-1] for n in nodes for w in region_written_operands(module, n)}
        changed = False
        for node in nodes:
            if (node.op == "call_function" and node.target is torch.ops.aten.view.default
                    and alias_chain(node)[-1] not in written):
                node.target, changed = torch.ops.aten.reshape.default, True
        if changed:
            module.recompile()


_SYM_QUERIES = {"aten::sym_size.int": "size", "aten::sym_numel": "numel", "aten::sym_stride.int": "stride"}


def _sizes_as_methods(gm: torch.fx.GraphModule) -> None:
    """`aten.sym_size.int(x, 0)` -> `x.size(0)` (same value): vmap has no rule for the aten op, but a
    batched tensor's size() is one member's size. Dynamic dims put these reads in the graph."""
    changed = False
    for node in gm.graph.nodes:
        method = _SYM_QUERIES.get(getattr(node.target, "name", lambda: "")()) if node.op == "call_function" else None
        if method:
            node.op, node.target, changed = "call_method", method, True
    if changed:
        gm.recompile()


def _range_of(vr) -> tuple[int, int | None]:
    """A sympy value range as (min, max or None for unbounded)."""
    lo, hi = _finite_int(vr.lower), _finite_int(vr.upper)
    return max(lo or 0, 0), hi


def _finite_int(v) -> int | None:
    """int(v) for a finite sympy bound, None for +-infinity (torch's int_oo)."""
    try:
        return int(v)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


@contextlib.contextmanager
def _quiet_on_failure():
    """Hold back what torch.export prints; show it only if export succeeds.

    A failed export prints its partial graph to stderr and logs warnings; our
    TraceError already says why, and a CLI user should see one line, not a dump.
    """
    held = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(held), warnings.catch_warnings():
            # an RNN's weight list, which its own forward() sets again on every call: nothing for the user to change
            warnings.filterwarnings("ignore", message=r"The tensor attributes [\w.]*_flat_weights\[")
            yield
    finally:
        logging.disable(previous)
    sys.stderr.write(held.getvalue())  # reached only on success


def _drop_guard_nodes(gm: torch.fx.GraphModule) -> None:
    """Remove export's input-guard call (it re-checks shapes we check ourselves, and is not batchable)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards") and not node.users:
            gm.graph.erase_node(node)
    # a region export keeps as a higher-order op (a torch.no_grad() block) is kept though nothing reads its result:
    # it may write state in place (a VQ-VAE's EMA codebook update), which fx's default would count as pure
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or isinstance(n.target, torch._ops.HigherOrderOperator))
    gm.recompile()


# torch.export's error for a tensor it met outside the graph and kept as a constant (`lifted_tensor_0`): what a
# `p.data = ...` assignment in forward() leaves (the swapped-in tensor is no graph value)
LIFTED_CONSTANT = "fake tensor in the exported program constant"


class _DataAssignmentSeen(torch.overrides.TorchFunctionMode):
    """Records where forward() first assigns a tensor's `.data` (`Tensor.data.__set__` reaches a torch function
    mode as the descriptor's __set__): the source line, as `code` (file:line)."""

    def __init__(self):
        super().__init__()
        self.where: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.where is None and getattr(func, "__name__", "") == "__set__" \
                and getattr(func, "__self__", None) is torch._C.TensorBase.data:
            frame = sys._getframe(1)
            torch_dir = torch.__file__.rpartition("/")[0]
            while frame is not None and (frame.f_code.co_filename.startswith(torch_dir) or frame.f_code.co_filename == __file__):
                frame = frame.f_back
            if frame is not None:
                import linecache
                code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                self.where = f"`{code}` ({frame.f_code.co_filename.rpartition('/')[2]}:{frame.f_lineno})"
            else:
                self.where = "a `.data =` assignment"
        return func(*args, **(kwargs or {}))


def data_assignment(model: nn.Module, example_inputs: tuple) -> str | None:
    """Where forward() on the example inputs assigns a tensor's `.data` (`pk.data = pk.data * m + pq.data * (1 - m)`,
    the momentum update of MoCo's reference code), or None: why torch.export failed with its lifted-constant error
    (LIFTED_CONSTANT), whose text points at `lifted_tensor_0` and not at the line. The model's state and the random
    streams are as they were afterwards; a forward() that fails says nothing either way (None)."""
    from stagewise.planner.snapshot import StateSnapshot  # planner.snapshot imports nothing from here; kept local
    watch, before = _DataAssignmentSeen(), StateSnapshot.take(model)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), watch:
            model(*example_inputs)
    except Exception:  # noqa: BLE001 - only a diagnosis
        pass
    finally:
        before.restore_if_changed(model)
    return watch.where


def data_assignment_refusal(model: nn.Module, where: str) -> str:
    """The TraceError text for forward() assigning `.data` (found by data_assignment at `where`), with the fix."""
    return (f"{type(model).__name__}.forward() assigns a tensor's .data, at {where}: torch.export cannot trace that "
            "(the tensor swapped in is no graph value; export keeps it as a constant, lifted_tensor_0, and fails). "
            "Update the tensor in place instead, under torch.no_grad(): for a momentum (EMA) update "
            "`pk.mul_(m).add_(pq.detach(), alpha=1 - m)`, or `pk.copy_(new_value)`; stagewise batches in-place "
            "updates of member state")
