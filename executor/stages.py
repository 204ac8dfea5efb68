"""One stage made runnable: its fx sub-graph and a runner per strategy.

`StageProgram` is built once per stage at `executor.build` time (nothing is
re-traced per call). A runner takes the stage's input boundary values and
returns its output boundary values (see executor.values for the three forms).

Layouts: stacked state tensors are [N, *param_shape]; Batched values are N-first.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._C import _functorch
import torch.fx
from torch import nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

try:  # the pieces torch.func.vmap is made of (private, see flat_vmap); a torch without them gets vmap itself
    from torch._functorch import predispatch as functorch_ops
    from torch._functorch.vmap import lazy_load_decompositions
except ImportError:  # pragma: no cover - another torch
    functorch_ops = None

from stagewise.planner.capability import (_draws_random as draws_random, alias_chain, is_inplace, is_inplace_op,
                                          norm_stats_updated, region_graphs)
from stagewise.planner.module_refusals import hook_computed_weights
from stagewise.planner.opening import ContainerTracer, no_mha_fastpath
from stagewise.planner.trace_watch import storage_root
from stagewise.planner.graph import renormalised_weight
from stagewise.planner.errors import ExecutionError, InputError
from stagewise.planner.plan import Stage, Strategy
from stagewise.executor.constants import LIFTED_PREFIX
from stagewise.executor.exact_numbers import OP_NAMES, number_op, number_operand, python_numbers, stacked_numbers
from stagewise.executor.values import (Batched, PerMember, Shared, as_batched, batched_arg, device_of, member_value,
                                       reset_number_context, reset_stage_device, set_number_context,
                                       set_stage_device)


class StageRetracer(ContainerTracer):
    """What an unpickled stage module (torch.load of a BatchedModule) is traced again with, from its code: buffers
    stay graph attributes. The default tracer runs ops on a buffer once and keeps the result as a constant, so
    `select(self.mem, 0, 0)` of a stage traced by torch.export would become a stale copy of the member's row. An
    OrderedDict or ModelOutput a stage builds stays one (ContainerTracer)."""

    proxy_buffer_attributes = True

    def __init__(self, *args: Any, **kwargs: Any):
        # the guards from_graph puts into a stage's graph (refuse_sparse_grad, no_grad_at_padding,
        # check_member_indices) stay calls of the graph traced again: run on a Proxy, each handed it on and dropped out
        kwargs["autowrap_functions"] = (*kwargs.get("autowrap_functions", ()), refuse_sparse_grad, no_grad_at_padding,
                                        check_member_indices, number_op, number_operand)
        super().__init__(*args, **kwargs)


def _region_writes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether a higher-order op's subgraphs (found as get_attr GraphModules among its arguments) write in place."""
    for a in node.all_input_nodes:
        sub = getattr(gm, str(a.target), None) if a.op == "get_attr" else None
        if isinstance(sub, torch.fx.GraphModule) and any(is_inplace(n) for n in sub.graph.nodes):
            return True
    return False


def put_back(stacked: dict[str, torch.Tensor], kept: dict[str, torch.Tensor]) -> None:
    """Each stacked tensor as `kept` holds it, as the leaf it was where a write recording gradients made it part of
    a graph (a refused call's writes undone)."""
    with torch.no_grad():
        for k, before in kept.items():
            t = stacked[k]
            if t.grad_fn is not None or t.requires_grad:
                t.detach_()
            t.copy_(before)


def _records_gradients(args: list) -> bool:
    """Whether a boundary value among `args` (shared, batched or per member) holds a tensor that records gradients."""
    for a in args:
        value = a.tree if type(a) is Batched else a.values if type(a) is PerMember else getattr(a, "value", a)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(value)[0]):
            return True
    return False


