"""Profile and sweep reports: dataclasses with a plain-JSON round trip and a text table.

JSON holds only str/float/int/bool/None/list/dict (the UI reads it from a worker
process; a plan file can store it under "profile"). Times are milliseconds,
compile times seconds, memory bytes, FLOPs counts for all N members together.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from stagewise.executor.timing import Timing

REPORT_VERSION = 1


def _num(x: float) -> Any:
    """JSON has no inf/nan: they become None."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _clean(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _clean(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_clean(v) for v in d]
    return _num(d)


@dataclass
class StrategyResult:
    """One strategy of one stage (or one whole-model baseline), run and checked against the loop."""

    strategy: str  # "vmap", "wide", "loop", "compile", "cuda_graph", "vmap/chunk=4"; baselines: "loop", "vmap", ...
    ok: bool  # ran and matched the member loop within rtol
    error: str = ""  # why not ok: the exception, "out of memory: ...", or "wrong result: max rel err ..."
    time: Optional[Timing] = None  # steady state, compile excluded
    compile_s: float = 0.0  # one-time compile/capture cost, never inside `time`
    max_rel_err: Optional[float] = None  # normwise, worst member, vs the member loop
    peak_mem_bytes: Optional[int] = None
    chunk_size: Optional[int] = None

    @property
    def ms(self) -> float:
        return self.time.median_ms if self.time else math.inf

    @staticmethod
    def from_json(d: dict) -> "StrategyResult":
        d = dict(d)
        d["time"] = Timing.from_json(d.get("time"))
        return StrategyResult(**d)


@dataclass
class StageProfile:
    """Measurements of one stage of the plan."""

    id: str
    mode: str  # "batched" / "excluded"
    strategy: str  # the plan's strategy for the stage
    nodes: list[str]
    flops: int  # all members, from the trace's per-node FLOP counts x N
    result: StrategyResult  # the plan's strategy
    loop: Optional[StrategyResult] = None  # the member loop of this stage on the same inputs
    candidates: list[StrategyResult] = field(default_factory=list)  # filled by autotune
    note: str = ""

    @property
    def gflops_per_s(self) -> Optional[float]:
        if not self.result.time or not self.flops or self.result.time.median_ms <= 0:
            return None
        return self.flops / (self.result.time.median_ms * 1e-3) / 1e9

    @staticmethod
    def from_json(d: dict) -> "StageProfile":
        d = dict(d)
        d.pop("gflops_per_s", None)
        d["result"] = StrategyResult.from_json(d["result"])
        d["loop"] = StrategyResult.from_json(d["loop"]) if d.get("loop") else None
        d["candidates"] = [StrategyResult.from_json(c) for c in d.get("candidates", [])]
        return StageProfile(**d)


