"""Plan invariants against a graph: partition, convexity, acyclic stage graph.

`validate(plan, graph)` is called at the end of every edit and by the executor;
the helpers here are also what edits use to explain a refusal (the offending path).
"""
from __future__ import annotations

import copy
import types
from dataclasses import replace
from typing import Any, Iterable, Optional

import networkx as nx
import torch

from stagewise.planner.capability import (DEFAULT_CHECK, autocast_region_check, chain, cond_check, inplace_buffer_check,
                                          norm_stats_view_check, stateful_module_check, unowned_write_check)
from stagewise.planner.errors import PlanMismatchError, TraceError
from stagewise.planner.graph import ModelGraph, _cuda_devices, _run_and_record
from stagewise.planner.plan import Plan, Stage, StageMode, Strategy


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


# the capability checks that read the graph alone (no example values, no vmap run): cheap enough for every build
STRUCTURAL_CHECK = chain(autocast_region_check, cond_check, stateful_module_check, inplace_buffer_check, norm_stats_view_check,
                         unowned_write_check)
# parts of a reason where vmap still runs the node as each member does: its slow per-member fallback, a write into
# whole stacked buffers (BatchNorm's own in training too), random draws (each member its own). What a batched stage
# may hold at build (and what compile takes on an excluded stage, with an exclusion by hand)
VMAP_RUNS_RIGHT = ("slow per-member loop", "in-place update of buffer", "randomness in")
_READS_REASON = (Strategy.COMPILE, Strategy.WIDE)  # strategies that judge an excluded stage by its reason
_COMPUTES = ("call_module", "call_function", "call_method")


def _fresh_values(graph: ModelGraph, example: tuple | None) -> tuple[Any, dict] | None:
    """(a copy of graph.gm, each node's value on `example`) for the value-dependent checks, or None where the graph
    cannot be run here (no example inputs, or it fails on the plan's zero inputs): the structural checks then judge
    alone. A copy: the vmap probe runs the graph's modules, which build's stage modules are made from."""
    if example is None:
        return None
    gm = copy.deepcopy(graph.gm)
    try:
        with torch.random.fork_rng(devices=_cuda_devices(gm)):  # (dropout in training draws: the caller's state stays)
            values, _ = _run_and_record(gm, tuple(example))
    except TraceError:  # zero inputs it cannot run on (the plan keeps shapes, not values): judged by structure alone
        return None
    return gm, values


def with_fresh_verdicts(plan: Plan, graph: ModelGraph, example: tuple | None = None) -> Plan:
    """`plan` judged by the capability verdicts of `graph`, a fresh trace of the members it is built for (build's
    retrace, which holds no verdicts of its own), instead of the verdicts its file recorded when it was planned.

    The same fingerprint does not mean the same verdicts: constants are not part of it (`F.batch_norm(...,
    training=self.training)` of members planned in eval and built in training updates statistics the plan says it
    does not), and a plan file's `reason` may be edited by hand. So:
      - an excluded stage whose strategy reads its reason (compile, wide) gets as reason its stored one joined
        ("; ") with every reason the fresh graph gives its nodes (structure, and the vmap probe where the graph runs
        on the plan's example inputs): a stored reason counts only where the fresh graph agrees, and a stage
        excluded by hand whose nodes the fresh graph finds unsafe is judged unsafe;
      - a batched stage (any strategy but the loop) holding a node the fresh graph's structure says vmap cannot run
        as each member does (not VMAP_RUNS_RIGHT) is refused.
    Args:
        plan: a plan `validate(plan, graph)` accepted.
        graph: the fresh trace (its gm not yet edited by build).
        example: one member's example inputs (the plan's traced shapes), or None.
    Returns:
        `plan`, or a copy whose excluded stages' reasons hold the fresh verdicts.
    Raises:
        PlanMismatchError naming the batched stage, the node, the fresh reason and the fix.
    """
    judged = [s for s in plan.stages if s.options.strategy is not Strategy.LOOP
              and (s.mode is StageMode.BATCHED or s.options.strategy in _READS_REASON)]
    if not judged:
        return plan
    by_value = any(s.mode is StageMode.EXCLUDED for s in judged)
    fresh = _fresh_values(graph, example) if by_value else None
    gm, values = fresh if fresh is not None else (graph.gm, {})
    view = types.SimpleNamespace(gm=gm, example_values=values)  # the checks' caches land here, not on the graph
    shaped = gm.meta.pop("stagewise_value_shaped", None)  # (value_shape_check caches on the gm itself)
    nodes = {n.name: n for n in gm.graph.nodes}
    stages = list(plan.stages)
    try:
        for i, s in enumerate(stages):
            if s not in judged:
                continue
            full = s.mode is StageMode.EXCLUDED and fresh is not None
            check = DEFAULT_CHECK if full else STRUCTURAL_CHECK
            reasons = {n: check(view, nodes[n]) for n in s.nodes if nodes[n].op in _COMPUTES}
            reasons = {n: r for n, r in reasons.items() if r}
            if s.mode is StageMode.BATCHED:
                bad = [n for n, r in reasons.items() if not any(ok in r for ok in VMAP_RUNS_RIGHT)]
                if bad:
                    raise PlanMismatchError(
                        f"batched stage {s.id} holds {bad[0]!r}, which these members' graph says vmap cannot run as each "
                        f"member does: {reasons[bad[0]]}. The plan was made from members that traced otherwise (another "
                        "training mode, another constant in forward(): the fingerprint does not hold those); re-plan "
                        f"from these members (planner.trace, planner.propose), or exclude({bad[0]!r})")
                continue
            reason = s.reason
            for r in dict.fromkeys(reasons.values()):  # (a reason may hold "; " itself: appended whole, once)
                reason = f"{reason}; {r}" if reason and r not in reason else reason or r
            if reason != s.reason:
                stages[i] = replace(s, reason=reason)
    finally:
        gm.meta.pop("stagewise_value_shaped", None)
        if shaped is not None:
            gm.meta["stagewise_value_shaped"] = shaped
    return plan if stages == list(plan.stages) else replace(plan, stages=tuple(stages))
