"""Model sources: a `.py` model file or a `torch.export` archive, plus member weights.

A model file defines `build_model() -> nn.Module` and `example_inputs() -> tuple`,
and optionally `build_members(n) -> list[nn.Module]`. Without it, members are
`n` copies from `build_model()`, the RNG re-seeded per member so their weights differ.
"""
from __future__ import annotations

import ast
import collections
import contextlib
import os
import hashlib
import importlib.machinery
import importlib.util
import io
import itertools
import copy
import json
import logging
import math
import operator
import pickle
import re
import warnings
import sys
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from stagewise.planner import budget
from stagewise.planner.errors import MemberError, ModelLoadError, UntrustedArchiveError
from stagewise.planner.errors import first_line as _first_line
from stagewise.planner.snapshot import deepcopy_module, state_refusal

MEMBER_SEED_BASE = 1234  # member i is built after torch.manual_seed(MEMBER_SEED_BASE + i)


@dataclass
class ModelSource:
    """A loaded model: the module to trace, example inputs, and a way to make members."""

    name: str  # file stem, e.g. "mlp"
    path: Path | None
    model: nn.Module
    example_inputs: tuple
    _build_members: Callable[[int], list[nn.Module]] = field(repr=False, default=None)

    def members(self, n: int, *, check_memory: bool = True) -> list[nn.Module]:
        """`n` members of this architecture (eval mode, own weights).

        Raises MemoryBudgetError, before building any, when n x one member's state
        (measured on `self.model`, the same architecture) would not fit in the
        available CPU memory; `check_memory=False` or STAGEWISE_SKIP_MEMORY_CHECK=1 skips that.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MemberError(f"the number of members must be an integer >= 1, got {n!r}; ask for 1 or more members")
        refusal = state_refusal(self.model)
        if refusal:
            raise MemberError(f"{self.name}: {refusal}")
        budget.check_fits(n, budget.state_bytes(self.model), "cpu", f"building {n} members of {self.name}",
                          "or run the members in smaller groups (plan.with_n_members)", check_memory)
        members = self._build_members(n)
        if len(members) != n:
            raise MemberError(f"{self.name}: build_members({n}) returned {len(members)} modules; it must return exactly {n}")
        _refuse_one_object(self.name, members)
        return members


def _refuse_one_object(name: str, members: list[nn.Module], error: type = MemberError) -> None:
    """MemberError where two members are one module object (build_model() returning a module-level `model = ...`,
    build_members returning `[m] * n`): trained, the loop would train the one model N times, and weight files would be
    loaded into it in turn."""
    again = next(((i, j) for j in range(len(members)) for i in range(j) if members[i] is members[j]), None)
    if again is not None:
        i, j = again
        raise error(f"{name}: members {i} and {j} are one module object: build_model() or build_members() "
                          f"returned the same module object for members {i} and {j} (a module-level `model = ...`, "
                          "`[m] * n`); members must be models of their own: make a new model in each call")


def load_source(path: str | Path, weights: Sequence[str | Path] | None = None, *, trust_archive: bool = False) -> ModelSource:
    """Load a `.py` model file or a `.pt2` export archive, by suffix.

    `trust_archive` only matters for `.pt2` archives (see load_export).
    """
    p = Path(path)
    if p.suffix == ".pt2":
        return load_export(p, weights, trust_archive=trust_archive)
    if p.suffix == ".py":
        return load_model_file(p, weights)
    raise ModelLoadError(f"{p.name}: unknown model format {p.suffix!r}; pass a .py model file or a .pt2 torch.export archive")


_LOADS = itertools.count()


def _import_file(p: Path):
    # Every load gets its own module name: a module loaded earlier stays importable by its name, so what was built
    # from it (stage graphs calling its torch.fx.wrap'd functions) still pickles after the file is loaded again.
    # The name is stable across processes (a digest of the path and the source, not Python's salted hash()), so a
    # batched module pickled by `torch.save` loads in a new process once that process has loaded the file too; a
    # file loaded again in one process gets a numbered name of its own
    source = p.read_bytes() if p.is_file() else b""
    digest = hashlib.sha256(str(p.resolve()).encode() + b"\0" + source).hexdigest()[:16]
    base = re.sub(r"\W", "_", f"_stagewise_model_{p.stem}_{digest}")
    module_name = base if base not in sys.modules else f"{base}_{next(_LOADS)}"
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{p}: cannot be imported as a Python module; check the file name ends in .py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        with _importable_beside(p) as package:
            if package:  # a file in a package: its relative imports (`from .layers import Block`) resolve there
                module.__package__ = package
            _forget_stale_helpers()
            present = set(sys.modules)
            try:
                spec.loader.exec_module(module)
            finally:
                _remember_helpers(set(sys.modules) - present - {module_name})
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        raise ModelLoadError(f"{p.name} has a syntax error at line {e.lineno}: {e.msg}; fix the file and load it again") from None
    except SystemExit as e:  # sys.exit() in a model file must not end the CLI or the app without a word
        sys.modules.pop(module_name, None)
        parser = any(f.name == "parse_args" or f.filename.endswith("argparse.py")
                     for f in traceback.extract_tb(e.__traceback__))
        raise ModelLoadError(f"{p.name} called sys.exit({e.code!r}) while being imported"
                             + (" (argparse's parse_args() read stagewise's own command line: parse the arguments "
                                "under `if __name__ == '__main__':` and give build_model() defaults, or call "
                                "parse_args([]) where no argument is required)" if parser
                                else "; remove the exit (guard script code with `if __name__ == '__main__':`)")) from None
    except Exception as e:  # any failure of user code at import time
        sys.modules.pop(module_name, None)
        last = traceback.extract_tb(e.__traceback__)[-1]
        hint = (" (a relative import needs the file's folder to be a package: add an __init__.py beside it)"
                if isinstance(e, ImportError) and "no known parent package" in str(e) else "")
        raise ModelLoadError(
            f"{p.name} failed to import: {type(e).__name__}: {e} (line {last.lineno}){hint}; fix the file and load it again"
        ) from None
    return module


# modules a model file imported from beside it (`from layers import Block`): name -> (file, its mtime then). Python
# keeps them by name, so another model's `layers.py`, or this one edited, would not be imported again
_HELPERS: dict[str, tuple[str, float]] = {}


def _remember_helpers(names: set[str]) -> None:
    """Note the modules a model file's import brought in from outside the installed packages."""
    installed = tuple(str(Path(d).resolve()) for d in {sys.prefix, sys.base_prefix, *sys.path} if "-packages" in d)
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and not name.startswith(("stagewise", "_stagewise_model_")) and not str(Path(file).resolve()).startswith(installed):
            try:
                _HELPERS[name] = (file, os.path.getmtime(file))
            except OSError:
                pass


