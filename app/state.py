"""Session state and cached model loading: the one place pages read and change what is loaded.

Session state holds only plain data: a ModelRef (where the model came from),
the edit History of plans, the selection (node names / stage ids) and messages.
The traced ModelGraph lives only inside `loaded()`, a st.cache_resource keyed
by the model's content digest.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import streamlit as st

import planner
from app import autosave
from app import graph_view as gv
from app.history import History
from app.launch import MODEL_ENV, REPO_ROOT
from planner.errors import StagewiseError
from planner.plan import Plan

SAMPLES_DIR = REPO_ROOT / "sample_models"
DEFAULT_SAMPLE = "transformer_block.py"  # several stages and an excluded one: shows what the app is for
DEFAULT_N = 8
UPLOAD_DIR = Path(tempfile.gettempdir()) / "stagewise_uploads"


@dataclass(frozen=True)
class ModelRef:
    """Where the current model came from (plain data, safe in session state)."""

    path: str  # .py model file or .pt2 archive
    weights: tuple[str, ...] = ()  # one weight file per member, in member order
    label: str = ""  # what the user called it (upload name or sample name)

    @property
    def name(self) -> str:
        return self.label or Path(self.path).name

    def digest(self) -> str:
        """Content hash of model and weight files: the cache key, so an edited file is traced again.

        Pages ask for it several times per rerun; each file is read and hashed again
        only when its size or modification time changed (weights can be large).
        """
        h = hashlib.sha256()
        for p in (self.path, *self.weights):
            h.update(p.encode())
            try:
                info = os.stat(p)
                h.update(_file_digest(p, info.st_mtime_ns, info.st_size))
            except OSError:
                h.update(b"<missing>")
        return h.hexdigest()[:20]


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> bytes:
    """sha256 of a file's bytes, remembered per (path, mtime, size)."""
    return hashlib.sha256(Path(path).read_bytes()).digest()


@dataclass(frozen=True)
class Loaded:
    """A model as the cache holds it. `graph` (fx + networkx) never leaves the cache's callers."""

    source: Any  # planner.ModelSource
    graph: Any  # planner.ModelGraph
    data: gv.GraphData


@st.cache_resource(max_entries=8, show_spinner="Loading and tracing the model…")
def _load(path: str, weights: tuple[str, ...], digest: str) -> Loaded:
    src = planner.load_source(path, list(weights) or None)
    graph = planner.trace(src.model, src.example_inputs)
    return Loaded(src, graph, gv.graph_data(graph))


def loaded(ref: ModelRef) -> Loaded:
    return _load(ref.path, ref.weights, ref.digest())


@st.cache_resource(max_entries=32)
def _view(path: str, weights: tuple[str, ...], digest: str, collapsed: tuple[str, ...]) -> tuple[gv.ViewGraph, dict]:
    data = _load(path, weights, digest).data
    view = gv.collapse(data, collapsed)
    return view, gv.view_layout(view)


def view_and_layout(ref: ModelRef, collapsed: Sequence[str]) -> tuple[gv.ViewGraph, dict]:
    """The drawn graph and its layout, cached per model digest and collapse choice."""
    return _view(ref.path, ref.weights, ref.digest(), tuple(sorted(collapsed)))


# -- session ----------------------------------------------------------------------------


def ss() -> Any:
    return st.session_state


def flash(kind: str, text: str) -> None:
    """Queue a message ("error", "warning", "success", "info") shown once at the top of the next page."""
    ss().setdefault("flash", []).append((kind, text))


def show_flash() -> None:
    for kind, text in ss().pop("flash", []):
        getattr(st, kind)(text)


def history() -> History | None:
    return ss().get("history")


def plan() -> Plan | None:
    h = history()
    return h.present if h else None


def model_ref() -> ModelRef | None:
    return ss().get("model_ref")


def current() -> Loaded | None:
    ref = model_ref()
    return loaded(ref) if ref else None


def loaded_or_notice() -> tuple[History, ModelRef] | None:
    """(history, model ref) of the loaded model; None, after telling the user to open one, when there is none."""
    h, ref = history(), model_ref()
    if h is None or ref is None:
        st.info("No model is loaded. Open one on the Model page.")
        return None
    return h, ref


def default_model_path() -> str | None:
    env = os.environ.get(MODEL_ENV)
    if env:
        return env
    preferred = SAMPLES_DIR / DEFAULT_SAMPLE
    if preferred.is_file():
        return str(preferred)
    samples = sample_paths()
    return samples[0] if samples else None


def sample_paths() -> list[str]:
    if not SAMPLES_DIR.is_dir():
        return []
    return sorted(str(p) for p in SAMPLES_DIR.iterdir() if p.suffix in (".py", ".pt2") and not p.name.startswith("_"))


