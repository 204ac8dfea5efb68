"""The Profile page: executor.profile / verify in a worker process, live progress, charts of where time goes."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

import executor
from app import jobs, state
from app import graph_view as gv
from app.profile_view import headline, stage_times, sweep_rows

POLL_S = 1.0


def _devices() -> list[str]:
    try:
        import torch

        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    except ImportError:  # torch is a dependency; this only guards odd installs
        return ["cpu"]


def _parse_ns(text: str, default: int) -> list[int]:
    ns = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if part:
            n = int(part)
            if n < 1:
                raise ValueError(n)
            ns.append(n)
    return ns or [default]


def _start(task: str) -> None:
    h, ref = state.history(), state.model_ref()
    if h is None or ref is None:
        return
    plan = h.present
    try:
        ns = _parse_ns(st.session_state.get("sweep_ns", ""), plan.n_members) if task == "profile" else [plan.n_members]
    except ValueError:
        state.flash("error", "N sweep: write member counts separated by commas, e.g. 2, 4, 8, 16")
        return
    if ref.weights and ns != [len(ref.weights)]:
        state.flash("warning", f"weights for {len(ref.weights)} members are loaded: the sweep runs N={len(ref.weights)} only")
        ns = [len(ref.weights)]
    job = jobs.start(task, ref.path, ref.weights, plan.with_profile(None).to_json(), st.session_state.get("device", "cpu"), ns)
    st.session_state.job = job
    st.session_state.job_plan = plan.dumps()


def _cancel() -> None:
    job = st.session_state.pop("job", None)
    if job is not None:
        jobs.cancel(job)
        state.flash("info", f"{job.task} cancelled")


def _finish(job: jobs.Job, result: dict) -> None:
    st.session_state.pop("job", None)
    if not result.get("ok"):
        state.flash("error", f"{job.task} failed: {result.get('error')}")
        return
    reports = result.get("reports", [])
    h = state.history()
    if job.task == "verify":
        st.session_state.verify_result = reports[-1] if reports else None
        return
    st.session_state.profile_result = reports
    if h is None or not reports:
        return
    main = next((r for r in reports if r["n"] == h.present.n_members), reports[-1])
    if h.present.dumps() == st.session_state.get("job_plan") or h.present.with_profile(None).dumps() == st.session_state.get("job_plan"):
        h.replace_present(h.entries[h.cursor][0], h.present.with_profile(main["report"]))
        state.save_autosave()
    else:
        state.flash("warning", "the plan changed while profiling: the report is shown but not attached to the plan")


@st.fragment(run_every=POLL_S)
def _poll_ui() -> None:
    job = st.session_state.get("job")
    if job is None:
        return
    result = jobs.result(job)
    if result is None:
        frac, msg = jobs.progress(job)
        st.progress(min(max(frac, 0.0), 1.0), text=f"{job.task}: {msg}")
        st.button("Cancel", on_click=_cancel)
        return
    _finish(job, result)
    st.rerun()


def controls_ui(available: bool) -> None:
    c = st.columns([1, 2, 1, 1], vertical_alignment="bottom")
    c[0].selectbox("Device", _devices(), key="device")
    c[1].text_input("N sweep (comma separated; empty = the plan's N)", key="sweep_ns", placeholder="2, 4, 8, 16")
    busy = st.session_state.get("job") is not None
    c[2].button("Profile", type="primary", on_click=_start, args=("profile",), disabled=busy or not available,
                width="stretch")
    c[3].button("Verify vs loop", on_click=_start, args=("verify",), disabled=busy, width="stretch")


def results_ui(plan, loaded, ref) -> None:
    verify = st.session_state.get("verify_result")
    if verify:
        ok = verify["report"].get("ok")
        (st.success if ok else st.error)(f"verify N={verify['n']}: {'MATCH' if ok else 'MISMATCH'} against the member loop")
        st.code(verify.get("text") or "", language=None)
    reports = st.session_state.get("profile_result") or []
    report = plan.profile or (reports[-1]["report"] if reports else None)
    if not report:
        st.info("No profile yet: press Profile. The run happens in a separate process, so a crash there leaves the app and plan intact.")
        return
    h = headline(report)
    if h:
        cols = st.columns(len(h))
        for col, (k, v) in zip(cols, h.items()):
            col.metric(k, f"{v:.3g}")
    times = stage_times(report)
    left, right = st.columns(2)
    if times:
        ids = [s.id for s in plan.stages if s.id in times] or list(times)
        colors = gv.stage_colors(plan)
        fig = go.Figure(go.Bar(x=ids, y=[times[i] for i in ids], marker_color=[colors.get(i, "#888") for i in ids]))
        fig.update_layout(title="time per stage (ms)", height=360, margin=dict(l=10, r=10, t=40, b=10))
        left.plotly_chart(fig, key="stage_bars")
        with right:
            view, pos = state.view_and_layout(ref, ())
            gfig = gv.build_figure(loaded.data, view, pos, plan, gv.FigureOptions(stage_times=times, height=420))
            gfig.update_layout(title="graph coloured by stage time", showlegend=False)
            st.plotly_chart(gfig, key="time_graph")
    rows = sweep_rows(reports)
    if len(rows) > 1:
        df = pd.DataFrame(rows).set_index("N")
        st.subheader("N sweep")
        st.line_chart(df, x_label="members N", y_label="ms per forward")
    with st.expander("Raw report JSON"):
        st.json(report, expanded=False)


def profile_page() -> None:
    st.header("Profile")
    h, ref = state.history(), state.model_ref()
    if h is None or ref is None:
        st.info("No model is loaded. Open one on the Model page.")
        return
    available = hasattr(executor, "profile")
    if not available:
        st.warning("Profiling is not available yet: this executor has no `executor.profile` (it comes with the "
                   "profiler issue). Verify against the member loop works already.")
    controls_ui(available)
    _poll_ui()
    results_ui(h.present, state.current(), ref)