def _forget_stale_helpers() -> None:
    """Drop from sys.modules the helpers an earlier model file imported that this import would find elsewhere (another
    project's `layers.py`, with sys.path as it is now) or that changed on disk since, so that they are imported
    afresh: a model built earlier keeps the classes it has."""
    for name, (file, mtime) in list(_HELPERS.items()):
        if name not in sys.modules:
            _HELPERS.pop(name)
            continue
        try:
            stale = not os.path.exists(file) or os.path.getmtime(file) != mtime
            if not stale and "." not in name:
                spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
                stale = spec is not None and spec.origin is not None and \
                    os.path.realpath(spec.origin) != os.path.realpath(file)
        except (OSError, ImportError, ValueError):
            stale = False
        if stale:
            top = name.split(".")[0]
            for other in [n for n in _HELPERS if n == top or n.startswith(top + ".")]:
                sys.modules.pop(other, None)
                _HELPERS.pop(other, None)


@contextlib.contextmanager
def _importable_beside(p: Path):
    """What `python path/model.py` (or `python -m` from the working folder) can import, importable while the file
    runs: its own folder (`from layers import Block`), the working folder (`from mypkg.layers import ...`, minGPT's
    layout) and, for a file in a package (folders with __init__.py), the folder above the package, whose dotted name
    it yields (None for a plain folder)."""
    folder = p.resolve().parent
    parts, root = [], folder
    while (root / "__init__.py").is_file() and root.parent != root:
        parts.insert(0, root.name)
        root = root.parent
    wanted = [str(folder), os.getcwd()] + ([str(root)] if parts else [])
    added = [d for d in dict.fromkeys(wanted) if d not in sys.path]
    sys.path[:0] = added
    try:
        yield ".".join(parts) or None
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def _call_user(p: Path, fn_name: str, fn: Callable, *args):
    try:
        with _importable_beside(p):  # (a function importing lazily, inside build_model())
            present = set(sys.modules)
            try:
                return fn(*args)
            finally:
                _remember_helpers(set(sys.modules) - present)
    except SystemExit as e:  # a model function calling sys.exit() must not end the CLI silently
        raise ModelLoadError(f"{p.name}: {fn_name}() called sys.exit({e.code!r}); return a value from {fn_name}() instead") from None
    except Exception as e:  # user code: report which function failed
        raise ModelLoadError(f"{p.name}: {fn_name}() raised {type(e).__name__}: {e}; fix {fn_name}() in the model file") from None


