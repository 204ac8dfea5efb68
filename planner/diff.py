"""Plan diff: how two plans of one graph differ (before/after an edit, proposed vs tuned, two plan files).

`diff_plans(a, b)` matches stages by their nodes. Stages of `a` and `b` that share a node
belong to one group (a connected component of "shares a node"); a group is

- same:      one stage in each, the same nodes and options (its id may differ: ids are renumbered);
- changed:   one stage in each, the same nodes, but what runs differs: mode, strategy, chunk size, the wide
             conv form or the torch.compile mode (tags in the note), or the reason of an excluded stage run
             wide / compile (both read it);
- merged:    several stages of `a` became one stage of `b`;
- split:     one stage of `a` became several stages of `b`;
- regrouped: several stages on both sides (nodes moved between stages);
- added / removed: stages whose nodes only one plan holds (hand-edited files).

Plain data only (no graph needed): the CLI, the app and tests read `rows()`, `nodes` and `summary()`.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from stagewise.planner.errors import PlanMismatchError
from stagewise.planner.measured import measured_stage_times, result_ms
from stagewise.planner.plan import InputSpec, Plan, Stage, StageMode, StageOptions, Strategy
from stagewise.planner.table import plural


class ChangeKind(str, enum.Enum):
    """What happened to one group of stages between the two plans."""

    SAME = "same"
    CHANGED = "changed"  # same nodes, other mode / strategy / chunk size / conv form / compile mode / read reason
    MERGED = "merged"
    SPLIT = "split"
    REGROUPED = "regrouped"
    ADDED = "added"  # nodes only the second plan holds
    REMOVED = "removed"  # nodes only the first plan holds


@dataclass(frozen=True)
class FieldChange:
    """One setting that differs: `field` went from `old` to `new` (plain JSON values)."""

    # stage: "mode", "strategy", "chunk_size", "conv_form", "compile_mode", "reason"; plan level: "n_members", "dtype",
    # "tracer", "capture", "opened_modules", "input x" (its mode), "input x shape" / "dtype" / "dynamic dims" / "value"
    field: str
    old: Any
    new: Any

    def text(self) -> str:
        old, new = _show(self.field, self.old), _show(self.field, self.new)
        return f"{_FIELD_WORDS.get(self.field, self.field)} {old} → {new}"


_FIELD_WORDS = {"n_members": "N", "chunk_size": "chunk size", "conv_form": "conv form", "compile_mode": "compile mode",
                "opened_modules": "opened modules"}


@dataclass(frozen=True)
class StageChange:
    """One group of stages: `before` (ids in the first plan) became `after` (ids in the second)."""

    kind: ChangeKind
    before: tuple[str, ...]  # stage ids of plan a, in its order
    after: tuple[str, ...]  # stage ids of plan b, in its order
    nodes: tuple[str, ...]  # every node of the group, a's order first
    fields: tuple[FieldChange, ...]  # kind CHANGED: the options that differ; else ()
    runs_as_before: tuple[str, ...]  # Stage.runs_as() of each `before` stage
    runs_as_after: tuple[str, ...]
    before_ms: Optional[float]  # measured ms of the `before` stages together; None unless all were measured as they are
    after_ms: Optional[float]

    def details(self) -> str:
        """What changed, in a few words ("strategy vmap → wide", "3 stages → 1")."""
        if self.kind is ChangeKind.CHANGED:
            return ", ".join(f.text() for f in self.fields)
        if self.kind is ChangeKind.ADDED:
            return f"{plural(len(self.nodes), 'node')} only in the second plan"
        if self.kind is ChangeKind.REMOVED:
            return f"{plural(len(self.nodes), 'node')} only in the first plan"
        if self.kind is ChangeKind.SAME:
            return ""
        return f"{plural(len(self.before), 'stage')} → {len(self.after)}"


@dataclass(frozen=True)
class NodeChange:
    """Where one node sits in each plan (graph colouring)."""

    before: Optional[str]  # stage id in plan a, None when a does not hold the node
    after: Optional[str]
    mode_before: Optional[str]  # "batched" / "excluded"
    mode_after: Optional[str]
    changed: bool  # its group is not "same": the stage it runs in, or how, differs


@dataclass(frozen=True)
class PlanDiff:
    """What differs between plan a (before) and plan b (after) of one graph."""

    fingerprint: str
    n_members: int  # plan b's
    plan_changes: tuple[FieldChange, ...]  # n_members, dtype, tracer, capture, opened modules, input specs
    stages: tuple[StageChange, ...]  # one per group, in a's stage order (added groups last)
    nodes: Mapping[str, NodeChange]  # node name -> where it sits in each plan
    measured: bool  # either plan carries a profile
    end_to_end_ms: tuple[Optional[float], Optional[float]]  # each plan's profiled end-to-end ms, None when absent

    @property
    def identical(self) -> bool:
        """No setting and no stage differs (profiles are measurements, not part of the comparison)."""
        return not self.plan_changes and all(c.kind is ChangeKind.SAME for c in self.stages)

    def changed_nodes(self) -> list[str]:
        return [n for n, c in self.nodes.items() if c.changed]

    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per stage group: change, before, after, nodes, runs as before/after, ms before/after, details."""
        return [{
            "change": c.kind.value, "before": ", ".join(c.before), "after": ", ".join(c.after), "nodes": len(c.nodes),
            "runs as before": _runs(c.runs_as_before), "runs as after": _runs(c.runs_as_after),
            "before ms": c.before_ms, "after ms": c.after_ms, "details": c.details(),
        } for c in self.stages]

    def summary(self) -> str:
        """One paragraph: the plan-level changes, each stage change with its times, node mode changes, what stayed."""
        if self.identical:
            return f"The plans are identical: {plural(len(self.stages), 'stage')}, N={self.n_members}."
        parts = [f.text() for f in self.plan_changes]
        parts += [_stage_sentence(c) for c in self.stages if c.kind is not ChangeKind.SAME]
        parts += _mode_sentences(self.nodes.values())
        same = sum(c.kind is ChangeKind.SAME for c in self.stages)
        if same:
            parts.append(f"{plural(same, 'stage')} unchanged")
        before, after = self.end_to_end_ms
        if before is not None or after is not None:
            parts.append(f"end to end {_ms(before)} → {_ms(after)}")
        return "; ".join(parts) + "."

    def to_json(self) -> dict:
        """Plain JSON: identical, fingerprint, summary, plan_changes, stages (the rows), nodes."""
        return {
            "identical": self.identical, "fingerprint": self.fingerprint, "summary": self.summary(),
            "plan_changes": [{"field": f.field, "old": f.old, "new": f.new} for f in self.plan_changes],
            "stages": self.rows(),
            "nodes": {n: {"before": c.before, "after": c.after, "changed": c.changed} for n, c in self.nodes.items()},
            "end_to_end_ms": list(self.end_to_end_ms),
        }


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Compare plan `a` (before) with plan `b` (after) of the same graph.

    Returns a PlanDiff (see the module docstring for the kinds of change). Measured times come
    from each plan's own profile, for stages profiled as they are. Raises PlanMismatchError when
    the plans are for different graphs (their fingerprints differ).
    """
    if a.fingerprint != b.fingerprint:
        raise PlanMismatchError(
            f"cannot diff plans of different models: the first plan has fingerprint {a.fingerprint}"
            f"{_from(a)}, the second {b.fingerprint}{_from(b)}; diff two plans of the same model "
            "(re-plan the older one with `stagewise plan` if the model changed)")
    times_a, times_b = measured_stage_times(a, a.profile), measured_stage_times(b, b.profile)
    changes = [_classify(group_a, group_b, times_a, times_b) for group_a, group_b in _groups(a, b)]
    return PlanDiff(
        fingerprint=a.fingerprint, n_members=b.n_members, plan_changes=tuple(_plan_changes(a, b)), stages=tuple(changes),
        nodes=_node_changes(a, b, changes), measured=bool(a.profile or b.profile),
        end_to_end_ms=(_end_to_end(a), _end_to_end(b)),
    )


def _from(plan: Plan) -> str:
    return f" ({plan.model})" if plan.model else ""


def _groups(a: Plan, b: Plan) -> list[tuple[list[Stage], list[Stage]]]:
    """The stages of a and b in connected groups of "shares a node", in a's stage order (b-only groups last)."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def root(k: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    owner_b = {n: s.id for s in b.stages for n in s.nodes}
    for s in a.stages:
        for n in s.nodes:
            if n in owner_b:
                parent[root(("a", s.id))] = root(("b", owner_b[n]))
    groups: dict[tuple[str, str], tuple[list[Stage], list[Stage]]] = {}
    for side, plan in (("a", a), ("b", b)):
        for s in plan.stages:
            pair = groups.setdefault(root((side, s.id)), ([], []))
            pair[0 if side == "a" else 1].append(s)
    return list(groups.values())


