"""The Plan page: the stage-coloured graph, selection, edit buttons, undo/redo, stage table, Graphviz view."""
from __future__ import annotations

from functools import partial

import pandas as pd
import streamlit as st

from stagewise.app import actions, state
from stagewise.app import graph_view as gv
from stagewise.app.figure import FigureOptions, build_figure
from stagewise.app.diff_view import diff_ui
from stagewise.app.dot_view import plan_dot
from stagewise.app.history import History
from stagewise.app.open_view import open_modules_ui
from stagewise.app.profile_view import measured_stage_times
from stagewise.planner.plan import Plan, Strategy
from stagewise.planner.table import plan_summary, plural

EDITS = {
    "merge": lambda p, g, sel, whole: actions.merge_selected(p, g, sel),
    "split": lambda p, g, sel, whole: actions.split_selected(p, g, sel),
    "exclude": lambda p, g, sel, whole: actions.exclude_selected(p, g, sel, whole),
    "include": lambda p, g, sel, whole: actions.include_selected(p, g, sel),
}


# -- callbacks (run before the rerun, so the whole page shows their result) ------------------


def _edit(kind: str) -> None:
    h, m = state.history(), state.current()
    if h is None or m is None:
        return
    sel = list(st.session_state.get("selection", []))
    whole = st.session_state.get("edit_scope", "whole stages") == "whole stages"
    result = state.guarded(kind, lambda: EDITS[kind](h.present, m.graph, sel, whole))
    if result is None:
        return
    warnings = actions.edit_warnings(kind, h.present, result[1])
    if warnings:  # say so before applying; the user picks: apply, the gentler alternative, or cancel
        st.session_state.pending_edit = {"label": result[0], "plan": result[1], "warnings": warnings, "base": h.present,
                                         "alternative": actions.alternative(kind, h.present, m.graph, sel)}
        return
    state.commit(*result)


def _apply_pending(which: str) -> None:
    pending = st.session_state.pop("pending_edit", None)
    h = state.history()
    if pending is None or h is None or which == "cancel":
        return
    if h.present != pending["base"]:  # the plan changed under the question (undo in another widget)
        state.flash("warning", "the plan changed since the warning: edit again")
        return
    state.commit(*(pending["alternative"][1] if which == "alternative" else (pending["label"], pending["plan"])))


def _set_strategy() -> None:
    h, m = state.history(), state.current()
    if h is None or m is None:
        return
    chunk = int(st.session_state.get("chunk_size") or 0) or None
    strategy = st.session_state.get("strategy", Strategy.VMAP.value)
    sel = list(st.session_state.get("selection", []))
    result = state.guarded("strategy", lambda: actions.set_options_selected(h.present, m.graph, sel, strategy, chunk))
    if result is not None:
        state.commit(*result)


def _step(kind: str) -> None:
    h = state.history()
    if h is None:
        return
    label = h.entries[h.cursor][0]
    if kind == "undo" and h.can_undo:
        h.undo()
        state.flash("info", f"undid: {label}")
    elif kind == "redo" and h.can_redo:
        h.redo()
        state.flash("info", f"redid: {h.entries[h.cursor][0]}")
    elif kind == "reset":
        h.reset()
        state.flash("info", "reset to the proposed plan (undo brings your edits back)")
    else:
        return
    st.session_state.selection = []
    state.bump_view()
    state.save_autosave()


def _chart_selected(key: str, collapsed: tuple[str, ...], unfolded: tuple[str, ...]) -> None:
    """A click or box/lasso selection on the graph.

    A plain click on a collapsed module box expands it one level, on a fold of repeated
    modules unfolds it, on an expanded module's "▾" tag collapses it; a click on a node,
    and every box or lasso selection, adds to the selection.
    """
    ref = state.model_ref()
    if ref is None:
        return
    view = state.view_of(ref, collapsed, unfolded)
    event = st.session_state.get(key)
    clicked = gv.clicked_view_id(event)
    if clicked is not None and (clicked.startswith(gv.OPEN_PREFIX) or view.kind(clicked) != "node"):
        loaded = state.current()
        change = gv.toggle(loaded.data, view, clicked, collapsed, unfolded)
        st.session_state.collapsed, st.session_state.unfolded = list(change.collapsed), list(change.unfolded)
        state.flash("info", change.message)
        return
    picked = gv.selection_from_event(event, view)
    # Each redraw resets Plotly's own selection, so clicks add to ours; an empty
    # selection event (Plotly's deselect) clears it.
    current = list(st.session_state.get("selection", []))
    st.session_state.selection = list(dict.fromkeys(current + picked)) if picked else []


