"""executor.verify: the batched module against the plain Python loop over members.

Errors are normwise: max |batched - loop| and that divided by max |loop|
(a per-element relative error explodes near zero and says nothing useful).
"""
from __future__ import annotations

import contextlib
import copy
import contextvars
import functools
import inspect
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import KeyPath, keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from stagewise.planner.graph import retrace
from stagewise.planner.plan import InputMode, Plan, Strategy
from stagewise.planner.errors import InputError, StagewiseError
from stagewise.planner.errors import first_line as _first_line
from stagewise.executor.build import build, resolve_device
from stagewise.executor.values import leaf_paths, member_value
from stagewise.executor.members import gradient_hooks

DEFAULT_RTOL = 1e-4  # float32: vmap and the loop may sum in different orders
# Normwise relative tolerance per plan dtype, against the float32 loop (README "Precision"). Chosen from the
# worst error measured on every sample, both input modes, N=3, outputs and stage boundaries (tests/test_dtype.py),
# with 2.5-4x headroom (worst seen: bfloat16 1.2e-2, float16 1.3e-3). tf32 computes as float32 on CPU; on CUDA its
# matmuls keep a 10-bit mantissa like float16, so it gets float16's value (not yet measured on a GPU).
DTYPE_RTOL = {"float32": DEFAULT_RTOL, "tf32": 5e-3, "bfloat16": 3e-2, "float16": 5e-3}


_MEMBER_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def members_rtol(members: Sequence[nn.Module]) -> float:
    """The tolerance of the members' own precision: float16 or bfloat16 state makes the loop itself compute in it
    (one rounding of it is no mismatch); DEFAULT_RTOL otherwise. Judged by the dtype most of the floating
    parameters are: one bfloat16 gate in a float32 model does not loosen the whole check 300x, bfloat16 layers
    beside one large float32 embedding table do (counted by tensors, not elements)."""
    counts: dict[torch.dtype, int] = {}
    for t in (members[0].parameters() if members else ()):
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    low = {d: c for d, c in counts.items() if d in _MEMBER_DTYPE}
    if not low or 2 * sum(low.values()) < sum(counts.values()):
        return DEFAULT_RTOL
    return max(DTYPE_RTOL[_MEMBER_DTYPE[d]] for d in low)


def default_rtol(plan: Plan, members: Sequence[nn.Module]) -> float:
    """The tolerance of the plan's precision, or of the members' own where that is looser (members_rtol)."""
    return max(DTYPE_RTOL[plan.dtype], members_rtol(members))


@dataclass
class ErrorRow:
    """Error of one compared value (an output leaf or a stage-boundary node)."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class VerifyReport:
    """Outputs and stage boundaries of the batched module vs the member loop."""

    n_members: int
    rtol: float
    outputs: list[ErrorRow] = field(default_factory=list)  # every call's outputs; rows of calls after the first say "(call k)"
    boundaries: list[ErrorRow] = field(default_factory=list)  # values crossing stages on the first call
    calls: int = 1  # consecutive calls compared per input shape (state updated in forward carries over between them)
    shapes: list[str] = field(default_factory=list)  # the input shapes compared, first one first
    notes: list[str] = field(default_factory=list)  # input shapes not compared, and why
    gradients: list[ErrorRow] = field(default_factory=list)  # verify(grads=True): each parameter's gradient
    # state forward() updates (running statistics, EMA buffers, counters, renormalised rows) after the consecutive calls
    state: list[ErrorRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self.outputs) and all(r.ok for r in self.boundaries) and all(r.ok for r in self.gradients)
                and all(r.ok for r in self.state))

    @property
    def max_rel(self) -> float:
        return max([r.max_rel for r in self.outputs] or [0.0])

    def to_json(self) -> dict:
        return {"n_members": self.n_members, "rtol": self.rtol, "ok": self.ok, "calls": self.calls,
                "shapes": self.shapes, "notes": self.notes,
                "outputs": [asdict(r) for r in self.outputs], "boundaries": [asdict(r) for r in self.boundaries],
                "gradients": [asdict(r) for r in self.gradients], "state": [asdict(r) for r in self.state]}

    def to_text(self) -> str:
        lines = [f"{'value':<28} {'max abs':>11} {'max rel':>11}  ok"]
        for kind, rows in (("output", self.outputs), ("boundary", self.boundaries), ("grad", self.gradients),
                           ("state", self.state)):
            for r in rows:
                lines.append(f"{kind + ' ' + r.name:<28} {r.max_abs:>11.3e} {r.max_rel:>11.3e}  {'yes' if r.ok else 'NO'}")
        lines += [f"note: {n}" for n in self.notes]
        verdict = "MATCH" if self.ok else "MISMATCH"
        shapes = f" at {len(self.shapes)} input shape(s) {'; '.join(self.shapes)}" if self.shapes else ""
        lines.append(f"{verdict}: batched vs loop over {self.n_members} members, {self.calls} consecutive calls{shapes}, rtol {self.rtol:g}")
        return "\n".join(lines)


@contextlib.contextmanager
def same_draws(seed: int = 0) -> Iterator[None]:
    """Run the block from torch's random state seeded with `seed`, and put the caller's state back after it: a run of
    the batched module and a run of the member loop each inside `same_draws(k)` start their draws from one state
    (Dropout in training, `randn_like`), so a plan that draws as the loop draws gives the loop's outputs."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _random_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def counting_draws(module: Any, drawn: list[str]) -> Any:
    """A `run=` for module.run_stages that runs the stages one by one and appends to `drawn` the id of each stage
    whose run moved torch's random state (it drew random numbers: Dropout in training, `randn_like`)."""
    from stagewise.executor.strategies.wide import random_ops  # strategies import this module's package

    def run(env: dict) -> None:
        for step in module._steps:
            before = _random_states()
            module._run_steps(env, [step])
            if any(not torch.equal(a, b) for a, b in zip(before, _random_states())):
                program = step[0]
                drawn.append(program.stage.id)
                if program.stage.options.strategy is Strategy.WIDE and random_ops(program.module) > 1:
                    drawn.append(program.stage.id)  # wide draws op by op for all members: another order too
                if program.stage.options.strategy is Strategy.COMPILE:
                    drawn.append(program.stage.id)  # vmapped (in training) or compiled, op by op for all members too
    return run


def draw_order_note(drawn: Sequence[str]) -> str:
    """Why the outputs of a plan drawing random numbers in several stages differ from the seeded member loop's."""
    names = list(dict.fromkeys(drawn))
    return (f"stage(s) {', '.join(names[:4])}{', ...' if len(names) > 4 else ''} draw random numbers in more than one "
            "place, or in one wide or compile stage: the batched module draws each stage's (or, under wide and "
            "compile, each op's) numbers for every member before the next one's, the member loop draws member by "
            "member, so from one seed their draws differ, each member's still fresh and its own. Outputs that "
            "depend on the draws are compared exactly only with one such stage; compare in eval mode (module.eval() "
            "and the members' .eval()) for the rest")


def fresh(inputs: Sequence[Any]) -> tuple:
    """A copy of every tensor in `inputs` (a forward() that writes its inputs in place must not change what the
    next run, or the caller, is given)."""
    return tuple(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tuple(inputs)))


def bound_as_given(module: nn.Module, inputs: Sequence[Any]) -> None:
    """The batched module's own check of the caller's `inputs` (BatchedModule.bind_inputs), before any copy is made.

    Every run below gets copies (`fresh`), and copying each input apart parts what shares memory: a shared input that
    is a row of a per_member input forward() writes in place (`(y[0], y)`), or per_member rows that overlap
    (`x.expand(N, ...)`). The module refuses such a call (InputError), so verify raises that InputError too, rather
    than a MATCH found on copies that the module, called on these inputs, would never run."""
    module.bind_inputs(tuple(inputs))


