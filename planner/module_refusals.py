"""What in a model's modules the batched module cannot repeat per member, and the messages refusing it.

Hooks on the model's modules (`module_hooks`; torch's state-driven weight_norm / spectral_norm hooks are
left out and compared as settings, `hook_configs`), torch.jit-scripted submodules, a forward replaced on an
instance, a class overriding __call__ and function attributes closing over a module or tensor
(`call_override_refusal`), gathered by `hooks_refusal`; global module hooks (`global_hooks_refusal`,
`global_hooks_present`), and global registration hooks held back while stagewise makes its own modules
(`registration_hooks_off`). Checked at trace (planner.graph), build and call (executor).
"""
from __future__ import annotations

import contextlib
import dis
import inspect
import types
from typing import Any

import torch
import torch.nn.utils.prune
import torch.nn.modules.module as torch_module
from torch import nn


# --- global module hooks ---------------------------------------------------------------------------------------

_GLOBAL_CALL_HOOKS = {  # torch.nn.modules.module's tables -> the function that fills them
    "_global_forward_pre_hooks": "register_module_forward_pre_hook",
    "_global_forward_hooks": "register_module_forward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
    "_global_backward_hooks": "register_module_full_backward_hook",
}
_GLOBAL_REGISTRATION_HOOKS = ("_global_buffer_registration_hooks", "_global_module_registration_hooks",
                              "_global_parameter_registration_hooks")


def _torch_owned(hook: Any) -> bool:
    """torch's own global hooks (FlopCounterMode's module tracker): they only watch."""
    f = getattr(hook, "func", hook)
    return str(getattr(f, "__module__", "")).startswith("torch.")


def global_hooks() -> dict[str, str]:
    """Hooks registered for every module's call ("register_module_forward_hook" -> the hook's name), torch's own left out."""
    found = {}
    for table, api in _GLOBAL_CALL_HOOKS.items():
        for hook in getattr(torch_module, table, {}).values():
            if not _torch_owned(hook):
                found.setdefault(api, getattr(hook, "__qualname__", type(hook).__name__))
    return found


def global_hooks_refusal(who: str) -> str | None:
    """The message refusing global module hooks for `who` (what would run without them), or None when there are none."""
    hooks = global_hooks()
    if not hooks:
        return None
    shown = ", ".join(f"torch.nn.modules.module.{api}: {name}" for api, name in hooks.items())
    return (f"global module hooks are registered ({shown}): the member loop fires them on every call of every module of "
            f"every member, but {who} never calls the members' modules (it would fire them on itself once with N-first "
            "values, and inside stages on vmap-internal values). Remove them (handle.remove()) while planning and running "
            "the batched module, or register a hook on the batched module itself for its N-first outputs")


def global_hooks_present() -> bool:
    """The per-call check: any global call hook at all (four dict truthiness tests); global_hooks() says whose."""
    m = torch_module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_pre_hooks
                or m._global_backward_hooks)


@contextlib.contextmanager
def registration_hooks_off():
    """Global buffer / module / parameter registration hooks held back inside. The members went through them when
    they were made; the modules stagewise makes from them (traced graphs, stacked state) must not go through them
    again (a hook that returns a changed tensor would change the stacked state; one that records would record ours)."""
    held = {}
    for table in _GLOBAL_REGISTRATION_HOOKS:
        hooks = getattr(torch_module, table, None)
        if hooks:
            held[table] = dict(hooks)
            hooks.clear()
    try:
        yield
    finally:
        for table, hooks in held.items():
            getattr(torch_module, table).update(hooks)


def closure_values(func: Any) -> list:
    """What `func`'s closure cells hold (empty cells, names assigned after the function was made, left out)."""
    out = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return out


def _closes_over_state(f: Any) -> str:
    """What a plain function closes over that a deepcopy of its module would not follow ("a module (Net)", "a tensor"), or ""."""
    if isinstance(f, (types.BuiltinMethodType, types.MethodWrapperType)) and isinstance(getattr(f, "__self__", None),
                                                                                        torch.Tensor):
        return "a tensor (a method bound to it: self.mode.equal, self.s.mul)"  # a deepcopy keeps it bound to the original's tensor
    for v in closure_values(f) if isinstance(f, types.FunctionType) else ():
        if isinstance(v, nn.Module):
            return f"a module ({type(v).__name__})"
        if isinstance(v, torch.Tensor):
            return "a tensor"
    return ""


# __call__ overrides known to compute what forward() computes: transformers' GradientCheckpointingLayer (the blocks of
# BERT, GPT-2, ViT, ... in transformers 5.17, seen on the GPU machine) calls forward, through torch.utils.checkpoint
# when gradient checkpointing is on: recomputation in backward, the same values. The traced graph runs forward.
VALUE_NEUTRAL_CALLS = {("transformers.modeling_layers", "GradientCheckpointingLayer.__call__")}


