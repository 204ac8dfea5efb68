"""The Model page: pick a bundled sample or upload a model file / .pt2 archive and member weights; N and input modes."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd
import streamlit as st

from stagewise import planner
from stagewise.app import state
from stagewise.app.launch import TOKEN_ENV
from stagewise.planner.plan import InputMode

WEIGHT_TYPES = ["safetensors", "pt", "pth", "bin"]


def upload_limit_note() -> str:
    """What the uploaders take: the size limit that applies (server.maxUploadSize, MB) and what to do past it.

    Streamlit refuses a larger file in the browser ("File must be ... or smaller") before the app
    sees it, so this note, shown beside the uploaders, is where the way around it is named.
    """
    mb = st.get_option("server.maxUploadSize")
    raise_it = "" if os.environ.get(TOKEN_ENV) else " (or restart the app with a larger `--server.maxUploadSize`)"
    return (f"Up to **{mb} MB per file** (this server's `server.maxUploadSize`); the uploader refuses a larger file. "
            f"For a larger model file or archive, open it by its path instead, `stagewise ui path/to/model.pt2`"
            f"{raise_it}; for larger member weights, use the command line, which reads them from disk: "
            "`stagewise profile PLAN MODEL --weights FILE ...`.")


def _open_sample() -> None:
    path = st.session_state.get("sample_choice")
    if path:
        state.open_model(state.ModelRef(path, label=Path(path).name), int(st.session_state.get("n_new", state.DEFAULT_N)))


def _trust_key(up) -> str:
    """The trust checkbox's key: one per uploaded file, so choosing another archive starts unticked."""
    return f"trust_archive_{up.file_id}"


def _open_upload() -> None:
    up = st.session_state.get("model_upload")
    if up is None:
        state.flash("error", "choose a .py model file or a .pt2 archive first")
        return
    trust = up.name.endswith(".pt2") and bool(st.session_state.get(_trust_key(up)))
    weights = sorted(st.session_state.get("weights_upload") or [], key=lambda f: planner.natural_key(f.name))

    def save() -> tuple[Path, str, tuple[str, ...]]:
        d = state.new_upload_dir()  # private (0700) and unique per upload: nothing planted can be picked up
        return d, state.save_upload(d, up.name, up.getvalue()), tuple(state.save_upload(d, w.name, w.getvalue())
                                                                       for w in weights)

    saved = state.guarded(f"saving {up.name}", save)
    if saved is None:
        return
    d, path, wpaths = saved
    n = int(st.session_state.get("n_new", state.DEFAULT_N))
    if not state.open_model(state.ModelRef(path, wpaths, label=up.name, trust_archive=trust), n):
        shutil.rmtree(d, ignore_errors=True)  # nothing refers to a model that did not load


def _set_n() -> None:
    h = state.history()
    n = int(st.session_state.get("n_current", 1))
    if h is None or n == h.present.n_members:
        return
    ref = state.model_ref()
    if ref and ref.weights and n != len(ref.weights):
        state.flash("error", f"N: {len(ref.weights)} weight files are loaded, so N is {len(ref.weights)}; "
                             "upload one weight file per member to change it")
        st.session_state.n_current = h.present.n_members
        return
    state.commit(f"N = {n}", h.present.with_n_members(n))


def _plan_edit(what: str, edit, label: str) -> None:
    """Apply `edit(plan)` to the present plan as one undoable step named `label` (errors shown, the plan kept)."""
    h = state.history()
    if h is None:
        return
    result = state.guarded(what, lambda: edit(h.present))
    if result is not None:
        state.commit(label, result)


def _set_input_mode(name: str) -> None:
    mode = st.session_state.get(f"input_mode_{name}")
    _plan_edit("input mode", lambda p: p.with_input_modes({name: mode}), f"input {name}: {mode}")


def _set_dtype() -> None:
    dtype = st.session_state.get("plan_dtype")
    _plan_edit("precision", lambda p: planner.set_dtype(p, dtype), f"precision {dtype}")


def _set_capture() -> None:
    on = bool(st.session_state.get("plan_capture"))
    _plan_edit("whole-plan capture", lambda p: planner.set_capture(p, on), f"whole-plan capture {'on' if on else 'off'}")