def call_member(member: nn.Module, plan: Plan, args: tuple) -> Any:
    """`member` called on one member's inputs, in the plan's order: a keyword-only parameter of forward()
    (`forward(self, x, *, mask)`, which the trace takes in order with the others) passed by its name."""
    try:
        kinds = inspect.signature(member.forward).parameters
    except (TypeError, ValueError):  # no signature to read: as given
        return member(*args)
    by_name = [i.name for i in plan.inputs]
    keyword = {name: x for name, x in zip(by_name, args)
               if name in kinds and kinds[name].kind is inspect.Parameter.KEYWORD_ONLY}
    if not keyword:
        return member(*args)
    return member(*(x for name, x in zip(by_name, args) if name not in keyword), **keyword)


def _ordered(x: torch.Tensor) -> bool:
    """Whether `x` is in order (non-decreasing or non-increasing) along its last dim, row by row."""
    step = x[..., 1:].long() - x[..., :-1].long()
    return bool((step >= 0).all()) or bool((step <= 0).all())


def member_inputs(plan: Plan, inputs: Sequence[Any], i: int) -> tuple:
    """Member i's inputs: shared ones as given, per_member ones indexed [i] (a Python number input, given as an [N]
    tensor, as the Python number it was traced as; given as one Python number, that number for every member)."""
    def own(spec, x: Any) -> Any:
        if spec.mode is not InputMode.PER_MEMBER:
            return x
        if spec.dtype in ("int", "float") and _is_number(x):
            return x
        if isinstance(x, (dict, list, tuple)) and spec.shape is None:  # a container (a batch dict): each leaf's row i
            return tree_map(_member_leaf(i), x)
        return x[i].item() if spec.dtype in ("int", "float") and isinstance(x, torch.Tensor) else x[i]
    return tuple(own(spec, x) for spec, x in zip(plan.inputs, inputs))


def _member_leaf(i: int) -> Callable[[Any], Any]:
    """Member i's part of a leaf of a per_member container input: row i of a tensor, and of an [N] tensor the Python
    number it holds (the batched module takes a number in a container as one per member, BatchedModule's
    _follow_container_numbers); anything else (a string, a flag) is every member's."""
    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t[i].item() if t.dim() == 1 else t[i]
    return leaf


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def per_member_numbers(plan: Plan, inputs: Sequence[Any]) -> tuple:
    """`inputs` with each per_member Python number input as one [N] tensor: one number (what a member's example inputs
    hold) given to every member, a list or tuple of N numbers one per member. float64 for floats, int64 for ints:
    float64 holds each Python float exactly, so the reference loop (member_inputs: `x[i].item()`) runs on the numbers
    as given (a sweep of gammas 0.999, 0.9999, 0.99999 in `1 - gamma` loses digits in float32), while the batched
    module takes them at its own precision (BatchedModule._numbers_per_member casts them as it casts a list)."""
    out = []
    for spec, x in zip(plan.inputs, inputs):
        if spec.mode is InputMode.PER_MEMBER and spec.dtype in ("int", "float"):
            number = x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x  # torch.tensor(0.7): one number
            values = [number] * plan.n_members if _is_number(number) else x
            if isinstance(values, (list, tuple)) and len(values) == plan.n_members and all(map(_is_number, values)):
                x = torch.tensor(values, dtype=torch.float64 if spec.dtype == "float" else torch.int64)
        out.append(x)
    return tuple(out) + tuple(inputs[len(out):])


def _loop_fails(e: Exception, i: int, grad: bool) -> InputError:
    """The error for the member loop, verify's reference, failing on member `i` (the batched module is not to blame)."""
    mode = "with gradients on" if grad else "under torch.no_grad(), as inference calls are checked"
    return InputError(
        f"the plain loop over members itself fails (member {i}, {mode}): {type(e).__name__}: {_first_line(e)}. "
        "It is the reference the batched module is compared with, so there is nothing to check against: pass inputs "
        "each member takes (a per_member input stacked [N, ...], member i given x[i]; a shared one as for one member), "
        "and check that the members run on them (member(*inputs) in a plain loop)")


def own_member_inputs(plan: Plan, inputs: Sequence[Any], i: int) -> tuple:
    """Member i's inputs (member_inputs) with each per_member tensor row its own copy.

    A row x[i] of the stacked input shares the stacked tensor's version counter: where forward() writes its input in
    place and an op then saves it for backward (`x.mul_(2); return fc(x)`), member 1's write bumps the version member
    0's saved row records, and member 0's backward fails ("modified by an inplace operation") where the plain loop,
    each member given its own tensor, runs. Shared inputs stay the one tensor every member is given."""
    own = member_inputs(plan, inputs, i)
    return tuple(x.clone() if spec.mode is InputMode.PER_MEMBER and isinstance(x, torch.Tensor) else x
                 for spec, x in zip(plan.inputs, own)) + own[len(plan.inputs):]


def _call_members(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], graded: Sequence[GradKey] = (),
                  leaves: list[dict[GradKey, torch.Tensor]] | None = None) -> list[Any]:
    """Each member on its own inputs (in the current grad mode; per_member rows copied apart, own_member_inputs), a
    failure of one as `_loop_fails` says. The input tensors at `graded` (an input's position, and the path to a leaf
    inside a container input) are given as gradient leaves of the member's own (`grad_leaves`), appended to `leaves`
    member by member."""
    outs = []
    for i, m in enumerate(members):
        try:
            args = own_member_inputs(plan, inputs, i)
            if graded:
                args, own = grad_leaves(args, graded)
                leaves.append(own)
            outs.append(call_member(m, plan, args))
        except StagewiseError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's model failing on its inputs: said as such, not a traceback
            raise _loop_fails(e, i, torch.is_grad_enabled()) from e
    return outs


# an input tensor whose gradient verify compares: the input's position in forward()'s arguments, and the pytree path
# to the tensor inside a container input (a batch dict's ('x',)), () for a tensor input itself
GradKey = tuple[int, KeyPath]


def grad_leaves(args: Sequence[Any], graded: Sequence[GradKey]) -> tuple[tuple, dict[GradKey, torch.Tensor]]:
    """`args` with the tensor at each key in `graded` (a top-level input, or a leaf inside a container input: a batch
    dict's x) replaced by a copy recording gradients into a fresh leaf, and those leaves by key: the call is given a
    non-leaf copy of each (forward() may write its input in place, x.add_(1), which a leaf requiring grad refuses), so
    the leaf's gradient is the input's, as x.grad is the caller's. A container is rebuilt around its new leaves, its
    other leaves (an integer mask, a flag) as they were."""
    args, leaves = list(args), {}
    for k in dict.fromkeys(k for k, _ in graded):
        paths = {path for kk, path in graded if kk == k}
        flat, spec = tree_flatten_with_path(args[k])
        given = []
        for path, x in flat:
            if path in paths and isinstance(x, torch.Tensor):  # (a per_member Python number: the loop's takes none)
                leaves[(k, path)] = x.detach().clone().requires_grad_(True)
                x = leaves[(k, path)].clone()
            given.append(x)
        args[k] = tree_unflatten(given, spec)
    return tuple(args), leaves


# whether verify's calls run with gradients on: for a module that refuses calls with them off (forward() branches on
# the grad mode and the plan was traced with them on), both it and the loop are called in the traced mode
_CALLS_WITH_GRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("stagewise_verify_calls_with_grad", default=False)


def _calls_mode() -> Any:
    return torch.enable_grad() if _CALLS_WITH_GRAD.get() else torch.no_grad()


def loop_outputs(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any]) -> list[Any]:
    """The trusted reference: each member on its own inputs, one after another.
    Raises: InputError where a member itself fails on its inputs (naming it and the error)."""
    with _calls_mode():
        return _call_members(plan, members, inputs)


