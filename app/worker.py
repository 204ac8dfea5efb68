"""Runs executor.profile / executor.verify in a separate process: `python -m stagewise.app.worker JOB_DIR`.

JOB_DIR/request.json says what to run; the worker appends progress lines to
JOB_DIR/progress.jsonl and writes JOB_DIR/result.json at the end. A crash, a
CUDA OOM or a hang here cannot take the Streamlit server (or the plan) down:
the app only reads these files. No streamlit here.

request.json: {"task": "profile"|"verify", "model_path": str, "weights": [str],
               "plan": Plan.to_json(), "device": "cpu"|"cuda", "ns": [int, ...],
               "autotune": bool, "compile_baseline": bool, "train": bool (optional: profile a training step),
               "budget": "default" | "quick" | "thorough" (optional: how much autotune measures),
               "trust_archive": bool (optional, default false: a .pt2 that needs unpickling is refused)}
result.json:  {"ok": bool, "error": str|None, "reports": [{"n": int, "report": dict, "text": str}]}
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _write_json(path: Path, obj: Any) -> None:
    """Write `obj` so a reader sees all of it or nothing (a uniquely named temp file, then os.replace)."""
    from stagewise.planner.files import write_atomic

    write_atomic(path, json.dumps(obj, indent=2, default=str))


class Progress:
    """Appends {"t", "fraction", "message"} lines that the app polls."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, message: str, fraction: float | None = None) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"t": time.time(), "fraction": fraction, "message": str(message)}) + "\n")


def run(job_dir: Path) -> dict:
    from stagewise import executor
    from stagewise import planner

    from stagewise.app.jobs import TASKS
    from stagewise.planner.errors import StagewiseError

    req = json.loads((job_dir / "request.json").read_text())
    if req.get("task") not in TASKS:  # before any work: an unknown task must not run a profile in its place
        raise StagewiseError(f"{job_dir / 'request.json'}: unknown task {req.get('task')!r}; the task is one of "
                             f"{', '.join(TASKS)} (start jobs with app.jobs.start)")
    progress = Progress(job_dir / "progress.jsonl")
    progress("loading the model", 0.0)
    # the app passes the user's "Trust this archive" choice; a request without it trusts nothing
    src = planner.load_source(req["model_path"], req.get("weights") or None,
                              trust_archive=req.get("trust_archive") is True)
    plan = planner.Plan.from_json(req["plan"], source="the app's plan")
    ns = [int(n) for n in (req.get("ns") or [plan.n_members])]
    reports = []
    for i, n in enumerate(ns):
        p = plan.with_n_members(n)
        progress(f"{req['task']} N={n} ({i + 1}/{len(ns)})", i / len(ns))
        members = src.members(n)
        inputs = executor.batched_inputs(p, src.example_inputs)
        if req["task"] == "verify":
            rep = executor.verify(p, members, inputs, device=req.get("device"))
        else:
            def tick(done: int, total: int, label: str, _i: int = i, _n: int = n) -> None:
                progress(f"N={_n}: {label}", (_i + done / max(total, 1)) / len(ns))

            rep = executor.profile(p, members, inputs, device=req.get("device", "cpu"), progress=tick,
                                   autotune=bool(req.get("autotune")), compile_baseline=bool(req.get("compile_baseline")),
                                   train=bool(req.get("train")), budget=str(req.get("budget") or "default"))
        reports.append({"n": n, "report": rep.to_json(), "text": rep.to_text()})
    progress("done", 1.0)
    return {"ok": True, "error": None, "reports": reports}


def main(argv: list[str]) -> int:
    job_dir = Path(argv[0])
    from stagewise.planner.errors import StagewiseError

    try:
        result = run(job_dir)
    except StagewiseError as e:
        result = {"ok": False, "error": str(e), "reports": []}
    except Exception as e:  # report anything else to the app instead of dying silently
        import traceback

        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "reports": []}
    _write_json(job_dir / "result.json", result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
