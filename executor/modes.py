"""executor.modes: whether forward() depends on the training flag, and the modes a batched module refuses.

reads_training is a static scan of the code a trace may run for a `training` read; mode_bound traces a copy
of member 0 again in each mode its own train() gives it other layer flags in, and names the first difference from the
traced graph (inside torch.export's no_grad blocks too: executor.subgraphs).
"""
from __future__ import annotations

import builtins
import copy
import functools
import sys
import types
from typing import Any, Sequence

import torch
from torch import nn

from stagewise.executor.subgraphs import subgraph_codes
from stagewise.planner.errors import StagewiseError
from stagewise.planner.graph import ModelGraph, retrace
from stagewise.planner.module_refusals import closure_values
from stagewise.planner.plan import Plan
from stagewise.planner.snapshot import deepcopy_module


# --- forward() reading self.training ------------------------------------------------------------
# A Python branch on `self.training` (or `F.dropout(x, p, self.training)`) in a traced forward is decided
# when it is traced: the graph holds one branch. Leaf modules (nn.Dropout, nn.BatchNorm*) stay call_module
# nodes under fx and follow .train()/.eval() at run time; torch.export traces inside them, so there their
# flag is decided at trace time too. build() traces a copy of member 0 in the other mode as well: where the
# graphs differ, the module refuses that mode (train(), eval(), a call with the flag set by hand).


def _code_reads_training(code: types.CodeType) -> bool:
    """Whether `code` (or a function nested in it) names an attribute or string `training`."""
    if "training" in code.co_names or "training" in code.co_consts:
        return True
    return any(isinstance(c, types.CodeType) and _code_reads_training(c) for c in code.co_consts)


def _all_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _all_names(c)
    return names


def _is_user_code(module_name: str | None) -> bool:
    """Whether a Python module name is neither torch's nor the standard library's (where no forward of ours hides)."""
    root = (module_name or "").partition(".")[0]
    return root not in ("torch", "builtins") and root not in sys.stdlib_module_names


def reads_training(model: nn.Module, tracer: str = "export", opened: Sequence[str] = ()) -> bool:
    """Whether Python code that may run in `model`'s traced forward reads a `training` flag: the methods of
    every traced submodule's classes (under export torch's own too: Dropout, BatchNorm read it; under fx its
    leaves are not traced unless `opened`), functions held on the modules, and the user functions, classes,
    modules and tables of functions those reach by global name. Only a filter: False skips tracing the model
    again in the other mode (see mode_bound); when in doubt it says True."""
    leaf = torch.fx.Tracer().is_leaf_module
    todo: list[Any] = []
    for path, mod in model.named_modules():
        if tracer == "fx" and path not in opened and leaf(mod, path):
            continue  # a call_module node: it reads its flag when it runs
        todo.append(type(mod))
        todo.extend(v for v in vars(mod).values() if callable(v) and not isinstance(v, nn.Module))
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is nn.Module or obj is object:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            if issubclass(obj, torch.fx.GraphModule) or (issubclass(obj, nn.Module) and ("train" in vars(obj) or "eval" in vars(obj))):
                return True  # generated code, or a train() of its own that may set other flags forward() reads: trace again
            todo.extend(obj.__mro__[1:])
            for v in vars(obj).values():
                if isinstance(v, (staticmethod, classmethod)):
                    v = v.__func__
                if isinstance(v, property):
                    todo.extend(f for f in (v.fget, v.fset) if f is not None)
                elif isinstance(v, (types.FunctionType, type)):
                    todo.append(v)
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__func__)
        elif isinstance(obj, functools.partial):
            todo.append(obj.func)
        elif isinstance(obj, types.FunctionType):
            if _code_reads_training(obj.__code__):
                return True
            todo.extend(v for v in closure_values(obj) if isinstance(v, (types.FunctionType, type, functools.partial)))
            names = _all_names(obj.__code__)
            for name in names:  # the user's helpers it calls by global name, `helper(...)` or `utils.helper(...)`
                v = obj.__globals__.get(name, getattr(builtins, name, None))
                if isinstance(v, types.ModuleType) and _is_user_code(v.__name__):
                    todo.extend(getattr(v, n) for n in names if isinstance(getattr(v, n, None), (types.FunctionType, type)))
                elif isinstance(v, (dict, list, tuple)):  # a registry of activations or blocks: ACTS[self.kind](x)
                    todo.extend(f for f in (v.values() if isinstance(v, dict) else v)
                                if isinstance(f, (types.FunctionType, type, functools.partial)) and _is_user_code(getattr(f, "__module__", None)))
                elif isinstance(v, (types.FunctionType, type, functools.partial)) and _is_user_code(getattr(v, "__module__", None)):
                    todo.append(v)
        elif callable(obj) and not isinstance(obj, (types.BuiltinFunctionType, torch.Tensor)):
            todo.append(type(obj))  # a callable object: its class's __call__
    return False


