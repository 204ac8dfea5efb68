"""Core types: Plan, Stage, StageOptions and their enums.

This module imports nothing of ours except the error family and planner.files. `Plan.to_json` and
`Plan.from_json` are the only code that knows the JSON layout; everything else
works on the frozen dataclasses. Edits (planner.edits) return new plans.
"""
from __future__ import annotations

import difflib
import enum
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from stagewise.planner.errors import EditError, MemberError, PlanFileError, PlanMismatchError
from stagewise.planner.files import write_atomic

SCHEMA_VERSION = 1

# Plan-level precision of the batched module (executor.build applies it). "tf32" keeps float32 weights and
# lets CUDA matmuls/convolutions use TF32 tensor cores; on CPU it computes exactly like float32.
DTYPES = ("float32", "tf32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"


def dtype_problem(dtype: Any) -> str:
    """Why `dtype` is not a plan precision, or "" when it is one of DTYPES."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return ""
    return f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}"


def _refuse_unknown_keys(d: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Raise PlanFileError for keys of a hand-edited plan object that nothing reads.

    A misspelled key ("stratgy", "chunksize", "dtyp") would otherwise be ignored and the
    default used: the module would silently differ from what the file asks for. Every key a
    stagewise plan file has ever held is known, so older files load as they did.
    """
    known = sorted(known)
    unknown = [k for k in d if k not in known]
    if not unknown:
        return
    parts = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise PlanFileError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; "
                        f"the keys here are {', '.join(known)}; fix the spelling in the plan file or remove the key")


def _tensor_dtype_problem(dtype: str) -> str:
    """Why `dtype` is not the name of a torch dtype ("float32", "int64", "bool"...), or "" when it is one."""
    import torch  # not at module level: plan files are read without touching torch otherwise

    if isinstance(getattr(torch, dtype, None), torch.dtype):
        return ""
    names = sorted({str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)})
    close = difflib.get_close_matches(dtype, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"dtype {dtype!r} is not a torch dtype; {hint}use a name such as float32, int64 or bool"


class StageMode(str, enum.Enum):
    """Whether a stage may run under vmap: the planner's (or the user's) decision.

    "excluded" means excluded from vmap, not "runs as a loop": an excluded stage runs
    with its strategy, the member loop by default, or `wide` / `compile` where
    autotune found those batch it correctly. `Stage.runs_batched` says how it runs.
    """

    BATCHED = "batched"  # may run under vmap (or any other strategy)
    EXCLUDED = "excluded"  # never under vmap/cuda_graph: loop, or wide/compile when autotune proved them


class Strategy(str, enum.Enum):
    """How a batched stage computes; chosen by hand or by the autotuner."""

    VMAP = "vmap"  # torch.func.vmap over stacked state (default)
    LOOP = "loop"  # the member loop (what an excluded stage does unless autotune found wide/compile)
    WIDE = "wide"  # hand-batched kernels (bmm linear, grouped conv, ...)
    COMPILE = "compile"  # torch.compile of the stage's vmapped callable
    CUDA_GRAPH = "cuda_graph"  # CUDA-graph capture of the stage (GPU only)


class InputMode(str, enum.Enum):
    """How one model input is given to the batched module."""

    SHARED = "shared"  # every member sees the same tensor, no member axis
    PER_MEMBER = "per_member"  # the tensor has a leading member axis [N, ...]


@dataclass(frozen=True)
class StageOptions:
    """Per-stage execution options; the defaults are the spine's plain vmap."""

    strategy: Strategy = Strategy.VMAP
    chunk_size: int | None = None  # vmap chunk_size: bounds memory, None = all members at once
    note: str = ""  # why this strategy was chosen (autotune writes measured times here)
    # a stage exclude(node) carved out: the other nodes of the stage it came from and that stage's options
    # (include merges it back into what is left of that stage alone, with those options); () otherwise
    carved_from: tuple[str, ...] = ()
    carved_options: "StageOptions | None" = None

    def __post_init__(self):
        # StageOptions(strategy="wide") as users write it: the enum, or a clear error (not a later AttributeError)
        if not isinstance(self.strategy, Strategy):
            try:
                object.__setattr__(self, "strategy", Strategy(self.strategy))
            except ValueError:
                known = ", ".join(s.value for s in Strategy)
                raise EditError(f"unknown strategy {self.strategy!r}; use one of {known} "
                                f"(a string or planner.Strategy)") from None
        chunk = self.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise EditError(f"chunk_size must be a positive integer or None, got {chunk!r}")

    def to_json(self) -> dict:
        out = {"strategy": self.strategy.value, "chunk_size": self.chunk_size, "note": self.note}
        if self.carved_from:
            out["carved_from"] = list(self.carved_from)
            out["carved_options"] = self.carved_options.to_json() if self.carved_options is not None else None
        return out

    @staticmethod
    def from_json(d: Mapping[str, Any], *, where: str = "stage options") -> "StageOptions":
        """Parse a stage's "options" object; `where` names it in errors ("stages[1] ('s1') options")."""
        if not isinstance(d, Mapping):
            raise PlanFileError(f"stage options must be a JSON object, got {d!r}; write {{\"strategy\": \"vmap\"}} or leave them out")
        _refuse_unknown_keys(d, StageOptions.__dataclass_fields__, where)
        try:
            strategy = Strategy(d.get("strategy", "vmap"))
        except ValueError:
            known = ", ".join(s.value for s in Strategy)
            raise PlanFileError(f"unknown strategy {d.get('strategy')!r}; use one of {known}") from None
        chunk = d.get("chunk_size")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):  # true is no size
            raise PlanFileError(f"chunk_size must be a positive integer or null, got {chunk!r}; fix it in the plan file")
        carved = d.get("carved_from") or ()
        if not isinstance(carved, (list, tuple)) or not all(isinstance(x, str) for x in carved):
            raise PlanFileError(f"carved_from must be a list of node names, got {carved!r}; fix it in the plan file or remove it")
        parent = d.get("carved_options")
        return StageOptions(strategy=strategy, chunk_size=chunk, note=str(d.get("note", "")), carved_from=tuple(carved),
                            carved_options=StageOptions.from_json(parent, where=f"{where} carved_options")
                            if isinstance(parent, Mapping) else None)


