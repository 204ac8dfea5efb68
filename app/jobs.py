"""Background jobs in worker processes (app.worker), tracked by plain job records. No streamlit here.

The app keeps a `Job` (paths and a pid) in session state; the Popen handles
live in a module-level registry so finished children are reaped.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagewise.app.launch import REPO_ROOT, environment

_PROCS: dict[str, subprocess.Popen] = {}


@dataclass(frozen=True)
class Job:
    id: str
    dir: str
    task: str
    started: float

    @property
    def path(self) -> Path:
        return Path(self.dir)


def start(task: str, model_path: str, weights: tuple[str, ...], plan_json: dict, device: str, ns: list[int],
          *, trust_archive: bool = False, **options: Any) -> Job:
    """Spawn `python -m stagewise.app.worker` for this request (options: autotune, compile_baseline); returns at once.

    trust_archive: the user's "Trust this archive" choice for a `.pt2` model (ModelRef.trust_archive);
    the worker passes it to planner.load_source, so an untrusted archive that needs unpickling is refused.
    """
    d = Path(tempfile.mkdtemp(prefix=f"stagewise_{task}_"))
    (d / "request.json").write_text(json.dumps({"task": task, "model_path": model_path, "weights": list(weights),
                                                "plan": plan_json, "device": device, "ns": ns,
                                                "trust_archive": bool(trust_archive), **options}))
    log = open(d / "log.txt", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "stagewise.app.worker", str(d)], cwd=str(REPO_ROOT), env=environment(),
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    job = Job(id=d.name, dir=str(d), task=task, started=time.time())
    _PROCS[job.id] = proc
    return job


def progress(job: Job) -> tuple[float, str]:
    """Latest (fraction, message) the worker reported."""
    p = job.path / "progress.jsonl"
    if not p.is_file():
        return 0.0, "starting the worker process"
    entries = _complete_entries(p.read_text())
    if not entries:
        return 0.0, "starting"
    last = entries[-1]
    frac = next((e["fraction"] for e in reversed(entries) if e.get("fraction") is not None), 0.0)
    return float(frac or 0.0), str(last.get("message", ""))


def _complete_entries(text: str) -> list[dict]:
    """The progress lines the worker has finished writing (a line without its newline may still be growing)."""
    out = []
    for ln in text.split("\n")[:-1]:  # what follows the last newline is unfinished (or empty)
        try:
            entry = json.loads(ln)
        except ValueError:  # not ours to crash on: the worker writes whole lines, so skip anything else
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def result(job: Job) -> dict[str, Any] | None:
    """The worker's result when it has finished; a crash (no result file) becomes an error result."""
    rp = job.path / "result.json"
    proc = _PROCS.get(job.id)
    code = proc.poll() if proc is not None else None
    if rp.is_file():
        if proc is not None and code is not None:
            _PROCS.pop(job.id, None)
        return json.loads(rp.read_text())
    if proc is None:  # the app restarted: we cannot tell if it still runs, and no result came
        return {"ok": False, "error": "the worker is gone (the app was restarted); run it again", "reports": []}
    if code is None:
        return None
    _PROCS.pop(job.id, None)
    tail = (job.path / "log.txt").read_text(errors="replace")[-2000:] if (job.path / "log.txt").is_file() else ""
    return {"ok": False, "error": f"the worker process died (exit code {code}) before finishing; the plan is unchanged. "
                                  f"Last output:\n{tail}", "reports": []}


def cleanup(job: Job) -> None:
    """Remove the job's folder once its result has been read."""
    shutil.rmtree(job.dir, ignore_errors=True)


def cancel(job: Job) -> None:
    proc = _PROCS.pop(job.id, None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    cleanup(job)
