"""Plan edits driven by a selection of node names and stage ids. No streamlit here.

Each action returns (label, new plan) or raises the library's StagewiseError;
multi-step actions (merging three stages) are all-or-nothing because plans are
frozen and the original is simply kept on error. Stage ids are renumbered by
the planner after an edit, so steps track stages by one of their nodes.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from stagewise import planner
from stagewise.planner.errors import EditError
from stagewise.planner.plan import Plan, StageMode, Strategy
from stagewise.planner.table import plural

FRAGMENT_LIMIT = 2  # carving one node out leaves up to 3 stages of 1: more new stages than this is fragmenting


def split_selection(plan: Plan, selection: Iterable[str]) -> tuple[list[str], list[str]]:
    """(stage ids, node names) named in a selection; a name that is both resolves to the stage."""
    stage_ids = {s.id for s in plan.stages}
    stages, nodes = [], []
    for item in selection:
        (stages if item in stage_ids else nodes).append(item)
    return stages, nodes


def stage_of_node(plan: Plan, node: str) -> str | None:
    """Id of the stage holding `node`; None for inputs, the output and unknown names."""
    for s in plan.stages:
        if node in s.nodes:
            return s.id
    return None


def stages_touched(plan: Plan, selection: Iterable[str]) -> list[str]:
    """Ids of every stage named or holding a named node, in plan order (inputs/outputs touch none)."""
    stages, nodes = split_selection(plan, selection)
    touched = set(stages) | {stage_of_node(plan, n) for n in nodes}
    return [s.id for s in plan.stages if s.id in touched]


def _anchor(plan: Plan, stage_id: str) -> str:
    """A node that identifies this stage across renumbering."""
    return plan.stage(stage_id).nodes[0]


def merge_selected(plan: Plan, graph: Any, selection: Sequence[str]) -> tuple[str, Plan]:
    """Merge every stage touched by the selection into one, folding them in plan (topological) order."""
    ids = stages_touched(plan, selection)
    if len(ids) < 2:
        raise EditError(f"merge needs two or more stages; the selection touches {ids or 'none'}; "
                        "select nodes of at least two stages")
    anchors = [_anchor(plan, s) for s in ids]
    new = plan
    for a in anchors[1:]:
        new = planner.merge(new, graph, new.stage_of(anchors[0]).id, new.stage_of(a).id)
    return f"merge {'+'.join(ids)}", new


def split_selected(plan: Plan, graph: Any, selection: Sequence[str]) -> tuple[str, Plan]:
    """One node selected: split its stage before it. Several nodes of one stage: carve them out as a stage."""
    _, nodes = split_selection(plan, selection)
    nodes = [n for n in nodes if stage_of_node(plan, n) is not None]
    if not nodes:
        raise EditError("split needs a node: select the node where the stage should be cut (not a stage id)")
    owners = {plan.stage_of(n).id for n in nodes}
    if len(owners) > 1:
        raise EditError(f"split works inside one stage; the selected nodes are in {sorted(owners)}; "
                        "select nodes of a single stage")
    sid = owners.pop()
    at: str | list[str] = nodes[0] if len(nodes) == 1 else list(nodes)
    new = planner.split(plan, graph, sid, at=at)
    what = f"at {nodes[0]}" if len(nodes) == 1 else f"carving out {len(nodes)} nodes"
    return f"split {sid} {what}", new


def _mode_edit(plan: Plan, graph: Any, selection: Sequence[str], whole_stages: bool, fn: Any, verb: str) -> tuple[str, Plan]:
    stages, nodes = split_selection(plan, selection)
    nodes = [n for n in nodes if stage_of_node(plan, n) is not None]
    if whole_stages:
        targets = stages_touched(plan, selection)
        anchors = [_anchor(plan, s) for s in targets]
        label_items = targets
    else:
        targets, anchors, label_items = [], list(nodes), list(nodes)
        anchors += [_anchor(plan, s) for s in stages]
        label_items += stages
    if not anchors:
        raise EditError(f"{verb} needs a selection; click nodes in the graph or pick stage ids above")
    new = plan
    for i, a in enumerate(anchors):
        whole = whole_stages or i >= len(nodes)
        new = fn(new, graph, new.stage_of(a).id if whole else a)
    return f"{verb} {', '.join(label_items)}", new


def exclude_selected(plan: Plan, graph: Any, selection: Sequence[str], whole_stages: bool = True) -> tuple[str, Plan]:
    """Exclude the touched stages (or, with whole_stages=False, just the selected nodes) from batching.

    Selected nodes of one stage are carved out together as one excluded stage where that
    split is legal (a collapsed module's nodes become one stage, not one stage each); a
    single node, or a group that cannot be split off, is carved out node by node.
    """
    if whole_stages:
        targets = stages_touched(plan, selection)
        done = [sid for sid in targets if not _excludable(plan.stage(sid))]
        if targets and len(done) == len(targets):
            raise EditError(f"exclude: {', '.join(done)} {'is' if len(done) == 1 else 'are'} excluded already "
                            "and run as the member loop; Include batches a stage again")
        return _mode_edit(plan, graph, [sid for sid in targets if sid not in done] or selection, True,
                          planner.exclude, "exclude")
    stages, nodes = split_selection(plan, selection)
    nodes = [n for n in nodes if stage_of_node(plan, n) is not None]
    if not stages and not nodes:
        raise EditError("exclude needs a selection; click nodes in the graph or pick stage ids above")
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(_anchor(plan, stage_of_node(plan, n)), []).append(n)
    new = plan
    for anchor, group in groups.items():
        sid = new.stage_of(anchor).id
        if len(group) > 1 and len(group) < len(new.stage(sid).nodes):
            try:
                carved = planner.split(new, graph, sid, at=group)
                new = planner.exclude(carved, graph, carved.stage_of(group[0]).id)
                continue
            except EditError:  # not a convex part: carve node by node below
                pass
        if len(group) == len(new.stage(sid).nodes):
            new = planner.exclude(new, graph, sid) if _excludable(new.stage(sid)) else new
            continue
        for n in group:
            new = planner.exclude(new, graph, n) if _excludable(new.stage_of(n)) else new
    for sid in stages:
        s = new.stage_of(_anchor(plan, sid))
        new = planner.exclude(new, graph, s.id) if _excludable(s) else new
    if new == plan:
        named = nodes + stages
        raise EditError(f"exclude: {', '.join(named)} {'is' if len(named) == 1 else 'are'} excluded already "
                        "and run as the member loop; Include batches a stage again")
    return f"exclude {', '.join(nodes + stages)}", new


def _excludable(stage: Any) -> bool:
    """Whether exclude changes the stage: it is batched, or excluded but still runs batched (wide, compile)."""
    return stage.mode is StageMode.BATCHED or stage.runs_batched


def looped_nodes(old: Plan, new: Plan) -> list[str]:
    """Nodes that run batched in `old` and as a member loop in `new`, in `new`'s stage order."""
    batched = {n for s in old.stages if s.runs_batched for n in s.nodes}
    return [n for s in new.stages if not s.runs_batched for n in s.nodes if n in batched]


def edit_warnings(kind: str, old: Plan, new: Plan) -> list[str]:
    """What an edit does that the user may not expect: batched nodes turned into a loop, a stage cut in many.

    Exclude is asked to loop nodes, so only merge and the others warn about that.
    """
    out = []
    looped = looped_nodes(old, new)
    if looped and kind != "exclude":
        out.append(f"{kind} turns {plural(len(looped), 'batched node')} into a member loop "
                   f"({', '.join(looped[:5])}{' …' if len(looped) > 5 else ''}): a stage holding an excluded node "
                   "runs every node as a loop over members")
    extra = len(new.stages) - len(old.stages)
    if extra > FRAGMENT_LIMIT:
        small = sum(len(s.nodes) == 1 for s in new.stages) - sum(len(s.nodes) == 1 for s in old.stages)
        out.append(f"{kind} turns {plural(len(old.stages), 'stage')} into {len(new.stages)} "
                   f"({plural(max(small, 0), 'new one-node stage')}): each stage boundary costs a hand-over between calls")
    return out


def alternative(kind: str, plan: Plan, graph: Any, selection: Sequence[str]) -> tuple[str, tuple[str, Plan]] | None:
    """A gentler edit to offer beside a warned one: (button label, (history label, plan)), or None."""
    if kind == "merge":
        # stages that may run under vmap: merged they stay one batched stage (an excluded stage that runs wide
        # would make the merge a loop again)
        batched = [sid for sid in stages_touched(plan, selection) if plan.stage(sid).mode is StageMode.BATCHED]
        if len(batched) >= 2:
            try:
                return f"Merge only the batched stages {'+'.join(batched)}", merge_selected(plan, graph, batched)
            except EditError:
                return None
    if kind == "exclude":
        try:
            return "Exclude the whole stages instead", exclude_selected(plan, graph, selection, True)
        except EditError:
            return None
    return None


def include_selected(plan: Plan, graph: Any, selection: Sequence[str]) -> tuple[str, Plan]:
    """Batch every touched stage again (the planner includes whole stages only)."""
    return _mode_edit(plan, graph, selection, True, planner.include, "include")


def set_options_selected(plan: Plan, graph: Any, selection: Sequence[str], strategy: Strategy | str,
                         chunk_size: int | None) -> tuple[str, Plan]:
    """Set strategy and chunk size on every touched stage (planner.set_options, which refuses what cannot run)."""
    ids = stages_touched(plan, selection)
    if not ids:
        raise EditError("select a stage (or one of its nodes) to set its strategy")
    new = plan
    for sid in ids:
        new = planner.set_options(new, graph, sid, strategy=Strategy(strategy), chunk_size=chunk_size, note="set in the app")
    return f"strategy {Strategy(strategy).value} on {', '.join(ids)}", new