def _classify(before: list[Stage], after: list[Stage], times_a: Mapping[str, float],
              times_b: Mapping[str, float]) -> StageChange:
    nodes = list(dict.fromkeys(n for s in before + after for n in s.nodes))
    fields: tuple[FieldChange, ...] = ()
    if not before:
        kind = ChangeKind.ADDED
    elif not after:
        kind = ChangeKind.REMOVED
    elif len(before) == 1 and len(after) == 1:
        fields = tuple(_stage_fields(before[0], after[0]))
        same_nodes = set(before[0].nodes) == set(after[0].nodes)
        kind = ChangeKind.REGROUPED if not same_nodes else ChangeKind.CHANGED if fields else ChangeKind.SAME
        fields = fields if same_nodes else ()
    elif len(after) == 1:
        kind = ChangeKind.MERGED
    elif len(before) == 1:
        kind = ChangeKind.SPLIT
    else:
        kind = ChangeKind.REGROUPED
    return StageChange(
        kind=kind, before=tuple(s.id for s in before), after=tuple(s.id for s in after), nodes=tuple(nodes),
        fields=fields, runs_as_before=tuple(s.runs_as() for s in before), runs_as_after=tuple(s.runs_as() for s in after),
        before_ms=_group_ms(before, times_a), after_ms=_group_ms(after, times_b),
    )


