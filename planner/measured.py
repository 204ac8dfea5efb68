"""Measured stage times out of a profile report's JSON (executor.ProfileReport.to_json), as the planner reads them.

The planner cannot import the executor, so this reads the plain JSON every reader relies on
(see plan._profile_problem): "stages": [{"id", "strategy", "nodes", "result": {"ok", "time":
{"median_ms", ...}}}], optionally "plan": the profiled plan's JSON. Times are milliseconds.
The app (profile_view) and plan diffs (planner.diff) both use it.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from stagewise.planner.plan import Plan

Report = Mapping[str, Any]


def result_ms(result: Optional[Mapping[str, Any]]) -> Optional[float]:
    """Median ms of one StrategyResult, None when it did not run or failed."""
    if not result or not result.get("ok") or not result.get("time"):
        return None
    ms = result["time"].get("median_ms")
    return float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None


def stage_times(report: Report | None) -> dict[str, float]:
    """{stage id: median ms of the plan's strategy}; {} when there is no report."""
    out = {}
    for s in (report or {}).get("stages", []) or []:
        ms = result_ms(s.get("result"))
        if ms is not None:
            out[str(s["id"])] = ms
    return out


def _measured_as(report: Report, times: Mapping[str, float]) -> dict[tuple[tuple[str, ...], str], float]:
    """{(nodes, strategy): ms} of the stages `report` measured.

    The nodes and strategy come from the profiled plan (report["plan"]) when the report carries it,
    else from the report's own stage entries (`stagewise profile -o` stores the report inside the
    profiled plan without a copy of it); their strategy label "vmap/chunk=4" names the strategy "vmap".
    """
    profiled = report.get("plan")
    if profiled:
        entries = [(s.get("id"), s.get("nodes"), (s.get("options") or {}).get("strategy", "vmap"))
                   for s in profiled.get("stages", []) or [] if isinstance(s, Mapping)]
    else:
        entries = [(s.get("id"), s.get("nodes"), str(s.get("strategy") or "").split("/")[0])
                   for s in report.get("stages", []) or [] if isinstance(s, Mapping)]
    return {(tuple(nodes), strategy): times[sid] for sid, nodes, strategy in entries
            if sid in times and isinstance(nodes, list) and nodes}


def measured_stage_times(plan: Plan, report: Report | None) -> dict[str, float]:
    """{stage id of `plan`: median ms} for the stages of `plan` that `report` measured as they are.

    `report` is typically `plan.profile`. Its stage ids name the stages of the plan it profiled,
    which may differ from `plan` (an autotuned merge, an edit since): a time counts only for a
    stage with the same nodes and strategy there, so a merged stage's time never lands on a smaller
    stage. A report that records neither its plan nor its stages' nodes matches nothing.
    """
    if not report:
        return {}
    by_nodes = _measured_as(report, stage_times(report))
    out = {}
    for stage in plan.stages:
        ms = by_nodes.get((tuple(stage.nodes), stage.options.strategy.value))
        if ms is not None:
            out[stage.id] = ms
    return out
