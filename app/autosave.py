"""Autosave of the current plan and where its model came from, so a reload or crash loses nothing.

The file lives in the working directory (`.stagewise_autosave.json`, or the
path in the STAGEWISE_AUTOSAVE environment variable) and is rewritten
atomically after every edit. No streamlit here.

The file's top level is the latest record (what a reload offers). Edited plans of other
models are kept beside it under "earlier", one per model fingerprint (newest first, at most
MAX_EARLIER): saving the plan of another model moves an edited record there instead of
overwriting it, and `saved_for` finds it when that model is opened again.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from stagewise.planner.errors import PlanFileError
from stagewise.planner.files import write_atomic
from stagewise.planner.plan import Plan

ENV_VAR = "STAGEWISE_AUTOSAVE"
DEFAULT_NAME = ".stagewise_autosave.json"
FORMAT = 1
MAX_EARLIER = 8  # edited plans of other models kept beside the latest record


def autosave_path() -> Path:
    return Path(os.environ.get(ENV_VAR) or Path.cwd() / DEFAULT_NAME)


@dataclass(frozen=True)
class AutosaveRecord:
    plan: Plan
    model_path: str  # the model file the plan was made for
    weights: tuple[str, ...]  # member weight files, or () for build_members / seeds
    saved_at: float  # unix time
    trust_archive: bool = False  # the user trusted the .pt2 model file (let it unpickle, i.e. run code)
    archive_sha256: str = ""  # sha256 of that file's bytes when it was trusted; trust holds only for those bytes
    # the plan holds the user's work (edits, a profile report), not only what propose gives; records written
    # before this was stored count as edited, so nothing they hold is overwritten unasked
    edited: bool = True

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.saved_at))
        return f"{Path(self.model_path).name}, {len(self.plan.stages)} stages, N={self.plan.n_members}, saved {when}"


def save(plan: Plan, model_path: str, weights: tuple[str, ...] = (), path: Path | None = None, *,
         trust_archive: bool = False, archive_sha256: str = "", edited: bool = True) -> Path:
    """Write the record atomically (two app sessions saving at once never collide); returns the file written.

    trust_archive is recorded only with the archive_sha256 (see `archive_sha256()`) of the bytes the
    user trusted: without a digest there is nothing to check a restore against, so it is not recorded.
    An edited record of another model (another plan fingerprint) already in the file is kept under
    "earlier" rather than overwritten; an edited record supersedes an earlier one of its own model.

    Raises:
        OSError when the file cannot be written (app.state turns it into a warning); no temp file is left behind.
    """
    path = Path(path or autosave_path())
    trusted = bool(trust_archive and archive_sha256)
    record = {"format": FORMAT, "saved_at": time.time(), "model_path": str(model_path),
              "weights": [str(w) for w in weights], "plan": plan.to_json(),
              "trust_archive": trusted, "archive_sha256": archive_sha256 if trusted else "", "edited": bool(edited)}
    earlier = _earlier_after(_read(path), plan.fingerprint, bool(edited))
    if earlier:
        record["earlier"] = earlier
    return write_atomic(path, json.dumps(record, sort_keys=True, indent=2) + "\n")


def _read(path: Path) -> dict | None:
    """The file's JSON object, or None when it is missing, unreadable or damaged (save then starts afresh)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def _fingerprint(d: dict) -> str | None:
    plan = d.get("plan")
    return str(plan.get("fingerprint")) if isinstance(plan, dict) and "fingerprint" in plan else None


def _earlier_after(old: dict | None, fingerprint: str, edited: bool) -> list[dict]:
    """The "earlier" list once a record for `fingerprint` becomes the latest one."""
    if old is None:
        return []
    earlier = [e for e in old.get("earlier", []) if isinstance(e, dict) and _fingerprint(e) is not None]
    if edited:  # the new record holds the latest work on this model
        earlier = [e for e in earlier if _fingerprint(e) != fingerprint]
    latest = {k: v for k, v in old.items() if k != "earlier"}
    fp = _fingerprint(latest)
    if fp is not None and fp != fingerprint and latest.get("edited", True):
        earlier = [latest] + [e for e in earlier if _fingerprint(e) != fp]
    return earlier[:MAX_EARLIER]


def _record(d: dict, path: Path) -> AutosaveRecord:
    """An AutosaveRecord from one record object; raises PlanFileError when damaged."""
    try:
        plan = Plan.loads(json.dumps(d["plan"]), source=str(path))  # loads names the file in every PlanFileError
        return AutosaveRecord(plan, str(d["model_path"]), tuple(str(w) for w in d.get("weights", [])),
                              float(d.get("saved_at", 0.0)), d.get("trust_archive") is True,
                              str(d.get("archive_sha256") or ""), d.get("edited", True) is not False)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # Plan.from_json's PlanFileError passes through
        raise PlanFileError(f"autosave file {path} is damaged ({e!r}); delete it or discard it in the app") from None


def load(path: Path | None = None) -> AutosaveRecord | None:
    """The latest record, or None when there is none or the user dismissed it; raises PlanFileError when damaged."""
    path = path or autosave_path()
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise PlanFileError(f"autosave file {path} is damaged ({e!r}); delete it or discard it in the app") from None
    if not isinstance(d, dict):
        raise PlanFileError(f"autosave file {path} is damaged (not a JSON object); delete it or discard it in the app")
    if d.get("dismissed") is True:
        return None
    return _record(d, path)


def saved_for(fingerprint: str, path: Path | None = None) -> AutosaveRecord | None:
    """The newest edited, not dismissed record of the model with this plan fingerprint, or None.

    What the app offers back when that model is opened again (after another model's plan took the
    latest place, or after its file moved and was opened from its new place). Damaged records are skipped.
    """
    path = path or autosave_path()
    d = _read(path)
    if d is None:
        return None
    for e in [{k: v for k, v in d.items() if k != "earlier"}, *d.get("earlier", [])]:
        if not isinstance(e, dict) or _fingerprint(e) != fingerprint or e.get("dismissed") is True \
                or e.get("edited", True) is False:
            continue
        try:
            return _record(e, path)
        except PlanFileError:
            continue
    return None


def archive_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read now.

    Not ModelRef.digest(): that one mixes in the weight files and remembers each file's hash
    per (path, mtime, size), so a file rewritten with its size and mtime kept would pass.

    Raises:
        OSError when the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dismiss(path: Path | None = None, fingerprint: str | None = None) -> None:
    """Mark a saved record dismissed (nothing offers it again) until a save replaces it.

    fingerprint None: the latest record; else the record of the model with that plan fingerprint
    (the latest one or one kept under "earlier"). The plan stays in the file: dismissing an offer
    is not deleting the user's work.
    """
    path = Path(path or autosave_path())
    d = _read(path)
    if d is None:
        return  # gone, or damaged (load() reports that): nothing to mark
    if fingerprint is None or _fingerprint(d) == fingerprint:
        d["dismissed"] = True
    else:
        for e in d.get("earlier", []):
            if isinstance(e, dict) and _fingerprint(e) == fingerprint:
                e["dismissed"] = True
                break
        else:
            return
    write_atomic(path, json.dumps(d, sort_keys=True, indent=2) + "\n")


def discard(path: Path | None = None) -> None:
    path = path or autosave_path()
    path.unlink(missing_ok=True)