def load_model_file(path: str | Path, weights: Sequence[str | Path] | None = None) -> ModelSource:
    """Import a model file and check its contract.

    Args:
        path: a `.py` file defining build_model() and example_inputs().
        weights: optional, one weight file per member (.safetensors or a torch.save'd
            state_dict); when given, members(n) needs n == len(weights).
    Raises:
        ModelLoadError naming the file and what is missing or broken.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file {p} does not exist; check the path")
    module = _import_file(p)
    for required in ("build_model", "example_inputs"):
        if not callable(getattr(module, required, None)):
            raise ModelLoadError(f"{p.name} defines no {required}(); a model file needs build_model() and example_inputs()")
    model = _call_user(p, "build_model", module.build_model)
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{p.name}: build_model() returned {type(model).__name__}, not an nn.Module; return the model instance")
    inputs = _call_user(p, "example_inputs", module.example_inputs)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise ModelLoadError(f"{p.name}: example_inputs() must return a tuple of inputs, got {type(inputs).__name__}")
    inputs = tuple(inputs)

    weights = _weights_list(p.name, weights)
    if callable(getattr(module, "build_members", None)):
        def build(n: int) -> list[nn.Module]:
            members = _call_user(p, "build_members", module.build_members, n)
            if not isinstance(members, (list, tuple)) or not all(isinstance(m, nn.Module) for m in members):
                raise ModelLoadError(f"{p.name}: build_members({n}) must return a list of nn.Module; fix build_members() in the model file")
            return list(members)
        if weights is not None:  # build_members(n) sets what each member holds besides its state (a sweep's settings)
            build = _members_from_weights(p.name, build, weights)
    else:
        def build(n: int) -> list[nn.Module]:
            # member i from seed MEMBER_SEED_BASE + i, with weight files too: what the files cannot hold (a
            # non-persistent buffer drawn at random, random Fourier features) is then what it was when they were saved
            state = torch.random.get_rng_state()
            try:
                out = []
                for i in range(n):
                    torch.manual_seed(MEMBER_SEED_BASE + i)
                    out.append(_call_user(p, "build_model", module.build_model))
                _refuse_one_object(p.name, out, ModelLoadError)  # (a model file's build_model(): its error)
                return out
            finally:
                torch.random.set_rng_state(state)
        if weights is not None:
            build = _members_from_weights(p.name, build, weights)
    return ModelSource(name=p.stem, path=p, model=model, example_inputs=inputs, _build_members=build)


def load_export(path: str | Path, weights: Sequence[str | Path] | None = None, *, trust_archive: bool = False) -> ModelSource:
    """Load a `.pt2` archive written by `torch.export.save`.

    Members are copies of the exported module, each loaded with one weight file
    when `weights` is given (otherwise all members share the archive's weights,
    which is only useful for checking a plan).

    Args:
        path: the `.pt2` file.
        weights: optional, one weight file per member (see load_model_file).
        trust_archive: allow parts that torch.export.load would unpickle or run (pickled
            weights or constants, custom objects, example inputs beyond tensors, compiled
            code, graph strings that are not operators or shape arithmetic). That runs code
            from the file, so only pass True for files you trust.
    Raises:
        UntrustedArchiveError when the archive needs unpickling and trust_archive is False;
        ModelLoadError when it is not a readable torch.export archive.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"export archive {p} does not exist; check the path")
    try:
        data = p.read_bytes()  # read once: the bytes checked are the bytes loaded
    except OSError as e:
        raise ModelLoadError(f"cannot read export archive {p}: {e.strerror}; check the path and its permissions") from None
    if not trust_archive:
        found = unsafe_archive_part(data)
        if found is not None:
            part, why = found
            raise UntrustedArchiveError(
                f"{p.name}: part {part!r} {why}; refusing to load the archive. "
                "If you trust this file, pass --trust-archive (CLI) or tick 'trust this archive' in the app "
                "(only for files you trust: loading it runs code)"
            )
    try:
        with _torch_logs_held_back():
            ep = torch.export.load(io.BytesIO(data))
    except Exception as e:  # torch raises many types for a bad archive
        raise ModelLoadError(f"{p.name} is not a torch.export archive ({type(e).__name__}: {_first_line(e)}); "
                             "write it with torch.export.save") from None
    example = getattr(ep, "example_inputs", None)
    if not example:
        raise ModelLoadError(f"{p.name} stores no example inputs; export with torch.export.export(model, args) on torch >= 2.4")
    args, kwargs = example
    if kwargs:
        raise ModelLoadError(f"{p.name}: keyword example inputs {sorted(kwargs)} are not supported; export with positional args")
    try:
        model = ep.module()
    except Exception as e:  # a damaged or hand-edited archive fails here, in torch's unflattening
        raise ModelLoadError(f"{p.name}: torch could not rebuild the module from the archive ({type(e).__name__}: {_first_line(e)}); "
                             "write it again with torch.export.save") from None
    weights = _weights_list(p.name, weights)
    build = lambda n: [deepcopy_module(model) for _ in range(n)]  # noqa: E731
    if weights is not None:
        # the archive's record of the exported model's state: every name, the ones its module dropped too (a tie's
        # other name, a counter the graph does not read), each -> the first name of its tensor
        names: dict[str, str] = {}
        kept: list[tuple[str, torch.Tensor]] = []
        for k, t in ep.state_dict.items():
            if not isinstance(t, torch.Tensor):
                continue
            # one tensor, or (a tie saved apart) equal values: the archive holds the exported model's own weights,
            # where two names with one random tensor's values are one tensor
            twin = next((name for name, u in kept if u is t or (u.shape == t.shape and u.dtype == t.dtype and t.numel() > 1
                                                                and torch.equal(u, t) and not _constant(t))), None)
            names[k] = twin if twin is not None else k
            if twin is None:
                kept.append((k, t))
        build = _members_from_weights(p.name, build, weights, archive=names)
    return ModelSource(name=p.stem, path=p, model=model, example_inputs=tuple(args), _build_members=build)


