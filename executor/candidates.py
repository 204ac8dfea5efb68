"""Running, checking and timing one stage's candidate strategies: shared by executor.profile and executor.autotune.

A candidate runs on the stage's real inputs (the outputs of the stages before
it); its outputs are compared with the stage's member loop (normwise, worst
member); out of memory and wrong results become a failed StrategyResult, never
an exception. Working candidates are timed round-robin, with peak memory.

State: candidates of a stage share its stacked state, and a forward that
updates buffers (BatchNorm in training mode, a call counter) moves it on every
run. SavedTensors puts it back, so that each candidate is checked from the
state the loop reference started from; private_members keeps the caller's
members out of it altogether.
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.planner.plan import StageOptions, Strategy
from stagewise.executor.input_writes import FreshInputs
from stagewise.executor.members import copy_member, member_list, state_device
from stagewise.executor.report import StrategyResult
from stagewise.executor.stages import RUNNERS, LoopRunner, Runner, StageProgram
from stagewise.executor.strategies.compiled import with_compile_mode
from stagewise.executor.strategies.wide import with_conv_form
from stagewise.executor.timing import Prepared, describe_error, inject_faults, interleaved, is_oom, peak_memory_bytes
from stagewise.executor.values import Batched, PerMember, as_batched, leaf_paths, n_first
from stagewise.executor.verify import DEFAULT_RTOL, dtype_clash, nonfinite_apart, same_draws, same_number

Progress = Optional[Callable[[int, int, str], None]]


# --- comparing with the loop ------------------------------------------------------------

def max_rel_error(got: Any, want: Any) -> float:
    """Worst member's normwise error: max|got-want| / max|want| per member, N-first trees."""
    g_leaves = tree_flatten(got)[0]
    w_leaves = tree_flatten(want)[0]
    if len(g_leaves) != len(w_leaves) or leaf_paths(got) != leaf_paths(want):  # other leaves, or under other keys
        return math.inf
    worst = 0.0
    for g, w in zip(g_leaves, w_leaves):
        if isinstance(g, torch.Tensor) and g.dim() == 1 and isinstance(w, (bool, int, float)) and not g.requires_grad:
            # a number every member returned alike, which the reference keeps as one plain value and the batched
            # module returns N-first (numbers read from tensors always are): compared member by member
            w = torch.full(g.shape, w, dtype=g.dtype if isinstance(w, bool) or not g.is_floating_point()
                           else torch.float64)
            g = g.detach().cpu().to(w.dtype)
        if not isinstance(w, torch.Tensor):
            if isinstance(w, float) and isinstance(g, (int, float)) and not isinstance(g, bool):
                # a Python number: its relative error, judged against the plan's tolerance like a tensor's
                same = g == w or (math.isnan(g) and math.isnan(w))
                rel = 0.0 if same else abs(g - w) / max(abs(w), 1e-30)
                if math.isnan(rel):  # NaN on one side alone (max() would drop it) or inf apart: wrong
                    return math.inf
                worst = max(worst, rel)
            elif not same_number(g, w, 0.0):
                return math.inf
            continue
        g = torch.as_tensor(g)
        if g.dim() == 1 and w.dim() == 1 and {g.dtype, w.dtype} == {torch.float32, torch.float64}:
            g, w = g.double(), w.double()  # one number per member, in float32 on one side: compared as values
        if g.shape != w.shape or dtype_clash(g.dtype, w.dtype):
            return math.inf
        if w.numel() == 0:
            continue
        if w.dim() == 0:
            g, w = g.reshape(1), w.reshape(1)
        if not (w.is_floating_point() or w.is_complex()):  # ids, masks, counts: equal or wrong, no tolerance
            if g.is_floating_point() or g.is_complex() or not torch.equal(g.detach().long(), w.detach().long()):
                return math.inf
            continue
        wide = torch.complex128 if (w.is_complex() or g.is_complex()) else torch.float64
        g64, w64 = g.detach().to(wide).reshape(w.shape[0], -1), w.detach().to(wide).reshape(w.shape[0], -1)
        if not (g64.isfinite().all() and w64.isfinite().all()):  # NaN and inf must sit where the loop has them
            if nonfinite_apart(g64, w64):
                return math.inf
        # NaN and inf sit alike (checked above): measured on the finite values (nan_to_num(0.0) alone would make an
        # inf 1.8e308, so a member's scale was inf-sized and its error divided to nothing)
        diff = (g64 - w64).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).amax(dim=1)
        scale = w64.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).amax(dim=1)
        rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)
        worst = max(worst, float(rel.max()))
    return worst


