"""executor.build: a plan plus members becomes one batched nn.Module.

Input layout: `shared` inputs as one member would take them; `per_member`
inputs with a leading member axis [N, ...]. Output layout: N-first, i.e. every
tensor of the model's output gets a leading [N] axis (pytrees keep their shape).
"""
from __future__ import annotations


import builtins
import contextlib
import copy
import dis
import difflib
import enum
import functools
import inspect
import math
import operator
import pickle
import re
import sys
import threading
import types
from pathlib import Path
import dataclasses
import warnings
import weakref
from typing import Any, Sequence

import networkx as nx
import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import SUPPORTED_NODES, register_dataclass, tree_flatten, tree_map, tree_unflatten

from stagewise.planner import budget
from stagewise.planner.capability import alias_chain, is_inplace
from stagewise.planner.files import temp_beside
from stagewise.planner.errors import first_line as _first_line
from stagewise.planner.errors import (DeviceError, ExecutionError, InputError, MemberError, OutputFileError, PlanMismatchError,
                                      StagewiseError, TraceError)
from stagewise.planner.graph import (BUFFER_VALUE_READS, READ_BUFFERS, REAL_BUFFERS, ModelGraph, global_hooks_present,
                                      CHECKPOINTED_NORMS_UNKNOWN, global_hooks_refusal, gradients_refusal, norms_in_checkpoints,
                                      persistence_only, updating_norms,
                                      plain_fx_code, quantized_state_refusal, registration_hooks_off, retrace)
from stagewise.planner.inputs import check_call_inputs, example_inputs_from, traced_specs
from stagewise.planner.tracers import check_small_sizes, region_written_operands
from stagewise.planner.plan import InputMode, Plan, Stage, Strategy
from stagewise.planner.validate import stage_graph, validate, with_fresh_verdicts
from stagewise.planner.snapshot import PLAIN_TYPES, held_values
from stagewise.planner.source import MEMBER_SEED_BASE
from stagewise.executor.exact_numbers import read_numbers
from stagewise.executor.capture import CAPTURED_CALL, CapturedPlan, CudaGraphBackend, NotCapturableError
from stagewise.executor.constants import (_LEAKY, LIFTED_PREFIX, MEMBER_NUMBERS, MEMBER_SHAPES, _liftable, config_signature,
                                          lift_member_constants)
from stagewise.executor.precision import take_dtypes_of_a_trace_in
from stagewise.planner.trace_watch import _grad_mode_reads
from stagewise.executor.own_storage import OwnStretch, as_original, own_storage
from stagewise.executor.own_storage import write_back as own_storage_write_back
# moved out of this module; still importable from here (tests patch stack_member_state on it)
from stagewise.executor.input_writes import check_input_writes, overlapping_rows_refusal, rows_overlap
from stagewise.executor.members import (aliasing_of, member_list, check_one_device, copy_member, frozen_apart, frozen_apart_flags, written_state, gradient_hooks, shared_across_members,
                                       stack_member_state, state_device, state_tree, tensors_overlap, ties_apart, tree_tensor)
from stagewise.executor.members import member_state, mirror_layer_classes, tied_names  # noqa: F401
from stagewise.executor.modes import _MODE_NAME, mode_bound, own_train_modes, set_train_modes, train_on_copy
from stagewise.executor.optim import watch_stacked_parameters
from stagewise.executor.modes import reads_training  # noqa: F401
from stagewise.executor.stages import _region_writes, LoopRunner, Runner, StageProgram, put_back, runner_for
from stagewise.executor.values import (Batched, PerMember, Shared, as_batched, leaf_paths, n_first,
                                       reset_call_number_context, span,
                                       set_call_number_context)


# Precision (plan.dtype). Cast once, not autocast: the stacked floating state (parameters and buffers,
# BatchNorm running statistics included, like `model.to(torch.bfloat16)`) is cast once at build, floating
# inputs at the module's entry, outputs back to the caller's dtype. It is the simplest rule that is also what
# users run (bf16 weights halve memory and bandwidth; autocast would re-cast the weights on every call),
# and every op of every stage strategy (vmap, loop, wide, compile) sees one dtype, so nothing in the
# executor needs to know about it. float16 on CPU where an op has no Half kernel: ExecutionError naming the
# op and suggesting bfloat16, never a silently wrong answer. "tf32" keeps float32 and enables TF32 only
# around the module's CUDA calls; on CPU it is a no-op (computes exactly like float32).
LOW_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_GRAD_MODE_NAME = {"grad": "with gradients on", "no_grad": "with gradients off (torch.no_grad())",
                   "inference": "under torch.inference_mode()"}


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


