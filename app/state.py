"""Session state and cached model loading: the one place pages read and change what is loaded.

Session state holds only plain data: a ModelRef (where the model came from),
the edit History of plans, the selection (node names / stage ids) and messages.
The traced ModelGraph lives only inside `loaded()`, a st.cache_resource keyed
by the model's content digest.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import streamlit as st

from stagewise import planner
from stagewise.app import autosave, jobs
from stagewise.app import graph_view as gv
from stagewise.app.history import History
from stagewise.app.launch import LOCAL_HOSTS, MODEL_ENV, NO_TOKEN_ENV, OPEN_ENV, REPO_ROOT, TOKEN_ENV
from stagewise.planner.errors import PlanMismatchError, StagewiseError
from stagewise.planner.plan import Plan

SAMPLES_DIR = REPO_ROOT / "sample_models"
DEFAULT_SAMPLE = "transformer_block.py"  # several stages and an excluded one: shows what the app is for
DEFAULT_N = 8
ACCESS_KEY = "access_granted"  # session-state flag: this browser session presented the token
JOB_PARAM = "job"  # the address keeps the running job's id, so a reload finds the job again


class AccessError(StagewiseError):
    """This browser session has not presented the app's access token, or uploads have no private place."""


@dataclass(frozen=True)
class ModelRef:
    """Where the current model came from (plain data, safe in session state)."""

    path: str  # .py model file or .pt2 archive
    weights: tuple[str, ...] = ()  # one weight file per member, in member order
    label: str = ""  # what the user called it (upload name or sample name)
    trust_archive: bool = False  # the user allowed this .pt2 archive to unpickle (run code)
    trusted_sha256: str = ""  # sha256 of the archive's bytes when trusted (open_model sets it); an autosave trusts only these
    opened: tuple[str, ...] = ()  # leaf modules traced inside (planner.trace's open_modules; app/open_view.py)

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
def _load(path: str, weights: tuple[str, ...], digest: str, trust_archive: bool = False, opened: tuple[str, ...] = ()) -> Loaded:
    src = planner.load_source(path, list(weights) or None, trust_archive=trust_archive)
    graph = planner.trace(src.model, src.example_inputs, open_modules=opened)
    return Loaded(src, graph, gv.graph_data(graph))


def loaded(ref: ModelRef) -> Loaded:
    return _load(ref.path, ref.weights, ref.digest(), ref.trust_archive, ref.opened)


@st.cache_resource(max_entries=32)
def _view(path: str, weights: tuple[str, ...], digest: str, trust_archive: bool,
          collapsed: tuple[str, ...], unfolded: tuple[str, ...], opened: tuple[str, ...] = ()) -> gv.ViewGraph:
    data = _load(path, weights, digest, trust_archive, opened).data
    return gv.collapse(data, collapsed, unfolded)


def view_of(ref: ModelRef, collapsed: Sequence[str] = (), unfolded: Sequence[str] = ()) -> gv.ViewGraph:
    """The drawn graph (collapsed modules, folded repeats), cached per model digest and view choice.
    Its layout is cached by app.dot_layout per drawn graph (edits to the plan never move a node)."""
    return _view(ref.path, ref.weights, ref.digest(), ref.trust_archive, tuple(sorted(collapsed)), tuple(sorted(unfolded)),
                 ref.opened)


# -- access: the token `stagewise ui` made (app/launch.py) ---------------------------------


def _host_name(host_header: str | None) -> str | None:
    """The lower-case host name of a Host header ("127.0.0.1:8501" -> "127.0.0.1"); None when there is none."""
    if not host_header:
        return None
    try:
        return (urlsplit(f"//{host_header}").hostname or "").rstrip(".")
    except ValueError:  # a malformed port or bracket: not a name we serve
        return ""