def _nfirst_all(values: list, n: int) -> list:
    return [_comparable(v, n) for v in values]


def _comparable(v: Any, n: int) -> Any:
    """A stage boundary value as max_rel_error compares it: N-first (values.n_first), or, where the members' values
    cannot be stacked (loop stages handing on a value whose shape depends on the values, `h[h[:, 0] > 0]`, or whose
    structure differs per member), a list of the members' own trees, each tensor with a member axis of one."""
    if isinstance(v, PerMember):
        layouts = [[(tuple(x.shape) if isinstance(x, torch.Tensor) else None) for x in tree_flatten(m)[0]]
                   + [leaf_paths(m)] for m in v.values]
        if any(layout != layouts[0] for layout in layouts[1:]):
            return [tree_map(lambda x: x.unsqueeze(0) if isinstance(x, torch.Tensor) else x, m) for m in v.values]
    # per-member Python floats as the doubles they are: a batched stage hands such numbers on in float64
    # (exact_numbers), where float32 would clash in dtype with them
    return n_first(v, n, float_dtype=torch.float64)


# --- running one strategy ------------------------------------------------------------------

def strategy_label(strategy: Strategy, chunk_size: Optional[int], conv_form: str = "", compile_mode: str = "") -> str:
    """"vmap", "vmap/chunk=4", "wide/conv=bmm", "compile/reduce-overhead": a candidate's name in results and notes."""
    return (strategy.value + (f"/chunk={chunk_size}" if chunk_size and strategy is Strategy.VMAP else "")
            + (f"/conv={conv_form}" if conv_form and strategy is Strategy.WIDE else "")
            + (f"/{compile_mode}" if compile_mode and strategy is Strategy.COMPILE else ""))


def conv_form_of_label(label: str) -> str:
    """The conv form a candidate label names ("wide/conv=bmm" -> "bmm"; "" for none)."""
    return label.partition("/conv=")[2]


def compile_mode_of_label(label: str) -> str:
    """The torch.compile mode a stage candidate's label names ("compile/reduce-overhead" -> "reduce-overhead"; "" for none)."""
    strategy, _, mode = label.partition("/")
    return mode if strategy == Strategy.COMPILE.value else ""


def make_runner(program: StageProgram, base: Runner, strategy: Strategy, chunk_size: Optional[int] = None,
                conv_form: str = "", compile_mode: str = "") -> Runner:
    """A runner of `strategy` for the stage `base` runs, sharing base's stacked state (`conv_form`: wide's,
    `compile_mode`: compile's torch.compile mode; the stage's own tags for either are replaced)."""
    options = StageOptions(strategy=strategy, chunk_size=chunk_size, note=program.stage.options.note)
    options = with_compile_mode(with_conv_form(options, conv_form if strategy is Strategy.WIDE else ""),
                                compile_mode if strategy is Strategy.COMPILE else "")
    prog = replace(program, stage=replace(program.stage, options=options))
    return RUNNERS[strategy](prog, base.n_members, base.stacked, base.member_states)


def try_strategy(label: str, stage_id: str, make: Callable[[], Callable[[], Any]],
                 check: Optional[Callable[[Any], float]], device: torch.device,
                 rtol: float = DEFAULT_RTOL) -> tuple[StrategyResult, Optional[Callable], Any]:
    """Build one candidate and run it once; `check(outputs)` gives its error against the loop.

    Returns (result without timing, the callable, its outputs); the callable is
    None when the candidate failed. Out of memory and wrong results never escape.
    The first call's wall time is kept in compile_s until time_candidates corrects it.
    """
    start = time.perf_counter()
    try:
        inject_faults(stage_id, label)
        call = make()
        with same_draws(0):  # the random state the loop reference drew from (loop_reference, autotune's checks)
            out = call()
        first_s = time.perf_counter() - start
        err = check(out) if check is not None else None
    except Exception as e:  # any failure of a candidate is a result, not a crash
        if is_oom(e) and device.type == "cuda":
            torch.cuda.empty_cache()
        return StrategyResult(label, ok=False, error=describe_error(e)), None, None
    if err is not None and not err <= rtol:
        return StrategyResult(label, ok=False, error=f"wrong result: max rel err {err:.2e} > {rtol:g} vs the member loop",
                              max_rel_err=err), None, None
    return StrategyResult(label, ok=True, max_rel_err=err, compile_s=first_s), call, out