@dataclass
class StageProgram:
    """A stage's nodes as a standalone GraphModule: inputs are boundary values, outputs a flat tuple."""

    stage: Stage
    module: torch.fx.GraphModule
    input_names: list[str]  # producer node names, in placeholder order
    output_names: list[str]  # stage nodes read outside the stage, in output order
    state_names: list[str]  # member state (params/buffers) the stage reads, full dotted names
    describe: str = ""  # "s1 (linear, relu, ...)" for error messages
    # some node updates a value from outside the stage in place (an input, state): x.add_(y), operator.iadd, ...
    # (those wherever they write), and activations with an `inplace` flag (ReLU(inplace=True)) writing such a value
    writes_in_place: bool = False
    # the inputs whose storage a node writes, as the graph shows it (through view-like calls): those that arrive
    # shared become per-member copies; every input does when an op named in place writes (writes_by_name)
    written_inputs: tuple[str, ...] = ()
    writes_by_name: bool = False  # some op writes by its name (x.add_(y)), not by an `inplace` flag
    # an output may be (a view of) an input the stage may write (`r = h.add_(1)` handed on): copies of the input
    # would hand on a view of the copy, which later writes into the input do not reach
    outputs_view_written: bool = False
    # a write through `.data` of an input (`h.data.add_(1)`), which moves no version counter of the input's: a copy of
    # the input would not show it was written
    writes_untracked: bool = False
    # an output is a view of an input that a later stage writes in place (`t = h.t()` handed on, `t[0].add_(1)` after):
    # a batched run on a stacked copy of per-member inputs would hand on views of the copy, which that write misses
    views_written_later: bool = False
    # member state (full dotted names) a node writes in place (`self.h.copy_(h)`, `self.ema.mul_(0.9)`)
    written_state: tuple[str, ...] = ()
    # positions of the inputs that are Python numbers read from tensors (exact_numbers.read_numbers): a batched stage
    # hands them on as an [N] tensor, of which the member loop gives each member a Python number, as the loop has
    number_inputs: tuple[int, ...] = ()

    @staticmethod
    def from_graph(gm: torch.fx.GraphModule, stage: Stage, users_outside: dict[str, bool], state_keys: set[str],
                   numbers: frozenset[str] = frozenset()) -> "StageProgram":
        """Cut `stage` out of `gm`. `users_outside[n]` says whether node n is read outside its stage; `numbers` names
        the nodes whose value is a Python number read from tensors or computed from such (exact_numbers.read_numbers),
        whose arithmetic runs in double as the loop's does (exact_numbers)."""
        nodes = {n.name: n for n in gm.graph.nodes}
        order = {name: i for i, name in enumerate(nodes)}
        listed = sorted(stage.nodes, key=lambda name: order.get(name, len(order)))  # a plan file may list them otherwise
        inside = set(stage.nodes)
        g = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}
        inputs: list[str] = []
        state: list[str] = []
        for name in listed:
            for dep in nodes[name].all_input_nodes:
                if dep.name in inside or dep.name in env:
                    continue
                if dep.op == "get_attr" and str(dep.target).startswith(LIFTED_PREFIX):
                    env[dep.name] = g.node_copy(dep)  # a per-member constant build added: read here, like state
                    state.append(str(dep.target))
                    continue
                if dep.op == "get_attr" and isinstance(getattr(gm, str(dep.target), None), torch.fx.GraphModule):
                    # a region op's subgraph (torch.export's torch.no_grad() block) planned into another stage by an
                    # edit: code, the same for every member, read here rather than handed over as a value
                    env[dep.name] = g.node_copy(dep)
                    continue
                env[dep.name] = g.placeholder(f"in_{dep.name}")
                inputs.append(dep.name)
        for name in listed:
            node = nodes[name]
            env[name] = g.node_copy(node, lambda x: env[x.name])
            state += _state_of(gm, node, state_keys)
        outputs = [n for n in listed if users_outside.get(n)]
        g.output(tuple(env[n] for n in outputs))
        exact_number_arithmetic(g, {env[n] for n in env if n in numbers})
        shown = ", ".join(stage.nodes[:4]) + (", ..." if len(stage.nodes) > 4 else "")
        guard_sparse_embeddings(gm, g, f"{stage.id} ({shown})")
        guard_padding_rows(gm, g)
        guard_member_indices(gm, g, f"{stage.id} ({shown})")
        module = torch.fx.GraphModule(gm, g, class_name=f"Stage_{stage.id}")
        module._tracer_cls = StageRetracer  # how torch.load makes the module again from its code
        # what the stage's in-place nodes may write (through views, `.float()` of a float, Dropout in eval, ...):
        # an input or state counts; a value made inside the stage (conv -> bn -> ReLU(inplace=True)) does not
        writers = [n for n in g.nodes if is_inplace(n)]
        roots = {storage_root(n.args[0], every_module=False) for n in writers}
        # F.embedding(max_norm=) renormalises the weight rows it is given in place (under torch.no_grad())
        renorms = [w for w in map(renormalised_weight, g.nodes) if w is not None]
        # F.batch_norm(training=True) / F.instance_norm(use_input_stats=True) update the running statistics they are
        # handed in place (an observation normaliser that keeps tracking in eval), which no `inplace` flag shows
        renorms += [stat for n in g.nodes for stat in norm_stats_updated(n)]
        roots |= {storage_root(w, every_module=False) for w in renorms}
        # a region op (torch.export's torch.no_grad() / autocast block) whose subgraph writes in place: what it is
        # given may be written (an EMA buffer updated under no_grad), which its node does not show
        regions = [n for n in g.nodes if isinstance(n.target, torch._ops.HigherOrderOperator) and _region_writes(gm, n)]
        roots |= {storage_root(a, every_module=False) for n in regions for a in n.all_input_nodes
                  if not (a.op == "get_attr" and isinstance(getattr(gm, str(a.target), None), torch.fx.GraphModule))}
        written = tuple(name for name in inputs if env[name] in roots)
        by_name = any(is_inplace_op(n) for n in writers)
        may_write = {env[name] for name in (inputs if by_name else written)}
        return StageProgram(stage, module, inputs, outputs, list(dict.fromkeys(state)), f"{stage.id} ({shown})",
                            writes_in_place=by_name or bool(written) or bool(regions) or bool(renorms)
                            or any(r.op == "get_attr" for r in roots),
                            written_inputs=written, writes_by_name=by_name,
                            outputs_view_written=any(storage_root(env[n], every_module=False) in may_write for n in outputs),
                            writes_untracked=any(_through_data(n.args[0]) for n in writers),
                            number_inputs=tuple(k for k, name in enumerate(inputs) if name in numbers),
                            written_state=tuple(dict.fromkeys(
                                [str(r.target) for r in roots if r is not None and r.op == "get_attr"]
                                # state handed in by another stage and written here (torch.export's
                                # `ema.mul_(0.9)` reads the buffer in one stage, writes it in the next)
                                + [str(r.target) for r in (storage_root(nodes[name], every_module=False) for name in written)
                                   if r.op == "get_attr" and str(r.target) in state_keys])))


_NUMBER_NOT_TENSOR = re.compile(r"must be (Number|real number|int|float|a number|SymFloat|SymInt), not Tensor")


def _passed_on(e: BaseException) -> bool:
    """An exception a stage hands on as it is, not as an ExecutionError: out of memory (batch-size back-off code, and
    torch's own, catch torch.OutOfMemoryError or an allocator's RuntimeError by type), and the control flow of torch's
    non-reentrant activation checkpoint (`_StopRecomputationError`, which it raises to stop a recomputation early and
    catches itself around a checkpointed batched module)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or type(e).__name__ == "_StopRecomputationError":
        return True
    if type(e) is RuntimeError:
        text = str(e).lower()
        return "out of memory" in text or "can't allocate memory" in text
    return False


def exact_number_arithmetic(g: torch.fx.Graph, numbers: set[torch.fx.Node]) -> None:
    """Rewrite in `g` Python arithmetic and comparisons among `numbers` (the stage's values and inputs that are numbers
    read from tensors, see exact_numbers) to run in double as the member loop's Python numbers do (number_op), and
    cast such a number back where an op takes it beside tensors (number_operand). The stage's outputs stay double: a
    later stage's arithmetic goes on in double, a later op rounds them as it takes them, and a number forward() returns
    comes back as the loop's Python floats are, doubles."""
    for node in list(g.nodes):
        if node in numbers and node.op == "call_function" and node.target in OP_NAMES and not node.kwargs:
            node.args = (OP_NAMES[node.target], *node.args)
            node.target = number_op
    for node in [n for n in g.nodes if n in numbers]:
        for user in list(node.users):
            if user.target is number_op or user.op == "output":
                continue  # more arithmetic, or handed on
            # the op's other operands: the number is rounded to their precision, as torch rounds a Python float
            beside = tuple(dict.fromkeys(a for a in user.all_input_nodes if a not in numbers))
            with g.inserting_before(user):
                cast = g.call_function(number_operand, (node, *beside))
            user.replace_input_with(node, cast)


# functional norms that update running statistics in place: target -> (running mean, running var, update flag) positions
# (None: always updates); the keyword names are F.batch_norm's / F.instance_norm's and aten's
def _through_data(node: torch.fx.Node) -> bool:
    """Whether `node` is reached from an earlier value through `.data` (views and in-place ops between)."""
    return any(a.op == "call_function" and a.target is getattr and len(a.args) > 1 and a.args[1] == "data"
               for a in alias_chain(node))


# where each embedding function takes `sparse` positionally
_SPARSE_AT = {torch.nn.functional.embedding: 6, torch.nn.functional.embedding_bag: 7,
              torch.ops.aten.embedding.default: 4, torch.embedding: 4, torch.embedding_bag: 5,
              torch.ops.aten.embedding_bag.default: 5, torch.ops.aten.embedding_bag.padding_idx: 5,
              torch.ops.aten._embedding_bag.default: 5}


def makes_sparse_grad(gm: torch.nn.Module, node: torch.fx.Node) -> bool:
    """Whether `node` makes a sparse gradient for an embedding weight: nn.Embedding / nn.EmbeddingBag with
    sparse=True, F.embedding / F.embedding_bag / aten.embedding called with sparse=True."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse
    at = _SPARSE_AT.get(node.target) if node.op == "call_function" else None
    return at is not None and bool(node.kwargs.get("sparse", node.args[at] if len(node.args) > at else False))


class _SparseGradRefused(torch.autograd.Function):
    """Identity whose backward raises ExecutionError (the message given): put after an embedding with sparse=True."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, message: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.message = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        raise ExecutionError(ctx.message)