def source_ui() -> None:
    st.subheader("Open a model")
    samples = state.sample_paths()
    tab_sample, tab_upload = st.tabs(["Bundled sample", "Upload"])
    with tab_sample:
        if samples:
            ref = state.model_ref()
            if st.session_state.get("sample_choice") not in samples:  # start on the open model when it is a sample
                st.session_state.sample_choice = ref.path if ref and ref.path in samples else samples[0]
            st.selectbox("Sample model", samples, key="sample_choice", format_func=lambda p: Path(p).name)
            st.button("Open sample", on_click=_open_sample, type="primary")
        else:
            st.info("No bundled samples found in sample_models/.")
    with tab_upload:
        st.warning("Uploading a model file **runs its code** on this machine (build_model(), example_inputs()). "
                   "Only upload files you trust. The app listens on 127.0.0.1 only and only for the browser tab "
                   "opened with the token `stagewise ui` printed, so nobody else can upload. A `.pt2` archive "
                   "is loaded without unpickling anything unless you tick *Trust this archive*.")
        up = st.file_uploader("Model file (.py with build_model() and example_inputs()) or torch.export archive (.pt2)",
                              type=["py", "pt2"], key="model_upload")
        if up is not None and up.name.endswith(".pt2"):
            st.checkbox("Trust this archive (it runs code from the file)", value=False, key=_trust_key(up),
                        help="Some archives store weights or example inputs as pickles; loading those runs code "
                             "the archive's author chose. Tick only for an archive you made or trust.")
        st.file_uploader("Member weights (optional): one .safetensors or state_dict file per member, "
                         "assigned in file-name order; N becomes the number of files",
                         type=WEIGHT_TYPES, accept_multiple_files=True, key="weights_upload")
        st.caption(upload_limit_note())
        st.button("Load uploaded model", on_click=_open_upload, type="primary")
    st.number_input("Members N for the model you open", min_value=1, max_value=4096, value=state.DEFAULT_N, key="n_new")


def current_ui() -> None:
    h, ref = state.history(), state.model_ref()
    if h is None or ref is None:
        st.info("No model loaded yet.")
        return
    loaded = state.current()
    g, plan = loaded.graph, h.present
    st.subheader(f"Current model: {ref.name}")
    st.caption(f"{ref.path}" + (f" · {len(ref.weights)} weight files" if ref.weights else ""))
    c = st.columns(4)
    c[0].metric("tracer", g.tracer)
    c[1].metric("nodes", len(loaded.data.nodes))
    c[2].metric("stages", len(plan.stages))
    c[3].metric("fingerprint", plan.fingerprint[:10])
    if g.tracer_note:
        st.caption(f"tracer note: {g.tracer_note}")
    if st.session_state.get("n_current") != plan.n_members:
        st.session_state.n_current = plan.n_members
    st.number_input("Members N", min_value=1, max_value=4096, key="n_current", on_change=_set_n,
                    disabled=bool(ref.weights), help="Stages do not depend on N; changing it is one undoable edit")
    st.markdown("**Inputs**: *shared* = every member sees the same tensor; *per_member* = the tensor has a leading [N, ...] axis")
    for spec in plan.inputs:
        key = f"input_mode_{spec.name}"
        if st.session_state.get(key) != spec.mode.value:
            st.session_state[key] = spec.mode.value
        st.radio(spec.name, [m.value for m in InputMode], key=key, horizontal=True, on_change=_set_input_mode,
                 args=(spec.name,))
    left, right = st.columns(2)
    if st.session_state.get("plan_dtype") != plan.dtype:
        st.session_state.plan_dtype = plan.dtype
    left.selectbox("Precision", list(planner.DTYPES), key="plan_dtype", on_change=_set_dtype,
                   help="The batched module's dtype, checked against the float32 member loop with the dtype's tolerance "
                        "(README 'Precision'); one undoable edit")
    if st.session_state.get("plan_capture") != plan.capture:
        st.session_state.plan_capture = plan.capture
    right.checkbox("Whole-plan capture (GPU)", key="plan_capture", on_change=_set_capture,
                   help="On a GPU, inference calls replay the plan as CUDA graphs (stages that sync with the host run "
                        "between them); training and CPU run stage by stage. Autotune sets it where it measures fastest")
    nodes_ui(loaded, plan)


def nodes_ui(loaded: state.Loaded, plan) -> None:
    """Every traced node as a table: what the planner knows and which stage holds it."""
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    bad = sum(not n.batchable for n in loaded.data.nodes)
    with st.expander(f"Traced nodes ({len(loaded.data.nodes)}, {bad} cannot be batched)"):
        rows = [{"node": n.name, "op": n.op, "target": n.target, "module": n.module_path, "shape": n.shape,
                 "dtype": n.dtype, "params": n.params, "FLOPs": n.flops, "stage": stage_of.get(n.name, ""),
                 "batchable": n.batchable, "why not": n.reason} for n in loaded.data.nodes]
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def model_page() -> None:
    st.header("Model")
    left, right = st.columns(2)
    with left:
        source_ui()
    with right:
        current_ui()
