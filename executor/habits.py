"""Single-model torch utilities that would treat a batched module's N members as one model, made to say so or to act
per member.

- ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` over a batched module's parameters take one norm over all
  members together: one member's large gradient (a diverging member of an lr sweep) shrinks every member's step, where N
  separate runs clip each member by its own norm. A ``JointNormWarning`` says so at the call, with the fix
  (``executor.clip_grad_norm_per_member_``). It is a warning, not a refusal: members trained as one model on a joint
  loss (an ensemble's averaged prediction) mean the joint norm; filter the category to silence it.
- ``torch.optim.swa_utils.update_bn(loader, model)`` finds BatchNorm layers through ``model.modules()``; a batched
  module's layers are not among them (its modules are the stacked state), so torch's function would return without a
  change. Where ``model`` holds batched modules (``ens`` itself, an ``AveragedModel(ens)``), ``update_bn`` here does
  what torch's does to each member: the running statistics become the plain average over the loader's batches of each
  member's batch statistics (torch's ``momentum=None``), ``num_batches_tracked`` counts the batches, modes come back.

How they are reached: torch's ``clip_grad_norm_`` computes its norm through the module-level ``_get_total_norm`` of
``torch.nn.utils.clip_grad``, which ``watch`` wraps once (and the public aliases ``torch.nn.utils.get_total_norm``,
``torch.nn.utils.clip_grad_norm_``, ``torch.optim.swa_utils.update_bn``), so a ``from torch.nn.utils import
clip_grad_norm_`` made before stagewise was imported is covered too. ``stagewise.executor`` wraps them when imported,
so an ``update_bn`` imported by name after that is the wrapped one; one bound before is torch's own.
Nothing changes for tensors that are not a batched module's: the wrappers call torch's functions as they were.
"""
from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from stagewise.executor.subgraphs import region_calls, root_outside, walk
from stagewise.planner.errors import ExecutionError

__all__ = ["JointNormWarning", "update_bn", "watch"]


class JointNormWarning(UserWarning):
    """A norm over a batched module's parameters or gradients taken over all members together."""


_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_ORIGINAL: dict[str, Any] = {}


def watch(module: nn.Module) -> None:
    """Say where torch's gradient-norm functions mix `module`'s members, and make update_bn reach its BatchNorms."""
    _MODULES.add(module)
    install()


def install() -> None:
    """Wrap torch's functions (once; stagewise.executor does it when imported, so a `from torch.optim.swa_utils import
    update_bn` after `import stagewise` binds the wrapped one)."""
    if not _ORIGINAL:
        _install()


def _install() -> None:
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    import torch.optim.swa_utils as swa_utils

    total = getattr(clip_grad, "_get_total_norm", None)
    if total is not None:  # torch >= 2.6: clip_grad_norm_ computes its norm through this module global
        _ORIGINAL["_get_total_norm"] = total
        wrapped = _watched(total, "torch.nn.utils.clip_grad_norm_ (or get_total_norm)", grads=True)
        clip_grad._get_total_norm = wrapped
        if getattr(utils, "get_total_norm", None) is total:
            utils.get_total_norm = wrapped
    else:  # an older torch: the public function
        _ORIGINAL["clip_grad_norm_"] = clip_grad.clip_grad_norm_
        wrapped_clip = _watched(clip_grad.clip_grad_norm_, "torch.nn.utils.clip_grad_norm_", grads=False)
        clip_grad.clip_grad_norm_ = wrapped_clip
        utils.clip_grad_norm_ = wrapped_clip
    original = _ORIGINAL["update_bn"] = swa_utils.update_bn

    @functools.wraps(original)
    def update_bn_watched(loader, model, device=None):
        return update_bn(loader, model, device)

    swa_utils.update_bn = update_bn_watched


def _members_of(tensors: Iterable[Any], grads: bool) -> int:
    """The largest member count among the batched modules whose parameters (or their grads) are in `tensors`."""
    ids = {id(t) for t in tensors if isinstance(t, torch.Tensor)}
    n = 0
    for module in list(_MODULES):
        if module.n_members > n and any(id(p.grad if grads else p) in ids for p in module.parameters()):
            n = module.n_members
    return n


