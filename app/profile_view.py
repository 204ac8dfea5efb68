"""Reading a ProfileReport's JSON for charts and tables. No streamlit here.

The report layout belongs to executor.profile (ProfileReport.to_json); this
module only looks values up, tolerating the spellings below, so the page keeps
working while that report grows. Anything it cannot find is shown as raw JSON.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

_STAGE_ID = ("id", "stage", "stage_id")
_STAGE_MS = ("ms", "time_ms", "mean_ms", "median_ms", "batched_ms")
_METRICS = {  # headline name -> accepted keys, top level or one level down
    "staged ms": ("staged_ms", "plan_ms", "batched_ms", "total_ms"),
    "loop ms": ("loop_ms",),
    "whole-vmap ms": ("vmap_ms", "whole_vmap_ms"),
    "speedup vs loop": ("speedup", "speedup_vs_loop"),
    "peak memory MB": ("peak_memory_mb", "memory_mb", "peak_mb"),
    "max error": ("max_error", "max_rel_error", "max_rel"),
}


def _first(d: Mapping[str, Any], keys: Iterable[str]) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _find(d: Mapping[str, Any], keys: Iterable[str]) -> Any:
    keys = tuple(keys)
    v = _first(d, keys)
    if v is not None:
        return v
    for sub in d.values():
        if isinstance(sub, Mapping):
            v = _first(sub, keys)
            if v is not None:
                return v
    return None


def stage_times(report: Mapping[str, Any] | None) -> dict[str, float]:
    """{stage id: measured ms} from a report (or from a plan.profile), {} when it has none."""
    if not report:
        return {}
    stages = report.get("stages")
    out: dict[str, float] = {}
    if isinstance(stages, Mapping):
        for sid, v in stages.items():
            ms = _first(v, _STAGE_MS) if isinstance(v, Mapping) else v
            if isinstance(ms, (int, float)):
                out[str(sid)] = float(ms)
    elif isinstance(stages, list):
        for row in stages:
            if isinstance(row, Mapping):
                sid, ms = _first(row, _STAGE_ID), _first(row, _STAGE_MS)
                if sid is not None and isinstance(ms, (int, float)):
                    out[str(sid)] = float(ms)
    return out


def headline(report: Mapping[str, Any] | None) -> dict[str, float]:
    """The summary numbers the page shows as metrics (only those the report has)."""
    if not report:
        return {}
    out = {}
    for name, keys in _METRICS.items():
        v = _find(report, keys)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = float(v)
    if "speedup vs loop" not in out and "staged ms" in out and out.get("loop ms"):
        out["speedup vs loop"] = out["loop ms"] / out["staged ms"] if out["staged ms"] else float("nan")
    return out


def sweep_rows(reports: Iterable[Mapping[str, Any]]) -> list[dict[str, float]]:
    """One row per N: {"N", "staged ms", "loop ms", "whole-vmap ms"} for the sweep line chart."""
    rows = []
    for r in reports:
        h = headline(r.get("report"))
        row = {"N": float(r.get("n", 0))}
        row.update({k: h[k] for k in ("staged ms", "loop ms", "whole-vmap ms") if k in h})
        rows.append(row)
    return rows