def refuse_sparse_grad(out: Any, message: str) -> Any:
    """`out` (an embedding's output), made to refuse a backward by name. Its indices carry no gradient, so a
    backward reaches it only where its weight records one (a frozen weight: no autograd node, nothing refused)."""
    if isinstance(out, torch.Tensor) and torch.is_grad_enabled():
        return _SparseGradRefused.apply(out, message)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and torch.is_grad_enabled():
        return (_SparseGradRefused.apply(out[0], message), *out[1:])  # aten embedding_bag: (output, offsets, ...)
    return out


def guard_sparse_embeddings(gm: torch.nn.Module, g: torch.fx.Graph, describe: str) -> None:
    """After each embedding with sparse=True in `g` (a stage's graph over `gm`'s modules), a node that raises
    ExecutionError naming it when a backward would reach its weight: a member's sparse gradient cannot go into
    the stacked [N, ...] weight (vmap: no sparse reshape; the loop: no sparse select_backward), which raised
    torch's bare error from backward(). The forward is unchanged (inference needs no gradient)."""
    for node in list(g.nodes):
        if not makes_sparse_grad(gm, node):
            continue
        message = (f"stage {describe}: embedding {node.name} has sparse=True, and its sparse gradient cannot be batched "
                   "across members (torch has no sparse reshape under vmap, nor a sparse select_backward for the "
                   "stacked weight): build the members' embeddings with sparse=False (the same gradient values, dense), "
                   "or train the members one by one")
        with g.inserting_after(node):
            guard = g.call_function(refuse_sparse_grad, (node, message))
        node.replace_all_uses_with(guard, delete_user_cb=lambda user: user is not guard)