def access_refusal() -> str | None:
    """Why this browser session may not use the app, or None when it may (and is now let in).

    The rule: the session's Host header, when it sends one, names this machine
    (127.0.0.1 / localhost; a browser on a DNS-rebound name sends that name), and
    - the app has a token ($STAGEWISE_UI_TOKEN, which `stagewise ui` sets): the session
      presented it once as ?token=...; it is remembered in session state, so page links
      that drop the query string keep working;
    - the app has no token (`streamlit run app/main.py`): refused, unless
      $STAGEWISE_UI_NO_TOKEN is "1", an explicit choice to run without one.
    """
    host = _host_name(st.context.headers.get("Host"))
    if host is not None and host not in LOCAL_HOSTS:
        return (f"this app only answers on {' or '.join(LOCAL_HOSTS)}, and this page came from {host!r}; "
                "open the address `stagewise ui` printed (`http://127.0.0.1:PORT/?token=...`)")
    if ss().get(ACCESS_KEY):
        return None
    expected = os.environ.get(TOKEN_ENV, "")
    if not expected:
        if os.environ.get(NO_TOKEN_ENV) == "1":
            ss()[ACCESS_KEY] = True
            return None
        return ("this app was started without an access token, so it does nothing: start it with "
                f"`stagewise ui` and open the address it prints (or set {NO_TOKEN_ENV}=1 to run it without one)")
    given = st.query_params.get("token")
    if not given:
        return ("this page was opened without the app's access token: open the address `stagewise ui` printed "
                "in its terminal (`http://127.0.0.1:PORT/?token=...`)")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return ("the token in this address is not this app's: open the address the running `stagewise ui` "
                "printed in its terminal (each start makes a new token)")
    ss()[ACCESS_KEY] = True
    return None


def require_access() -> None:
    """Raise AccessError unless this session presented the token (a second lock behind main.py's check)."""
    if not ss().get(ACCESS_KEY):
        raise AccessError("this browser session has not presented the app's access token; "
                          "open the address `stagewise ui` printed")


def keep_token_in_address() -> None:
    """Put the token back into the address bar after a page link dropped it, so a reload still gets in."""
    token = os.environ.get(TOKEN_ENV)
    if token and ss().get(ACCESS_KEY) and st.query_params.get("token") != token:
        st.query_params["token"] = token
    job = ss().get("job")  # page links drop the query string too: keep the running job's id for a reload
    if job is not None and ss().get(ACCESS_KEY) and st.query_params.get(JOB_PARAM) != job.id:
        st.query_params[JOB_PARAM] = job.id


def forget_job_in_address() -> None:
    """The job is over (finished, failed or cancelled): a reload has nothing to find."""
    if JOB_PARAM in st.query_params:
        del st.query_params[JOB_PARAM]


def resume_job() -> None:
    """Find the job whose id the address kept (a reload during a profile) and make it this session's job again.

    The id must name a job folder of the app's private jobs directory (jobs.find); anything else is refused
    with a message and dropped from the address.
    """
    job_id = st.query_params.get(JOB_PARAM)
    if not job_id or ss().get("job") is not None:
        return
    try:
        job = jobs.find(job_id)
    except StagewiseError as e:
        forget_job_in_address()
        flash("error", f"not resuming a job: {e}")
        return
    ss().job = job
    try:  # the plan it runs on, so a finished profile is attached when that plan is (again) the present one
        ss().job_plan = Plan.from_json(json.loads((job.path / "request.json").read_text())["plan"],
                                       source="the job's request").dumps()
    except (OSError, ValueError, KeyError, StagewiseError):
        ss().job_plan = None
    flash("info", f"found the {job.task} job {job.id} that was running before the reload")


# -- uploads: a private per-user directory ---------------------------------------------------


def upload_root() -> Path:
    """Where uploads are kept: $XDG_CACHE_HOME/stagewise/uploads (default ~/.cache/...), mode 0700.

    Kept across restarts so an autosave can find the uploaded model it refers to.
    Raises AccessError when the directory (or its parent) is not this user's alone:
    another user able to write there could swap in a model file of their own.
    """
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base.mkdir(parents=True, exist_ok=True)
    root = base / "stagewise" / "uploads"
    for d, others_may in ((root.parent, 0o055), (root, 0)):  # others may list .../stagewise, never write it
        d.mkdir(mode=0o700, exist_ok=True)
        _check_private(d, others_may)
    return root