def compare(name: str, got: Any, want: Any, rtol: float, n_members: int | None = None) -> list[ErrorRow]:
    """Rows comparing two pytrees leaf by leaf (non-tensor leaves must be equal).

    Floating leaves: normwise relative error at most `rtol`; with `n_members`, a leaf whose dim 0 is the
    member axis is measured member by member (each member's error over its own scale; the row has the
    worst), so a member whose outputs are small next to another's is checked too. Integer and bool
    leaves (ids, argmax, masks) must be equal: a tolerance would pass a wrong id among large ids.
    """
    g_leaves, _ = tree_flatten(got)
    w_leaves, _ = tree_flatten(want)
    if len(g_leaves) != len(w_leaves):
        return [ErrorRow(f"{name}: {len(g_leaves)} leaves vs {len(w_leaves)}", float("inf"), float("inf"), False)]
    rows = []
    for k, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        label = name if len(g_leaves) == 1 else f"{name}[{k}]"
        if isinstance(w, torch.Tensor) or isinstance(g, torch.Tensor):
            # a Python float (a number one side hands on per member) as the double it is: as float32 a value past
            # float32's range would be inf, and agree with a batched inf
            g_t, w_t = (torch.as_tensor(v, dtype=torch.float64 if isinstance(v, float) else None).detach().cpu()
                        for v in (g, w))
            if g_t.shape != w_t.shape:
                rows.append(ErrorRow(f"{label} shape {list(g_t.shape)} vs {list(w_t.shape)}", float("inf"), float("inf"), False))
                continue
            if g_t.numel() == 0:
                rows.append(ErrorRow(label, 0.0, 0.0, True))
                continue
            rows.append(_tensor_row(label, g_t, w_t, rtol, n_members))
        else:
            same = same_number(g, w, rtol)
            rows.append(ErrorRow(label, 0.0 if same else float("inf"), 0.0 if same else float("inf"), bool(same)))
    return rows


def same_number(g: Any, w: Any, rtol: float) -> bool:
    """Whether a non-tensor output `g` equals the loop's `w`: floats within `rtol` (NaN equal to NaN), the rest equal."""
    if isinstance(w, float) and isinstance(g, (int, float)) and not isinstance(g, bool):
        if math.isnan(w) or math.isnan(g):
            return math.isnan(w) and math.isnan(g)
        return g == w or abs(g - w) <= rtol * max(abs(w), 1e-30)
    try:
        return bool(type(g) is type(w) and g == w)
    except Exception:  # noqa: BLE001 - values whose == fails or is not one bool (arrays): not equal
        return False


def _tensor_row(label: str, g: torch.Tensor, w: torch.Tensor, rtol: float, n_members: int | None) -> ErrorRow:
    exact = not (g.is_floating_point() or g.is_complex()) and not (w.is_floating_point() or w.is_complex())
    if exact:  # in int64, not double: ids above 2**53 stay distinct
        g, w = g.to(torch.int64), w.to(torch.int64)
    else:  # complex stays complex (double() would drop the imaginary part)
        kind = torch.complex128 if g.is_complex() or w.is_complex() else torch.float64
        g, w = g.to(kind), w.to(kind)
    diff = (g - w).abs()
    # the same NaN or the same infinity in both is agreement, not an error (inf - inf is nan)
    diff = torch.where((g == w) | (torch.isnan(g) & torch.isnan(w)), torch.zeros_like(diff), diff.to(torch.float64))
    scale = w.abs().to(torch.float64).nan_to_num(nan=0.0, posinf=0.0)
    per_member = n_members is not None and g.dim() >= 1 and g.shape[0] == n_members and n_members > 1
    if per_member:
        errs, scales = diff.reshape(n_members, -1).amax(1), scale.reshape(n_members, -1).amax(1)
    else:
        errs, scales = diff.reshape(1, -1).amax(1), scale.reshape(1, -1).amax(1)
    rels = torch.where(scales > 0, errs / torch.where(scales > 0, scales, torch.ones_like(scales)), errs)
    abs_err, rel = errs.max().item(), rels.max().item()  # max propagates nan: a nan anywhere is a mismatch
    ok = abs_err == 0 if exact else bool(rel <= rtol)
    return ErrorRow(label, abs_err, rel, ok)


def _loop_reference(column: list, got: Any) -> Any:
    """The members' values of one output leaf, in the layout the batched module returns (values.n_first)."""
    if isinstance(column[0], torch.Tensor):
        return torch.stack(column)
    if isinstance(got, torch.Tensor):
        # per-member Python numbers come back as an [N] tensor; floats compared as the doubles they are (float32
        # would round the reference too: a number past float32's range was inf on both sides, a MATCH)
        return torch.tensor(column, dtype=torch.float64 if any(isinstance(c, float) for c in column) else None)
    return column[0] if all(c == column[0] for c in column) else column  # equal ones stay one plain value


def _compare_outputs(report: VerifyReport, got: Any, want: list[Any], suffix: str) -> None:
    """Add one row per output leaf: the batched output against the members' outputs stacked N-first."""
    want_stacked = [tree_flatten(w)[0] for w in want]
    got_leaves = tree_flatten(got)[0]
    if any(len(w) != len(got_leaves) for w in want_stacked):  # an output the batched module dropped or added
        counts = sorted({len(w) for w in want_stacked})
        report.outputs.append(ErrorRow(f"out{suffix}: {len(got_leaves)} output leaves, the loop returns {counts}",
                                       float("inf"), float("inf"), False))
        return
    paths = leaf_paths(got)
    other = next((i for i, w in enumerate(want) if leaf_paths(w) != paths), None)
    if other is not None:  # the same leaves under other keys (`{self.name: y}`)
        report.outputs.append(ErrorRow(f"out{suffix}: structured as {_structure(got)}, member {other}'s loop output as "
                                       f"{_structure(want[other])}", float("inf"), float("inf"), False))
        return
    for k, g in enumerate(got_leaves):
        column = [w[k] for w in want_stacked]
        if isinstance(g, torch.Tensor) and isinstance(column[0], torch.Tensor) and dtype_clash(g.dtype, column[0].dtype):
            report.outputs.append(ErrorRow(f"out[{k}]{suffix}: dtype {str(g.dtype).replace('torch.', '')}, the loop's "
                                           f"{str(column[0].dtype).replace('torch.', '')}", float("inf"), float("inf"), False))
            continue
        ref = _loop_reference(column, g)
        label = f"out[{k}]" if len(got_leaves) > 1 else "out"
        report.outputs.extend(compare(label + suffix, g, ref, report.rtol, n_members=len(want)))
        _note_nothing_finite(report, label, column)