def _padding_of(gm: torch.nn.Module, node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    """(indices node, padding_idx, weight node or None) of an embedding lookup with a padding row, else None:
    nn.Embedding (its padding_idx is already non-negative), F.embedding (a negative one counts from the end),
    aten.embedding / torch.embedding (weight first; -1 means none, F.embedding has normalised the rest)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is torch.nn.Embedding and mod.padding_idx is not None and node.args:
            return node.args[0], mod.padding_idx, None
        return None
    if node.op != "call_function":
        return None
    if node.target is torch.nn.functional.embedding:
        p = node.kwargs.get("padding_idx", node.args[2] if len(node.args) > 2 else None)
        weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        idx = node.kwargs.get("input", node.args[0] if node.args else None)
        return (idx, p, weight) if isinstance(p, int) and idx is not None else None
    if node.target in (torch.ops.aten.embedding.default, torch.embedding):
        p = node.kwargs.get("padding_idx", node.args[2] if len(node.args) > 2 else -1)
        return (node.args[1], p, None) if isinstance(p, int) and p >= 0 and len(node.args) > 1 else None
    return None


def no_grad_at_padding(out: Any, idx: Any, padding_idx: int, weight: Any = None) -> Any:
    """`out` (an embedding's output, same values) with no gradient at the positions whose index is the padding row.

    torch's embedding backward, reached from outside a vmap whose indices and weight both carry the member axis,
    keeps the padding row's gradient at zero for member 0 only (the members' weights are one flattened table, the
    padding index is not offset per member): members 1..N-1 trained their padding rows where the loop does not.
    With the output's gradient zero there, no member's padding row gets one, whatever the strategy."""
    # not out.requires_grad: inside vmap the output's wrapper says False even where its weight records a gradient
    if not (isinstance(out, torch.Tensor) and torch.is_grad_enabled()):
        return out
    if not torch.compiler.is_compiling() and not _functorch.is_batchedtensor(idx):
        return out  # shared indices, or the member loop: torch's backward keeps every padding row at zero already
    if padding_idx < 0 and isinstance(weight, torch.Tensor):
        padding_idx += weight.shape[0]
    if torch.compiler.is_compiling():  # (dynamo traces this form; no forward-mode derivative through a compiled stage)
        return torch.where((idx == padding_idx).unsqueeze(-1), out.detach(), out)
    return _NoGradAt.apply(out, idx == padding_idx)


class _NoGradAt(torch.autograd.Function):
    """`out` as it is, with its reverse-mode gradient zero where `at` (positions, `out`'s shape without its last dim);
    its forward-mode tangent (torch.func.jvp, jacfwd, forward-over-reverse) passes unchanged, as torch's embedding
    gives the padding row one."""

    @staticmethod
    def forward(out: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return out.clone()

    @staticmethod
    def vmap(info: Any, in_dims: tuple, out: torch.Tensor, at: torch.Tensor) -> tuple:
        # (a rule of its own: torch's generated one fails under a jvp around the vmap)
        out, at = (t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
                   for t, d in zip((out, at), in_dims))
        return _NoGradAt.apply(out, at), 0

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        at, = ctx.saved_tensors
        return grad.masked_fill(at.unsqueeze(-1), 0), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, _at: Any) -> torch.Tensor:
        return tangent


def guard_padding_rows(gm: torch.nn.Module, g: torch.fx.Graph) -> None:
    """After each embedding lookup with a padding row in `g`, a no_grad_at_padding node (see there)."""
    for node in list(g.nodes):
        found = _padding_of(gm, node)
        if found is None:
            continue
        idx, p, weight = found
        with g.inserting_after(node):
            guard = g.call_function(no_grad_at_padding, (node, idx, p, weight))
        node.replace_all_uses_with(guard, delete_user_cb=lambda user: user is not guard)


_ONE_HOT = (torch.nn.functional.one_hot, torch.ops.aten.one_hot.default)
_EMBEDDING_ATEN = (torch.ops.aten.embedding.default, torch.embedding)


def _index_bound_of(gm: torch.nn.Module, node: torch.fx.Node) -> tuple[Any, Any, str] | None:
    """(indices, their bound, what) of a lookup whose member-batched indices vmap would read out of another member's
    rows, else None. The bound is an int (nn.Embedding's num_embeddings, one_hot's num_classes) or the weight node
    (F.embedding / aten.embedding: its row count, read per call). one_hot with num_classes=-1 (the largest index + 1)
    has no bound to check."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        idx = node.args[0] if node.args else node.kwargs.get("input")
        # a subclass's own forward may map its input before the lookup (`super().forward(x % V)`): not checked
        ok = isinstance(mod, torch.nn.Embedding) and type(mod).forward is torch.nn.Embedding.forward \
            and isinstance(idx, torch.fx.Node)
        return (idx, mod.num_embeddings, f"embedding {node.target}") if ok else None
    if node.op != "call_function":
        return None
    if node.target is torch.nn.functional.embedding:
        idx = node.kwargs.get("input", node.args[0] if node.args else None)
        weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        found = (idx, weight, f"embedding {node.name}")
    elif node.target in _EMBEDDING_ATEN:
        weight = node.kwargs.get("weight", node.args[0] if node.args else None)
        idx = node.kwargs.get("indices", node.args[1] if len(node.args) > 1 else None)
        found = (idx, weight, f"embedding {node.name}")
    elif node.target in _ONE_HOT:
        idx = node.kwargs.get("input", node.kwargs.get("self", node.args[0] if node.args else None))
        classes = node.kwargs.get("num_classes", node.args[1] if len(node.args) > 1 else -1)
        found = (idx, classes, f"F.one_hot {node.name}") if type(classes) is int and classes >= 0 else None
    else:
        return None
    if found is None or not isinstance(found[0], torch.fx.Node):
        return None
    bound = found[1]
    if isinstance(bound, torch.Tensor):
        bound = bound.shape[0]
    return (found[0], bound, found[2]) if isinstance(bound, (int, torch.fx.Node)) else None


def check_index_rows(ids: torch.Tensor, dim: int | None, bound: int, what: str, where: str) -> None:
    """InputError naming the first member (position along `dim`, the member axis of `ids`; None: not known) whose indices leave
    [0, bound), as the member loop's IndexError / one_hot's RuntimeError would: one min/max reduction and a read of
    its two numbers. On CUDA torch._assert_async instead, which does not wait for the device (no host sync per call):
    a failure is a device-side assert, as the member loop's own lookup kernel raises there, without the member named."""
    if ids.is_cuda:  # (the message overload has a CPU kernel only; CUDA's assert prints its own)
        if ids.numel():
            torch._assert_async(((ids >= 0) & (ids < bound)).all())
        return
    if ids.is_meta or not ids.numel() or type(ids) is not torch.Tensor \
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return  # a tracing tensor (make_fx, torch.func.linearize): no values to read; the op checks its own
    lo, hi = torch.aminmax(ids)
    if lo.item() >= 0 and hi.item() < bound:
        return
    rows = ids.movedim(dim, 0).reshape(ids.shape[dim], -1) if dim is not None else ids.reshape(1, -1)
    bad = (rows < 0) | (rows >= bound)
    member = int(bad.any(1).nonzero()[0, 0])
    value = int(rows[member][bad[member]][0])
    whose = f"member {member}'s indices" if dim is not None else "the indices (under the caller's transform)"
    one_hot = what.startswith("F.one_hot")
    size = "num_classes" if one_hot else "num_embeddings"
    loop = ("RuntimeError: Class values must be " + ("non-negative" if value < 0 else "smaller than num_classes")
            if one_hot else "IndexError: index out of range in self")
    raise InputError(
        f"stage {where}: {whose} into {what} hold {value}, outside [0, {bound}) ({size}={bound}); "
        f"the member loop raises {loop} there. Batched, the members' tables are one [N*{bound}] table (torch.func's "
        f"rule), so such an index would read another member's row (and train it) instead: pass indices in "
        f"0..{bound - 1} (below {size}; a padding id equal to the vocabulary size is a common cause), or make {size} "
        "larger")


def check_member_indices(ids: Any, bound: Any, what: str, where: str) -> Any:
    """`ids` itself, after check_index_rows on them with the member axis where they carry one (vmap's batched
    tensor, unwrapped: one reduction over every member's indices). Indices without a member axis (shared ones, the
    member loop's, a nested vmap of the caller's) are left to the op, which checks them against its own table.
    Under torch.compile nothing is checked here: CompileRunner checks the indices its compiled call hands back."""
    if torch.compiler.is_compiling() or not isinstance(ids, torch.Tensor) or not _functorch.is_batchedtensor(ids):
        return ids
    check_indices_under(_functorch.get_unwrapped(ids), _functorch.maybe_get_bdim(ids),
                        bound if type(bound) is int else bound.shape[0], what, where)
    return ids


def check_indices_under(ids: torch.Tensor, dim: int, bound: int, what: str, where: str) -> None:
    """check_index_rows on member indices with the member axis at `dim`. Inside a transform of the caller's
    (torch.func.vmap over a batch of calls, vmap(grad(...)) per-sample gradients) they are wrapped again, and
    torch.func's rule still reads the members' tables as one: every index is checked, on the memory under every
    wrapper (each member's and each mapped call's, the member not named); a tracing tensor (make_fx, linearize) has
    no values to read."""
    if not _functorch.is_functorch_wrapped_tensor(ids):
        check_index_rows(ids, dim, bound, what, where)
        return
    while _functorch.is_functorch_wrapped_tensor(ids):
        ids = _functorch.get_unwrapped(ids)
    if type(ids) is torch.Tensor:
        check_index_rows(ids.reshape(1, -1), None, bound, what, where)


def guard_member_indices(gm: torch.nn.Module, g: torch.fx.Graph, describe: str) -> None:
    """Before each embedding / one_hot in `g`, a check_member_indices node on its indices (the op reads that node).

    torch.func's embedding rule flattens the stacked [N, V, d] table into [N*V, d] and shifts member m's indices by
    m*V: an index of V..N*V-1 (or a negative one) that the member loop refuses with IndexError read, and trained,
    another member's row. one_hot's vmap decomposition has no class check and gave a zero row. With the check the
    batched module refuses what the loop refuses, naming the member and the index."""
    for node in list(g.nodes):
        found = _index_bound_of(gm, node)
        if found is None:
            continue
        idx, bound, what = found
        with g.inserting_before(node):
            checked = g.call_function(check_member_indices, (idx, bound, what, describe))
        node.replace_input_with(idx, checked)


def _state_of(gm: torch.fx.GraphModule, node: torch.fx.Node, state_keys: set[str]) -> list[str]:
    if node.op == "call_module":
        prefix = f"{node.target}."
        return [k for k in state_keys if k.startswith(prefix)]
    if node.op == "get_attr" and node.target in state_keys:
        return [str(node.target)]
    if node.op == "get_attr":  # a submodule itself, handed to a torch.fx.wrap helper (`run_packed(self.rnn, x)`)
        prefix = f"{node.target}."
        return [k for k in state_keys if k.startswith(prefix)]
    return []


def state_slots(module: torch.nn.Module, names: list[str]) -> list[tuple[dict, str, str]] | None:
    """Where each state name lives in `module`: (its owner's _parameters or _buffers dict, leaf name,
    dotted name); None when one is a plain attribute (functional_call's setattr case)."""
    slots = []
    for name in names:
        path, _, leaf = name.rpartition(".")
        try:
            owner = module.get_submodule(path) if path else module
        except AttributeError:
            return None
        table = owner._parameters if leaf in owner._parameters else owner._buffers if leaf in owner._buffers else None
        if table is None:
            return None
        slots.append((table, leaf, name))
    return slots


def stateless_call(module: torch.fx.GraphModule, names: list[str]) -> Callable[..., Any]:
    """`call(*state, *inputs)`: `functional_call(module, dict(zip(names, state)), inputs, tie_weights=False)`,
    with the places of `names` in the module looked up once, here.

    Per call it puts each state tensor into its slot, runs the GraphModule's generated `forward`
    (no Module.__call__ / GraphModule wrapper around it: a stage module has no hooks of its own)
    and puts the module's own tensors back. Every original is read before any is replaced, so a
    submodule reachable under two names is restored correctly too. State and inputs are flat
    positional arguments so that vmap, which flattens its arguments on every call, walks no dict.
    """
    k = len(names)
    slots = state_slots(module, names)
    if slots is None:
        return lambda *args: functional_call(module, dict(zip(names, args[:k])), args[k:], tie_weights=False)
    if not slots:
        return lambda *inputs: module.forward(*inputs)
    places = [(table, leaf) for table, leaf, _ in slots]

    def call(*args: Any) -> Any:
        saved = [table[leaf] for table, leaf in places]
        try:
            for (table, leaf), t in zip(places, args):
                table[leaf] = t
            return module.forward(*args[k:])
        finally:
            for (table, leaf), t in zip(places, saved):
                table[leaf] = t

    return call


@dataclass
class Runner:
    """Runs one StageProgram across members. Subclasses implement `run`."""

    program: StageProgram
    n_members: int
    stacked: dict[str, torch.Tensor] = field(repr=False)  # this stage's state, [N, ...] each
    member_states: list[dict[str, torch.Tensor]] = field(repr=False)  # views stacked[k][i]
    trainable = True  # (not a field) False for strategies whose results carry no gradients (cuda_graph)

    def run(self, args: list) -> list:
        raise NotImplementedError

    def device_for(self, args: list) -> torch.device | None:
        """Where values this stage makes from Python numbers belong: its state's device, else its tensor inputs'."""
        state = next(iter(self.stacked.values()), None)
        return state.device if state is not None else device_of(args)

    def _state_before_writes(self, args: list) -> dict[str, torch.Tensor]:
        """Copies of the state this stage writes in place, where a write could record gradients into state that records
        none (a call under grad, on values or state that record them): taken so that such a write can be undone. A
        write of values that record none (a memory bank filled under torch.no_grad()) takes no copy."""
        if not (self.program.written_state and torch.is_grad_enabled()):
            return {}
        if not (any(t.requires_grad for t in self.stacked.values()) or _records_gradients(args)):
            return {}
        return {k: self.stacked[k].detach().clone() for k in self.program.written_state
                if k in self.stacked and not self.stacked[k].requires_grad}

    def _refuse_graph_into_state(self, kept: dict[str, torch.Tensor], error: Exception | None) -> None:
        """ExecutionError, with the state put back as it was, where the run wrote a value that records gradients into
        state that records none: member by member, the first member's write turns the stacked tensor into one that
        records gradients, and the next member's write is refused by autograd halfway through the members."""
        graphed = [k for k in kept if self.stacked[k].requires_grad or self.stacked[k].grad_fn is not None]
        if not graphed:
            return
        put_back(self.stacked, {k: kept[k] for k in graphed})
        names = ", ".join(repr(k) for k in graphed)
        raise ExecutionError(
            f"stage {self.program.describe}: forward() writes a value that records gradients into state that records "
            f"none ({names}: a recurrent state `self.h.copy_(h)`, an EMA `self.ema.copy_(0.9 * self.ema + 0.1 * f)`, "
            "without .detach()): the member loop's buffer would then carry this call's graph into the next one, whose "
            "backward fails there. Write a detached value (`.detach()`), or call the module under torch.no_grad(). "
            "The state is as it was before this call") from error

    def _dtype_advice(self, args: list, error: Exception) -> str:
        """For torch's dtype mismatch (`expected scalar type Float but found Double`, `Input type (double) and bias type
        (float)`): the advice naming a floating input's dtype and the one the stage's weights hold (what the plan was
        traced and the members built in), else "". The member loop fails alike, so excluding the stage is no fix."""
        if "Tensor dtype mismatch" in str(error) and any(
                n.op == "call_function" and "assert_tensor_metadata" in str(n.target) for n in self.program.module.graph.nodes):
            return ("The stage's torch.export graph checks the dtypes it was traced with: a batched module whose state "
                    "was cast after build (ens.to(torch.bfloat16), .half(), .double()) cannot run it. Set the precision "
                    "on the plan (planner.set_dtype(plan, 'bfloat16')) and build again, or cast the members "
                    "before planning")
        if not _DTYPE_MISMATCH.search(str(error)):
            return ""
        if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            # a loop or wide stage ran under the autocast and handed on low-precision values; vmap applies none
            return ("The call runs under torch.autocast, which vmap stages do not apply while loop and wide stages do: "
                    "one handed on values in the autocast dtype to a stage computing in the weights' dtype. Set the "
                    "plan's dtype instead (planner.set_dtype(plan, 'bfloat16')) and call the module outside autocast")
        want = next((t.dtype for t in self.stacked.values() if t.is_floating_point()), None)
        leaves = [x for a in args for x in tree_flatten(a.tree if type(a) is Batched else a.values if type(a) is PerMember
                                                        else getattr(a, "value", a))[0]]
        got = next((x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != want),
                   None)
        if want is None or got is None:
            return ""
        name = lambda dt: str(dt).replace("torch.", "")  # noqa: E731
        return (f"Check the inputs' dtype: one is {name(got)} where the stage computes in {name(want)} (its weights' "
                f"dtype, as the members and the plan were built): pass it as {name(want)} (`x.to({want})`), or build "
                f"the members and the plan in {name(got)}. The member loop fails alike (excluding the stage would not "
                "help)")

    takes_python_numbers = False  # (the member loop: a number read from tensors reaches it as one per member)

    def __call__(self, args: list) -> list:
        if self.program.number_inputs:  # numbers read from tensors: Python numbers per member, or one float64 [N] tensor
            args = (python_numbers(args, self.program.number_inputs) if self.takes_python_numbers else
                    stacked_numbers(args, self.program.number_inputs, self.device_for(args)))
        token = set_stage_device(self.device_for(args))  # numbers made into tensors anywhere in the run land here
        numbers = set_number_context((self.stacked, args))  # ... at the precision of what the stage computes with
        kept = self._state_before_writes(args)
        try:
            try:
                out = self.run(args)
            except TypeError as e:
                # numbers recording gradients handed as 0-d tensors (a learned temperature: the loop's `taus[i]`) to an
                # op that takes a Python number only (F.leaky_relu's slope): as numbers, as the loop must give them
                if not (self.takes_python_numbers and _NUMBER_NOT_TENSOR.search(str(e)) and not self.program.writes_in_place
                        and any(type(a) is PerMember and a.values and isinstance(a.values[0], torch.Tensor)
                                for a in (args[k] for k in self.program.number_inputs))):
                    raise
                args = python_numbers([a if type(a) is not PerMember or k not in self.program.number_inputs
                                       else Batched(torch.stack(a.values).detach()) for k, a in enumerate(args)],
                                      self.program.number_inputs, keep_grad=False)
                out = self.run(args)
            if kept:
                self._refuse_graph_into_state(kept, None)
            return out
        except InputError as e:  # the stage refused its inputs by name (check_member_indices)
            if kept:
                self._refuse_graph_into_state(kept, e)
            raise
        except ExecutionError as e:
            if kept:
                self._refuse_graph_into_state(kept, e)
            if str(e).startswith("stage "):
                raise
            # a strategy's own refusal (wide: a per-member Python value): named with its stage
            raise ExecutionError(f"stage {self.program.describe} failed ({self.program.stage.options.strategy.value}): {e}") from e
        except Exception as e:  # a stage failure becomes one message naming the stage
            if kept:
                self._refuse_graph_into_state(kept, e)
            if _passed_on(e):
                if not type(e).__name__.startswith("_"):
                    e.add_note(f"(in stage {self.program.describe} of the batched module, run with "
                               f"{self.program.stage.options.strategy.value})")
                raise
            shapes = [_describe_value(a) for a in args]
            strategy = self.program.stage.options.strategy.value
            training = (" This stage (or a layer of it: a Dropout put in training for MC dropout) runs in training "
                        "mode now: where the plan was traced with members in eval mode, its ops were probed in that "
                        "mode, and some batch there but not in training (dropout draws, BatchNorm with momentum=None "
                        "counts its calls with .item(), spectral_norm writes with out=); to train, plan with members "
                        "in .train() (planner.trace and executor.build; for MC dropout, with their Dropouts in "
                        "training), or exclude this stage"
                        if any(m.training for m in self.program.module.modules()) and strategy in ("vmap", "compile")
                        and _NOT_BATCHABLE.search(str(e)) else "")
            compiler = type(e).__name__ in ("BackendCompilerFailed", "TorchRuntimeError", "Unsupported", "InternalTorchDynamoError") \
                or type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))
            advice = (
                "This failure is torch.compile's, compiling the batched module around the stage (torch.compile(ens)): "
                f"call the module uncompiled, or let stagewise compile the stage itself (planner.set_options(plan, "
                f"graph, {self.program.stage.id!r}, strategy='compile'), which executor.autotune also tries)"
                if compiler else self._dtype_advice(args, e)
                or f"Check the input shapes, or exclude the stage to run it as a loop.{training}")
            raise ExecutionError(
                f"stage {self.program.describe} failed ({strategy}): "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}; "
                f"stage inputs were {shapes}. {advice}"
            ) from e
        finally:
            reset_number_context(numbers)
            reset_stage_device(token)