_PASS_THROUGH_OPS = {"COPY_FREE_VARS", "RESUME", "NOP", "CACHE", "PUSH_NULL", "PRECALL", "CALL", "CALL_FUNCTION_EX",
                     "RETURN_VALUE", "BUILD_MAP", "DICT_MERGE", "KW_NAMES", "LOAD_GLOBAL", "LOAD_METHOD", "LOAD_ATTR",
                     "LOAD_SUPER_ATTR", "LOAD_DEREF", "LOAD_FAST"}


def passes_through(call: Any) -> bool:
    """Whether a `__call__` override only hands its arguments on, as they came, to nn.Module's:
    `def __call__(self, x: Tensor) -> Tensor: return super().__call__(x)` (written for type checkers), with
    `*args, **kwargs` or keywords passed by their own names (`mask=mask`). Nothing else read, computed or called."""
    code = getattr(call, "__code__", None)
    if code is None:
        return False
    try:
        signature = list(inspect.signature(call).parameters.values())[1:]
        params = [p.name for p in signature]
        ops = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
    except (TypeError, ValueError):
        return False
    loaded, keywords, calls = [], (), 0
    for op in ops:
        if op.opname not in _PASS_THROUGH_OPS:
            return False
        if op.opname == "LOAD_GLOBAL" and op.argval != "super" \
                or op.opname in ("LOAD_METHOD", "LOAD_ATTR", "LOAD_SUPER_ATTR") and op.argval != "__call__" \
                or op.opname == "LOAD_DEREF" and op.argval != "__class__" or op.opname == "BUILD_MAP" and op.arg:
            return False
        if op.opname == "LOAD_FAST":
            loaded.append(op.argval)
        elif op.opname == "KW_NAMES":
            keywords = code.co_consts[op.arg]
        elif op.opname in ("CALL", "CALL_FUNCTION_EX"):
            calls += 1
    if calls != 2 or len(loaded) != len(params) or not all(isinstance(k, str) for k in keywords):
        return False  # super() and its __call__; each argument once
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature) != any(
            op.opname == "CALL_FUNCTION_EX" for op in ops):
        return False  # *args handed on unpacked (not as one tuple), and only then
    positional, named = loaded[:len(loaded) - len(keywords)], loaded[len(loaded) - len(keywords):]
    return positional == params[:len(positional)] and list(keywords) == named


def call_override_refusal(model: nn.Module, who: str) -> str | None:
    """The message refusing a forward replaced on a module instance, a user class overriding __call__, or a function
    attribute closing over a module or tensor (a deepcopy keeps reading the original's), or None.

    fx traces type(root).forward (an instance's forward is ignored) and neither tracer runs a root's __call__; a
    replaced forward that closes over a member's own modules would read member 0's weights for every member."""
    for path, mod in model.named_modules():
        where = f"{who}'s submodule {path} ({type(mod).__name__})" if path else \
            (who if who == type(mod).__name__ else f"{who} ({type(mod).__name__})")
        if type(mod).__module__.startswith("torch.export."):
            continue  # a loaded torch.export archive's own guard module (torch wraps its forward; the trace keeps the check)
        replaced = [k for k in ("forward", "__call__") if k in vars(mod)]
        if replaced:
            return (f"{where} has {replaced[0]} replaced on the instance (m.{replaced[0]} = ...; a wrapper such as "
                    "accelerate's or torch.compile's): torch.fx traces the class's forward() and ignores it, and a "
                    "replacement that closes over the member's own modules would run member 0's weights for every member. "
                    "Put the code in a subclass's forward() and build the members from it, or remove the replacement "
                    f"(del m.{replaced[0]}; for torch.compile pass the module before compiling)")
        for k, f in vars(mod).items():
            held = _closes_over_state(f)
            if held:
                return (f"{where}'s attribute {k!r} is a function that closes over {held}: stagewise traces and runs "
                        "copies of the members, and a copied module keeps the same function, which goes on reading the "
                        "original's weights (every member would read member 0's, and no gradient reaches the copy). "
                        "Make it a method (def f(self, x): ...) and keep `self.f = self.f_method` if needed, or an nn.Module")
        call = type(mod).__call__
        if call is not nn.Module.__call__ and not str(getattr(call, "__module__", "")).startswith("torch.") \
                and (getattr(call, "__module__", None), getattr(call, "__qualname__", None)) not in VALUE_NEUTRAL_CALLS \
                and not passes_through(call):
            return (f"{where} overrides __call__ ({type(mod).__qualname__}.__call__): the traced graph "
                    "runs forward() only, so what __call__ adds around it would be dropped or run twice. "
                    "Move that code into forward()")
    return None


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _state_driven_hook_types() -> tuple[type, ...]:
    """torch's own hooks that compute from the module's state alone (the old weight_norm / spectral_norm):
    a leaf module's hooks run with the module in every strategy that calls it, so these give each member its own."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    return SpectralNorm, WeightNorm


def hook_computed_weights(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(module path, the module, attribute) for each weight torch's hook-based spectral_norm / weight_norm computes
    and sets as a plain attribute of its module before the module runs (`enc.weight` from `enc.weight_orig`)."""
    return [(path, m, hook.name) for path, m in model.named_modules() for hook in m._forward_pre_hooks.values()
            if isinstance(hook, _state_driven_hook_types())]


