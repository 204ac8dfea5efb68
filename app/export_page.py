"""The Export page: the plan JSON, a Python snippet that builds the batched module, DOT/SVG; import a plan."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from stagewise import planner
from stagewise.app import state
from stagewise.app.dot_view import dot_to_svg, plan_dot


def snippet(model_path: str, plan_file: str, weights: tuple[str, ...] = (), export: bool = False) -> str:
    """Ready-to-paste Python that loads the plan and builds the batched module."""
    w = f", weights={list(weights)!r}" if weights else ""
    return f'''from stagewise import planner, executor

src = planner.load_source({model_path!r}{w})
plan = planner.Plan.load({plan_file!r})
ensemble = executor.build(plan, src.members(plan.n_members){", src.example_inputs" if export else ""})
# inputs: shared ones as one member takes them, per_member ones stacked [N, ...]
inputs = executor.batched_inputs(plan, src.example_inputs)
outputs = ensemble(*inputs)  # N-first: [N, ...] per output tensor
'''


@st.cache_data(max_entries=16, show_spinner="Rendering SVG…")
def _svg(dot: str) -> bytes | None:
    """dot_to_svg, run once per distinct graph text rather than on every rerun of the page."""
    return dot_to_svg(dot)


def import_problem(plan: planner.Plan, graph, ref: state.ModelRef) -> str | None:
    """Why `plan` cannot be imported for the open model, said in app actions; None when validate may judge it.

    planner.validate names the command-line fix (re-plan with `stagewise plan`); in the app the fix is
    opening the right model or modules, or loading as many weight files as the plan has members.
    """
    if tuple(plan.opened_modules) != tuple(graph.opened_modules):
        opened = ", ".join(plan.opened_modules) or "none"
        return (f"the plan is for the model traced with leaf modules opened ({opened}), and {ref.name} is open with "
                f"{', '.join(graph.opened_modules) or 'none'} opened; open the same modules under 'Leaf modules' "
                "on the Plan page (or close them there), then import the plan again")
    if plan.fingerprint != graph.fingerprint:
        made_for = f" ({plan.model})" if plan.model else ""
        return (f"the plan was made for another model or architecture{made_for}: its fingerprint {plan.fingerprint} "
                f"is not {ref.name}'s {graph.fingerprint}; open that model on the Model page, then import the plan again")
    if ref.weights and plan.n_members != len(ref.weights):  # the rule model_page._set_n applies to N
        return (f"the plan is for N={plan.n_members} members, but {len(ref.weights)} weight files are loaded, so N is "
                f"{len(ref.weights)}; import a plan for N={len(ref.weights)}, or upload {plan.n_members} weight files "
                "(one per member) on the Model page first")
    return None


def _import_plan() -> None:
    up = st.session_state.get("plan_upload")
    m, h, ref = state.current(), state.history(), state.model_ref()
    if up is None or m is None or h is None or ref is None:
        return
    what = f"importing {up.name}"
    plan = state.guarded(what, lambda: planner.Plan.loads(up.getvalue(), source=up.name))  # bytes: a bad byte is named
    if plan is None:
        return
    problem = import_problem(plan, m.graph, ref)
    if problem:
        state.flash("error", f"{what}: {problem}")
        return
    result = state.guarded(what, lambda: planner.validate(plan, m.graph))
    if result is not None:
        state.commit(f"import {up.name}", result)


def export_page() -> None:
    st.header("Export")
    found = state.loaded_or_notice()
    if found is None:
        return
    h, ref = found
    plan = h.present
    stem = Path(ref.name).stem
    text = plan.dumps()
    c = st.columns(3)
    c[0].download_button("Download plan JSON", text, file_name=f"{stem}.plan.json", mime="application/json",
                         type="primary", key="dl_plan")
    st.caption("Includes the last profile report" if plan.profile else "No profile report inside yet (see the Profile page)")
    loaded = state.current()
    view = state.view_of(ref, st.session_state.get("collapsed", []), st.session_state.get("unfolded", []))
    dot = plan_dot(loaded.data, view, plan)
    c[1].download_button("Download .dot", dot, file_name=f"{stem}.dot", mime="text/vnd.graphviz", key="dl_dot")
    svg = _svg(dot)
    if svg is not None:
        c[2].download_button("Download .svg", svg, file_name=f"{stem}.svg", mime="image/svg+xml", key="dl_svg")
    else:
        c[2].caption("SVG needs the Graphviz `dot` program (apt-get install graphviz); the .dot file opens in any Graphviz viewer.")
    st.subheader("Use it in code")
    model_path, weights = state.user_paths(ref)
    st.code(snippet(model_path, f"{stem}.plan.json", weights, plan.tracer == "export"), language="python")
    if model_path != ref.path:
        st.caption(f"The snippet names your files as you uploaded them; the app works on a private copy ({ref.path}).")
    with st.expander("Plan JSON"):
        st.code(text, language="json")
    st.subheader("Import a plan")
    st.file_uploader("Plan JSON for the current model (checked against its graph)", type=["json"], key="plan_upload")
    st.button("Import plan", on_click=_import_plan)