# torch's words for operands of two floating dtypes (CPU and CUDA kernels, matmul, convolution, norms)
_DTYPE_MISMATCH = re.compile(r"expected scalar type \w+ but found|same dtype|Input type \(\w+\) and \w+ type|"
                             r"expected m1 and m2|dtype mismatch|to have the same type", re.I)
# vmap's own refusals (an op with no batching rule, .item()), as opposed to a shape or dtype error of the inputs
_NOT_BATCHABLE = re.compile(r"vmap|[Bb]atching rule")


def _describe_value(v) -> str:
    if isinstance(v, Batched):
        leaves = [x for x in tree_flatten(v.tree)[0] if isinstance(x, torch.Tensor)]
        return "batched " + ", ".join(str(list(x.shape)) for x in leaves[:3])
    if isinstance(v, Shared):
        x = v.value
        return f"shared {list(x.shape)}" if isinstance(x, torch.Tensor) else f"shared {type(x).__name__}"
    return f"per-member list of {len(v.values)}"


def randomness(module: torch.nn.Module) -> str:
    """vmap's randomness for a stage: in training each member draws its own (dropout masks, as the loop
    would), and so in eval where the graph draws whatever the mode (noise drawn inside a torch.no_grad() region of
    a torch.export graph); otherwise a random op is an error (inference is expected to be deterministic)."""
    if module.training:
        return "different"
    graph = getattr(module, "graph", None)
    return "different" if graph is not None and _graph_draws(module) else "error"