def _collapse_to_depth() -> None:
    m = state.current()
    depth = st.session_state.get("collapse_depth", 0)
    if m is not None:
        st.session_state.collapsed = gv.boxes_at_depth(m.data, depth) if depth else []
        st.session_state.unfolded = []


def _expand_all() -> None:
    st.session_state.collapsed, st.session_state.unfolded, st.session_state.collapse_depth = [], [], 0


def _table_selected(key: str, stage_ids: tuple[str, ...]) -> None:
    event = st.session_state.get(key) or {}
    rows = (event.get("selection") or {}).get("rows", [])
    st.session_state.selection = [stage_ids[r] for r in rows if r < len(stage_ids)]


def _select_matches(matches: tuple[str, ...]) -> None:
    st.session_state.selection = list(matches)


# -- widgets ------------------------------------------------------------------------------------


def summary_ui(plan: Plan, loaded: state.Loaded, ref: state.ModelRef) -> None:
    st.markdown(f"**{ref.name}** · **{plan_summary(plan)}**"
                f" · {plural(len(loaded.data.nodes), 'node')} · N = {plan.n_members} · traced with {loaded.graph.tracer}"
                f" · precision {plan.dtype}" + (" · whole-plan capture on GPU" if plan.capture else ""))


def view_options_ui(data: gv.GraphData) -> tuple[list[str], list[str], list[str]]:
    """Module collapse and search; returns (collapsed module paths, unfolded folds, search hits).

    `collapsed` in the session is the truth (clicks on the graph change it); the depth control
    and "Expand all" rewrite it in one step, and the multiselect shows and edits it directly.
    """
    modules = data.module_paths()
    depths = sorted({m.count(".") + 1 for m in modules})
    if st.session_state.get("collapse_depth", 0) not in [0] + depths:
        st.session_state.collapse_depth = 0
    st.session_state.collapsed = [m for m in st.session_state.get("collapsed", []) if m in modules]
    unfolded = list(st.session_state.get("unfolded", []))
    c0, c1, c2, c3, c4 = st.columns([1.3, 0.8, 2.2, 2, 1], vertical_alignment="bottom")
    c0.selectbox("Collapse all modules at depth", [0] + depths, key="collapse_depth", on_change=_collapse_to_depth,
                 format_func=lambda d: "none" if d == 0 else f"{d} (e.g. {gv.modules_at_depth(data, d)[0]})",
                 help="Draw every nn.Module at this nesting depth as one box; click a box to expand it in place")
    c1.button("Expand all", on_click=_expand_all, disabled=not st.session_state.collapsed, width="stretch")
    c2.multiselect("Collapsed modules", modules, key="collapsed", placeholder="none: every node drawn",
                   help="Clicking a module box on the graph expands it; its ▾ tag collapses it again")
    query = c3.text_input("Search nodes", key="search", placeholder="name, op target or module path")
    hits = gv.search(data, query)
    c4.button(f"Select {len(hits)} hits", disabled=not hits, on_click=_select_matches, args=(tuple(hits),),
              width="stretch")
    return sorted(st.session_state.collapsed), sorted(unfolded), hits


def selection_ui(plan: Plan, data: gv.GraphData) -> list[str]:
    """The selection as a multiselect of stage ids and node names (mirrors clicks in the graph)."""
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    options = [s.id for s in plan.stages] + [n.name for n in data.nodes if n.name not in {s.id for s in plan.stages}]
    valid = set(options)
    st.session_state.selection = [x for x in st.session_state.get("selection", []) if x in valid]
    sizes = {s.id: len(s.nodes) for s in plan.stages}

    def label(x: str) -> str:
        if x in sizes:
            return f"{x} (stage, {plural(sizes[x], 'node')})"
        return f"{x} ({stage_of.get(x, 'input/output')})"

    return st.multiselect("Selection: click or box/lasso-select nodes in the graph, or pick stages and nodes here",
                          options, key="selection", format_func=label)