def _with_isfinite(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a float8 tensor (which has no isfinite kernel) in float32, whose infinities and NaN it keeps."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def _note_nothing_finite(report: VerifyReport, label: str, column: list) -> None:
    """A note when a member's loop output `label` holds no finite value (all NaN / inf): its row says 0 error because
    the batched NaN and inf sit where the loop's do (compare counts NaN against NaN, and the same infinity, as agreement,
    and one anywhere else as a mismatch), but no number was compared, so a MATCH there says nothing of the weights (an
    all-NaN input, a diverged member). Once per output, at the first call or input set that shows it."""
    empty = [i for i, c in enumerate(column) if isinstance(c, torch.Tensor) and (c.is_floating_point() or c.is_complex())
             and c.numel() and not bool(torch.isfinite(_with_isfinite(c.detach())).any())]
    if not empty or any(note.startswith(f"{label}: ") for note in report.notes):
        return
    who = "every member's" if len(empty) == len(column) else \
        f"member{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))}'s"
    report.notes.append(f"{label}: {who} loop output is all NaN / inf, so no finite value of it was compared (only that "
                        "the batched module has NaN and inf at the same positions); find where the NaN comes from (the "
                        "inputs, a diverged member) and verify on inputs that give finite outputs")


# whether the check running now is of a low-precision plan (verify sets it; profile and autotune leave the default)
_OUTPUTS_CAST: contextvars.ContextVar[bool] = contextvars.ContextVar("stagewise_outputs_cast", default=True)


def dtype_clash(got: torch.dtype, want: torch.dtype) -> bool:
    """Whether a batched output's dtype differs from the loop's beyond the plan's documented cast: a low-precision
    plan hands floating outputs back in the caller's dtype, so float32, bfloat16 and float16 stand for each other
    there; float64 (precision lost or invented), and integer, bool or complex against anything else, do not. A
    float32 plan (verify) casts nothing: a float32 output where bfloat16 members' loop returns bfloat16 is a clash."""
    if got == want:
        return False
    low = (torch.float32, torch.bfloat16, torch.float16)
    return not (got in low and want in low and _OUTPUTS_CAST.get())


def _structure(tree: Any) -> str:
    """`tree` with its tensors and numbers shown as `*` (dict keys, container types), shortened."""
    text = repr(tree_map(lambda x: _Leaf(), tree))
    return text if len(text) <= 80 else text[:77] + "..."


class _Leaf:
    def __repr__(self) -> str:
        return "*"


def _compare_state(report: VerifyReport, module: nn.Module, members: Sequence[nn.Module],
                   before: list[dict[str, torch.Tensor]], rtol: float,
                   members_before: list[dict[str, torch.Tensor]] | None = None) -> None:
    """One row per state tensor that forward() moved on either side over the calls compared (a running statistic,
    an EMA buffer, a counter, an Embedding's renormalised rows): the batched module's against the members', each
    member measured on its own scale. A plan that drops or repeats an update shows here even where the outputs do not
    read it (BatchNorm in training reads the batch's statistics)."""
    after = _module_state(module)
    for key in before[0] if before else ():
        own = [dict([*m.named_parameters(), *m.named_buffers()]).get(key) for m in members]
        if any(t is None for t in own):
            continue
        # moved by forward() on either side, each against where it started (the module's state may start elsewhere:
        # a module built otherwise is the outputs' to show)
        moved = any(not torch.equal(after[i][key], before[i][key]) for i in range(len(members))) or any(
            members_before is not None and key in members_before[i]
            and not torch.equal(own[i].detach().cpu(), members_before[i][key].cpu()) for i in range(len(members)))
        if not moved:
            continue
        got = torch.stack([after[i][key] for i in range(len(members))])
        want = torch.stack([t.detach().cpu() for t in own])
        # a state near zero by cancellation (an EMA of a normalised activation's mean) has rounding noise as its
        # relative error: within float32's noise of the state's scale (or of 1) is a match
        floor = 1e-6 * max(1.0, float(want.abs().max())) if want.is_floating_point() and want.numel() else 0.0
        report.state.extend(r if r.ok or r.max_abs > floor else ErrorRow(r.name, r.max_abs, r.max_rel, True)
                            for r in compare(key, got, want, rtol, n_members=len(members)))


def _module_state(module: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Each member's copy of the batched module's state, buffers outside the state_dict (persistent=False) included."""
    from stagewise.executor.constants import LIFTED_PREFIX

    stacked = {k: t for k, t in module._stacked.items() if not k.startswith(LIFTED_PREFIX)}
    with torch.no_grad():
        return [{k: t[i].detach().clone() for k, t in stacked.items()} for i in range(module.n_members)]


def _buffers(members: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Copies of what forward() may update in place: the buffers, and the parameters (an EMA teacher updated in
    forward(), an Embedding's max_norm renormalising its weight)."""
    return [{k: t.detach().clone() for k, t in [*m.named_parameters(), *m.named_buffers()]} for m in members]


def _restore_buffers(members: Sequence[nn.Module], saved: list[dict[str, torch.Tensor]]) -> None:
    with torch.no_grad():
        for m, state in zip(members, saved):
            for k, t in [*m.named_parameters(), *m.named_buffers()]:
                t.copy_(state[k])


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm, keep: set[str]):
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = out
        return out


def _copies_together(members: Sequence[nn.Module]) -> list[nn.Module]:
    """Copies of `members` to build from and run as the loop, made with one deepcopy memo: a tensor several members
    hold as one object (a buffer shared by the population) is one object in the copies too, so the reference loop
    updates it member after member as the caller's loop would (copies made apart would each hold their own, and a
    batched module giving each member its own copy would look right). MemberError for a member torch cannot copy."""
    from stagewise.executor.members import copy_member, member_list
    from stagewise.planner.snapshot import deepcopy_module

    memo: dict = {}
    out = []
    for i, m in enumerate(member_list(members, "executor.verify")):
        try:
            out.append(deepcopy_module(m, memo))
        except Exception:  # noqa: BLE001 - copied again alone, for copy_member's MemberError naming the member and the fix
            out.append(copy_member(m, i, "verify runs private copies so that it never changes your members"))
    return out


def verify(*args, **kwargs) -> "VerifyReport":
    # the calls' grad mode (_CALLS_WITH_GRAD) is this verify's alone; so is whether its outputs may come back in
    # another floating dtype (a low-precision plan's, see dtype_clash)
    token = _CALLS_WITH_GRAD.set(False)
    plan = args[0] if args else kwargs.get("plan")
    cast = _OUTPUTS_CAST.set(getattr(plan, "dtype", None) in LOW_PRECISION_DTYPES)
    try:
        return _verify(*args, **kwargs)
    finally:
        _OUTPUTS_CAST.reset(cast)
        _CALLS_WITH_GRAD.reset(token)


def _verify(plan: Plan, members: Sequence[nn.Module], inputs: Sequence[Any], *, rtol: float | None = None, device=None,
           calls: int = 2, more_inputs: Sequence[Sequence[Any]] | None = None, grads: bool = False) -> VerifyReport:
    """Build the plan, run it and the member loop on `inputs`, and compare.

    Args:
        inputs: the batched module's inputs (shared as-is, per_member [N, ...]); a per_member Python number input may
            also be one number (what a member's example inputs hold: every member gets it) or a list of N numbers.
        rtol: max normwise relative error; None = DTYPE_RTOL[plan.dtype] (the loop runs in the members' precision),
            looser for float16 / bfloat16 members (default_rtol).
        device: where the batched module runs (inputs are copied there); the loop
            runs each member where it already is, on `inputs` as given.
        calls: consecutive calls compared (at least 2: state a forward() updates
            drifts from call to call, and one call would not show a plan that drops the update).
            The first runs stage by stage (its stage boundaries are compared too), the later ones
            through the module's forward() (a whole-plan capture replays there).
        more_inputs: further input sets, usually other shapes (shapes can be baked into a trace),
            each compared on `calls` more calls after `inputs`; None (the default) = one set with
            another batch size (`resized_inputs`), () = none. A set the member loop itself cannot
            take is skipped, and one the plan refuses up front with InputError (a torch.export
            trace specialised to the traced shape) is noted; both in `notes`. Any other failure
            of the batched module there is a mismatch.
        grads: also one call with gradients on, as training runs it: its outputs, and every stacked parameter's
            gradient of one random projection of the outputs against each member's own backward (normwise per
            member, over the member's whole gradient where a parameter's own is near zero: a difference within
            GRAD_NOISE of the member's whole gradient norm is float32 rounding noise, so a gradient that is zero in
            exact arithmetic (a conv bias before BatchNorm) matches; rtol at least GRADS_RTOL, and
            LOW_PRECISION_GRADS_RTOL for a bfloat16 / float16 plan or members: grads_tolerance). Off by default: an
            inference plan need not train (sparse embeddings, shared parameters).
    The inputs as given first pass the batched module's own check (an InputError where the module refuses them: a
    shared input on the memory of a per_member input forward() writes in place, overlapping per_member rows it
    writes); then every run gets its own copy of the inputs (a forward() that writes them in place), and the
    batched module and the loop draw random numbers from the same seeded state, call by call
    (Dropout in training); the caller's random state is left as it was.
    Returns:
        VerifyReport with max abs/rel error per output leaf and per stage-boundary value, and notes:
        input sets not compared, members whose outputs the check cannot tell apart.
    Raises:
        MemberError for a member that cannot be deep-copied, InputError where the plain loop over the members itself
        fails on `inputs` (there is no reference to compare with), and what executor.build raises.
    Side effects: none on `members`: the loop and the traces run private copies of them, where they
    are (one copy of their state for the call), so buffers and attributes forward() updates stay as they were.
    """
    if not isinstance(plan, Plan) or isinstance(members, nn.Module):
        got = type(plan).__name__ if not isinstance(plan, Plan) else type(members).__name__
        raise TypeError(f"verify(plan, members, inputs) takes the plan and the N member modules (a list), got a {got} "
                        f"{'as the plan' if not isinstance(plan, Plan) else 'as the members'}: it builds the batched "
                        "module itself and compares it with the loop over the members. For a module already built (and "
                        "changed since), compare its outputs with executor.loop_outputs(plan, members, inputs)")
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be an int >= 1, got {calls!r}")
    rtol = default_rtol(plan, members) if rtol is None else rtol
    # gradient hooks on the caller's parameters: deep copies carry none, so both sides below would run without them
    hooked = gradient_hooks(members) if grads else []
    members = _copies_together(members)  # the caller's modules are never run
    inputs = per_member_numbers(plan, tuple(inputs))
    if more_inputs is None:
        other = resized_inputs(plan, inputs)
        more_inputs = [other] if other is not None else []
    example = member_inputs(plan, inputs, 0)
    module = build(plan, members, example_inputs=example, device=device)
    bound_as_given(module, inputs)
    report = VerifyReport(n_members=plan.n_members, rtol=rtol, calls=calls, shapes=[describe_inputs(inputs)])
    saved = _buffers(members)  # forward may update buffers in place; each run starts from the same state
    state_before = _module_state(module)
    # the batched module runs on `device`; the loop runs each member where it is, on `inputs` as given
    target = resolve_device(device)
    on_device = lambda: tree_map(lambda x: x.to(target) if isinstance(x, torch.Tensor) else x, fresh(inputs))  # noqa: E731
    drawn: list[str] = []
    _CALLS_WITH_GRAD.set("no_grad" in (module.__dict__.get("_grad_mode_refused") or {}))
    with _calls_mode(), same_draws(1):
        got, env = module.run_stages(*on_device(), keep=True, run=counting_draws(module, drawn))
    with same_draws(1):
        want = loop_outputs(plan, members, fresh(inputs))
    _compare_outputs(report, got, want, "")
    if len(drawn) > 1 and not report.ok:  # why the draws did not match the loop's (a compiled stage's may)
        report.notes.append(draw_order_note(drawn))
    _note_alike_members(report, want, rtol)
    _restore_buffers(members, saved)
    # boundaries of the first call: each member's own graph run, compared with what crossed the stage boundary
    boundary = [n for p in module.programs for n in p.output_names]
    per_member = []
    with same_draws(1):
        for i, m in enumerate(members):
            rec = _Recorder(retrace(m, plan.tracer, example, opened=plan.opened_modules).gm, set(boundary))
            with torch.no_grad():
                rec.run(*member_inputs(plan, fresh(inputs), i))
            per_member.append(rec.values)
    missing = [name for name in boundary if any(name not in values for values in per_member)]
    if missing:
        # the member's graph traced again after the loop ran has other nodes: forward() traces otherwise once it has
        # run (a cache it fills on its first call); the outputs above are still compared
        report.notes.append(f"stage boundaries {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} not "
                            "compared: a member traced again after running takes another path (a cache forward() "
                            "fills on its first call)")
    # in a low-precision plan a boundary value past the dtype's range (a mask's torch.finfo(dtype).min, which the
    # float32 loop has as float32's) is that dtype's largest number there: the float32 loop's is clamped to it
    dtype = getattr(torch, plan.dtype) if plan.dtype in ("bfloat16", "float16") else None
    in_range = (lambda v: tree_map(lambda t: t.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max)
                                   if isinstance(t, torch.Tensor) and t.is_floating_point() else t, v)) if dtype else (lambda v: v)
    for name in (n for n in boundary if n not in missing):
        seen: list[ErrorRow] = []
        for i in range(plan.n_members):
            rows = compare(f"{name} (member {i})", member_value(env[name], i), in_range(per_member[i][name]), rtol)
            bad = [r for r in rows if not r.ok]
            if bad:
                report.boundaries.extend(bad)
                break
            seen += rows
        else:  # every member matched: one row with the worst error, named by the node alone
            worst = max(seen, key=lambda r: r.max_rel, default=ErrorRow(name, 0.0, 0.0, True))
            report.boundaries.append(ErrorRow(name, worst.max_abs, worst.max_rel, worst.ok))
    _restore_buffers(members, saved)  # after comparing: recorded values may alias the buffers
    del env, per_member
    # later calls: state updated by forward() carries over in both, so a plan that drops an update drifts here
    with same_draws(1):
        loop_outputs(plan, members, fresh(inputs))  # the loop's first call again, so its state matches the batched module's
    for call in range(2, calls + 1):
        with _calls_mode(), same_draws(call):
            got = module(*on_device())
        with same_draws(call):
            want = loop_outputs(plan, members, fresh(inputs))
        _compare_outputs(report, got, want, f" (call {call})")
    _compare_state(report, module, members, state_before, rtol, saved)
    if hooked:
        # the batched module refuses to train such members (the stacked parameters carry no hooks), and the loop's
        # gradients are the hooks' own: no row of gradients compared on copies without them would mean anything
        report.gradients.append(ErrorRow(
            f"gradient hooks on the members' {', '.join(hooked[:3])}{', ...' if len(hooked) > 3 else ''} "
            "(register_hook): the batched module trains stacked copies without them (its training call refuses); "
            "put them on ens.named_stacked_parameters()", math.inf, math.inf, False))
    elif grads:
        _verify_grads(report, plan, module, members, inputs, on_device, grads_tolerance(plan, members, rtol),
                      seed=calls + 1)
    for k, other in enumerate(more_inputs):
        _verify_more(report, plan, module, members, per_member_numbers(plan, tuple(other)), device, seed=100 * (k + 1))
    _restore_buffers(members, saved)
    return report


