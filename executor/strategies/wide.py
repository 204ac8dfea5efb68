"""The `wide` strategy: run a stage's graph node by node on N-first tensors,
using hand-batched kernels where they exist (executor.strategies.wide_layers,
wide_ops) and `torch.func.vmap` of the single op where they do not.

Input/output format: stage boundary values (Shared / Batched / PerMember);
inside the stage a batched value is `NFirst(t)`, t = [N, *member_shape].

Because every node with a wide rule runs without vmap, this strategy also runs
stages that were excluded because vmap has no batching rule for one of their
ops (scaled_dot_product_attention, nn.GRU, nn.LSTM on CPU; nn.MultiheadAttention and
nn.TransformerEncoder(Layer), which vmap runs only through its slow per-member fallback):
`wide_rule_gaps` says which nodes of a stage would still need vmap.

Convolutions run in the stage's conv form (wide_layers.CONV_FORMS_DOC: per-member loop,
grouped, grouped channels_last, im2col + baddbmm, cuDNN benchmark mode on GPU), read from
the stage's options (conv_form_of; "" = the device's default) when the runner is made.

The node program is built once per runner (WideRunner._compile_program): per call
only tensor ops and a closure per node run. nn.Linear is one baddbmm against
[N, in, out] weights transposed at construction, fused with the activation
module that is its only reader (applied in place on the fresh GEMM output).
Measured on the 2-core CPU, round-robin against HEAD's interpreter: deep MLP
(8 x Linear+GELU, N=20) 1.35x -> 1.01x the floor, MLP 64-128-64 N=100
1.24/1.33x -> 1.14/1.21x (shared / per-member input, warm caches, 2 threads).
"""
from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import fields, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch.func import functional_call, vmap
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.planner.errors import ExecutionError, PlanFileError
from stagewise.planner.capability import ALWAYS_VIEWS, VIEW_NAMES, base_name, is_inplace, region_graphs
from stagewise.planner.graph import RANDOM_OPS
from stagewise.planner.plan import StageMode, StageOptions
from stagewise.planner.trace_watch import storage_root
from stagewise.executor.stages import Runner, StageProgram, check_indices_under, check_member_indices
from stagewise.executor.strategies import wide_ops
from stagewise.executor.strategies.wide_layers import (CONV_FORMS, ELEMENTWISE_MODULES, conv, conv_forms,
                                                       inplace_activation, module_rule)
from stagewise.executor.strategies.wide_ops import NFirst, is_nf, op_name
from stagewise.executor.values import Batched, PerMember, Shared, stack_member_values

# functions/methods with a rule of their own (everything else falls back to vmap of the op)
_RULED = (wide_ops.ELEMENTWISE | set(wide_ops.DIM_ARGS) | wide_ops.META | wide_ops.MATMUL
          | {"getattr", "getitem", "view", "reshape", "_unsafe_view", "expand", "permute", "t", "repeat",
             "cat", "concat", "concatenate", "stack", "scaled_dot_product_attention", "linear", "layer_norm"})


def _any_nf(x: Any) -> bool:
    if isinstance(x, NFirst):
        return True
    if isinstance(x, (list, tuple)):
        return any(_any_nf(v) for v in x)
    if isinstance(x, dict):
        return any(_any_nf(v) for v in x.values())
    if isinstance(x, (torch.Tensor, int, float, bool, str, type(None))):
        return False
    # other pytree nodes (an output dataclass, registered at build): look at their leaves
    return any(is_nf(v) for v in tree_flatten(x, is_leaf=is_nf)[0])


def _method(name: str) -> Callable:
    return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)


# why the planner excludes a node where vmap still runs it right (its reason's start, or a phrase in it): through
# vmap's slow per-member fallback, or because of what it writes (wide hands the stage [N, ...] copies of those)
_VMAP_SAFE_REASONS = ("no batching rule for", "in-place update of buffer", "makes a tensor from sizes alone")


