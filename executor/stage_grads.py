"""One stage forward and backward, and the check of its gradients against the member loop's.

Used by the training profile (executor.profile_train) and the training-mode autotune
(executor.autotune_train). A stage's float inputs that come from earlier stages are made
leaves that require grad, the surrogate loss is a fixed random weighting of its float outputs, and
`torch.autograd.grad` gives the gradients of its member state and of those inputs.
A per_member Python number (an [N] tensor holding the members' numbers, see
per_member_numbers) is no such input: the member loop hands each member a Python number,
which has no gradient, and an op that must get a Python number (F.leaky_relu's slope)
refuses a 0-d tensor that requires grad ("must be Number, not Tensor"), so it stays as given.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# what keeps a per_member number a number (build.number_takers follows the same ops: `a * 0.5` is still one)
from stagewise.executor.build import _NUMBER_ARITHMETIC
from stagewise.executor.candidates import max_rel_error
from stagewise.executor.own_storage import own_storage
from stagewise.executor.stages import LoopRunner, Runner, StageProgram
from stagewise.executor.values import Batched, PerMember, Shared, leaf_paths, n_first
# the gradients' tolerance is verify(grads=True)'s own, defined there (a candidate autotune keeps passes verify);
# here for profile_train and autotune_train, which judge stages by it
from stagewise.executor.verify import GRADS_RTOL, grads_tolerance, members_grads_rtol  # noqa: F401


def float_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a pytree."""
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _leaf(x: Any) -> Any:
    return x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _leaves_but(tree: Any, numbers: frozenset) -> Any:
    """`tree` with every float tensor a fresh leaf that requires grad, but those at the key paths in `numbers`
    (() for the whole value)."""
    if () in numbers:
        return tree
    if not numbers:
        return tree_map(_leaf, tree)
    flat, spec = tree_flatten(tree)
    return tree_unflatten([x if path in numbers else _leaf(x) for x, path in zip(flat, leaf_paths(tree))], spec)


def _with_grad_leaves(args: list, numbers: list[frozenset] | None = None) -> tuple[list, list[torch.Tensor]]:
    """The stage's arguments with every float tensor of a batched or per-member value a fresh leaf that requires grad,
    but the per_member numbers (`numbers[k]`: the key paths in argument k that hold one, see per_member_numbers)."""
    out, leaves = [], []
    for k, a in enumerate(args):
        skip = numbers[k] if numbers else frozenset()
        if isinstance(a, Batched):
            a = Batched(_leaves_but(a.tree, skip))
        elif isinstance(a, PerMember):
            a = PerMember([_leaves_but(v, skip) for v in a.values])
        out.append(a)
        if not isinstance(a, Shared):
            leaves += [x for x in tree_flatten(a.tree if isinstance(a, Batched) else a.values)[0]
                       if isinstance(x, torch.Tensor) and x.requires_grad]
    return out, leaves


def per_member_numbers(module: Any, env: dict) -> dict[str, frozenset]:
    """{boundary value name: the key paths in it (() for the whole value) that hold a per_member Python number} for
    the BatchedModule `module` whose bound inputs (bind_inputs) are `env`: an input traced as a Python number, a
    number inside a per_member container input that build follows (an [N] leaf, as build's
    _follow_container_numbers counts it), and what the stages make of them with Python arithmetic or by reading the
    container (`cfg["slope"] * 0.5`), handed from stage to stage. Said by the stages' graphs, nothing is run."""
    found: dict[str, set] = {name: {()} for name in module.__dict__.get("_traced_numbers") or ()}
    for name in module.__dict__.get("_container_loops") or {}:
        v = env.get(name)
        if isinstance(v, Batched):
            paths = {path for path, x in zip(leaf_paths(v.tree), tree_flatten(v.tree)[0])
                     if isinstance(x, torch.Tensor) and x.dim() == 1}
            if paths:
                found[name] = paths
    if not found:
        return {}
    for program in module.programs:
        inputs = {f"in_{name}": name for name in program.input_names}
        held: dict[str, set] = {}  # node name in the stage -> the number paths under its value
        for node in program.module.graph.nodes:
            if node.op == "placeholder":
                paths = found.get(inputs.get(node.name, ""))
                if paths:
                    held[node.name] = set(paths)
            elif node.op == "call_function" and node.target in _NUMBER_ARITHMETIC and node.all_input_nodes and all(
                    () in held.get(x.name, ()) for x in node.all_input_nodes):
                held[node.name] = {()}
            elif (node.op == "call_function" and node.target is operator.getitem or node.op == "call_method"
                  and node.target == "get") and len(node.args) > 1 and isinstance(node.args[0], torch.fx.Node) \
                    and not isinstance(node.args[1], (torch.fx.Node, slice)) and node.args[0].name in held:
                key = node.args[1]
                under = {path[1:] for path in held[node.args[0].name] if path and path[0] == key}
                if under:
                    held[node.name] = under
        for name in program.output_names:
            if name in held:
                found[name] = held[name]
    return {name: frozenset(paths) for name, paths in found.items()}