GRADS_RTOL = 1e-4  # float32 gradients summed in other orders (as executor.stage_grads checks a stage's)
# bfloat16 / float16 plans against the float32 loop: a ReLU unit at the rounding boundary switches, and its gradient
# moves by a whole step; only a gross error shows at this precision
LOW_PRECISION_GRADS_RTOL = 0.25
LOW_PRECISION_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# float32 rounding noise of a gradient against its member's whole gradient norm: a parameter's gradient that is zero in
# exact arithmetic (a conv bias before BatchNorm in training) is noise of up to ~3e-6 of it (measured at 65k summed
# positions). A difference below GRAD_NOISE of the member's norm but above the parameter's own rtol (the grey zone,
# where noise and a wrong small gradient, a branch behind a 1e-6 layer scale, look alike) is settled by a float64
# run of that member: the batched gradient matches where it is within GRAD_NOISE_FACTOR times the loop's own distance
# from the float64 gradient (or rtol of it)
GRAD_NOISE = 1e-5
GRAD_NOISE_FACTOR = 10.0


functools.update_wrapper(verify, _verify)  # its signature and docstring are the ones to see


def grads_rtol(plan: Plan, rtol: float) -> float:
    """The tolerance for gradients: the outputs' at least GRADS_RTOL; LOW_PRECISION_GRADS_RTOL for half-precision plans."""
    if plan.dtype in ("bfloat16", "float16"):
        return max(rtol, LOW_PRECISION_GRADS_RTOL)
    return max(rtol, GRADS_RTOL)