@contextlib.contextmanager
def _torch_logs_held_back():
    """Hold back torch's log records while it loads an archive.

    Loading a trusted archive whose example inputs need full unpickling, torch 2.13 logs the
    weights_only failure with a message that breaks %-formatting: a plain logging setup prints a
    "Logging error" traceback, and a handler that raises on it (pytest's capture) fails the load.
    Whether the load worked is said by what it returns or raises, not by these records.
    """
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


# -- what torch.export.load (torch 2.13) would unpickle ---------------------------------------
# Current archives ("pt2" format, records under one top folder, read by torch's PyTorchFileReader):
#   data/weights/<model>_weights_config.json, data/constants/<model>_constants_config.json: JSON
#     payload configs; an entry with use_pickle is read with torch.load(weights_only=False), and
#     constants named custom_obj_* / opaque_obj_* with the TorchScript unpickler / pickle.loads.
#   data/weights/<model>.pt, data/constants/<model>.pt: legacy state files, read like sample inputs.
#   data/sample_inputs/<model>.pt: torch.load(weights_only=True), on failure weights_only=False.
#   data/aotinductor/...: a compiled shared library that load_pt2 dlopens.
# Archives of torch <= 2.7 (a top-level "version" file, read with zipfile when the above fails):
#   serialized_{state_dict,constants,example_inputs}.{pt,json}: the same weights_only fallback.
# Raw tensor records are read as bytes; models/<model>.json is JSON, but see _code_in_program.
_NEEDS_PICKLE = "holds objects beyond plain tensors, which only a full unpickle (able to run code) can read"
_LEGACY_PARTS = ("serialized_state_dict.pt", "serialized_state_dict.json", "serialized_constants.pt",
                 "serialized_constants.json", "serialized_example_inputs.pt")


def unsafe_archive_part(data: bytes) -> tuple[str, str] | None:
    """The first part of a `.pt2` archive that torch.export.load would unpickle, as (part, why); None if none.

    Reads the zip and its JSON configs; pickled parts are only tried with torch's weights_only
    loader (tensors and plain containers, no code), which is what torch.export.load tries first.
    An archive torch cannot read at all is left to torch.export.load to refuse.
    """
    try:
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None  # not a zip: torch.export.load fails on it without unpickling anything
    lowered = [n.lower() for n in names]
    if len(set(lowered)) != len(lowered):  # torch's zip reader matches names case-insensitively
        dup = next(n for n in names if lowered.count(n.lower()) > 1)
        return dup, "appears twice in the zip, so what is checked might not be what torch loads"
    if "version" in names:  # torch <= 2.7 layout, read with zipfile
        zf = zipfile.ZipFile(io.BytesIO(data))
        for part in _LEGACY_PARTS:
            if part in names and not _loads_weights_only(zf.read(part)):
                return part, _NEEDS_PICKLE
    from torch.export.pt2_archive import PT2ArchiveReader
    from torch.export.pt2_archive import constants as C

    try:
        reader = PT2ArchiveReader(io.BytesIO(data))
        # torch's reader finds "data/weights/x" under any letter case, so every lookup here ignores case too
        records = {r.lower(): r for r in reader.get_file_names()}
    except (RuntimeError, AssertionError, ValueError):
        return None  # not a current archive: torch.export.load reads it no further than we did
    for lowered_record, record in records.items():
        if lowered_record.startswith(C.AOTINDUCTOR_DIR.lower()):
            return record, "is AOTInductor compiled code, which runs when loaded"
    prefix, suffix = C.MODELS_FILENAME_FORMAT.split("{}")
    models = [r[len(prefix):-len(suffix)] for r in records.values() if r.startswith(prefix) and r.endswith(suffix)]
    for model in models:
        found = _code_in_program(reader.read_bytes(C.MODELS_FILENAME_FORMAT.format(model)), C.MODELS_FILENAME_FORMAT.format(model))
        if found is not None:
            return found
        for name in (C.SAMPLE_INPUTS_FILENAME_FORMAT.format(model), f"{C.WEIGHTS_DIR}{model}.pt", f"{C.CONSTANTS_DIR}{model}.pt"):
            part = records.get(name.lower())
            if part is not None and not _loads_weights_only(reader.read_bytes(part)):
                return part, _NEEDS_PICKLE
        for config_name, base, kind in ((C.WEIGHTS_CONFIG_FILENAME_FORMAT, C.WEIGHTS_DIR, "weight"),
                                        (C.CONSTANTS_CONFIG_FILENAME_FORMAT, C.CONSTANTS_DIR, "constant")):
            config_file = records.get(config_name.format(model).lower())
            if config_file is not None:
                found = _pickled_payload(reader.read_bytes(config_file), config_file, base, kind, C.TENSOR_CONSTANT_FILENAME_PREFIX)
                if found is not None:
                    return found
    return None


# The program JSON is not pickled, but torch turns three kinds of its strings into code: node targets
# (any callable reachable from `torch`, `operator` or `math`, e.g. torch.os.system, becomes a graph call),
# symbolic expressions (sympy.sympify, which evals) and guards_code (exec'd into the module's input check).
_SHAPE_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_EXPR_FUNCTIONS = frozenset({  # sympy's srepr constructors, and the functions torch gives sympify and its guards
    "Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "Eq", "Ne", "Ge", "Gt", "Le", "Lt", "And", "Or", "Not", "floor", "ceiling", "sqrt",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift",
    "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "OpaqueUnaryFn_sqrt",
    "cast_symbool_to_symint_guardless", "isnan",
})


def _code_in_program(raw: bytes, part: str) -> tuple[str, str] | None:
    """The first string of an exported program's JSON that would run as code other than shape arithmetic."""
    try:
        program = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # torch cannot parse it either
    stack = [program]
    while stack:  # iterative: the JSON may nest deeper than Python recursion allows
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        for key, value in item.items():
            if key == "guards_code" and isinstance(value, list):
                checks = [("guard", g) for g in value]
            elif key == "expr_str":
                checks = [("symbolic expression", value)]
            elif key == "as_operator" or (key == "target" and "inputs" in item):
                checks = [("call target", value)] if not _is_torch_operator(value) else []
            else:
                checks = []
                stack.append(value)
            for what, text in checks:
                if what == "call target" or not _is_shape_expression(text):
                    return part, f"has a {what} {str(text)[:80]!r} that torch would run as code"
    return None


def _is_torch_operator(target: Any) -> bool:
    """Whether a serialized node target resolves, as torch.export.load resolves it, to an operator (not any callable)."""
    if not isinstance(target, str):
        return False
    from torch._export.serde.serialize import _SYM_OPS

    head, _, rest = target.partition(".")
    roots = {"torch": torch, "_operator": operator, "math": math}
    if head not in roots:
        return False  # torch keeps other strings as unresolved names (and then refuses the node)
    obj: Any = roots[head]
    for name in rest.split(".") if rest else []:
        if name.startswith("__") or not hasattr(obj, name):
            return not name.startswith("__")  # unresolved: torch refuses the node itself
        obj = getattr(obj, name)
    return isinstance(obj, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) or obj in _SYM_OPS or obj is operator.getitem


def _is_shape_expression(text: Any) -> bool:
    """Whether `text` parses as arithmetic/comparisons over sizes: names, numbers, shape methods, sympy functions."""
    if not isinstance(text, str):
        return False
    try:
        tree = ast.parse(text.replace("\n", " "), mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            ok = (isinstance(f, ast.Name) and f.id in _EXPR_FUNCTIONS) or (
                isinstance(f, ast.Attribute) and (f.attr in _SHAPE_METHODS or (isinstance(f.value, ast.Name) and f.value.id == "math")))
            if not ok or not all(isinstance(k.value, ast.Constant) for k in node.keywords):  # Symbol('s0', integer=True)
                return False
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_") or not (node.attr in _SHAPE_METHODS or (isinstance(node.value, ast.Name) and node.value.id == "math")):
                return False
        elif isinstance(node, ast.Name):
            if node.id.startswith("_") or node.id in {"eval", "exec", "open", "compile", "getattr", "globals", "locals", "vars"}:
                return False
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Constant, ast.Subscript,
                                   ast.Load, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.Tuple, ast.keyword)):
            return False
    return True


def _pickled_payload(raw: bytes, config_file: str, base: str, kind: str, tensor_prefix: str) -> tuple[str, str] | None:
    """The first entry of a payload config that is stored as a pickle (anything not plainly raw bytes)."""
    try:
        entries = json.loads(raw)["config"]
        items = list(entries.items())
    except (ValueError, KeyError, TypeError, AttributeError):
        return config_file, "cannot be read as a payload config, so its parts cannot be checked"
    for fqn, meta in items:
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            return config_file, f"has a malformed entry for {fqn!r}, so it cannot be checked"
        part = base + meta["path_name"]
        if meta.get("use_pickle") is not False:  # torch only tests truthiness; accept exactly false
            return part, f"({kind} {fqn!r}) is stored as a pickle, which can run code when loaded"
        if kind == "constant" and not meta["path_name"].startswith(tensor_prefix):
            return part, f"(constant {fqn!r}) is a pickled object, which can run code when loaded"
    return None