def _warn_joint(what: str, n: int) -> None:
    warnings.warn(
        f"{what} over a batched module's parameters takes one norm over all {n} members together: a clip scales every "
        f"member's gradients by it, so one member's large gradient (a diverging member of a sweep) shortens every "
        f"member's step, where {n} separate training runs clip each member by its own norm. Use "
        f"executor.clip_grad_norm_per_member_(ens.parameters(), max_norm, {n}) (it returns the [N] norms). If the "
        f"members train as one model on a joint loss, the joint norm is what you want: silence this with "
        f"warnings.filterwarnings('ignore', category=executor.JointNormWarning)", JointNormWarning,
        stacklevel=_callers_level())


def _callers_level() -> int:
    """The warnings stacklevel of the first frame outside torch and this module (the user's call of clip_grad_norm_,
    whichever of torch's functions led here)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or "/torch/" in frame.f_code.co_filename.replace("\\", "/")):
        frame, level = frame.f_back, level + 1
    return level


def _watched(fn, what: str, grads: bool):
    """`fn` (taking tensors or parameters first) warning where they are a batched module's, of several members.
    `grads`: the first argument holds gradients (get_total_norm), not parameters (clip_grad_norm_)."""
    @functools.wraps(fn)
    def watched(first, *args, **kwargs):
        if _MODULES and not torch.compiler.is_compiling():  # (dynamo cannot trace warnings.warn: fullgraph=True fails)
            first = [first] if isinstance(first, torch.Tensor) else list(first)
            n = _members_of(first, grads=grads)
            if n > 1:
                _warn_joint(what, n)
        return fn(first, *args, **kwargs)
    return watched


# --- update_bn --------------------------------------------------------------------------------

_EACH_MEMBER = ("run torch.optim.swa_utils.update_bn on each member (ens.member_state_dicts() into the members, then "
                "ens.load_member_state_dict(i, member.state_dict()))")


def _batched_norms(module: nn.Module) -> list[tuple[Any, float | None, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """A batched module's BatchNorm layers that keep running statistics: (the layer, or the training flag its traced
    op has, momentum (None: the layer's own cumulative average), stacked running mean, running var,
    num_batches_tracked or None). ExecutionError where the batched update_bn would not give torch's answer."""
    from stagewise.executor.members import tree_tensor

    found, calls = [], {}
    for stage in module.stage_modules:
        for node in stage.graph.nodes:
            if node.op == "call_module":
                calls[str(node.target)] = calls.get(str(node.target), 0) + 1
            elif node.op == "call_function" and node.target in _BATCH_NORM_OPS:
                calls[node.name] = 1
    seen = set()
    for stage in module.stage_modules:
        for name, layer in stage.named_modules():
            if not isinstance(layer, nn.modules.batchnorm._BatchNorm) or not layer.track_running_stats or name in seen:
                continue
            seen.add(name)
            keys = [f"{name}.running_mean", f"{name}.running_var", f"{name}.num_batches_tracked"]
            if not all(k in module._stacked for k in keys[:2]):
                raise ExecutionError(f"update_bn: the batched module's BatchNorm {name!r} keeps no stacked running "
                                     f"statistics under its name; {_EACH_MEMBER}")
            if calls.get(name, 0) > 1:
                raise ExecutionError(
                    f"update_bn: forward() calls BatchNorm {name!r} {calls[name]} times (two views through one encoder, "
                    "a block applied again): torch's update_bn averages the statistics of every call, which the batched "
                    f"one, reading one update per batch, cannot; {_EACH_MEMBER}")
            if layer.momentum is not None and not layer.momentum > 0:
                raise ExecutionError(f"update_bn: BatchNorm {name!r} has momentum={layer.momentum!r}, so its statistics "
                                     f"never move; {_EACH_MEMBER}")
            found.append((layer, None if layer.momentum is None else float(layer.momentum),
                          tree_tensor(module.stacked, keys[0]), tree_tensor(module.stacked, keys[1]),
                          tree_tensor(module.stacked, keys[2]) if keys[2] in module._stacked else None))
    ops: dict[str, int] = {}
    for stage in module.stage_modules:  # batch norm as an op (torch.export's aten.batch_norm, F.batch_norm under fx),
        for scope, node in walk(stage):  # inside a `with torch.no_grad():` block's sub-graph too (executor.subgraphs)
            if node.op != "call_function" or node.target not in _BATCH_NORM_OPS:
                continue
            try:
                args = node.normalized_arguments(scope.gm, normalize_to_only_use_kwargs=True).kwargs
            except Exception:
                args = None
            mean, var = (args or {}).get("running_mean"), (args or {}).get("running_var")
            if isinstance(mean, torch.fx.Node) and isinstance(var, torch.fx.Node) and scope.parent is not None:
                # a sub-graph's placeholders: the stage's values its call passes (one the block computes stays as it
                # is, no get_attr, and is refused below)
                mean, var = (root_outside(scope, v, lambda n: n)[1] for v in (mean, var))
            if not (isinstance(mean, torch.fx.Node) and isinstance(var, torch.fx.Node) and mean.op == var.op == "get_attr"):
                if mean is None and var is None and args is not None:
                    continue  # no running statistics (track_running_stats=False)
                raise ExecutionError(f"update_bn: the batched module's batch norm {node.name!r} takes running statistics "
                                     f"it does not hold as stacked state; {_EACH_MEMBER}")
            name = str(mean.target).rpartition(".")[0] or str(mean.target)
            if name in seen or str(mean.target) not in module._stacked:
                continue
            ops[name] = ops.get(name, 0) + 1
            if ops[name] > 1:
                raise ExecutionError(
                    f"update_bn: forward() runs the batch norm with statistics {name!r} more than once (two views "
                    "through one encoder): torch's update_bn averages the statistics of every call, which the batched "
                    f"one, reading one update per batch, cannot; {_EACH_MEMBER}")
            if not _in_batch_norm_layer(node):
                # torch's update_bn sets momentum None on BatchNorm layers; a batch norm called with a momentum of its
                # own (F.batch_norm(..., momentum=0.2) in forward()) keeps it there, so torch's result is that moving
                # average from reset statistics, and whether it resets them depends on which module holds them
                raise ExecutionError(
                    f"update_bn: forward() calls a batch norm itself ({node.name!r}, statistics {name!r}), with a "
                    f"momentum torch's update_bn does not reach; {_EACH_MEMBER}")
            momentum = args.get("momentum", 0.1)
            if not isinstance(momentum, (int, float)) or not momentum > 0:
                raise ExecutionError(f"update_bn: batch norm {node.name!r} has momentum={momentum!r}; {_EACH_MEMBER}")
            found.append((bool(args.get("training", False)), float(momentum), tree_tensor(module.stacked, str(mean.target)),
                          tree_tensor(module.stacked, str(var.target)),
                          tree_tensor(module.stacked, f"{name}.num_batches_tracked")
                          if f"{name}.num_batches_tracked" in module._stacked else None))
    for name in ops:
        seen.add(name)
    _refuse_unattributed(module, seen)
    return found


