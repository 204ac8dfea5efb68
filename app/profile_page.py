"""The Profile page: executor.profile / verify in a worker process, live progress, charts of where time goes."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
import torch

from stagewise import planner
from stagewise.app import jobs, state
from stagewise.app import graph_view as gv
from stagewise.app.figure import FigureOptions, build_figure
from stagewise.executor.report import capture_text
from stagewise.app.profile_view import (baselines, failures, headline, measured_stage_times, shown_report, stage_rows,
                                        stage_times, sweep_rows)
from stagewise.planner.errors import StagewiseError
from stagewise.planner.table import plural

POLL_S = 1.0
STRATEGY_COLORS = gv.STRATEGY_COLORS  # one palette for every chart on this page


def table_cells(rows: list[dict]) -> pd.DataFrame:
    """Rows as a table with empty cells for missing values (never "None") and floats to 3 digits."""
    def cell(v):
        if v is None:
            return ""
        return f"{v:.3g}" if isinstance(v, float) else v
    return pd.DataFrame([{k: cell(v) for k, v in r.items()} for r in rows])


def _devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


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
    try:
        job = jobs.start(task, ref.path, ref.weights, plan.with_profile(None).to_json(), st.session_state.get("device", "cpu"),
                         ns, trust_archive=ref.trust_archive, autotune=bool(st.session_state.get("autotune")),
                         compile_baseline=bool(st.session_state.get("compile_baseline")),
                         train=bool(st.session_state.get("train")), budget=st.session_state.get("budget", "default"))
    except StagewiseError as e:  # no private jobs directory
        state.flash("error", f"{task} not started: {e}")
        return
    st.session_state.job = job
    st.session_state.job_plan = plan.with_profile(None).dumps()
    st.query_params[state.JOB_PARAM] = job.id  # a reload during the job finds it again (state.resume_job)


def _cancel() -> None:
    job = st.session_state.pop("job", None)
    state.forget_job_in_address()
    if job is not None:
        jobs.cancel(job)
        state.flash("info", f"{job.task} cancelled")


def _finish(job: jobs.Job, result: dict) -> None:
    st.session_state.pop("job", None)
    state.forget_job_in_address()
    jobs.cleanup(job)  # the result is read: the worker is reaped (jobs.result) and its folder goes
    if not result.get("ok"):
        state.flash("error", f"{job.task} failed: {result.get('error')}")
        return
    reports = result.get("reports", [])
    h = state.history()
    if job.task == "verify":
        st.session_state.verify_result = reports[-1] if reports else None
        return
    st.session_state.profile_result = reports
    st.session_state.pop("shown_n", None)  # show the plan's N first (its report is the one attached)
    if h is None or not reports:
        return
    main = next((r for r in reports if r["n"] == h.present.n_members), None)
    if main is None:
        state.flash("info", f"the sweep did not include the plan's N={h.present.n_members}: no report is attached to the plan")
    elif h.present.with_profile(None).dumps() == st.session_state.get("job_plan"):
        h.replace_present(h.entries[h.cursor][0], h.present.with_profile(main["report"]))
        state.save_autosave()
    else:
        state.flash("warning", "the plan changed while profiling: the report is shown but not attached to the plan")


@st.fragment(run_every=POLL_S)
def _poll_ui() -> None:
    """Progress of the running job, redrawn every POLL_S; drawn only while a job runs, so idle pages do not poll."""
    job = st.session_state.get("job")
    if job is None:  # cancelled from inside this fragment: redraw the whole page once
        st.rerun()
    result = jobs.result(job)
    if result is None:
        frac, msg = jobs.progress(job)
        st.progress(min(max(frac, 0.0), 1.0), text=f"{job.task}: {msg}")
        st.button("Cancel", on_click=_cancel)
        return
    _finish(job, result)
    st.rerun()


def _adopt_tuned(report: dict) -> None:
    """Make the autotuned plan of the report on screen the plan: its N, its stages, and the report as its profile."""
    h, m = state.history(), state.current()
    tuned = report.get("plan") if report.get("autotuned") else None
    if h is None or m is None or not tuned:
        return
    try:
        plan = planner.validate(planner.Plan.from_json(tuned, source="the autotuned plan"), m.graph)
    except StagewiseError as e:
        state.flash("error", f"adopting the tuned plan: {e}")
        return
    n = report.get("n_members", plan.n_members)
    state.commit(f"adopt the autotuned plan for N = {n}", plan.with_n_members(n).with_profile(report))


def controls_ui() -> None:
    c = st.columns([1, 2, 1, 1], vertical_alignment="bottom")
    c[0].selectbox("Device", _devices(), key="device")
    c[1].text_input("N sweep (comma separated; empty = the plan's N)", key="sweep_ns", placeholder="2, 4, 8, 16")
    busy = st.session_state.get("job") is not None
    c[2].button("Profile", type="primary", on_click=_start, args=("profile",), disabled=busy,
                width="stretch")
    c[3].button("Verify vs loop", on_click=_start, args=("verify",), disabled=busy, width="stretch")
    o = st.columns([1.2, 1.2, 1.2, 1])
    o[0].checkbox("Autotune each stage's strategy first", key="autotune")
    o[1].checkbox("Also time torch.compile of the whole vmap", key="compile_baseline")
    o[2].checkbox("Training step", key="train",
                  help="time forward + backward + Adam step: the plan with one stacked optimizer, N torch.optim loops, the torch.func recipe")
    o[3].selectbox("Autotune budget", BUDGETS, key="budget", disabled=not st.session_state.get("autotune"),
                   help="quick: fewer samples and no torch.compile (minutes become seconds); thorough: every candidate "
                        "timed in full; default: clear losers dropped after a brief timing")


BUDGETS = ["default", "quick", "thorough"]  # executor.autotune's budgets


def _bar(title: str, labels: list[str], series: dict[str, tuple[list, list[str] | str]]) -> go.Figure:
    """Grouped bars: series name -> (values, one colour per bar or one for all)."""
    fig = go.Figure()
    for name, (ys, colors) in series.items():
        fig.add_trace(go.Bar(name=name, x=labels, y=ys, marker_color=colors))
    fig.update_layout(title=title, height=340, barmode="group", margin=dict(l=10, r=10, t=40, b=10),
                      yaxis_title="ms (median)", legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right"))
    return fig


def sweep_figure(rows: list[dict]) -> go.Figure:
    """End-to-end ms against N, one line per way of running (stagewise, loop, vmap, ...)."""
    fig = go.Figure()
    names = [k for k in rows[0] if k != "N"]
    for name in names:
        label = name.removesuffix(" ms")
        fig.add_trace(go.Scatter(x=[r["N"] for r in rows], y=[r.get(name) for r in rows], mode="lines+markers",
                                 name=label, line=dict(color=STRATEGY_COLORS.get(label, "#888888"))))
    fig.update_layout(title="N sweep: time per forward of all members", height=360, xaxis_title="members N",
                      yaxis_title="ms (median)", margin=dict(l=10, r=10, t=40, b=10))
    fig.update_xaxes(type="log", tickvals=[r["N"] for r in rows])
    return fig


def results_ui(plan, loaded, ref) -> None:
    verify = st.session_state.get("verify_result")
    if verify:
        ok = verify["report"].get("ok")
        (st.success if ok else st.error)(f"verify N={verify['n']}: {'MATCH' if ok else 'MISMATCH'} against the member loop")
        st.code(verify.get("text") or "", language=None)
    reports = st.session_state.get("profile_result") or []
    report = _shown_report_ui(plan, reports)
    if not report:
        st.info("No profile yet: press Profile. It runs in a separate process, so a crash or out-of-memory there "
                "leaves the app and the plan intact.")
        return
    what = "Training step: forward + backward + optimizer, " if report.get("train") else ""
    st.subheader(f"{what}N = {report.get('n_members')} on {report.get('device')} ({report.get('device_name')})")
    h = headline(report)
    if h:
        for col, (k, v) in zip(st.columns(len(h)), h.items()):
            col.metric(k, v)
    for line in failures(report):
        st.warning(line)
    if report.get("capture"):
        st.caption(f"Whole-plan capture: {capture_text(report['capture'])}. The end-to-end time replays these graphs; "
                   "the per-stage times run each stage on its own.")
    if report.get("autotuned"):
        st.button(f"Adopt the autotuned plan for N = {report.get('n_members')}", on_click=_adopt_tuned, args=(report,),
                  type="primary", help="Makes the plan these numbers were measured on the plan (with this N), report included")
    rows = stage_rows(report)
    left, right = st.columns(2)
    if rows:
        ids = [r["stage"] for r in rows]
        left.plotly_chart(_bar("time per stage", ids, {
            "plan": ([r["ms"] for r in rows], [STRATEGY_COLORS.get(r["strategy"] or "", "#888888") for r in rows]),
            "member loop": ([r["loop ms"] for r in rows], STRATEGY_COLORS["loop"])}), key="stage_bars")
        left.caption("Plan bars are coloured by the stage's strategy: " + ", ".join(
            f"{k}" for k in dict.fromkeys(r["strategy"] for r in rows if r["strategy"])) + "; the member loop is grey.")
    base = baselines(report)
    right.plotly_chart(_bar("whole model", list(base), {
        "end to end": (list(base.values()), [STRATEGY_COLORS.get(k, "#888888") for k in base])}), key="baseline_bars")
    if rows:
        st.dataframe(table_cells(rows), hide_index=True, width="stretch")
    times = measured_stage_times(plan, report)
    if stage_times(report):
        view = state.view_of(ref, st.session_state.get("collapsed", []), st.session_state.get("unfolded", []))
        st.markdown("**Graph coloured by measured stage time**")
        unmeasured = [s.id for s in plan.stages if s.id not in times]
        if unmeasured:
            st.caption(f"Open dotted boxes: {plural(len(unmeasured), 'stage')} of the current plan "
                       f"({', '.join(unmeasured[:8])}{' …' if len(unmeasured) > 8 else ''}) "
                       f"{'was' if len(unmeasured) == 1 else 'were'} not measured as {'it is' if len(unmeasured) == 1 else 'they are'} "
                       "in this report (another N, an autotuned merge, or an edit since).")
        gfig = build_figure(loaded.data, view, plan, FigureOptions(stage_times=times))
        st.plotly_chart(gfig, key="time_graph")
    sweep = sweep_rows(reports)
    if len(sweep) > 1:
        st.plotly_chart(sweep_figure(sweep), key="sweep_chart")
    text = next((r.get("text") for r in reversed(reports) if r.get("report") is report), None)
    with st.expander("Report"):
        if text:
            st.code(text, language=None)
        st.json(report, expanded=False)


def _shown_report_ui(plan, reports: list[dict]) -> dict | None:
    """The report whose numbers the page shows: a pick among the N of the last run, else the plan's own profile.

    With a sweep, the plan's N is shown first (its report is the one attached to the plan).
    """
    if not reports:
        return plan.profile
    ns = [r["n"] for r in reports]
    if len(ns) > 1:
        if st.session_state.get("shown_n") not in ns:
            st.session_state.shown_n = plan.n_members if plan.n_members in ns else ns[-1]
        st.radio("Show the report for N =", ns, key="shown_n", horizontal=True)
    found = shown_report(reports, st.session_state.get("shown_n", plan.n_members))
    return found["report"] if found else None


def profile_page() -> None:
    st.header("Profile")
    found = state.loaded_or_notice()
    if found is None:
        return
    h, ref = found
    controls_ui()
    if st.session_state.get("job") is not None:
        _poll_ui()
    results_ui(h.present, state.current(), ref)
