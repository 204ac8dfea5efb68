"""Background jobs in worker processes (app.worker), tracked by plain job records. No streamlit here.

Each job is a folder in the app's private jobs directory ($XDG_CACHE_HOME/stagewise/jobs,
mode 0700): request, progress, log, result and job.json (task, start time, worker pid).
The folder's name is the job id; a browser keeps it in the address so a reload finds
the job again (`find` accepts only ids naming a folder of that directory). The Popen
handles live in a module-level registry, and a waiter thread per worker reaps it the
moment it exits, so no finished worker is left as a zombie even when nobody polls.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagewise.app.launch import REPO_ROOT, environment
from stagewise.planner.errors import StagewiseError

TASKS = ("profile", "verify")
JOB_ID = re.compile(r"(profile|verify)-[a-z0-9_]{8}")  # what tempfile.mkdtemp(prefix=f"{task}-") names
ORPHAN_AGE_S = 24 * 3600  # a job folder this old is left over from an earlier run of the app
READ_MARK = "result_read"  # written once the app has read the result: the folder is garbage from then on
_PROCS: dict[str, subprocess.Popen] = {}


class JobError(StagewiseError):
    """A job id that names no job of this app (forged, mistyped, or already cleaned up), or no private jobs place."""


@dataclass(frozen=True)
class Job:
    id: str
    dir: str
    task: str
    started: float
    pid: int = 0  # the worker's process id (0: unknown)

    @property
    def path(self) -> Path:
        return Path(self.dir)


def jobs_root() -> Path:
    """The app's private jobs directory, $XDG_CACHE_HOME/stagewise/jobs (default ~/.cache/...), mode 0700.

    Raises JobError when it (or .../stagewise) is a link, another user's, or writable by others:
    a job folder planted there could hand the app a result of someone else's making.
    """
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base.mkdir(parents=True, exist_ok=True)
    root = base / "stagewise" / "jobs"
    for d, others_may in ((root.parent, 0o055), (root, 0)):  # others may list .../stagewise, never write it
        d.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(d)
        if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()) \
                or info.st_mode & 0o077 & ~others_may:
            raise JobError(f"jobs directory {d} is not a private directory of this user (a link, another user's, "
                           f"or open to others: mode {stat.S_IMODE(info.st_mode):o}); delete it or run `chmod 700 {d}`")
    return root


def start(task: str, model_path: str, weights: tuple[str, ...], plan_json: dict, device: str, ns: list[int],
          *, trust_archive: bool = False, **options: Any) -> Job:
    """Spawn `python -m stagewise.app.worker` for this request (options: autotune, compile_baseline); returns at once.

    trust_archive: the user's "Trust this archive" choice for a `.pt2` model (ModelRef.trust_archive);
    the worker passes it to planner.load_source, so an untrusted archive that needs unpickling is refused.
    """
    if task not in TASKS:
        raise JobError(f"jobs.start({task!r}): the task is one of {', '.join(TASKS)}")
    d = Path(tempfile.mkdtemp(prefix=f"{task}-", dir=jobs_root()))
    (d / "request.json").write_text(json.dumps({"task": task, "model_path": model_path, "weights": list(weights),
                                                "plan": plan_json, "device": device, "ns": ns,
                                                "trust_archive": bool(trust_archive), **options}))
    log = open(d / "log.txt", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "stagewise.app.worker", str(d)], cwd=str(REPO_ROOT), env=environment(),
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    job = Job(id=d.name, dir=str(d), task=task, started=time.time(), pid=proc.pid)
    (d / "job.json").write_text(json.dumps({"task": task, "started": job.started, "pid": proc.pid}))
    _PROCS[job.id] = proc
    threading.Thread(target=proc.wait, name=f"reap {job.id}", daemon=True).start()  # reaped as soon as it exits
    return job


def find(job_id: str) -> Job:
    """The job whose id a browser kept (from `start`, in this or an earlier session of the app).

    Raises JobError unless `job_id` has the shape of a job id and names a real folder (not a link)
    directly inside jobs_root() that holds a job record: nothing from an address can point elsewhere.
    """
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise JobError(f"job id {str(job_id)[:80]!r} from the address is not a job id of this app "
                       "(like 'profile-ab12cd_9'); it was ignored")
    root = jobs_root()
    d = root / job_id
    try:
        info = os.lstat(d)
    except FileNotFoundError:
        raise JobError(f"no job {job_id} in the app's jobs directory (it finished and was cleaned up, or was "
                       "cancelled); run it again") from None
    if not stat.S_ISDIR(info.st_mode) or d.resolve().parent != root.resolve() \
            or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise JobError(f"job id {job_id} does not name a job folder of this app (a link or a file in "
                       f"{root}); it was ignored")
    try:
        rec = json.loads((d / "job.json").read_text())
        return Job(id=job_id, dir=str(d), task=str(rec["task"]), started=float(rec["started"]), pid=int(rec["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        raise JobError(f"job {job_id} has no readable job record; it was ignored") from None


def running(job: Job) -> bool:
    """Whether the job's worker process still runs (ours, or one an earlier app process started)."""
    proc = _PROCS.get(job.id)
    if proc is not None:
        return proc.poll() is None
    if job.pid <= 0:
        return False
    try:  # a worker of an earlier app process: its command line names the job folder (not a reused pid)
        return job.dir.encode() in Path(f"/proc/{job.pid}/cmdline").read_bytes()
    except OSError:
        return False


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
    """The worker's result when it has finished (None while it runs); a crash (no result file) becomes an error result."""
    rp = job.path / "result.json"
    proc = _PROCS.get(job.id)
    if proc is None:  # a job of an earlier app process, or one already reaped and forgotten
        if rp.is_file():
            return json.loads(rp.read_text())
        if running(job):
            return None
        if not job.path.exists():  # another tab of the same job read its result first, or cancelled it
            return {"ok": False, "error": f"job {job.id} is over and its folder removed (its result was read, or it "
                                          "was cancelled, in another tab); run it again", "reports": []}
        return {"ok": False, "error": "the worker is gone (cancelled, or the app was restarted) and left no result; "
                                      "run it again", "reports": []}
    code = proc.poll()
    if code is None:
        return None
    _PROCS.pop(job.id, None)  # reaped (poll or the waiter thread): nothing left to track
    if rp.is_file():
        return json.loads(rp.read_text())
    tail = (job.path / "log.txt").read_text(errors="replace")[-2000:] if (job.path / "log.txt").is_file() else ""
    return {"ok": False, "error": f"the worker process died (exit code {code}) before finishing; the plan is unchanged. "
                                  f"Last output:\n{tail}", "reports": []}