def _loads_weights_only(raw: bytes) -> bool:
    """Whether torch.load(weights_only=True) reads these bytes (then torch never falls back to full pickle)."""
    if len(raw) == 0:
        return True  # torch skips empty artifacts
    try:
        torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:  # any failure makes torch.export.load retry with weights_only=False
        return False
    return True


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read one member's weights: `.safetensors`, or a state_dict saved with torch.save (weights_only=True)."""
    p = Path(path)
    if p.is_dir():
        inside = sorted(q.name for q in p.iterdir() if q.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        raise ModelLoadError(f"weight file {p} is a folder (a save_pretrained folder?); pass the weight file in it"
                             + (f" ({', '.join(inside[:3])})" if inside else ""))
    if not p.is_file():
        raise ModelLoadError(f"weight file {p} does not exist; check the path")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused a non-tensor object; its message is many lines
        raise ModelLoadError(
            f"weight file {p.name} holds objects other than tensors, which stagewise does not unpickle (that can run code); "
            "save only the tensors: torch.save(model.state_dict(), path) or safetensors"
        ) from None
    except Exception as e:  # corrupt files raise many types
        raise ModelLoadError(f"weight file {p.name} could not be read ({type(e).__name__}: {_first_line(e)}); "
                             "pass a .safetensors file or a torch.save'd state_dict") from None
    # (a module's get_extra_state() value sits beside the tensors under a key ending in `_extra_state`)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) or str(k).endswith("_extra_state")
                                              for k, v in state.items()):
        nested = [k for k, v in state.items() if isinstance(v, dict) and v
                  and all(isinstance(t, torch.Tensor) for t in v.values())] if isinstance(state, dict) else []
        if nested:  # a training checkpoint: {'model': state_dict, 'optimizer': ..., 'iter_num': ...}
            raise ModelLoadError(
                f"weight file {p.name} is a checkpoint whose {nested[0]!r} entry holds a state_dict"
                f"{' (also ' + ', '.join(repr(k) for k in nested[1:3]) + ')' if len(nested) > 1 else ''}; save that "
                f"entry alone: torch.save(torch.load(path)[{nested[0]!r}], new_path)")
        raise ModelLoadError(f"weight file {p.name} does not hold a state_dict (a dict of tensors); save model.state_dict()")
    return state


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel's and torch.compile's


def _without_wrapper_prefix(state: dict, own: Sequence[str]) -> dict:
    """A state_dict saved from a wrapper (DDP's `module.`, torch.compile's `_orig_mod.`) keyed as the model's own
    keys `own`, as torch's consume_prefix_in_state_dict_if_present makes it: where every key carries the prefix and
    none of the model's does (a model whose own submodule is named `module` keeps its keys)."""
    own = set(own)
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if not all(str(k).startswith(prefix) for k in state):
                continue
            stripped = {str(k)[len(prefix):] for k in state}
            # the model's own keys may carry it too (a submodule named `module`: an EMA wrapper's model): taken off
            # where that fits the model better, never where the keys fit as they are
            if any(str(k).startswith(prefix) for k in own) and (set(state) <= own or not stripped <= own):
                continue
            out = collections.OrderedDict(state)
            meta = getattr(state, "_metadata", None)
            if meta is not None:
                out._metadata = collections.OrderedDict(meta)  # renamed with the keys, as torch's own function does
            torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(out, prefix)
            state, changed = out, True
    return state


def _weights_list(name: str, weights: Any) -> list | None:
    """`weights` as a list of paths (a generator such as Path.glob is read once), or None. ModelLoadError for one path
    (a str would be read letter by letter) or no path at all (a pattern that matched nothing would give members
    with no file's weights, without a word)."""
    if weights is None:
        return None
    if isinstance(weights, (str, Path)):
        raise ModelLoadError(f"{name}: weights={str(weights)!r} is one path; pass a list of weight files, one per member "
                             f"(weights=[{str(weights)!r}] for one member)")
    given = weights
    weights = list(weights)
    if not weights:
        raise ModelLoadError(f"{name}: weights is an empty list, so no member would get a file's weights; pass one weight "
                             "file per member (check the pattern that listed them), or weights=None for members without files")
    indices = [_member_file_index(w) for w in weights]
    if not isinstance(given, (list, tuple)):
        if None not in indices:
            # stagewise member files from a generator (Path.glob, os.scandir) or a set, which list them in no order of
            # their own: member i is file member_i, as save_member_weights numbered them
            return [w for _, w in sorted(zip(indices, weights), key=lambda p: p[0])]
        if [natural_key(Path(w).name) for w in weights] != sorted(natural_key(Path(w).name) for w in weights):
            warnings.warn(f"{name}: the weight files came from a {type(given).__name__} in an order that is not their "
                          f"names' ({', '.join(Path(w).name for w in weights[:4])}{', ...' if len(weights) > 4 else ''}): "
                          "member i gets the i-th as listed (Path.glob lists in the folder's order). Pass a list in the "
                          "order you mean (sorted(paths, key=planner.natural_key) for the names' order)", stacklevel=3)
        return weights
    if None not in indices and indices != sorted(indices):
        warnings.warn(f"{name}: the weight files are stagewise member files given out of their order "
                      f"({', '.join(Path(w).name for w in weights[:4])}{', ...' if len(weights) > 4 else ''}): member i "
                      "gets the i-th file as listed. Pass sorted(paths, key=planner.natural_key) to keep the saved order",
                      stacklevel=3)
    return weights