def _stage_fields(old: Stage, new: Stage) -> list[FieldChange]:
    """What differs in how the stage runs: its settings, the kernel choices its note records, the reason its
    strategy reads."""
    pairs = [("mode", old.mode.value, new.mode.value),
             ("strategy", old.options.strategy.value, new.options.strategy.value),
             ("chunk_size", old.options.chunk_size, new.options.chunk_size)]
    # a kernel choice counts where a strategy reads it; a stage starting or ending to run with the default one shows
    # only as the strategy change
    pairs += [(name, x, y) for name, x, y in (("conv_form", _conv_form(old.options), _conv_form(new.options)),
                                              ("compile_mode", _compile_mode(old.options), _compile_mode(new.options)))
              if {x, y} - {None, _DEFAULT}]
    # its reason's parts, in any order (merges join them with "; "), are what those strategies judge it by
    if old.mode is new.mode is StageMode.EXCLUDED and _READS_REASON & {old.options.strategy, new.options.strategy} \
            and set(old.reason.split("; ")) != set(new.reason.split("; ")):
        pairs.append(("reason", old.reason, new.reason))
    return [FieldChange(name, x, y) for name, x, y in pairs if x != y]


# The kernel choices a plan records as tags in a stage's options.note, matched as their readers match them
# (executor.strategies.wide.conv_form_of, executor.strategies.compiled.compile_mode_of: the planner does not import
# the executor). The note's other words (measured times) are not compared.
_CONV_FORM_TAG = re.compile(r"\[wide: conv=([a-z0-9_]+)\]")
_COMPILE_MODE_TAG = re.compile(r"\[compile: mode=([a-z-]+)\]")
_DEFAULT = "default"  # the tag's absence: the device's default conv form, torch.compile's default mode
# an excluded stage's strategies that read its reason (executor.strategies.wide._vmap_unsafe,
# executor.strategies.compiled.excluded_compile_refusal)
_READS_REASON = frozenset({Strategy.WIDE, Strategy.COMPILE})


