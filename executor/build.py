"""executor.build: a plan plus members becomes one batched nn.Module.

Input layout: `shared` inputs as one member would take them; `per_member`
inputs with a leading member axis [N, ...]. Output layout: N-first, i.e. every
tensor of the model's output gets a leading [N] axis (pytrees keep their shape).
"""
from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import re
import sys
import types
from pathlib import Path
import dataclasses
import warnings
from typing import Any, Sequence

import networkx as nx
import torch
from torch import nn
from torch.utils._pytree import SUPPORTED_NODES, register_dataclass, tree_flatten, tree_map, tree_unflatten

from stagewise.planner import budget
from stagewise.planner.files import temp_beside
from stagewise.planner.errors import DeviceError, ExecutionError, InputError, MemberError, PlanMismatchError, StagewiseError
from stagewise.planner.graph import (ModelGraph, fingerprint_lines, global_hooks_present, global_hooks_refusal,
                                      registration_hooks_off, retrace)
from stagewise.planner.inputs import check_call_inputs, example_inputs_from
from stagewise.planner.capability import alias_chain, is_inplace
from stagewise.planner.plan import InputMode, Plan, Stage
from stagewise.planner.snapshot import StateSnapshot
from stagewise.planner.validate import stage_graph, validate
from stagewise.executor.capture import CapturedPlan, CudaGraphBackend, NotCapturableError
from stagewise.executor.constants import LIFTED_PREFIX, lift_member_constants
from stagewise.executor.stages import LoopRunner, Runner, StageProgram, runner_for
from stagewise.executor.values import Batched, Shared, as_batched, n_first, reset_call_number_context, set_call_number_context