def _refuse_unattributed(module: nn.Module, attributed: set[str]) -> None:
    """ExecutionError where running statistics the batched module holds may be updated by forward() where no batch
    norm found above does it: written by another op (`self.bn.running_mean.mul_(...)`), or inside a region op whose
    graph cannot be looked into. Returning would leave them as they were, where torch's update_bn resets and averages
    them per layer."""
    from stagewise.executor.members import written_state

    stats = {k.rpartition(".")[0] for k in module._stacked if k.endswith((".running_mean", ".running_var"))}
    loose = sorted(stats - attributed)
    if not loose:
        return
    for stage in module.stage_modules:
        written = {k.rpartition(".")[0] for k in written_state(stage)[0]}
        closed = [n.name for scope, n in walk(stage) if isinstance(n.target, torch._ops.HigherOrderOperator)
                  and not region_calls(scope.gm, n)]
        hit = [name for name in loose if name in written]
        if hit or closed:
            how = (f"forward() writes {hit[0]!r}'s running statistics with an op other than a batch norm" if hit else
                   f"the stage runs {closed[0]!r}, a region op whose graph stagewise cannot look into, and may update "
                   f"{loose[0]!r}'s running statistics there")
            raise ExecutionError(f"update_bn: {how}, so the batched update_bn cannot reset and average them as torch's "
                                 f"does per BatchNorm layer; {_EACH_MEMBER}")