# What stagewise wrote for every excluded stage before excluded stages carried the loop strategy (plan
# files of 2026-11-21 and before, tests/golden then): read as the loop, as it always ran. Any other vmap
# or cuda_graph strategy on an excluded stage is refused, as set_options refuses it.
_OLD_EXCLUDED_OPTIONS = {"strategy": "vmap", "chunk_size": None, "note": ""}


@dataclass(frozen=True)
class Stage:
    """A convex set of graph nodes run as one unit."""

    id: str  # "s0", "s1", ... in topological order of the stage graph
    nodes: tuple[str, ...]  # fx node names, in graph (topological) order
    mode: StageMode = StageMode.BATCHED
    reason: str = ""  # why the stage is excluded ("" for batched stages)
    options: StageOptions = field(default_factory=StageOptions)

    def __post_init__(self) -> None:
        # an excluded stage cannot run under vmap: a vmap strategy carried over from before becomes the loop
        if self.mode is StageMode.EXCLUDED and self.options.strategy in (Strategy.VMAP, Strategy.CUDA_GRAPH):
            object.__setattr__(self, "options", replace(self.options, strategy=Strategy.LOOP, chunk_size=None))

    @property
    def runs_batched(self) -> bool:
        """Whether the stage runs as one batched call (any strategy but the member loop), whatever its mode."""
        return self.options.strategy is not Strategy.LOOP

    def runs_as(self) -> str:
        """How the stage runs, in words: "batched (vmap)", "batched (wide)", ... or "member loop"."""
        return f"batched ({self.options.strategy.value})" if self.runs_batched else "member loop"

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "nodes": list(self.nodes),
            "mode": self.mode.value,
            "reason": self.reason,
            "options": self.options.to_json(),
        }

    @staticmethod
    def from_json(d: Mapping[str, Any], *, where: str = "") -> "Stage":
        """Parse one stage object; `where` is its place in the file ("stages[1]"), named in errors."""
        if not isinstance(d, Mapping):
            raise PlanFileError(f"each stage must be a JSON object with id and nodes, got {d!r}")
        here = f"{where} ({d.get('id')!r})" if where else f"stage {d.get('id')!r}"
        _refuse_unknown_keys(d, ("id", "nodes", "mode", "reason", "options"), here)
        try:
            mode = StageMode(d.get("mode", "batched"))
        except ValueError:
            raise PlanFileError(f"stage {d.get('id')!r}: unknown mode {d.get('mode')!r}; use 'batched' or 'excluded'") from None
        nodes = d.get("nodes")
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes) or not nodes:
            raise PlanFileError(f"stage {d.get('id')!r}: 'nodes' must be a non-empty list of node names")
        raw = d.get("options") or {}
        options = StageOptions.from_json(raw, where=f"{here} options")
        reason = str(d.get("reason", ""))
        if (mode is StageMode.EXCLUDED and "strategy" in raw and options.strategy in (Strategy.VMAP, Strategy.CUDA_GRAPH)
                and dict(raw) != _OLD_EXCLUDED_OPTIONS):
            # Stage.__post_init__ would quietly make it the loop: the file asked for something else
            raise PlanFileError(
                f"{here}: the stage is excluded ({reason or 'no reason given'}), so it cannot run under "
                f"{options.strategy.value}; set its options' \"strategy\" to \"loop\", \"wide\" or \"compile\", "
                "or set its \"mode\" to \"batched\" (planner.include) to run it under vmap"
            )
        return Stage(id=str(d["id"]), nodes=tuple(nodes), mode=mode, reason=reason, options=options)


