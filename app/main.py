"""Streamlit entry point: `streamlit run app/main.py` (or `stagewise ui [MODEL]`, see app/launch.py).

Lets in only a browser session that presented the access token `stagewise ui` made
(state.access_refusal), then opens on a bundled sample (or $STAGEWISE_MODEL), offers
to restore an autosaved plan, and routes to the Model, Plan, Profile and Export pages.
"""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from stagewise.app import state  # the installed package (pip install -e . in a checkout), not app/ beside this file

VIEWS = Path(__file__).resolve().parent / "views"


def autosave_offer_ui() -> None:
    rec = st.session_state.get("autosave_offer")
    if rec is None:
        return
    with st.container(border=True):
        if st.session_state.get("autosave_offer_here"):  # found when this model was opened (state.open_model)
            st.info(f"An autosaved plan exists for this model: {rec.describe()}. Restore it (one undoable step)?")
        else:
            st.info(f"An autosaved plan exists: {rec.describe()}. Restore it?")
        c = st.columns([1, 1, 6])
        c[0].button("Restore", on_click=state.restore_autosave, type="primary", key="restore_autosave")
        c[1].button("Dismiss", on_click=state.dismiss_autosave, key="dismiss_autosave")


def access_ui() -> bool:
    """Whether this browser session may use the app; when not, say how to get in (nothing else runs)."""
    why = state.access_refusal()
    if why is None:
        state.keep_token_in_address()
        return True
    st.title("stagewise")
    st.error(f"Access refused: {why}.")
    st.caption("Uploading a model runs its code on this machine, so the app only works in the browser tab "
               "opened from the address with the token that `stagewise ui` prints when it starts.")
    return False


def main() -> None:
    st.set_page_config(page_title="stagewise", layout="wide")
    # less empty space above the page title: the graph is what people came for
    st.html("<style>[data-testid='stMainBlockContainer']{padding-top:2.5rem}</style>")
    if not access_ui():  # no model load, no autosave offer, no pages (so no upload, no profile)
        st.stop()
    state.init()
    pages = [
        st.Page(str(VIEWS / "plan.py"), title="Plan", default=True, url_path="plan"),
        st.Page(str(VIEWS / "model.py"), title="Model", url_path="model"),
        st.Page(str(VIEWS / "profile.py"), title="Profile", url_path="profile"),
        st.Page(str(VIEWS / "export.py"), title="Export", url_path="export"),
    ]
    nav = st.navigation(pages, position="top")
    autosave_offer_ui()
    state.show_flash()
    nav.run()


main()