# torch's dropout family: the op (or function) name, without an overload, and where its probability and training flag
# sit (aten ops: (input, p, train); F.dropout and friends: (input, p, training, inplace)).
_DROPOUTS = {"dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
             "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout", "dropout1d", "dropout2d", "dropout3d"}


def _is_dropout_of_zero(node: torch.fx.Node) -> bool:
    """Whether `node` calls torch's dropout family with a constant probability 0: the identity in either mode."""
    target = node.target
    if node.op != "call_function" or _is_user_code(getattr(target, "__module__", None)):
        return False
    if str(getattr(target, "__name__", "")).partition(".")[0] not in _DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def _is_attention_without_dropout(node: torch.fx.Node) -> bool:
    """Whether `node` is scaled_dot_product_attention with a dropout_p of 0 (`0` and `0.0` alike: nanoGPT's
    `dropout_p=self.dropout if self.training else 0` with dropout 0.0 traces to one or the other by mode)."""
    if node.op != "call_function" or "scaled_dot_product_attention" not in str(getattr(node.target, "__name__", "")):
        return False
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else None)
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def _without_dropout_flags(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` whose dropouts of probability 0 carry no training flag (they compute the same in both modes),
    so two traces differing only there read as one program. The copy is for comparing only, never run."""
    copied = torch.fx.Graph()
    copied._codegen = graph._codegen  # the same input/output handling (export's pytree code) as the traced graph
    copied.output(copied.graph_copy(graph, {}))
    for node in copied.nodes:
        if _is_dropout_of_zero(node):
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("training", "train")}
            if len(node.args) > 2:  # the flag positional: dropped with what follows it (inplace), which p = 0 makes moot
                node.args = node.args[:2]
        elif _is_attention_without_dropout(node):
            node.kwargs = {**node.kwargs, "dropout_p": 0.0} if "dropout_p" in node.kwargs else node.kwargs
            if len(node.args) > 4:
                node.args = (*node.args[:4], 0.0, *node.args[5:])
    return copied


def _mode_text(gm: torch.fx.GraphModule, state_names: set[str]) -> tuple[list[str], dict[str, Any]]:
    """What decides a trace's behaviour beyond member state: its code, line by line (dropouts of probability 0 without
    their training flag), and the constants it reads; then the same of each sub-graph its region ops run (torch.export's
    `with torch.no_grad():` block, whose Dropout or BatchNorm the trace fixes to a mode too), under a line naming it."""
    lines, consts = _graph_text(gm, state_names)
    for path, sub in subgraph_codes(gm):
        inner, inner_consts = _graph_text(sub, set())  # (state reaches a sub-graph as operands, not get_attr)
        lines += [f"# {path}:", *inner]
        consts.update({f"{path}.{k}": v for k, v in inner_consts.items()})
    return lines, consts


def _graph_text(gm: torch.fx.GraphModule, state_names: set[str]) -> tuple[list[str], dict[str, Any]]:
    """One graph's code lines and the constants (not `state_names`, not modules) its get_attr nodes read."""
    code = gm.code
    if any(_is_dropout_of_zero(n) or _is_attention_without_dropout(n) for n in gm.graph.nodes):
        code = _without_dropout_flags(gm.graph).python_code(root_module="self").src
    consts = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) not in state_names:
            obj: Any = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part, None)
            if not isinstance(obj, nn.Module):
                consts[str(node.target)] = obj
    return code.strip().splitlines(), consts


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and (a.device.type == "meta" or torch.equal(a.detach(), b.detach())))
    try:
        return bool(a == b)
    except Exception:  # an object without a plain ==: only itself is itself
        return a is b


def around_first_difference(a: str, b: str, width: int = 60) -> tuple[str, str]:
    """Two lines of code cut to `width` characters either side of the first character they differ at (the lines may
    share a long start, such as a call's first arguments)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, at - width)
    cut = lambda t: ("..." if start else "") + t[start:at + width] + ("..." if len(t) > at + width else "")  # noqa: E731
    return cut(a), cut(b)


def _mode_difference(traced: tuple[list[str], dict[str, Any]], other: tuple[list[str], dict[str, Any]]) -> str | None:
    """None when two traces are the same program, else a few words on the first difference."""
    (lines_a, consts_a), (lines_b, consts_b) = traced, other
    for a, b in zip(lines_a + ["<end>"], lines_b + ["<end>"]):
        if a != b:
            a, b = around_first_difference(a.strip(), b.strip())
            return f"`{a}` became `{b}`"
    for k in consts_a.keys() | consts_b.keys():
        if k not in consts_a or k not in consts_b or not _same_constant(consts_a[k], consts_b[k]):
            return f"the constant {k!r} differs"
    return None


_MODE_NAME = {True: "training", False: "eval"}


def mode_bound(private: nn.Module, graph: ModelGraph, plan: Plan, example: tuple | None) -> dict[bool, str]:
    """The modes (True = training) in which `private` (a copy of member 0, traced as `graph`) traces to another
    program than `graph`, each with the first difference (or why it cannot be traced in that mode).

    A mode is what `train(mode)` makes of the model, its class's own train() included (mmcv's `norm_eval`, a
    `freeze_bn` keeping BatchNorm in eval while the rest trains): members built fresh are all in training mode, and
    the training loop's `.train()` then puts their BatchNorm in eval, another graph under torch.export. A mode whose
    layer flags are those traced is the traced graph itself."""
    now = [m.training for m in private.modules()]
    own = any(type(m).train is not nn.Module.train for m in private.modules())
    copies = {mode: train_on_copy(private, mode) for mode in (True, False)} if own else {}
    flags = {mode: [m.training for m in copies[mode].modules()] if own else [mode] * len(now) for mode in (True, False)}
    wanted = [mode for mode in (True, False) if flags[mode] != now]  # the layers as traced already: graph itself
    if not wanted or not reads_training(private, plan.tracer, plan.opened_modules):
        return {}
    state = {k for k, _ in private.named_parameters(remove_duplicate=False)} | {k for k, _ in private.named_buffers(remove_duplicate=False)}
    traced = _mode_text(graph.gm, state)
    names = [i.name for i in plan.inputs]
    bound = {}
    for mode in wanted:
        if own:
            other = copies[mode]
            kept = sorted(name or type(private).__name__ for name, m in other.named_modules() if m.training != mode)
            how = (f"after its own train({mode}) (the model's class overrides train(), leaving {', '.join(kept[:3])}"
                   f"{' ...' if len(kept) > 3 else ''} in {_MODE_NAME[not mode]} mode)" if kept else f"in {_MODE_NAME[mode]} mode")
        else:
            # the other mode's trace may run Python that changes attributes: on a copy, sharing the parameters and
            # buffers (a trace does not write them: fx holds proxies, export fakes)
            other = deepcopy_module(private, {id(t): t for t in [*private.parameters(), *private.buffers()]})
            other.train(mode)
            how = f"in {_MODE_NAME[mode]} mode"
        try:
            g = retrace(other, plan.tracer, example, names, plan.opened_modules)
        except StagewiseError as e:  # e.g. a random draw only the training branch makes
            bound[mode] = f"{how} it cannot be traced ({str(e).splitlines()[0][:300]})"
            continue
        difference = _mode_difference(traced, _mode_text(g.gm, state))
        if difference is not None:
            bound[mode] = f"{how} it traces to another graph ({difference})"
    return bound


def train_on_copy(model: nn.Module, mode: bool) -> nn.Module:
    """A copy of `model` (sharing its parameters and buffers) after `copy.train(mode)`, the model's own train() run
    (an override that returns None too); the parameters' requires_grad flags, which such an override may set (a
    frozen BatchNorm), are put back on the shared tensors afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    other = deepcopy_module(model, {id(t): t for t in [*model.parameters(), *model.buffers()]})
    try:
        other.train(mode)
        other.__dict__["_stagewise_requires_grad"] = {k: p.requires_grad for k, p in other.named_parameters(remove_duplicate=False)}
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return other


def own_train_modes(private: nn.Module, now: dict[str, bool]) -> tuple[dict[bool, dict[str, bool]], dict[bool, dict[str, bool]]]:
    """For a model whose class (or a submodule's) overrides train() (mmcv's `norm_eval`: BatchNorm kept in eval while
    the rest trains; a `freeze_bn` that also sets requires_grad), ({mode: {qualified name: training}} of the
    submodules that `private.train(mode)` leaves in the other mode, {mode: {parameter: requires_grad}} of the
    parameters it sets otherwise than `now` (the members' flags, {name: requires_grad}); ({}, {}) where no class
    overrides it (nn.Module.train sets every submodule alike and no flag). Run on copies sharing the tensors; the
    flags are put back."""
    if all(type(m).train is nn.Module.train for m in private.modules()):
        return {}, {}
    modes, flags = {}, {}
    for mode in (True, False):
        other = train_on_copy(private, mode)
        modes[mode] = {name: m.training for name, m in other.named_modules() if m.training != mode}
        flags[mode] = other.__dict__["_stagewise_requires_grad"]
    # every flag either mode sets otherwise than the members hold it, in both modes: a reversible override
    # (`self.bn.requires_grad_(mode)`) puts it back on the way back
    moved = {k for mode in flags for k, rg in flags[mode].items() if now.get(k) != rg}
    return modes, {mode: {k: flags[mode][k] for k in moved if k in flags[mode]} for mode in flags}


def set_train_modes(module: nn.Module, mode: bool, overrides: dict[bool, dict[str, bool]]) -> None:
    """`module.train(mode)`, then the submodules (by qualified name) that the member's own train() leaves otherwise."""
    module.train(mode)
    for name, sub in module.named_modules():
        if name in overrides.get(mode, {}):
            sub.training = overrides[mode][name]