def natural_key(name: str) -> list:
    """A sort key putting `member_2` before `member_10` (the digits compared as numbers)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(name))]


def _member_file_index(path: Any) -> int | None:
    """The index in a member file's name (`member_007.safetensors`: 7), or None for another name."""
    found = re.fullmatch(r"member_(\d+)\.\w+", Path(str(path)).name)
    return int(found.group(1)) if found else None


def _members_from_weights(name: str, build_n: Callable[[int], list[nn.Module]], weights: Sequence[str | Path],
                          archive: dict[str, str] | None = None):
    """members(n): the n members `build_n` makes (the model file's build_members, or build_model n times), member i
    loaded with weight file i. `archive`: for members of a torch.export archive, its state names (see
    load_member_state)."""
    states = [read_state_dict(w) for w in weights]

    def build(n: int) -> list[nn.Module]:
        if n != len(states):
            raise MemberError(f"{name}: {len(states)} weight files given but {n} members asked for; pass one weight file per member")
        members = build_n(n)
        _refuse_one_object(name, members)  # (before any file is loaded into it in turn, the last one kept)
        keyed = [_without_wrapper_prefix(st, list(m.state_dict())) for m, st in zip(members, states)]
        _refuse_shared_apart(name, members, keyed, weights)
        for m, w, state in zip(members, weights, keyed):
            load_member_state(m, state, Path(w).name, archive=archive)
        return members

    return build


def _refuse_shared_apart(name: str, members: list[nn.Module], states: list[dict], weights: Sequence) -> None:
    """MemberError where members hold one tensor (build_members shares a module: a frozen embedding) and their weight
    files hold different values for it: loading file after file into the one tensor would leave every member the
    last file's."""
    held: dict[tuple[str, int], int] = {}
    for i, m in enumerate(members):
        for k, t in m.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):  # a get_extra_state() value
                continue
            j = held.setdefault((k, t.data_ptr()), i)
            if j != i and k in states[i] and k in states[j] and t.numel() and not torch.equal(states[i][k], states[j][k]):
                raise MemberError(
                    f"{name}: members {j} and {i} hold one tensor as {k} (build_members shares it between them), but "
                    f"their weight files {Path(weights[j]).name} and {Path(weights[i]).name} hold different values for "
                    "it: one tensor cannot take both. Give each member its own copy in build_members, or save the same "
                    "values for it in every file")


def _tie_groups(module: nn.Module) -> dict[str, str]:
    """State name -> the first name of the tensor it is (tied weights: `lm_head.weight` is `embed.weight`)."""
    first: dict[object, str] = {}
    out = {}
    for k, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        # one object, or two on one memory (a torch.export archive loads a tie as two Parameters viewing one storage)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) \
            if t.numel() and t.device.type != "meta" and t.layout == torch.strided else id(t)
        out[k] = first.setdefault(key, k)
    return out


def _filled_in(module: nn.Module, key: str) -> bool:
    """A key a file may leave out: a BatchNorm's num_batches_tracked, a module's get_extra_state() value (a file of
    tensors alone, safetensors, cannot hold it: the module keeps its own)."""
    return _batch_count(module, key) or key.rpartition(".")[2] == "_extra_state"


def _batch_count(module: nn.Module, key: str) -> bool:
    """Whether `key` is a BatchNorm's num_batches_tracked, which its load fills in when a file lacks it."""
    owner, _, leaf = key.rpartition(".")
    try:
        return leaf == "num_batches_tracked" and isinstance(module.get_submodule(owner), nn.modules.batchnorm._BatchNorm)
    except AttributeError:
        return False


def _lossy(value: torch.Tensor, into: torch.dtype) -> str:
    """Why casting `value` to `into` (what load_state_dict does) would change its numbers beyond rounding; "" if not."""
    if value.dtype == into:
        return ""
    if not value.numel():
        return ""
    if value.is_complex() and not into.is_complex:
        if bool(value.imag.ne(0).any()):
            return "drops the imaginary part"
        value = value.real
    if into.is_floating_point or into.is_complex or into == torch.bool:
        return ""
    # float8 has no trunc, unsigned ints above uint8 no min/max: compared as float64 / int64 (uint64 as float64)
    exact = value.to(torch.float64) if value.is_floating_point() or value.dtype == torch.uint64 else value.to(torch.int64)
    if value.is_floating_point() and not bool((exact == exact.trunc()).all()):
        return "truncates to integers"
    info = torch.iinfo(into)
    if exact.min().item() < info.min or exact.max().item() > info.max:
        return f"wraps values outside [{info.min}, {info.max}]"
    return ""