def _in_batch_norm_layer(node: torch.fx.Node) -> bool:
    """Whether a traced batch norm op is a BatchNorm layer's own (torch.export's module stack says so)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    kind = list(stack.values())[-1][1]
    if isinstance(kind, str):  # "torch.nn.modules.batchnorm.BatchNorm2d", "timm.layers.norm_act.BatchNormAct2d"
        owner, _, qualname = kind.rpartition(".")
        found = sys.modules.get(owner)
        for part in [qualname] if found is not None else []:
            found = getattr(found, part, None)
        kind = found if isinstance(found, type) else kind
    if isinstance(kind, type):
        return issubclass(kind, nn.modules.batchnorm._BatchNorm)
    return str(kind).rpartition(".")[2] in {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
                                            "LazyBatchNorm2d", "LazyBatchNorm3d"}


_BATCH_NORM_OPS = frozenset(op for op in (
    torch.nn.functional.batch_norm, torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
    getattr(torch.ops.aten, "_native_batch_norm_legit_functional", None) and torch.ops.aten._native_batch_norm_legit_functional.default,
    getattr(torch.ops.aten, "_native_batch_norm_legit", None) and torch.ops.aten._native_batch_norm_legit.default,
) if op)


@torch.no_grad()
def update_bn(loader: Iterable[Any], model: nn.Module, device: torch.device | str | None = None) -> None:
    """``torch.optim.swa_utils.update_bn`` for a model that holds batched modules: each member's running statistics
    become the average of its batch statistics over `loader` (as torch's, with momentum None); BatchNorm layers
    outside batched modules are handled as torch handles them. `loader` yields inputs, or tuples/lists whose first
    item is the input; `device`: where each input goes first. A model without batched modules is torch's call."""
    from stagewise.executor.build import BatchedModule

    batched = [m for m in model.modules() if isinstance(m, BatchedModule)]
    if not batched:
        return _ORIGINAL.get("update_bn", torch.optim.swa_utils.update_bn)(loader, model, device)
    norms = [entry for module in batched for entry in _batched_norms(module)]
    # (the batched modules' own nodes report the members' BatchNorm class, but hold stacked state: handled above)
    plain = {m: m.momentum for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and type(m).__name__ != "StateNode"}
    if not norms and not plain:
        return None
    # what a refusal half way puts back (the user's statistics are not lost to a failed update)
    kept = [t.clone() for _, _, mean, var, count in norms for t in (mean, var, count) if t is not None]
    kept += [t.clone() for layer in plain for t in layer.buffers()]
    for layer in plain:
        layer.reset_running_stats()
    sums = []
    for _, _, mean, var, count in norms:
        mean.zero_()
        var.fill_(1)
        if count is not None:
            count.zero_()
        sums.append((torch.zeros_like(mean), torch.zeros_like(var)))
    was_training = model.training
    model.train()
    # a layer a train() override keeps in eval (mmcv's norm_eval) reads its reset statistics and is left so, as torch
    # leaves it; the others with a momentum are zeroed before each batch and read after it; a layer with momentum None
    # keeps its own cumulative average, which is torch's update_bn's
    updating = [(momentum, mean, var, count, sum_) for (layer, momentum, mean, var, count), sum_ in zip(norms, sums)
                if (layer.training if isinstance(layer, nn.Module) else layer) and momentum is not None]
    for layer in plain:
        layer.momentum = None
    batches, done = 0, False
    try:
        for batch in loader:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            if device is not None:
                x = x.to(device)
            counted = []
            for _, mean, var, count, _ in updating:  # one update from zero: the statistic is what it holds over the momentum
                mean.zero_()
                var.zero_()
                counted.append(count.clone() if count is not None else None)
            model(x)
            batches += 1
            for (momentum, mean, var, count, (s_mean, s_var)), before in zip(updating, counted):
                if count is not None and bool((count - before > 1).any()):
                    raise ExecutionError("update_bn: a BatchNorm updated its statistics more than once in one call of the "
                                         f"model, which the batched update_bn cannot average; {_EACH_MEMBER}")
                s_mean.add_(mean, alpha=1.0 / momentum)
                s_var.add_(var, alpha=1.0 / momentum)
        done = True
    finally:
        if done:
            for _, mean, var, _, (s_mean, s_var) in updating:
                if batches:
                    torch.div(s_mean, batches, out=mean)
                    torch.div(s_var, batches, out=var)
                else:
                    mean.zero_()
                    var.fill_(1)
        else:
            live = [t for _, _, mean, var, count in norms for t in (mean, var, count) if t is not None]
            live += [t for layer in plain for t in layer.buffers()]
            for t, saved in zip(live, kept):
                t.copy_(saved)
        for layer, momentum in plain.items():
            layer.momentum = momentum
        model.train(was_training)
