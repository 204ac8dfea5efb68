"""Plan edits: pure functions returning a new, validated Plan.

A refused edit raises EditError naming the stages and the offending path and
saying what to do instead; the plan passed in is frozen and so never changes.
Stage ids are renumbered s0, s1, ... in topological order after every edit.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import networkx as nx

from stagewise.planner.errors import EditError, PlanMismatchError
from stagewise.planner.graph import ModelGraph
from stagewise.planner.plan import Plan, Stage, StageMode, StageOptions, Strategy, dtype_problem
from stagewise.planner.validate import convexity_violation, renumber, validate

USER_EXCLUDED = "excluded by user"
# The note of a node carved out of its stage by exclude(node): include() merges such a stage back into
# its batched neighbours, so exclude-then-include of one node restores the stage it came from.
CARVED_NOTE = "carved out of its stage by exclude; include merges it back"


def _finish(plan: Plan, graph: ModelGraph, stages: Iterable[Stage], what: str) -> Plan:
    try:
        return validate(plan.with_stages(renumber(stages, graph)), graph)
    except PlanMismatchError as e:
        raise EditError(f"{what}: refused, the result would be invalid: {e}") from None


def _check_graph(plan: Plan, graph: ModelGraph, what: str) -> None:
    if plan.fingerprint != graph.fingerprint:
        raise EditError(f"{what}: the plan (fingerprint {plan.fingerprint}) is for another graph ({graph.fingerprint}); load the matching model")


def _path_in_stages(plan: Plan, path: list[str]) -> str:
    """'s1 -> s2 -> s3' for a node path, collapsing consecutive nodes of one stage."""
    ids: list[str] = []
    for n in path:
        sid = plan.stage_of(n).id if graph_has(plan, n) else n
        if not ids or ids[-1] != sid:
            ids.append(sid)
    return " -> ".join(ids)


def graph_has(plan: Plan, node: str) -> bool:
    return any(node in s.nodes for s in plan.stages)


def merge(plan: Plan, graph: ModelGraph, a: str, b: str) -> Plan:
    """Merge stages `a` and `b` into one.

    Two batched stages stay batched (keeping `a`'s options); if either is
    excluded the merged stage is excluded (run as a loop). Refused when some path
    leaves the union and comes back (the stage graph would get a cycle).
    """
    what = f"merge({a!r}, {b!r})"
    _check_graph(plan, graph, what)
    sa, sb = _stage_or_edit_error(plan, a, what), _stage_or_edit_error(plan, b, what)
    if sa.id == sb.id:
        raise EditError(f"{what}: a stage cannot be merged with itself; pick two different stages")
    union = sa.nodes + sb.nodes
    path = convexity_violation(graph, union)
    if path:
        via = [plan.stage_of(n).id for n in path[1:-1]]
        via = list(dict.fromkeys(v for v in via if v not in (sa.id, sb.id)))
        raise EditError(
            f"{what}: would create a cycle {_path_in_stages(plan, path)} (nodes {' -> '.join(path)}); "
            f"merge {', '.join(via)} into them as well, or split {via[0]} first"
        )
    if sa.mode is StageMode.BATCHED and sb.mode is StageMode.BATCHED:
        merged = Stage(id="", nodes=union, mode=StageMode.BATCHED, options=sa.options)
    else:
        reasons = "; ".join(dict.fromkeys(r for r in (sa.reason, sb.reason) if r))
        merged = Stage(id="", nodes=union, mode=StageMode.EXCLUDED, reason=reasons or USER_EXCLUDED)
    rest = [s for s in plan.stages if s.id not in (sa.id, sb.id)]
    return _finish(plan, graph, rest + [merged], what)


def split(plan: Plan, graph: ModelGraph, stage: str, at: str | Iterable[str]) -> Plan:
    """Split `stage` in two.

    `at` a node name: the nodes before it (graph order) form one stage, it and
    the nodes after it the other; such a split is always convex.
    `at` a collection of node names: those nodes become a stage of their own;
    refused when either part would not be convex, or when values would flow
    both ways between the parts (a cycle of two stages).
    """
    what = f"split({stage!r}, at={at!r})"
    _check_graph(plan, graph, what)
    s = _stage_or_edit_error(plan, stage, what)
    if isinstance(at, str):
        if at not in s.nodes:
            raise EditError(f"{what}: node {at!r} is not in stage {s.id}; pick one of {list(s.nodes)[:8]}")
        cut = graph.topo_index(at)
        first = tuple(n for n in s.nodes if graph.topo_index(n) < cut)
        second = tuple(n for n in s.nodes if graph.topo_index(n) >= cut)
        if not first:
            raise EditError(f"{what}: {at!r} is the first node of {s.id}, nothing comes before it; pick a later node")
    else:
        chosen = set(at)
        stray = sorted(chosen - set(s.nodes))
        if stray:
            raise EditError(f"{what}: nodes {stray} are not in stage {s.id}; select nodes of one stage")
        first = tuple(n for n in s.nodes if n in chosen)
        second = tuple(n for n in s.nodes if n not in chosen)
        if not first or not second:
            raise EditError(f"{what}: select some but not all nodes of {s.id} to split it")
        for part in (first, second):
            path = convexity_violation(graph, part)
            if path:
                raise EditError(
                    f"{what}: the part {list(part)[:4]}{'...' if len(part) > 4 else ''} would not be convex: "
                    f"path {' -> '.join(path)} leaves it and comes back; include the nodes on that path in the selection, "
                    "or split at a single node instead"
                )
        forward = _edge_between(graph, first, second)
        backward = _edge_between(graph, second, first)
        if forward and backward:
            raise EditError(
                f"{what}: the two parts would feed each other ({forward[0]} -> {forward[1]} and {backward[0]} -> {backward[1]}), "
                "a cycle between the stages; add nodes to the selection so values flow one way, or split at a single node instead"
            )
    parts = [replace(s, nodes=first), replace(s, nodes=second)]
    return _finish(plan, graph, [x for x in plan.stages if x.id != s.id] + parts, what)


def exclude(plan: Plan, graph: ModelGraph, target: str) -> Plan:
    """Run a stage as a member loop, or carve one node out into an excluded stage of its own.

    Carving node n out of stage S leaves up to two stages: the nodes of S that are
    not downstream of n, and those that are (both convex, see the module tests).
    An excluded stage that still runs batched (an attention or GRU stage proposed as
    `wide`, or one autotune set to wide/compile) is set to the member loop, keeping why
    it is excluded: "exclude the stage to make it the loop" is what the README promises.
    """
    what = f"exclude({target!r})"
    _check_graph(plan, graph, what)
    if any(s.id == target for s in plan.stages):
        s = plan.stage(target)
        if s.mode is StageMode.EXCLUDED and s.runs_batched:
            new = replace(s, options=StageOptions(strategy=Strategy.LOOP))
            return _finish(plan, graph, [new if x.id == s.id else x for x in plan.stages], what)
        if s.mode is StageMode.EXCLUDED:
            batchable = all(graph.dag.nodes[n]["batchable"] for n in s.nodes)
            raise EditError(f"{what}: stage {s.id} is already excluded and runs as the member loop"
                            + (f"; include({s.id!r}) batches it again" if batchable else ""))
        new = replace(s, mode=StageMode.EXCLUDED, reason=USER_EXCLUDED, options=StageOptions(strategy=Strategy.LOOP))
        return _finish(plan, graph, [new if x.id == s.id else x for x in plan.stages], what)
    if not graph_has(plan, target):
        raise EditError(f"{what}: no stage or node named {target!r}; stages are {[s.id for s in plan.stages]}")
    s = plan.stage_of(target)
    if len(s.nodes) == 1:
        return exclude(plan, graph, s.id)
    downstream = nx.descendants(graph.dag, target)
    before = tuple(n for n in s.nodes if n != target and n not in downstream)
    after = tuple(n for n in s.nodes if n in downstream)
    reason = graph.dag.nodes[target]["reason"] or USER_EXCLUDED
    carved = Stage(id="", nodes=(target,), mode=StageMode.EXCLUDED, reason=reason,
                   options=StageOptions(strategy=Strategy.LOOP, note=CARVED_NOTE, carved_from=before + after,
                                        carved_options=replace(s.options, carved_from=(), carved_options=None)))
    parts = [replace(s, nodes=p) for p in (before, after) if p] + [carved]
    return _finish(plan, graph, [x for x in plan.stages if x.id != s.id] + parts, what)


def include(plan: Plan, graph: ModelGraph, stage: str) -> Plan:
    """Run an excluded stage batched again; refused if one of its nodes cannot be batched.

    A stage that exclude(node) carved out of a batched stage (note CARVED_NOTE) is merged
    back into the batched stages next to it wherever the union stays convex, taking their
    options: exclude then include of one node gives back the stage it came from.
    """
    what = f"include({stage!r})"
    _check_graph(plan, graph, what)
    s = _stage_or_edit_error(plan, stage, what)
    if s.mode is StageMode.BATCHED:
        raise EditError(f"{what}: stage {s.id} is already batched")
    bad = [n for n in s.nodes if not graph.dag.nodes[n]["batchable"]]
    if bad:
        raise EditError(
            f"{what}: node {bad[0]!r} cannot be batched ({graph.dag.nodes[bad[0]]['reason']}); "
            f"carve it out with exclude({bad[0]!r}) and include the rest"
            if len(s.nodes) > 1 else f"{what}: node {bad[0]!r} cannot be batched ({graph.dag.nodes[bad[0]]['reason']})"
        )
    new = replace(s, mode=StageMode.BATCHED, reason="", options=StageOptions())
    rest = [x for x in plan.stages if x.id != s.id]
    if s.options.note == CARVED_NOTE:
        origin = set(s.options.carved_from)
        rest, new = _merge_into_neighbours(rest, graph, new, within=origin or None)
        if origin and s.options.carved_options is not None:
            new = replace(new, options=s.options.carved_options)  # the options of the stage it came from
    return _finish(plan, graph, rest + [new], what)


def _merge_into_neighbours(others: list[Stage], graph: ModelGraph, stage: Stage,
                           within: set[str] | None = None) -> tuple[list[Stage], Stage]:
    """Fold the batched stages adjacent to `stage` into it while the union stays convex; (the rest, the merged stage).
    `within`: only stages whose nodes all lie in it (what is left of the stage `stage` was carved out of)."""
    others = list(others)
    merged = stage
    grown = True
    while grown:
        grown = False
        for nb in others:
            if nb.mode is not StageMode.BATCHED or (within is not None and not set(nb.nodes) <= within):
                continue
            if not (_edge_between(graph, nb.nodes, merged.nodes) or _edge_between(graph, merged.nodes, nb.nodes)):
                continue
            union = tuple(sorted(nb.nodes + merged.nodes, key=graph.topo_index))
            if convexity_violation(graph, union):
                continue
            merged = Stage(id="", nodes=union, mode=StageMode.BATCHED, options=nb.options)
            others.remove(nb)
            grown = True
            break
    return others, merged


def set_options(plan: Plan, graph: ModelGraph, stage: str, **options) -> Plan:
    """Set a stage's options (strategy, chunk_size, note); unknown keys are refused."""
    what = f"set_options({stage!r})"
    _check_graph(plan, graph, what)
    s = _stage_or_edit_error(plan, stage, what)
    unknown = set(options) - set(StageOptions.__dataclass_fields__)
    if unknown:
        raise EditError(f"{what}: unknown options {sorted(unknown)}; known: {sorted(StageOptions.__dataclass_fields__)}")
    if "strategy" in options:
        try:
            options["strategy"] = Strategy(options["strategy"])
        except ValueError:
            raise EditError(f"{what}: unknown strategy {options['strategy']!r}; use one of {[x.value for x in Strategy]}") from None
        if s.mode is StageMode.EXCLUDED and options["strategy"] in (Strategy.VMAP, Strategy.CUDA_GRAPH):
            raise EditError(
                f"{what}: stage {s.id} is excluded ({s.reason}), so it cannot run under vmap; "
                "use loop or wide (compile too, unless the reason says vmap fails or computes otherwise there), or include it first"
            )
    chunk = options.get("chunk_size")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise EditError(f"{what}: chunk_size must be a positive integer or None, got {chunk!r}")
    new = replace(s, options=replace(s.options, **options))
    return _finish(plan, graph, [new if x.id == s.id else x for x in plan.stages], what)


def _stage_or_edit_error(plan: Plan, stage_id: str, what: str) -> Stage:
    for s in plan.stages:
        if s.id == stage_id:
            return s
    raise EditError(f"{what}: no stage {stage_id!r}; stages are {[s.id for s in plan.stages]}")


def _edge_between(graph: ModelGraph, src: Iterable[str], dst: Iterable[str]) -> tuple[str, str] | None:
    """Some DAG edge from a node of `src` to a node of `dst`, or None."""
    targets = set(dst)
    for u in src:
        for v in graph.dag.successors(u):
            if v in targets:
                return u, v
    return None


def set_dtype(plan: Plan, dtype: str) -> Plan:
    """The plan at precision `dtype` ("float32", "tf32", "bfloat16" or "float16"; see executor.build).

    Stages do not depend on the precision, so no graph is needed; the plan's profile is dropped
    (it was measured at the old precision). Raises EditError naming the value and the choices.
    """
    problem = dtype_problem(dtype)
    if problem:
        raise EditError(f"set_dtype: {problem}")
    return plan.with_dtype(dtype)


def set_capture(plan: Plan, on: bool = True) -> Plan:
    """The plan with whole-plan capture on (or off): built on a GPU, the batched module replays inference
    calls (eval mode, no gradients recorded) as CUDA graphs, the maximal runs of capturable stages
    (executor.capture); training and CPU run stage by stage. Raises EditError for a non-boolean."""
    if not isinstance(on, bool):
        raise EditError(f"set_capture: expected True or False, got {on!r}")
    return plan.with_capture(on)