def _check_private(d: Path, others_may: int = 0) -> None:
    """Raise AccessError unless `d` is a real directory of this user that others can use only as `others_may` allows."""
    info = os.lstat(d)
    if not stat.S_ISDIR(info.st_mode):
        raise AccessError(f"upload directory {d} is not a directory (a link or a file); delete it and load again")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise AccessError(f"upload directory {d} belongs to another user (uid {info.st_uid}); "
                          "delete it, or set XDG_CACHE_HOME to a directory of your own")
    if info.st_mode & 0o077 & ~others_may:
        raise AccessError(f"upload directory {d} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
                          f"run `chmod 700 {d}` (or delete it) and load again")


def new_upload_dir() -> Path:
    """A fresh, uniquely named directory (mode 0700) for the files of one upload."""
    require_access()
    return Path(tempfile.mkdtemp(prefix="upload-", dir=upload_root()))


def _safe_name(name: str) -> str:
    """The last component of an uploaded file's name, without path parts or leading dots."""
    base = re.split(r"[/\\]", name)[-1].strip().lstrip(".")
    return base or "upload"


def save_upload(directory: Path, name: str, data: bytes) -> str:
    """Write an uploaded file into `directory` (from new_upload_dir) as a new file, mode 0600; returns its path.

    Never opens an existing file: a second file of the same name gets a numbered name.
    """
    require_access()
    stem, dot, ext = _safe_name(name).rpartition(".")
    base = _safe_name(name)
    for i in range(1000):
        p = directory / (base if i == 0 else (f"{stem}-{i}.{ext}" if dot else f"{base}-{i}"))
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return str(p)
    raise AccessError(f"more than 1000 uploaded files named {base!r} in one upload; rename them")


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

    The user's edited plan is never thrown away by opening a model: an autosave holding work (edits,
    a profile report) is not overwritten until the first edit of the new model, and then it is kept
    beside the new one (autosave's "earlier"). When the file holds an edited plan for the model just
    opened (the same fingerprint: opened again, or uploaded again after its file moved), it is offered
    back. save=False (the model the app opens on) leaves the autosave alone until the user edits.
    """
    ref = _pin_trust(ref)

    def go() -> tuple[Loaded, Plan]:
        require_access()
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
    _offer_saved_plan_here()
    if save and not _autosave_holds_work():
        save_autosave()
    return True


def _autosave_holds_work() -> bool:
    """Whether the latest autosave holds work a fresh proposal must not overwrite (a damaged file counts:
    it is left for the user to look at, and the first edit replaces it as before)."""
    try:
        rec = autosave.load()
    except StagewiseError:
        return True
    return rec is not None and rec.edited


def _offer_saved_plan_here() -> None:
    """After opening a model: offer the autosaved edited plan of this model (same fingerprint), if any.

    An autosave that equals the plan just opened except for its profile report gives the report back
    (attached to the plan) instead of an offer. An offer made for the previous model is dropped: its
    Restore would apply it to this one.
    """
    if ss().get("autosave_offer_here"):
        ss().autosave_offer, ss().autosave_offer_here = None, False
    h = history()
    if h is None:
        return
    rec = autosave.saved_for(h.present.fingerprint)
    if rec is None:
        return
    if _without_profile(rec.plan) == _without_profile(h.present):
        _attach_saved_profile(rec.plan)
        return
    ss().autosave_offer, ss().autosave_offer_here = rec, True


def _attach_saved_profile(saved: Plan) -> None:
    """Attach the profile report of an autosaved plan equal to the present one (profile aside), when it has one."""
    h = history()
    if h is not None and saved.profile is not None and h.present.profile is None:
        h.replace_present(h.entries[h.cursor][0], h.present.with_profile(saved.profile))


def _pin_trust(ref: ModelRef) -> ModelRef:
    """`ref` with the sha256 of the archive it trusts, read now, at the moment the user trusted it."""
    if not ref.trust_archive or ref.trusted_sha256:
        return ref
    try:
        return replace(ref, trusted_sha256=autosave.archive_sha256(ref.path))
    except OSError:  # unreadable: loading it reports that; an autosave without a digest restores untrusted
        return ref


def _install(ref: ModelRef, history: History, data: gv.GraphData) -> None:
    """Make `ref` the current model with this history; fresh selection and view (big graphs open collapsed)."""
    ss().model_ref = ref
    ss().history = history
    ss().selection = []
    depth = gv.auto_collapse(data) if len(data.nodes) > gv.AUTO_COLLAPSE_NODES else 0
    ss().collapse_depth = depth  # what the "collapse all at depth" control shows; `collapsed` is the truth
    ss().collapsed = gv.boxes_at_depth(data, depth) if depth else []
    ss().unfolded = []
    bump_view()


def bump_view() -> None:
    """New chart widget key: the Plotly selection of the previous plan does not carry over."""
    ss().view_version = ss().get("view_version", 0) + 1


def save_autosave() -> None:
    h, ref = history(), model_ref()
    if h is None or ref is None:
        return
    p = h.present
    # work worth keeping: anything but the proposed plan as it was opened (a profile report counts)
    edited = _without_profile(p) != _without_profile(h.base) or p.profile is not None
    try:
        autosave.save(p, ref.path, ref.weights, trust_archive=ref.trust_archive, archive_sha256=ref.trusted_sha256,
                      edited=edited)
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
    jobs.clean_orphans()  # folders of jobs whose result was read, or a day old
    try:
        latest = autosave.load()
    except StagewiseError as e:
        latest = None
        flash("warning", str(e))
    path = default_model_path()
    if path:
        opened = tuple(json.loads(os.environ.get(OPEN_ENV) or "[]")) if path == os.environ.get(MODEL_ENV) else ()
        open_model(ModelRef(path, label=Path(path).name, opened=opened), DEFAULT_N, save=False)
    if latest is not None:  # else an offer open_model made for the model opened (an earlier record) stands
        # an autosave equal to the plan just opened (profile aside) is nothing to restore; its profile report is kept
        if plan() is not None and _without_profile(latest.plan) == _without_profile(plan()) and not latest.weights:
            _attach_saved_profile(latest.plan)
            ss().autosave_offer, ss().autosave_offer_here = None, False
        else:  # the latest work, restored from its own files (with its weights), is what a reload offers
            ss().autosave_offer, ss().autosave_offer_here = latest, False
    resume_job()


def _without_profile(p: Plan) -> Plan:
    return p.with_profile(None)


def restore_autosave() -> None:
    """Callback: load the autosaved plan and its model; the restored plan is one undoable step.

    An offer made when a model was opened (autosave_offer_here) applies to that model as it is
    open now (its file may have moved since the plan was saved).
    """
    rec = ss().get("autosave_offer")
    here = bool(ss().get("autosave_offer_here"))
    ss().autosave_offer, ss().autosave_offer_here = None, False
    if rec is None:
        return
    if here and history() is not None and model_ref() is not None:
        _restore_here(rec)
        return
    ref = ModelRef(rec.model_path, rec.weights, label=Path(rec.model_path).name, opened=rec.plan.opened_modules)
    gone = [p for p in (ref.path, *ref.weights) if not Path(p).is_file()]
    if gone:
        flash("error", f"restoring the autosaved plan: its model file{'s' if len(gone) > 1 else ''} "
                       f"{', '.join(gone)} {'are' if len(gone) > 1 else 'is'} gone (moved or deleted since the plan was "
                       "saved); open or upload the model again on the Model page and the app offers this plan for it "
                       "(the autosave keeps it until then)")
        return
    if rec.trust_archive:
        if _still_trusted(rec):
            ref = replace(ref, trust_archive=True, trusted_sha256=rec.archive_sha256)
        else:
            flash("warning", f"restoring the autosaved plan: {ref.name} was trusted when it was saved, but the file "
                             "has changed since, so it is opened untrusted (its code does not run); if you trust "
                             "the new file, upload it again and tick 'Trust this archive'")

    def go() -> tuple[Plan, Plan]:
        require_access()
        m = loaded(ref)
        restored = _fitting(rec, m.graph, ref)
        proposed = planner.propose(m.graph, rec.plan.n_members, {i.name: i.mode for i in rec.plan.inputs}, model=ref.name)
        return proposed, restored

    result = guarded("restoring the autosaved plan", go)
    if result is None:
        return
    proposed, restored = result
    restored_history = History.start(proposed)
    restored_history.push("restored autosave", restored)
    _install(ref, restored_history, loaded(ref).data)
    save_autosave()
    flash("success", f"restored the autosaved plan ({len(restored.stages)} stages) for {ref.name}")


def _fitting(rec: autosave.AutosaveRecord, graph: Any, ref: ModelRef) -> Plan:
    """The autosaved plan, checked against the model as open now; the refusals name what to do in the app."""
    if rec.plan.fingerprint != graph.fingerprint or tuple(rec.plan.opened_modules) != tuple(graph.opened_modules):
        raise PlanMismatchError(
            f"{ref.name} changed since the plan was saved (its fingerprint is {graph.fingerprint} now, the plan's "
            f"{rec.plan.fingerprint}), so the saved stages no longer fit it; open it on the Model page and edit the "
            "plan proposed for it (the autosave keeps the old plan)")
    if ref.weights and rec.plan.n_members != len(ref.weights):  # the rule model_page._set_n applies to N
        raise PlanMismatchError(
            f"the autosaved plan is for N={rec.plan.n_members} members, but {len(ref.weights)} weight files are "
            f"loaded; upload {rec.plan.n_members} weight files (one per member) with the model on the Model page, "
            "or dismiss the offer")
    return planner.validate(rec.plan, graph)


def _restore_here(rec: autosave.AutosaveRecord) -> None:
    """Restore `rec` onto the model open now (one undoable step on its history)."""
    h, ref = history(), model_ref()

    def go() -> Plan:
        require_access()
        return _fitting(rec, loaded(ref).graph, ref)

    restored = guarded("restoring the autosaved plan", go)
    if restored is None:
        return
    h.push("restored autosave", restored)
    ss().selection = []
    bump_view()
    save_autosave()
    flash("success", f"restored the autosaved plan ({len(restored.stages)} stages) for {ref.name}")


def _still_trusted(rec: autosave.AutosaveRecord) -> bool:
    """Whether the archive at the autosaved path still has the bytes the user trusted (hashed afresh)."""
    if not rec.archive_sha256:
        return False
    try:
        now = autosave.archive_sha256(rec.model_path)
    except OSError:
        return False
    return hmac.compare_digest(now, rec.archive_sha256)


def dismiss_autosave() -> None:
    """Callback: drop the offer for good: a reload or a new session does not offer this autosave again."""
    rec = ss().get("autosave_offer")
    here = bool(ss().get("autosave_offer_here"))
    ss().autosave_offer, ss().autosave_offer_here = None, False
    if rec is not None:
        autosave.dismiss(fingerprint=rec.plan.fingerprint if here else None)


def user_paths(ref: ModelRef) -> tuple[str, tuple[str, ...]]:
    """(model path, weight paths) as the user knows them: an upload's own file names, not the app's private copy."""
    try:
        uploaded = Path(ref.path).resolve().is_relative_to(upload_root().resolve())
    except (OSError, AccessError):
        uploaded = False
    if not uploaded:
        return ref.path, ref.weights
    return ref.name, tuple(Path(w).name for w in ref.weights)