def _conv_form(options: StageOptions) -> Optional[str]:
    """The wide conv form the stage's options record ("default" without one); None when the strategy is not wide."""
    if options.strategy is not Strategy.WIDE:
        return None
    variant = getattr(options, "variant", "") or ""  # a future StageOptions field conv_form_of reads first
    found = re.fullmatch(r"conv=([a-z0-9_]+)", variant) or _CONV_FORM_TAG.search(options.note)
    return found.group(1) if found else _DEFAULT


def _compile_mode(options: StageOptions) -> Optional[str]:
    """The torch.compile mode the stage's options record ("default" without one); None when the strategy is not compile."""
    if options.strategy is not Strategy.COMPILE:
        return None
    found = _COMPILE_MODE_TAG.search(options.note)
    return found.group(1) if found else _DEFAULT


def _group_ms(stages: Sequence[Stage], times: Mapping[str, float]) -> Optional[float]:
    """The stages' measured ms together; None when there are none or one was not measured as it is."""
    if not stages or any(s.id not in times for s in stages):
        return None
    return sum(times[s.id] for s in stages)


def _plan_changes(a: Plan, b: Plan) -> list[FieldChange]:
    """The plan-level settings that differ, then each input's: its mode, and for an input both plans hold, what the
    trace recorded of it (which calls are accepted, what build retraces with)."""
    out = [FieldChange(name, getattr(a, name), getattr(b, name)) for name in ("n_members", "dtype", "tracer", "capture")
           if getattr(a, name) != getattr(b, name)]
    if a.opened_modules != b.opened_modules:
        out.append(FieldChange("opened_modules", list(a.opened_modules), list(b.opened_modules)))
    specs_a = {i.name: i for i in a.inputs}
    specs_b = {i.name: i for i in b.inputs}
    for name in dict.fromkeys([*specs_a, *specs_b]):
        sa, sb = specs_a.get(name), specs_b.get(name)
        if (sa and sa.mode.value) != (sb and sb.mode.value):
            out.append(FieldChange(f"input {name}", sa and sa.mode.value, sb and sb.mode.value))
        if sa is not None and sb is not None:
            out += [FieldChange(f"input {name} {key}", x, y) for key, x, y in _spec_fields(sa, sb) if x != y]
    return out


def _spec_fields(a: InputSpec, b: InputSpec) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for what the trace recorded of one input, as plain JSON."""
    def shape(s: InputSpec) -> Optional[list[int]]:
        return list(s.shape) if s.shape is not None else None

    return [("shape", shape(a), shape(b)), ("dtype", a.dtype, b.dtype),
            ("dynamic dims", [d.to_json() for d in a.dynamic_dims], [d.to_json() for d in b.dynamic_dims]),
            ("value", a.value, b.value)]


def _node_changes(a: Plan, b: Plan, changes: Sequence[StageChange]) -> dict[str, NodeChange]:
    stage_a = {n: s for s in a.stages for n in s.nodes}
    stage_b = {n: s for s in b.stages for n in s.nodes}
    out = {}
    for c in changes:
        for n in c.nodes:
            sa, sb = stage_a.get(n), stage_b.get(n)
            out[n] = NodeChange(sa.id if sa else None, sb.id if sb else None, sa.mode.value if sa else None,
                                sb.mode.value if sb else None, changed=c.kind is not ChangeKind.SAME)
    return out


def _end_to_end(plan: Plan) -> Optional[float]:
    return result_ms((plan.profile or {}).get("end_to_end"))


# -- words ------------------------------------------------------------------------------------------


def _show(field: str, value: Any) -> str:
    """One side of a FieldChange in words."""
    if value is None:
        return "none"
    if field == "reason":
        return f'"{value}"'
    if field == "opened_modules" or field.endswith(" dynamic dims"):
        return ", ".join(_dim_words(v) if isinstance(v, Mapping) else str(v) for v in value) or "none"
    return str(value)


def _dim_words(d: Mapping[str, Any]) -> str:
    """A dynamic dim's JSON in words: "0", "2 (min 2, max 64, symbol d0)"."""
    extra = [f"{key.replace('_', ' ')} {', '.join(v) if isinstance(v, list) else v}"
             for key, v in d.items() if key != "dim"]
    return f"{d['dim']}" + (f" ({', '.join(extra)})" if extra else "")