def actions_ui(plan: Plan, selection: list[str]) -> None:
    touched = actions.stages_touched(plan, selection)
    h = state.history()
    c = st.columns([1, 1, 1, 1, 0.2, 1, 1, 1])
    c[0].button("Merge", on_click=_edit, args=("merge",), disabled=len(touched) < 2, width="stretch",
                help="Merge every stage the selection touches into one")
    c[1].button("Split", on_click=_edit, args=("split",), disabled=not selection, width="stretch",
                help="One node: split its stage before it. Several nodes of one stage: carve them out")
    c[2].button("Exclude", on_click=_edit, args=("exclude",), disabled=not selection, width="stretch",
                help="Run as a loop over members instead of batched")
    c[3].button("Include", on_click=_edit, args=("include",), disabled=not selection, width="stretch",
                help="Batch an excluded stage again")
    c[5].button("Undo", on_click=_step, args=("undo",), disabled=not (h and h.can_undo), width="stretch")
    c[6].button("Redo", on_click=_step, args=("redo",), disabled=not (h and h.can_redo), width="stretch")
    c[7].button("Reset", on_click=_step, args=("reset",), width="stretch", help="Back to the proposed plan")
    o = st.columns([2, 2, 1.2, 1.2], vertical_alignment="bottom")
    o[0].radio("Exclude acts on", ["whole stages", "selected nodes only"], key="edit_scope", horizontal=True)
    o[1].selectbox("Strategy", [s.value for s in Strategy], key="strategy",
                   help="vmap is what the executor runs today; other strategies come with the profiler/autotuner")
    o[2].number_input("chunk size (0 = all)", min_value=0, step=1, key="chunk_size")
    o[3].button("Set strategy", on_click=_set_strategy, disabled=not touched, width="stretch")
    pending_ui()


def pending_ui() -> None:
    """An edit held back by a warning: what it would do, and the choices."""
    pending = st.session_state.get("pending_edit")
    if not pending:
        return
    with st.container(border=True):
        st.warning(f"**{pending['label']}** — not applied yet: " + " ".join(pending["warnings"]))
        c = st.columns(3)
        c[0].button(f"Apply anyway ({len(pending['plan'].stages)} stages)", on_click=_apply_pending, args=("apply",),
                    key="pending_apply")
        if pending["alternative"]:
            c[1].button(pending["alternative"][0], on_click=_apply_pending, args=("alternative",), type="primary",
                        key="pending_alternative")
        c[2].button("Cancel", on_click=_apply_pending, args=("cancel",), key="pending_cancel")


def graph_ui(data: gv.GraphData, plan: Plan, ref: state.ModelRef, collapsed: list[str], unfolded: list[str],
             hits: list[str], selection: list[str]) -> None:
    view = state.view_of(ref, collapsed, unfolded)
    expanded_sel = set(view.expand(selection)) | set(selection)
    for s in plan.stages:
        if s.id in expanded_sel:
            expanded_sel |= set(s.nodes)
    times = measured_stage_times(plan, plan.profile) if st.session_state.get("color_by_time") and plan.profile else None
    fig = build_figure(data, view, plan, FigureOptions(
        selected=frozenset(expanded_sel), highlighted=frozenset(hits), stage_times=times))
    key = f"chart_{st.session_state.get('view_version', 0)}_{abs(hash((tuple(collapsed), tuple(unfolded)))) % 10**8}"
    # scrollZoom off: the mouse wheel scrolls the page (a tall graph must not trap it); zoom is in the toolbar
    st.plotly_chart(fig, key=key, on_select=partial(_chart_selected, key, tuple(collapsed), tuple(unfolded)),
                    selection_mode=("points", "box", "lasso"), config={"displaylogo": False, "scrollZoom": False})
    legend = ("Colour = measured stage time (dotted open boxes = not measured in the attached profile)" if times is not None
              else "Shaded region and colour = stage (kept across edits; never red or grey)")
    st.caption(f"Top to bottom = data flow. {legend}; hatched grey, dashed = runs as a member loop; "
               "red outline = cannot be batched (hover for why); black outline = selected. Click a node to add it to "
               "the selection, box or lasso (chart toolbar) to add many; click a bold ▸ module box to expand it, its ▾ tag "
               "to collapse it again; ×k boxes are k identical blocks, click to unfold. The wheel scrolls the page; "
               "zoom with the toolbar.")


