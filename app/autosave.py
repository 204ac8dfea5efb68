"""Autosave of the current plan and where its model came from, so a reload or crash loses nothing.

The file lives in the working directory (`.stagewise_autosave.json`, or the
path in the STAGEWISE_AUTOSAVE environment variable) and is rewritten
atomically after every edit. No streamlit here.
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

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.saved_at))
        return f"{Path(self.model_path).name}, {len(self.plan.stages)} stages, N={self.plan.n_members}, saved {when}"


def save(plan: Plan, model_path: str, weights: tuple[str, ...] = (), path: Path | None = None, *,
         trust_archive: bool = False, archive_sha256: str = "") -> Path:
    """Write the record atomically (two app sessions saving at once never collide); returns the file written.

    trust_archive is recorded only with the archive_sha256 (see `archive_sha256()`) of the bytes the
    user trusted: without a digest there is nothing to check a restore against, so it is not recorded.

    Raises:
        OSError when the file cannot be written (app.state turns it into a warning); no temp file is left behind.
    """
    path = Path(path or autosave_path())
    trusted = bool(trust_archive and archive_sha256)
    record = {"format": FORMAT, "saved_at": time.time(), "model_path": str(model_path),
              "weights": [str(w) for w in weights], "plan": plan.to_json(),
              "trust_archive": trusted, "archive_sha256": archive_sha256 if trusted else ""}
    return write_atomic(path, json.dumps(record, sort_keys=True, indent=2) + "\n")


def load(path: Path | None = None) -> AutosaveRecord | None:
    """The saved record, or None when there is none or the user dismissed it; raises PlanFileError when damaged."""
    path = path or autosave_path()
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if isinstance(d, dict) and d.get("dismissed") is True:
            return None
        plan = Plan.loads(json.dumps(d["plan"]), source=str(path))  # loads names the file in every PlanFileError
        return AutosaveRecord(plan, str(d["model_path"]), tuple(str(w) for w in d.get("weights", [])),
                              float(d.get("saved_at", 0.0)), d.get("trust_archive") is True,
                              str(d.get("archive_sha256") or ""))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # Plan.from_json's PlanFileError passes through
        raise PlanFileError(f"autosave file {path} is damaged ({e!r}); delete it or discard it in the app") from None


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


def dismiss(path: Path | None = None) -> None:
    """Mark the saved record dismissed (load() then offers nothing) until the next save() replaces it.

    The plan stays in the file: dismissing an offer is not deleting the user's work.
    """
    path = Path(path or autosave_path())
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # gone, or damaged (load() reports that): nothing to mark
    if isinstance(d, dict):
        d["dismissed"] = True
        write_atomic(path, json.dumps(d, sort_keys=True, indent=2) + "\n")


def discard(path: Path | None = None) -> None:
    path = path or autosave_path()
    path.unlink(missing_ok=True)