def _vmap_unsafe(reason: str) -> bool:
    """Whether an excluded stage's reason (parts joined by "; " where stages merged) holds one where vmap would not
    run the node as each member does (or not at all): anything but the reasons in _VMAP_SAFE_REASONS, an exclusion
    by the user included (its reason is unknown). At build the reason holds the members' own graph's verdicts beside
    the plan file's (planner.validate.with_fresh_verdicts), so a stale or edited reason does not hide an unsafe node."""
    return any(not any(safe in part for safe in _VMAP_SAFE_REASONS) for part in reason.split("; ") if part) or not reason


def wide_rule_gaps(program: StageProgram) -> list[str]:
    """Nodes of the stage that have no wide rule (they would run under vmap of the single op)."""
    gaps = []
    for node in program.module.graph.nodes:
        if node.op == "call_module":
            if module_rule(program.module.get_submodule(node.target)) is None:
                gaps.append(node.name)
        elif node.op in ("call_function", "call_method") and op_name(node.target) not in _RULED \
                and node.target is not check_member_indices:  # checked N-first in _call, without vmap
            gaps.append(node.name)
    return gaps


# --- the convolution form of a wide stage --------------------------------------------------------
# A plan records the form autotune chose as a tag in the stage's options.note ("[wide: conv=bmm]"),
# so the JSON plan rebuilds the same kernels. A future StageOptions field `variant` ("conv=bmm")
# is read first where it exists; the note tag is what plans carry today.
_FORM_TAG = re.compile(r"\[wide: conv=([a-z0-9_]+)\]")


def conv_form_of(options: StageOptions) -> str:
    """The conv form recorded in a stage's options ("" = the device's default form).

    Raises PlanFileError for a form that does not exist (a hand-edited plan)."""
    variant = getattr(options, "variant", "") or ""
    found = re.fullmatch(r"conv=([a-z0-9_]+)", variant) or _FORM_TAG.search(options.note)
    form = found.group(1) if found else ""
    if form and form not in CONV_FORMS:
        raise PlanFileError(f"unknown wide conv form {form!r} in the stage options; use one of {', '.join(CONV_FORMS)} "
                            "or remove the [wide: conv=...] tag from the note")
    return form


def with_conv_form(options: StageOptions, form: str) -> StageOptions:
    """`options` with `form` recorded ("" removes the record): the note tag, and the `variant`
    field too where StageOptions has one (plans read by older versions still find the tag)."""
    note = _FORM_TAG.sub("", options.note).rstrip()
    if form:
        note = f"{note} [wide: conv={form}]".lstrip()
    if "variant" in {f.name for f in fields(options)}:
        return replace(options, note=note, variant=f"conv={form}" if form else "")
    return replace(options, note=note)


def wide_conv_forms(program: StageProgram, device) -> list[str]:
    """Conv forms worth trying for the stage on `device`, the default first; [] without convolutions."""
    forms: list[str] = []
    for node in program.module.graph.nodes:
        if node.op == "call_module":
            mod = program.module.get_submodule(node.target)
            if module_rule(mod) is conv:
                forms += [f for f in conv_forms(mod, device) if f not in forms]
    return forms


class WideRunner(Runner):
    """Hand-batched kernels over stacked state (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        gm = self.program.module
        self._nodes = list(gm.graph.nodes)
        self._calls: dict[str, tuple] = {}
        form = conv_form_of(self.program.stage.options)
        for node in self._nodes:
            if node.op == "call_module":
                mod = gm.get_submodule(node.target)
                prefix = f"{node.target}."
                state = {k[len(prefix):]: v for k, v in self.stacked.items() if k.startswith(prefix)}
                rule = module_rule(mod)
                if rule is conv and form:
                    rule = functools.partial(conv, form=form)
                self._calls[node.name] = (mod, rule, state)
            elif node.op == "call_function":
                self._calls[node.name] = (node.target, op_name(node.target))
            elif node.op == "call_method":
                self._calls[node.name] = (_method(node.target), op_name(node.target))
            elif node.op == "get_attr":
                value = self.stacked.get(str(node.target))
                self._calls[node.name] = (NFirst(value) if value is not None else _attr(gm, str(node.target)),)
        # a submodule handed to a torch.fx.wrap helper (`run_packed(self.rnn, x)`): the call runs once per member with
        # that member's state swapped into the module (the stage module's own copy holds member 0's)
        self._module_args: dict[str, list[tuple[torch.nn.Module, dict]]] = {}
        for node in self._nodes:
            if node.op in ("call_function", "call_method"):
                mods = [(self._calls[a.name][0], {k[len(f"{a.target}."):]: v for k, v in self.stacked.items()
                                                  if k.startswith(f"{a.target}.")})
                        for a in node.all_input_nodes
                        if a.op == "get_attr" and isinstance(self._calls.get(a.name, (None,))[0], torch.nn.Module)]
                if mods:
                    self._module_args[node.name] = mods

        self._fused = _sibling_linears(gm, self.stacked)  # first node of a group -> the group's node names
        self._pending: dict[str, Any] = {}
        # nodes vmap ran (tried once: no more checks) and nodes it could not run (run once per member from then on)
        self._vmap_ran: set[str] = set()
        self._per_member: set[str] = set()
        if self.program.stage.mode == StageMode.EXCLUDED and _vmap_unsafe(self.program.stage.reason):
            # an excluded stage runs wide for the ops wide has rules for (a GRU, a convolution); where the planner
            # found vmap, which wide falls back on for the others, cannot run them (an autocast region it would run
            # without its autocast, linalg.solve with a shared right-hand side in another shape), each member runs
            # those, as the loop would
            self._per_member.update(n.name for n in self._nodes if n.op in ("call_module", "call_function", "call_method"))
        self._program = self._compile_program(gm)

    def _linear_group(self, first: str, group: list[str], x: Any) -> Any:
        """Sibling Linears reading one input as one GEMM against their weights concatenated;
        the other members' results wait in self._pending until their nodes run."""
        states = [self._calls[name][2] for name in group]
        # concatenated on every call: a copy kept across calls would miss writes through `.data` (see wide_ops.relaid)
        w = torch.cat([st["weight"] for st in states], dim=1)
        b = torch.cat([st["bias"] for st in states], dim=1) if "bias" in states[0] else None
        y = wide_ops.linear(x, NFirst(w), NFirst(b) if b is not None else None, self.n_members)
        parts = y.split([st["weight"].shape[1] for st in states], dim=-1)
        for name, part in zip(group[1:], parts[1:]):
            self._pending[name] = NFirst(part)
        return NFirst(parts[0])

    def _compile_program(self, gm: torch.fx.GraphModule) -> tuple:
        """The node program, built once: (constants, placeholder names, steps, output args).

        Each step is a closure `step(env)` that reads its inputs from `env` (node name -> value)
        and stores its result; per call only the steps run. Linear layers (not in a sibling group)
        get a direct kernel step against weights transposed here once, with the activation module
        that is their only reader applied in place on the fresh GEMM output (see _linear_step).
        Every other node interprets its arguments (_generic_step).
        """
        grouped = {name for group in self._fused.values() for name in group}
        consts, placeholders, steps, skip = {}, [], [], set()
        outputs: Any = ()
        for node in self._nodes:
            if node.op == "placeholder":
                placeholders.append(node.name)
            elif node.op == "get_attr":
                consts[node.name] = self._calls[node.name][0]
            elif node.op == "output":
                outputs = node.args[0]
            elif node.name in skip:
                continue
            elif node.op == "call_module" and node.name not in grouped and (fast := self._linear_step(gm, node)):
                step, fused_act = fast
                steps.append(step)
                if fused_act is not None:
                    skip.add(fused_act)
            elif node.op == "call_module" and isinstance(self._calls[node.name][0], ELEMENTWISE_MODULES):
                steps.append(self._elementwise_step(node))
            else:
                steps.append(self._generic_step(node))
        return consts, placeholders, steps, tuple(outputs) if isinstance(outputs, (list, tuple)) else (outputs,)

    def _generic_step(self, node: torch.fx.Node) -> Callable[[dict], None]:
        """Interpret one node: load its arguments from env, dispatch through _call.

        An in-place op (`h.mul_(0.5)`, `F.relu(h, inplace=True)`) hands on its first operand itself, as torch returns
        it: the result vmap or the member loop gives back is a stacked copy, and a later write through it (`.add_()`
        chained in the next stage) would miss the value (a buffer's slice) the loop writes."""
        name, args, kwargs, call = node.name, node.args, node.kwargs, self._call
        map_arg = torch.fx.node.map_arg
        returns_operand = node.op != "call_module" and is_inplace(node) and op_name(node.target) != "setitem"

        def step(env: dict) -> None:
            load = lambda a: env[a.name]  # noqa: E731
            a = map_arg(args, load)
            out = call(node, a, map_arg(kwargs, load))
            env[name] = a[0] if returns_operand and type(a[0]) is NFirst and type(out) is NFirst else out

        return step

    def _elementwise_step(self, node: torch.fx.Node) -> Callable[[dict], None]:
        """A stateless elementwise module (ReLU, GELU, ...) on one N-first tensor: the module itself."""
        generic = self._generic_step(node)
        mod = self._calls[node.name][0]
        src = node.args[0].name if len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], torch.fx.Node) else None
        if src is None:
            return generic
        name = node.name

        def step(env: dict) -> None:
            x = env[src]
            if type(x) is NFirst:
                env[name] = NFirst(mod(x.t))
            else:
                generic(env)

        return step

    def _linear_step(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[tuple[Callable[[dict], None], Optional[str]]]:
        """nn.Linear of every member as one baddbmm on [N, M, in] x [N, in, out], or None (no fast form).

        The weights are read as a transposed [N, in, out] view on every call (an NT GEMM: a copy
        kept across calls would miss writes through `.data`, see wide_ops.relaid); the bias is a
        [N, 1, out] view, broadcast inside baddbmm. Where the Linear's only reader is an
        activation module with an in-place form, the activation runs in place on the GEMM
        output and the pair is one step (returns the activation's node name to skip).
        Calls that need autograd, or inputs of another form, take the interpreted path.
        Returns (step, fused activation node name or None).
        """
        mod, _, state = self._calls[node.name]
        if (type(mod) is not torch.nn.Linear or module_rule(mod) is None or node.kwargs or len(node.args) != 1
                or not isinstance(node.args[0], torch.fx.Node) or "weight" not in state
                or (mod.bias is not None and "bias" not in state)):
            return None
        w, b = state["weight"], state.get("bias")
        if w.dim() != 3:
            return None
        n, out_f, in_f = w.shape
        act, act_node = None, None
        users = list(node.users)
        if len(users) == 1 and users[0].op == "call_module" and len(users[0].args) == 1 and not users[0].kwargs:
            act = inplace_activation(gm.get_submodule(users[0].target))
            act_node = users[0] if act is not None else None
        src, dst = node.args[0].name, (act_node or node).name
        generic = self._generic_step(node)
        generic_act = self._generic_step(act_node) if act_node is not None else None

        def interpreted(env: dict) -> None:
            generic(env)
            if generic_act is not None:
                generic_act(env)

        def step(env: dict) -> None:
            x = env[src]
            if type(x) is NFirst:
                t = x.t
                batch = t.shape[1:-1]
                x3 = t if t.dim() == 3 else t.reshape(n, -1, in_f)
            elif isinstance(x, torch.Tensor) and x.dim() >= 1:
                t = x
                batch = x.shape[:-1]
                x3 = x.reshape(1, -1, in_f).expand(n, -1, -1)  # shared: broadcast, no copy
            else:
                return interpreted(env)
            if torch.is_grad_enabled() and (t.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
                return interpreted(env)  # autograd records: the generic path, whose in-place activation is not used
            wt = w.transpose(1, 2)  # views made per call: nothing derived from the weights outlives the call
            y = torch.baddbmm(b.unsqueeze(1), x3, wt) if b is not None else torch.bmm(x3, wt)
            if act is not None:
                act(y)  # y is fresh (ours alone) and no autograd records: safe in place
            env[dst] = NFirst(y if len(batch) == 1 else y.view(n, *batch, out_f))

        return step, (act_node.name if act_node is not None else None)

    def run(self, args: list) -> list:
        n = self.n_members
        consts, placeholders, steps, outputs = self._program
        self._pending.clear()
        env = dict(consts)
        for name, value in zip(placeholders, args):
            env[name] = _bind(value)
        for step in steps:
            step(env)
        return [_unbind(env[v.name] if isinstance(v, torch.fx.Node) else v, n) for v in outputs]

    def _call(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        n = self.n_members
        entry = self._calls[node.name]
        if node.op == "call_module":
            if node.name in self._pending:
                return self._pending.pop(node.name)
            if node.name in self._fused:
                return self._linear_group(node.name, self._fused[node.name], args[0])
            mod, rule, state = entry
            if not state and not _any_nf((args, kwargs)):
                if mod.training and draws_while_training(mod):  # a mask (an RReLU slope) per member
                    return NFirst(torch.stack([mod(*args, **kwargs) for _ in range(n)]))
                return mod(*args, **kwargs)
            out = rule(mod, state, args, kwargs, n) if rule is not None else None
            if out is None and (isinstance(mod, torch.nn.RNNBase) or (mod.training and draws_while_training(mod))):
                # vmap cannot stand in: it refuses random draws, and cuDNN's RNN has no batching rule (a refused
                # configuration: bidirectional, dropout between layers while training, an unbatched input)
                return _member_loop(mod, state, args, kwargs, n)
            if out is None:
                if node.name in self._per_member:
                    return _member_loop(mod, state, args, kwargs, n)
                # the first attempt may update buffers before vmap gives up (BatchNorm counts the batch, then reads the
                # count): they are put back before the members run, or the update would count twice
                saved = None if node.name in self._vmap_ran else \
                    {k: v.detach().clone() for k, v in state.items() if not v.requires_grad}
                try:
                    out = _vmap_call(lambda st, a, kw: functional_call(mod, st, a, kw, tie_weights=False), state, args, kwargs)
                except (RuntimeError, ValueError) as e:
                    if saved is None or not _VMAP_CANNOT.search(str(e)):
                        raise
                    with torch.no_grad():
                        for k, v in saved.items():
                            state[k].copy_(v)
                    # no batching rule (nn.LSTMCell) or a host read (BatchNorm's momentum=None reads a count): per member
                    self._per_member.add(node.name)
                    return _member_loop(mod, state, args, kwargs, n)
                self._vmap_ran.add(node.name)
            return out
        fn, name = entry
        if node.name in self._module_args:
            return _member_loop(fn, {}, args, kwargs, n, stateless=True, modules=self._module_args[node.name])
        if not _any_nf((args, kwargs)):
            if _is_random(node):  # one draw per member, as the loop makes (computed once it would be shared by all)
                draws = [fn(*args, **kwargs) for _ in range(n)]
                if isinstance(draws[0], (tuple, list)):  # a region's outputs (torch.no_grad() / autocast, export)
                    return type(draws[0])(NFirst(torch.stack(list(c))) if isinstance(c[0], torch.Tensor) else c[0]
                                          for c in zip(*draws))
                return NFirst(torch.stack(draws))
            return fn(*args, **kwargs)
        if isinstance(fn, torch._ops.OpOverload) and not fn._schema.returns:
            # an export graph's checks (_assert_tensor_metadata: dtype, device): the same for the stacked tensor
            return fn(*tree_map(lambda x: x.t if is_nf(x) else x, args, is_leaf=is_nf),
                      **tree_map(lambda x: x.t if is_nf(x) else x, kwargs, is_leaf=is_nf))
        if fn is check_member_indices and not is_nf(args[0]):
            # shared indices, handed on as they are: the op checks them against its own table, and the lookup keeps
            # them shared (through vmap they came back N-first, and torch's rule for both batched then trained
            # members 1..N-1's padding rows, the padding index not offset per member)
            return args[0]
        if fn is check_member_indices and is_nf(args[0]):
            # an embedding's / one_hot's member indices, N-first here: checked against one member's table without a vmap
            bound = args[1]
            rows = bound if type(bound) is int else bound.t.shape[1] if is_nf(bound) else bound.shape[0]
            check_indices_under(args[0].t, 0, rows, args[2], args[3])
            return args[0]
        if name == "getitem" and not is_nf(args[0]) and not _any_nf(args[1:]):
            return args[0][args[1]]  # an item of a container (a module's output tuple): None is an item too
        if name == "setitem" and is_nf(args[0]):
            # `h[i] = v`, `h.__setitem__(i, v)`: returns None, which vmap cannot hand back; the write is the result
            if node.name in self._per_member:
                return _member_loop(fn, {}, args, kwargs, n, stateless=True)
            fn = _returning_first_operand(fn)
        out = wide_ops.call_function(fn, name, args, kwargs, n) if name in _RULED else None
        if out is None:
            if node.name in self._per_member:
                return _member_loop(fn, {}, args, kwargs, n, stateless=True)
            try:
                out = _vmap_call(lambda st, a, kw: fn(*a, **kw), {}, args, kwargs, writes=_keeps_operand(node))
            except (RuntimeError, ValueError) as e:  # ValueError: vmap refusing what the op returns
                if node.name in self._vmap_ran or not _VMAP_CANNOT.search(str(e)):
                    raise
                self._per_member.add(node.name)
                return _member_loop(fn, {}, args, kwargs, n, stateless=True)
            self._vmap_ran.add(node.name)
        return None if name == "setitem" else out


def _returning_first_operand(fn: Callable) -> Callable:
    """`fn` (a setitem, which returns None) returning its first operand, the tensor it wrote: vmap hands back tensors
    only (that result is dropped: the node's value is None, as torch's)."""
    def call(*args, **kwargs):
        fn(*args, **kwargs)
        return args[0]

    return call


_RANDOM_METHODS = {"uniform_", "normal_", "bernoulli_", "bernoulli", "random_", "exponential_", "geometric_", "cauchy_",
                   "log_normal_", "multinomial"}


def _is_random(node: torch.fx.Node) -> bool:
    """Whether the node draws random numbers (fx: torch.rand & co, Tensor.bernoulli_ & co; export: seeded aten ops)."""
    target = node.target
    if node.op == "call_method":
        return target in _RANDOM_METHODS
    if isinstance(target, torch._ops.HigherOrderOperator):  # a torch.no_grad() / autocast region of torch.export:
        # a draw inside it (drop path, a Beta sample) is one too
        return any(_is_random(n) for sub in region_graphs(node) for n in sub.graph.nodes)
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    # (F.alpha_dropout, F.dropout2d, F.rrelu, F.gumbel_softmax, torch.feature_alpha_dropout: drawn as F.dropout is)
    return target in RANDOM_OPS or (getattr(target, "__name__", "") in _RANDOM_FUNCTIONS
                                    and (getattr(target, "__module__", None) or "").startswith("torch"))


def _sibling_linears(gm: torch.fx.GraphModule, stacked: dict) -> dict[str, list[str]]:
    """Groups of >= 2 nn.Linear nodes that read the same value (q, k, v projections), keyed by the first.

    HFTA-style horizontal fusion: one GEMM with the members' weights concatenated
    along the output axis instead of one small GEMM per layer.
    """
    groups: dict[str, list[torch.fx.Node]] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # where each storage is written in place: a group whose input is written between its first Linear and its last
    # (`q = a(h); h.relu_(); k = b(h)`) would run every Linear at the first one, before the write (fx records no
    # edge for it); a write before them all (`h = relu_(fc(x)); q, k = a(h), b(h)`) is one they all see
    writes: dict[torch.fx.Node, list[int]] = {}
    for n in gm.graph.nodes:
        if is_inplace(n):
            writes.setdefault(storage_root(n.args[0], every_module=False), []).append(order[n])
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.kwargs or len(node.args) != 1 or not isinstance(node.args[0], torch.fx.Node):
            continue
        mod = gm.get_submodule(node.target)
        if type(mod) is torch.nn.Linear and module_rule(mod) is not None and f"{node.target}.weight" in stacked:
            groups.setdefault(node.args[0].name, []).append(node)
    fused = {}
    for nodes in groups.values():
        first, last = order[nodes[0]], order[nodes[-1]]
        if any(first < at < last for at in writes.get(storage_root(nodes[0].args[0], every_module=False), ())):
            continue
        mods = [gm.get_submodule(x.target) for x in nodes]
        same = all(m.in_features == mods[0].in_features and (m.bias is None) == (mods[0].bias is None) for m in mods)
        if len(nodes) >= 2 and same and all(f"{x.target}.bias" in stacked for x in nodes if mods[0].bias is not None):
            fused[nodes[0].name] = [x.name for x in nodes]
    return fused


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _keeps_operand(node: torch.fx.Node) -> bool:
    """The op writes its first operand in place (`out[:, :, :3] = h`) or returns a view of it (`out[:, :, :3]`, to be
    written later): the operand must stay the value itself, since a write into a dense copy of it is lost."""
    name = node.target if node.op == "call_method" else base_name(node)
    return is_inplace(node) or name in VIEW_NAMES or name in ALWAYS_VIEWS


def _vmap_call(fn: Callable, state: dict, args: tuple, kwargs: dict, writes: bool = False) -> Any:
    """vmap of one op: batched operands on dim 0, shared ones broadcast. `writes`: the op writes its first operand in
    place or views it (_keeps_operand), which must then stay the value itself, not a dense copy of it."""
    unwrap = lambda x: _dense_images(x.t) if is_nf(x) else x  # noqa: E731
    dims = tree_map(lambda x: 0 if is_nf(x) else None, (args, kwargs), is_leaf=is_nf)
    a, kw = tree_map(unwrap, (args, kwargs), is_leaf=is_nf)
    if writes and args and is_nf(args[0]):
        a = (args[0].t, *a[1:])
    out = vmap(fn, in_dims=(0 if state else None, dims[0], dims[1]), randomness="error")(state, a, kw)
    return tree_map(lambda t: NFirst(t) if isinstance(t, torch.Tensor) else t, out)


_RANDOM_FUNCTIONS = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "feature_dropout", "dropout1d",
                               "dropout2d", "dropout3d", "rrelu", "rrelu_", "gumbel_softmax"})


def random_ops(gm: torch.fx.GraphModule) -> int:
    """How many ops of a stage module may draw random numbers (in training): `wide` runs each one per member in
    turn, so a stage with several draws them in another order than the member loop does."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            count += draws_while_training(gm.get_submodule(str(node.target)))
        elif node.op in ("call_function", "call_method"):
            count += _is_random(node)
    return count


def draws_while_training(module: torch.nn.Module) -> bool:
    """Whether `module` draws random numbers in training mode: a dropout of p > 0 in it (nn.Dropout & co, or
    nn.MultiheadAttention's attention dropout), an nn.RReLU."""
    return any((isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0) or isinstance(m, torch.nn.RReLU)
               or (isinstance(m, torch.nn.MultiheadAttention) and m.dropout > 0) for m in module.modules())


# vmap errors that say it cannot run the call at all (not that the call is wrong): the member loop stands in
_VMAP_CANNOT = re.compile(r"[Bb]atching rule not implemented|vmap: .*(\.item\(\)|data-dependent)|"
                          r"We could not generate a fallback|vmap: called random operation|"  # F.dropout & co
                          r"must only return Tensors")  # a module returning None (MultiheadAttention's weights)


def _member_loop(mod: Any, state: dict, args: tuple, kwargs: dict, n: int, stateless: bool = False,
                 modules: Sequence[tuple[torch.nn.Module, dict]] = ()) -> Any:
    """The module once per member, with that member's state and inputs, outputs stacked (NFirst): for a module whose
    wide rule refused the call and which vmap cannot run either (random draws while training, torch's RNNs). Members
    run in order, each drawing from the global generator, as the member loop (LoopRunner) draws. `modules`: modules
    the call is handed (a torch.fx.wrap helper's argument), each with the member's rows of its state swapped in."""
    outs = []
    for i in range(n):
        a, kw = tree_map(lambda x: x.t[i] if is_nf(x) else x, (args, kwargs), is_leaf=is_nf)
        with contextlib.ExitStack() as swapped:
            for module, st in modules:
                swapped.enter_context(_reparametrize_module(module, {k: v[i] for k, v in st.items()}))
            outs.append(mod(*a, **kw) if stateless else functional_call(mod, {k: v[i] for k, v in state.items()}, a,
                                                                        kw, tie_weights=False))
    first, spec = tree_flatten(outs[0])
    columns = [tree_flatten(o)[0] for o in outs]
    for j, leaf in enumerate(first):
        if not isinstance(leaf, torch.Tensor) and any(c[j] != leaf for c in columns[1:]):
            # a Python value per member (`.item()`): one value for all would be member 0's
            what = type(mod).__name__ if isinstance(mod, torch.nn.Module) else "a call"
            raise ExecutionError(f"{what} returns a Python value (.item(), .tolist()) that differs "
                                 f"between members ({', '.join(repr(c[j]) for c in columns[:3])}); the wide strategy "
                                 "holds one value for all members: run this stage with strategy 'loop'")
        if isinstance(leaf, torch.Tensor) and any(c[j].shape != leaf.shape for c in columns[1:]):
            # a shape that depends on the values (x[idx == e], nonzero): no stacked tensor holds the members' results
            what = type(mod).__name__ if isinstance(mod, torch.nn.Module) else "a call"
            raise ExecutionError(f"{what} gives each member a tensor of its own shape "
                                 f"({', '.join(str(list(c[j].shape)) for c in columns[:3])}{', ...' if n > 3 else ''}): "
                                 "a shape that depends on the values, which the wide strategy cannot stack; run this "
                                 "stage with strategy 'loop', its default")
    return spec.unflatten([NFirst(torch.stack([c[j] for c in columns])) if isinstance(leaf, torch.Tensor) else leaf
                           for j, leaf in enumerate(first)])


def _bind(value: Any) -> Any:
    """A boundary value inside the stage: batched tensors become NFirst, shared values stay plain."""
    if isinstance(value, Shared):
        return value.value
    if isinstance(value, Batched):
        if isinstance(value.tree, torch.Tensor):
            return NFirst(value.tree)
        return tree_map(lambda x: NFirst(x) if isinstance(x, torch.Tensor) else x, value.tree)
    assert isinstance(value, PerMember)
    tree, dims = stack_member_values(value.values)
    leaves, spec = tree_flatten(tree)
    dim_leaves = tree_flatten(dims)[0]
    return spec.unflatten([NFirst(x) if d == 0 else x for x, d in zip(leaves, dim_leaves)])


def _dense_images(t: torch.Tensor) -> torch.Tensor:
    """`t` in the standard layout if it is a batch of images in another (the grouped_nhwc conv form's channels-last
    rows): vmap cannot query such a tensor's layout (GroupNorm and InstanceNorm do), "NYI ... memory_format"."""
    return t.contiguous() if t.dim() >= 5 and not t.is_contiguous() else t


def _unbind(value: Any, n: int) -> Any:
    """A stage output as a boundary value: Batched if anything in it is per member, else Shared."""
    # (handed on as they are, not made dense: a copy would part a view from what it views, `v = h[:, :2]` then
    # `h.add_(b)` in a later stage, 2.9 off; a vmap stage asked the layout of channels-last rows retries on
    # contiguous copies of its arguments, putting back what it wrote)
    if type(value) is NFirst:
        return Batched(value.t)
    if not _any_nf(value):
        return Shared(value)
    return Batched(tree_map(lambda x: x.t if is_nf(x) else (x.unsqueeze(0).expand(n, *x.shape) if isinstance(x, torch.Tensor) else x),
                            value, is_leaf=is_nf))
