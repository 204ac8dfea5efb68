"""Reading executor's ProfileReport JSON (ProfileReport.to_json) for charts and tables. No streamlit here.

Layout (executor/report.py): "stages": [{"id", "mode", "strategy", "flops",
"result": StrategyResult, "loop": StrategyResult|None}], "end_to_end": StrategyResult,
"baselines": [StrategyResult with strategy "loop", "vmap", ...], "train": bool (a training
profile: times are forward + backward + optimizer step, baselines "loop" and "torch.func"); a StrategyResult
has "ok", "error", "time": {"median_ms", "p10_ms", "p90_ms", ...}|None,
"max_rel_err", "peak_mem_bytes". Times are milliseconds, memory bytes.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

# per-stage times are read in the planner (plan diffs need them too); re-exported for the pages
from stagewise.planner.measured import measured_stage_times, result_ms, stage_times  # noqa: F401

Report = Mapping[str, Any]


def shown_report(reports: Iterable[Mapping[str, Any]], n: Optional[int]) -> Optional[Mapping[str, Any]]:
    """The worker result {"n", "report", ...} for member count `n`, else the last one; None when there are none."""
    reports = list(reports)
    return next((r for r in reports if r.get("n") == n), reports[-1] if reports else None)


def stage_rows(report: Report | None) -> list[dict[str, Any]]:
    """One row per stage: id, mode, strategy, ms, loop ms, speedup vs loop, GFLOP/s, max rel err, error."""
    rows = []
    for s in (report or {}).get("stages", []) or []:
        res, loop = s.get("result") or {}, s.get("loop")
        ms, loop_ms = result_ms(res), result_ms(loop)
        rows.append({
            "stage": s["id"], "mode": s.get("mode"), "strategy": s.get("strategy"), "ms": ms, "loop ms": loop_ms,
            "vs loop": (loop_ms / ms) if ms and loop_ms else None, "GFLOP/s": s.get("gflops_per_s"),
            "max rel err": res.get("max_rel_err"), "error": res.get("error", ""),
        })
    return rows


def baselines(report: Report | None) -> dict[str, Optional[float]]:
    """{"stagewise": ms, "loop": ms, "vmap": ms, ...} end to end (None where a baseline failed)."""
    if not report:
        return {}
    out = {"stagewise": result_ms(report.get("end_to_end"))}
    for b in report.get("baselines", []) or []:
        out[str(b.get("strategy"))] = result_ms(b)
    return out


def headline(report: Report | None) -> dict[str, str]:
    """The summary the page shows as metrics, formatted."""
    if not report:
        return {}
    base = baselines(report)
    plan_ms = base.get("stagewise")
    out: dict[str, str] = {}
    if plan_ms is not None:
        out["stagewise ms"] = f"{plan_ms:.3g}"
    for name in ("loop", "vmap", "torch.func"):
        ms = base.get(name)
        if ms is not None:
            out[f"{name} ms"] = f"{ms:.3g}"
            if plan_ms:
                out[f"speedup vs {name}"] = f"{ms / plan_ms:.2f}×"
    e2e = report.get("end_to_end") or {}
    if e2e.get("peak_mem_bytes") is not None:
        out["peak memory"] = f"{e2e['peak_mem_bytes'] / 2**20:.1f} MiB"
    errs = [e2e.get("max_rel_err")] + [(s.get("result") or {}).get("max_rel_err") for s in report.get("stages", [])]
    errs = [e for e in errs if isinstance(e, (int, float))]
    if errs:
        out["max rel error"] = f"{max(errs):.1e}"
    return out


def failures(report: Report | None) -> list[str]:
    """Lines naming every stage or baseline that failed, with its error."""
    if not report:
        return []
    out = [f"stage {s['id']}: {(s.get('result') or {}).get('error')}" for s in report.get("stages", [])
           if not (s.get("result") or {}).get("ok", True)]
    out += [f"baseline {b.get('strategy')}: {b.get('error')}" for b in report.get("baselines", []) if not b.get("ok", True)]
    e2e = report.get("end_to_end") or {}
    if e2e and not e2e.get("ok", True):
        out.append(f"end to end: {e2e.get('error')}")
    return out


def sweep_rows(reports: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per N (worker results {"n", "report"}): N and the end-to-end ms of stagewise and each baseline."""
    rows = []
    for r in reports:
        row: dict[str, Any] = {"N": int(r.get("n", 0))}
        row.update({f"{k} ms": v for k, v in baselines(r.get("report")).items()})
        rows.append(row)
    return sorted(rows, key=lambda row: row["N"])
