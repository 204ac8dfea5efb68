"""executor.input_writes: refuse model inputs forward() writes in place where one batched call cannot do
what the member loop does (check_input_writes); give the runs profile repeats fresh copies of inputs forward()
writes (FreshInputs)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.executor.members import state_device
from stagewise.executor.subgraphs import root_outside, walk
from stagewise.executor.timing import Prepared
from stagewise.executor.values import span
from stagewise.planner.capability import alias_chain, is_inplace
from stagewise.planner.errors import InputError
from stagewise.planner.graph import ModelGraph, renormalised_weight
from stagewise.planner.plan import InputMode, Plan
from stagewise.planner.snapshot import StateSnapshot


def _shared_write_refusal(where: str, name: str) -> InputError:
    return InputError(
        f"{where} writes the shared input {name!r} in place: the member loop writes the caller's tensor once per member "
        f"(member i sees i writes before its own), which one batched call cannot repeat; clone the input in forward() "
        f"({name} = {name}.clone()) or give it per_member (planner.propose(..., input_mode='per_member'))")


def _graph_writes(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(node, the value of `gm` it writes in place) for each write the graph shows: `x.add_()`, `x += 1` as export
    records it, F.relu(x, inplace=True), nn.ReLU(inplace=True)(x), and a write inside a region op's subgraph
    (torch.export's `with torch.no_grad(): x.clamp_(0, 1)` is `wrap_with_set_grad_enabled(False, submod, x)`), said as
    a write by the region op into the operand its subgraph's placeholder stands for (executor.subgraphs)."""
    out = []
    for scope, node in walk(gm):
        if not is_inplace(node):
            continue
        if scope.parent is None:
            out.append((node, node.args[0]))
            continue
        where, root = root_outside(scope, node.args[0], lambda v: alias_chain(v)[-1])
        if where.parent is None:  # a value of `gm` (not one the block computes itself)
            out.append((scope.entry, root))
    return out


def check_input_writes(private: nn.Module, graph: ModelGraph, plan: Plan, example: tuple | None) -> frozenset[str]:
    """InputError for a model input forward() writes in place where the batched module cannot do what the loop does;
    returns the per_member inputs it writes (each call then checks their member rows do not overlap: rows_overlap).

    A shared input written in place is refused: the loop writes the caller's tensor N times, each member
    seeing the writes of the members before it. The graph shows most writes (`x.add_`, a view's `mul_`,
    an in-place module, and `x += 1` on an input, which tracing records as operator.iadd); a write inside a
    function the trace keeps closed (torch.fx.wrap) does not show, so `private` (a copy of member 0, its
    state and the random generators restored afterwards) also runs once on copies of `example` and an
    input whose version counter moved was written. A per_member input written where the graph does not show
    it is refused too (the batched module would leave the caller's rows unwritten); one the graph shows is fine.
    A model that cannot run on the (zero) example inputs skips the run; the graph's writes are still refused.
    """
    names = list(graph.input_names)
    shared = {n for n in names if plan.input_mode(n) is not InputMode.PER_MEMBER}
    shown = set()
    # F.embedding(max_norm=) renormalises the rows of the weight it is given in place (a table passed as an input)
    renorms = [(n, w) for n in graph.gm.graph.nodes for w in [renormalised_weight(n)] if w is not None]
    for node, written in [*_graph_writes(graph.gm), *renorms]:
        root = alias_chain(written)[-1]
        if root.op == "placeholder":
            if root.name in shared:
                kind = getattr(node.target, '__name__', node.target)
                where = (f"{node.name} (an in-place op inside a `with torch.no_grad():` or autocast block, export's {kind})"
                         if isinstance(node.target, torch._ops.HigherOrderOperator) else f"{node.name} ({node.op} {kind})")
                raise _shared_write_refusal(where, root.name)
            shown.add(root.name)
    if example is None or not any(isinstance(x, torch.Tensor) for x in example):
        return frozenset(shown)
    device = state_device(private) or torch.device("cpu")
    copies = tuple(x.detach().clone().to(device) if isinstance(x, torch.Tensor) else x for x in example)
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in copies]
    snapshot = StateSnapshot.take(private)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            private(*copies)
    except Exception:  # noqa: BLE001 - a probe on zeros (a model that needs real inputs); the graph scan above stands
        return frozenset(shown)
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
    return frozenset(shown)


