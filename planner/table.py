"""The stage table as plain rows (for the CLI and the app) and as text."""
from __future__ import annotations

from stagewise.planner.graph import ModelGraph
from stagewise.planner.plan import Plan


def stage_rows(plan: Plan, graph: ModelGraph | None = None) -> list[dict]:
    """One plain dict per stage: id, mode, strategy, n_nodes, nodes, params, flops, reason."""
    rows = []
    for s in plan.stages:
        row = {
            "id": s.id,
            "mode": s.mode.value,
            "strategy": s.options.strategy.value,  # an excluded stage runs loop, or wide/compile if autotuned so
            "n_nodes": len(s.nodes),
            "nodes": list(s.nodes),
            "reason": s.reason,
        }
        if graph is not None:
            row["params"] = sum(graph.dag.nodes[n]["params"] for n in s.nodes if n in graph.dag)
            row["flops"] = sum(graph.dag.nodes[n]["flops"] for n in s.nodes if n in graph.dag)
        rows.append(row)
    return rows


def _short_nodes(nodes: list[str], width: int) -> str:
    text = ", ".join(nodes)
    return text if len(text) <= width else text[: width - 4].rsplit(",", 1)[0] + ", ..."


def human(n: float) -> str:
    """1234567 -> '1.2M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def format_stage_table(plan: Plan, graph: ModelGraph | None = None, nodes_width: int = 48) -> str:
    """The stage table as aligned text, with a header line about the plan."""
    rows = stage_rows(plan, graph)
    head = f"{'stage':<6} {'mode':<9} {'strategy':<9} {'#':>3}  {'nodes':<{nodes_width}}"
    if graph is not None:
        head += f" {'params':>7} {'FLOPs':>7}"
    lines = [head + "  reason"]
    for r in rows:
        line = f"{r['id']:<6} {r['mode']:<9} {r['strategy']:<9} {r['n_nodes']:>3}  {_short_nodes(r['nodes'], nodes_width):<{nodes_width}}"
        if graph is not None:
            line += f" {human(r['params']):>7} {human(r['flops']):>7}"
        lines.append(line + ("  " + r["reason"] if r["reason"] else ""))
    batched = sum(1 for r in rows if r["mode"] == "batched")
    summary = (f"{len(rows)} stage{'s' if len(rows) != 1 else ''} ({batched} batched, {len(rows) - batched} excluded), "
               f"N={plan.n_members}, tracer={plan.tracer}, inputs: "
               + ", ".join(f"{i.name}={i.mode.value}" for i in plan.inputs))
    return "\n".join([summary, *lines])