def members_grads_rtol(members: Sequence[nn.Module]) -> float:
    """The gradient tolerance of the members' own precision (a baseline that runs them as they are, torch.func):
    LOW_PRECISION_GRADS_RTOL for float16 / bfloat16 members (members_rtol), else float32's summation-order 1e-4."""
    return LOW_PRECISION_GRADS_RTOL if members_rtol(members) > DEFAULT_RTOL else GRADS_RTOL


def grads_tolerance(plan: Plan, members: Sequence[nn.Module], rtol: float | None = None) -> float:
    """The tolerance gradients are judged at against the member loop's, by verify(grads=True), autotune(train=True)
    and profile_train alike: grads_rtol of the outputs' `rtol` (None = default_rtol: 1e-4 for float32, 5e-3 for tf32,
    LOW_PRECISION_GRADS_RTOL for a bfloat16 or float16 plan), and LOW_PRECISION_GRADS_RTOL where the members
    themselves are float16 / bfloat16 (members_grads_rtol): their loop computes the gradients in that precision, a
    ReLU at the rounding boundary switching there as in a bfloat16 plan. Judged by the plan's dtype alone, a float32
    plan of bfloat16 members failed verify at 7e-2 where the batched gradient was the one closer to a float64 run
    (8e-3 off it, the loop's 0.4), and autotune(train=True) rejected every batched candidate of a bfloat16 CNN."""
    rtol = default_rtol(plan, members) if rtol is None else rtol
    return max(grads_rtol(plan, rtol), members_grads_rtol(members))


def _verify_grads(report: VerifyReport, plan: Plan, module: nn.Module, members: Sequence[nn.Module],
                  inputs: tuple, on_device: Callable[[], Any], rtol: float, seed: int) -> None:
    """One call with gradients on: the outputs, and each stacked parameter's gradient of sum(outputs * w) (w one random
    weight per output element, the same on both sides) against each member's own backward. Which outputs record
    gradients is the loop's to say: a batched output that records none where the loop's does is a mismatch, and so
    is a gradient the batched module does not give where a member's is not zero. A floating tensor input given
    requiring grad (a training step that reads x.grad: an adversarial step, a gradient penalty) has its gradient
    compared too: a per_member one member by member (the batched x.grad[i] against member i's own x_i.grad), a shared
    one as the sum of the members' (what the batched module's one input gathers); the call is as given, so an input
    not requiring grad gets none on either side. A container input (a batch dict, a list of tensors) is compared leaf
    by leaf, each floating tensor inside given requiring grad a row of its own named as the trace names it
    (`input batch['x']`): of a per_member container member i's leaf is row i (`_member_leaf`), of a shared one the
    members' gradients are summed."""
    params = [(name, p) for name, p in module.named_stacked_parameters() if p.requires_grad]
    graded, held = _graded_inputs(plan, inputs, len(members))
    report.notes.extend(held)
    if not params and not graded:
        report.notes.append("gradients not compared: no parameter requires grad, and no input was given requiring grad")
        return
    member_leaves: list[dict[int, torch.Tensor]] = []
    with same_draws(seed):
        want = _call_members(plan, members, fresh(inputs), graded, member_leaves)
    want_leaves = [[x for x in tree_flatten(w)[0] if isinstance(x, torch.Tensor)] for w in want]
    generator = torch.Generator().manual_seed(seed)
    recorded = [any(leaves[j].requires_grad and (leaves[j].is_floating_point() or leaves[j].is_complex())
                    for leaves in want_leaves) for j in range(len(want_leaves[0]) if want_leaves else 0)]
    weights = [torch.randn((len(members), *_real64(want_leaves[0][j]).shape), generator=generator, dtype=torch.float64)
               if r else None for j, r in enumerate(recorded)]  # N-first, as the batched module's outputs
    try:
        args, batched_leaves = grad_leaves(on_device(), graded)
        with same_draws(seed):
            got = module(*args)
        _compare_outputs(report, got, want, " (with gradients)")
        got_leaves = [x for x in tree_flatten(got)[0] if isinstance(x, torch.Tensor)]
        if len(got_leaves) != len(weights):
            return  # the outputs' rows above say how they differ
        for j, (g, w) in enumerate(zip(got_leaves, weights)):
            if w is not None and not g.requires_grad:
                report.gradients.append(ErrorRow(f"output leaf {j}: records no gradient, the loop's does",
                                                 float("inf"), float("inf"), False))
        if not any(w is not None for w in weights):
            report.notes.append("gradients not compared: no output of the loop records gradients")
            return
        terms = [(_real64(g) * w.to(g.device)).sum() for g, w in zip(got_leaves, weights) if w is not None and g.requires_grad]
        targets = [p for _, p in params] + [batched_leaves[key] for key in graded]
        got_grads = list(torch.autograd.grad(sum(terms), targets, allow_unused=True)) if terms else [None] * len(targets)
    except Exception as e:  # noqa: BLE001 - the batched module failing in training is this check's finding
        report.gradients.append(ErrorRow(f"gradients: {type(e).__name__}: {_first_line(e)}", float("inf"), float("inf"), False))
        return
    got_grads, got_inputs = got_grads[:len(params)], got_grads[len(params):]
    per_member, per_member_inputs = [], []
    for i, (m, leaves) in enumerate(zip(members, want_leaves)):
        own = dict(m.named_parameters(remove_duplicate=False))
        targets = [own.get(name) for name, _ in params]
        terms = [(_real64(x) * w[i].to(x.device)).sum() for x, w in zip(leaves, weights) if w is not None and x.requires_grad]
        found = [t for t in targets if t is not None and t.requires_grad]
        asked = found + [member_leaves[i][key] for key in graded]  # one backward: the member's graph is freed after it
        grads = torch.autograd.grad(sum(terms), asked, allow_unused=True) if asked and terms else [None] * len(asked)
        grads_i = dict(zip(map(id, found), grads[:len(found)]))
        per_member.append([None if t is None else grads_i.get(id(t)) for t in targets])
        per_member_inputs.append([None if g is None else _real64(g.detach()).cpu() for g in grads[len(found):]])
    # a member's scale: its whole gradient's norm (a gradient that is zero in exact arithmetic, a key bias under
    # softmax, comes out as rounding noise: measured against the member's scale, not its own)
    scales = [math.sqrt(sum(float(_real64(g).norm()) ** 2 for g in grads if g is not None)) for grads in per_member]
    # that noise is the plan's precision's: a bfloat16 plan's is about 3e-3 of the member's scale; float32's grows with
    # the terms a gradient sums (a conv bias before BatchNorm, zero in exact arithmetic: 1.5e-7 of the member's scale
    # at 2k positions, 2.5e-6 at 65k), so a difference within GRAD_NOISE of it is no mismatch, whatever rtol is
    floor, noise = 1e-3, GRAD_NOISE / rtol
    if plan.dtype in LOW_PRECISION_DTYPES:
        floor = noise = max(floor, 2 * torch.finfo(LOW_PRECISION_DTYPES[plan.dtype]).eps)
    exact: dict[int, list | None] = {}  # member -> its float64 gradients (None: no float64 run reproduces the loop)
    for k, (name, p) in enumerate(params):
        if got_grads[k] is None and all(grads[k] is None for grads in per_member):
            report.notes.append(f"gradient of {name} not compared: neither side gives one")
            continue
        worst_abs = worst_rel = 0.0
        for i, grads in enumerate(per_member):  # a missing gradient is a zero one (torch leaves it None)
            g = _real64(got_grads[k][i].detach()).cpu() if got_grads[k] is not None else \
                _real64(torch.zeros(p.shape[1:], dtype=p.dtype))
            w = _real64(grads[k].detach()).cpu() if grads[k] is not None else torch.zeros_like(g)
            g, w, apart = _finite_pair(g, w)
            diff = math.inf if apart else float((g - w).norm())
            rel = diff / max(float(w.norm()), floor * scales[i], 1e-30)
            if rel > rtol and diff <= rtol * max(float(w.norm()), noise * scales[i]):  # the grey zone: noise or not?
                if i not in exact:
                    exact[i] = _grads64(plan, members[i], member_inputs(plan, fresh(inputs), i),
                                        [None if w_ is None else w_[i] for w_ in weights], [n for n, _ in params],
                                        per_member[i], scales[i])
                if exact[i] is not None:
                    ref = exact[i][k] if exact[i][k] is not None else torch.zeros_like(g)
                    own_noise = float((w - ref).norm())
                    if float((g - ref).norm()) <= max(rtol * float(ref.norm()), GRAD_NOISE_FACTOR * own_noise):
                        rel = diff / max(float(w.norm()), noise * scales[i], 1e-30)
            worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, rel)
        report.gradients.append(ErrorRow(name, worst_abs, worst_rel, worst_rel <= rtol))
    _compare_input_grads(report, plan, graded, got_inputs, per_member_inputs,
                         [member_leaves[0][key].shape for key in graded], rtol)