def rows_overlap(x: torch.Tensor) -> bool:
    """Whether two members' rows of `x` (its dim 0) may share memory (stride 0: `base.expand(N, ...)`; windows:
    `unfold`, as_strided). Memory shared inside one member's row (a broadcast dim) is the loop's too.

    Rows are apart when the member stride reaches past one row's extent; otherwise (interleaved rows) a
    sufficient test decides: each dim's stride, dims taken by stride, reaches past all the smaller ones."""
    if x.dim() == 0 or x.shape[0] < 2 or x[0].numel() == 0:
        return False
    step = abs(x.stride(0))
    if step == 0:
        return True
    if step >= span(x[0]):
        return False
    reach = 1
    for size, stride in sorted(((s, abs(st)) for s, st in zip(x.shape, x.stride()) if s > 1), key=lambda p: p[1]):
        if stride < reach:
            return True
        reach = stride * (size - 1) + reach
    return False


def overlapping_rows_refusal(name: str) -> InputError:
    return InputError(
        f"the per_member input {name!r} is written in place by forward(), and its member rows share memory (an "
        f"expanded tensor, `x.expand(N, ...)`, or overlapping windows): the member loop writes each member's rows one "
        f"after another, so a member sees the writes of those before it, which one batched call cannot repeat; pass "
        f"{name}.clone() (or .contiguous()) so that each member has its own rows")


class FreshInputs:
    """The inputs for runs that repeat one call (executor.profile's end to end, baselines and training steps).

    Where forward() writes its inputs in place (`written`: the batched module's `_written_inputs`), every run is
    handed private copies (`values`), never the caller's tensors, and `restore()` puts the caller's values back into
    them before each run: without that, each of a profile's hundreds of calls would write into the inputs (the
    caller's, `x.mul_(2)`: x times 2**k) and every call after the first would run on other values than the check's.
    The copies are made once and refilled in place, so a callable built on them (the loop baseline's per-member
    views, vmap's, the floor's reshaped batch) sees the fresh values. `contiguous`: copies in torch's contiguous
    layout (the floor reshapes [N, B, ...] to [N * B, ...], a view of such a copy, so refilling the copy refills it).
    Copies are leaves; one of a leaf that requires grad requires grad too (a write recording gradients into it then
    fails, as the member loop's does). Without writes, `values` are the caller's inputs and nothing is copied.
    """

    def __init__(self, inputs: tuple, written: bool, contiguous: bool = False):
        self.source, self.written = tuple(inputs), bool(written)
        if not self.written:
            self.values = self.source
            return
        made: dict[int, torch.Tensor] = {}  # one copy per tensor: an input given twice stays one tensor, as the loop's

        def copy(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) not in made:
                c = x.detach().clone(memory_format=torch.contiguous_format if contiguous else torch.preserve_format)
                made[id(x)] = c.requires_grad_(x.requires_grad and x.is_leaf)
            return made[id(x)]

        self.values = tuple(tree_map(copy, self.source))
        self._pairs = [(made[id(x)], x) for x in {id(t): t for t in tree_flatten(self.source)[0]
                                                  if isinstance(t, torch.Tensor)}.values()]

    def restore(self) -> None:
        """The caller's values back into the copies (what the last run wrote is gone)."""
        if self.written:
            with torch.no_grad():
                for c, x in self._pairs:
                    c.copy_(x)

    def timed(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call` (built on `values`) with restore() before each run, outside what timing measures (timing.Prepared):
        the copy is not the call's cost; `call` itself where nothing is written."""
        return Prepared(self.restore, call) if self.written else call