class StageInputs:
    """A stage's input values from `env`, for the runs that check and time its candidates.

    For a stage that writes in place, each run gets private writable [N, ...] copies (what BatchedModule passes it,
    never `env`'s tensors, which may be the caller's inputs), refilled with `env`'s values before the run: without
    that, a stage doing `x.mul_(2)` would see x times 2**k on its k-th run, and a candidate checked on such values could
    be judged wrong (or right where it is wrong). The copies are made once and refilled in place
    (input_writes.FreshInputs), and `timed(run)` refills them outside what timing measures (timing.Prepared): the
    copy is not the stage's cost. Calling the object refills and returns them (a reference run, advance()); a stage
    that writes nothing gets `env`'s values, uncopied.
    """

    def __init__(self, program: StageProgram, env: dict, n: int):
        args = [env[name] for name in program.input_names]
        self.written = bool(program.writes_in_place)
        if not self.written:
            self._args, self._fresh = args, None
            return
        self._fresh = FreshInputs(tuple(as_batched(a, n).tree for a in args), True)
        self._args = [Batched(t) for t in self._fresh.values]

    def refill(self) -> None:
        """`env`'s values back into the copies (what the last run wrote is gone); nothing where nothing is written."""
        if self._fresh is not None:
            self._fresh.restore()

    def current(self) -> list:
        """The values as they are now (no refill): what a call built for `prepared` runs on."""
        return list(self._args)

    def __call__(self) -> list:
        self.refill()
        return self.current()

    def prepared(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call` (built on `current()`) with refill() before each run, outside the timed call; `call` itself where
        nothing is written."""
        return Prepared(self.refill, call) if self.written else call

    def timed(self, run: Callable[[list], Any]) -> Callable[[], Any]:
        """`run(inputs)` as a candidate's call: the refill before it, outside the timed call."""
        return self.prepared(lambda: run(self.current()))


def stage_inputs(program: StageProgram, env: dict, n: int) -> StageInputs:
    """The stage's input values from `env` (StageInputs: fresh private copies for a stage that writes in place)."""
    return StageInputs(program, env, n)


def advance(program: StageProgram, env: dict, fresh: Callable[[], list], outputs: Optional[list],
            run: Callable[[list], list]) -> None:
    """Put the stage's outputs into `env` (and, if it writes in place, the inputs it wrote into)."""
    if program.writes_in_place:
        args = fresh()
        outputs = run(args)
        env.update(zip(program.input_names, args))
    for name, value in zip(program.output_names, outputs):
        env[name] = value


def loop_reference(program: StageProgram, runner: Runner, fresh: Callable[[], list]) -> tuple[Runner, list, Callable[[list], float]]:
    """The stage's member loop (the trusted reference), its outputs on `fresh()` inputs, and a check against them."""
    reference = LoopRunner(program, runner.n_members, runner.stacked, runner.member_states)
    with same_draws(0):  # candidates are checked from the same random state (try_strategy): a stage that draws
        ref = reference(fresh())  # random numbers matches when it draws as the loop draws
    return reference, ref, stage_check(ref, runner.n_members)


def stage_check(want_values: list, n: int) -> Callable[[list], float]:
    """Error of a stage's boundary outputs against the loop runner's, per member."""
    # a copy: the loop's outputs may view the stage's inputs (`r = h.add_(1)` handed on), which StageInputs refills
    # before each candidate's run, so the reference would move with the candidate it checks
    want = tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, _nfirst_all(want_values, n))
    return lambda out: max_rel_error(_nfirst_all(out, n), want)


def time_candidates(cands: dict[str, tuple[StrategyResult, Callable]], device: torch.device,
                    repeats: Optional[int], warmup: int, compiles: set[str], *, memory: bool = True,
                    deadline_s: Optional[float] = None) -> None:
    """Time the working candidates round-robin; fill time, peak memory and compile_s in place.

    compile_s of a label in `compiles` becomes its first call's time less a steady call; the
    others' is kept as it was (a later round must not erase a compile time measured before),
    0 where it still holds the first call's time. `memory`: measure peak memory (on CPU one
    profiled call, ~0.05-0.3 s) for candidates that have none yet. `deadline_s`: see
    timing.interleaved."""
    fns = {label: call for label, (res, call) in cands.items()}
    try:
        timings = interleaved(fns, device, repeats, warmup, deadline_s)
    except Exception:  # a candidate that ran once but fails when repeated (OOM on a second buffer set): find which
        for label, (res, call) in cands.items():
            try:
                res.time = interleaved({label: call}, device, repeats, warmup, deadline_s)[label]
            except Exception as e:
                res.ok, res.error = False, describe_error(e)
                if is_oom(e) and device.type == "cuda":
                    torch.cuda.empty_cache()
        timings = {label: res.time for label, (res, _) in cands.items() if res.ok}
    for label, (res, call) in cands.items():
        if label not in timings or not res.ok:
            continue
        first_timing = res.time is None
        res.time = timings[label]
        if label in compiles and first_timing:
            res.compile_s = max(0.0, res.compile_s - res.time.median_ms / 1e3)
        elif first_timing:
            res.compile_s = 0.0  # the first call of an eager candidate is no one-time cost worth reporting
        if memory and res.peak_mem_bytes is None:
            try:
                res.peak_mem_bytes = peak_memory_bytes(call, device)
            except Exception as e:
                res.ok, res.error = False, describe_error(e)


def on_device(x: Any, device: torch.device) -> Any:
    """Tensors of a pytree moved to `device`."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


class SavedTensors:
    """The values some state tensors hold now; `restore()` writes them back in place.

    Only tensors whose values changed are written (an unchanged one keeps its version counter,
    which whole-plan capture keys parameters on). A tensor reachable twice (tied) is saved once.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
        with torch.no_grad():
            self._saved = [(t, t.detach().clone()) for t in unique.values()]

    def restore(self, only: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Write the saved values back; `only`: just these of the saved tensors (one stage's state)."""
        keep = None if only is None else {id(t) for t in only}
        with torch.no_grad():
            for t, value in self._saved:
                if (keep is None or id(t) in keep) and not torch.equal(t, value):
                    t.copy_(value)


def member_tensors(members: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of `members`."""
    return [t for m in members for t in [*m.parameters(), *m.buffers()]]


@contextlib.contextmanager
def state_kept(members: Sequence[nn.Module]) -> Iterator[None]:
    """Run the block (the member loop, a retrace) and put the members' parameters and buffers back after it."""
    snapshot = SavedTensors(member_tensors(members))
    try:
        yield
    finally:
        snapshot.restore()


_PRIVATE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # copies private_members made (never a caller's module)


def private_members(members: Sequence[nn.Module], device: Optional[torch.device], who: str = "autotune") -> list[nn.Module]:
    """Copies of `members` on `device` (None: where each is) to run as the loop reference and build candidates
    from: the caller's modules are never run, so forward's buffer updates (BatchNorm statistics, counters)
    and attributes it sets never reach them. Members that are already such copies on `device` are returned
    as they are (profile hands its copies on to autotune: one copy per call, not two). `who` names the
    caller in the error. MemberError for a member torch cannot copy."""
    out = []
    for i, m in enumerate(member_list(members, f"executor.{who}")):
        if m in _PRIVATE and _on(m, device):
            out.append(m)
            continue
        c = copy_member(m, i, f"{who} runs private copies so that it never changes your members")
        c = c.to(device) if device is not None else c
        _PRIVATE.add(c)
        out.append(c)
    return out


def _on(m: nn.Module, device: Optional[torch.device]) -> bool:
    """Whether `m`'s state is on `device` ("cuda" without an index matches any CUDA device)."""
    home = state_device(m)
    return (device is None or home is None
            or (home.type == device.type and (device.index is None or home.index == device.index)))