def _cast_floating(tree: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """Every floating tensor leaf of `tree` (of dtype `only`, when given) as `dtype` (others untouched)."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype
                    and (only is None or x.dtype == only) else x, tree)


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
_LIFTED_TROUBLE = re.compile(r"doesn't match the broadcast shape|in-place|inplace", re.I)
# a failure naming a low-precision dtype: the op has no kernel for it (rfft: "Unsupported dtype BFloat16")
_LOW_PRECISION_TROUBLE = re.compile(r"dtype (BFloat16|Half)\b|not implemented for '(BFloat16|Half)'|(BFloat16|Half) is not supported")
# float32 and low-precision operands meeting in one op (an export graph's baked casts)
_MIXED_DTYPES = re.compile(r"dtype mismatch|same dtype|Expected: Float, Got|mixed dtype|expected scalar type|"
                           r"expected m1 and m2|found at least two|float != c10::(BFloat16|Half)|(BFloat16|Half) != float|"
                           r"Input type \(float\) and bias type \(c10::(BFloat16|Half)\)", re.I)
# vmap's own refusals of an op (not of its operands' shapes): a data-dependent output shape, a host read
_VMAP_REFUSED = re.compile(r"vmap: We do not support batching operators that can output dynamic shape|"
                           r"vmap: It looks like you're calling \.item\(\)|vmap: It looks like you're attempting to use a "
                           r"Tensor in some data-dependent control flow")
_INPUT_TROUBLE = re.compile(r"shape|size|dimension|dtype|Expected|expected|must match|mat1|mat2|out of range|index|"
                            r"should be the same", re.I)


# a non-tensor input's InputSpec.dtype for a Python value torch.export takes as a constant of the graph
_PYTHON_SCALARS = ("bool", "int", "float")


def _is_number(x: Any) -> bool:
    """A Python bool/int/float, or a one-element tensor standing for one (a row of a per_member [N] tensor)."""
    return isinstance(x, (bool, int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


# Python arithmetic whose result is again a number when its operands are (`-bound`, `slope * 0.5`): under vmap a
# per-member 0-d tensor, in the member loop a number, read by whatever takes it next
_NUMBER_ARITHMETIC = {operator.neg, operator.pos, operator.abs, operator.add, operator.sub, operator.mul,
                      operator.truediv, operator.floordiv, operator.mod, operator.pow}
_CLAMPS = (torch.clamp, torch.clip, "clamp", "clip")


def _takes_a_tensor(node: torch.fx.Node, position: int) -> bool:
    """Whether `node` runs under vmap with a per-member 0-d tensor at flattened argument `position`, where the member
    loop hands it a Python number: an operand of arithmetic or of a comparison (constants._liftable), torch.where's
    values, torch.lerp's weight. Not F.leaky_relu's slope (a lifted attribute gets a tensor slope by a rewrite of the
    node; an input's number does not), nor one bound of a clamp whose other bound is a Python number (aten's clamp
    takes both bounds as numbers or both as tensors)."""
    if node.op == "call_function" and node.target is torch.where:
        return position in (1, 2)
    if node.op == "call_function" and node.target is torch.lerp:
        return position == 2
    if node.target in _LEAKY or not _liftable(node, position):
        return False
    if node.target in _CLAMPS:
        bounds = [*node.args[1:3], node.kwargs.get("min"), node.kwargs.get("max")]
        return all(b is None or isinstance(b, torch.fx.Node) for b in bounds)
    return True


def number_takers(gm: torch.fx.GraphModule, sources: dict[torch.fx.Node, str]) -> dict[torch.fx.Node, set[str]]:
    """{node: the per_member numbers it takes} for the nodes of `gm` that take a per_member Python number (`sources`:
    the nodes whose value is one, by the name the messages give it) or a number made of such numbers by Python
    arithmetic, as an argument that must be a Python number (F.leaky_relu's slope, F.hardtanh's bounds, F.dropout's p,
    a slice bound, a call_module's argument): one vmap call hands the op a per-member 0-d tensor there, which it reads
    as a number (vmap refuses `.item()` and data-dependent control flow, and `wide` passes the [N] tensor itself);
    the member loop gives each member its own. Said by the graph alone, before anything runs."""
    numbers = {node: {name} for node, name in sources.items()}
    takers: dict[torch.fx.Node, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node in numbers:
            continue
        read = [x for x in node.all_input_nodes if x in numbers]
        if not read:
            continue
        names = set().union(*(numbers[x] for x in read))
        leaves = tree_flatten((node.args, node.kwargs))[0]
        hits = [k for k, x in enumerate(leaves) if isinstance(x, torch.fx.Node) and x in numbers]
        if node.op == "call_function" and node.target in _NUMBER_ARITHMETIC and all(x in numbers for x in node.all_input_nodes):
            numbers[node] = names  # a number of numbers: what takes it is looked at in turn
        elif (node.op not in ("call_function", "call_method") or not all(_takes_a_tensor(node, k) for k in hits)
              or {id(x) for x in read} - {id(leaves[k]) for k in hits}):  # inside a slice (`h[:, :n]`), kept whole by pytrees
            takers[node] = names
    return takers


def container_reads(gm: torch.fx.GraphModule, name: str) -> tuple[dict[tuple, list[torch.fx.Node]], list[tuple[tuple, torch.fx.Node]]]:
    """How forward() reads the container input `name` (a dict, list or tuple): ({key path: the nodes reading the value
    there with constant keys (getitem, dict.get), `cfg["slope"]` at ("slope",)}, [(key path, a node reading the part of
    the container there in any other way: handed on whole, a key computed in forward())]). A per_member number the
    container holds at a path is what the nodes at that path read; a node of the second kind may read any number the
    part it reads holds, and what it does with it cannot be followed."""
    placeholder = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name), None)
    exact: dict[tuple, list[torch.fx.Node]] = {}
    whole: list[tuple[tuple, torch.fx.Node]] = []
    todo = [(placeholder, ())] if placeholder is not None else []
    while todo:
        node, path = todo.pop()
        for user in node.users:
            key = None
            if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node:
                key = user.args[1]
            elif user.op == "call_method" and user.target == "get" and user.args[0] is node and len(user.args) > 1:
                key = user.args[1]
            if key is None or isinstance(key, (torch.fx.Node, slice)) or user.op == "output":
                if user.op != "output":  # handed out as it is: stacked, not read
                    whole.append((path, user))
                continue
            deeper = (*path, key)
            exact.setdefault(deeper, []).append(user)
            todo.append((user, deeper))
    return exact, whole


def number_loops(takers: dict[torch.fx.Node, set[str]], stage_of: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """{stage id: what in it takes a per_member number, in words ("'slope' to leaky_relu")} for number_takers' `takers`."""
    out: dict[str, list[str]] = {}
    for node, names in takers.items():
        sid = stage_of.get(node.name)
        if sid is not None:
            op = str(node.target) if node.op in ("call_method", "call_module") else getattr(node.target, "__name__", str(node.target))
            out.setdefault(sid, []).append(f"{', '.join(repr(n) for n in sorted(names))} to {op}")
    return {sid: tuple(dict.fromkeys(words)) for sid, words in out.items()}


def _elements_shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold an element of memory in common. Their first-to-last byte ranges (tensors_overlap) first;
    where those overlap, the elements themselves (those of `a` marked in a mask over the range, those of `b` looked up
    in it): interleaved views share a byte range and no element (y[:, 0] and y[:, 1] of one [B, 2] tensor). Elements
    of two sizes (views of one memory as two dtypes) are taken to share one wherever the ranges overlap."""
    if not tensors_overlap(a, b):
        return False
    if a.element_size() != b.element_size():
        return True
    start = min(a.storage_offset(), b.storage_offset())
    end = max(a.storage_offset() + span(a), b.storage_offset() + span(b))
    marks = torch.zeros(end - start, dtype=torch.bool, device=a.device)
    marks.as_strided(a.shape, a.stride(), a.storage_offset() - start).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), b.storage_offset() - start).any())


def _as_given(x: torch.Tensor) -> bool | int | float:
    """The Python number a one-element tensor holds, as the caller wrote it: the shortest decimal that gives the same
    value in the tensor's dtype (torch.tensor([0.01]) holds 0.009999999776 in float32; it was given as 0.01)."""
    value = x.item()
    if not x.is_floating_point() or x.dtype == torch.float64 or value != value or value in (float("inf"), float("-inf")):
        return value
    for digits in range(1, 18):
        short = float(f"{value:.{digits}g}")
        if torch.tensor(short, dtype=x.dtype).item() == value:
            return short
    return value


def _caller_level() -> int:
    """The stacklevel of a warning issued by the caller of this function that names the first frame outside stagewise and
    torch.nn's Module (the user's call of the batched module, however many of its own frames lie between)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE) or _MODULE_FILE in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE = str(Path(__file__).resolve().parent.parent)  # the stagewise package's folder
_MODULE_FILE = str(Path("torch", "nn", "modules"))


def _path_name(name: str, path: tuple) -> str:
    return name + "".join(f"[{k!r}]" for k in path)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` -> cpu; refuses CUDA on a machine without it, with the fix."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' was requested but this machine has no CUDA device; use device='cpu'")
    return dev


def _check_small_sizes(plan: Plan, graph: ModelGraph, member: nn.Module, example: tuple | None) -> None:
    """PlanMismatchError where a torch.export plan accepts a dynamic dim below 2 that the members' graph does not hold
    for. torch.export traces such dims for sizes of at least 2, and planning checked sizes 1 and 0 against the model
    (planner.tracers.check_small_sizes); the fingerprint does not hold the bounds, so a plan file edited to a smaller
    `min` would run the >= 2 branch where forward() takes another (`if x.shape[0] == 1:`). Checked again here, on
    the zeros of the traced shapes and fresh random floats, only for plans that accept such sizes."""
    loose = [(spec.name, d) for spec in plan.inputs for d in spec.dynamic_dims if d.min < 2 and d.symbol]
    if plan.tracer != "export" or not loose or example is None:
        return
    check_small_sizes(member, graph.gm, example, drawn_only=True)
    found = traced_specs(graph.gm, "export", {})
    for name, d in loose:
        ours = next((x for x in found[name].dynamic_dims if x.dim == d.dim), None) if name in found else None
        if ours is not None and ours.min > d.min:
            raise PlanMismatchError(
                f"the plan accepts size {d.min} for dim {d.dim} of input {name!r}, where these members' graph holds for "
                f"sizes of at least {ours.min} only: torch.export traced that dim from 2 up, and at size "
                f"{ours.min - 1} forward() answers otherwise than the graph (a branch on the size). The plan file says "
                f"min {d.min}, planning found {ours.min}: set it back, or re-plan (`stagewise plan`)")


def _first_difference(plan: Plan, graph: ModelGraph, member: nn.Module | None = None, example: tuple | None = None) -> str:
    """Where the members' graph first parts from the plan's, in words: the inputs' names, then the first node (in
    graph order) one has and the other lacks, with what the other has there, then whether the members' training mode
    is all that differs (traced again in the other mode: `member`, with `example`). The plan keeps node names alone
    (and a hash of the rest): a difference in a node's op, a module's class or a parameter's shape is said as such."""
    planned_inputs = [i.name for i in plan.inputs]
    if planned_inputs != list(graph.input_names):
        return f"the plan's model takes inputs {planned_inputs}, these members' forward() takes {list(graph.input_names)}"
    planned = [n for s in plan.stages for n in s.nodes]
    have = list(graph.compute_nodes)
    if set(planned) != set(have):
        ops = difflib.SequenceMatcher(a=planned, b=have, autojunk=False).get_opcodes()
        _, i1, i2, j1, j2 = next(op for op in ops if op[0] != "equal")
        after = f"after {have[j1 - 1]!r}, " if j1 else "at the start, "
        if i2 > i1 and j2 > j1:
            what = f"the plan has {_names(planned[i1:i2])} where these members' graph has {_names(have[j1:j2])}"
        elif i2 > i1:
            what = f"the plan has {_names(planned[i1:i2])}, which these members' graph lacks"
        else:
            what = f"these members' graph has {_names(have[j1:j2])}, which the plan lacks"
        lost = [n for n in planned[i1:i2] if n not in have] or [n for n in planned if n not in have]
        extra = [n for n in have[j1:j2] if n not in planned] or [n for n in have if n not in planned]
        first = (f"first plan node the model lacks: {lost[0]!r}" if lost and (i2 > i1 or not extra) else
                 f"first model node the plan lacks: {extra[0]!r}")
        return f"{first}, in graph order: {after}{what}{_mode_difference(plan, member, example)}"
    why = _mode_difference(plan, member, example)
    default = torch.get_default_dtype()
    if default is not torch.float32 and not why:
        # tensors forward() makes (`torch.arange(8) / 7.0`) take the default dtype, which the fingerprint holds
        why = (f"; the default dtype is {str(default).removeprefix('torch.')} now (torch.set_default_dtype): "
               "tensors forward() makes take it, so a plan traced under float32 differs there: build under the "
               "default dtype the plan was traced with")
    return ("same node names in the same order: parameter shapes, dtypes or module types differ, or a node's op or "
            "target (a layer's width, bias=False, nn.GELU for nn.ReLU); the plan records a hash of these, not which, so "
            "compare with the model the plan was made from" + why)


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _mode_difference(plan: Plan, member: nn.Module | None, example: tuple | None) -> str:
    """"; it matches them in eval mode: ..." where member 0 traced in the other training mode gives the plan's
    fingerprint (a plan made in train mode, members built in eval), else ""."""
    if member is None:
        return ""
    mode = not member.training
    try:
        other = retrace(train_on_copy(member, mode), plan.tracer, example, [i.name for i in plan.inputs], plan.opened_modules)
    except StagewiseError:
        return ""
    if other.fingerprint != plan.fingerprint:
        return ""
    return (f"; these members in {_MODE_NAME[mode]} mode match the plan: it was made from the model in {_MODE_NAME[mode]} "
            f"mode, and these members are in {_MODE_NAME[not mode]} mode. Call .{'train()' if mode else 'eval()'} on them "
            "before executor.build, or re-plan from the model in the mode you will run")


def register_output_dataclasses(gm: torch.fx.GraphModule) -> None:
    """Make dataclasses built in forward() (output dataclasses) pytree nodes, like tuples and dicts.

    Otherwise a dataclass is one opaque leaf: its tensors get no member axis and
    vmap's internal batched tensors leak out of the stage inside it.
    """
    for node in gm.graph.nodes:
        cls = node.target
        if node.op == "call_function" and isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls not in SUPPORTED_NODES:
            register_dataclass(cls)


def _grad_modes_refused(reads: set[str], member: nn.Module, plan: Plan, example: tuple | None,
                        traced: str, grad: bool) -> dict[str, str]:
    """{"grad" / "no_grad" / "inference": why a call in that mode is refused} for a forward() that read the grad
    mode while traced (`reads`, _grad_mode_reads) with gradients on or off (`grad`) to the graph whose fingerprint is
    `traced`. Traced again with those reads answering as a call in the other mode would (torch itself left in the
    traced mode, so its own no_grad regions trace alike), a different graph means the batched module would run the
    traced branch where the member loop takes the other."""
    if not reads:
        return {}
    refused = {}
    fix = (f"forward() reads {' and '.join(sorted(reads))}, and this module's plan was traced "
           f"{'with' if grad else 'without'} gradients, whose branch the trace keeps")

    def differs(answers: dict[str, bool], inputs: tuple | None = example) -> bool:
        with torch.set_grad_enabled(grad), _grad_mode_reads(member, force=answers):
            try:
                return retrace(member, plan.tracer, inputs, [i.name for i in plan.inputs], plan.opened_modules).fingerprint != traced
            except StagewiseError:
                return True

    if differs({"torch.is_grad_enabled": not grad, "torch.is_inference_mode_enabled": False}):
        mode = "no_grad" if grad else "grad"
        refused[mode] = (f"{fix}; with gradients {'off' if grad else 'on'} it traces to another graph, which the member "
                         f"loop would run. For such calls, plan a second module {'inside torch.no_grad()' if grad else 'with gradients on'} "
                         "(planner.trace and planner.propose in that mode; executor.build follows the plan), or branch "
                         "outside forward()")
    floating = [i for i, x in enumerate(example or ()) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if grad and "a tensor's requires_grad" in reads and floating:
        # the example inputs record no gradient: a call with one that does (input gradients, a saliency map) may take
        # the other side of `if x.requires_grad:`
        asking = tuple(x.detach().clone().requires_grad_(True) if i in floating else x for i, x in enumerate(example))
        if differs({}, asking):
            refused["input_grad"] = (
                f"forward() reads a tensor's requires_grad, and traced with inputs that record gradients it traces to "
                "another graph, which the member loop would run; the plan's trace takes inputs that do not (its example "
                "inputs). Pass inputs that do not require grad, or branch outside forward()")
    if reads & {"torch.is_inference_mode_enabled", "a tensor's is_inference()"} and differs({"torch.is_grad_enabled": False, "torch.is_inference_mode_enabled": True}):
        refused["inference"] = (f"{fix}; under torch.inference_mode() it traces to another graph, which the member loop "
                                "would run and no plan can hold (tracing sees inference mode as torch.no_grad()). Call it "
                                "under torch.no_grad() instead, or branch outside forward()")
    return refused


def _numbers_by_mode(members: list[nn.Module], private: nn.Module, plan: Plan, example: tuple | None,
                     bound: dict[bool, str], lifted: dict[str, torch.Tensor], state_keys: set[str]) -> dict[bool, str]:
    """{mode: why} for each mode a switch into (train()/eval()) would run the members' numbers as the trace's mode
    lifted them while forward() uses others in that mode (`self.t if self.training else 1.0` in a sweep whose member 0
    holds 1.0: member 0 traces alike in both modes, the others do not). Only where forward() reads self.training and
    members hold other values than member 0 anywhere; the members' copies share their tensors."""
    first = (config_signature(members[0]), held_values(members[0]))
    if all((config_signature(m), held_values(m)) == first for m in members[1:]) or not reads_training(
            private, plan.tracer, plan.opened_modules):
        return {}
    names, out = [i.name for i in plan.inputs], {}
    for mode in (True, False):
        if mode in bound or all(m.training == mode for m in private.modules()):
            continue
        copies = [train_on_copy(m, mode) for m in members]  # the members' requires_grad flags put back
        try:
            graph = retrace(copies[0], plan.tracer, example, names, plan.opened_modules)
            theirs = lift_member_constants(graph, copies, plan.tracer, example, names, state_keys, opened=plan.opened_modules)
        except StagewiseError as e:
            out[mode] = f"in {_MODE_NAME[mode]} mode the members cannot be told apart as in the traced mode ({str(e).splitlines()[0][:300]})"
            continue
        differ = sorted(k for k in theirs.keys() | lifted.keys() if k not in theirs or k not in lifted
                        or theirs[k].shape != lifted[k].shape or not torch.equal(theirs[k], lifted[k].to(theirs[k].device)))
        if differ:
            out[mode] = (f"the members differ in numbers that forward() uses otherwise in {_MODE_NAME[mode]} mode "
                         f"({', '.join(k.removeprefix(LIFTED_PREFIX) for k in differ[:3])}: a value per member only one "
                         "mode reads, such as `self.t if self.training else 1.0`), and the batched module holds the "
                         "traced mode's per member")
    return out


def _members_trace_alike(members: list[nn.Module], private: nn.Module, plan: Plan, example: tuple | None,
                         graph: ModelGraph) -> str:
    """MemberError where forward() reads buffer values into Python (`graph`'s BUFFER_VALUE_READS: a branch on
    `int(self.act_id)`, a NaN guard) and a member's own buffers trace to another graph than member 0's: the batched
    module would run member 0's branch for it. Members whose buffers equal one already traced are not traced again.
    Returns member 0's plain trace's code (what the per-call watch compares with, _ValueReadWatch)."""
    names = [i.name for i in plan.inputs]
    real = graph.gm.meta.get(REAL_BUFFERS, ())
    first = plain_fx_code(private, names, plan.opened_modules, real)  # (`graph` itself is not compared: probes shaped it)
    buffers = []
    for member in members:
        theirs = dict(member.named_buffers(remove_duplicate=False))
        buffers.append({k: theirs.get(k) for k in _buffer_names(private)})
    why = _buffers_trace_alike(buffers, private, names, plan.opened_modules, first, real, start=1)
    if why:
        i, how = why
        raise MemberError(_value_read_refusal(graph.gm.meta[BUFFER_VALUE_READS], f"member {i} with its own buffers {how} "
                                              "than member 0, whose graph the plan holds", i))
    return first


def _buffer_names(model: nn.Module) -> list[str]:
    return [f"{path}.{k}" if path else k for path, mod in model.named_modules() for k, b in mod._buffers.items()
            if b is not None]


def _value_read_refusal(reads: Sequence[str], what: str, i: int) -> str:
    return (f"forward() reads buffer values into Python ({', '.join(reads[:3])}), and {what} (a branch on a buffer's "
            f"value, `if int(self.act_id) == 2:`, or a number made of it, `x / float(self.t)`): the batched module would "
            f"run member 0's branch (or number) for member {i}. Keep the choice on tensors (torch.where(self.act_id == 2, "
            "torch.tanh(h), torch.relu(h))); for a number, write `self.t.item()` (recorded per member: its stage runs as "
            "the member loop) or keep it a tensor (x / self.t); or batch the members that take each branch apart (one "
            "plan and build per group)")


def _buffers_trace_alike(buffers: list[dict[str, torch.Tensor | None]], model: nn.Module, names: list[str],
                         opened: Sequence[str], first: str, real: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(member, how it differs) for the first member from `start` on whose buffers (`buffers[i]`: dotted name ->
    tensor) make `model`'s plain fx trace (`real`: REAL_BUFFERS) another program than `first`; None when all trace to
    it. Each member's
    buffers (copies) are swapped into `model` in turn and put back; buffers equal to ones already traced are not
    traced again, nor are members missing one (a member's buffer is a buffer of the plan: checked elsewhere)."""
    owners = [(path, mod, k) for path, mod in model.named_modules() for k, b in mod._buffers.items() if b is not None]
    keys = [f"{path}.{k}" if path else k for path, _, k in owners]
    seen: list[list[torch.Tensor]] = [[mod._buffers[k] for _, mod, k in owners]] if start else []
    for i in range(start, len(buffers)):
        values = [buffers[i].get(k) for k in keys]
        if any(v is None for v in values) or any(
                all(v.shape == w.shape and torch.equal(v.detach().cpu(), w.detach().cpu()) for v, w in zip(values, done))
                for done in seen):
            continue
        seen.append(values)
        kept = [mod._buffers[k] for _, mod, k in owners]
        try:
            for (_, mod, k), v, old in zip(owners, values, kept):
                mod._buffers[k] = v.detach().clone().to(device=old.device, dtype=old.dtype)
            try:
                same, why = plain_fx_code(model, names, opened, real) == first, "traces to another graph"
            except Exception as e:  # noqa: BLE001 - its values break the trace (a size read from a buffer)
                same, why = False, f"does not trace ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        finally:
            for (_, mod, k), old in zip(owners, kept):
                mod._buffers[k] = old
        if not same:
            return i, why
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, on the same device in the same dtype (after .to() the values are compared again)."""
    return a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


_READ_ALWAYS = 65536  # elements: a buffer this small is compared by value on every call (about 10 us at most)


class _ValueReadWatch:
    """Buffers a plan's forward() reads the values of (BUFFER_VALUE_READS) that forward() itself never writes, as
    the build checked them: a later change of one (ens.load_member_state_dict, a PBT exploit step copying a member's
    state, a write into stacked_state) is traced again before the call runs, since the graph holds the branch the
    build-time values take. Costs, for such plans only, a torch.equal per small buffer per call and a look at the
    version counters of the large ones (see _marks), and one copy of those buffers."""

    def __init__(self, private: nn.Module, plan: Plan, stacked: dict[str, torch.Tensor], always: set[str],
                 in_training: dict[str, str], reads: Sequence[str], first: str, real: Sequence[str],
                 read: Sequence[str] | None):
        """`first`: member 0's plain trace's code, as _members_trace_alike traced it; `real`: REAL_BUFFERS; `read`:
        READ_BUFFERS (None where not known); `always`, `in_training`: the buffers forward() writes (written_state)."""
        self.model = copy.deepcopy(private)  # its own: the stage modules share `private`'s submodules
        self.names = [i.name for i in plan.inputs]
        self.opened = tuple(plan.opened_modules)
        self.real = tuple(real)
        self.reads = tuple(reads)
        # a buffer read into Python that a layer updates in training (BatchNorm's num_batches_tracked): watched (a
        # loaded state changes it), and a call with that layer in training refused (_refuse_trained_reads)
        self.trained = {k: owner for k, owner in in_training.items() if read is None or k in read}
        self.keys = [k for k in _buffer_names(self.model) if k in stacked and k not in always
                     and (k not in in_training or k in self.trained)]
        self.seen = [stacked[k].detach().clone() for k in self.keys]
        self.marks = self._marks(stacked)
        own = dict(self.model.named_buffers(remove_duplicate=False))
        cast = False
        with torch.no_grad():
            for k in self.keys:  # member 0's values as the plan holds them (a bfloat16 plan rounds a float's value)
                if k in own and own[k].dtype != stacked[k].dtype:
                    own[k].copy_(stacked[k][0].to(own[k].dtype))
                    cast = True
        self.first = plain_fx_code(self.model, self.names, self.opened, self.real) if cast else first

    def refuse_trained_reads(self, module: "BatchedModule") -> None:
        """ExecutionError for a call with a layer in training whose buffer forward() reads the value of (a warm-up
        branch on BatchNorm's num_batches_tracked): the layer writes it each call, so the loop's members take the
        other branch once it crosses, which the graph, holding the branch member 0's value took at build, never
        does."""
        trained = [k for k, owner in self.trained.items() if module._stage_layer_mode(owner)]
        if trained:
            raise ExecutionError(
                f"forward() turns the values of {', '.join(trained[:3])} into Python (a branch or a number made of "
                f"{'them' if len(trained) > 1 else 'it'}), which {'their layers update' if len(trained) > 1 else 'its layer updates'} "
                "on every call in training mode: the graph keeps the branch member 0's value took at build, and the "
                "loop's members would take the other once the value crosses (a warm-up switch after k steps). Call it "
                "in eval mode, or keep the choice on tensors (torch.where(...)), or count the steps outside the model "
                "and pass the switch in as an input")

    def _marks(self, stacked: dict[str, torch.Tensor]) -> list[tuple]:
        """What tells, without reading values, that a large buffer is as last checked: the tensor, its memory and its
        version counter (an in-place write, a row's too, bumps its base's; a replacement is another tensor). Buffers
        of up to _READ_ALWAYS elements (the flags and ids forward() branches on) are compared by value every call,
        since a write through `.data` bumps no version counter; a larger one is read only when its marks change."""
        return [(id(t), t.data_ptr(), t._version) for t in (stacked[k] for k in self.keys) if t.numel() > _READ_ALWAYS]

    def check(self, stacked: dict[str, torch.Tensor]) -> None:
        marks = self._marks(stacked)
        small = [(stacked[k], s) for k, s in zip(self.keys, self.seen) if s.numel() <= _READ_ALWAYS]
        if marks == self.marks and all(_same(a, b) for a, b in small):
            return
        now = [stacked[k] for k in self.keys]
        if all(_same(a, b) for a, b in zip(now, self.seen)):
            self.marks = marks
            return
        n = now[0].shape[0]
        buffers = [{k: t[i] for k, t in zip(self.keys, now)} for i in range(n)]
        changed = [i for i in range(n) if not all(_same(t[i], s[i]) for t, s in zip(now, self.seen))]
        fixed = dict(self.model.named_buffers(remove_duplicate=False))
        why = _buffers_trace_alike([{**fixed, **buffers[i]} for i in changed], self.model, self.names, self.opened,
                                   self.first, self.real)
        if why:
            i = changed[why[0]]
            raise ExecutionError(_value_read_refusal(
                self.reads, f"member {i}'s buffers changed since build (ens.load_member_state_dict, a write into "
                f"stacked_state), with which it {why[1]} than the graph the plan holds", i)
                + "; the batched module's state is as it was before this call")
        self.seen = [t.detach().clone() for t in now]
        self.marks = marks


def _fast_path_modules_traced_through(member: nn.Module, plan: Plan) -> str:
    """The classes of torch's attention modules with an inference fast path (nn.MultiheadAttention,
    nn.TransformerEncoderLayer, nn.TransformerEncoder; batch_first, which that path needs) that the plan's graph holds
    as traced ops rather than as leaves (a torch.export trace, or an opened module); "" for none."""
    kinds = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)
    opened = tuple(plan.opened_modules)

    def batch_first(m: nn.Module) -> bool:  # torch's fast paths take batch_first calls only
        attn = m if isinstance(m, nn.MultiheadAttention) else (
            m.self_attn if isinstance(m, nn.TransformerEncoderLayer) else
            getattr(m.layers[0], "self_attn", None) if len(m.layers) else None)
        return bool(getattr(attn, "batch_first", False))

    # whatever mode the members are in now: a module built in training mode may be switched to eval (.eval())
    found = {type(m).__name__ for path, m in member.named_modules() if isinstance(m, kinds) and batch_first(m)
             and (plan.tracer == "export" or any(path == o or path.startswith(o + ".") for o in opened))}
    return ", ".join(f"nn.{k}" for k in sorted(found))


def _has_buffer(module: nn.Module, target: str) -> bool:
    try:
        module.get_buffer(target)
    except AttributeError:
        return False
    return True


def run_order(plan: Plan, graph: ModelGraph) -> list[Stage]:
    """The plan's stages in dependency order (a hand-edited plan file may list them in any order)."""
    index = {s.id: i for i, s in enumerate(plan.stages)}
    return [plan.stage(sid) for sid in nx.lexicographical_topological_sort(stage_graph(plan, graph), key=index.__getitem__)]


def _state_itself(node: torch.fx.Node, keys: set[str]) -> str | None:
    """The state key whose tensor `node`'s value is (a get_attr of it, or in-place ops on one), else None."""
    while node.op != "get_attr":
        if not is_inplace(node):
            return None
        node = node.args[0]
    return str(node.target) if str(node.target) in keys else None


_MISSING_GLOBAL = object()
_SETTING_ITEMS = 64  # a module-level container of more items is not watched (a vocabulary, not a setting)


_HELPERS_FOLLOWED = 256  # functions looked into for one model at most (a deep library of the model's own is cut there)


def _globals_read(model: nn.Module) -> tuple:
    """(module name, dotted name, a copy of its value) for each module-level setting the forward() of one of the
    model's own classes reads (a number, bool, str, or a small dict / list / tuple of them: `CFG["temperature"]`,
    or such an attribute of a module-level object: `args.temperature` of an argparse Namespace, a dataclass config,
    `settings.TEMPERATURE` of a module), as it is now: read in forward() itself, in the lambdas and inner functions it
    makes, and in the functions of the model's own it calls (a module-level helper `act(h)`, a method
    `self.scale(h)`), followed through theirs. Only global reads count (an attribute or method named like a global,
    `x.size(0)` beside a module-level `size`, is not one). torch's own modules are not looked into."""
    out, seen = [], set()
    todo: list[tuple[types.CodeType, str, type | None]] = []
    for cls in {type(m) for m in model.modules()}:
        fn = getattr(cls.forward, "__func__", cls.forward)
        if getattr(fn, "__code__", None) is not None and _own_module(getattr(fn, "__module__", None)):
            todo.append((fn.__code__, fn.__module__, cls))
    followed: set[types.CodeType] = set()
    while todo and len(followed) < _HELPERS_FOLLOWED:
        code, where, cls = todo.pop()
        if code in followed:
            continue
        followed.add(code)
        space = vars(sys.modules[where])
        todo += [(k, where, cls) for k in code.co_consts if isinstance(k, types.CodeType)]  # lambdas, inner functions
        for name, value in _global_reads(code, space):
            if (where, name) not in seen and _is_setting(value):
                seen.add((where, name))
                out.append((where, name, copy.deepcopy(value)))
            fn = getattr(value, "__func__", value)  # a module-level function of the model's own it may call
            if isinstance(fn, types.FunctionType) and _own_module(fn.__module__):
                todo.append((fn.__code__, fn.__module__, None))
        if cls is not None:  # a method of the class it may call (`self.scale(h)`), a class attribute (`self.TEMP`)
            for name in code.co_names:
                fn = getattr(cls, name, None)
                fn = getattr(fn, "__func__", fn)
                if isinstance(fn, types.FunctionType) and _own_module(fn.__module__):
                    todo.append((fn.__code__, fn.__module__, cls))
                owner = next((c for c in cls.__mro__ if name in vars(c)), None)
                if owner is not None and _is_setting(vars(owner)[name]) and "<locals>" not in owner.__qualname__ \
                        and _own_module(owner.__module__):
                    key = (owner.__module__, f"{owner.__qualname__}.{name}")
                    if key not in seen:
                        seen.add(key)
                        out.append((*key, copy.deepcopy(vars(owner)[name])))
    return tuple(out)


_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_LOADS_ATTR = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _global_reads(code: types.CodeType, space: dict) -> list[tuple[str, Any]]:
    """(dotted name, value) for each global `code` reads: `CFG`, and for an object that holds settings (a module, a
    Namespace, a dataclass instance: not a class, function, tensor or torch's), the attributes read off it,
    `args.temperature` (as far as the first value that is a setting)."""
    out = []
    instructions = list(dis.get_instructions(code))
    for k, ins in enumerate(instructions):
        if ins.opname not in _LOADS_GLOBAL:
            continue
        name, value = ins.argval, space.get(ins.argval, _MISSING_GLOBAL)
        if value is _MISSING_GLOBAL:
            continue  # a builtin (len, range)
        out.append((name, value))
        after = instructions[k + 1] if k + 1 < len(instructions) else None
        if (k and instructions[k - 1].opname in _LOADS_GLOBAL and instructions[k - 1].argval == "getattr"
                and after is not None and after.opname == "LOAD_CONST" and isinstance(after.argval, str)
                and _holds_settings(value) and _is_setting(getattr(value, after.argval, _MISSING_GLOBAL))):
            out.append((f"{name}.{after.argval}", getattr(value, after.argval)))  # getattr(args, "temperature")
            continue
        j = k + 1
        while j < len(instructions) and instructions[j].opname in _LOADS_ATTR and _holds_settings(value):
            name = f"{name}.{instructions[j].argval}"
            value = getattr(value, instructions[j].argval, _MISSING_GLOBAL)
            if _is_setting(value):
                out.append((name, value))
                break
            j += 1
    return out


def _holds_settings(obj: Any) -> bool:
    """`obj` may hold settings as attributes: a module or a plain object, not torch's, a class, a function or a tensor."""
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor, nn.Module)) \
            or obj is _MISSING_GLOBAL or _is_setting(obj):
        return False
    owner = obj.__name__ if isinstance(obj, types.ModuleType) else type(obj).__module__
    return not (owner or "").startswith(("torch", "stagewise", "builtins", "numpy"))


def _resolved(where: str, name: str) -> Any:
    """The value of the dotted global `name` of module `where` now (_MISSING_GLOBAL where any part is gone)."""
    value: Any = sys.modules.get(where)
    for part in name.split("."):
        value = getattr(value, part, _MISSING_GLOBAL)
        if value is _MISSING_GLOBAL:
            break
    return value


def _own_module(where: str | None) -> bool:
    """`where` names a loaded module of the model's own, not torch's or stagewise's."""
    return bool(where) and not where.startswith(("torch", "stagewise")) and where in sys.modules


def _load_hooks(member: nn.Module) -> list[str]:
    """The member's modules (by path, "" for the root) that load their state with code of their own: a
    load_state_dict pre / post hook, or a class of the model's own overriding _load_from_state_dict or
    set_extra_state."""
    out = []
    for path, m in member.named_modules():
        cls = type(m)
        own = not (cls.__module__ or "").startswith("torch") and any(
            name in vars(c) for c in cls.__mro__ if not (c.__module__ or "").startswith("torch")
            for name in ("_load_from_state_dict", "set_extra_state"))
        hooks = [*m._load_state_dict_pre_hooks.values(), *m._load_state_dict_post_hooks.values()]
        users = [h for h in hooks if not (getattr(getattr(h, "hook", h), "__module__", None) or "").startswith("torch")]
        if users or own:
            out.append(path)
    return out


def load_aliased_refusal(module: "BatchedModule", how: str, state_dict: dict, prefix: str, under: str) -> str:
    """Why torch's load_state_dict of the rows of every member (`state_dict`, keys `prefix` + the member's name, for
    the node at the path `under`) would give the members other values than their own loads: rows of a tensor several
    members hold that differ (the loop's one tensor cannot hold two values), or one member's two names on one memory
    stacked apart, loaded with other values (or one of them not loaded: a buffer viewing the weight keeps the old
    rows), or ""."""
    aliased = module.__dict__.get("_load_aliased") or {}
    start = under + "." if under else ""
    # torch hands every node the whole dict: the root's prefix finds a name outside this node's subtree too (given
    # where the load began at the root, absent where it began here)
    root = prefix[:len(prefix) - len(start)] if start and prefix.endswith(start) else prefix
    for name, (why, other) in aliased.items():
        if not name.startswith(start) or root + name not in state_dict:
            continue
        value = state_dict[root + name]
        if isinstance(other, list):  # the members holding it as one tensor: their rows must agree
            rows = [value[i] for i in other if isinstance(value, torch.Tensor) and value.dim() and i < value.shape[0]]
            if all(torch.equal(r, rows[0]) for r in rows[1:]):
                continue
            return f"{how}: {why}, and the rows loaded for members {other} differ. Load the same values into those rows"
        twin = root + other
        if twin is not None and twin in state_dict and isinstance(value, torch.Tensor) and (
                value.shape != state_dict[twin].shape or torch.equal(value, state_dict[twin])):
            continue  # both given: alike, or one a part of the other (a buffer viewing rows of the weight)
        return (f"{how}: {why}; loaded {'with other values under the two names' if twin in state_dict else 'under one name only'}, "
                f"`{other}` would keep its old rows. Load into the members themselves (member.load_state_dict(...)) and "
                "build again, or give each name its own tensor in the model")
    return ""


def load_hooks_refusal(module: "BatchedModule", how: str, under: str = "") -> str:
    """Why loading state into the stacked rows by `how` would skip the members' own load code (a module at or under
    the path `under` loading its state with code of its own: _load_hooks), or ""."""
    hooked = [p for p in module.__dict__.get("_load_hooks") or () if not under or p == under or p.startswith(under + ".")]
    if not hooked:
        return ""
    who = f"module {hooked[0]!r}" if hooked[0] else "model"
    return (f"{how}: the members' {who} loads its state with code of its own (a load_state_dict hook, a "
            "_load_from_state_dict or set_extra_state of its class: a derived buffer refreshed after loading), which "
            "copying the tensors into the stacked rows would skip. Load the state into the members themselves "
            "(member.load_state_dict(...)) and build again, or copy what the hook computes by hand "
            "(ens.stacked_state[name][i].copy_(...))")


def _branching_modules(member: nn.Module, stage_modules: Sequence[nn.Module]) -> dict[str, tuple[str, bool]]:
    """{path: (class name, the mode it was traced in)} of the member's modules whose forward() reads self.training and that no stage calls as a
    leaf: traced through (a module of the model's own branching on it), or a torch.export graph's ops (BatchNorm,
    Dropout with their mode fixed): the graph kept one mode. A leaf layer a stage calls reads its flag at run time."""
    called = {str(n.target) for m in stage_modules for n in m.graph.nodes if n.op == "call_module"}
    out = {}
    for path, module in member.named_modules():
        cls = type(module)
        fn = getattr(cls.forward, "__func__", cls.forward)
        code = getattr(fn, "__code__", None)
        inside_a_call = any(path == c or path.startswith(c + ".") for c in called)  # a leaf run at call time
        if path and not inside_a_call and code is not None and "training" in code.co_names:
            out[path] = (cls.__name__, module.training)
    return out


def _learnable_attributes(member: nn.Module, gm: torch.fx.GraphModule, stacked: dict[str, torch.Tensor]) -> list[str]:
    """Names of the plain tensor attributes (not parameters or buffers) of `member` that require grad as leaves, a
    learnable scalar trained by passing it to the optimizer by hand, and that the graph reads (as a get_attr, or
    lifted into the stacked state)."""
    read = set(stacked) | {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    state = {k for k, _ in member.named_parameters(remove_duplicate=False)} | {k for k, _ in member.named_buffers()}
    modules = {k for k, _ in member.named_modules()}  # (a submodule handed to a torch.fx.wrap helper: no tensor)
    constants = any(t not in state and t not in modules for t in read)  # tensors that are no state (constants, lifted)
    registered = {id(p) for p in member.parameters()}  # (an RNN's _flat_weights list holds its own parameters)
    def learnable(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf and id(v) not in registered
    out = []
    for path, module in member.named_modules():
        for k, v in vars(module).items():
            name = f"{path}.{k}" if path else k
            if learnable(v) and not isinstance(v, nn.Parameter) and name in read:
                out.append(name)
            elif constants and isinstance(v, (list, tuple, dict)) and k not in ("_parameters", "_buffers", "_modules"):
                # an nn.Parameter in a plain list or dict (not a ParameterList / ParameterDict): not registered, so
                # no state of the member's, and the graph reads it as a constant
                items = v.items() if isinstance(v, dict) else enumerate(v)
                out += [f"{name}[{key!r}]" for key, item in items if learnable(item)]
    return out


def _is_setting(value: Any) -> bool:
    """A number, bool or str, or a dict / list / tuple of them, nested (a YAML config's `cfg["model"]["temperature"]`),
    of _SETTING_ITEMS values at most in all."""
    return _setting_items(value, 4) is not None


def _setting_items(value: Any, depth: int) -> int | None:
    """How many plain values `value` holds as a setting, or None where it is none (or holds too many)."""
    if isinstance(value, (bool, int, float, str)) and not isinstance(value, enum.Enum):
        return 1
    if depth == 0 or not isinstance(value, (dict, list, tuple)) or len(value) > _SETTING_ITEMS:
        return None
    if isinstance(value, dict) and not all(isinstance(k, (str, int)) for k in value):
        return None
    total = 0
    for v in (value.values() if isinstance(value, dict) else value):
        n = _setting_items(v, depth - 1)
        if n is None:
            return None
        total += n
        if total > _SETTING_ITEMS:
            return None
    return total


def _configs_held(members: Sequence[nn.Module]) -> tuple:
    """(the object, where it is held, {field: a copy of its value}) for each configuration object the members' modules
    hold as an attribute (a Hugging Face PretrainedConfig every layer shares as `self.config`, a dataclass, an
    argparse Namespace, an object of a plain class of the script's, `self.hp = HParams()`, or a dict, `self.cfg =
    {"scale": 2.0}`): forward() reads its fields on every call (`self.config.pad_token_id`, `self.cfg["scale"]`), the
    traced graph holds the values they had; the script usually keeps the same object (`cfg`) and may change it after
    build. Watched: the fields (a dict's string keys) holding plain values (numbers, strings, and small containers of
    them) whose names the code of the model's own classes reads (an `args.epoch` a training loop moves and no model
    code reads is not one), and that no method of theirs but __init__ writes (a count forward() keeps in a dict, which
    the member loop moves and the batched module does not)."""
    import argparse  # noqa: PLC0415
    import dataclasses  # noqa: PLC0415

    read, written = _names_used_by_classes(members[0]) if members else (frozenset(), frozenset())
    seen: dict[int, Any] = {}
    for m in members:
        for path, mod in m.named_modules():
            for k, v in vars(mod).items():
                if id(v) in seen or isinstance(v, (nn.Module, torch.Tensor, type)) or k.startswith("__") \
                        or k in _MODULE_INTERNAL_NAMES:
                    continue
                if type(v) is dict:
                    fields = {f: copy.deepcopy(x) for f, x in v.items()
                              if isinstance(f, str) and f in read and f not in written and _plain_setting(x)}
                elif (dataclasses.is_dataclass(v) or isinstance(v, (argparse.Namespace, types.SimpleNamespace))
                        or any(c.__name__.endswith("Config") for c in type(v).__mro__) or _plain_class(type(v))) \
                        and hasattr(v, "__dict__"):
                    fields = {f: copy.deepcopy(x) for f, x in vars(v).items()
                              if f in read and f not in written and _plain_setting(x)}
                else:
                    continue
                if fields:
                    seen[id(v)] = (v, f"{path}.{k}" if path else k, fields)
    return tuple(seen.values())


_MODULE_INTERNAL_NAMES = frozenset(vars(nn.Module()))  # (_parameters, _buffers, the hook tables, ...)


def _plain_class(cls: type) -> bool:
    """A class of the script's own that may hold settings (`class HParams:`): not a library's, and not a function,
    method, module, exception or partial."""
    if (cls.__module__ or "").startswith(_LIBRARY_MODULES):
        return False
    return not issubclass(cls, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
                                BaseException, functools.partial))


_LIBRARY_MODULES = ("torch", "builtins", "numpy", "typing", "collections", "functools", "logging", "transformers",
                    "safetensors", "networkx", "stagewise", "_thread", "_io", "_collections", "_operator", "_abc")


def _plain_setting(value: Any, depth: int = 0) -> bool:
    """A number, string, bool, None or enum, or a small tuple / list / dict of them (compared with ==)."""
    if isinstance(value, PLAIN_TYPES):
        return True
    if depth < 3 and isinstance(value, (tuple, list)) and len(value) <= _SETTING_ITEMS:
        return all(_plain_setting(x, depth + 1) for x in value)
    if depth < 3 and isinstance(value, dict) and len(value) <= _SETTING_ITEMS:
        return all(isinstance(k, str) and _plain_setting(x, depth + 1) for k, x in value.items())
    return False


def _names_used_by_classes(member: nn.Module) -> tuple[frozenset, frozenset]:
    """(read, written): every name the code of the member's module classes (not torch's) reads, its attribute names
    and string constants (a dict key, `self.cfg["scale"]`), in their functions and what decorates them (a wrapper's
    own code, and the function it wraps), nested functions included; and the attribute names and constant dict keys
    their forward() writes (`self.stats["calls"] += 1`: a count the member loop moves on each call). A method the
    script calls between steps (`set_epoch`) writes what the watch is for, and is not counted."""
    names: set[str] = set()
    written: set[str] = set()
    seen_code: set[int] = set()

    def code_names(code: types.CodeType, writes: bool) -> None:
        if id(code) in seen_code:
            return
        seen_code.add(id(code))
        names.update(code.co_names)
        names.update(c for c in code.co_consts if isinstance(c, str))
        if writes:
            recent: list[Any] = []
            previous = ""
            for ins in dis.get_instructions(code):
                if ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
                    written.add(ins.argval)
                elif ins.opname in ("STORE_SUBSCR", "DELETE_SUBSCR"):
                    written.update(c for c in recent if isinstance(c, str))
                if ins.opname in ("LOAD_CONST", "LOAD_SMALL_INT"):
                    recent = [*recent[-3:], ins.argval]
                elif ins.opname == "BINARY_SUBSCR" and not previous.startswith(("COPY", "DUP_TOP")) and recent:
                    recent = recent[:-1]  # a key read (`y[:, 0] = self.cfg["fill"]`), not the one written to; an
                    # augmented write (`d["k"] += 1`) copies its container and key first
                elif ins.opname.startswith("STORE") or ins.opname in ("POP_TOP", "RETURN_VALUE"):
                    recent = []  # a statement ended: the next write's key comes after
                previous = ins.opname
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                code_names(const, writes)

    for cls in {c for m in member.modules() for c in type(m).__mro__}:
        if (cls.__module__ or "").startswith(("torch", "builtins")):
            continue
        for attr, f in vars(cls).items():
            if attr in ("extra_repr", "__repr__", "__str__", "__init__"):  # (what builds or prints the module: not a
                continue  # read of a call; a field read there alone, a layer width, changes nothing after build)
            f = getattr(f, "fget", None) or getattr(f, "__func__", f)
            for _ in range(8):  # down a decorator chain (functools.wraps keeps __wrapped__)
                code = getattr(f, "__code__", None)
                if code is not None:
                    code_names(code, attr == "forward")
                f = getattr(f, "__wrapped__", None)
                if f is None:
                    break
    return frozenset(names), frozenset(written)


def _check_number_input(name: str, x: Any, kind: str, traced: Any, guarded: bool = False) -> None:
    """InputError where a Python number input comes as another type than traced (a bool, int or float for another, a
    0-d tensor for a number: forward() may branch on which, `isinstance(s, torch.Tensor)`, and the graph holds the
    branch taken), or, where the trace took its value as a constant (torch.export), a float of another sign of zero or
    NaN-ness than that value (`math.copysign`; torch.export's guard compares with ==, for which -0.0 == 0.0)."""
    if type(x).__name__ != kind and not (kind == "float" and type(x) is int):  # (an int where a float was: as Python)
        got = f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise InputError(f"input {name!r} was traced as a Python {kind}, got {got}: forward() may take another path "
                         f"for a {type(x).__name__} (a branch on its type), and the plan holds the one it took for a "
                         f"{kind}; pass a {kind} (for one per member, plan the input as per_member), or re-plan with a "
                         f"{type(x).__name__} in the example inputs")
    if not guarded and traced is not None and _is_number(x) and x != traced and not (x != x and traced != traced):
        # (torch.export's guard refuses it, naming the fix; a module loaded by torch.load has none)
        raise InputError(f"input {name!r} is {x!r}, the plan's torch.export trace took it as the constant {traced!r}: "
                         "pass that value, plan the input as per_member, or re-plan with this one")
    if kind == "float" and isinstance(traced, float) and isinstance(x, float) and (
            math.isnan(x) != math.isnan(traced) or math.copysign(1.0, x) != math.copysign(1.0, traced)):
        raise InputError(f"input {name!r} is {x!r}, the plan's torch.export trace took it as the constant {traced!r} "
                         "(another sign of zero, or NaN): pass that value, or re-plan with this one")


def _same_setting(now: Any, was: Any) -> bool:
    if type(now) is not type(was):
        return False
    if isinstance(was, float):
        return now == was or (now != now and was != was)
    return now == was


def _short(value: Any) -> str:
    text = "missing" if value is _MISSING_GLOBAL else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _numbers_n_first(value: Any, n: int) -> Any:
    """A number forward() returns per member (one read from tensors) as an [N] tensor, also where every member's is
    the same: bools as bool, whole numbers as int64, floats as float64 (the loop's doubles)."""
    if isinstance(value, PerMember) and value.values and all(isinstance(v, (bool, int, float)) for v in value.values):
        floats = any(isinstance(v, float) for v in value.values)
        return torch.tensor(value.values, dtype=torch.float64 if floats else None)  # (where n_first puts numbers)
    return n_first(value, n, float_dtype=torch.float64)


def _own_rows(value: Any, n: int) -> Any:
    """An output with one row of memory per member: a value no member changes (a constant made in forward(), a
    function of shared inputs alone) comes out of vmap expanded over the member axis (stride 0), and an in-place
    edit of one member's output would reach every member's (the loop gives each member its own tensor)."""
    if isinstance(value, torch.Tensor):
        # (a sparse output has no strides, and vmap gives it its own values per member)
        return value.contiguous() if n > 1 and value.layout is torch.strided and value.dim() and value.stride(0) == 0 else value
    if isinstance(value, (tuple, list, dict)):
        return tree_map(lambda t: _own_rows(t, n) if isinstance(t, torch.Tensor) else t, value)
    return value


# torch.func.vmap does not apply a caller's autocast: the batched module's stages compute in the state's dtype
AUTOCAST_WARNING = (
    "the batched module is called under torch.autocast, which torch.func.vmap does not apply: its vmap stages compute in "
    "the state's dtype (its loop and wide stages do apply the autocast), so its outputs may come back in the state's "
    "dtype, depending on the stages' strategies (float32 where the member loop's would be bfloat16/float16; the values "
    "agree within that precision). For low-precision compute, set the plan's dtype instead "
    "(planner.set_dtype(plan, 'bfloat16')) and call the module outside autocast")

_MADE_FROM_STATE = ("_runners", "_steps", "_inference_only", "_grad_checks", "_storage", "_views_made", "_captured",
                    "_call_lock")
# shared by a deepcopy (pytree specs, export's guard function, the members' configuration objects it watches)
_IMMUTABLE = ("_output_tree", "_out_spec", "_input_guard", "_configs_held")


def _refuse_unloadable_graphs(state: dict) -> None:
    """OutputFileError where a stage graph of a torch.export plan would pickle but not unpickle: a GraphModule
    unpickles by tracing its code again with torch.fx, which cannot pass a traced size inside a list argument of an
    aten op (a GRU's h0 made as `aten.zeros([1, batch, h])`). torch.load would fail later, often in another process
    with the module gone; this says so at the save, with the checkpoints that load anywhere."""
    for k, gm in enumerate(state.get("stage_modules") or ()):
        try:
            pickle.loads(pickle.dumps(gm))
        except Exception as e:  # fx's re-trace raises RuntimeError, TypeError, ...
            stage = state["programs"][k].stage.id if len(state.get("programs") or ()) > k else str(k)
            raise OutputFileError(
                f"this batched module cannot be pickled whole (torch.save(ens) / pickle): the graph of stage {stage} "
                f"(a torch.export trace) would not load again ({type(e).__name__}: {_first_line(e)[:160]}). Save its "
                "state instead: torch.save(ens.state_dict(), path) and, to load, executor.build(plan, members) then "
                "ens.load_state_dict(torch.load(path)); or executor.save_member_weights(ens, folder)") from None


_STACKED_BY = torch.utils.weak.WeakIdKeyDictionary()  # member parameter -> [(batched module, its member)] (weak)


def _warn_stacked_elsewhere(module: "BatchedModule", members: Sequence[nn.Module]) -> None:
    """Warn where a learnable member parameter was stacked by another live batched module built from other models (a
    layer the members' generator and discriminator share, a GAN's label embedding, built as two modules): each
    batched module trains its own copy, where the member loop trains one tensor; then remember this module's."""
    elsewhere = []
    for i, m in enumerate(members):
        for name, p in m.named_parameters():
            if not p.requires_grad:
                continue
            live = [(mod, owner) for mod, owner in _STACKED_BY.get(p, ()) if mod() is not None and owner() is not None]
            other = next((owner() for mod, owner in live if mod() is not module and owner() is not m), None)
            if other is not None:
                elsewhere.append((i, name, type(other).__name__))
            _STACKED_BY[p] = [*live, (weakref.ref(module), weakref.ref(m))]
    if elsewhere:
        import gc  # noqa: PLC0415 - a module deleted but in a reference cycle is still alive until the collector runs
        gc.collect()
        elsewhere = [(i, name, other) for i, name, other in elsewhere
                     if any(mod() is not None and mod() is not module and owner() is not members[i]
                            for mod, owner in _STACKED_BY.get(members[i].get_parameter(name), ()))]
    if elsewhere:
        i, name, other = elsewhere[0]
        warnings.warn(
            f"member {i}'s parameter {name!r} is also a parameter of {other} members an earlier batched module stacked "
            f"(a layer the two models share{f', and {len(elsewhere) - 1} more' if len(elsewhere) > 1 else ''}): each "
            "batched module holds its own copy, so training one leaves the other's as it was, where the member loop "
            "trains one tensor. Put both models in one wrapper module and build one batched module from it (the "
            "shared layer is then one stacked tensor), or copy the trained rows across after each step",
            UserWarning, stacklevel=3)


def _checkpointed_norm(members: Sequence[nn.Module], path: str, graph: ModelGraph, output_leaves: list,
                       stacked: dict[str, torch.Tensor], again: bool, region: tuple[str, ...] = ()) -> tuple:
    """(path, each member's momentum, whether it counts batches, the output leaves computed from it, the state and
    the inputs it is computed from, whether it is called more than once) for a layer updating running statistics that
    the members run inside a checkpointed region (BatchedModule._run_recomputing_norms). A BatchNorm counts its
    batches (momentum None: their cumulative average); an InstanceNorm counts none, and momentum None updates
    nothing. Torch recomputes the region when backward runs a node of it: after the gradient of an output computed
    from the layer (the leaves: positions in the flattened outputs; None where the layer's nodes are not found), on
    the way to a gradient the layer's own state or what comes before it records (a frozen region, and a backward
    asked for later parameters alone, recompute nothing)."""
    counts = isinstance(members[0].get_submodule(path), nn.modules.batchnorm._BatchNorm)
    momenta = tuple(m.get_submodule(path).momentum for m in members)

    paths = {path, *region}  # the layer and the other modules its region runs (torch recomputes the whole region)

    def in_layer(n: torch.fx.Node) -> bool:  # fx: the layers' calls; torch.export: the ops recorded inside them
        if n.op == "call_module":
            return str(n.target) in paths
        stack = (n.meta.get("nn_module_stack") or {}).values() if n.op == "call_function" else ()
        return any(isinstance(v, tuple) and str(v[0]).removeprefix("L['self'].") in paths for v in stack)
    mine = [n.name for n in graph.gm.graph.nodes if in_layer(n)]
    after = set(mine).union(*(nx.descendants(graph.dag, n) for n in mine if n in graph.dag)) if mine else None
    leaves = None if after is None else tuple(i for i, (name, _) in enumerate(output_leaves) if name in after)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    before = set(mine).union(*(nx.ancestors(graph.dag, n) for n in mine if n in graph.dag))
    state, inputs = {k for k in stacked if any(k.startswith(f"{p}.") for p in paths)}, set()
    for name in before:
        n = nodes.get(name)
        if n is None:
            continue
        if n.op == "call_module":
            state |= {k for k in stacked if k.startswith(f"{n.target}.")}
        elif n.op == "get_attr" and str(n.target) in stacked:
            state.add(str(n.target))
        elif n.op == "placeholder":
            inputs.add(n.name)
    if not mine:  # (not found: every state and input)
        state, inputs = set(stacked), set(graph.input_names)
    return (path, momenta if counts else tuple(0.0 if m is None else m for m in momenta), counts, leaves,
            tuple(sorted(state)), tuple(sorted(inputs)), again)


class _StateByName(dict):
    """BatchedModule.stacked_state: the stacked tensors by name, written in place; putting another tensor under a name
    (`ens.stacked_state["fc.weight"] = w`) would leave the stages and the optimizer on the old one, and is refused."""

    def _refused(self, *args, **kwargs):
        raise TypeError("ens.stacked_state holds the tensors the stages run: write into them in place (under "
                        "torch.no_grad(): `ens.stacked_state[name].copy_(new)`, or ens.load_member_state_dict / "
                        "ens.load_state_dict) instead of putting another tensor under a name")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = __ior__ = _refused


_RECOMPUTED: dict[int, list] = {}  # backward pass -> [[term, reached its region]] in the order backward met them


def _reached_output(term: list, _grads: Any) -> None:
    """Backward came through an output computed from a checkpointed norm layer (BatchedModule._run_recomputing_norms):
    noted in the order backward meets the calls' outputs (the order eager torch recomputes their regions), applied at
    the end of this backward where it also reached what the layer's statistics are computed from."""
    task = torch._C._current_graph_task_id()
    if task not in _RECOMPUTED:
        _RECOMPUTED[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_update_again, task))
    _RECOMPUTED[task].append([term, False])


def _reached_region(term: list, _grads: Any) -> None:
    for entry in _RECOMPUTED.get(torch._C._current_graph_task_id(), ()):
        if entry[0] is term:
            entry[1] = True


def _update_again(task: int) -> None:
    """The second statistics update eager torch makes when backward recomputes a checkpointed region, for each call
    this backward ran through (see BatchedModule._run_recomputing_norms), on the statistics as they are now (another
    call may have updated them), in the order torch recomputes them."""
    with torch.no_grad():
        for term, reached in _RECOMPUTED.pop(task, ()):
            if not reached:
                continue
            momentum, cumulative, mean, var, count, updated, batch = term[0]
            # through .data: the autograd graph saved the statistics (a BatchNorm's backward takes them, and reads
            # them only in eval), and a version bump would fail a later backward through the graph
            mean, var = mean.data, var.data
            if count is not None:  # (an InstanceNorm counts no batches)
                count.data.add_(updated.to(count.dtype))
            rows = updated.unsqueeze(-1)
            f = 1.0 / count.to(mean.dtype).clamp(min=1).unsqueeze(-1) if count is not None else mean.new_ones(())
            for stat, part in zip((mean, var), batch):
                again = torch.where(cumulative, (1 - f) * stat + f * part, (1 - momentum) * stat + part)
                stat.copy_(torch.where(rows, again, stat))


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
        # the output's structure, flattened once: per call only its leaves are looked up (the nodes themselves are
        # not kept: an export graph's do not pickle); fx's immutable_list/dict as list/dict, what the model returns
        leaves, self._output_tree = tree_flatten(_plain_containers(output_node.args[0]))
        self._output_leaves = [(x.name, None) if isinstance(x, torch.fx.Node) else (None, x) for x in leaves]
        self._output_is_leaf = self._output_tree.is_leaf()
        # which inputs need a look before any stage runs (a per_member axis; an export trace's shapes)
        self._per_member_at = [mode is InputMode.PER_MEMBER for mode in self._modes]  # a traced None is shared (InputSpec)
        self._traced_tensors = frozenset(i.name for i in plan.inputs if i.shape is not None)  # inputs traced as tensors
        self._traced_none = frozenset(i.name for i in plan.inputs if i.dtype == "NoneType")  # inputs traced as None
        # shared inputs traced as a Python bool / int / float: {name: (type name, the traced value or None)}
        self._traced_numbers_typed = {i.name: (i.dtype, i.value) for i in plan.inputs if i.shape is None
                                      and i.dtype in ("bool", "int", "float") and i.mode is InputMode.SHARED}
        self._traced_numbers = frozenset(i.name for i in plan.inputs if i.shape is None and i.dtype in _PYTHON_SCALARS
                                         and plan.input_mode(i.name) is InputMode.PER_MEMBER)  # per_member Python numbers
        self.__dict__["_shapes"] = {k: t.shape for k, t in stacked.items()}  # [N, *member shape] of every stacked tensor
        self._checks_traced = plan.tracer == "export" or graph.input_guard is not None
        stage_of = {n: s.id for s in plan.stages for n in s.nodes}
        read_outside = {}
        for node in graph.gm.graph.nodes:
            for dep in node.all_input_nodes:
                if stage_of.get(dep.name) != stage_of.get(node.name) or node.op == "output":
                    read_outside[dep.name] = True
        keys = set(stacked)
        # Python numbers read from tensors, and per_member number inputs: their arithmetic runs in double
        numbers = read_numbers(graph.gm, [n for n in graph.input_names if n in self._traced_numbers])
        # returned numbers read from tensors: an [N] tensor always, also where every member's happens to be equal (a
        # count, a flag: a plain Python value on some calls and a tensor on others before)
        self.__dict__["_number_outputs"] = frozenset(name for name, _ in self._output_leaves if name in numbers)
        self.programs = _unchunk_views_written_later(_mark_views_written_later(
            [StageProgram.from_graph(graph.gm, s, read_outside, keys, numbers) for s in run_order(plan, graph)], graph.gm,
            stage_of),
            graph.gm, stage_of)
        # not submodules: the module's parameters and state_dict are the stacked member state alone.
        # _apply and train() reach them by hand (their constants follow .to(), their mode follows .train())
        self.__dict__["stage_modules"] = [p.module.to(device) for p in self.programs]
        params = params if params is not None else {}
        self._member_keys = list(member_keys) if member_keys is not None else [k for k in stacked if not k.startswith(LIFTED_PREFIX)]
        self.stacked = state_tree(stacked, params, persistent=set(self._member_keys))
        self.stacked.__dict__["_modes"][0] = self  # train() / eval() on a node of the tree reach the layers (_layer_mode)
        self.__dict__["_state_replaced"] = self.stacked.changed  # [True] once a tensor of the tree is replaced
        self._stacked = {k: tree_tensor(self.stacked, k) for k in stacked}
        # a state tensor read by a stage and handed on is that tensor itself, not a copy: an in-place
        # update downstream (a running mean written by a loop stage) must land in the stacked state
        # (key None: the result of an in-place op on state, `self.mem.copy_(...)`, which a later stage may view and write:
        # a loop stage's rows of it are handed on as the one tensor they are rows of, not stacked into a copy)
        gm_nodes = {n.name: n for n in graph.gm.graph.nodes}
        self._state_outputs = [[(k, str(gm_nodes[name].target) if gm_nodes[name].op == "get_attr" else None)
                                for k, name in enumerate(p.output_names)
                                if _state_itself(gm_nodes[name], keys) is not None] for p in self.programs]
        self._find_number_loops(graph, stage_of)
        self._build_runners()
        self._make_captured()
        watch_stacked_parameters(self)  # torch optimizers that would mix the members are refused at their first step
        # modes this module cannot be switched to (True = training) -> why: forward() reads self.training (see mode_bound)
        self._mode_bound: dict[bool, str] = {}
        self._traced_modes = ""  # the members' modes when built, in words
        self._mode_refused: tuple[bool, ...] = ()  # values of the training flag a call refuses (one attribute read per call)

    def _find_number_loops(self, graph: ModelGraph, stage_of: dict[str, str]) -> None:
        """The stages that run as the member loop whatever their strategy, because an op in them takes a per_member
        Python number where it must be a number (number_takers): `_number_loops` {stage id: what takes which number},
        read by _build_runners. For a per_member container input (a dict of settings), which of its values are
        numbers is known at the call (bind_inputs): `_container_loops` {input: ({key path: such stages if a number
        sits there}, [(key path, stage id, words) for parts of the container read otherwise])}."""
        batched = {s.id for s in self.plan.stages if s.options.strategy is not Strategy.LOOP}  # a loop already: nothing to do

        def loops(takers: dict) -> dict[str, tuple[str, ...]]:
            return {sid: words for sid, words in number_loops(takers, stage_of).items() if sid in batched}

        per_member = [spec for spec in self.plan.inputs if self.plan.input_mode(spec.name) is InputMode.PER_MEMBER]
        placeholders = {n.name: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
        sources = {placeholders[spec.name]: spec.name for spec in per_member if spec.shape is None
                   and spec.dtype in _PYTHON_SCALARS and spec.name in placeholders}
        # a number the members hold differently (`self.k`), lifted per member where an op takes it as a size or a
        # slice bound (constants._member_number): read like a per_member number input
        attributes = graph.gm.meta.get(MEMBER_NUMBERS) or {}
        sources.update({n: attributes[str(n.target)] for n in graph.gm.graph.nodes
                        if n.op == "get_attr" and str(n.target) in attributes})
        self.__dict__["_number_loops"] = loops(number_takers(graph.gm, sources)) if sources else {}
        self._refuse_member_shapes(graph, stage_of, attributes)
        containers = {}
        for spec in per_member:
            if spec.shape is not None or spec.dtype in (*_PYTHON_SCALARS, "NoneType", "str") or spec.name not in placeholders:
                continue
            exact, whole = container_reads(graph.gm, spec.name)
            by_path = {path: loops(number_takers(graph.gm, {node: _path_name(spec.name, path) for node in nodes}))
                       for path, nodes in exact.items()}
            others = [(path, sid, words) for path, node in whole
                      for sid, words in loops({node: {_path_name(spec.name, path) + "[...]"}}).items()]
            if any(by_path.values()) or others:
                containers[spec.name] = ({p: v for p, v in by_path.items() if v}, others)
        self.__dict__["_container_loops"] = containers
        self.__dict__["_number_loops_unsaid"] = set(self._number_loops)  # warned about at the first call

    def _refuse_member_shapes(self, graph: ModelGraph, stage_of: dict[str, str], attributes: dict[str, str]) -> None:
        """MemberError where numbers the members hold differently (`self.k` in `h[:, :self.k]`), each member's own in
        the member loop, give the members' values of a node read outside its stage (or returned) other shapes: the
        loop's results cannot be stacked N-first there. The shapes are build's run of each member's graph on the
        example inputs (constants.member_shapes); without them the call names them (_run_plain)."""
        shapes = graph.gm.meta.get(MEMBER_SHAPES) or {}
        if not shapes:
            return
        takers = number_loops(number_takers(graph.gm, {n: attributes[str(n.target)] for n in graph.gm.graph.nodes
                                                       if n.op == "get_attr" and str(n.target) in attributes}), stage_of)
        # a value handed from one stage running as the member loop to another stays one tensor per member (PerMember);
        # one handed to a batched stage, or returned, is stacked
        looped = {s.id for s in self.plan.stages if s.options.strategy is Strategy.LOOP} | set(self._number_loops)
        for node in graph.gm.graph.nodes:
            column = shapes.get(node.name)
            sid = stage_of.get(node.name)
            stacked_by = [u for u in node.users if u.op == "output" or (stage_of.get(u.name) != sid
                                                                        and stage_of.get(u.name) not in looped)]
            if column is None or not stacked_by:
                continue
            differing = [i for i, s in enumerate(column) if s != column[0]]
            shown = ", ".join(f"member {i}: {', '.join(str(list(s)) for s in column[i]) or 'no tensor'}"
                              for i in [0, *differing[:2]])
            numbers = "; ".join(dict.fromkeys(  # (one number lifted at several nodes is said once)
                f"the number there, from {label}: " + ", ".join(f"member {i}: {v}" for i, v in enumerate(self._stacked[target].tolist())
                                              if i == 0 or i in differing[:2])
                for target, label in attributes.items() if target in self._stacked))
            # every batched stage reading a value whose shapes differ (after one is made a loop, its outputs are per
            # member too): excluding them all at once, not the first alone, which led to the same error one stage on
            readers = sorted({stage_of.get(u.name) for n in graph.gm.graph.nodes
                              if (c := shapes.get(n.name)) is not None and any(x != c[0] for x in c)
                              for u in n.users if u.op != "output" and stage_of.get(u.name) != stage_of.get(n.name)
                              and stage_of.get(u.name) not in looped} - {None})
            excluding = "; ".join(f"plan = planner.exclude(plan, graph, {r!r})" for r in readers)
            read = "as an output" if stacked_by[0].op == "output" else f"by stage {stage_of.get(stacked_by[0].name)}, a batched one"
            raise MemberError(
                f"the members' values of node {node.name!r} (stage {sid}, read {read}) differ in shape ({shown}): the "
                f"members differ in a number forward() takes as a size, a dim or a slice bound ({numbers}; "
                f"{'; '.join(takers.get(sid, ())) or 'taken in an earlier stage'}), so each member's result has its own "
                "shape, and the members' results cannot be stacked N-first. Pad them to one size in forward() "
                "(F.pad(h[:, :k], (0, size - k))), " + (
                    "" if stacked_by[0].op == "output" else
                    f"run the stage{'s' if len(readers) > 1 else ''} reading such values as the member loop too "
                    f"({excluding}), ") + "or plan the members that differ here separately")

    @property
    def number_loops(self) -> dict[str, tuple[str, ...]]:
        """{stage id: which per_member numbers go to which op, in words}: the stages that run as the member loop whatever
        their strategy, because an op in them takes a per_member Python number (see _find_number_loops)."""
        return dict(self.__dict__.get("_number_loops") or {})

    def _follow_container_numbers(self, name: str, x: Any) -> None:
        """Run as the member loop the stages that take a number the per_member container input `name` holds now
        (an [N] tensor of it: one number per member) where an op must get a Python number (see _find_number_loops)."""
        by_path, others = self.__dict__["_container_loops"][name]
        numbers = [path for path, leaf in zip(leaf_paths(x), tree_flatten(x)[0])
                   if isinstance(leaf, torch.Tensor) and leaf.dim() == 1]
        found: dict[str, tuple[str, ...]] = {}
        for path in numbers:
            for sid, words in by_path.get(path, {}).items():
                found[sid] = found.get(sid, ()) + words
            for prefix, sid, words in others:
                if len(path) > len(prefix) and path[:len(prefix)] == prefix:  # (at the prefix itself: by_path's)
                    found[sid] = found.get(sid, ()) + words
        new = {sid: words for sid, words in found.items() if sid not in self._number_loops}
        if new:
            self.__dict__["_number_loops"] = {**self._number_loops, **new}
            self._number_loops_unsaid.update(new)
            self._build_runners()

    def _say_number_loops(self) -> None:
        """Warn once per stage that runs as the member loop for a per_member number (_find_number_loops)."""
        for program in self.programs:
            sid = program.stage.id
            if sid not in self._number_loops_unsaid:
                continue
            warnings.warn(
                f"stage {program.describe} hands the per_member number(s) {'; '.join(self._number_loops[sid])}, where the "
                "op takes a Python number, not a tensor (F.leaky_relu's negative_slope, F.hardtanh's bounds, F.dropout's "
                "p, a slice bound, a size, ...), which one batched call cannot give each member: it runs as the member "
                f"loop. Say so in the plan: planner.exclude(plan, graph, {sid!r}); or give every member one number there "
                "(one shared input; one value of a self. attribute), or write the op with tensors "
                "(torch.where(h > 0, h, h * slope)), which batch", stacklevel=_caller_level())
        self._number_loops_unsaid.clear()

    def set_mode_bound(self, bound: dict[bool, str], member: nn.Module) -> None:
        """Refuse the modes in `bound` (True = training; value: how the graph differs there) from now on;
        `member`: the member the graph was traced from, in the modes it was traced in."""
        modes = {m.training for m in member.modules()}
        self._mode_bound = dict(bound)
        self._traced_modes = f"{_MODE_NAME[member.training]} mode" if len(modes) == 1 else "a mix of training and eval modes"
        # a call in the root's traced mode runs the traced graph as traced, whatever train() would make of it
        self._mode_refused = tuple(mode for mode in bound if mode != member.training)

    def _mode_refusal(self, mode: bool, how: str) -> ExecutionError:
        state = self.__dict__.get("_training_state_refused")
        if mode and state:  # not the graph: state a layer updates in training that stacking parts (members.Aliasing)
            return ExecutionError(f"{how} is refused: {state}; evaluation (.eval()) is unaffected")
        wanted = _MODE_NAME[mode]
        to = ("to train, call .train() on the model before planner.trace and on every member before executor.build, and keep "
              "this module for evaluation; each module holds its own copy of the weights: load the trained ones into "
              "the other before using it (other.load_state_dict(this_module.state_dict()))" if mode else
              "to evaluate, build a separate module from members in eval mode (.eval() before planner.trace and executor.build), "
              "and keep this module for training; that module holds its own copy of the weights: load this one's into it "
              "before evaluating (ens_eval.load_state_dict(ens_train.state_dict()))")
        export = (" (torch.export, which traced this plan, fixes the mode of Dropout and BatchNorm layers too)"
                  if self.plan.tracer == "export" else "")
        return ExecutionError(
            f"forward() depends on self.training (or on what train()/eval() set){export}: this module was built from members in {self._traced_modes}, and "
            f"{self._mode_bound[mode]}, so {how} would run the traced graph where the member loop runs the {wanted}-mode one; {to}")

    def _check_grad_mode(self, inputs: tuple) -> None:
        """ExecutionError for a call in a grad mode whose branch of forward() the trace did not keep (_grad_modes_refused)."""
        refused = self.__dict__["_grad_mode_refused"]
        if "input_grad" in refused and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            # whatever the grad mode: a leaf keeps its flag under torch.no_grad() (an adversarial input in a PGD loop)
            raise ExecutionError(f"a call with an input that requires grad is refused: {refused['input_grad']}")
        mode = ("inference" if torch.is_inference_mode_enabled() and "inference" in refused else
                "grad" if torch.is_grad_enabled() else "no_grad")
        if mode in refused:
            raise ExecutionError(f"a call {_GRAD_MODE_NAME[mode]} is refused: {refused[mode]}")

    def _mode_refused_now(self) -> ExecutionError:
        return self._mode_refusal(self.training, f"a call with the training flag set to {self.training} (without .train()/.eval())")

    def _make_captured(self) -> None:
        """The plan's whole-plan capture (plan.capture) for the state's device, or None (CPU, or capture off)."""
        backend = capture_backend(next(iter(self._stacked.values())).device) if self.plan.capture and self._stacked else None
        self.__dict__["_captured"] = CapturedPlan(self, backend=backend) if backend is not None else None

    def _build_runners(self) -> None:
        # one call at a time: a vmap stage swaps each call's state into its stage module's slots, and some runners keep
        # per-call values of their own, so calls from several threads (a thread-pool server) would mix (1-3 in 1200
        # calls came out wrong); re-entrant, for a hook that calls the module again
        self.__dict__.setdefault("_call_lock", threading.RLock())
        self.__dict__["_written_ptrs"] = None  # the state's storage may be new: the written buffers' looked up anew
        # per-member views for loop stages, made once: made under no_grad (a build or .to() inside torch.no_grad())
        # they would carry no gradient back to the stacked tensors, so they are made with grad on; see _views_stale
        with torch.enable_grad():
            views = [{k: v[i] for k, v in self._stacked.items()} for i in range(self.n_members)]
        runners: list[Runner] = []
        loops = self.__dict__.get("_number_loops") or {}  # (a module pickled before there were any: none)
        for p in self.programs:
            stacked = {k: self._stacked[k] for k in p.state_names}
            member_states = [{k: v[k] for k in p.state_names} for v in views]
            if p.stage.id in loops:  # an op in it takes a per_member Python number (see _find_number_loops)
                from stagewise.executor.strategies import BoundLoopRunner  # the strategies import this module's neighbours
                runners.append(BoundLoopRunner(p, self.n_members, stacked, member_states))
            else:
                runners.append(runner_for(p, self.n_members, stacked, member_states))
        self.runners = runners
        # every stacked tensor: loop runners read them through per-member views made here (new storage: made again),
        # and a tensor given new storage of another shape (`p.data = t` without the member axis) is refused by name
        # where vmap would refuse it, the loop read row i of whatever it got, and wide broadcast it (_check_layout)
        self._storage = [(self._stacked[k], _data_ptr(self._stacked[k]), self._stacked[k].shape) for k in sorted(self._stacked)]
        # what the views were made under: which watched tensors required grad, and whether in inference mode
        # (a view of a frozen tensor stays out of autograd after requires_grad_(True); an inference view forever)
        self.__dict__["_views_made"] = (tuple(t.requires_grad for t, _, _ in self._storage), torch.is_inference_mode_enabled())

    @property
    def runners(self) -> list[Runner]:
        """One runner per program, in run order. Assigning a new list (profile labels them) re-makes the steps."""
        return self.__dict__["_runners"]

    @runners.setter
    def runners(self, runners: list[Runner]) -> None:
        self.__dict__["_runners"] = runners
        # the flat program the per-call path runs: per stage (program, runner, input names, output names,
        # how it writes in place (_Writes, None if it does not), (output index, state key) of state handed on as itself)
        self.__dict__["_steps"] = [(p, r, tuple(p.input_names), tuple(p.output_names), _Writes.of(p, r), tuple(so))
                                   for p, r, so in zip(self.programs, runners, self._state_outputs)]
        # a strategy that carries no gradients (cuda_graph): calls that would record autograd are refused
        self.__dict__["_inference_only"] = any(not getattr(r, "trainable", True) for r in runners)
        self.__dict__["_grad_checks"] = (self._inference_only or bool(self.__dict__.get("_shared_across"))
                                         or bool(self.__dict__.get("_ties_apart")) or bool(self.__dict__.get("_grad_hooks"))
                                         or bool(self.__dict__.get("_frozen_apart"))
                                         or bool(self.__dict__.get("_lost_backwards"))
                                         or bool(self.__dict__.get("_aliased_params"))
                                         or bool(self.__dict__.get("_traced_without_grad"))
                                         or bool(self.__dict__.get("_learnable_attributes")))

    def _follow_new_storage(self) -> None:
        """Rebuild the runners if a tensor a loop stage reads got new storage (`p.data = ...`, `set_`): its
        per-member views would go on reading the old one. An in-place update needs nothing. Also when
        gradients are recorded and the views cannot carry them (see _build_runners)."""
        for t, ptr, shape in self._storage:
            if _data_ptr(t) != ptr or t.shape != shape:  # new storage, or `p.data = p.data[0]` (the same address)
                self._check_layout()
                self._build_runners()
                return
        if torch.is_grad_enabled() and self._views_stale():
            self._build_runners()

    def _views_stale(self) -> bool:
        """Whether the loop stages' per-member views were made from tensors whose requires_grad has changed since,
        or in inference mode (outside it now)."""
        requires, inference = self.__dict__["_views_made"]
        if inference and not torch.is_inference_mode_enabled():
            return True
        return any(t.requires_grad != was for (t, _, _), was in zip(self._storage, requires))

    def _check_layout(self) -> None:
        """ExecutionError naming a stacked tensor whose shape is no longer the one built ([N, *member shape])."""
        for k, shape in self.__dict__.get("_shapes", {}).items():
            t = self._stacked.get(k)
            if t is not None and t.shape != shape:
                raise ExecutionError(
                    f"the stacked state {k!r} is now shaped {list(t.shape)}, where the batched module holds it as "
                    f"{list(shape)} (member axis first, N={self.n_members}): each member's row would be read from "
                    f"whatever it got. Give it its [N, ...] shape again (to set every member: .data = t.expand("
                    f"{self.n_members}, *t.shape).clone(); one member: p.data[i].copy_(t))")

    def _follow_replaced_state(self) -> None:
        """Read the tensors of the state tree anew after one was replaced (see members.StateNode): the runners and the
        whole-plan capture were built on the old ones."""
        self._state_replaced[0] = False
        self.__dict__["_written_ptrs"] = None  # (the written buffers' storage, looked up anew)
        self._stacked = {k: tree_tensor(self.stacked, k) for k in self._stacked}
        self._check_layout()
        self._build_runners()
        self._make_captured()

    def to(self, *args, **kwargs) -> "BatchedModule":
        """nn.Module.to, but a memory_format (`ens.to(memory_format=torch.channels_last)`, as timm and torchvision
        training scripts call on a model) is not applied: the stacked conv weights carry the member axis (5-D), which
        torch's channels_last refuses ("required rank 4 tensor"), and a layout changes no value. The device and dtype
        are applied; a warning says the format was not. Inputs in channels_last are taken as they are."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is not None:
            warnings.warn(f"the batched module keeps its own memory layout: {memory_format} is not applied to its "
                          "stacked state (the member axis makes a conv weight 5-D; the values are the same either way). "
                          "executor.autotune chooses each conv stage's fastest formulation", UserWarning, stacklevel=2)
            if device is None and dtype is None:
                return self
            return super().to(*[a for a in (device, dtype) if a is not None], non_blocking=non_blocking)
        return super().to(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        kept = self.__dict__.get("_kept_dtypes") or {}
        # per-member constants forward() makes in float32 (lifted into the stacked state): moved, not cast
        held_state = {k: tree_tensor(self.stacked, k) for k in kept if k in self.__dict__.get("_stacked", {})}
        super()._apply(fn, recurse)  # the stacked state tree: tied names stay one Parameter
        for k, t in held_state.items():
            path, _, leaf = k.rpartition(".")
            owner = self.stacked.get_submodule(path) if path else self.stacked
            if leaf in owner._buffers:
                owner._buffers[leaf] = t.to(device=fn(torch.empty(0, dtype=t.dtype, device=t.device)).device)
        for m in self.stage_modules:
            held = {k: m.get_buffer(k) for k in kept if _has_buffer(m, k)}
            m._apply(fn)
            for k, t in held.items():  # moved where fn moves a tensor of its dtype, not cast
                owner, _, name = k.rpartition(".")
                m.get_submodule(owner)._buffers[name] = t.to(device=fn(torch.empty(0, dtype=t.dtype, device=t.device)).device)
        self._stacked = {k: tree_tensor(self.stacked, k) for k in self._stacked}
        if self.plan.dtype in LOW_PRECISION and self.plan.tracer == "fx":
            # `.float()` / `.double()` of a low-precision plan's module: the inputs enter in the state's dtype from now
            # on (an fx graph casts to whatever its values are; an export graph keeps its casts and says so when run)
            floating = [t.dtype for k, t in self._stacked.items() if t.is_floating_point() and k not in kept]
            self.__dict__["_input_dtype"] = floating[0] if floating else LOW_PRECISION[self.plan.dtype]
        self._build_runners()
        if "_captured" in self.__dict__:  # not while nn.Module.__init__ sets things up
            self._make_captured()
        if "_state_replaced" in self.__dict__:
            self._state_replaced[0] = False  # followed just now
        return self

    def train(self, mode: bool = True) -> "BatchedModule":
        """Training mode for every stage: dropout draws a mask per member, BatchNorm updates each member's statistics.
        ExecutionError for a mode whose graph differs from the traced one (forward() branches on self.training)."""
        if mode in self.__dict__.get("_mode_bound", ()):
            raise self._mode_refusal(mode, f".train({mode})" if mode else ".eval()")
        self.__dict__["_setting_modes"] = True  # (the state tree's nodes follow below, as the stage modules do)
        try:
            super().train(mode)
        finally:
            self.__dict__["_setting_modes"] = False
        self._bump_modes()
        later = self.__dict__.get("_low_precision_later")
        if mode and later:  # built in eval: the statistics start moving now, in the plan's low precision
            self.__dict__["_low_precision_later"] = ()
            warnings.warn(low_precision_state_warning(self.plan.dtype, list(later)), stacklevel=2)
        # as member.train(mode) would: a class overriding train() (BatchNorm kept in eval) keeps its layers' modes
        overrides = self.__dict__.get("_own_train_modes") or {}
        hand_set = [k for k in self.__dict__.get("_modes_set_by_hand", ()) if k not in overrides.get(mode, {})
                    and self._stage_layer_mode(k) not in (None, mode)]  # only layers this call moves
        if hand_set and not self.__dict__.get("_warned_hand_set"):
            self.__dict__["_warned_hand_set"] = True
            warnings.warn(
                f"this module was built from members with layers put in another mode by hand ({', '.join(hand_set[:3])}"
                f"{', ...' if len(hand_set) > 3 else ''}); .train({mode}) sets them as member.train({mode}) would, to "
                f"{_MODE_NAME[mode]} mode. To keep a layer in eval mode while training (frozen BatchNorm statistics), "
                "override train() in the model class (as mmcv's norm_eval does): the batched module follows it",
                stacklevel=2)
        for m in self.stage_modules:
            set_train_modes(m, mode, overrides)
        for r in self.runners:  # loop stages call per-member shallow copies of their stage (bound_loop): the flag too
            for bound in getattr(r, "_bound", ()):
                set_train_modes(bound, mode, overrides)
        for k, flag in (self.__dict__.get("_own_train_grads") or {}).get(mode, {}).items():
            if k in self._stacked and self._stacked[k].requires_grad != flag:  # `freeze_bn` freezing the weights too
                self._stacked[k].requires_grad_(flag)
        return self

    def _layer_mode(self, path: str, mode: bool) -> None:
        """train(mode) / eval() called on the node `path` of the state tree (`ens.stacked.bn.eval()`, or a walk over
        `ens.modules()` picking layers by class: MC dropout's `m.train()` on the Dropouts of a model in eval, BatchNorm
        frozen while fine-tuning): the layers at `path` in the stage modules and the loop stages' per-member copies
        take that mode, as each member's layer does in the loop. ExecutionError where a module of the model's own
        there branches on self.training in forward(): the trace kept one side of that branch."""
        if not path or self.__dict__.get("_setting_modes"):
            return
        baked = [p for p, (_, traced) in (self.__dict__.get("_branching_modules") or {}).items()
                 if (p == path or p.startswith(path + ".")) and traced != mode]
        if baked:
            raise ExecutionError(
                f"train({mode}) on {path!r} of the batched module: forward() of {baked[0]!r} "
                f"({self._branching_modules[baked[0]][0]}) reads self.training, and the plan's graph holds its ops as "
                f"traced in one mode ({'torch.export fixes the mode of every layer' if self.plan.tracer == 'export' else 'traced through, one side of the branch kept'}), "
                "so that layer's other mode cannot be run from this module. Put the members' layers in the mode you "
                "want before planner.trace and executor.build, or build one module per mode (ens.train() / ens.eval() "
                "switch the whole module where its graph allows)")
        if mode:
            for layer, why in (self.__dict__.get("_training_refused_layers") or {}).items():
                if (layer == path or layer.startswith(path + ".") or path.startswith(layer + ".")) \
                        and self._stage_layer_mode(layer) is False:
                    raise ExecutionError(f"train() on {path!r} of the batched module would put {layer!r} in training "
                                         f"mode, which is refused: {why}; evaluation is unaffected")
        found = False
        for m in self.stage_modules:
            try:
                m.get_submodule(path).train(mode)
                found = True
            except AttributeError:
                continue
        for r in self.runners:
            for bound in getattr(r, "_bound", ()):
                try:
                    bound.get_submodule(path).train(mode)
                except AttributeError:
                    continue
        if found:
            self._bump_modes()

    def _bump_modes(self) -> None:
        """A layer's mode changed: graphs captured before (executor.capture) replay the old one, and are made again."""
        self.__dict__["_modes_version"] = self.__dict__.get("_modes_version", 0) + 1
        captured = self.__dict__.get("_captured")
        if captured is not None:
            self._make_captured()

    def _stage_layer_mode(self, name: str) -> bool | None:
        """The training flag of the layer `name` in the stage modules that hold it now (None where none does)."""
        for m in self.stage_modules:
            try:
                return m.get_submodule(name).training
            except AttributeError:
                continue
        return None

    def _check_trainable(self) -> None:
        """ExecutionError naming the first stage whose strategy cannot carry gradients, or the parameters members
        share (one tensor in the loop, a copy per member here)."""
        if self.__dict__.get("_traced_without_grad") and any(p.requires_grad for p in self._stacked.values()):
            raise ExecutionError(
                "this module's plan was traced inside torch.no_grad(), where torch.export records none of forward()'s own "
                "torch.no_grad() regions (Hugging Face's rotary embedding is one): a call that records gradients would "
                "send them where the model stops them. Call it under torch.no_grad() / torch.inference_mode(), or plan "
                "it with gradients on (planner.trace outside torch.no_grad()) to train it")
        learnable = self.__dict__.get("_learnable_attributes")
        if learnable:
            raise ExecutionError(
                f"member 0 holds {learnable[0]!r} as a plain tensor that requires grad (a learnable value not registered "
                "as a parameter: a plain attribute, or an nn.Parameter in a plain list or dict, trained by passing it to "
                "the optimizer by hand): the batched module holds it as a constant, so a call that records gradients "
                "would give it none where the member loop gives each member's one. Register it (`self.x = "
                "nn.Parameter(...)`, nn.ParameterList / nn.ParameterDict for a list or dict of them) so that it is "
                "stacked and trained with the others; inference (torch.no_grad()) is unaffected")
        aliased = [(k, other) for k, other in self.__dict__.get("_aliased_params", ()) if self._stacked[k].requires_grad]
        if aliased:
            raise ExecutionError(
                f"member 0 holds the trainable parameter {aliased[0][0]} (on one memory with {aliased[0][1]}): two "
                "tensors on one memory, which the batched "
                "module stacks apart, so an optimizer step on the stacked parameter would leave the other name's copy "
                "behind where the member loop's moves both. Give the other name its own tensor (a copy), read the "
                "parameter itself in forward(), or freeze it (requires_grad_(False)); inference (torch.no_grad()) is "
                "unaffected")
        # members freezing apart: refused while a stacked parameter keeps member 0's flag (built so); set otherwise on
        # this module, it is one flag every member holds (ens.stacked.fc1.requires_grad_(False): frozen in all)
        apart = self.__dict__.get("_frozen_apart_flags")
        kept = [k for k, flag in (apart or {}).items() if k not in self._stacked or self._stacked[k].requires_grad == flag]
        if self.__dict__.get("_frozen_apart") and (apart is None or kept):
            hint = (f" Or set its one flag for every member on this module: ens.stacked.{kept[0]}.requires_grad_"
                    f"({not apart[kept[0]]}) {'trains it in' if not apart[kept[0]] else 'freezes it for'} every member"
                    if kept and kept[0] in self._stacked else "")
            raise ExecutionError(f"{self.__dict__['_frozen_apart']}; inference (torch.no_grad()) is unaffected.{hint}")
        held = self.__dict__.get("_shared_across") or {}
        shared = [k for k in held if k in self._stacked and self._stacked[k].requires_grad]
        if shared:
            # a dict since the shared frozen ones are kept (members.shared_across_members): False = frozen at build
            unfrozen = [k for k in shared if isinstance(held, dict) and not held[k]]
            raise ExecutionError(
                f"members share the trainable parameter(s) {shared[:3]} (one tensor, or tensors on one memory, held by several members)"
                + (", made trainable on this module after build (frozen in the members then"
                   f"{'' if unfrozen == shared else ': ' + str(unfrozen[:3])}, allowed while frozen; unfrozen since by "
                   "ens.stacked...requires_grad_(True))" if unfrozen else "") + ": the batched "
                "module holds a copy per member, so training would update the copies apart where the member loop updates "
                "one tensor. Give each member its own copy (copy.deepcopy), or freeze it (requires_grad_(False)); "
                "inference (torch.no_grad()) is unaffected")
        hooked = [k for k in self.__dict__.get("_grad_hooks", ()) if k in self._stacked and self._stacked[k].requires_grad]
        if hooked:
            raise ExecutionError(
                f"members have gradient hooks on {hooked[:3]} (Tensor.register_hook / register_post_accumulate_grad_hook): "
                "the batched module trains stacked copies of the members' parameters, which carry no hooks, so their "
                "gradients would go unchanged where the member loop changes them (a mask freezing rows, a clip). Put the "
                "hooks on the stacked parameters instead (for name, p in ens.named_stacked_parameters(): "
                "p.register_hook(...), p is [N, ...]), then remove them from the members; inference (torch.no_grad()) "
                "is unaffected")
        lost = self.__dict__.get("_lost_backwards") or ()
        if any(name.endswith(".CheckpointFunction") for name in lost):
            raise ExecutionError(
                "forward() uses torch.utils.checkpoint with use_reentrant=True, and this plan was traced with torch.export, "
                "which keeps the checkpointed region as it runs forward, with gradients off: nothing before or inside it "
                "would be trained. Pass use_reentrant=False (torch's recommended form, which torch.fx traces), or train "
                "the members in a loop; inference (torch.no_grad()) is unaffected")
        if lost:
            how = ("this plan was traced with torch.export, which records the ops of its forward and drops the backward "
                   "it defines" if self.plan.tracer == "export" else
                   "torch.fx had to trace through it (it writes its input, ctx.mark_dirty, or takes an argument a graph "
                   "cannot hold, such as a function), recording the ops of its forward and not the backward it defines")
            raise ExecutionError(
                f"forward() calls the autograd.Function {', '.join(lost[:3])}, and {how}: gradients here would be those of "
                "the forward's ops, not the member loop's. Pass the Function tensors and plain numbers only, and make "
                "forward() traceable by torch.fx, which keeps such a Function as one call; or train the members in a "
                "loop; inference (torch.no_grad()) is unaffected")
        apart = self.__dict__.get("_ties_apart") or {}
        if apart and any(p.requires_grad for p in self._stacked.values()):
            tie, tied_in = next(iter(apart.items()))
            raise ExecutionError(
                f"members differ in weight tying: {tie} is one tensor in member(s) {tied_in[:4]} and two in the others, so the "
                "batched module holds two tensors for every member and training would update a tied member's two names "
                "apart where the member loop updates one tensor. Tie (or untie) the same parameters in every member, or "
                "train the members that differ here as separate modules; inference (torch.no_grad()) is unaffected")
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
        if self._state_replaced[0]:
            self._follow_replaced_state()
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
        if self._state_replaced[0]:
            self._follow_replaced_state()
        with torch.no_grad():
            # a module's get_extra_state() value is no tensor and is not stacked: each member's, as built, goes back
            # under its key (load_state_dict, strict, asks for it)
            extra = self.__dict__.get("_extra_states") or [{}] * self.n_members
            return [{k: self._stacked[k][i].detach().clone() if k in self._stacked else copy.deepcopy(extra[i][k])
                     for k in self._member_keys if k in self._stacked or k in extra[i]} for i in range(self.n_members)]

    def load_member_state_dict(self, i: int, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Put one member's state (a state_dict of the original architecture: a member changed after build, a
        checkpoint, a re-initialised member of a population) into row `i` of the stacked state, in place, as
        `load_state_dict` would into member i (values cast to the stacked dtype and device). MemberError for a key
        that is missing (with strict) or unknown, or a shape that is not one member's. The members' own modules
        are not read again: what they hold besides their state (a sweep's numbers) stays as built."""
        if not 0 <= i < self.n_members:
            raise MemberError(f"load_member_state_dict({i}): no such member; pass 0..{self.n_members - 1}")
        hooked = load_hooks_refusal(self, f"load_member_state_dict({i})")
        if hooked:
            raise MemberError(hooked)
        self._check_member_load(i, state_dict)
        if self._state_replaced[0]:
            self._follow_replaced_state()
        keys = set(self._member_keys)
        unknown = sorted(set(state_dict) - keys)
        missing = sorted(keys - set(state_dict)) if strict else []
        if unknown or missing:
            raise MemberError(f"load_member_state_dict({i}): {'unknown key(s) ' + str(unknown[:3]) if unknown else ''}"
                              f"{'; ' if unknown and missing else ''}{'missing key(s) ' + str(missing[:3]) if missing else ''}; "
                              "pass one member's state_dict (strict=False to load part of it)")
        for k, v in state_dict.items():
            if tuple(v.shape) != tuple(self._stacked[k].shape[1:]):
                raise MemberError(f"load_member_state_dict({i}): {k} has shape {list(v.shape)}, one member's is "
                                  f"{list(self._stacked[k].shape[1:])}")
        with torch.no_grad():
            for k, v in state_dict.items():
                self._stacked[k][i].copy_(v)

    def _check_member_load(self, i: int, state_dict: dict) -> None:
        """MemberError where copying `state_dict` into row i alone would leave the batched module otherwise than member
        i's own load_state_dict leaves the member: a tensor other members hold too (a shared backbone: the loop's load
        writes it for them all), one of two names on one memory stacked apart (a view of the weight registered as a
        buffer; a torch.export module's tie) loaded under one name or with other values, and a tie member i has where
        others do not (a tie sweep: the member keeps one tensor for both names)."""
        how = f"load_member_state_dict({i})"
        for name, (why, other) in (self.__dict__.get("_load_aliased") or {}).items():
            if name not in state_dict:
                continue
            if isinstance(other, list):
                if i in other and len(other) > 1:
                    raise MemberError(f"{how}: {why}. Load the state into the members and build again, or give each "
                                      "member its own copy (copy.deepcopy the shared module for each member)")
                continue
            mine, theirs = (torch.as_tensor(state_dict[k]) for k in (name, other)) if other in state_dict else (None, None)
            if mine is None or (mine.shape == theirs.shape and not torch.equal(mine, theirs)):
                raise MemberError(f"{how}: {why}; loaded {'with other values under the two names' if other in state_dict else 'under one name only'}, "
                                  f"`{other}` would keep its old row. Load the same values under both names, or load into "
                                  "member i itself (member.load_state_dict(...)) and build again")
        for tie, tying in (self.__dict__.get("_ties_apart") or {}).items():
            a, b = tie.split(" = ")
            if i in tying and (a in state_dict or b in state_dict) and not (
                    a in state_dict and b in state_dict and torch.equal(state_dict[a], state_dict[b])):
                raise MemberError(f"{how}: member {i} ties `{a}` and `{b}` (one tensor), which the batched module stacks "
                                  "apart because other members do not tie them; loaded under one name only or with "
                                  "other values under the two, the member's own load would leave both names one value "
                                  "where the rows here would differ. Load the same values under both names, or load "
                                  "into member i itself and build again")

    @property
    def stacked_state(self) -> dict[str, torch.Tensor]:
        """Member state stacked [N, ...] by dotted name: the module's Parameters and buffers themselves
        (shared with the runners; in-place updates persist; update parameters under torch.no_grad())."""
        if self._state_replaced[0]:
            self._follow_replaced_state()
        return _StateByName(self._stacked)

    def bind_inputs(self, inputs: tuple) -> dict[str, Any]:
        """Model inputs by placeholder name as boundary values (Batched for per_member, Shared otherwise); InputError if they do not fit."""
        if len(inputs) != len(self._input_names):
            raise InputError(f"the model takes {len(self._input_names)} inputs {self._input_names}, got {len(inputs)}; pass them positionally")
        if self.__dict__.get("_traced_numbers"):
            inputs = self._numbers_per_member(inputs)
        env: dict[str, Any] = {}
        for name, per_member, x in zip(self._input_names, self._per_member_at, inputs):
            if per_member:
                leaves = (x,) if isinstance(x, torch.Tensor) else [  # (a tensor: the per-call case, no pytree walk)
                    t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)] if isinstance(x, (dict, list, tuple)) else ()
                if isinstance(x, (list, tuple)) and name in self._traced_tensors:  # one input per member, in a list
                    raise InputError(
                        f"input {name!r} is per_member and was traced as one tensor, got a {type(x).__name__} of {len(x)}: "
                        f"stack the members' inputs into one N-first tensor (torch.stack({name}) gives [{len(x)}, ...]), "
                        f"with N = {self.n_members}")
                if not leaves or any(t.dim() == 0 or t.shape[0] != self.n_members for t in leaves):
                    got = (list(x.shape) if isinstance(x, torch.Tensor) else
                           f"a {type(x).__name__} whose tensors are shaped {[list(t.shape) for t in leaves][:4]}" if leaves
                           else type(x).__name__)
                    raise InputError(
                        f"input {name!r} is per_member, so it needs a leading member axis of size {self.n_members}; got {got}. "
                        "Stack one input per member (each tensor of a dict or tuple input), or plan it as 'shared'"
                    )
                if name in self.__dict__.get("_written_inputs", ()) and any(rows_overlap(t) for t in leaves):
                    raise overlapping_rows_refusal(name)  # (each tensor of a dict or tuple input)
                if name in self.__dict__.get("_container_loops", ()):
                    self._follow_container_numbers(name, x)
                env[name] = Batched(x)
            else:
                if x is None and name in self._traced_tensors:
                    # `if mask is not None:` took the tensor branch at trace time: the graph would apply None as a tensor
                    raise InputError(f"input {name!r} was traced as a tensor, got None: the plan holds the branch forward() "
                                     f"took for a tensor there; pass a tensor, or re-plan with None in the example inputs")
                if x is not None and name in self._traced_none:
                    # `if mask is not None:` took the None branch at trace time: the graph has no use of the input
                    raise InputError(f"input {name!r} was traced as None, got a {type(x).__name__}: the plan holds the "
                                     "branch forward() took for None there, which would ignore it; pass None, or re-plan "
                                     f"with a {type(x).__name__} for {name!r} in the example inputs")
                typed = self.__dict__.get("_traced_numbers_typed", {}).get(name)
                if typed is not None:
                    _check_number_input(name, x, *typed, guarded=self.__dict__.get("_input_guard") is not None)
                env[name] = Shared(x)
        if self.__dict__.get("_written_inputs"):
            self._check_shared_apart(inputs)
        if self.__dict__.get("_written_keys"):
            self._check_apart_from_written_state(inputs)
        if self._checks_traced:
            self._check_traced_shapes(inputs)
        dtype = self.__dict__.get("_input_dtype") or LOW_PRECISION.get(self.plan.dtype)
        if dtype is not None:  # floating inputs enter at the plan's precision, like the stacked state (see LOW_PRECISION)
            env = {k: Batched(_cast_floating(v.tree, dtype)) if isinstance(v, Batched) else Shared(_cast_floating(v.value, dtype))
                   for k, v in env.items()}
        return env

    def _check_configs(self) -> None:
        """ExecutionError where a configuration object the members hold (`self.config`) has a field that is not what
        it was at build (`cfg.pad_token_id = 1` after build: the member loop reads the new value, the graph the old)."""
        for obj, where, fields in self._configs_held:
            now = obj if type(obj) is dict else vars(obj)
            if all(now.get(k, _MISSING_GLOBAL) == v for k, v in fields.items()):
                continue
            for k in sorted(fields, key=str):
                if not _same_setting(now.get(k, _MISSING_GLOBAL), fields.get(k, _MISSING_GLOBAL)):
                    raise ExecutionError(
                        f"the members' {type(obj).__name__} at {where!r} has {k!r} = {_short(now.get(k, _MISSING_GLOBAL))}, "
                        f"which was {_short(fields.get(k, _MISSING_GLOBAL))} when the batched module was built: forward() "
                        "reads its fields on every call and the traced graph holds the values they had then, where the "
                        "member loop reads the new one. Build the batched module again after changing the config "
                        "(planner.trace, executor.build), or set it back")

    def _check_globals(self) -> None:
        """ExecutionError where a module-level setting forward() reads (`CFG["temperature"]`, `TEMPERATURE`) is not what
        it was at build: the traced graph holds the value it had then, the member loop reads the new one."""
        for where, name, value in self._globals_read:
            now = _resolved(where, name)
            if not _same_setting(now, value):
                raise ExecutionError(
                    f"forward() reads the module-level {name!r} of {where} (now {_short(now)}), which was {_short(value)} "
                    "when the batched module was built: the traced graph holds the value it had then, where the member "
                    "loop reads the new one. Build the batched module again after changing it (executor.build), or pass "
                    "the setting to forward() as an input (or hold it as a buffer) so that it can change between calls")

    def _read_before_written(self, name: str, other: str) -> bool:
        """Whether a stage reading input `name` runs before a later stage writing input `other` in place (the member
        loop's reads of `name` after forward()'s write of `other` see it; such a stage's do not). Within one stage the
        graph keeps forward()'s order, member rows apart."""
        order = [(set(p.input_names), set(p.written_inputs)) for p in self.programs]
        reads = [k for k, (ins, _) in enumerate(order) if name in ins]
        writes = [k for k, (_, out) in enumerate(order) if other in out]
        if not writes:
            return True  # written through a view a stage is handed (`v = x[:, :2]` before, `v.mul_(2)` here): unknown
        return bool(reads) and min(reads) < max(writes)

    def _check_apart_from_written_state(self, inputs: tuple) -> None:
        """InputError for an input on the memory of member state forward() writes in place on this call (a buffer
        forward() returned and the caller feeds back, `out, state = ens(x, state)`): in the member loop the input is
        that buffer, so a read of it after forward()'s write sees the write, where the batched module may read it as
        it came in (a stage before the write). Looked up by storage: one dict lookup per input tensor."""
        keys = self._written_keys if self.training else self.__dict__["_written_always"]
        if not keys:
            return
        ptrs = self.__dict__.get("_written_ptrs")
        if ptrs is None or ptrs[0] is not keys:
            ptrs = (keys, {self._stacked[k].untyped_storage().data_ptr(): k for k in keys if k in self._stacked})
            self.__dict__["_written_ptrs"] = ptrs
        for name, x in zip(self._input_names, inputs):
            for t in (x,) if isinstance(x, torch.Tensor) else _tensor_leaves(x):
                while torch._C._functorch.is_functorch_wrapped_tensor(t):  # under torch.func.grad / vmap: its memory
                    t = torch._C._functorch.get_unwrapped(t)
                key = ptrs[1].get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
                if key is not None and _elements_shared(t, self._stacked[key]):
                    raise InputError(
                        f"input {name!r} shares memory with the stacked buffer {key!r}, which forward() writes in place "
                        f"on this call (a value the module returned, fed back: `out, h = ens(x, h)`): in the member loop "
                        f"the input is that buffer, and a read of it after forward()'s write sees the write, where the "
                        f"batched module may read it before; pass a copy ({name}.clone())")

    def _numbers_per_member(self, inputs: tuple) -> tuple:
        """`inputs` with each per_member Python number input (traced as a Python bool, int or float) as one [N] tensor:
        given as one (the members' numbers, torch.tensor(values)), or as a list or tuple of N Python numbers (floats as
        float64, the loop's doubles; exact_numbers rounds them where an op takes them). InputError for anything
        else (one number, a tensor of another shape), naming what to pass."""
        out = list(inputs)
        for k, name in enumerate(self._input_names):
            if name not in self._traced_numbers:
                continue
            x, n = inputs[k], self.n_members
            kind = self.plan.inputs[k].dtype
            if isinstance(x, (list, tuple)) and len(x) == n:
                for i, v in enumerate(x):
                    if isinstance(v, (bool, int, float)) and kind in ("bool", "int", "float"):
                        _check_number_input(f"{name}[{i}]", v, kind, None)
            elif isinstance(x, torch.Tensor) and kind in ("bool", "int", "float") and (
                    (x.dtype == torch.bool) != (kind == "bool") or (x.is_floating_point() and kind != "float")):
                raise InputError(f"input {name!r} was traced as a Python {kind} per member, got a {str(x.dtype)[6:]} "
                                 f"tensor: forward() may take another path for another type (a branch on it), and the "
                                 f"plan holds the one it took for a {kind}; pass {kind}s (a list, or a tensor of that "
                                 "kind), or re-plan with such values in the example inputs")
            if isinstance(x, (list, tuple)) and len(x) == n and all(isinstance(v, (bool, int, float)) for v in x):
                floats = any(isinstance(v, float) for v in x)
                out[k] = x = torch.tensor(x, dtype=torch.float64 if floats else None)
            if isinstance(x, torch.Tensor) and x.dim() == 1 and x.shape[0] == n:
                # a tensor of numbers is taken as it holds them (float32 ones too: number_op widens them exactly)
                continue
            spec = self.plan.inputs[k]
            got = (f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else
                   f"a {type(x).__name__} of {len(x)}" if isinstance(x, (list, tuple)) else f"a {type(x).__name__} ({x!r})")
            raise InputError(
                f"input {name!r} is a per_member Python number (traced as a Python {spec.dtype}), so it takes one number "
                f"per member: a list of {n} numbers, or one tensor of shape [{n}] (torch.tensor([...])); got {got}. For one number "
                "for every member, plan it as 'shared'")
        return tuple(out)

    def _check_shared_apart(self, inputs: tuple) -> None:
        """InputError for an input on memory a per_member input forward() writes in place also holds (`ens(y[0], y)`,
        `ens(y, y)`): the member loop's write into its row reaches the other value that later members and later ops
        read; the batched module reads it as it came in (a copy per stage, or read before the rows are written)."""
        written = [(name, t) for name, per_member, x in zip(self._input_names, self._per_member_at, inputs)
                   if per_member and name in self._written_inputs for t in _tensor_leaves(x)]
        if not written:
            return
        for name, per_member, x in zip(self._input_names, self._per_member_at, inputs):
            for t in _tensor_leaves(x):
                other = next((w for w, rows in written if w != name and _elements_shared(t, rows)), None)
                if other is not None and per_member and not self._read_before_written(name, other):
                    continue  # every read of `name` runs with or after the last write of `other`: as the loop reads it
                if other is not None and per_member:
                    raise InputError(
                        f"the per_member inputs {name!r} and {other!r} share memory (`ens(y, y)`, overlapping slices of "
                        f"one tensor), and forward() writes {other!r} in place: in the member loop that write reaches "
                        f"{name!r} before later ops read it, where the batched module may read {name!r} as it came in; "
                        f"pass a copy ({name}.clone())")
                if other is not None:
                    raise InputError(
                        f"the shared input {name!r} shares memory with the per_member input {other!r}, which forward() "
                        f"writes in place (such as a row of it: `ens({other}[0], {other})`): the member loop's writes into "
                        f"{other!r} reach {name!r}, which the batched module reads as it came in; pass a copy "
                        f"({name}.clone(), e.g. {other}[0].clone())")

    def _check_traced_shapes(self, inputs: tuple) -> None:
        """InputError before any stage runs if a member's inputs break what the trace assumed (planner.inputs).

        The per_member rows of one tensor share their shape, so member 0's inputs speak for every member's shapes;
        not for a per_member Python number, which torch.export baked into the graph as its traced value (guard
        `temperature == 1.0`): every member whose number differs from member 0's is put to the guard too, else
        members 1.. would run member 0's value without a word."""
        one = [x[0] if per_member else x for per_member, x in zip(self._per_member_at, inputs)]
        check_call_inputs(self.plan.tracer, self.plan.inputs, one)
        guard = self.__dict__.get("_input_guard")  # export's own guard: catches relations the spec does not spell out
        numbers = [k for k, (spec, per_member) in enumerate(zip(self.plan.inputs, self._per_member_at))
                   if per_member and spec.shape is None and spec.dtype in _PYTHON_SCALARS]
        if guard is not None:
            self._guard(guard, one, 0)
        for k in numbers:  # (a plan file with no traced value and a module unpickled without its guard: unchecked)
            x = inputs[k]
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                continue  # refused where the member axis is looked for (bind_inputs)
            traced = self.plan.inputs[k].value
            differ = ((x != x[:1]) if traced is None else (x != traced)).reshape(len(x), -1).any(1)
            if isinstance(traced, float) and x.is_floating_point():  # -0.0 == 0.0 and NaN != NaN for ==: the sign and
                # NaN-ness as the trace took them (`math.copysign(1, s)`)
                sign = torch.signbit(x) != (math.copysign(1.0, traced) < 0)
                differ = (differ & ~(torch.isnan(x) & math.isnan(traced))) | sign.reshape(len(x), -1).any(1) | (
                    torch.isnan(x) != math.isnan(traced)).reshape(len(x), -1).any(1)
            for i in differ.nonzero().flatten().tolist():
                if guard is not None:
                    self._guard(guard, [x[i] if per_member else x for per_member, x in zip(self._per_member_at, inputs)], i)
                if traced is not None:  # the guard let it by (none kept), the graph still holds the traced value
                    raise self._baked_number(self._input_names[k], i, x[i], f"traced as {traced!r}")

    def _guard(self, guard: Any, one: list, member: int) -> None:
        """Run torch.export's guard on member `member`'s inputs `one`; InputError naming the input it refuses."""
        try:
            guard(*one)
        except Exception as e:  # an AssertionError ("Guard failed: ..."), or torch's own on a value it cannot compare
            what = (str(e).strip().splitlines() or ["a guard failed"])[0]
            named = [name for name in self._input_names if re.search(rf"\b{re.escape(name)}\b", what)]
            if not named and not isinstance(e, AssertionError):
                # a tensor where the trace took a number (`x == 1.0` of a [2] tensor: "Boolean value of Tensor with
                # more than one value is ambiguous"): the inputs traced as Python values that got something else
                named = [spec.name for spec, x in zip(self.plan.inputs, one)
                         if spec.shape is None and spec.dtype in _PYTHON_SCALARS and not _is_number(x)]
            scalars = {spec.name for spec in self.plan.inputs if spec.shape is None and spec.dtype in (*_PYTHON_SCALARS, "str")}
            for name in named:
                if name not in scalars:
                    continue
                value = one[self._input_names.index(name)]
                spec = self.plan.inputs[self._input_names.index(name)]
                if isinstance(value, str) != (spec.dtype == "str") or not (_is_number(value) or isinstance(value, str)):
                    # a [N] tensor for a shared number, a str for a float
                    got = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else
                           f"a {type(value).__name__}")
                    per = (f" (member {member}'s value of the per_member input)" if self._per_member_at[
                        self._input_names.index(name)] else "")
                    raise InputError(
                        f"input {name!r} was traced as a Python {spec.dtype}"
                        f"{' (' + repr(spec.value) + ')' if spec.value is not None else ''}, which the plan's torch.export "
                        f"trace fixed into its graph, and got {got}{per} ({what}); pass "
                        f"{'one Python ' + spec.dtype if not per else 'one number per member, as an [N] tensor'}"
                        f"{' (a value per member, or another value, needs the plan traced with a tensor there)' if spec.dtype in ('int', 'float') else ''}") from None
                # `temperature == 1.0`: torch.export baked a Python number input into the graph
                raise self._baked_number(name, member, value, what) from None
            where = f"member {member}'s inputs " if member else "the inputs "
            raise InputError(
                f"{where}break a condition of the plan's torch.export trace ({what}"
                f"{'' if isinstance(e, AssertionError) else ': ' + type(e).__name__})"
                f"{' on input ' + repr(named[0]) if named else ''}; pass inputs like the traced ones (shapes, dtypes, "
                "the same Python values) or re-plan with example inputs like these") from None

    def _baked_number(self, name: str, member: int, value: Any, what: str) -> InputError:
        """The refusal of a Python number input (bool, int, float) that differs from the value torch.export fixed."""
        spec = self.plan.inputs[self._input_names.index(name)]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = _as_given(value)
        kind = f"a Python {spec.dtype}" if spec.dtype in ("bool", "str") else "a Python number"
        traced = "" if spec.value is None else f"torch.tensor({spec.value!r})"
        per_member = self._per_member_at[self._input_names.index(name)]
        if spec.dtype in ("bool", "str"):  # a flag picks a branch of forward(): no tensor makes the graph hold both
            fix = f"Plan a module for each value of {name!r} (re-plan with that value in the example inputs)"
        else:
            fix = (f"Plan it as a tensor: trace with a tensor in the example inputs{' (' + traced + ')' if traced else ''}, "
                   "which the graph then takes as an input, and pass " +
                   ("the members' values as one [N] tensor" if per_member else
                    f"torch.tensor({value!r})" if _is_number(value) else "a 0-d tensor"))
        if per_member:
            return InputError(
                f"input {name!r} is per_member and {kind}, which the plan's torch.export trace fixed at its traced value "
                f"({what}): member {member}'s {value!r} would run as the traced value. {fix}")
        return InputError(
            f"input {name!r} is {kind}, which the plan's torch.export trace fixed at its traced value ({what}): another "
            f"value ({value!r}) would run the traced one. {fix}")

    def _run_plain(self, *inputs, keep: bool = False, run: Any = None) -> tuple[Any, dict[str, Any]]:
        """Run all stages in the state's own dtype; returns (N-first outputs, boundary values by node name if `keep`).
        `run(env)`, when given, runs the stages on the bound inputs instead of the flat step list (capture's runs)."""
        if self._grad_checks and torch.is_grad_enabled() and (self.training or self._records_grad()):
            self._check_trainable()
        if self._storage:
            self._follow_new_storage()
        env = self.bind_inputs(inputs)
        if self.__dict__.get("_number_loops_unsaid"):
            self._say_number_loops()
        # per-member floats stacked where no stage's tensors tell their precision (a stage holding no floating tensor,
        # the outputs) follow the whole call's: float64 in a float64 model, as the loop's doubles (values._float_dtype)
        numbers = set_call_number_context((self._stacked, *env.values()))  # the state and the inputs alone
        try:
            if run is None:
                self._run_steps(env, self._steps)
            else:
                run(env)
            return self._outputs(env), (env if keep else {})
        except ExecutionError as e:
            loops = self.__dict__.get("_number_loops")
            if loops and str(e).startswith("members produced tensors of different shapes"):
                # the member loop could not stack them either: say which number gave each member its own shape
                said = "; ".join(words for sid in loops for words in loops[sid])
                at = next(((name, [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in v.values])
                           for name, v in env.items() if isinstance(v, PerMember)
                           and len({tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in v.values}) > 1), None)
                where = "" if at is None else f" at node {at[0]!r} (" + ", ".join(
                    f"member {i}: {list(s) if s is not None else 'no tensor'}" for i, s in enumerate(at[1])
                    if i == 0 or s != at[1][0]) + ")"
                raise ExecutionError(
                    f"members produced tensors of different shapes{where}: a per_member number reaches an op that takes "
                    f"a Python number ({said}), and as a size or a slice bound gives each member its own shape, so the "
                    "members' results cannot be stacked N-first (the member loop's cannot either). Pad them to one size "
                    "in forward() (F.pad(h[:, :k], (0, size - k))), give every member one number there, or plan the "
                    "members that differ here separately") from None
            raise
        finally:
            reset_call_number_context(numbers)

    def _run_steps(self, env: dict[str, Any], steps: list) -> None:
        """Run `steps` (a slice of the flat program) on the boundary values in `env`, adding their outputs to it."""
        # what a stage before the last one that writes state writes: a refusal there puts its own stage's writes back
        # (Runner), so only earlier stages' need a copy here (one writing stage, a memory bank: none)
        writers = [step[0].written_state for step in steps if step[0].written_state] if torch.is_grad_enabled() else []
        written = {k for keys in writers[:-1] for k in keys}
        kept = {k: self._stacked[k].detach().clone() for k in written
                if k in self._stacked and not self._stacked[k].requires_grad} if written else {}
        try:
            self._run_steps_on(env, steps)
        except ExecutionError as e:
            if kept and "records gradients into state that records none" in str(e):
                # a later stage refused the call: what earlier stages wrote into the state goes back too, so that the
                # refusal leaves the state as it was before the call (as the message says)
                put_back(self._stacked, kept)
            raise

    def _run_steps_on(self, env: dict[str, Any], steps: list) -> None:
        n = self.n_members
        for program, runner, input_names, output_names, writes, state_out in steps:
            args = [env[name] for name in input_names]
            copies = None
            if writes is not None:
                args, copies, runner = writes.inputs(env, input_names, args, runner, n)
            try:
                outs = runner(args)
            except ExecutionError as e:
                error = self._input_error(program, e, env)
                if error is e:
                    raise
                raise error from e
            if copies:
                try:
                    _write_back(copies, {p for _, p, _ in self._storage})
                except RuntimeError as e:  # the copies no longer fit what they copy (`h.unsqueeze_(1)` in the stage)
                    shape = "shape" in str(e) or "size" in str(e)
                    raise ExecutionError(
                        f"stage {program.describe} writes a value from outside it in place, and writing each member's "
                        f"result back failed ({_first_line(e)[:200]})" + (
                            ": an in-place op that changes a tensor's shape or strides (unsqueeze_, squeeze_, resize_, "
                            "t_) cannot be given back that way. Use the out-of-place form (h = h.unsqueeze(1)), or keep "
                            "the op in one stage with what reads it" if shape else
                            "; keep the write in one stage with what reads the value (merge the stages)")) from None
                outs = writes.outputs(outs, copies) if writes.views_out or isinstance(copies[-1], OwnStretch) else outs
            env.update(zip(output_names, outs))
            for k, key in state_out:
                if key is not None:
                    env[output_names[k]] = Batched(self._stacked[key])
                elif isinstance(env[output_names[k]], PerMember):
                    env[output_names[k]] = as_batched(env[output_names[k]], n)

    def _outputs(self, env: dict[str, Any]) -> Any:
        """The model's outputs, N-first, from the boundary values in `env`."""
        n = self.n_members
        # a Python float forward() returns per member comes back float64: the loop's are doubles (a float32 [N] tensor
        # would drop digits, and turn a value past float32's range into inf); numbers a batched stage computed are
        # float64 already (exact_numbers)
        numbers = self.__dict__.get("_number_outputs") or ()
        leaves = [x if name is None else _numbers_n_first(env[name], n) if name in numbers else
                  _own_rows(n_first(env[name], n, float_dtype=torch.float64), n) for name, x in self._output_leaves]
        result = leaves[0] if self._output_is_leaf else tree_unflatten(leaves, self._output_tree)
        if self._out_spec is not None:
            result = tree_unflatten(list(result), self._out_spec)
        return result

    def _input_error(self, program: StageProgram, e: ExecutionError, env: dict[str, Any] | None = None) -> StagewiseError:
        """The error to raise for a stage's failure: an InputError when torch failed in a stage fed by the
        model inputs (most likely their shape or dtype), or on a None a container input holds (`env`: the call's
        boundary values), else `e` itself."""
        if env is not None and e.__cause__ is not None and "NoneType" in str(e.__cause__):
            # `batch["mask"]` None where the example inputs held a tensor: the graph applies the tensor branch to it
            for name in self._input_names:
                value = env.get(name)
                held = _none_inside(value.value if isinstance(value, Shared) else getattr(value, "tree", None))
                if held:
                    return InputError(
                        f"input {name!r} holds None at {held}, and stage {program.describe} failed on a None "
                        f"({type(e.__cause__).__name__}: {_first_line(e.__cause__)[:120]}): the plan holds the branch "
                        "forward() took for what its example inputs held there (a tensor). Pass a tensor there, or "
                        "re-plan with None there in the example inputs (a plan for each)")
        lifted = [n[len(LIFTED_PREFIX):] for n in program.state_names if n.startswith(LIFTED_PREFIX)]
        if lifted and e.__cause__ is not None and _LIFTED_TROUBLE.search(str(e.__cause__)):
            # a sweep's number, now one per member, written in place into a tensor forward() makes alike for every
            # member (`buckets += math.log(self.max_distance)`): under vmap that tensor cannot take per-member values
            return ExecutionError(
                f"{str(e).split('; stage inputs were')[0]}. The stage reads numbers the members hold differently "
                f"(lifted per member at {', '.join(lifted[:3])}), and a tensor it makes alike for every member cannot "
                f"take them in place under vmap; run it as a loop: planner.exclude(plan, graph, {program.stage.id!r}) "
                "(or planner.set_options(..., strategy='loop')), or give every member the same value")
        read = [n for n in program.input_names if n in self._input_names]
        if not read or e.__cause__ is None or isinstance(e.__cause__, StagewiseError):
            return e
        if not _INPUT_TROUBLE.search(str(e.__cause__)):  # e.g. no batching rule for a module's configuration
            return e
        if _VMAP_REFUSED.search(str(e.__cause__)):  # not the inputs: an op vmap cannot run, in a stage marked batched
            return ExecutionError(
                f"{str(e).split('; stage inputs were')[0]}: vmap cannot run an op of this stage whatever the inputs. "
                "The planner excludes such ops from batched stages; a plan edited by hand may have put one there "
                f"(planner.validate(plan, planner.trace(model, example_inputs)) names it): run it as a loop, "
                f"planner.exclude(plan, graph, {program.stage.id!r}), or re-plan")
        if "Check the inputs' dtype" in str(e):  # stages.Runner named the input's dtype and the stage's: not a shape
            return InputError(f"{e}. The stage reads model input(s) {read}")
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
            device = next(iter(self._stacked.values())).device.type
            if "not implemented for 'Half'" in str(e):
                raise ExecutionError(f"{str(e).split('. Check')[0]}: this op has no float16 kernel on {device}; use dtype "
                                     "'bfloat16' (planner.set_dtype(plan, 'bfloat16')) or run on CUDA") from e
            if _MIXED_DTYPES.search(str(e)):
                # torch.export baked the trace's float32 into the graph (`h.to(torch.float32)` in an RMSNorm, a cast
                # back to the input's dtype, dtype checks), and the trace in the plan's dtype could not replace them
                why = self.__dict__.get("_precision_refused")
                converted = self.plan.tracer == "export" and any(
                    t.is_floating_point() and t.dtype != LOW_PRECISION[self.plan.dtype]
                    for k, t in self._stacked.items() if k not in (self.__dict__.get("_kept_dtypes") or {}))
                if not why and not converted:  # an fx graph, or the trace in the plan's dtype, casts to float32 there
                    raise ExecutionError(
                        f"{str(e).split('. Check')[0]}: forward() makes float32 values itself (`x.float()`, "
                        f"`.to(torch.float32)`) and hands them to {self.plan.dtype} weights, so member 0 cast to "
                        f"{self.plan.dtype} (`member.to(torch.{self.plan.dtype})`) fails alike; cast to the weights' dtype "
                        f"there (`x.to(self.fc.weight.dtype)`), or keep this plan float32 (planner.set_dtype(plan, "
                        "'float32'))") from e
                why = why or "its state is no longer in that dtype (converted since build: .to(dtype), .double(), .half())"
                raise ExecutionError(
                    f"{str(e).split('. Check')[0]}: this plan was traced with torch.export, which fixes the dtypes the "
                    f"model's casts had at trace time (float32) into the graph, so float32 values meet the {self.plan.dtype} "
                    f"weights; stagewise traced member 0 again in {self.plan.dtype} to take its dtypes, but {why}. Keep this "
                    "plan float32 (planner.set_dtype(plan, 'float32')), or make forward() traceable by torch.fx, whose "
                    "graph casts to the dtype the values have when it runs") from e
            if _LOW_PRECISION_TROUBLE.search(str(e)):  # an op with no kernel for the plan's dtype (fft in bfloat16)
                raise ExecutionError(f"{str(e).split('. Check')[0]}: this op does not run in {self.plan.dtype} on {device}; "
                                     "keep this plan float32 (planner.set_dtype(plan, 'float32'))"
                                     + (" or try 'float16' on CUDA" if self.plan.dtype == "bfloat16" else "")) from e
            raise
        return _cast_floating(out, caller, only=dtype), env  # outputs in the plan's precision; a float64 one stays float64

    def _by_name(self, inputs: tuple, named: dict) -> tuple:
        """Positional inputs and keyword ones as the plan's positional inputs; InputError for a name the plan does not
        take, one given twice, or an input left out (forward()'s defaults beyond the plan's inputs are traced in)."""
        names = list(self._input_names)
        # fx names a placeholder shadowing a Python builtin `input_1` (`forward(self, input, target)`): forward()'s own
        # name is taken for it too, as the members take it
        aliases = {m.group(1): n for n in names if (m := re.fullmatch(r"(.+)_\d+", n)) and m.group(1) not in names
                   and hasattr(builtins, m.group(1))}
        if aliases and any(k in aliases for k in named):
            named = {aliases.get(k, k): v for k, v in named.items()}
        unknown = sorted(k for k in named if k not in names)
        twice = sorted(k for k in named if k in names[:len(inputs)])
        # an input traced as None (`forward(input_ids, attention_mask=None, ..., labels=None)` planned with positional
        # Nones to reach a later one) left out by name takes the None it was traced with, as forward()'s default would
        absent = [k for k in names[len(inputs):] if k not in named]
        defaults_none = self.__dict__.get("_none_by_default", ())
        named = {**named, **{k: None for k in absent if k in self._traced_none and k in defaults_none}}
        missing = [k for k in absent if k not in named]
        if unknown or twice or missing:
            why = (f"keyword(s) {unknown} are not inputs of the plan" if unknown else
                   f"input(s) {twice} given both by position and by name" if twice else
                   f"input(s) {missing} not given")
            raise InputError(f"the batched module takes the plan's inputs {names}, by position or by name; {why}: pass "
                             f"ens({', '.join(names)}) (inputs traced with their default value are part of the graph, "
                             "not inputs)")
        return tuple(inputs) + tuple(named[k] for k in names[len(inputs):])

    def forward(self, *inputs, **named):
        """Shared inputs as one member takes them, per_member ones [N, ...]; returns N-first outputs (one call at a time:
        calls from several threads wait for each other).

        Raises InputError for the wrong number of inputs, a missing member axis, or
        inputs a stage reading them cannot take (wrong shape); ExecutionError when a
        later stage fails, for global module hooks registered since build, or for a
        training flag set by hand to a mode forward() was not traced in (see mode_bound).
        """
        with self.__dict__["_call_lock"]:
            return self._forward(*inputs, **named)

    def _forward(self, *inputs, **named):
        via = named.pop(CAPTURED_CALL, None) if named else None  # executor.capture's module calling through this one
        if named:  # `ens(**batch)`: the plan's inputs by name, in its order
            inputs = self._by_name(inputs, named)
        if global_hooks_present():  # four dict truthiness tests; torch's own watching hooks pass below
            self._refuse_global_hooks()
        if parametrize._cache_enabled:
            raise ExecutionError(
                "the batched module is called inside torch.nn.utils.parametrize.cached(): that cache is keyed by the "
                "parametrized module torch made first, which the batched module's copies share with member 0, so members "
                "would read (and write) member 0's cached weights. Call it outside the cached() block (it computes each "
                "member's parametrized weights once per call anyway)")
        if self.training in self._mode_refused:  # the flag set by hand (train() refuses before it sets it)
            raise self._mode_refused_now()
        if self.__dict__.get("_grad_mode_refused"):  # forward() reads the grad mode (a module pickled before: absent)
            self._check_grad_mode(inputs)
        if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            warnings.warn(AUTOCAST_WARNING, stacklevel=5)  # the caller, past nn.Module.__call__ and forward()
        if self._state_replaced[0]:
            self._follow_replaced_state()
        if self.__dict__.get("_globals_read"):  # module-level settings forward() reads, baked at build: changed?
            self._check_globals()
        if self.__dict__.get("_configs_held"):  # configuration objects the members hold (`self.config`): changed?
            self._check_configs()
        if self.__dict__.get("_value_reads") is not None:  # forward() reads buffer values: changed since build?
            self.__dict__["_value_reads"].check(self._stacked)
            self.__dict__["_value_reads"].refuse_trained_reads(self)  # (a layer in training: by .train() or by hand)
        if via is not None:  # `fast = executor.capture(ens)`: its graphs, after this module's checks and hooks
            return via.replay(*inputs)
        captured = self.__dict__["_captured"]
        if captured is not None and not self.training and not (torch.is_grad_enabled() and self._records_grad()):
            try:
                return getattr(captured, "replay", captured)(*inputs)
            except NotCapturableError as e:
                warnings.warn(f"the plan asks for whole-plan capture, but {e}; running stage by stage from now on",
                              RuntimeWarning, stacklevel=2)
                self.__dict__["_captured"] = None
        if self.__dict__.get("_checkpointed_norms") and self.training and torch.is_grad_enabled():
            return self._run_recomputing_norms(inputs)
        if self.plan.dtype == "float32":  # the common case, straight to the stages (run_stages casts for the others)
            return self._run_plain(*inputs)[0]
        return self.run_stages(*inputs)[0]

    def _run_recomputing_norms(self, inputs: tuple) -> Any:
        """One call where the members run normalisation layers inside a torch.utils.checkpoint region: eager torch
        recomputes the region when backward runs a node of it, so each such layer that updated its statistics in the
        call updates them a second time with the same batch statistics (num_batches_tracked counts 2 per step), on
        each backward through the region. The batched module runs the region once; two gradient hooks apply the
        second update to each member that updated, from the batch term this call added (exact to rounding): one on
        the outputs computed from the layer, then one on what the layer's statistics are computed from (its state and
        what comes before it, inputs included) within the same backward, which then ran through the region. A layer
        called more than once per call (or inside a region and outside it) is refused: its updates cannot be told
        apart after the call."""
        named = dict(zip(self._input_names, inputs))
        before = []
        for path, momenta, counts, leaves, state, input_names, again in self._checkpointed_norms:
            if again and self.stacked.get_submodule(path).training:
                raise ExecutionError(
                    f"{path} updates running statistics inside a torch.utils.checkpoint region and is called more than "
                    "once per call (or outside the region too): eager torch recomputes the region in backward and "
                    "updates those statistics once more per call inside it, which the batched module cannot repeat "
                    "call by call. Train with the layer called once inside the region, or keep it out of checkpointed "
                    "regions (the batched module saves no memory there); inference, and evaluation mode, are unaffected")
            keys = [f"{path}.{k}" for k in ("running_mean", "running_var", "num_batches_tracked")]
            if all(k in self._stacked for k in keys):
                sources = [self._stacked[k] for k in state if k in self._stacked and self._stacked[k].requires_grad]
                sources += [t for name in input_names for t in tree_flatten(named.get(name))[0]
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                before.append((momenta, counts, leaves, sources, *(self._stacked[k] for k in keys),
                               *(self._stacked[k].detach().clone() for k in keys)))
        out = self._run_plain(*inputs)[0] if self.plan.dtype == "float32" else self.run_stages(*inputs)[0]
        flat = tree_flatten(out)[0]
        for momenta, counts, leaves, sources, mean, var, count, mean0, var0, count0 in before:
            # per member: a layer in eval mode (set by hand) updated nothing
            updated = (count != count0) if counts else ((mean != mean0) | (var != var0)).flatten(1).any(1)
            if not sources or not bool(updated.any()):
                continue  # (nothing records a gradient through the region: torch recomputes nothing)
            with torch.no_grad():  # per member: momentum · the batch's statistics, or (momentum None: a cumulative
                # average) the batch's statistics themselves, n·new - (n-1)·old
                cumulative = torch.tensor([m is None for m in momenta], device=mean.device).unsqueeze(-1)
                momentum = torch.tensor([0.0 if m is None else m for m in momenta], dtype=mean.dtype,
                                        device=mean.device).unsqueeze(-1)
                n = count.to(mean.dtype).unsqueeze(-1)
                batch = tuple(torch.where(cumulative, n * new - (n - 1) * old, new - (1 - momentum) * old)
                              for new, old in ((mean, mean0), (var, var0)))
            if leaves is not None and len(flat) != len(self._output_leaves):
                leaves = None  # (outputs in another structure than traced: every one)
            outputs = [t for i, t in enumerate(flat) if (leaves is None or i in leaves)
                       and isinstance(t, torch.Tensor) and t.requires_grad]
            if not outputs:
                continue
            term = [(momentum, cumulative, mean, var, count if counts else None, updated, batch)]
            torch.autograd.graph.register_multi_grad_hook(outputs, functools.partial(_reached_output, term), mode="any")
            torch.autograd.graph.register_multi_grad_hook(sources, functools.partial(_reached_region, term), mode="any")
        return out

    def __deepcopy__(self, memo: dict) -> "BatchedModule":
        """A copy with its own stacked state (EMA / SWA copies, the best model so far). The loop stages' per-member views
        are not graph leaves, which torch cannot deepcopy: the copy makes its own from its state."""
        if self._state_replaced[0]:  # (after torch.func.functional_call: the transform's tensors, read anew)
            self._follow_replaced_state()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k in _IMMUTABLE:
                new.__dict__[k] = v
            elif k not in _MADE_FROM_STATE:
                new.__dict__[k] = copy.deepcopy(v, memo)
        new._stacked = {k: tree_tensor(new.stacked, k) for k in self._stacked}
        new.stacked.__dict__["_modes"][0] = new
        new._build_runners()
        new._make_captured()
        watch_stacked_parameters(new)
        return new

    def __getstate__(self) -> dict:
        """Pickled (torch.save(ens)) without what is made from the state (runners, per-member views, the capture):
        __setstate__ makes them again, as a deepcopy does. torch.export's guard function does not pickle: a loaded
        module checks its inputs against the plan's traced shapes (check_call_inputs) without it."""
        if self._state_replaced[0]:  # (after torch.func.functional_call: the transform's tensors, read anew)
            self._follow_replaced_state()
        state = {k: v for k, v in self.__dict__.items() if k not in _MADE_FROM_STATE}
        if self.plan.tracer == "export":
            _refuse_unloadable_graphs(state)
        if state.get("_input_guard") is not None:
            try:
                pickle.dumps(state["_input_guard"])
            except Exception:  # a local function of torch.export: pickling it fails after torch.save emptied the file
                state["_input_guard"] = None
        if state.get("_configs_held"):
            try:
                pickle.dumps(state["_configs_held"])
            except Exception:  # noqa: BLE001 - a config class defined in a function: the loaded module watches none
                state["_configs_held"] = ()
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._stacked = {k: tree_tensor(self.stacked, k) for k in self._stacked}
        if "_modes" in self.stacked.__dict__:  # (a module pickled before nodes followed modes: none)
            self.stacked.__dict__["_modes"][0] = self
        self._build_runners()
        self._make_captured()
        watch_stacked_parameters(self)

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
        member loop fires them on every module call, the batched module cannot (its forward refuses them too);
        ExecutionError at a call that records gradients for members that freeze different parameters
        (members.frozen_apart: inference runs); InputError for a model input
        forward() writes in place where the batched module cannot repeat the loop's writes (check_input_writes).
    """
    refusal = global_hooks_refusal("the batched module") or next(
        (r for m in (members if isinstance(members, (list, tuple)) else ()) if isinstance(m, nn.Module)
         for r in [quantized_state_refusal(m)] if r), None)
    if refusal:
        raise MemberError(refusal)
    # the members went through registration hooks; the modules made here from them must not. Outside inference mode:
    # state stacked inside it would be inference tensors, which no later training call (and no version check) can use
    # (torch.inference_mode(False) turns gradients on: traced with them on, whatever the caller's mode)
    with registration_hooks_off(), torch.inference_mode(False):
        return _build(plan, member_list(members, "executor.build"), example_inputs, device, check_memory)


def _build(plan: Plan, members: list[nn.Module], example_inputs: tuple | None, device: str | torch.device | None,
           check_memory: bool) -> BatchedModule:
    dev = resolve_device(device)
    if len(members) != plan.n_members:
        raise MemberError(
            f"the plan is for {plan.n_members} members but {len(members)} were given; "
            f"pass {plan.n_members} members or use plan.with_n_members({len(members)})"
        )
    check_one_device(members)
    budget.check_fits(len(members), budget.state_bytes(members[0]), dev, f"stacking the state of {len(members)} members",
                      "set chunk_size on large stages for their activations, or use another device", check_memory)
    # a private copy: the stage modules keep the traced submodules, and .to()/.double() on the
    # batched module must not move or convert the caller's member 0
    # the traced shapes, not the caller's: an export graph is specialised to them, so another shape
    # would trace another graph; the batched module then checks each call against them
    private = copy_member(members[0], 0, "stagewise builds from a private copy of it")
    # made where member 0 lives: an export retrace of a CUDA member on CPU zeros failed ("two different devices")
    example = example_inputs_from(plan.inputs, state_device(private)) or example_inputs
    unknown = [s for s in plan.inputs if s.dtype is not None and s.shape is None and s.dtype != "NoneType" and s.value is None]
    if example is None and plan.tracer == "export" and unknown:  # a str argument (a head name, a mode): not recorded
        raise TraceError(
            f"this plan was traced with torch.export, which fixed its input {unknown[0].name!r} (a Python "
            f"{unknown[0].dtype}) at the value it was traced with, and the plan records no such value: pass the inputs it "
            f"was traced with, executor.build(plan, members, example_inputs=(...)), and call the module with that "
            f"{unknown[0].name!r} (another value needs a plan of its own)")
    with _grad_mode_reads(private) as reads:
        graph = retrace(private, plan.tracer, example, [i.name for i in plan.inputs], plan.opened_modules)
    traced_with_grad = True
    if graph.fingerprint != plan.fingerprint:  # planned inside torch.no_grad()? export then records none of forward()'s
        # own no_grad regions (Hugging Face's rotary embedding), and a branch on the grad mode takes its other side
        with torch.no_grad(), _grad_mode_reads(private) as reads_off:
            other = retrace(private, plan.tracer, example, [i.name for i in plan.inputs], plan.opened_modules)
        if other.fingerprint == plan.fingerprint:
            graph, traced_with_grad, reads = other, False, reads_off
    if graph.fingerprint != plan.fingerprint and persistence_only(graph.gm, plan.opened_modules, plan.fingerprint):
        graph.fingerprint = plan.fingerprint  # the same graph: one buffer in the state_dict or not (members deep-copied)
    if graph.fingerprint != plan.fingerprint:
        cast = {str(p.dtype).removeprefix("torch.") for p in members[0].parameters() if p.is_floating_point()}
        if plan.dtype in LOW_PRECISION and cast == {plan.dtype}:
            raise PlanMismatchError(
                f"these members are in {plan.dtype} already, and the plan ({plan.dtype} by planner.set_dtype) was made "
                f"from float32 ones: the batched module casts float32 members to {plan.dtype} itself. Pass the float32 "
                f"members, or plan from the {plan.dtype} members as they are")
        raise PlanMismatchError(
            f"the plan's fingerprint {plan.fingerprint} does not match these members' {graph.fingerprint} "
            f"({_first_difference(plan, graph, private, example)}); the plan was made for another model, or for this one by an earlier "
            "stagewise that traced it otherwise (out= writes now trace as copy_): re-plan with `stagewise plan`"
        )
    _check_small_sizes(plan, graph, private, example)
    # the member traced again below (its modes, the members' numbers, the plan's dtype) in the mode the plan was
    with torch.set_grad_enabled(traced_with_grad):
        validate(plan, graph)
        # judged by these members' graph, not by the verdicts the plan recorded (constants and modes are not in the
        # fingerprint; a file's reasons may be edited): compile and wide read the excluded stages' reasons from here
        plan = with_fresh_verdicts(plan, graph, example)
        first_code = None
        if graph.gm.meta.get(BUFFER_VALUE_READS):  # before the graph is edited below
            first_code = _members_trace_alike(members, private, plan, example, graph)
        grad_mode_refused = _grad_modes_refused(reads, private, plan, example, graph.fingerprint, traced_with_grad)
        if traced_with_grad and "grad" not in grad_mode_refused and example is not None:
            # a plan traced for inference (inside torch.no_grad(), whose graph is often the one traced with
            # gradients): a hook on an autograd node only a call with gradients sets shows in member 0's own
            # backward against the graph's (planner.graph.gradients_refusal; the trace checked this with gradients on).
            # A graph only a trace without gradients gives refuses such calls already (the call's check names why)
            why = gradients_refusal(private, graph.gm, example)
            if why:
                grad_mode_refused["grad"] = why
        written = check_input_writes(private, graph, plan, example)
        aliasing = aliasing_of(members, graph.gm)  # the members' own tensors: a private copy does not keep their aliasing
        always, in_training = written_state(graph.gm)
        # leaf modules in training mode now update their buffers on every call; the others once .train() is called
        training_now = {k for k, owner in in_training.items() if members[0].get_submodule(owner).training}
        refused = aliasing.build_refusal(always) or aliasing.training_mode_refusal(training_now)
        if refused:
            raise MemberError(refused)
        bound = mode_bound(private, graph, plan, example)  # before the graph is edited below (lifted constants)
        register_output_dataclasses(graph.gm)
        stacked = stack_member_state(members, dev)
        # a sweep's members differ in numbers the trace baked in: give each member its own (or refuse)
        per_member = lift_member_constants(graph, members, plan.tracer, example, [i.name for i in plan.inputs], set(stacked),
                                           opened=plan.opened_modules)
        stacked.update({k: v.to(dev) for k, v in per_member.items()})
        # a torch.export graph in bfloat16/float16: the dtypes it baked in at float32 taken from a trace in that dtype (after
        # the float32 comparisons above: members' constants are told apart, and modes compared, at one dtype)
        precision_refused, kept_dtypes = take_dtypes_of_a_trace_in(graph, plan, private, LOW_PRECISION[plan.dtype], example) \
            if plan.tracer == "export" and plan.dtype in LOW_PRECISION else ("", {})
        if precision_refused:  # the float32 trace runs as it is: it may fail (float32 meets the weights) or not
            warnings.warn(
                f"a {plan.dtype} plan of a torch.export graph: stagewise traced member 0 again in {plan.dtype} to take the "
                f"dtypes and dtype-dependent constants torch.export fixed at float32, but {precision_refused}. The float32 "
                f"trace's run in {plan.dtype} instead: torch.finfo(torch.float32).min becomes -inf there (NaN in a fully "
                "masked softmax row), and an element size or a cast back to the input's dtype stays float32's. Check the "
                "plan with executor.verify, or keep it float32 (planner.set_dtype(plan, 'float32'))", stacklevel=3)
    apart = ties_apart(members)
    written_tie = next((tie for tie in apart if set(tie.split(" = ")) & always), None)
    if written_tie is not None:
        raise MemberError(
            f"members tie parameters differently ({written_tie} in members {apart[written_tie]}, not in the others), and "
            "forward() writes one of them in place (an nn.Embedding(max_norm=) renormalising the rows it reads, an "
            "in-place update): the batched module stacks the two names apart, so the write would not reach the other "
            "name as it does in a member that ties them. Give the members one tying, or write no weight in forward()")
    merged = [tie for tie, tying in apart.items() if 0 in tying]
    if plan.tracer == "export" and merged:
        # torch.export gives a tie of the member it traces one graph input: both names read member 0's one tensor,
        # and a member holding two would run with one of them in place of the other
        untied = next((i for i in range(len(members)) if all(i not in apart[t] for t in merged)), None)
        first = f"member {untied}: its graph reads both names" if untied is not None else "its graph reads both names"
        raise MemberError(
            f"members tie parameters differently ({merged[0]} in members {apart[merged[0]]}, not in the others), and "
            "torch.export's graph of member 0, which ties them, reads one tensor for both names: the other members "
            f"would run with one weight in place of the other. Put a member that does not tie them first ({first}) "
            "and plan from it, or make the model traceable by torch.fx")
    drifting = _low_precision_state_written(graph, plan, stacked)
    if drifting:
        warnings.warn(low_precision_state_warning(plan.dtype, drifting), stacklevel=3)
    # norm layers in eval now whose statistics .train() would start updating: said then
    later = [k for k in _low_precision_state_written(graph, plan, stacked, in_training=True) if k not in drifting]
    traced_through = _fast_path_modules_traced_through(members[0], plan)
    if traced_through:
        warnings.warn(
            f"the plan's graph runs torch's {traced_through} as the ops it traced ({'torch.export' if plan.tracer == 'export' else 'opened'}): "
            "called in eval mode without gradients, torch's own module takes a fast path that answers otherwise where "
            "a mask pads (nn.TransformerEncoder zeroes padded positions) or masks out a whole row (NaN), and the "
            "batched module gives the traced ops' answer there. Check with executor.verify on padded inputs, or let "
            "torch.fx keep these modules closed (planner.trace without opening them), whose plan follows torch's paths",
            stacklevel=3)
    params = {k: p.requires_grad for k, p in members[0].named_parameters(remove_duplicate=False)}
    module = BatchedModule(plan, graph, stacked, dev, params=params, member_keys=list(members[0].state_dict()))
    extra = [{k: copy.deepcopy(v) for k, v in m.state_dict().items() if k.rpartition(".")[2] == "_extra_state"}
             for m in members] if any(k.rpartition(".")[2] == "_extra_state" for k in module._member_keys) else None
    module.__dict__["_extra_states"] = extra
    bound.update(_numbers_by_mode(members, private, plan, example, bound, per_member, set(stacked) - set(per_member)))
    module.set_mode_bound(bound, private)
    module.__dict__["_own_train_modes"], module.__dict__["_own_train_grads"] = own_train_modes(private, params)
    # layers whose mode differs from the root's and no train() override of the class sets so: set by hand
    explained = module.__dict__["_own_train_modes"].get(private.training, {})
    module.__dict__["_modes_set_by_hand"] = tuple(name for name, m in private.named_modules()
                                                  if m.training != private.training and name not in explained)
    # .train() follows the class's train() override (set_train_modes): a layer it keeps in eval (a shared frozen
    # BatchNorm backbone) updates nothing in training, as in the member loop
    kept_in_eval = {name for name, flag in module.__dict__["_own_train_modes"].get(True, {}).items() if not flag}
    training_refused = aliasing.training_mode_refusal({k for k, owner in in_training.items() if owner not in kept_in_eval})
    eval_only = graph.gm.meta.get("stagewise_eval_only_differences")
    if eval_only and not training_refused:  # accepted in eval mode, where they do nothing
        training_refused = (f"members differ in dropout rates, {'; '.join(eval_only[:3])}, which do nothing in eval mode "
                            "but would all run as member 0's in training (the traced graph holds one rate); to train "
                            "them batched, give the members one rate")
    if training_refused:  # such a leaf in eval mode: .train() would put it in training mode, and is refused (a call with
        # the flag set by hand leaves every layer's own mode as it is)
        module.__dict__["_training_state_refused"] = training_refused
        module._mode_bound[True] = training_refused
    # the same, layer by layer: train() on a node of the state tree (`ens.stacked.bn.train()`, MC dropout's walk
    # over ens.modules()) puts only that layer in training mode, and is refused where that layer is one of these
    refused_layers: dict[str, str] = {}
    for owner in sorted({owner for owner in in_training.values() if owner not in kept_in_eval}):
        why = aliasing.training_mode_refusal({k for k, o in in_training.items() if o == owner})
        if why:
            refused_layers[owner] = why
    for layer, difference in zip(graph.gm.meta.get("stagewise_eval_only_layers", ()), eval_only or ()):
        refused_layers.setdefault(layer, f"members differ in its dropout rate ({difference}), which does nothing in "
                                         "eval mode but would run as member 0's in training (the traced graph holds "
                                         "one rate); to run it in training batched, give the members one rate")
    module.__dict__["_training_refused_layers"] = refused_layers
    module.__dict__["_aliased_params"] = aliasing.parameters()
    module.__dict__["_grad_mode_refused"] = grad_mode_refused
    module.__dict__["_traced_without_grad"] = not traced_with_grad
    module.__dict__["_shared_across"] = shared_across_members(members)
    module.__dict__["_load_aliased"] = aliasing.load_refusals(module._stacked)  # what the in-place loads must not part
    module.__dict__["_frozen_apart"] = frozen_apart(members)  # trains member 0's choice for all: refused in training
    module.__dict__["_frozen_apart_flags"] = frozen_apart_flags(members)  # ... while the stacked flag stays member 0's
    module.__dict__["_ties_apart"] = apart
    module.__dict__["_grad_hooks"] = gradient_hooks(members)
    module.__dict__["_learnable_attributes"] = _learnable_attributes(members[0], graph.gm, module._stacked)
    module.__dict__["_branching_modules"] = _branching_modules(members[0], module.stage_modules)
    module.__dict__["_load_hooks"] = _load_hooks(members[0])
    _warn_stacked_elsewhere(module, members)
    # norms that eager torch recomputes in backward (inside a torch.utils.checkpoint region): the loop updates their
    # statistics twice per backward, which the batched module repeats (BatchedModule._run_recomputing_norms)
    checkpointed = norms_in_checkpoints(private, example) if example is not None else None
    if checkpointed is None and updating_norms(private) and "checkpoint" in _names_used_by_classes(members[0])[0]:
        warnings.warn(CHECKPOINTED_NORMS_UNKNOWN.format(model=type(members[0]).__name__), UserWarning, stacklevel=3)
    module.__dict__["_checkpointed_norms"] = tuple(
        _checkpointed_norm(members, path, graph, module._output_leaves, module._stacked, again, region)
        for path, (again, region) in (checkpointed or {}).items())
    mirror_layer_classes(module.stacked, members[0])
    module.__dict__["_globals_read"] = _globals_read(members[0])  # module-level settings forward() reads: baked
    module.__dict__["_configs_held"] = _configs_held(members)  # and the configuration objects they hold
    try:  # forward()'s parameters whose default is None (a by-name call may leave out one traced as None)
        module.__dict__["_none_by_default"] = frozenset(
            k for k, p in inspect.signature(members[0].forward).parameters.items() if p.default is None)
    except (TypeError, ValueError):
        module.__dict__["_none_by_default"] = frozenset()
    module.__dict__["_lost_backwards"] = graph.gm.meta.get("stagewise_lost_backwards", ())
    module.__dict__["_written_inputs"] = written  # per_member inputs forward() writes in place
    module.__dict__["_precision_refused"] = precision_refused  # why the export graph kept its float32 dtypes
    module.__dict__["_kept_dtypes"] = kept_dtypes  # stage constants .to() must not cast (made in forward())
    module.__dict__["_low_precision_later"] = later
    module.runners = module.runners  # re-make the steps and the gradient checks with it
    module.training = members[0].training  # the flag alone: each stage module keeps the mode it was traced in
    if plan.dtype in LOW_PRECISION:
        complex_state = [k for k, t in module._stacked.items() if t.is_complex()]
        if complex_state:  # Module.to(bfloat16) keeps the real part alone (float16), or makes what no op takes
            raise PlanMismatchError(
                f"the plan computes in {plan.dtype} (planner.set_dtype), and the members hold complex state "
                f"({', '.join(complex_state[:3])}), which {plan.dtype} cannot hold: casting it would drop the imaginary "
                "part. Keep the plan in float32 (planner.set_dtype(plan, 'float32')), or hold the complex values as "
                "two real tensors")
        module.to(LOW_PRECISION[plan.dtype])  # once: stacked state and stage constants (see LOW_PRECISION)
    # member state forward() writes in place on a call (always, and in training the norms' statistics): an input on
    # its memory is refused (BatchedModule._check_apart_from_written_state)
    written_always = tuple(sorted({*always, *(k for p in module.programs for k in p.written_state)}))
    module.__dict__["_written_always"] = written_always
    module.__dict__["_written_keys"] = tuple(sorted({*written_always, *in_training}))
    if first_code is not None:
        module.__dict__["_value_reads"] = _ValueReadWatch(private, plan, module._stacked, always, in_training,
                                                          graph.gm.meta[BUFFER_VALUE_READS], first_code,
                                                          graph.gm.meta.get(REAL_BUFFERS, ()),
                                                          graph.gm.meta.get(READ_BUFFERS))
    return module


def low_precision_state_warning(dtype: str, names: list[str]) -> str:
    return (f"a {dtype} plan keeps the state forward() updates in {dtype}, as member.to(torch.{dtype}) would "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): with {'8' if dtype == 'bfloat16' else '11'} "
            f"bits of precision a running average with a small momentum, or a count, stops moving after some calls (a "
            f"{dtype} count of ones stops at {'256' if dtype == 'bfloat16' else '2048'}), so that state drifts from a "
            "float32 member loop's over a long run, which executor.verify's few calls do not show. Keep such a model "
            "float32, or compare the state after a realistic number of calls")


def _low_precision_state_written(graph: ModelGraph, plan: Plan, stacked: dict[str, torch.Tensor],
                                 in_training: bool = False) -> list[str]:
    """Floating buffers forward() updates (in-place writes to the model's state, BatchNorm statistics, an
    Embedding's renormalised rows), where the plan's dtype is bfloat16/float16: they are kept in that dtype.
    `in_training`: the norm layers' statistics as train() would have them update (those in eval count then)."""
    if plan.dtype not in LOW_PRECISION:
        return []
    from stagewise.planner.graph import _NORMS_WITH_STATISTICS, _state_writers

    def updates(node: torch.fx.Node) -> bool:  # a norm layer in eval updates nothing (train() later: its own call)
        layer = graph.gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        return in_training or not (isinstance(layer, _NORMS_WITH_STATISTICS) and not layer.training)

    written = {str(alias_chain(n.args[0])[-1].target) for n in graph.gm.graph.nodes
               if is_inplace(n) and n.args and isinstance(n.args[0], torch.fx.Node) and alias_chain(n.args[0])[-1].op == "get_attr"}
    written |= {t for node, targets in _state_writers(graph.gm) if updates(node) for t in targets}
    # what a region op's subgraph writes (torch.export's torch.no_grad() block updating a running mean)
    written |= {str(a.target) for n in graph.gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)
                and _region_writes(graph.gm, n) for a in n.all_input_nodes if a.op == "get_attr"}
    params = set(dict(graph.gm.named_parameters()))
    return sorted(k for k in written if k in stacked and k not in params and stacked[k].is_floating_point())


def _mark_views_written_later(programs: list[StageProgram], gm: torch.fx.GraphModule,
                               stage_of: dict[str, str]) -> list[StageProgram]:
    """Set `views_written_later` on the programs handing on a view of one of their inputs (through view-like calls
    the graph shows) that an in-place op of a later stage writes: run on per-member values, such a stage runs member
    by member (see _Writes), so the view is of the member's own tensor and the write reaches what else reads it."""
    chains = [(n, set(alias_chain(n.args[0]))) for n in gm.graph.nodes if is_inplace(n) and n.args
              and isinstance(n.args[0], torch.fx.Node)]
    # and the operands a torch.export region writes (`with torch.no_grad(): v.clamp_(0, 1)` on a view handed in)
    chains += [(n, set(alias_chain(w))) for n in gm.graph.nodes for w in region_written_operands(gm, n)]
    if not chains:
        return programs
    nodes = {n.name: n for n in gm.graph.nodes}
    marked = []
    for p in programs:
        own = set(p.stage.nodes)
        hit = False
        for name in p.output_names:
            chain = alias_chain(nodes[name])
            if len(chain) > 1 and any(c.name not in own for c in chain[1:]):  # a view of what came in
                hit = any(nodes[name] in aliases and stage_of.get(w.name) != p.stage.id for w, aliases in chains)
            if hit:
                break
        marked.append(dataclasses.replace(p, views_written_later=True) if hit else p)
    return marked


def _unchunk_views_written_later(programs: list[StageProgram], gm: torch.fx.GraphModule,
                                 stage_of: dict[str, str]) -> list[StageProgram]:
    """The programs with `chunk_size` off where the stage hands on a view (of state, an input or one of its own values:
    `self.buf[0]`, `x[:, :4]`, `h.t()`) that an in-place op of another stage writes, with a warning. vmap with a
    chunk_size concatenates the chunks' results, so such an output is a new tensor, not a view, and the write would
    miss the stacked buffer, the caller's input or the stage's other outputs (1.13 off). chunk_size only bounds
    memory: the stage runs as one vmap."""
    if not any(p.stage.options.chunk_size for p in programs):
        return programs
    key = lambda n: ("attr", str(n.target)) if n.op == "get_attr" else n.name  # noqa: E731 - a buffer by its name
    writes = [(stage_of.get(n.name), {key(a) for a in alias_chain(n.args[0])}) for n in gm.graph.nodes
              if is_inplace(n) and n.args and isinstance(n.args[0], torch.fx.Node)]
    writes += [(stage_of.get(n.name), {key(a) for a in alias_chain(w)}) for n in gm.graph.nodes
               for w in region_written_operands(gm, n)]
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for p in programs:
        if p.stage.options.chunk_size:
            hit = next((name for name in p.output_names for chain in [alias_chain(nodes[name])] if len(chain) > 1
                        and any(sid != p.stage.id and {key(c) for c in chain} & written for sid, written in writes)), None)
            if hit is not None:
                warnings.warn(f"stage {p.stage.id}: chunk_size={p.stage.options.chunk_size} is not applied: the stage hands "
                              f"on {hit!r}, a view that another stage writes in place, and a chunked vmap hands on "
                              "concatenated copies instead, which that write would miss; the stage runs as one vmap",
                              stacklevel=3)
                p = dataclasses.replace(p, stage=dataclasses.replace(
                    p.stage, options=dataclasses.replace(p.stage.options, chunk_size=None)))
        out.append(p)
    return out


@dataclasses.dataclass(frozen=True)
class _Writes:
    """How the inputs of a stage that writes in place are handed to it, so that every write lands where the member
    loop's would: in the value itself, seen by every other value sharing its storage (a view taken before, its base)."""

    into_shared: frozenset[str]  # inputs that become [N, ...] copies when shared (a loop would write N times into one)
    loop: Runner  # the stage run member by member: the stage's own runner if it is a loop, else made on first need
    views_out: bool  # an output may be a view of a written input: it must view the input itself, not a copy
    untracked: bool  # a write goes through `.data`, which moves no version counter: copies are written back anyway

    @staticmethod
    def of(program: StageProgram, runner: Runner) -> "_Writes | None":
        if not (program.writes_in_place or program.views_written_later):
            return None
        # a write by an op's name may reach an input through calls the graph does not show as views: all inputs
        into = frozenset(program.input_names if program.writes_by_name else program.written_inputs) \
            if program.writes_in_place else frozenset()
        return _Writes(into, runner if isinstance(runner, LoopRunner) else None,
                       program.outputs_view_written or program.views_written_later, program.writes_untracked)

    def inputs(self, env: dict[str, Any], names: Sequence[str], args: list, runner: Runner, n: int) -> tuple[list, list, Runner]:
        """(the stage's arguments, the stacked copies to write back after it ran, the runner to run it with).

        Shared inputs it writes become [N, ...] copies, in `env` too (later stages read the written values).
        A loop stage gets per-member values as they are: each member writes its own tensors, as the loop does.
        A batched strategy gets stacked copies of them; after the run, each copy the stage wrote (its version
        counter moved) is written back into the members' tensors, where every value viewing them sees it. Where
        per-member values share storage (h and v = h[:, :3] both handed on, or one tensor every member holds),
        separate copies would part what one write reaches; where an output may be a view of a written input, it
        would be a view of the copy, which later writes into the input miss; and a write through `.data` moves no
        version counter, so it would not be written back: the stage then runs member by member (`_loop_of`) on the
        values themselves."""
        device = runner.device_for(args)
        per_member = [k for k, a in enumerate(args) if type(a) is PerMember]
        if per_member and self.loop is not runner and (self.views_out or self.untracked
                                                       or _storage_shared([args[k] for k in per_member])):
            runner = self._loop_of(runner)
        out, copies = list(args), []
        for k, (name, a) in enumerate(zip(names, args)):
            if type(a) is PerMember:
                if isinstance(runner, LoopRunner):
                    continue
                b = as_batched(a, n, device)
                leaves = tree_flatten(b.tree)[0]  # every leaf, as the members' trees have them (a number: a [N] tensor)
                if not _shares_storage(_tensor_leaves(leaves), a.values[0]):  # rows of stacked state: written as such
                    copies.append((b, a, [_version(x) for x in leaves]))
                out[k] = b
            elif name in self.into_shared:
                out[k] = env[name] = as_batched(a, n, device)
        if isinstance(runner, LoopRunner) and torch.is_grad_enabled():
            out = self._own_rows(out, names, copies, n)
        return out, copies, runner

    def _own_rows(self, args: list, names: Sequence[str], copies: list, n: int) -> list:
        """For a loop, each member's own copy of the memory its values share with other members' (own_storage):
        rows of one tensor share its version counter, so an op that saves a value for backward (ReLU(inplace=True),
        a Linear reading `r` before `h.mul_(2)` writes it) would find it changed by the next member's write. The
        copies a member wrote are written back after the run (`_write_back`), and outputs viewing a copy are made
        the same views of the original (`outputs`)."""
        written = [k for k, name in enumerate(names) if name in self.into_shared]
        out, stretches = own_storage(args, n, written, always=self.untracked)
        copies += stretches
        return out

    def outputs(self, outs: list, copies: list) -> list:
        """`outs` with every per-member tensor that views a member's own copy of its memory (`_own_rows`) made the
        same view of the original, which the copy was written back into: later writes into the value reach it."""
        stretches = [c for c in copies if isinstance(c, OwnStretch)]
        if not stretches:
            return outs
        back = as_original(stretches)
        return [PerMember([tree_map(back, v) for v in o.values]) if type(o) is PerMember else o for o in outs]

    def _loop_of(self, runner: Runner) -> Runner:
        if self.loop is None:
            from stagewise.executor.strategies import BoundLoopRunner  # the strategies import this module's neighbours
            object.__setattr__(self, "loop", BoundLoopRunner(runner.program, runner.n_members, runner.stacked,
                                                             runner.member_states))
        return self.loop


def _none_inside(value: Any, path: str = "") -> str:
    """Where the first None inside a dict, list or tuple `value` sits (`['mask']`, `[1]`); "" for none."""
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        return ""
    for key, v in items:
        found = path + key if v is None else _none_inside(v, path + key)
        if found:
            return found
    return ""


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]


def _storage_of(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # torch.func's wrappers hold no storage of their own
        return None


def _storage_shared(values: list[PerMember]) -> bool:
    """Whether two tensors among the per-member `values` (any member, any leaf) share storage, or one has none we can see."""
    seen: set[int] = set()
    for v in values:
        for member in v.values:
            for x in _tensor_leaves(member):
                ptr = _storage_of(x)
                if ptr is None or ptr in seen:
                    return True
                seen.add(ptr)
    return False


def _shares_storage(leaves: list[torch.Tensor], member: Any) -> bool:
    mine = {_storage_of(x) for x in leaves}
    return any(_storage_of(x) in mine for x in _tensor_leaves(member))


def _version(x: Any) -> int | None:
    """`x`'s version counter, which moves when it is written; -1 for an inference tensor (made under
    torch.inference_mode(), which keeps none: always written back); None for a non-tensor (never)."""
    if not isinstance(x, torch.Tensor):
        return None
    return -1 if x.is_inference() else x._version


def _write_back(copies: list, state: set[int] = frozenset()) -> None:
    """After a stage ran on copies of its inputs (_Writes.inputs), write each copy it wrote into the values it copied:
    (stacked copy, the members' tensors, each leaf's version before the run) or a member's own copy of its memory
    (own_storage.OwnStretch). Leaves pair by position in the value's tree (the members' trees and the stacked one
    have one structure). A stacked leaf is written back where its version moved, always where it was -1 (an
    inference tensor, made under torch.inference_mode(), which keeps none), never where None (not a tensor)."""
    own_storage_write_back([c for c in copies if isinstance(c, OwnStretch)], state)
    for entry in copies:
        if isinstance(entry, OwnStretch):
            continue
        copy_, original, versions = entry
        for j, (x, v) in enumerate(zip(tree_flatten(copy_.tree)[0], versions)):
            if v is not None and (v == -1 or x._version != v):
                for i, member in enumerate(original.values):
                    target = tree_flatten(member)[0][j]
                    if isinstance(target, torch.Tensor):
                        root = target._base if target._base is not None else target
                        if root.is_leaf and root.requires_grad:  # a parameter written in place (a max_norm lookup
                            with torch.no_grad():  # renormalises its rows under no_grad): written as the member's was
                                target.copy_(x[i])
                        else:
                            target.copy_(x[i])


def _plain_containers(x: Any) -> Any:
    """`x` with torch.fx's immutable_list / immutable_dict (what a graph's output node holds) as plain list / dict,
    as the model itself returns them (they cannot be changed, and their pytree type differs)."""
    if type(x) in (list, immutable_list):
        return [_plain_containers(v) for v in x]
    if type(x) in (dict, immutable_dict):
        return {k: _plain_containers(v) for k, v in x.items()}
    if type(x) is tuple:
        return tuple(_plain_containers(v) for v in x)
    return x


def _data_ptr(t: torch.Tensor) -> int | None:
    """`t.data_ptr()`, or None for a tensor with no storage of its own (torch.func's wrappers: functional_call of
    the batched module inside torch.func.grad puts them into the state tree)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def check_member_folder(folder: Path, n_members: int) -> None:
    """OutputFileError where `folder` cannot take the files of `n_members` members: it is a file, or it holds member
    files of a larger set, which a later load of the folder would mix with these."""
    if folder.exists() and not folder.is_dir():
        raise OutputFileError(f"cannot save member weights into {folder}: it is a file, not a folder; pass a folder path")
    extra = sorted(p.name for p in folder.glob("member_*.safetensors")
                   if p.stem[len("member_"):].isdigit() and int(p.stem[len("member_"):]) >= n_members) \
        if folder.is_dir() else []
    if extra:
        # a set of more members saved here before: loading the folder would mix the two sets
        raise OutputFileError(f"{folder} holds member files of a larger set ({', '.join(extra[:3])}"
                              f"{', ...' if len(extra) > 3 else ''}) beside the {n_members} this would write; "
                              "pass an empty folder, or move those files away first")


def file_tensors(states: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """The member state dicts as safetensors files hold them: the tensors, contiguous. A get_extra_state() value (no
    tensor) is left out, with a warning naming it."""
    left_out = sorted({k for state in states for k, v in state.items() if not isinstance(v, torch.Tensor)})
    if left_out:
        warnings.warn(
            f"the members' get_extra_state() values ({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''}) "
            "are no tensors, and safetensors files hold tensors only: members loaded from these files get the values "
            "the model builds. Keep them with torch.save(ens.member_state_dicts(), path) as well", stacklevel=3)
    return [{k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)} for state in states]


def save_member_weights(module: BatchedModule, folder: str | Path) -> list[Path]:
    """Write each member's state as `folder/member_000.safetensors`, ... (one ordinary state dict per
    member, loadable with `planner.load_source(model, weights=paths)` or load_state_dict). Returns the paths."""
    from safetensors.torch import save_file  # a required dependency (pyproject); imported where used

    folder = Path(folder)
    check_member_folder(folder, module.n_members)
    if module._state_replaced[0]:
        module._follow_replaced_state()
    keys = set(module._member_keys)
    with torch.no_grad():
        apart = sorted(k for k, t in module._stacked.items() if k not in keys and not k.startswith(LIFTED_PREFIX)
                       and t.dim() > 0 and t.shape[0] > 1 and not torch.equal(t, t[:1].expand_as(t)))
    if apart:
        warnings.warn(
            f"the members differ in buffers a state_dict does not hold ({', '.join(apart[:3])}"
            f"{', ...' if len(apart) > 3 else ''}: registered with persistent=False), which these files leave out: "
            "members loaded from them get the values the model builds (planner.load_model_file builds member i from "
            f"seed {MEMBER_SEED_BASE} + i). Register them as persistent buffers, or keep them beside the files "
            "(torch.save({k: ens.stacked_state[k] for k in names}, path), copied back into ens.stacked_state[k] "
            "after loading: ens.state_dict() leaves them out too)", stacklevel=2)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, state in enumerate(file_tensors(module.member_state_dicts())):
        path = folder / f"member_{i:03d}.safetensors"
        with temp_beside(path) as tmp:  # written whole or not at all
            save_file(state, str(tmp))
        paths.append(path)
    return paths