def module_hooks(model: nn.Module) -> dict[str, str]:
    """Hooks the batched module cannot repeat per member: "path (kind)" -> what the hook is.

    A hook on the root module never reaches a traced graph (fx traces forward(), not the call); a hook
    on a submodule runs member 0's function (its closure, its captures) for every member, or is traced into
    the graph with member 0's values. torch's own state-driven weight_norm / spectral_norm hooks are left
    out below the root (their config is compared like any other attribute, see hook_configs)."""
    state_driven = _state_driven_hook_types()
    found = {}
    for path, mod in model.named_modules():
        for table in _HOOK_TABLES:
            for hook in getattr(mod, table, {}).values():
                if path and isinstance(hook, state_driven):
                    continue
                if not path and str(getattr(hook, "__module__", "")).startswith("torch.export."):
                    continue  # a loaded torch.export archive's own input check and state sync (the trace keeps the check)
                kind = table.strip("_").replace("_hooks", " hook").replace("_", " ")
                found[f"{path or type(model).__name__} ({kind})"] = getattr(hook, "__qualname__", type(hook).__name__)
    return found


def hook_configs(model: nn.Module) -> tuple:
    """The state-driven hooks module_hooks leaves out, with their settings (members must agree on them)."""
    state_driven = _state_driven_hook_types()
    return tuple((path, table, type(h).__name__, tuple(sorted((k, repr(v)) for k, v in vars(h).items())))
                 for path, mod in model.named_modules() for table in _HOOK_TABLES
                 for h in getattr(mod, table, {}).values() if isinstance(h, state_driven))


def hooks_refusal(model: nn.Module, who: str) -> str | None:
    """The message refusing `model`'s hooks (module_hooks), torch.jit-scripted submodules, or a forward / __call__
    the trace cannot see (call_override_refusal), or None when it has none of them."""
    compiled = [path for path, mod in model.named_modules() if path and type(mod).__name__ == "OptimizedModule"
                and isinstance(getattr(mod, "_orig_mod", None), nn.Module)]
    if compiled:
        return (f"{who} holds torch.compile'd submodule(s) {', '.join(repr(p) for p in compiled[:3])}: stagewise traces "
                "and batches the plain modules. Build the members with the modules before compiling (set "
                f"m.{compiled[0]} = m.{compiled[0]}._orig_mod); to compile, set strategy='compile' on the stages (executor.autotune tries it)")
    scripted = [path for path, mod in model.named_modules() if path and isinstance(mod, torch.jit.ScriptModule)]
    if scripted:
        return (f"{who} holds torch.jit-scripted or -traced submodule(s) {', '.join(repr(p) for p in scripted[:3])}: such "
                "a module runs its own compiled copy of the weights, so each member's weights cannot be put in for it "
                "(every member would run member 0's); build the members from the plain nn.Modules, without "
                "torch.jit.script / torch.jit.trace")
    overridden = call_override_refusal(model, who)
    if overridden:
        return overridden
    hooks = module_hooks(model)
    if not hooks:
        return None
    pruned = [path for path, mod in model.named_modules() for hook in getattr(mod, "_forward_pre_hooks", {}).values()
              if isinstance(hook, torch.nn.utils.prune.BasePruningMethod)]
    if pruned:
        return (f"{who} is pruned with torch.nn.utils.prune at {', '.join(repr(p or type(model).__name__) for p in pruned[:3])}: "
                "its hook recomputes `weight = weight_orig * weight_mask` before every call, which a traced graph would "
                "run with member 0's mask for every member. Make the pruning permanent before planning "
                "(torch.nn.utils.prune.remove(module, 'weight') on each member): the masked weights become plain parameters")
    lazy = [path or type(model).__name__ for path, mod in model.named_modules()
            if isinstance(mod, torch.nn.modules.lazy.LazyModuleMixin) and mod.has_uninitialized_params()]
    if lazy:
        return (f"{who} has lazy modules not yet initialised ({', '.join(repr(p) for p in lazy[:3])}): their shapes are "
                "set by the first call. Call each member once on an example input before planning (member(*example)), "
                "which makes them ordinary layers")
    shown = ", ".join(f"{k}: {v}" for k, v in list(hooks.items())[:3])
    return (f"{who} has module hooks ({shown}{', ...' if len(hooks) > 3 else ''}) that a traced graph cannot run per member: "
            "a hook on the model itself is never traced, and one on a submodule would run member 0's hook for every member. "
            "Remove the hooks before planning (handle.remove()) and put what they do into forward(), or run the hooks' "
            "work on the batched module's outputs")