def _graph_draws(gm: torch.nn.Module, depth: int = 0) -> bool:
    """Whether a stage's graph, or a region's graph it holds (torch.export), draws random numbers."""
    return any(draws_random(n) or (depth < 4 and any(_graph_draws(sub, depth + 1) for sub in region_graphs(n)))
               for n in gm.graph.nodes)


def flat_vmap(func: Callable[..., tuple], dims: tuple, batch_size: int, randomness: str) -> Callable[..., tuple]:
    """`vmap(func, in_dims=dims, randomness=randomness)` for flat positional arguments (each dim 0 or
    None) and a flat tuple of tensor outputs, N-first.

    torch.func.vmap flattens its arguments, matches in_dims to them and checks them on every call
    (about 40 us on the development CPU, as much as a small stage's arithmetic); here those are
    fixed when the stage is built, so a call does only what vmap does after them: one vmap level,
    a batch dimension onto each batched argument, `func`, the batch dimension off each output.
    Under torch.compile it is torch.func.vmap itself (dynamo knows that one).
    """
    public = vmap(func, in_dims=dims, randomness=randomness)
    if functorch_ops is None:
        return public
    lazy_load_decompositions()
    batched = tuple(d == 0 for d in dims)
    add, remove = functorch_ops._add_batch_dim, functorch_ops._remove_batch_dim
    is_compiling = torch.compiler.is_compiling

    def call(*args: Any) -> tuple:
        if is_compiling():
            return public(*args)
        for x, b in zip(args, batched):
            if b and x.shape[0] != batch_size:  # what vmap checks on every call, without its pytree walk
                raise ValueError(f"vmap: expected the member axis (dim 0) of size {batch_size} on every batched "
                                 f"argument, got one of shape {list(x.shape)}")
        level = functorch_ops._vmap_increment_nesting(batch_size, randomness)
        try:
            outs = func(*[add(x, 0, level) if b else x for x, b in zip(args, batched)])
            return tuple(remove(t, level, batch_size, 0) for t in outs)
        finally:
            functorch_ops._vmap_decrement_nesting()

    return call


_NUMBERS = (int, float, bool, type(None))  # a Batched value that is one of these is the same for every member


def _simple_args(args: list) -> tuple[tuple | None, list]:
    """(vmap's in_dims, the inputs) when each argument is Shared (None), a Batched tensor (0) or a
    Batched number (None; what batched_arg gives them, without its pytree walk); (None, []) otherwise."""
    dims, inputs = [], []
    for a in args:
        t = type(a)
        if t is Shared:
            dims.append(None)
            inputs.append(a.value)
        elif t is Batched:
            x = a.tree
            if isinstance(x, torch.Tensor):
                dims.append(0)
            elif type(x) in _NUMBERS:
                dims.append(None)
            else:
                return None, []
            inputs.append(x)
        else:
            return None, []
    return tuple(dims), inputs


_MHA_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
                nn.TransformerDecoder, nn.Transformer)