@dataclass(frozen=True)
class DynamicDim:
    """One dim of a traced input that the plan accepts at other sizes.

    Export plans: a dim torch.export left symbolic (Dim.AUTO); fx plans: every dim
    (an fx graph is shape-generic). Sizes 0 and 1 are accepted like torch.export's
    own input guards accept them.
    """

    dim: int  # index into one member's tensor (no member axis)
    min: int = 0  # smallest accepted size (0: no lower bound)
    max: int | None = None  # largest accepted size (None: no upper bound)
    symbol: str = ""  # dims with the same symbol ("d0", ...), in any input, must have equal sizes; "" = free
    # symbols of dims that must have this dim's size when it is below 2 (checked there only together with them:
    # input_ids' and attention_mask's batch, which export gave symbols of their own)
    small_with: tuple[str, ...] = ()

    def to_json(self) -> dict:
        d: dict[str, Any] = {"dim": self.dim}
        if self.min:
            d["min"] = self.min
        if self.max is not None:
            d["max"] = self.max
        if self.symbol:
            d["symbol"] = self.symbol
        if self.small_with:
            d["small_with"] = list(self.small_with)
        return d

    @staticmethod
    def from_json(d: Any, *, where: str) -> "DynamicDim":
        if isinstance(d, Mapping):
            _refuse_unknown_keys(d, DynamicDim.__dataclass_fields__, f"{where}: a dynamic_dims entry")
            dim, lo, hi, sym = d.get("dim"), d.get("min", 0), d.get("max"), d.get("symbol", "")
            small_with = d.get("small_with", [])
            if _is_size(dim) and _is_size(lo) and (hi is None or _is_size(hi)) and isinstance(sym, str) \
                    and isinstance(small_with, list) and all(isinstance(x, str) for x in small_with):
                return DynamicDim(dim, lo, hi, sym, tuple(small_with))
        raise PlanFileError(f"{where}: each dynamic_dims entry must be an object like {{\"dim\": 0}} "
                            f"(optional integer min/max, string symbol, list of symbols small_with), got {d!r}; fix it "
                            "or re-create the plan with `stagewise plan`")