def stage_rows(plan: Plan, data: gv.GraphData) -> pd.DataFrame:
    """The stage table; empty text (never None) where a stage has no time, chunk or reason."""
    times = measured_stage_times(plan, plan.profile) if plan.profile else {}
    rows = []
    for s in plan.stages:
        infos = [data.node(n) for n in s.nodes if data.has(n)]
        t = times.get(s.id)
        rows.append({
            "stage": s.id, "runs as": s.runs_as(), "vmap": "excluded" if s.mode.value == "excluded" else "ok",
            "nodes": len(s.nodes), "params": sum(i.params for i in infos), "FLOPs": sum(i.flops for i in infos),
            "last ms": f"{t:.3g}" if t is not None else ("" if not plan.profile else "not measured"),
            "chunk": str(s.options.chunk_size) if s.options.chunk_size else "", "reason": s.reason,
        })
    return pd.DataFrame(rows)


def stage_table_ui(plan: Plan, data: gv.GraphData) -> None:
    st.subheader("Stages")
    key = f"table_{st.session_state.get('view_version', 0)}"
    st.dataframe(stage_rows(plan, data), hide_index=True, key=key, on_select=partial(_table_selected, key, tuple(s.id for s in plan.stages)),
                 selection_mode="multi-row", width="stretch",
                 column_config={"params": st.column_config.NumberColumn(format="compact"),
                                "FLOPs": st.column_config.NumberColumn(format="compact"),
                                "reason": st.column_config.TextColumn(width="large", help="why the stage is excluded from vmap")})
    reasons = [f"{s.id}: {s.reason}" for s in plan.stages if s.reason]
    if reasons:  # the table cell cuts long reasons; here they are whole
        st.caption("Excluded because: " + "; ".join(reasons))
    if plan.profile:
        st.toggle("Colour the graph by measured stage time", key="color_by_time")


def history_ui(h: History) -> None:
    with st.expander(f"Edit history ({h.cursor} of {len(h.entries) - 1} edits applied)"):
        for i, label in enumerate(h.labels()):
            mark = "▶" if i == h.cursor else ("·" if i < h.cursor else "↷")
            st.text(f"{mark} {i}: {label}")


def graphviz_ui(data: gv.GraphData, plan: Plan, ref: state.ModelRef, collapsed: list[str], unfolded: list[str]) -> None:
    if not st.toggle("Static Graphviz view", key="show_dot"):
        return
    view = state.view_of(ref, collapsed, unfolded)
    dot = plan_dot(data, view, plan)
    st.graphviz_chart(dot, width="content")
    st.download_button("Download .dot", dot, file_name=f"{plan.model or 'plan'}.dot".replace("/", "_"), mime="text/vnd.graphviz")


def plan_page() -> None:
    st.header("Plan")
    found = state.loaded_or_notice()
    if found is None:
        return
    h, ref = found
    loaded = state.current()
    plan = h.present
    summary_ui(plan, loaded, ref)
    open_modules_ui()
    if loaded.graph.tracer != "fx":
        st.caption(f"Traced with torch.export: {loaded.graph.tracer_note}")
    collapsed, unfolded, hits = view_options_ui(loaded.data)
    selection = selection_ui(plan, loaded.data)
    actions_ui(plan, selection)
    left, right = st.columns([3, 2])
    with left:
        graph_ui(loaded.data, plan, ref, collapsed, unfolded, hits, selection)
    with right:
        stage_table_ui(plan, loaded.data)
        history_ui(h)
    graphviz_ui(loaded.data, plan, ref, collapsed, unfolded)
    diff_ui(h, loaded.data, collapsed, unfolded)