def grad_safe_kernels(module: nn.Module) -> Callable[[Callable], Callable] | None:
    """A wrapper that makes a vmapped stage pick kernels that carry gradients while gradients are recorded, or None
    when the stage needs none. Under vmap a parameter reports requires_grad=False, so torch takes inference-only
    paths it would not take for the member itself: nn.MultiheadAttention's fused fast path (no derivative), and on
    the CPU the flash SDPA kernel for an attention with a mask (no gradient for a learned bias, T5's relative
    positions). With gradients on, the fast path is off and a masked SDPA runs on the math kernel, as for the member."""
    graph = module.graph if isinstance(module, torch.fx.GraphModule) else None
    mha = any(isinstance(m, _MHA_MODULES) for m in module.modules())
    masked = False
    for node in graph.nodes if graph is not None else ():
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else str(node.target)
        if isinstance(node.target, torch._ops.OpOverload):
            name = node.target.name().split("::")[-1].split(".")[0]
        if name == "scaled_dot_product_attention" and (len(node.args) > 3 and node.args[3] is not None
                                                      or node.kwargs.get("attn_mask") is not None):
            masked = True
        mha = mha or name == "_native_multi_head_attention"
    if not (mha or masked):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415 - only for such stages

    def wrap(fn: Callable) -> Callable:
        def guarded(*args):
            if not torch.is_grad_enabled():
                return fn(*args)
            with contextlib.ExitStack() as stack:
                if mha:
                    stack.enter_context(no_mha_fastpath())
                if masked and not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
                    stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
                return fn(*args)
        return guarded
    return wrap


def _default_layout(value: Any) -> Any:
    """A stage argument (Shared / Batched / PerMember or a plain value) with its tensors contiguous."""
    fix = lambda tree: tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, tree)  # noqa: E731
    if isinstance(value, Shared):
        return Shared(fix(value.value))
    if isinstance(value, Batched):
        return Batched(fix(value.tree))
    if isinstance(value, PerMember):
        return PerMember([fix(v) for v in value.values])
    return fix(value)


def _other_layout(value: Any) -> bool:
    """Whether a stage argument holds a tensor of 4 or more dimensions not in the default layout (channels_last, a
    permuted view), which an op asking for its memory format (GroupNorm) cannot be answered about inside vmap."""
    return any(isinstance(t, torch.Tensor) and t.dim() >= 4 and not t.is_contiguous() for t in _arg_leaves(value))


def _arg_leaves(value: Any) -> list:
    return tree_flatten(value.value if isinstance(value, Shared) else value.tree if isinstance(value, Batched)
                        else value.values if isinstance(value, PerMember) else value)[0]