def _is_size(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class InputSpec:
    """One model input (an fx placeholder), how members receive it, and what the trace assumed of it.

    shape/dtype/dynamic_dims describe one member's input as traced; they are
    None/None/() in plan files written before they were recorded.
    """

    name: str
    mode: InputMode = InputMode.SHARED
    shape: tuple[int, ...] | None = None  # one member's traced shape; None for a non-tensor input or when unknown
    dtype: str | None = None  # "float32", "int64"...; a Python type name ("int") for a non-tensor; None when unknown
    dynamic_dims: tuple[DynamicDim, ...] = ()  # dims accepted at other sizes; every other dim is fixed at `shape`
    # a Python number a torch.export trace took as a constant (its guard refuses other values): what `build`
    # retraces with when no example inputs are given; None otherwise
    value: bool | int | float | None = None

    def __post_init__(self) -> None:
        # an input traced as None (an optional input left out) has no member axis: shared whatever was asked
        # (propose, a plan file, an edit), so the module and every check read the same mode
        if self.dtype == "NoneType" and self.mode is not InputMode.SHARED:
            object.__setattr__(self, "mode", InputMode.SHARED)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"name": self.name, "mode": self.mode.value}
        if self.dtype is not None:
            d.update(shape=list(self.shape) if self.shape is not None else None, dtype=self.dtype,
                     dynamic_dims=[dd.to_json() for dd in self.dynamic_dims])
        if self.value is not None:
            d["value"] = self.value
        return d

    @staticmethod
    def from_json(d: Any) -> "InputSpec":
        """Parse one input object; errors name the input ("input 'x': ...")."""
        if not isinstance(d, Mapping):
            raise PlanFileError(f"each input must be a JSON object with a name, got {d!r}; re-create the plan with `stagewise plan`")
        name = str(d["name"])
        shape, dtype, dyn = d.get("shape"), d.get("dtype"), d.get("dynamic_dims", [])
        where = f"input {name!r}"  # input names are unique in a plan: the name places it in the file
        _refuse_unknown_keys(d, ("name", "mode", "shape", "dtype", "dynamic_dims", "value"), where)
        if shape is not None and (not isinstance(shape, list) or not all(_is_size(s) for s in shape)):
            raise PlanFileError(f"{where}: shape must be a list of non-negative integers or null, got {shape!r}; fix it or re-create the plan")
        if dtype is not None and not isinstance(dtype, str):
            raise PlanFileError(f"{where}: dtype must be a string such as \"float32\", got {dtype!r}; fix it or re-create the plan")
        if dtype is not None and shape is not None:  # a tensor input: the dtype its zeros are rebuilt with and calls checked against
            problem = _tensor_dtype_problem(dtype)
            if problem:
                raise PlanFileError(f"{where}: {problem}; fix it or re-create the plan")
        if not isinstance(dyn, list):
            raise PlanFileError(f"{where}: dynamic_dims must be a list, got {dyn!r}; fix it or re-create the plan")
        dims = tuple(DynamicDim.from_json(x, where=where) for x in dyn)
        rank = len(shape) if shape is not None else 0
        bad = [x.dim for x in dims if x.dim >= rank]
        if bad:
            raise PlanFileError(f"{where}: dynamic dim {bad[0]} is outside its traced shape {shape}; fix it or re-create the plan")
        value = d.get("value")
        if value is not None and (type(value).__name__ != dtype or not isinstance(value, (bool, int, float))):
            raise PlanFileError(f"{where}: value must be a number of its dtype {dtype!r}, got {value!r}; fix it or re-create the plan")
        return InputSpec(name, InputMode(d.get("mode", "shared")), tuple(shape) if shape is not None else None, dtype, dims,
                         value)

    def dynamic_dim(self, dim: int) -> DynamicDim | None:
        """The DynamicDim for `dim`, or None when the trace fixed that dim."""
        return next((x for x in self.dynamic_dims if x.dim == dim), None)


# every key a plan file has held (schema_version 1; dtype, opened_modules and capture were added later and are optional)
_PLAN_KEYS = ("schema_version", "model", "fingerprint", "tracer", "n_members", "inputs", "stages", "profile", "dtype",
              "opened_modules", "capture")