def _graded_inputs(plan: Plan, inputs: Sequence[Any], n_members: int) -> tuple[list[GradKey], list[str]]:
    """The input tensors whose gradients verify(grads=True) compares, and a note for each it cannot compare.

    Compared: each floating tensor given requiring grad, a top-level input or a leaf of a container input (a batch
    dict, a list or tuple of tensors, as torch's pytree opens it). A per_member one needs its members on dim 0 ([N,
    ...]); of a per_member container a 1-D leaf is each member's Python number (`_member_leaf`), with no gradient on
    the member's side. An object pytree does not open (a plain class holding tensors) is given to forward() as it is,
    so the tensors it holds are not compared either."""
    graded: list[GradKey] = []
    held: list[str] = []
    for k, (spec, x) in enumerate(zip(plan.inputs, inputs)):
        per_member = spec.mode is InputMode.PER_MEMBER
        container = not isinstance(x, torch.Tensor)
        for path, leaf in tree_flatten_with_path(x)[0]:
            name = f"input {spec.name}{keystr(path)}"
            if not isinstance(leaf, torch.Tensor):
                inside = [t for t in _held_tensors(leaf) if t.requires_grad and t.is_floating_point()]
                if inside:
                    held.append(f"gradients of the tensors inside {name} not compared: a {type(leaf).__name__} "
                                "object, which torch's pytree does not open (forward() is given it as it is); pass "
                                "them as inputs of their own, or in a dict, list or tuple, to compare their gradients")
                continue
            if not (leaf.requires_grad and leaf.is_floating_point()):
                continue
            if per_member and not container and spec.shape is None and spec.dtype in ("int", "float"):
                held.append(f"gradient of {name} not compared: a per_member Python number, which the reference loop "
                            "gives each member as a Python number (no gradient); the batched module carries its "
                            "gradient where the ops take tensors")
                continue
            if not per_member or (leaf.dim() > int(container) and leaf.shape[0] == n_members):
                graded.append((k, path))
            elif container and leaf.dim() == 1:
                held.append(f"gradient of {name} not compared: a 1-D leaf of a per_member container is each "
                            "member's Python number, which records no gradient; pass it as [N, 1] (each member a [1] "
                            "tensor) to compare its gradient")
    return graded, held


def _held_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors among `obj`'s attributes (one level: a plain batch object's fields), for saying they are not
    compared."""
    try:
        fields = vars(obj)
    except TypeError:  # no __dict__ (a number, a string, a slotted object): nothing found
        return []
    return [t for t in fields.values() if isinstance(t, torch.Tensor)]


def _compare_input_grads(report: VerifyReport, plan: Plan, graded: Sequence[GradKey],
                         got: Sequence[torch.Tensor | None],
                         per_member: list[list[torch.Tensor | None]], shapes: list[torch.Size], rtol: float) -> None:
    """One gradient row per input tensor in `graded` (floating inputs given requiring grad, and floating leaves so
    given inside container inputs): the batched module's gradient `got` of the weighted outputs against each member's
    own (`per_member[i][j]`, float64, of the gradient leaf member i was called with for graded[j], of one member's
    shape `shapes[j]`). A per_member input (or a leaf of a per_member container) is compared member by member,
    normwise over the member's own row (a member whose gradient is below 1e-3 of the largest member's over that:
    rounding noise); a shared one against the sum of the members'. A gradient torch leaves None is a zero one. A row
    is named as the trace names the input: `input x`, `input batch['x']` for a leaf inside a container."""
    floor = 1e-3
    if plan.dtype in LOW_PRECISION_DTYPES:
        floor = max(floor, 2 * torch.finfo(LOW_PRECISION_DTYPES[plan.dtype]).eps)
    for j, (k, path) in enumerate(graded):
        spec = plan.inputs[k]
        name = f"{spec.name}{keystr(path)}"
        shared = spec.mode is not InputMode.PER_MEMBER
        batched = _real64(got[j].detach()).cpu() if got[j] is not None else None
        if batched is None and all(grads[j] is None for grads in per_member):
            report.notes.append(f"gradient of input {name} not compared: neither side gives one")
            continue
        shape = shapes[j]
        own = [grads[j] if grads[j] is not None else torch.zeros(shape, dtype=torch.float64) for grads in per_member]
        if shared:
            pairs = [(batched if batched is not None else torch.zeros(shape, dtype=torch.float64), sum(own))]
            label = f"input {name} (shared: the members' summed)"
        else:
            pairs = [(batched[i] if batched is not None else torch.zeros_like(w), w) for i, w in enumerate(own)]
            label = f"input {name}"
        scale = max(float(w.norm()) for _, w in pairs)
        worst_abs = worst_rel = 0.0
        for g, w in pairs:
            g, w, apart = _finite_pair(g, w) if g.shape == w.shape else (g, w, True)
            diff = math.inf if apart else float((g - w).norm())
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(float(w.norm()), floor * scale, 1e-30))
        report.gradients.append(ErrorRow(label, worst_abs, worst_rel, worst_rel <= rtol))


def _grads64(plan: Plan, member: nn.Module, inputs: tuple, weights: list, names: list[str], loop: list,
             scale: float) -> list | None:
    """A float64 copy of `member`'s gradients of the same weighted sum of its outputs (its float inputs in float64), for
    telling float32 rounding noise from a wrong small gradient; None where that run fails or does not reproduce the
    loop's float32 gradients within 1e-4 of the member's norm (random draws in training, a float32-only op): then the
    grey zone counts as a mismatch, as without this run."""
    try:
        m64 = copy.deepcopy(member).double()
        as64 = tree_map(lambda x: x.detach().double().requires_grad_(x.requires_grad)
                        if isinstance(x, torch.Tensor) and x.is_floating_point() else x, inputs)
        with torch.enable_grad():
            out = call_member(m64, plan, as64)
            leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            terms = [(_real64(x) * w.to(x.device)).sum() for x, w in zip(leaves, weights) if w is not None and x.requires_grad]
            own = dict(m64.named_parameters(remove_duplicate=False))
            targets = [own.get(n) for n in names]
            found = [t for t in targets if t is not None and t.requires_grad]
            if not terms or not found:
                return None
            got = dict(zip(map(id, found), torch.autograd.grad(sum(terms), found, allow_unused=True)))
    except Exception:  # noqa: BLE001 - a model that cannot run in float64: no exact reference, the strict floor holds
        return None
    grads = [None if t is None or got.get(id(t)) is None else _real64(got[id(t)].detach()).cpu() for t in targets]
    for g64, g32 in zip(grads, loop):
        a = g64 if g64 is not None else 0.0
        b = _real64(g32.detach()).cpu() if g32 is not None else 0.0
        if float(torch.as_tensor(a - b).norm()) > 1e-4 * max(scale, 1e-30):
            return None
    return grads


def nonfinite_apart(g: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether NaN and inf in `g` sit elsewhere than in the loop's `w` (or an inf of another sign)."""
    inf = w.isinf()
    return not (torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), inf) and torch.equal(g[inf], w[inf]))


