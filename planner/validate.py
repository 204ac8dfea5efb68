"""Plan invariants against a graph: partition, convexity, acyclic stage graph.

`validate(plan, graph)` is called at the end of every edit and by the executor;
the helpers here are also what edits use to explain a refusal (the offending path).
"""
from __future__ import annotations

from typing import Iterable, Optional

import networkx as nx

from stagewise.planner.errors import PlanMismatchError
from stagewise.planner.graph import ModelGraph
from stagewise.planner.plan import Plan, Stage, StageMode


def convexity_violation(graph: ModelGraph, nodes: Iterable[str]) -> Optional[list[str]]:
    """A path u -> x ... -> v with u, v in `nodes` and x outside, or None when convex."""
    inside = set(nodes)
    dag = graph.dag
    # nodes reachable from the set by leaving it at least once
    outside_frontier = {s for u in inside for s in dag.successors(u) if s not in inside}
    reach_out: dict[str, str] = {}  # outside node -> predecessor on a path from the set
    stack = list(outside_frontier)
    for s in outside_frontier:
        reach_out[s] = next(u for u in dag.predecessors(s) if u in inside)
    while stack:
        x = stack.pop()
        for y in dag.successors(x):
            if y in inside:
                # reconstruct: ... -> x -> y
                path = [y, x]
                while path[-1] in reach_out and path[-1] not in inside:
                    path.append(reach_out[path[-1]])
                return list(reversed(path))
            if y not in reach_out:
                reach_out[y] = x
                stack.append(y)
    return None


def stage_graph(plan: Plan, graph: ModelGraph) -> nx.DiGraph:
    """The quotient DAG: one node per stage id, an edge where a value crosses stages."""
    owner = {n: s.id for s in plan.stages for n in s.nodes}
    q = nx.DiGraph()
    q.add_nodes_from(s.id for s in plan.stages)
    for u, v in graph.dag.edges:
        su, sv = owner.get(u), owner.get(v)
        if su is not None and sv is not None and su != sv:
            q.add_edge(su, sv)
    return q


def renumber(plan_stages: Iterable[Stage], graph: ModelGraph) -> list[Stage]:
    """Give stages ids s0, s1, ... in topological order of the stage graph (ties by first node).

    Raises PlanMismatchError naming the stages (or their first nodes) when the stage graph has a cycle.
    """
    stages = list(plan_stages)
    owner = {n: i for i, s in enumerate(stages) for n in s.nodes}
    q = nx.DiGraph()
    q.add_nodes_from(range(len(stages)))
    for u, v in graph.dag.edges:
        if u in owner and v in owner and owner[u] != owner[v]:
            q.add_edge(owner[u], owner[v])
    first = [min(graph.topo_index(n) for n in s.nodes) for s in stages]
    try:
        order = list(nx.lexicographical_topological_sort(q, key=lambda i: first[i]))
    except nx.NetworkXUnfeasible:
        loop = [u for u, _ in nx.find_cycle(q)]
        named = [f"[{stages[i].id or stages[i].nodes[0]}{', ...' if not stages[i].id and len(stages[i].nodes) > 1 else ''}]" for i in loop]
        raise PlanMismatchError(
            f"the stages would feed each other in a cycle {' -> '.join(named + named[:1])}; "
            "merge the stages on the cycle, or split elsewhere"
        ) from None
    out = []
    for new_id, i in enumerate(order):
        s = stages[i]
        nodes = tuple(sorted(s.nodes, key=graph.topo_index))
        out.append(Stage(id=f"s{new_id}", nodes=nodes, mode=s.mode, reason=s.reason, options=s.options))
    return out


def validate(plan: Plan, graph: ModelGraph) -> Plan:
    """Check the plan fits the graph; returns it unchanged or raises PlanMismatchError.

    Checks: same opened modules and fingerprint, input names, every compute node in exactly one stage,
    no unknown nodes, each stage convex, the stage graph acyclic, batched stages
    hold only batchable nodes.
    """
    if tuple(plan.opened_modules) != tuple(graph.opened_modules):
        raise PlanMismatchError(
            f"the plan opens modules {list(plan.opened_modules)} but the model was traced opening {list(graph.opened_modules)}; "
            "trace it with planner.trace(..., open_modules=plan.opened_modules)"
        )
    if plan.fingerprint != graph.fingerprint:
        raise PlanMismatchError(
            f"plan fingerprint {plan.fingerprint} does not match the model's {graph.fingerprint}: "
            "the plan was made for another model or architecture; re-plan with `stagewise plan`"
        )
    if [i.name for i in plan.inputs] != graph.input_names:
        raise PlanMismatchError(f"plan inputs {[i.name for i in plan.inputs]} differ from the model's {graph.input_names}; re-plan")
    compute = graph.compute_nodes
    known = set(compute)
    seen: dict[str, str] = {}
    for s in plan.stages:
        for n in s.nodes:
            if n not in known:
                raise PlanMismatchError(f"stage {s.id} names node {n!r}, which the graph does not have (or is an input/output); re-plan")
            if n in seen:
                raise PlanMismatchError(f"node {n!r} is in two stages ({seen[n]} and {s.id}); every node belongs to exactly one stage: "
                                       "remove it from one of them or re-plan")
            seen[n] = s.id
    missing = [n for n in compute if n not in seen]
    if missing:
        raise PlanMismatchError(f"nodes {missing[:5]} are in no stage; every node belongs to exactly one stage, re-plan")
    for s in plan.stages:
        path = convexity_violation(graph, s.nodes)
        if path:
            raise PlanMismatchError(f"stage {s.id} is not convex: path {' -> '.join(path)} leaves it and comes back; "
                                   "add the nodes on that path to the stage, or split it there")
        if s.mode is StageMode.BATCHED:
            bad = [n for n in s.nodes if not graph.dag.nodes[n]["batchable"]]
            if bad:
                raise PlanMismatchError(f"batched stage {s.id} holds {bad[0]!r}, which cannot be batched: {graph.dag.nodes[bad[0]]['reason']}; "
                                       f"exclude({bad[0]!r}) or mark the stage excluded")
    q = stage_graph(plan, graph)
    if not nx.is_directed_acyclic_graph(q):
        cycle = nx.find_cycle(q)
        raise PlanMismatchError(f"stage graph has a cycle {' -> '.join(u for u, _ in cycle)} -> {cycle[0][0]}; "
                                "merge the stages on the cycle, or re-plan")
    return plan
