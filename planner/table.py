"""The stage table as plain rows (for the CLI and the app) and as text."""
from __future__ import annotations

from stagewise.planner.graph import ModelGraph
from stagewise.planner.plan import Plan, StageMode


def stage_rows(plan: Plan, graph: ModelGraph | None = None) -> list[dict]:
    """One plain dict per stage: id, mode, strategy, n_nodes, nodes, params, flops, reason."""
    rows = []
    for s in plan.stages:
        row = {
            "id": s.id,
            "mode": s.mode.value,  # "excluded" = excluded from vmap; how it runs is runs_as
            "strategy": s.options.strategy.value,  # an excluded stage runs loop, or wide/compile if autotuned so
            "runs_as": s.runs_as(),  # "batched (vmap)", "batched (wide)", ... or "member loop"
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


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 node', '3 nodes' ('1 member loop', '2 member loops')."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def plan_summary(plan: Plan) -> str:
    """'3 stages (2 batched, 1 member loop; 1 excluded from vmap)': how the stages run, then the planner's decision.

    Batched counts every stage run as one batched call (vmap, wide, compile, cuda_graph), an
    excluded stage that autotune runs `wide` included; member loops are the stages run per member.
    """
    stages = plan.stages
    batched = sum(s.runs_batched for s in stages)
    excluded = sum(s.mode is StageMode.EXCLUDED for s in stages)
    return (f"{plural(len(stages), 'stage')} ({batched} batched, {plural(len(stages) - batched, 'member loop')}; "
            f"{excluded} excluded from vmap)")


def human(n: float) -> str:
    """1234567 -> '1.2M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def format_stage_table(plan: Plan, graph: ModelGraph | None = None, nodes_width: int = 48) -> str:
    """The stage table as aligned text, with a header line about the plan."""
    rows = stage_rows(plan, graph)
    head = f"{'stage':<6} {'vmap':<9} {'runs as':<18} {'#':>3}  {'nodes':<{nodes_width}}"
    if graph is not None:
        head += f" {'params':>7} {'FLOPs':>7}"
    lines = [head + "  reason"]
    for r in rows:
        vmap = "excluded" if r["mode"] == StageMode.EXCLUDED.value else "ok"
        line = f"{r['id']:<6} {vmap:<9} {r['runs_as']:<18} {r['n_nodes']:>3}  {_short_nodes(r['nodes'], nodes_width):<{nodes_width}}"
        if graph is not None:
            line += f" {human(r['params']):>7} {human(r['flops']):>7}"
        lines.append(line + ("  " + r["reason"] if r["reason"] else ""))
    summary = (f"{plan_summary(plan)}, N={plan.n_members}, tracer={plan.tracer}, inputs: "
               + ", ".join(f"{i.name}={i.mode.value}" for i in plan.inputs)
               + (f", dtype={plan.dtype}" if plan.dtype != "float32" else "")  # float32 unless said
               + (", whole-plan capture on GPU" if plan.capture else ""))
    return "\n".join([summary, *lines])