# Precision (plan.dtype). Cast once, not autocast: the stacked floating state (parameters and buffers,
# BatchNorm running statistics included, like `model.to(torch.bfloat16)`) is cast once at build, floating
# inputs at the module's entry, outputs back to the caller's dtype. It is the simplest rule that is also what
# users run (bf16 weights halve memory and bandwidth; autocast would re-cast the weights on every call),
# and every op of every stage strategy (vmap, loop, wide, compile) sees one dtype, so nothing in the
# executor needs to know about it. float16 on CPU where an op has no Half kernel: ExecutionError naming the
# op and suggesting bfloat16, never a silently wrong answer. "tf32" keeps float32 and enables TF32 only
# around the module's CUDA calls; on CPU it is a no-op (computes exactly like float32).
LOW_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class _TF32:
    """TF32 matmuls and convolutions (and float32 matmul precision "high") inside, restored after. Where the
    caller set torch's newer per-backend `fp32_precision` flags so that the legacy ones cannot be read (torch
    raises on a mix), the newer flags are set and restored instead."""

    def __enter__(self):
        try:
            self.saved = ("legacy", torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                          torch.get_float32_matmul_precision())
        except RuntimeError:  # "mix of the legacy and new APIs": only the new ones may be used now
            self.saved = ("new", torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
            torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
            return
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")

    def __exit__(self, *exc):
        if self.saved[0] == "new":
            torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = self.saved[1:]
            return
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision = self.saved[1:]
        torch.set_float32_matmul_precision(precision)


def tf32_scope(dtype: str, device: torch.device) -> Any:
    """TF32 on for a "tf32" plan's CUDA work (profile and autotune call stage runners outside the module's forward,
    which turns it on itself), a no-op context otherwise."""
    return _TF32() if dtype == "tf32" and device.type == "cuda" else contextlib.nullcontext()


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor leaf of `tree` as `dtype` (others untouched)."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x, tree)


# What a plan with `capture` set replays through: None = CUDA graphs on a CUDA device, nothing elsewhere (the
# module runs stage by stage). Tests without a GPU put capture.ReplayBackend here to run the same path on CPU.
CAPTURE_BACKEND: Any = None


def capture_backend(device: torch.device) -> Any:
    """A fresh whole-plan capture backend for a module on `device`, or None where there is none."""
    if CAPTURE_BACKEND is not None:
        return CAPTURE_BACKEND()
    return CudaGraphBackend() if device.type == "cuda" and torch.cuda.is_available() else None


# torch's words for a failure the inputs likely caused (their shape, dtype or values): only then is a stage's
# failure reported as InputError with shape advice
_INPUT_TROUBLE = re.compile(r"shape|size|dimension|dtype|Expected|expected|must match|mat1|mat2|out of range|index", re.I)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` -> cpu; refuses CUDA on a machine without it, with the fix."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' was requested but this machine has no CUDA device; use device='cpu'")
    return dev


def member_state(member: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of one member by dotted name, every name of a tied tensor included.

    A tensor reachable under several names (an embedding tied to the output head)
    appears once per name, as the same object: a stage reading `head.weight` must
    receive this member's tensor even when `emb.weight` is read by another stage.
    """
    named = list(member.named_parameters(remove_duplicate=False)) + list(member.named_buffers(remove_duplicate=False))
    return dict(named)


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Alias name -> first name, for tensors of `state` reachable under several names."""
    first: dict[int, str] = {}
    alias = {}
    for k, t in state.items():
        owner = first.setdefault(id(t), k)
        if owner != k:
            alias[k] = owner
    return alias


def stack_member_state(members: Sequence[nn.Module], device: torch.device) -> dict[str, torch.Tensor]:
    """Stack member state into [N, ...] tensors; MemberError names the first mismatching member and key.

    Names tied to one tensor in every member share one stacked tensor (the aliasing
    is kept, so an in-place update reaches every stage that reads it).
    """
    states = [member_state(m) for m in members]
    ref = states[0]
    for i, st in enumerate(states[1:], start=1):
        if st.keys() != ref.keys():
            missing = sorted(ref.keys() - st.keys())
            extra = sorted(st.keys() - ref.keys())
            raise MemberError(f"member {i} does not match member 0: missing {missing[:3]}, unexpected {extra[:3]}; all members must share one architecture")
        for k, t in st.items():
            if t.shape != ref[k].shape or t.dtype != ref[k].dtype:
                raise MemberError(
                    f"member {i} has {k} of shape {list(t.shape)} {t.dtype}, member 0 has {list(ref[k].shape)} {ref[k].dtype}; "
                    "all members must share one architecture"
                )
    ties = [tied_names(st) for st in states]
    shared_ties = {k: v for k, v in ties[0].items() if all(t.get(k) == v for t in ties[1:])}
    stacked: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k in ref:
            if k in shared_ties:
                stacked[k] = stacked[shared_ties[k]]
            else:
                stacked[k] = torch.stack([st[k].detach() for st in states]).to(device)
    return stacked


def check_same_requires_grad(members: Sequence[nn.Module]) -> None:
    """MemberError naming the first member that freezes other parameters than member 0: a stacked parameter
    has one requires_grad for all members (member 0's would be trained, or frozen, for every member)."""
    ref = {k: p.requires_grad for k, p in members[0].named_parameters(remove_duplicate=False)}
    for i, m in enumerate(members[1:], start=1):
        differ = [(k, p.requires_grad) for k, p in m.named_parameters(remove_duplicate=False) if k in ref and ref[k] != p.requires_grad]
        if differ:
            frozen = [k for k, rg in differ if not rg]
            trained = [k for k, rg in differ if rg]
            what = "; ".join(part for part in (
                f"member {i} freezes {frozen[:3]}{' ...' if len(frozen) > 3 else ''} (requires_grad=False), which member 0 trains" if frozen else "",
                f"member {i} trains {trained[:3]}{' ...' if len(trained) > 3 else ''}, which member 0 freezes (requires_grad=False)" if trained else "",
            ) if part)
            raise MemberError(f"{what}: a stacked parameter has one requires_grad for all members, so it would be trained or frozen "
                              "for every member alike. Freeze the same parameters in every member (p.requires_grad_(False) on each), "
                              "or build the members that differ here as separate modules")


def shared_across_members(members: Sequence[nn.Module]) -> list[str]:
    """Names of trainable parameters that two members hold as one tensor. Stacked, each member gets its own
    copy: forward is the same, but training would update the copies apart where the loop updates one tensor."""
    seen: dict[int, int] = {}
    shared = []
    for i, m in enumerate(members):
        for name, p in m.named_parameters():
            owner = seen.setdefault(id(p), i)
            if owner != i and p.requires_grad and name not in shared:
                shared.append(name)
    return shared


def _first_difference(plan: Plan, graph: ModelGraph) -> str:
    planned = [n for s in plan.stages for n in s.nodes]
    have = set(graph.compute_nodes)
    lost = [n for n in planned if n not in have]
    if lost:
        return f"first plan node the model lacks: {lost[0]!r}"
    placed = set(planned)
    extra = [n for n in graph.compute_nodes if n not in placed]
    if extra:
        return f"first model node the plan lacks: {extra[0]!r}"
    return "same node names: parameter shapes, dtypes or module types differ (" + fingerprint_lines(graph.gm, graph.opened_modules)[-1] + " ...)"


def register_output_dataclasses(gm: torch.fx.GraphModule) -> None:
    """Make dataclasses built in forward() (output dataclasses) pytree nodes, like tuples and dicts.

    Otherwise a dataclass is one opaque leaf: its tensors get no member axis and
    vmap's internal batched tensors leak out of the stage inside it.
    """
    for node in gm.graph.nodes:
        cls = node.target
        if node.op == "call_function" and isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls not in SUPPORTED_NODES:
            register_dataclass(cls)


def run_order(plan: Plan, graph: ModelGraph) -> list[Stage]:
    """The plan's stages in dependency order (a hand-edited plan file may list them in any order)."""
    index = {s.id: i for i, s in enumerate(plan.stages)}
    return [plan.stage(sid) for sid in nx.lexicographical_topological_sort(stage_graph(plan, graph), key=index.__getitem__)]


def state_tree(stacked: dict[str, torch.Tensor], params: dict[str, bool], persistent: set[str]) -> nn.Module:
    """Stacked member state as a module tree mirroring one member's: `tree.fc1.weight` is [N, *fc1.weight.shape].

    Names in `params` become nn.Parameters (requires_grad as given; a tied tensor is one Parameter
    under each of its names); the rest are buffers, in the state_dict when in `persistent`.
    """
    root = nn.Module()
    as_param: dict[int, nn.Parameter] = {}
    for name, t in stacked.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        if name in params:
            p = as_param.get(id(t))
            if p is None:
                p = as_param[id(t)] = nn.Parameter(t, requires_grad=params[name])
            owner.register_parameter(leaf, p)
        else:
            owner.register_buffer(leaf, t, persistent=name in persistent)
    return root


def tree_tensor(tree: nn.Module, name: str) -> torch.Tensor:
    """The tensor `state_tree` registered under dotted `name`."""
    path, _, leaf = name.rpartition(".")
    owner = tree.get_submodule(path) if path else tree
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


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
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _cell_is_code(c))
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


def _cell_is_code(cell: Any) -> bool:
    try:
        v = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return isinstance(v, (types.FunctionType, type, functools.partial))


def _mode_text(gm: torch.fx.GraphModule, state_names: set[str]) -> tuple[list[str], dict[str, Any]]:
    """What decides a trace's behaviour beyond member state: its code, line by line, and the constants it reads."""
    consts = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) not in state_names:
            obj: Any = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part, None)
            if not isinstance(obj, nn.Module):
                consts[str(node.target)] = obj
    return gm.code.strip().splitlines(), consts


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and (a.device.type == "meta" or torch.equal(a.detach(), b.detach())))
    try:
        return bool(a == b)
    except Exception:  # an object without a plain ==: only itself is itself
        return a is b


def _mode_difference(traced: tuple[list[str], dict[str, Any]], other: tuple[list[str], dict[str, Any]]) -> str | None:
    """None when two traces are the same program, else a few words on the first difference."""
    (lines_a, consts_a), (lines_b, consts_b) = traced, other
    for a, b in zip(lines_a + ["<end>"], lines_b + ["<end>"]):
        if a != b:
            return f"`{a.strip()[:100]}` became `{b.strip()[:100]}`"
    for k in consts_a.keys() | consts_b.keys():
        if k not in consts_a or k not in consts_b or not _same_constant(consts_a[k], consts_b[k]):
            return f"the constant {k!r} differs"
    return None


_MODE_NAME = {True: "training", False: "eval"}


def mode_bound(private: nn.Module, graph: ModelGraph, plan: Plan, example: tuple | None) -> dict[bool, str]:
    """The modes (True = training) in which `private` (a copy of member 0, traced as `graph`) traces to another
    program than `graph`, each with the first difference (or why it cannot be traced in that mode)."""
    modes = [m.training for m in private.modules()]
    wanted = [mode for mode in (True, False) if any(t != mode for t in modes)]  # all modules in `mode` already: graph itself
    if not wanted or not reads_training(private, plan.tracer, plan.opened_modules):
        return {}
    state = {k for k, _ in private.named_parameters(remove_duplicate=False)} | {k for k, _ in private.named_buffers(remove_duplicate=False)}
    traced = _mode_text(graph.gm, state)
    names = [i.name for i in plan.inputs]
    bound = {}
    for mode in wanted:
        # the other mode's trace may run Python that changes attributes: on a copy, sharing the parameters and buffers
        # (a trace does not write them: fx holds proxies, export fakes)
        other = copy.deepcopy(private, {id(t): t for t in [*private.parameters(), *private.buffers()]})
        other.train(mode)
        try:
            g = retrace(other, plan.tracer, example, names, plan.opened_modules)
        except StagewiseError as e:  # e.g. a random draw only the training branch makes
            bound[mode] = f"in {_MODE_NAME[mode]} mode it cannot be traced ({str(e).splitlines()[0][:300]})"
            continue
        difference = _mode_difference(traced, _mode_text(g.gm, state))
        if difference is not None:
            bound[mode] = f"in {_MODE_NAME[mode]} mode it traces to another graph ({difference})"
    return bound


def _written_in_place(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The value `node` writes in place (`x.add_()`, `x += 1` as export records it, F.relu(x, inplace=True),
    nn.ReLU(inplace=True)(x)), or None."""
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if first is None:
        return None
    if is_inplace(node) or (node.op == "call_function" and node.kwargs.get("inplace") is True):
        return first
    if node.op == "call_module" and getattr(gm.get_submodule(str(node.target)), "inplace", False) is True:
        return first
    return None


def _shared_write_refusal(where: str, name: str) -> InputError:
    return InputError(
        f"{where} writes the shared input {name!r} in place: the member loop writes the caller's tensor once per member "
        f"(member i sees i writes before its own), which one batched call cannot repeat; clone the input in forward() "
        f"({name} = {name}.clone()) or give it per_member (planner.propose(..., input_mode='per_member'))")


def check_input_writes(private: nn.Module, graph: ModelGraph, plan: Plan, example: tuple | None) -> None:
    """InputError for a model input forward() writes in place where the batched module cannot do what the loop does.

    A shared input written in place is refused: the loop writes the caller's tensor N times, each member
    seeing the writes of the members before it. The graph shows most writes (`x.add_`, a view's `mul_`,
    an in-place module); torch.fx records `x += 1` as an out-of-place add, so `private` (a copy of member 0,
    its state and the random generators restored afterwards) also runs once on copies of `example` and an
    input whose version counter moved was written. A per_member input written where the graph does not show
    it is refused too (the batched module would leave the caller's rows unwritten); one the graph shows is fine.
    A model that cannot run on the (zero) example inputs skips the run; the graph's writes are still refused.
    """
    names = list(graph.input_names)
    shared = {n for n in names if plan.input_mode(n) is not InputMode.PER_MEMBER}
    shown = set()
    for node in graph.gm.graph.nodes:
        written = _written_in_place(graph.gm, node)
        root = alias_chain(written)[-1] if written is not None else None
        if root is not None and root.op == "placeholder":
            if root.name in shared:
                raise _shared_write_refusal(f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)})",
                                            root.name)
            shown.add(root.name)
    if example is None or not any(isinstance(x, torch.Tensor) for x in example):
        return
    state = next(iter([*private.parameters(), *private.buffers()]), None)
    device = state.device if state is not None else torch.device("cpu")
    copies = tuple(x.detach().clone().to(device) if isinstance(x, torch.Tensor) else x for x in example)
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in copies]
    snapshot = StateSnapshot.take(private)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            private(*copies)
    except Exception:  # noqa: BLE001 - a probe on zeros (a model that needs real inputs); the graph scan above stands
        return
    finally:
        snapshot.restore_if_changed(private)
    for name, x, v in zip(names, copies, versions):
        if v is None or x._version == v:
            continue
        if name in shared:
            raise _shared_write_refusal("forward()", name)
        if name not in shown:
            raise InputError(
                f"forward() writes the per_member input {name!r} in place in a way the {plan.tracer} trace does not record "
                f"(torch.fx records `{name} += ...` as an out-of-place add), so the batched module would leave the caller's "
                f"tensor unwritten where the member loop writes it; write {name} = {name} + ... (no write), or "
                f"{name}.add_(...) (a write the trace records)")


class BatchedModule(nn.Module):
    """N members run as one module, stage by stage. forward(*inputs) -> N-first outputs."""

    def __init__(self, plan: Plan, graph: ModelGraph, stacked: dict[str, torch.Tensor], device: torch.device,
                 params: dict[str, bool] | None = None, member_keys: Sequence[str] | None = None):
        """`params`: stacked names that are parameters -> requires_grad (the rest are buffers and
        per-member constants); `member_keys`: one member's state_dict keys, in order."""
        super().__init__()
        self.plan = plan
        self.n_members = plan.n_members
        self._input_names = graph.input_names
        self._modes = [plan.input_mode(n) for n in graph.input_names]
        self._out_spec = graph.out_spec
        self.__dict__["_input_guard"] = graph.input_guard  # export's input check on one member's inputs; a function, not a submodule
        output_node = next(n for n in graph.gm.graph.nodes if n.op == "output")
        self._output_args = output_node.args[0]
        # the output's structure, flattened once: per call only its leaves are looked up
        leaves, self._output_tree = tree_flatten(self._output_args)
        self._output_leaves = [(x.name, None) if isinstance(x, torch.fx.Node) else (None, x) for x in leaves]
        self._output_is_leaf = self._output_tree.is_leaf()
        # which inputs need a look before any stage runs (a per_member axis; an export trace's shapes)
        self._per_member_at = [mode is InputMode.PER_MEMBER for mode in self._modes]
        self._checks_traced = plan.tracer == "export" or graph.input_guard is not None
        stage_of = {n: s.id for s in plan.stages for n in s.nodes}
        read_outside = {}
        for node in graph.gm.graph.nodes:
            for dep in node.all_input_nodes:
                if stage_of.get(dep.name) != stage_of.get(node.name) or node.op == "output":
                    read_outside[dep.name] = True
        keys = set(stacked)
        self.programs = [StageProgram.from_graph(graph.gm, s, read_outside, keys) for s in run_order(plan, graph)]
        # not submodules: the module's parameters and state_dict are the stacked member state alone.
        # _apply and train() reach them by hand (their constants follow .to(), their mode follows .train())
        self.__dict__["stage_modules"] = [p.module.to(device) for p in self.programs]
        params = params if params is not None else {}
        self._member_keys = list(member_keys) if member_keys is not None else [k for k in stacked if not k.startswith(LIFTED_PREFIX)]
        self.stacked = state_tree(stacked, params, persistent=set(self._member_keys))
        self._stacked = {k: tree_tensor(self.stacked, k) for k in stacked}
        # a state tensor read by a stage and handed on is that tensor itself, not a copy: an in-place
        # update downstream (a running mean written by a loop stage) must land in the stacked state
        gm_nodes = {n.name: n for n in graph.gm.graph.nodes}
        self._state_outputs = [[(k, str(gm_nodes[name].target)) for k, name in enumerate(p.output_names)
                                if gm_nodes[name].op == "get_attr" and str(gm_nodes[name].target) in keys] for p in self.programs]
        self._build_runners()
        self._make_captured()
        # modes this module cannot be switched to (True = training) -> why: forward() reads self.training (see mode_bound)
        self._mode_bound: dict[bool, str] = {}
        self._traced_modes = ""  # the members' modes when built, in words
        self._mode_refused: tuple[bool, ...] = ()  # values of the training flag a call refuses (one attribute read per call)

    def set_mode_bound(self, bound: dict[bool, str], member: nn.Module) -> None:
        """Refuse the modes in `bound` (True = training; value: how the graph differs there) from now on;
        `member`: the member the graph was traced from, in the modes it was traced in."""
        modes = {m.training for m in member.modules()}
        self._mode_bound = dict(bound)
        self._traced_modes = f"{_MODE_NAME[member.training]} mode" if len(modes) == 1 else "a mix of training and eval modes"
        # a call in the root's traced mode runs the traced graph as traced, whatever train() would make of it
        self._mode_refused = tuple(mode for mode in bound if mode != member.training)

    def _mode_refusal(self, mode: bool, how: str) -> ExecutionError:
        wanted = _MODE_NAME[mode]
        to = ("to train, call .train() on the model before planner.trace and on every member before executor.build, and keep "
              "this module for evaluation" if mode else
              "to evaluate, build a separate module from members in eval mode (.eval() before planner.trace and executor.build), "
              "and keep this module for training")
        export = (" (torch.export, which traced this plan, fixes the mode of Dropout and BatchNorm layers too)"
                  if self.plan.tracer == "export" else "")
        return ExecutionError(
            f"forward() depends on self.training (or on what train()/eval() set){export}: this module was built from members in {self._traced_modes}, and "
            f"{self._mode_bound[mode]}, so {how} would run the traced graph where the member loop runs the {wanted}-mode one; {to}")

    def _mode_refused_now(self) -> ExecutionError:
        return self._mode_refusal(self.training, f"a call with the training flag set to {self.training} (without .train()/.eval())")

    def _make_captured(self) -> None:
        """The plan's whole-plan capture (plan.capture) for the state's device, or None (CPU, or capture off)."""
        backend = capture_backend(next(iter(self._stacked.values())).device) if self.plan.capture and self._stacked else None
        self.__dict__["_captured"] = CapturedPlan(self, backend=backend) if backend is not None else None

    def _build_runners(self) -> None:
        views = [{k: v[i] for k, v in self._stacked.items()} for i in range(self.n_members)]
        runners: list[Runner] = []
        for p in self.programs:
            stacked = {k: self._stacked[k] for k in p.state_names}
            member_states = [{k: v[k] for k in p.state_names} for v in views]
            runners.append(runner_for(p, self.n_members, stacked, member_states))
        self.runners = runners
        # the state read through per-member views (loop runners); batched runners read the stacked tensors
        # themselves, so a plan without loop stages watches nothing on the per-call path
        watched = {k for p, r in zip(self.programs, self.runners) if isinstance(r, LoopRunner) for k in p.state_names}
        self._storage = [(self._stacked[k], self._stacked[k].data_ptr()) for k in sorted(watched)]

    @property
    def runners(self) -> list[Runner]:
        """One runner per program, in run order. Assigning a new list (profile labels them) re-makes the steps."""
        return self.__dict__["_runners"]

    @runners.setter
    def runners(self, runners: list[Runner]) -> None:
        self.__dict__["_runners"] = runners
        # the flat program the per-call path runs: per stage (program, runner, input names, output names,
        # whether it writes in place, (output index, state key) of state handed on as itself)
        self.__dict__["_steps"] = [(p, r, tuple(p.input_names), tuple(p.output_names), p.writes_in_place, tuple(so))
                                   for p, r, so in zip(self.programs, runners, self._state_outputs)]
        # a strategy that carries no gradients (cuda_graph): calls that would record autograd are refused
        self.__dict__["_inference_only"] = any(not getattr(r, "trainable", True) for r in runners)
        self.__dict__["_grad_checks"] = self._inference_only or bool(self.__dict__.get("_shared_across"))

    def _follow_new_storage(self) -> None:
        """Rebuild the runners if a tensor a loop stage reads got new storage (`p.data = ...`, `set_`): its
        per-member views would go on reading the old one. An in-place update needs nothing."""
        for t, ptr in self._storage:
            if t.data_ptr() != ptr:
                self._build_runners()
                return

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # the stacked state tree: tied names stay one Parameter
        for m in self.stage_modules:
            m._apply(fn)
        self._stacked = {k: tree_tensor(self.stacked, k) for k in self._stacked}
        self._build_runners()
        if "_captured" in self.__dict__:  # not while nn.Module.__init__ sets things up
            self._make_captured()
        return self

    def train(self, mode: bool = True) -> "BatchedModule":
        """Training mode for every stage: dropout draws a mask per member, BatchNorm updates each member's statistics.
        ExecutionError for a mode whose graph differs from the traced one (forward() branches on self.training)."""
        if mode in self.__dict__.get("_mode_bound", ()):
            raise self._mode_refusal(mode, f".train({mode})" if mode else ".eval()")
        super().train(mode)
        for m in self.stage_modules:
            m.train(mode)
        for r in self.runners:  # loop stages call per-member shallow copies of their stage (bound_loop): the flag too
            for bound in getattr(r, "_bound", ()):
                bound.train(mode)
        return self

    def _check_trainable(self) -> None:
        """ExecutionError naming the first stage whose strategy cannot carry gradients, or the parameters members
        share (one tensor in the loop, a copy per member here)."""
        shared = [k for k in self.__dict__.get("_shared_across", ()) if self._stacked[k].requires_grad]
        if shared:
            raise ExecutionError(
                f"members share the trainable parameter(s) {shared[:3]} (one tensor held by several members): the batched "
                "module holds a copy per member, so training would update the copies apart where the member loop updates "
                "one tensor. Give each member its own copy (copy.deepcopy), or freeze it (requires_grad_(False)); "
                "inference (torch.no_grad()) is unaffected")
        for program, runner in zip(self.programs, self.runners):
            if not runner.trainable:
                strategy = program.stage.options.strategy.value
                raise ExecutionError(
                    f"stage {program.describe} runs strategy {strategy!r}, which is inference-only (no gradients); "
                    f"for training set another strategy on it (planner.set_options(plan, graph, {program.stage.id!r}, strategy='vmap')), "
                    "or call the module under torch.no_grad() / torch.inference_mode() for inference"
                )

    def named_stacked_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(member parameter name, its [N, ...] Parameter), each tied Parameter once, in member order."""
        seen, out = set(), []
        for k in self._member_keys:
            t = self._stacked.get(k)
            if isinstance(t, nn.Parameter) and id(t) not in seen:
                seen.add(id(t))
                out.append((k, t))
        return out

    def member_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """N ordinary state dicts (detached copies, same keys as one member's state_dict) that load
        into the original architecture with load_state_dict."""
        with torch.no_grad():
            return [{k: self._stacked[k][i].detach().clone() for k in self._member_keys} for i in range(self.n_members)]

    @property
    def stacked_state(self) -> dict[str, torch.Tensor]:
        """Member state stacked [N, ...] by dotted name: the module's Parameters and buffers themselves
        (shared with the runners; in-place updates persist; update parameters under torch.no_grad())."""
        return self._stacked

    def bind_inputs(self, inputs: tuple) -> dict[str, Any]:
        """Model inputs by placeholder name as boundary values (Batched for per_member, Shared otherwise); InputError if they do not fit."""
        if len(inputs) != len(self._input_names):
            raise InputError(f"the model takes {len(self._input_names)} inputs {self._input_names}, got {len(inputs)}; pass them positionally")
        env: dict[str, Any] = {}
        for name, per_member, x in zip(self._input_names, self._per_member_at, inputs):
            if per_member:
                if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != self.n_members:
                    got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise InputError(
                        f"input {name!r} is per_member, so it needs a leading member axis of size {self.n_members}; got {got}. "
                        "Stack one input per member, or plan it as 'shared'"
                    )
                env[name] = Batched(x)
            else:
                env[name] = Shared(x)
        if self._checks_traced:
            self._check_traced_shapes(inputs)
        dtype = LOW_PRECISION.get(self.plan.dtype)
        if dtype is not None:  # floating inputs enter at the plan's precision, like the stacked state (see LOW_PRECISION)
            env = {k: Batched(_cast_floating(v.tree, dtype)) if isinstance(v, Batched) else Shared(_cast_floating(v.value, dtype))
                   for k, v in env.items()}
        return env

    def _check_traced_shapes(self, inputs: tuple) -> None:
        """InputError before any stage runs if one member's inputs break what the trace assumed (planner.inputs)."""
        one = [x[0] if mode is InputMode.PER_MEMBER else x for mode, x in zip(self._modes, inputs)]
        check_call_inputs(self.plan.tracer, self.plan.inputs, one)
        guard = self.__dict__.get("_input_guard")  # export's own guard: catches relations the spec does not spell out
        if guard is not None:
            try:
                guard(*one)
            except AssertionError as e:
                what = (str(e).strip().splitlines() or ["a guard failed"])[0]
                raise InputError(f"the inputs break a condition of the plan's torch.export trace ({what}); "
                                 "pass inputs shaped like the traced ones or re-plan with example inputs of this shape") from None

    def _run_plain(self, *inputs, keep: bool = False, run: Any = None) -> tuple[Any, dict[str, Any]]:
        """Run all stages in the state's own dtype; returns (N-first outputs, boundary values by node name if `keep`).
        `run(env)`, when given, runs the stages on the bound inputs instead of the flat step list (capture's runs)."""
        if self._grad_checks and torch.is_grad_enabled() and (self.training or self._records_grad()):
            self._check_trainable()
        if self._storage:
            self._follow_new_storage()
        env = self.bind_inputs(inputs)
        # per-member floats stacked where no stage's tensors tell their precision (a stage holding no floating tensor,
        # the outputs) follow the whole call's: float64 in a float64 model, as the loop's doubles (values._float_dtype)
        numbers = set_call_number_context((self._stacked, *env.values()))  # the state and the inputs alone
        try:
            if run is None:
                self._run_steps(env, self._steps)
            else:
                run(env)
            return self._outputs(env), (env if keep else {})
        finally:
            reset_call_number_context(numbers)

    def _run_steps(self, env: dict[str, Any], steps: list) -> None:
        """Run `steps` (a slice of the flat program) on the boundary values in `env`, adding their outputs to it."""
        n = self.n_members
        for program, runner, input_names, output_names, in_place, state_out in steps:
            args = [env[name] for name in input_names]
            if in_place:
                # an in-place write must land in one [N, ...] tensor that later stages read too
                # (vmap cannot write a batched value into a shared one; a loop would write N times into it)
                args = [as_batched(a, n, runner.device_for(args)) for a in args]
                env.update(zip(input_names, args))
            try:
                outs = runner(args)
            except ExecutionError as e:
                error = self._input_error(program, e)
                if error is e:
                    raise
                raise error from e
            env.update(zip(output_names, outs))
            for k, key in state_out:
                env[output_names[k]] = Batched(self._stacked[key])

    def _outputs(self, env: dict[str, Any]) -> Any:
        """The model's outputs, N-first, from the boundary values in `env`."""
        n = self.n_members
        leaves = [n_first(env[name], n) if name is not None else x for name, x in self._output_leaves]
        result = leaves[0] if self._output_is_leaf else tree_unflatten(leaves, self._output_tree)
        if self._out_spec is not None:
            result = tree_unflatten(list(result), self._out_spec)
        return result

    def _input_error(self, program: StageProgram, e: ExecutionError) -> StagewiseError:
        """The error to raise for a stage's failure: an InputError when torch failed in a stage fed by the
        model inputs (most likely their shape or dtype), else `e` itself."""
        read = [n for n in program.input_names if n in self._input_names]
        if not read or e.__cause__ is None or isinstance(e.__cause__, StagewiseError):
            return e
        if not _INPUT_TROUBLE.search(str(e.__cause__)):  # e.g. no batching rule for a module's configuration
            return e
        return InputError(f"{e}. The stage reads model input(s) {read}; check they are shaped like example_inputs() "
                          "(per_member ones with a leading [N] axis)")

    def run_stages(self, *inputs, keep: bool = False, run: Any = None) -> tuple[Any, dict[str, Any]]:
        """Run all stages at plan.dtype; returns (N-first outputs, boundary values by node name if `keep`,
        those in the plan's dtype). Floating inputs cast in, floating outputs cast back to the caller's
        dtype (that of its first floating input; float32 when it passes none)."""
        if self.training in self._mode_refused:
            raise self._mode_refused_now()
        dtype = LOW_PRECISION.get(self.plan.dtype)
        if dtype is None:
            tf32 = self.plan.dtype == "tf32" and any(t.is_cuda for t in self._stacked.values())
            if not tf32:
                return self._run_plain(*inputs, keep=keep, run=run)
            with _TF32():
                return self._run_plain(*inputs, keep=keep, run=run)
        caller = next((x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()), torch.float32)
        try:
            out, env = self._run_plain(*inputs, keep=keep, run=run)  # bind_inputs casts the floating inputs
        except (ExecutionError, InputError) as e:  # a stage fed by the model inputs reports InputError
            if "not implemented for 'Half'" not in str(e):
                raise
            raise ExecutionError(f"{str(e).split('. Check')[0]}: this op has no float16 kernel on {next(iter(self._stacked.values())).device.type}; "
                                 "use dtype 'bfloat16' (planner.set_dtype(plan, 'bfloat16')) or run on CUDA") from e
        return _cast_floating(out, caller), env

    def forward(self, *inputs):
        """Shared inputs as one member takes them, per_member ones [N, ...]; returns N-first outputs.

        Raises InputError for the wrong number of inputs, a missing member axis, or
        inputs a stage reading them cannot take (wrong shape); ExecutionError when a
        later stage fails, for global module hooks registered since build, or for a
        training flag set by hand to a mode forward() was not traced in (see mode_bound).
        """
        if global_hooks_present():  # four dict truthiness tests; torch's own watching hooks pass below
            self._refuse_global_hooks()
        if self.training in self._mode_refused:  # the flag set by hand (train() refuses before it sets it)
            raise self._mode_refused_now()
        captured = self.__dict__["_captured"]
        if captured is not None and not self.training and not (torch.is_grad_enabled() and self._records_grad()):
            try:
                return captured(*inputs)
            except NotCapturableError as e:
                warnings.warn(f"the plan asks for whole-plan capture, but {e}; running stage by stage from now on",
                              RuntimeWarning, stacklevel=2)
                self.__dict__["_captured"] = None
        if self.plan.dtype == "float32":  # the common case, straight to the stages (run_stages casts for the others)
            return self._run_plain(*inputs)[0]
        return self.run_stages(*inputs)[0]

    def _refuse_global_hooks(self) -> None:
        """ExecutionError naming the global module hooks registered since build (see planner.graph.global_hooks)."""
        refusal = global_hooks_refusal("the batched module")
        if refusal:
            raise ExecutionError(refusal)

    def _records_grad(self) -> bool:
        return any(p.requires_grad for p in self._stacked.values())


def build(plan: Plan, members: Sequence[nn.Module], example_inputs: tuple | None = None, device: str | torch.device | None = None,
          *, check_memory: bool = True) -> BatchedModule:
    """Turn `plan` and its members into one batched module.

    Args:
        plan: a Plan (planner.propose / Plan.load) for this architecture.
        members: exactly plan.n_members modules of that architecture.
        example_inputs: one member's inputs, used only for torch.export plans from files that
            do not record the traced input shapes (older stagewise); otherwise the traced
            shapes and dtypes in plan.inputs are used and this is ignored.
        device: where to run ("cpu", "cuda", torch.device); default cpu.
        check_memory: False skips the memory estimate (planner.budget; also STAGEWISE_SKIP_MEMORY_CHECK=1).
    The module runs at plan.dtype (see LOW_PRECISION): bfloat16/float16 state cast here, once; an op
    without a float16 kernel raises ExecutionError on the first call (naming it, suggesting bfloat16).
    Returns:
        BatchedModule: forward(*inputs) takes shared inputs as-is and per_member
        inputs as [N, ...]; returns the model's outputs with tensors N-first.
    Raises:
        MemberError (count or state mismatch), PlanMismatchError (plan for another
        model: both fingerprints and the first difference; or a plan that breaks the
        invariants), TraceError (members[0] cannot be traced again with the plan's
        tracer, or an old export plan file without input shapes and no example_inputs), DeviceError,
        MemoryBudgetError (the stacked state, N x one member's, would not fit on `device`; before stacking),
        MemberError for global module hooks (torch.nn.modules.module.register_module_forward_hook, ...): the
        member loop fires them on every module call, the batched module cannot (its forward refuses them too),
        or for members that freeze different parameters (check_same_requires_grad); InputError for a model input
        forward() writes in place where the batched module cannot repeat the loop's writes (check_input_writes).
    """
    refusal = global_hooks_refusal("the batched module")
    if refusal:
        raise MemberError(refusal)
    with registration_hooks_off():  # the members went through them; the modules made here from them must not
        return _build(plan, list(members), example_inputs, device, check_memory)


def _build(plan: Plan, members: list[nn.Module], example_inputs: tuple | None, device: str | torch.device | None,
           check_memory: bool) -> BatchedModule:
    dev = resolve_device(device)
    if len(members) != plan.n_members:
        raise MemberError(
            f"the plan is for {plan.n_members} members but {len(members)} were given; "
            f"pass {plan.n_members} members or use plan.with_n_members({len(members)})"
        )
    budget.check_fits(len(members), budget.state_bytes(members[0]), dev, f"stacking the state of {len(members)} members",
                      "set chunk_size on large stages for their activations, or use another device", check_memory)
    # a private copy: the stage modules keep the traced submodules, and .to()/.double() on the
    # batched module must not move or convert the caller's member 0
    # the traced shapes, not the caller's: an export graph is specialised to them, so another shape
    # would trace another graph; the batched module then checks each call against them
    example = example_inputs_from(plan.inputs) or example_inputs
    try:
        private = copy.deepcopy(members[0])
    except Exception as e:  # a module torch cannot copy (the old nn.utils.weight_norm's derived weight, ...)
        raise MemberError(f"member 0 cannot be copied ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                          "stagewise builds from a private copy of it. Models using torch.nn.utils.weight_norm can use "
                          "torch.nn.utils.parametrizations.weight_norm instead; otherwise make the module deep-copyable") from e
    graph = retrace(private, plan.tracer, example, [i.name for i in plan.inputs], plan.opened_modules)
    if graph.fingerprint != plan.fingerprint:
        raise PlanMismatchError(
            f"the plan's fingerprint {plan.fingerprint} does not match these members' {graph.fingerprint} "
            f"({_first_difference(plan, graph)}); the plan was made for another model: re-plan with `stagewise plan`"
        )
    validate(plan, graph)
    check_same_requires_grad(members)
    check_input_writes(private, graph, plan, example)
    bound = mode_bound(private, graph, plan, example)  # before the graph is edited below (lifted constants)
    register_output_dataclasses(graph.gm)
    stacked = stack_member_state(members, dev)
    # a sweep's members differ in numbers the trace baked in: give each member its own (or refuse)
    per_member = lift_member_constants(graph, members, plan.tracer, example, [i.name for i in plan.inputs], set(stacked),
                                       opened=plan.opened_modules)
    stacked.update({k: v.to(dev) for k, v in per_member.items()})
    params = {k: p.requires_grad for k, p in members[0].named_parameters(remove_duplicate=False)}
    module = BatchedModule(plan, graph, stacked, dev, params=params, member_keys=list(members[0].state_dict()))
    module.set_mode_bound(bound, private)
    module.__dict__["_shared_across"] = shared_across_members(members)
    module.runners = module.runners  # re-make the steps and the gradient checks with it
    module.training = members[0].training  # the flag alone: each stage module keeps the mode it was traced in
    if plan.dtype in LOW_PRECISION:
        module.to(LOW_PRECISION[plan.dtype])  # once: stacked state and stage constants (see LOW_PRECISION)
    return module


def save_member_weights(module: BatchedModule, folder: str | Path) -> list[Path]:
    """Write each member's state as `folder/member_000.safetensors`, ... (one ordinary state dict per
    member, loadable with `planner.load_source(model, weights=paths)` or load_state_dict). Returns the paths."""
    from safetensors.torch import save_file  # a required dependency (pyproject); imported where used

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, state in enumerate(module.member_state_dicts()):
        path = folder / f"member_{i:03d}.safetensors"
        with temp_beside(path) as tmp:  # written whole or not at all
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        paths.append(path)
    return paths