def _values_kept(args: list) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(tensor, version, a copy of its values) for each tensor among the stage arguments."""
    with torch.no_grad():
        return [(t, t._version, t.clone()) for a in args for t in _arg_leaves(a) if isinstance(t, torch.Tensor)]


def _put_back(kept: list, stage: str) -> None:
    """Each kept tensor a failed attempt wrote (its version moved) given its values back. Where that cannot be done
    as the member loop would see it (the write recorded gradients; the arguments share memory, which default-layout
    copies would part), ExecutionError naming the fix."""
    written = [(t, old) for t, version, old in kept if t._version != version]
    storages = [t.untyped_storage().data_ptr() for t, _, _ in kept]
    if written and (torch.is_grad_enabled() and any(t.requires_grad for t, _ in written)
                    or len(set(storages)) != len(storages)):
        raise ExecutionError(
            f"stage {stage} writes a tensor in place that is not in the default memory layout (channels_last, a "
            "permuted view), and an op in it asks for the layout (GroupNorm), which vmap cannot answer; its chunked "
            "run had written part of the values before failing, which cannot be put back here. Pass the input in "
            "the default layout (x.contiguous()), or set no chunk_size on the stage")
    with torch.no_grad():
        for t, old in written:
            t.copy_(old)


def _written_back(args: list, fixed: list, outs: list) -> list:
    """After a stage ran on `fixed`, the default-layout copies of `args`: each copy it wrote in place (its version
    counter moved) copied into the tensor it was made from, and an output that is such a copy made that tensor."""
    made_from = {}
    for a, f in zip(args, fixed):
        for orig, copy in zip(_arg_leaves(a), _arg_leaves(f)):
            if isinstance(orig, torch.Tensor) and copy is not orig:
                made_from[id(copy)] = orig
                if copy._version:
                    orig.copy_(copy)
    if not made_from:
        return outs
    back = lambda t: made_from.get(id(t), t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return [Shared(tree_map(back, o.value)) if isinstance(o, Shared) else Batched(tree_map(back, o.tree))
            if isinstance(o, Batched) else PerMember([tree_map(back, v) for v in o.values])
            if isinstance(o, PerMember) else o for o in outs]


class VmapRunner(Runner):
    """One torch.func.vmap over stacked state: `functional_call(stage, state[i], inputs[i])` for all i at once.

    The vmapped callable is made once per kind of arguments (which are shared, which batched) and
    training mode; the stage runs through `stateless_call` (its state's places found at construction).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._meta: dict[str, Any] = {}
        # tie_weights=False: every name of a tied tensor is in `state` (executor.members.member_state), each
        # a separate per-member slice of one stacked tensor, which functional_call's tying would refuse
        self._state_keys = list(self.stacked)  # the order of the state arguments (see stateless_call)
        call = stateless_call(self.program.module, self._state_keys)
        flat_metas: dict[int, dict[str, Any]] = {}
        # draws random numbers whatever the mode (`x + torch.randn_like(x)`, a stage excluded for it and set to vmap or
        # compile by hand): computed once for every member, all would share one draw
        self._draws = any(draws_random(n) for n in self.program.module.graph.nodes)

        # torch's hook-based spectral_norm / weight_norm set the weight they compute as a plain attribute of their
        # module at each call: inside vmap a batched tensor, which would stay there after the call (deepcopy, pickle
        # and torch.save of the module then fail on it): what the attribute held before goes back after each call
        hooked = [(m, name, m.__dict__.get(name)) for _, m, name in hook_computed_weights(self.program.module)]

        def one_member(*args):
            out = call(*args)
            for module, name, before in hooked:
                module.__dict__[name] = before
            if type(out) is tuple and all(isinstance(x, torch.Tensor) for x in out):
                # the common case: a flat tuple of tensors, no pytree walk
                meta = flat_metas.get(len(out))
                self._meta = meta if meta is not None else flat_metas.setdefault(len(out), self._flat_meta(len(out)))
                return out
            leaves, spec = tree_flatten(out)
            tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            # non-tensor leaves (sizes, shapes) cannot leave vmap; they are the same for all members
            self._meta = {"spec": spec, "leaves": leaves, "tensor_at": tensor_at, "flat": False}
            return tuple(leaves[i] for i in tensor_at)

        self._one_member = one_member
        # chunked with gradients recorded, a stage writing in place fails its backward (the chunks are views of one
        # tensor with one version counter: a later chunk's write moves what an earlier one saved): such calls run
        # unchunked (chunk_size only bounds memory)
        self._unchunk_with_grad = bool(self.program.stage.options.chunk_size) and any(
            is_inplace(n) for n in self.program.module.graph.nodes)
        self._call = call
        self._vmapped: dict[Any, Callable] = {}
        self._grad_kernels = grad_safe_kernels(self.program.module)

    @staticmethod
    def _flat_meta(n: int) -> dict[str, Any]:
        """The recorded output structure of a stage returning a flat tuple of n tensors."""
        leaves, spec = tree_flatten(tuple(range(n)))
        return {"spec": spec, "leaves": leaves, "tensor_at": list(range(n)), "flat": True}

    def _vmap_args(self, args: list) -> tuple[list, list, bool]:
        """(inputs, their in_dims, whether anything member-specific goes in)."""
        device = self.device_for(args)
        pairs = [batched_arg(a, device) for a in args]
        inputs = [p[0] for p in pairs]
        dims = [p[1] for p in pairs]
        per_member = bool(self._state_keys) or any(d is not None and any(x == 0 for x in tree_flatten(d)[0]) for d in dims)
        return inputs, dims, per_member

    def _rebuild(self, tensors: Any, meta: dict[str, Any] | None = None) -> list:
        """The stage's outputs: vmap's tensors put back into the structure one_member recorded
        (`meta`, default the latest call's; its non-tensor leaves hold only for inputs of that signature)."""
        meta = self._meta if meta is None else meta
        if meta.get("flat"):
            return [Batched(t) for t in tensors]
        leaves = list(meta["leaves"])
        for slot, t in zip(meta["tensor_at"], tensors):
            leaves[slot] = t
        return [Batched(v) for v in tree_unflatten(leaves, meta["spec"])]

    def _vmapped_for(self, dims: Any, training: bool) -> Callable:
        """The vmapped stage for arguments with these in_dims (made on first use, then kept); call it
        with the state tensors (in `_state_keys` order), then the inputs, all positional."""
        whole = self._unchunk_with_grad and torch.is_grad_enabled()
        key = (tuple(dims) if all(d is None or type(d) is int for d in dims) else repr(dims), training) + \
            (("unchunked",) if whole else ())
        fn = self._vmapped.get(key)
        if fn is None:
            in_dims = (0,) * len(self._state_keys) + tuple(dims)
            chunk_size = None if whole else self.program.stage.options.chunk_size
            if chunk_size is None and all(d is None or d == 0 for d in dims):
                fn = flat_vmap(self._one_member, in_dims, self.n_members, randomness(self.program.module))
            else:
                fn = vmap(self._one_member, in_dims=in_dims, randomness=randomness(self.program.module), chunk_size=chunk_size)
            if self._grad_kernels is not None:
                fn = self._grad_kernels(fn)
            self._vmapped[key] = fn
        return fn

    def _state_args(self) -> list[torch.Tensor]:
        """The stacked state in `_state_keys` order (read per call: in-place updates and `.data` swaps show)."""
        stacked = self.stacked
        return [stacked[k] for k in self._state_keys]

    def run(self, args: list) -> list:
        # a stage writing in place given a tensor in another layout: what a failed first attempt writes (a chunked
        # vmap writes chunk by chunk before the layout error) is put back before the retry
        kept = _values_kept(args) if self.program.writes_in_place and any(_other_layout(a) for a in args) else None
        try:
            return self._run(args)
        except RuntimeError as e:
            if "querying is_contiguous inside of vmap for memory_format" not in str(e):
                raise
            # a channels_last input meets an op that asks for its memory format (GroupNorm): vmap cannot answer
            # that, so the inputs go in in the default layout (the values are the same)
            if kept is None:
                return self._run([_default_layout(a) for a in args])
            _put_back(kept, self.program.describe)
            fixed = [_default_layout(a) for a in args]
            return _written_back(args, fixed, self._run(fixed))

    def _run(self, args: list) -> list:
        training = self.program.module.training
        dims, inputs = _simple_args(args)
        if dims is not None and not training and (self._state_keys or 0 in dims) and not (
                self._unchunk_with_grad and torch.is_grad_enabled()):
            # the per-call fast path: shared values and batched tensors into a vmap made before
            fn = self._vmapped.get((dims, False))
            if fn is None:
                fn = self._vmapped_for(dims, False)
            return self._rebuild(fn(*self._state_args(), *inputs))
        inputs, dims, per_member = self._vmap_args(args)
        if not per_member and training:
            # training: random ops (dropout) must draw per member, so nothing is computed once and shared
            inputs, dims, per_member = self._vmap_args([as_batched(a, self.n_members, self.device_for(args)) for a in args])
        if not per_member and self._draws:
            # random draws with nothing per member: each member draws its own, in member order, as the loop does
            outs = [self._call(*inputs) for _ in range(self.n_members)]
            return [PerMember([o[k] for o in outs]) for k in range(len(outs[0]))]
        if not per_member:
            # nothing member-specific goes in: compute once, share the result
            out = self._call(*inputs)  # no state: the stage module's forward
            return [Shared(v) for v in out]
        return self._rebuild(self._vmapped_for(dims, training)(*self._state_args(), *inputs))


class LoopRunner(Runner):
    """The member loop: the stage once per member with that member's own state."""

    takes_python_numbers = True

    def run(self, args: list) -> list:
        module = self.program.module
        results = []
        for i in range(self.n_members):
            member_args = tuple(member_value(a, i) for a in args)
            results.append(functional_call(module, self.member_states[i], member_args, tie_weights=False))
        n_out = len(self.program.output_names)
        return [PerMember([r[k] for r in results]) for k in range(n_out)]


RUNNERS: dict[Strategy, type[Runner]] = {Strategy.VMAP: VmapRunner, Strategy.LOOP: LoopRunner}


def runner_for(program: StageProgram, n_members: int, stacked: dict[str, torch.Tensor], member_states: list[dict]) -> Runner:
    """The runner for a stage's strategy.

    An excluded stage never carries vmap or cuda_graph (planner.plan.Stage turns them
    into loop), so it runs as the loop, or as `wide` / `compile` where autotune found
    those batch it correctly after all.
    """
    stage = program.stage
    strategy = stage.options.strategy
    if strategy is Strategy.WIDE and (program.writes_untracked or any(
            n.op == "call_function" and n.target is getattr and len(n.args) > 1 and n.args[1] == "data"
            for n in program.module.graph.nodes)):
        # a write through `.data` (`r.data.clamp_(...)`), which bumps no version counter: wide runs the ops on N-first
        # copies of what it is handed, so the write would not reach the tensor later stages read (0.72 off)
        warnings.warn(f"stage {program.describe}: strategy 'wide' is not applied: the stage reads or writes through "
                      "`.data`, which the wide strategy's N-first copies would not hand on; it runs as the member loop",
                      UserWarning, stacklevel=3)
        strategy = Strategy.LOOP
    cls = RUNNERS.get(strategy)
    if cls is None:
        known = ", ".join(s.value for s in RUNNERS)
        raise ExecutionError(f"stage {stage.id}: strategy {strategy.value!r} is not available here; use one of {known}")
    return cls(program, n_members, stacked, member_states)