@dataclass(frozen=True)
class Plan:
    """The stages of one traced graph for `n_members` members. Frozen: edits return a new plan."""

    fingerprint: str  # hash of graph structure + parameter shapes (planner.graph.fingerprint)
    tracer: str  # "fx" or "export"
    n_members: int
    inputs: tuple[InputSpec, ...]
    stages: tuple[Stage, ...]
    model: str = ""  # where the model came from, for people reading the file
    profile: Mapping[str, Any] | None = None  # last ProfileReport.to_json(), if any
    schema_version: int = SCHEMA_VERSION
    dtype: str = DEFAULT_DTYPE  # precision of the batched module, one of DTYPES; written to JSON only when not float32
    # leaf modules the trace opened (planner.opening); executor.build traces them open again. JSON only when not empty
    opened_modules: tuple[str, ...] = ()
    # whole-plan capture (executor.capture): on a GPU, inference calls replay the plan as CUDA graphs (autotune
    # sets it where that measured fastest). JSON only when set
    capture: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.n_members, bool) or not isinstance(self.n_members, int) or self.n_members < 1:
            raise MemberError(f"n_members must be an integer >= 1, got {self.n_members!r}; pass -n 1 or more")
        problem = dtype_problem(self.dtype)
        if problem:
            raise PlanFileError(f"plan {problem}")

    # -- lookups -------------------------------------------------------------
    def stage(self, stage_id: str) -> Stage:
        """The stage with this id; raises PlanMismatchError naming the known ids."""
        for s in self.stages:
            if s.id == stage_id:
                return s
        known = ", ".join(s.id for s in self.stages)
        raise PlanMismatchError(f"no stage {stage_id!r} in this plan; known stages: {known}")

    def stage_of(self, node: str) -> Stage:
        """The stage holding `node`."""
        for s in self.stages:
            if node in s.nodes:
                return s
        raise PlanMismatchError(f"node {node!r} is in no stage of this plan; check the node name (see `stagewise show`)")

    def input_mode(self, name: str) -> InputMode:
        for spec in self.inputs:
            if spec.name == name:
                return spec.mode
        raise PlanMismatchError(f"plan has no input {name!r}; inputs are {[i.name for i in self.inputs]}")

    # -- small functional updates ---------------------------------------------
    def with_stages(self, stages: Iterable[Stage]) -> "Plan":
        return replace(self, stages=tuple(stages), profile=None)

    def with_n_members(self, n: int) -> "Plan":
        """The same stages for another member count (stages do not depend on N)."""
        return replace(self, n_members=n, profile=None)

    def with_dtype(self, dtype: str) -> "Plan":
        """The same stages at another precision (one of DTYPES); the old profile no longer applies."""
        return replace(self, dtype=dtype, profile=None)

    def with_capture(self, on: bool) -> "Plan":
        """The same stages with whole-plan capture on or off; the old profile no longer applies."""
        return replace(self, capture=bool(on), profile=None)

    def with_profile(self, report_json: Mapping[str, Any] | None) -> "Plan":
        return replace(self, profile=report_json)

    def with_input_modes(self, modes: Mapping[str, InputMode | str]) -> "Plan":
        specs = []
        for spec in self.inputs:
            mode = modes.get(spec.name, spec.mode)
            specs.append(replace(spec, mode=InputMode(mode)))
        unknown = set(modes) - {s.name for s in self.inputs}
        if unknown:
            raise PlanMismatchError(f"unknown inputs {sorted(unknown)}; inputs are {[i.name for i in self.inputs]}")
        return replace(self, inputs=tuple(specs), profile=None)

    # -- JSON -------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "tracer": self.tracer,
            "n_members": self.n_members,
            "inputs": [i.to_json() for i in self.inputs],
            "stages": [s.to_json() for s in self.stages],
            "profile": dict(self.profile) if self.profile is not None else None,
            # only when not the default: float32 plans read the same as before the field existed
            **({"dtype": self.dtype} if self.dtype != DEFAULT_DTYPE else {}),
            **({"opened_modules": list(self.opened_modules)} if self.opened_modules else {}),
            **({"capture": True} if self.capture else {}),
        }

    def dumps(self) -> str:
        """Canonical text form: sorted keys, indent 2, trailing newline (golden files use it)."""
        return json.dumps(self.to_json(), sort_keys=True, indent=2) + "\n"

    @staticmethod
    def from_json(d: Any, *, source: str = "plan") -> "Plan":
        """Parse a plan dict; raises PlanFileError naming `source` and the problem."""
        if not isinstance(d, dict):
            raise PlanFileError(f"{source}: expected a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanFileError(
                f"{source}: schema_version is {version!r}, this stagewise reads version {SCHEMA_VERSION}; "
                "re-create the plan with `stagewise plan`"
            )
        _refuse_unknown_keys(d, _PLAN_KEYS, source)
        missing = [k for k in ("fingerprint", "tracer", "n_members", "inputs", "stages") if k not in d]
        if missing:
            raise PlanFileError(f"{source}: missing keys {missing}; re-create the plan with `stagewise plan`")
        if not isinstance(d["inputs"], list) or not isinstance(d["stages"], list):
            raise PlanFileError(f"{source}: 'inputs' and 'stages' must be JSON lists; re-create the plan with `stagewise plan`")
        try:
            inputs = tuple(InputSpec.from_json(x) for x in d["inputs"])
            stages = tuple(Stage.from_json(x, where=f"stages[{i}]") for i, x in enumerate(d["stages"]))
        except PlanFileError as e:  # one stage's or input's problem: name the file it is in
            raise (e if str(e).startswith(f"{source}:") else PlanFileError(f"{source}: {e}")) from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanFileError(f"{source}: malformed inputs or stages ({e!r}); re-create the plan with `stagewise plan`") from None
        ids = [s.id for s in stages]
        if len(set(ids)) != len(ids):
            raise PlanFileError(f"{source}: duplicate stage ids {sorted({i for i in ids if ids.count(i) > 1})}; give each stage its own id")
        n = d["n_members"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanFileError(f"{source}: n_members must be an integer >= 1, got {n!r}; fix it in the plan file")
        profile = d.get("profile")
        problem = _profile_problem(profile)
        if problem:
            raise PlanFileError(f"{source}: the 'profile' block is malformed ({problem}); "
                                "delete it (set it to null) or re-profile with `stagewise profile -o`")
        dtype = d.get("dtype", DEFAULT_DTYPE)  # files written before the field existed are float32
        problem = dtype_problem(dtype)
        if problem:
            raise PlanFileError(f"{source}: {problem}; fix it in the plan file or re-plan with `stagewise plan --dtype`")
        opened = d.get("opened_modules", [])  # files written before the field existed opened nothing
        if not isinstance(opened, list) or not all(isinstance(p, str) and p for p in opened):
            raise PlanFileError(f"{source}: opened_modules must be a list of module paths such as [\"encoder.layers.0\"], "
                                f"got {opened!r}; fix it or re-plan with `stagewise plan --open`")
        capture = d.get("capture", False)  # files written before the field existed run stage by stage
        if not isinstance(capture, bool):
            raise PlanFileError(f"{source}: capture must be true or false, got {capture!r}; fix it in the plan file")
        return Plan(
            fingerprint=str(d["fingerprint"]),
            tracer=str(d["tracer"]),
            n_members=n,
            inputs=inputs,
            stages=stages,
            model=str(d.get("model", "")),
            profile=profile,
            schema_version=version,
            dtype=dtype,
            opened_modules=tuple(opened),
            capture=capture,
        )

    @staticmethod
    def loads(text: str | bytes, *, source: str = "plan") -> "Plan":
        """Parse plan JSON text (bytes must be UTF-8); raises PlanFileError naming `source`."""
        if isinstance(text, (bytes, bytearray)):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PlanFileError(f"{source} is not UTF-8 text (bad byte at offset {e.start}); "
                                    "pass a file written by `stagewise plan` or Plan.save") from None
        if text.startswith("\ufeff"):  # a byte order mark some editors (Windows Notepad) write first: not part of the JSON
            text = text[1:]
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFileError(f"{source} is not valid JSON ({e}); pass a file written by `stagewise plan` or Plan.save") from None
        except RecursionError:
            raise PlanFileError(f"{source} nests JSON too deeply to be a plan; pass a file written by `stagewise plan` or Plan.save") from None
        try:
            return Plan.from_json(d, source=source)
        except PlanFileError as e:  # errors of one stage or input do not know the file; name it
            if str(e).startswith(source):
                raise
            raise PlanFileError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> Path:
        """Write the plan atomically: readers see the old or the new plan, never a part; concurrent saves do not collide."""
        path = Path(path)
        try:
            write_atomic(path, self.dumps())
        except OSError as e:
            raise PlanFileError(f"cannot write plan file {path}: {e.strerror}; check that the folder exists and is writable") from None
        return path

    @staticmethod
    def load(path: str | Path) -> "Plan":
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise PlanFileError(f"cannot read plan file {path}: {e.strerror}; check the path") from None
        return Plan.loads(data, source=str(path))


# The profile block is executor.ProfileReport.to_json(); the planner cannot import it, so it checks the
# shape every reader relies on (the CLI's `show`, the app's charts, ProfileReport.from_json).
def _profile_problem(profile: Any) -> str:
    """What is wrong with a plan's 'profile' value, or "" when it is null or well-formed."""
    if profile is None:
        return ""
    if not isinstance(profile, dict):
        return f"expected a JSON object or null, got {type(profile).__name__}"
    stages, baselines = profile.get("stages", []), profile.get("baselines", [])
    if not isinstance(stages, list) or not isinstance(baselines, list):
        return "'stages' and 'baselines' must be lists"
    results = [("end_to_end", profile.get("end_to_end")), *((f"baselines[{i}]", b) for i, b in enumerate(baselines))]
    for i, st in enumerate(stages):
        if not isinstance(st, dict) or not isinstance(st.get("id"), str):
            return f"stages[{i}] must be an object with a string 'id'"
        results += [(f"stages[{i}].result", st.get("result")), (f"stages[{i}].loop", st.get("loop"))]
        candidates = st.get("candidates", [])
        if not isinstance(candidates, list):
            return f"stages[{i}].candidates must be a list"
        results += [(f"stages[{i}].candidates[{j}]", c) for j, c in enumerate(candidates)]
    for where, result in results:
        if result is None:
            continue
        if not isinstance(result, dict):
            return f"{where} must be an object or null"
        time = result.get("time")
        if time is not None and not isinstance(time, dict):
            return f"{where}.time must be an object or null"
        for key, value in (time or {}).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                return f"{where}.time.{key} must be a number"
    return ""