@dataclass
class ProfileReport:
    """What `executor.profile` measured: per stage, end to end and the whole-model baselines."""

    model: str
    fingerprint: str
    n_members: int
    device: str  # "cpu" / "cuda:0"
    device_name: str  # CPU model or GPU name
    torch_version: str
    threads: int
    stages: list[StageProfile]
    end_to_end: StrategyResult  # the whole plan, strategy "stagewise"
    baselines: list[StrategyResult] = field(default_factory=list)  # "loop", "vmap", "vmap+compile", "floor"
    warmup: int = 2
    autotuned: bool = False
    plan: Optional[dict] = None  # the profiled plan's JSON (the tuned plan when autotuned)
    trace_path: Optional[str] = None
    profile_s: float = 0.0  # wall time of the profile, compile included
    compile_s: float = 0.0  # total compile time inside it
    notes: list[str] = field(default_factory=list)
    version: int = REPORT_VERSION
    # a training profile (executor.profile(..., train=True)): times are forward + backward + optimizer step end
    # to end (baselines "loop": N torch.optim optimizers, "torch.func": vmap(grad) + one foreach step) and
    # forward + backward per stage; max_rel_err compares gradients with the member loop's
    train: bool = False
    optimizer: str = ""  # with train: "adam" / "sgd"
    # whole-plan capture (plan.capture) as the end-to-end time ran it: CapturedPlan.layout(), one entry per graph or
    # eager stage ({"stages", "mode": "graph" | "eager", "reason"}); None when the plan ran stage by stage
    capture: Optional[list] = None

    # -- lookups -------------------------------------------------------------------
    def baseline(self, name: str) -> Optional[StrategyResult]:
        return next((b for b in self.baselines if b.strategy == name), None)

    def speedup_over(self, name: str) -> Optional[float]:
        """Baseline time / plan time (>1: the plan is faster)."""
        b = self.baseline(name)
        if not b or not b.ok or not self.end_to_end.ok:
            return None
        return b.ms / self.end_to_end.ms

    # -- JSON -------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        for s, sd in zip(self.stages, d["stages"]):
            sd["gflops_per_s"] = s.gflops_per_s  # derived, for readers of the JSON
        return _clean(d)

    @staticmethod
    def from_json(d: dict) -> "ProfileReport":
        d = dict(d)
        d["stages"] = [StageProfile.from_json(s) for s in d["stages"]]
        d["end_to_end"] = StrategyResult.from_json(d["end_to_end"])
        d["baselines"] = [StrategyResult.from_json(b) for b in d.get("baselines", [])]
        return ProfileReport(**d)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, indent=2) + "\n"

    # -- text ---------------------------------------------------------------------------
    def to_text(self) -> str:
        kind = f"training profile ({self.optimizer} step)" if self.train else "profile"
        head = (f"{kind} of {self.model or 'plan ' + self.fingerprint}: N={self.n_members} on {self.device} "
                f"({self.device_name}, {self.threads} threads), torch {self.torch_version}"
                + (", autotuned" if self.autotuned else ""))
        lines = [head, "", _STAGE_HEADER]
        for s in self.stages:
            lines.append(_stage_row(s))
            for c in s.candidates:
                chosen = c.strategy in (s.strategy, f"merged/{s.strategy}") and c.chunk_size == s.result.chunk_size
                lines.append(_candidate_row(c, chosen=chosen))
        whole = "training step" if self.train else "whole model"
        lines += ["", f"{whole:<24} {'median ms':>10} {'p10-p90 ms':>15} {'compile s':>9} {'max rel err':>11}  vs stagewise"]
        for r in [self.end_to_end] + self.baselines:
            lines.append(_baseline_row(r, self.end_to_end, self.train))
        if self.capture:
            lines.append(f"\nwhole-plan capture: {capture_text(self.capture)}")
        if self.trace_path:
            lines.append(f"\nchrome trace: {self.trace_path} (open in chrome://tracing or ui.perfetto.dev)")
        lines.append(f"\nprofiled in {self.profile_s:.1f} s (compile {self.compile_s:.1f} s); times are medians after {self.warmup} warm-up calls")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def capture_text(layout: list) -> str:
    """A capture layout in one line: "one CUDA graph (s0-s4)" or "graph s0-s1 · eager s2 (why) · graph s3"."""
    def ids(entry: dict) -> str:
        st = entry["stages"]
        return st[0] if len(st) == 1 else f"{st[0]}-{st[-1]}"
    if len(layout) == 1 and layout[0]["mode"] == "graph":
        return f"one CUDA graph ({ids(layout[0])})"
    graphs = sum(e["mode"] == "graph" for e in layout)
    parts = [f"graph {ids(e)}" if e["mode"] == "graph" else f"eager {ids(e)} ({e['reason']})" for e in layout]
    return f"{graphs} CUDA graph{'s' if graphs != 1 else ''}: " + " · ".join(parts)


_STAGE_HEADER = (f"{'stage':<6} {'mode':<9} {'strategy':<14} {'nodes':>5} {'median ms':>10} {'p10-p90 ms':>15} "
                 f"{'loop ms':>9} {'speedup':>7} {'GFLOP/s':>8} {'peak MiB':>8} {'max rel err':>11}")


def _fmt(x: Optional[float], spec: str, dash: str = "-") -> str:
    return dash if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _spread(t: Optional[Timing]) -> str:
    return f"{t.p10_ms:.3g}-{t.p90_ms:.3g}" if t else "-"


def _stage_row(s: StageProfile) -> str:
    r = s.result
    speed = s.loop.ms / r.ms if (s.loop and s.loop.ok and r.ok and r.ms > 0) else None
    mem = r.peak_mem_bytes / 2**20 if r.peak_mem_bytes is not None else None
    row = (f"{s.id:<6} {s.mode:<9} {s.strategy:<14} {len(s.nodes):>5} {_fmt(r.time.median_ms if r.time else None, '10.3f'):>10} "
           f"{_spread(r.time):>15} {_fmt(s.loop.ms if s.loop and s.loop.ok else None, '9.3f'):>9} "
           f"{_fmt(speed, '6.2f') + 'x' if speed else '-':>7} {_fmt(s.gflops_per_s, '8.2f'):>8} {_fmt(mem, '8.1f'):>8} "
           f"{_fmt(r.max_rel_err, '11.1e'):>11}")
    if not r.ok:
        row += f"  FAILED: {r.error}"
    return row