def fwd_bwd(program: StageProgram, runner: Runner, fresh: Callable[[], list], n: int,
            numbers: dict[str, frozenset] | None = None) -> Callable[[], list]:
    """A call running the stage forward and backward (surrogate loss = its float outputs weighted by fixed random
    numbers, the same for every runner); returns the gradients.
    `numbers`: per_member_numbers of the module, kept out of the gradient leaves."""
    params = [t for t in runner.stacked.values() if t.requires_grad]
    skip = [(numbers or {}).get(name, frozenset()) for name in program.input_names]
    fixed = None if program.writes_in_place else _with_grad_leaves(fresh(), skip)

    by_member = program.writes_in_place and isinstance(runner, LoopRunner)
    weights: dict[tuple, torch.Tensor] = {}

    def weighted(k: int, x: torch.Tensor) -> torch.Tensor:
        # each output weighted by fixed random numbers in [0.5, 1.5), the same for the loop and every candidate (seeded
        # by the leaf's place): a plain sum checks no gradient through an output whose sum is constant (a softmax, a
        # normalisation), where every reference gradient upstream is 0. Made once per leaf shape, not per timed call
        key = (k, tuple(x.shape), x.device)
        w = weights.get(key)
        if w is None:
            w = torch.rand(x.shape, generator=torch.Generator().manual_seed(7919 + k)).add_(0.5).to(x.device)
            weights[key] = w
        return (x.float() * w).sum()

    def call() -> list:
        args, leaves = fixed if fixed is not None else (fresh(), [])
        if by_member:
            args = _own_rows(args, n)
        outs = runner(args)
        flat = [x for v in outs for x in float_leaves(n_first(v, n))]
        loss = sum((weighted(k, x) for k, x in enumerate(flat)), torch.zeros((), device=_device(params, leaves)))
        targets = params + leaves
        if not targets or not loss.requires_grad:
            return []
        grads = torch.autograd.grad(loss, targets, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]

    return call


def _own_rows(args: list, n: int) -> list:
    """Each member's own copy of the memory its values share with other members', for a stage run member by member
    that writes in place, as the batched module hands them (build._Writes, own_storage): rows of one tensor share its
    version counter, so an op that saves a value for backward (ReLU(inplace=True)) would find it changed by the next
    member's write. Nothing is written back: only the gradients are kept."""
    return own_storage(args, n, range(len(args)))[0]


def _device(params: list, leaves: list) -> torch.device | None:
    t = next(iter(params + leaves), None)
    return t.device if t is not None else None


# a gradient tensor is judged against at least this part of its member's largest gradient: float32 rounding noise of a
# gradient that is zero in exact arithmetic reaches ~3e-6 of that (verify.GRAD_NOISE), 3e-5 of the floor, under the
# float32 tolerance 1e-4; a wrong tensor is seen from 1e-5 of the member's scale (1e-4 of it judged whole-member alone)
_TENSOR_SCALE_FLOOR = 0.1


def grads_check(ref: list, n: int) -> Callable[[list], float]:
    """Error of a stage's gradients against the member loop's: normwise over each member's [N, ...] gradients (a
    per-member input's pieces are compared as one row each), and each gradient tensor apart against the larger of
    its own scale and 0.1 of its member's largest gradient (a small bias's gradient wholly wrong hid in the
    member's norm; the floor keeps a gradient that cancels to almost nothing from being judged on its rounding)."""
    if not ref:
        return lambda got: 0.0
    ref_rows = _rows(ref, n)
    apart = [k for k, g in enumerate(ref) if g.dim() and g.shape[0] == n]
    floor = _finite_abs(ref_rows[0]).amax(dim=1) * _TENSOR_SCALE_FLOOR if ref_rows[0].numel() else None

    def check(got: list) -> float:
        worst = max(max_rel_error(*pair) for pair in zip(_rows(got, n), ref_rows))
        if worst == float("inf") or floor is None or len(got) != len(ref):
            return worst
        for k in apart:
            g, w = (_as_real(x[k]).reshape(n, -1).double() for x in (got, ref))
            if g.shape != w.shape:
                return float("inf")
            if not w.numel():
                continue
            diff = _finite_abs(g - w).amax(dim=1)
            scale = torch.maximum(_finite_abs(w).amax(dim=1), floor.double())
            rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)
            worst = max(worst, float(rel.max()))
        return worst

    return check


def _as_real(g: torch.Tensor) -> torch.Tensor:
    """A complex gradient as its (real, imaginary) pairs (.float() would keep its real part alone)."""
    return torch.view_as_real(g.resolve_conj()) if g.is_complex() else g


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and inf as 0 (where they sit is checked apart: verify.nonfinite_apart)."""
    return x.detach().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)


def _rows(grads: list, n: int) -> list:
    """(the [N, ...] gradients as one [N, total] tensor, the rest as rows of their own)."""
    stacked = [_as_real(g).reshape(n, -1).float() for g in grads if g.dim() and g.shape[0] == n]
    rest = [g.reshape(1, -1) for g in grads if not (g.dim() and g.shape[0] == n)]
    return [torch.cat(stacked, dim=1) if stacked else torch.zeros(n, 0)] + rest