def _finite_pair(g: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(g, w, apart) for a gradient `g` against the loop's `w`: NaN and inf must sit where the loop has them (as for
    outputs); `apart` where they do not (a NaN gradient where the loop's is finite: its norm is NaN, which no `>`
    comparison and no max() would ever count), else both with those elements zeroed, measured on the finite rest."""
    if bool(torch.isfinite(g).all()) and bool(torch.isfinite(w).all()):
        return g, w, False
    if nonfinite_apart(g, w):
        return g, w, True
    return (g.nan_to_num(0.0, posinf=0.0, neginf=0.0), w.nan_to_num(0.0, posinf=0.0, neginf=0.0), False)


def _real64(t: torch.Tensor) -> torch.Tensor:
    """`t` in float64, a complex tensor as its (real, imaginary) pairs: `.double()` of a complex tensor keeps the real
    part alone, so a gradient wrong only in its imaginary part would compare equal."""
    return torch.view_as_real(t.resolve_conj()).double() if t.is_complex() else t.double()


def _note_alike_members(report: VerifyReport, outputs: list[Any], rtol: float) -> None:
    """A note when two members' loop outputs are equal within `rtol`: a plan that ran one member's weights for the
    other would pass this check (identical members, fine-tuned copies a little apart)."""
    flat = []
    for out in outputs:
        leaves = [_real64(x.detach()).reshape(-1).cpu() for x in tree_flatten(out)[0]
                  if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel()]
        if not leaves:
            return
        v = torch.cat([t.real if t.is_complex() else t for t in leaves])
        flat.append(v[:: max(1, v.numel() // 4096)].nan_to_num(0.0, 0.0, 0.0))
    if len({v.numel() for v in flat}) != 1:
        return
    rows = torch.stack(flat)
    scale = rows.abs().amax(1).clamp_min(1e-30)
    for i in range(1, len(flat)):
        close = ((rows[:i] - rows[i]).abs().amax(1) <= rtol * scale[i]).nonzero()
        if close.numel():
            j = int(close[0])
            report.notes.append(f"members {j} and {i} give the same outputs within rtol {rtol:g}: this check cannot tell "
                                "them apart, so a plan that ran one's weights for the other would pass; verify with "
                                "members that differ (other seeds) to check the member order too")
            return


def _verify_more(report: VerifyReport, plan: Plan, module, members: list[nn.Module], inputs: tuple, device,
                 seed: int = 100) -> None:
    """Compare `report.calls` more calls on another input set, state carried over from the calls before."""
    shape = describe_inputs(inputs)
    before = _buffers(members)
    try:
        with same_draws(seed):
            loop_outputs(plan, members[:1], fresh(inputs))  # can the model itself take these inputs?
    except Exception as e:  # any failure of the user's own model here means: not a shape it takes
        e = e.__cause__ if isinstance(e, InputError) and e.__cause__ is not None else e  # the model's own error
        report.notes.append(f"input shape {shape} not compared: the member loop itself fails on it ({type(e).__name__}: {_first_line(e)})")
        return
    finally:
        _restore_buffers(members[:1], before[:1])
    target = resolve_device(device)
    try:
        bound_as_given(module, inputs)  # what the module says of these inputs themselves, before they are copied
    except InputError as e:
        report.notes.append(f"input shape {shape} refused up front by the plan: {_first_line(e)}")
        return
    for call in range(1, report.calls + 1):
        name = f"out @ {shape} (call {call})"
        try:
            with _calls_mode(), same_draws(seed + call):
                got = module(*tree_map(lambda x: x.to(target) if isinstance(x, torch.Tensor) else x, fresh(inputs)))
        except InputError as e:
            if call == 1:
                report.notes.append(f"input shape {shape} refused up front by the plan: {_first_line(e)}")
                return
            raise
        except StagewiseError as e:
            report.outputs.append(ErrorRow(f"{name} failed: {_first_line(e)[:120]}", float("inf"), float("inf"), False))
            return
        with same_draws(seed + call):
            want = loop_outputs(plan, members, fresh(inputs))
        _compare_outputs(report, got, want, f" @ {shape}" + (f" (call {call})" if call > 1 else ""))
    report.shapes.append(shape)


def describe_inputs(inputs: Sequence[Any]) -> str:
    """'[8, 32] int64, [8, 12]' — the tensor inputs' shapes (dtype when not float32)."""
    parts = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            parts.append(str(list(x.shape)) + ("" if x.dtype == torch.float32 else f" {str(x.dtype).replace('torch.', '')}"))
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts)


def resized_inputs(plan: Plan, inputs: Sequence[Any]) -> tuple | None:
    """`inputs` with another batch size: the leading (batch) dim of every tensor input that shares the
    first tensor input's batch size grows by half (at least 1), by repeating rows (so integer ids and
    masks stay valid). Per-member inputs keep their [N] axis and resize the dim after it. None when no
    input has a batch dim."""
    def batch_dim(spec, x) -> int:
        return 1 if spec.mode is InputMode.PER_MEMBER else 0

    sized = [(spec, x) for spec, x in zip(plan.inputs, inputs) if isinstance(x, torch.Tensor) and x.dim() > batch_dim(spec, x)]
    if not sized:
        return None
    b = sized[0][1].shape[batch_dim(*sized[0])]
    new = b + max(1, b // 2)
    out = []
    for spec, x in zip(plan.inputs, inputs):
        d = batch_dim(spec, x) if isinstance(x, torch.Tensor) else -1
        if isinstance(x, torch.Tensor) and x.dim() > d and x.shape[d] == b:
            rows = torch.arange(new, device=x.device) % b
            x = x.index_select(d, rows)
        out.append(x)
    return tuple(out)


def batched_inputs(plan: Plan, example_inputs: Sequence[Any], seed: int = 0) -> tuple:
    """Inputs for the batched module made from one member's example inputs.

    Shared inputs are passed as they are. Per-member inputs get a leading [N]
    axis; floating-point ones get a small different perturbation per member, so
    a plan that mixed members up would not pass verification by accident.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec, x in zip(plan.inputs, example_inputs):
        if spec.mode is InputMode.PER_MEMBER and isinstance(x, torch.Tensor):
            if x.is_floating_point():
                noise = torch.randn((plan.n_members, *x.shape), generator=gen, dtype=x.dtype)
                out.append(x.unsqueeze(0) + 0.1 * noise.to(x.device) * (x.abs().mean() + 1e-3))
            elif x.dim() > 1 and x.shape[0] > 1 and not _ordered(x):
                # token ids, actions: each member its own rows, the batch rolled (each row stays a valid row: ids in
                # the vocabulary, a column's own range), so that members mixed up do not match by accident. Values
                # in order along the last dim keep theirs (offsets, cumulative lengths, positions, padding masks)
                out.append(torch.stack([x.roll(i, dims=0) for i in range(plan.n_members)]))
            else:
                out.append(x.unsqueeze(0).expand(plan.n_members, *x.shape).clone())
        elif spec.mode is InputMode.PER_MEMBER and isinstance(x, (int, float)) and not isinstance(x, bool):
            # a Python number per member (a temperature) goes in as an [N] tensor, each member's own
            # (float32: a float64 tensor would turn a float32 computation into float64, where the member's Python
            # number does not)
            # A torch.export plan fixed the number at its traced value: every member is given that one (the batched
            # module refuses another, naming the fix)
            fixed = plan.tracer == "export" and spec.shape is None
            values = [x * (1 + 0.1 * i) if isinstance(x, float) and not fixed else x for i in range(plan.n_members)]
            out.append(torch.tensor(values, dtype=torch.float32 if isinstance(x, float) else torch.int64))
        else:
            out.append(x)
    return tuple(out)