def _ms(ms: Optional[float]) -> str:
    return "not measured" if ms is None else f"{ms:.3g} ms"


def _runs(runs_as: Sequence[str]) -> str:
    """'batched (vmap)' for stages that all run alike, else each one's, joined."""
    unique = list(dict.fromkeys(runs_as))
    return unique[0] if len(unique) == 1 else ", ".join(runs_as)


def _ids(ids: Sequence[str]) -> str:
    return ids[0] if len(ids) == 1 else ", ".join(ids[:-1]) + " and " + ids[-1]


def _stage_sentence(c: StageChange) -> str:
    """'s1 and s2 merged into s1', 's4 now runs wide (was vmap)', with the times when either plan measured them."""
    if c.kind is ChangeKind.CHANGED:
        name = c.before[0] if c.before == c.after else f"{c.before[0]} (now {c.after[0]})"
        words = []
        for f in c.fields:
            if f.field == "strategy":
                words.append(f"now runs {f.new} (was {f.old})")
            elif f.field == "mode":
                words.append(f"now {f.new} (was {f.old})")
            else:
                words.append(f.text())
        text = f"{name} " + ", ".join(words)
    elif c.kind is ChangeKind.MERGED:
        text = f"{_ids(c.before)} merged into {c.after[0]}"
    elif c.kind is ChangeKind.SPLIT:
        text = f"{c.before[0]} split into {_ids(c.after)}"
    elif c.kind is ChangeKind.REGROUPED:
        text = f"{_ids(c.before)} regrouped as {_ids(c.after)}"
    elif c.kind is ChangeKind.ADDED:
        text = f"new {_ids(c.after)} ({c.details()})"
    else:
        text = f"{_ids(c.before)} removed ({c.details()})"
    if c.before_ms is not None or c.after_ms is not None:
        text += f": {_ms(c.before_ms)} → {_ms(c.after_ms)}"
    return text


def _mode_sentences(nodes: Sequence[NodeChange]) -> list[str]:
    """'2 nodes now excluded from vmap (were batched)' and the other way round."""
    out = []
    for old, new, words in ((StageMode.BATCHED, StageMode.EXCLUDED, "now excluded from vmap"),
                            (StageMode.EXCLUDED, StageMode.BATCHED, "now batched")):
        n = sum(c.mode_before == old.value and c.mode_after == new.value for c in nodes)
        if n:
            out.append(f"{plural(n, 'node')} {words} ({'was' if n == 1 else 'were'} {old.value})")
    return out


def format_diff(diff: PlanDiff) -> str:
    """The diff as text: the summary, then one aligned line per stage group (the CLI prints it).

    Columns: change, before, after, # nodes, ms before → after (when either plan was profiled),
    details, and last (it can be long) how the stages run, before → after.
    """
    ms_head = "ms".ljust(32) if diff.measured else ""
    lines = [diff.summary(), "", f"{'change':<10} {'before':<12} {'after':<12} {'#':>3}  {ms_head}{'details':<24} runs as"]
    for r in diff.rows():
        same = r["runs as before"] == r["runs as after"]
        runs = r["runs as before"] if same else f"{r['runs as before'] or '-'} → {r['runs as after'] or '-'}"
        ms = f"{_ms(r['before ms'])} → {_ms(r['after ms'])}".ljust(32) if diff.measured else ""
        lines.append(f"{r['change']:<10} {r['before'] or '-':<12} {r['after'] or '-':<12} {r['nodes']:>3}  "
                     f"{ms}{r['details']:<24} {runs}")
    return "\n".join(lines)