def _candidate_row(c: StrategyResult, chosen: bool) -> str:
    mark = "*" if chosen else " "
    label = f"  {mark} {c.strategy}"
    if not c.ok:  # a candidate not applicable to the stage did not fail: it was never tried (autotune.NOT_APPLICABLE)
        return f"{label:<31} {c.error}" if c.error.startswith("not applicable: ") else f"{label:<31} failed: {c.error}"
    extra = f"  (+{c.compile_s:.1f} s compile)" if c.compile_s else ""
    return f"{label:<31} {c.ms:>10.3f} {_spread(c.time):>15}  err {_fmt(c.max_rel_err, '.1e')}{extra}"


_TRAINING_NAMES = {"stagewise": "stagewise + stacked opt", "loop": "loop: N torch.optim", "torch.func": "torch.func + foreach opt"}


def _baseline_row(r: StrategyResult, plan: StrategyResult, train: bool = False) -> str:
    name = _TRAINING_NAMES.get(r.strategy, r.strategy) if train else {"stagewise": "stagewise plan", "loop": "loop (eager)", "vmap": "whole vmap", "vmap+compile": "whole vmap + compile",
            "floor": "floor: 1 member, Nx batch"}.get(r.strategy, r.strategy)
    if not r.ok:
        return f"{name:<24} failed: {r.error}"
    ratio = r.ms / plan.ms if plan.ok and r.strategy != "stagewise" else None
    return (f"{name:<24} {r.ms:>10.3f} {_spread(r.time):>15} {_fmt(r.compile_s or None, '9.1f'):>9} "
            f"{_fmt(r.max_rel_err, '11.1e'):>11}  {(format(ratio, '.2f') + 'x') if ratio else '':>8}")


@dataclass
class SweepPoint:
    """One N of an N sweep."""

    n: int
    stage_ms: dict[str, Optional[float]]  # stage id -> the plan's strategy, median ms
    loop_ms: dict[str, Optional[float]]  # stage id -> the member loop of that stage, median ms
    end_to_end_ms: Optional[float]
    loop_end_to_end_ms: Optional[float]
    peak_mem_bytes: Optional[int]
    error: str = ""


@dataclass
class SweepReport:
    """A plan timed at several N: per-stage break-even N and the largest N under a memory budget."""

    model: str
    device: str
    points: list[SweepPoint]
    break_even: dict[str, Optional[int]]  # stage id -> smallest N from which batching beats the loop (None: never)
    memory_budget: Optional[int] = None  # bytes
    max_n_in_budget: Optional[int] = None  # largest measured N whose peak memory fits the budget
    max_n_estimate: Optional[int] = None  # linear extrapolation of peak memory in N
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return _clean(asdict(self))

    @staticmethod
    def from_json(d: dict) -> "SweepReport":
        d = dict(d)
        d["points"] = [SweepPoint(**p) for p in d["points"]]
        return SweepReport(**d)

    def to_text(self) -> str:
        ids = list(self.break_even)
        lines = [f"N sweep of {self.model} on {self.device}", "",
                 f"{'N':>5} " + " ".join(f"{i + ' ms':>10} {i + ' loop':>10}" for i in ids) + f" {'total ms':>10} {'loop ms':>10} {'peak MiB':>9}"]
        for p in self.points:
            if p.error:
                lines.append(f"{p.n:>5} failed: {p.error}")
                continue
            cells = " ".join(f"{_fmt(p.stage_ms.get(i), '10.3f'):>10} {_fmt(p.loop_ms.get(i), '10.3f'):>10}" for i in ids)
            mem = p.peak_mem_bytes / 2**20 if p.peak_mem_bytes is not None else None
            lines.append(f"{p.n:>5} {cells} {_fmt(p.end_to_end_ms, '10.3f'):>10} {_fmt(p.loop_end_to_end_ms, '10.3f'):>10} {_fmt(mem, '9.1f'):>9}")
        lines.append("")
        for i, n in self.break_even.items():
            lines.append(f"{i}: batching beats the loop from N={n}" if n else f"{i}: batching never beat the loop in this sweep")
        if self.memory_budget is not None:
            lines.append(f"memory budget {self.memory_budget / 2**20:.0f} MB: largest measured N that fits = {self.max_n_in_budget}, "
                         f"linear estimate = {self.max_n_estimate}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