def save_upload(name: str, data: bytes) -> str:
    """Keep an uploaded file on disk (content-addressed), so the planner can import it and autosave can find it."""
    digest = hashlib.sha256(data).hexdigest()[:16]
    d = UPLOAD_DIR / digest
    d.mkdir(parents=True, exist_ok=True)
    p = d / Path(name).name
    if not p.is_file():
        p.write_bytes(data)
    return str(p)


def guarded(what: str, fn: Callable[[], Any]) -> Any:
    """Run fn; on a library error (or a crash in user model code) flash it and return None, keeping the state."""
    try:
        return fn()
    except StagewiseError as e:
        flash("error", f"{what}: {e}")
    except Exception as e:  # user model code can raise anything; show it, keep the app and the plan alive
        flash("error", f"{what} failed unexpectedly ({type(e).__name__}: {e}); if the model file is fine, please report this")
    return None


def open_model(ref: ModelRef, n_members: int, input_mode: Any = "shared", *, save: bool = True) -> bool:
    """Load, trace and propose for `ref`; on error keep the previous model and plan. Returns success.

    save=False (the model the app opens on) leaves an existing autosave alone until the user edits.
    """

    def go() -> tuple[Loaded, Plan]:
        m = loaded(ref)
        n = len(ref.weights) if ref.weights else n_members
        if ref.weights:
            m.source.members(n)  # weights that do not fit the architecture fail here, not later
        return m, planner.propose(m.graph, n, input_mode, model=ref.name)

    result = guarded(f"loading {ref.name}", go)
    if result is None:
        return False
    m, proposed = result
    _install(ref, History.start(proposed), m.data)
    if save:
        save_autosave()
    return True


def _install(ref: ModelRef, history: History, data: gv.GraphData) -> None:
    """Make `ref` the current model with this history; fresh selection and view (big graphs open collapsed)."""
    ss().model_ref = ref
    ss().history = history
    ss().selection = []
    ss().collapsed = []
    ss().collapse_depth = gv.auto_collapse(data) if len(data.nodes) > gv.AUTO_COLLAPSE_NODES else 0
    bump_view()


def bump_view() -> None:
    """New chart widget key: the Plotly selection of the previous plan does not carry over."""
    ss().view_version = ss().get("view_version", 0) + 1


def save_autosave() -> None:
    p, ref = plan(), model_ref()
    if p is None or ref is None:
        return
    try:
        autosave.save(p, ref.path, ref.weights)
    except OSError as e:
        flash("warning", f"could not autosave the plan to {autosave.autosave_path()} ({e.strerror}); export it by hand")


def commit(label: str, new: Plan) -> None:
    """Record an edit: push to history, autosave, clear the selection, say what happened."""
    h = history()
    assert h is not None, "commit without a loaded plan"
    h.push(label, new)
    ss().selection = []
    bump_view()
    save_autosave()
    flash("success", f"{label} → {len(new.stages)} stages")


def init() -> None:
    """First run of a session: check for an autosave, open the default model."""
    if ss().get("initialised"):
        return
    ss().initialised = True
    ss().setdefault("selection", [])
    try:
        ss().autosave_offer = autosave.load()
    except StagewiseError as e:
        ss().autosave_offer = None
        flash("warning", str(e))
    path = default_model_path()
    if path:
        open_model(ModelRef(path, label=Path(path).name), DEFAULT_N, save=False)
    offer = ss().get("autosave_offer")
    # an autosave equal to the plan just opened (profile aside) is nothing to restore
    if offer is not None and plan() is not None and _without_profile(offer.plan) == _without_profile(plan()) and not offer.weights:
        ss().autosave_offer = None


def _without_profile(p: Plan) -> Plan:
    return p.with_profile(None)


def restore_autosave() -> None:
    """Callback: load the autosaved plan and its model; the restored plan is one undoable step."""
    rec = ss().get("autosave_offer")
    ss().autosave_offer = None
    if rec is None:
        return
    ref = ModelRef(rec.model_path, rec.weights, label=Path(rec.model_path).name)

    def go() -> tuple[Plan, Plan]:
        m = loaded(ref)
        restored = planner.validate(rec.plan, m.graph)
        proposed = planner.propose(m.graph, rec.plan.n_members, {i.name: i.mode for i in rec.plan.inputs}, model=ref.name)
        return proposed, restored

    result = guarded("restoring the autosaved plan", go)
    if result is None:
        return
    proposed, restored = result
    history = History.start(proposed)
    history.push("restored autosave", restored)
    _install(ref, history, loaded(ref).data)
    save_autosave()
    flash("success", f"restored the autosaved plan ({len(restored.stages)} stages) for {ref.name}")


def dismiss_autosave() -> None:
    ss().autosave_offer = None