def load_member_state(module: nn.Module, state: dict[str, torch.Tensor], what: str,
                      archive: dict[str, str] | None = None) -> None:
    """Load `state` into `module` (a member just built), raising MemberError that lists missing/unexpected/mis-shaped
    keys, and values the model's dtype cannot hold (a float file value into an integer buffer). A key left out is
    accepted where torch fills it in: a tied weight saved once (Hugging Face's save_pretrained), BatchNorm's
    num_batches_tracked. Keys are those torch's load_state_dict reads, through the model's own load code (a
    load_state_dict pre-hook, a `_load_from_state_dict` override: an old weight_norm's weight_g / weight_v, a frozen
    BatchNorm dropping its counter). `archive` (a torch.export archive's state names -> the first name of the tensor
    each is in the archive): its module keeps only the state its graph reads, so a file key the archive records
    beside (a tie's other name, an unread counter) is accepted, and a tie saved under the name it dropped is loaded."""
    own = module.state_dict()
    state = _without_wrapper_prefix(state, list(own))
    ties = _tie_groups(module)
    by_tie: dict[str, str] = {}
    for k in state:
        if k in ties and isinstance(state[k], torch.Tensor):
            first = by_tie.setdefault(ties[k], k)
            if first != k and not (state[first].shape == state[k].shape and torch.equal(state[first], state[k].to(state[first].dtype))):
                # one tensor in the model, two values in the file: loading would keep whichever comes last
                raise MemberError(
                    f"{what} holds different values for {first} and {k}, which this model ties (one tensor): loading "
                    "would keep one and drop the other without a word. Save the weights of a model that ties them, or "
                    "untie them in the model")
    if archive:  # a tie saved under the name the archive dropped (safetensors' save_model keeps one name)
        for k in [k for k in own if k not in state and k in archive]:
            twin = next((u for u in state if u not in own and archive.get(u) == archive[k]), None)
            if twin is not None:
                state = _with_metadata({**state, k: state[twin]}, state)
    saved_under = {ties.get(k, k) for k in state}
    if _loads_through_own_code(module):
        # torch's load runs the model's own code on the file's tensors (which may change them in place: each load
        # gets its own) and reads the keys as that code leaves them: loaded straight into the member, checked after
        try:
            result = module.load_state_dict(_own_tensors(state), strict=False)
        except RuntimeError as e:
            raise MemberError(f"{what} does not fit the architecture ({_first_line(e)}); save the weights of this "
                              "exact model") from None
        missing = sorted(k for k in result.missing_keys if not (ties.get(k, k) in saved_under or _filled_in(module, k)))
        unexpected = sorted(k for k in result.unexpected_keys if not (archive and k in archive))
        shapes, lossy = [], []  # (a shape torch cannot load raised above; the model's code may change shapes)
    else:
        missing = sorted(k for k in set(own) - set(state) if not (ties.get(k, k) in saved_under or _filled_in(module, k)))
        unexpected = sorted(k for k in set(state) - set(own) if not (archive and k in archive))
        tensors = [k for k in own if k in state and isinstance(state[k], torch.Tensor) and isinstance(own[k], torch.Tensor)]
        shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in tensors if state[k].shape != own[k].shape]
        lossy = [f"{k}: file {state[k].dtype} into model {own[k].dtype} {why}" for k in tensors
                 for why in [_lossy(state[k], own[k].dtype)] if why]
    if missing or unexpected or shapes or lossy:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:3]))
        if lossy:
            parts.append("values the model's dtype cannot hold: " + "; ".join(lossy[:3]))
        raise MemberError(f"{what} does not fit the architecture: {', '.join(parts)}; save the weights of this exact model")
    if not _loads_through_own_code(module):
        module.load_state_dict(state, strict=False)  # the keys were checked above, less those torch or the ties fill in


def _loads_through_own_code(module: nn.Module) -> bool:
    """Whether torch's load of `module` runs code of the model's own (a load_state_dict pre- or post-hook, a
    `_load_from_state_dict` override outside torch), which may read other keys than the module's state_dict holds."""
    for m in module.modules():
        if m._load_state_dict_pre_hooks:
            return True
        own = type(m)._load_from_state_dict
        if own is not nn.Module._load_from_state_dict and not getattr(own, "__module__", "").startswith("torch."):
            return True
    return False


def _own_tensors(state: dict) -> dict:
    """A copy of `state` whose tensors are copies (a load hook may change what it is given in place), metadata kept."""
    return _with_metadata({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, state)


def _constant(t: torch.Tensor) -> bool:
    """All of `t`'s values alike (an untrained norm's ones, a zero bias): equal such tensors are no sign of a tie."""
    flat = t.detach().reshape(-1)
    return bool((flat == flat[0]).all())


def _with_metadata(new: dict, old: dict) -> dict:
    """`new` as an OrderedDict carrying `old`'s `_metadata` (each module's state version, which torch's load reads:
    a file without it is read as the oldest format and migrated)."""
    out = collections.OrderedDict(new)
    meta = getattr(old, "_metadata", None)
    if meta is not None:
        out._metadata = meta
    return out