def cleanup(job: Job) -> None:
    """Remove the job's folder once its result has been read (marked read first, so a failed removal is swept later)."""
    try:
        (job.path / READ_MARK).touch()
    except OSError:  # the folder is already gone
        pass
    shutil.rmtree(job.dir, ignore_errors=True)


def cancel(job: Job) -> None:
    """Kill the worker, reap it, and remove the job's folder."""
    proc = _PROCS.pop(job.id, None)
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    elif running(job):  # a worker an earlier app process started: not our child, so only kill it
        try:
            os.kill(job.pid, 9)
        except OSError:
            pass
    cleanup(job)


def clean_orphans(now: float | None = None) -> list[str]:
    """Remove job folders left behind (at app start): older than ORPHAN_AGE_S, or whose worker is gone and
    whose result was read. A job whose worker still runs is kept. Returns the removed ids."""
    now = time.time() if now is None else now
    try:
        root = jobs_root()
    except JobError:  # not ours to sweep; starting a job will say why
        return []
    removed = []
    for d in root.iterdir():
        if not JOB_ID.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        try:
            job = find(d.name)
        except JobError:  # no job record: judge by age alone
            job = Job(id=d.name, dir=str(d), task="", started=d.stat().st_mtime)
        if running(job):
            continue
        if now - job.started > ORPHAN_AGE_S or (d / READ_MARK).exists():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed
