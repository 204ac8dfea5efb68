"""Opening leaf modules in the app: list the modules the trace keeps as single nodes, pick some, trace again inside them.

A leaf module (nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.GRU, ...) is one
node the planner cannot see inside: 0 FLOPs measured per op, one verdict for all of it.
Opening it re-traces the model with planner.trace(..., open_modules=...), so its ops become
nodes that stages can hold. The plan records the opened modules; a new plan is proposed
(the old one was for another graph), keeping N and the input modes.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import streamlit as st

from stagewise.app import state

CHOICE_KEY = "open_modules_choice"


# torch.nn classes whose forward is one functional call: opening them gives the same single node back
SINGLE_OP = frozenset({
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d",
    "RMSNorm", "Embedding", "Dropout", "Dropout1d", "Dropout2d", "Identity", "Flatten", "Unflatten", "ReLU", "GELU",
    "SiLU", "Tanh", "Sigmoid", "LeakyReLU", "ELU", "Softmax", "LogSoftmax", "Softplus", "Mish", "Hardswish",
    "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "Upsample",
})


def leaf_rows(graph: Any) -> list[dict]:
    """One row per leaf module of a planner.ModelGraph: path, class, what opening gives, batchable and why not.

    Modules with several ops inside (attention, encoder layers, recurrent layers, user modules kept as
    leaves) come first; single-op modules (Linear, LayerNorm, ...) last: opening them gives one node back."""
    rows = [{"module": leaf.path, "type": leaf.type_name,
             "inside": "one op" if leaf.type_name in SINGLE_OP else "several ops",
             "batchable": leaf.batchable, "why not": leaf.reason}
            for leaf in graph.leaf_modules()]
    return sorted(rows, key=lambda r: (r["inside"] == "one op", r["batchable"]))


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _reopen(opened: tuple[str, ...], label: str) -> None:
    """Trace the current model again with `opened` and propose a plan for it (same N and input modes)."""
    ref, plan = state.model_ref(), state.plan()
    if ref is None or plan is None:
        return
    modes = {i.name: i.mode.value for i in plan.inputs}
    mode: Any = next(iter(modes.values())) if len(set(modes.values())) == 1 else modes  # names may differ after re-tracing
    if state.open_model(replace(ref, opened=opened), plan.n_members, mode):
        state.flash("info", f"{label}; re-traced, with a new proposed plan (edits of the previous graph's plan do not carry over)")


def _open_selected() -> None:
    ref = state.model_ref()
    chosen = tuple(st.session_state.get(CHOICE_KEY) or ())
    if ref is None or not chosen:
        state.flash("error", "choose one or more leaf modules to open first")
        return
    st.session_state[CHOICE_KEY] = []
    _reopen(tuple(dict.fromkeys((*ref.opened, *chosen))), f"opened {', '.join(chosen)}")


def _close_all() -> None:
    _reopen((), "closed every opened module")


def open_modules_ui() -> list[str]:
    """Draw the leaf-module list and the open/close buttons for the loaded model; returns the opened module paths."""
    ref, loaded = state.model_ref(), state.current()
    if ref is None or loaded is None:
        return []
    graph = loaded.graph
    rows = leaf_rows(graph)
    worth = [r for r in rows if r["inside"] != "one op"]
    kinds = ", ".join(f"{t} ×{n}" if n > 1 else t for t, n in _counts(r["type"] for r in worth).items())
    title = (f"Leaf modules: {len(worth)} with ops inside ({kinds}) to open and plan inside" if worth
             else f"Leaf modules ({len(rows)}, each one op): nothing inside to plan")
    with st.expander(title):
        if graph.tracer_note:
            st.caption(f"tracer note: {graph.tracer_note}")
        if ref.opened:
            st.markdown("**Opened:** " + ", ".join(f"`{p}`" for p in ref.opened))
            st.button("Close opened modules", on_click=_close_all, key="close_opened_modules")
        if not rows:
            st.caption("No leaf modules: the trace already sees every op (torch.export traces inside every module).")
            return list(ref.opened)
        st.dataframe(rows, hide_index=True, width="stretch")
        st.multiselect("Leaf modules to open", [r["module"] for r in rows], key=CHOICE_KEY,
                       format_func=lambda p: f"{p} ({next(r['type'] for r in rows if r['module'] == p)})",
                       help="Re-traces the model inside these modules; modules fx cannot trace inside "
                            "(MultiheadAttention, GRU, ...) make it trace with torch.export, which opens every module")
        st.button("Open selected leaf modules", on_click=_open_selected, type="primary", key="open_leaf_modules")
    return list(ref.opened)
