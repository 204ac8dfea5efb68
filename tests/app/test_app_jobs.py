"""Worker processes: results come back as files, and a crash there is an error result, not a dead app."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from stagewise.app import jobs, launch
from stagewise.app.export_page import snippet
from app_fakes import app_test, residual_plan, wait_until_listening

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Job folders land in tmp_path/cache/stagewise/jobs, never in the user's own cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _wait(job: jobs.Job, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        res = jobs.result(job)
        if res is not None:
            return res
        time.sleep(0.3)
    jobs.cancel(job)
    raise AssertionError("worker did not finish")


def test_crashing_worker_becomes_an_error_result(tmp_path):
    model = tmp_path / "crash.py"
    model.write_text("import os\ndef build_model():\n    os._exit(3)\ndef example_inputs():\n    return ()\n")
    job = jobs.start("verify", str(model), (), residual_plan().to_json(), "cpu", [4])
    res = _wait(job)
    assert not res["ok"] and "died (exit code 3)" in res["error"]


def test_library_error_in_worker_is_reported(tmp_path):
    job = jobs.start("verify", str(tmp_path / "missing.py"), (), residual_plan().to_json(), "cpu", [4])
    res = _wait(job)
    assert not res["ok"] and "does not exist" in res["error"]
    assert jobs.progress(job)[1] == "loading the model"


def test_cancel_kills_the_worker(tmp_path):
    model = tmp_path / "slow.py"
    model.write_text("import time\ndef build_model():\n    time.sleep(60)\ndef example_inputs():\n    return ()\n")
    job = jobs.start("verify", str(model), (), residual_plan().to_json(), "cpu", [4])
    jobs.cancel(job)
    assert jobs.result(job)["ok"] is False  # gone, reported as such
    assert not job.path.exists()


def test_launch_command_is_localhost_only_and_finds_the_packages(tmp_path):
    cmd = launch.command(port=8599)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("app/main.py")
    for flag in ("--server.address=127.0.0.1", "--browser.gatherUsageStats=false", "--server.enableXsrfProtection=true",
                 "--server.port=8599", "--server.headless=true"):
        assert flag in cmd
    env = launch.environment(ROOT / "sample_models" / "mlp.py")
    assert env[launch.MODEL_ENV] == str(ROOT / "sample_models" / "mlp.py")
    assert str(ROOT) not in env.get("PYTHONPATH", "").split(":")  # the checkout's folders are not top-level packages
    from stagewise.planner.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        launch.environment(tmp_path / "nope.py")


def test_shipped_config_is_localhost_and_private():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    cfg = tomllib.loads((ROOT / "app" / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "127.0.0.1" and cfg["server"]["enableXsrfProtection"] is True
    assert cfg["browser"]["gatherUsageStats"] is False and cfg["server"]["maxUploadSize"] > 0


def test_snippet_builds_the_exported_plan(tmp_path):
    from stagewise import planner

    src_path = ROOT / "sample_models" / "mlp.py"
    src = planner.load_source(src_path)
    g = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(g, 3)
    plan.save(tmp_path / "mlp.plan.json")
    code = snippet(str(src_path), str(tmp_path / "mlp.plan.json"))
    scope: dict = {}
    exec(compile(code, "snippet", "exec"), scope)
    assert scope["outputs"].shape[0] == 3


def test_launch_main_serves_the_app(tmp_path, monkeypatch):
    """app.launch.main (what `stagewise ui` calls) answers on 127.0.0.1 without any terminal prompt."""
    import socket
    import subprocess
    import sys

    port = launch.free_port(0)
    code = f"from stagewise.app.launch import main; main(None, {port}, headless=True)"  # the installed package, as `stagewise ui`
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**__import__("os").environ, "STAGEWISE_AUTOSAVE": str(tmp_path / "a.json")})
    try:
        wait_until_listening(proc, port)
        import urllib.request

        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=10).read() == b"ok"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    # the server launch.main started went away with it (no orphaned streamlit)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.3).close()
            time.sleep(0.3)
        except OSError:
            break
    else:
        raise AssertionError(f"streamlit still serves on port {port} after `stagewise ui` was stopped")


# -- .pt2 archives in the worker: the user's trust choice travels with the request ----------------


def _archives(tmp_path: Path) -> tuple[Path, dict[str, tuple[Path, Path]], dict]:
    """A plain export archive of the sample MLP, two crafted copies, and a plan for them.

    Each crafted copy swaps its example inputs for a pickle that creates its own marker file and
    then returns the real inputs: torch.export.load needs a full unpickle (so untrusted it is
    refused), and trusted it loads and runs like the plain one.
    """
    import io
    import zipfile

    import torch

    from stagewise import planner

    src = planner.load_source(ROOT / "sample_models" / "mlp.py")
    buf = io.BytesIO()
    torch.export.save(torch.export.export(src.model, src.example_inputs), buf)
    plain = tmp_path / "plain.pt2"
    plain.write_bytes(buf.getvalue())
    crafted = {}
    for name in ("untrusted", "trusted"):
        marker = tmp_path / f"code_ran_{name}"

        class CreatesMarker:
            def __reduce__(self, _m: str = str(marker)):
                return eval, (f"(open({_m!r}, 'w').close(), ((__import__('torch').zeros(32, 64),), {{}}))[1]",)

        payload = io.BytesIO()
        torch.save(CreatesMarker(), payload)
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
            for info in zin.infolist():
                zout.writestr(info, payload.getvalue() if "/data/sample_inputs/" in info.filename else zin.read(info))
        path = tmp_path / f"{name}.pt2"
        path.write_bytes(out.getvalue())
        crafted[name] = (path, marker)
    loaded = planner.load_source(plain)
    plan = planner.propose(planner.trace(loaded.model, loaded.example_inputs), 2)
    return plain, crafted, plan.to_json()


def test_worker_loads_a_pt2_archive_only_as_trusted_as_the_user_said(tmp_path):
    plain, crafted, plan_json = _archives(tmp_path)
    (untrusted, marker_off), (trusted, marker_on) = crafted["untrusted"], crafted["trusted"]
    started = {  # all three at once: each worker imports torch, which is most of the time
        "off": jobs.start("verify", str(untrusted), (), plan_json, "cpu", [2]),  # trust defaults to off
        "on": jobs.start("verify", str(trusted), (), plan_json, "cpu", [2], trust_archive=True),
        "plain": jobs.start("verify", str(plain), (), plan_json, "cpu", [2], trust_archive=False),
    }
    res = {k: _wait(job) for k, job in started.items()}

    assert not res["off"]["ok"] and "refusing to load the archive" in res["off"]["error"]
    assert "sample_inputs" in res["off"]["error"] and not marker_off.exists()  # refused before any unpickling
    assert jobs.progress(started["off"])[1] == "loading the model"

    assert marker_on.exists()  # trusted: the loader was told so, and the archive's pickle ran
    assert res["on"]["ok"], res["on"]["error"]  # and the job went on past loading to a real check
    assert [r["n"] for r in res["on"]["reports"]] == [2] and jobs.progress(started["on"]) == (1.0, "done")

    assert res["plain"]["ok"], res["plain"]["error"]  # an archive of plain tensors needs no trust
    assert [r["n"] for r in res["plain"]["reports"]] == [2]


def test_request_without_a_trust_flag_trusts_nothing(tmp_path, monkeypatch):
    """An old or hand-written request.json (no "trust_archive") is loaded untrusted."""
    import json

    from stagewise.app import worker

    seen = []

    def load_source(path, weights=None, **kw):
        seen.append(kw)
        raise RuntimeError("stop")  # only the call matters here

    monkeypatch.setattr("stagewise.planner.load_source", load_source)
    for extra in ({}, {"trust_archive": "yes"}, {"trust_archive": True}):
        (tmp_path / "request.json").write_text(json.dumps({"task": "verify", "model_path": "m.pt2", "plan": {}, **extra}))
        with pytest.raises(RuntimeError, match="stop"):
            worker.run(tmp_path)
    assert [kw["trust_archive"] for kw in seen] == [False, False, True]


# -- result files: written whole, under a name no other writer shares ---------------------------


def test_worker_result_writes_never_collide_or_show_half_a_file(tmp_path):
    import json
    import threading

    from stagewise.app import worker

    path = tmp_path / "result.json"
    (tmp_path / "result.json.tmp").mkdir()  # the old fixed temp name, taken: writing must not depend on it
    errors: list[BaseException] = []

    def write(k: int) -> None:
        try:
            for i in range(40):
                worker._write_json(path, {"ok": True, "writer": k, "i": i, "reports": [{"text": "x" * 5000}]})
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    def read() -> None:
        for _ in range(200):
            if path.is_file():
                try:
                    assert json.loads(path.read_text())["ok"] is True
                except BaseException as e:
                    errors.append(e)
                    return

    threads = [threading.Thread(target=write, args=(k,)) for k in range(3)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert json.loads(path.read_text())["i"] == 39
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "result.json.tmp"]  # no temp file left over


def test_progress_ignores_a_line_still_being_written(tmp_path):
    job = jobs.Job(id="j", dir=str(tmp_path), task="verify", started=0.0)
    (tmp_path / "progress.jsonl").write_text('{"fraction": 0.0, "message": "loading the model"}\n'
                                             '{"fraction": null, "message": "N=2: stage s1"}\n'
                                             '{"fraction": 0.5, "mess')
    assert jobs.progress(job) == (0.0, "N=2: stage s1")


# -- jobs that survive a reload: found by id, reaped, cleaned ------------------------------------


def _state(pid: int) -> str:
    """The process state letter of `pid` ("Z": a zombie nobody reaped), "" when no such process exists."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    return next((ln.split()[1] for ln in status.splitlines() if ln.startswith("State:")), "")


def _assert_reaped(pid: int, timeout: float = 10) -> None:
    import os

    deadline = time.time() + timeout
    while _state(pid) not in ("", "X") and time.time() < deadline:  # the waiter thread reaps it right after exit
        time.sleep(0.1)
    assert _state(pid) in ("", "X"), f"worker {pid} left in state {_state(pid)!r}"
    with pytest.raises(ChildProcessError):  # nothing left to wait for: already reaped
        os.waitpid(pid, os.WNOHANG)


def test_finished_worker_is_reaped_even_when_nobody_polls(tmp_path):
    job = jobs.start("verify", str(tmp_path / "missing.py"), (), residual_plan().to_json(), "cpu", [4])
    assert job.path.parent == jobs.jobs_root() and jobs.JOB_ID.fullmatch(job.id)
    deadline = time.time() + 120
    while not (job.path / "result.json").is_file() and time.time() < deadline:
        time.sleep(0.2)
    _assert_reaped(job.pid)  # no jobs.result() call yet
    assert not jobs.result(job)["ok"]
    jobs.cleanup(job)
    assert not job.path.exists()


def test_cancel_reaps_the_worker_and_removes_its_folder(tmp_path):
    model = tmp_path / "slow.py"
    model.write_text("import time\ndef build_model():\n    time.sleep(60)\ndef example_inputs():\n    return ()\n")
    job = jobs.start("verify", str(model), (), residual_plan().to_json(), "cpu", [4])
    assert jobs.running(job)
    jobs.cancel(job)
    _assert_reaped(job.pid)
    assert not job.path.exists() and not jobs.running(job)


def test_forged_job_ids_are_refused(tmp_path):
    root = jobs.jobs_root()
    outside = tmp_path / "profile-abcd1234"  # a job-shaped folder outside the jobs directory
    outside.mkdir()
    (outside / "job.json").write_text('{"task": "profile", "started": 0, "pid": 1}')
    (root / "verify-linked_1").symlink_to(outside)  # planted inside, pointing out
    for forged in ("../../etc", "/etc", str(outside), "profile-abcd1234/../../x", "profile-ABCD1234", "profile-abcd1234\n", ""):
        with pytest.raises(jobs.JobError, match="not a job id of this app"):
            jobs.find(forged)
    with pytest.raises(jobs.JobError, match="does not name a job folder of this app"):
        jobs.find("verify-linked_1")
    with pytest.raises(jobs.JobError, match="no job profile-abcd1234 in the app's jobs directory"):
        jobs.find("profile-abcd1234")


def test_old_and_read_job_folders_are_cleaned_at_app_start(tmp_path, monkeypatch):
    import json

    root = jobs.jobs_root()

    def folder(name: str, started: float, read: bool = False) -> Path:
        d = root / name
        d.mkdir()
        (d / "job.json").write_text(json.dumps({"task": name.split("-")[0], "started": started, "pid": 0}))
        (d / "result.json").write_text('{"ok": true, "reports": []}')
        if read:
            (d / jobs.READ_MARK).touch()
        return d

    old = folder("profile-old_0001", time.time() - 2 * jobs.ORPHAN_AGE_S)
    read = folder("verify-read_001", time.time(), read=True)
    unread = folder("profile-unread_1", time.time())  # a result nobody has read yet: a reload may still want it
    other = root / "notes"
    other.mkdir()
    at = app_test(monkeypatch, tmp_path, ROOT / "sample_models" / "mlp.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not old.exists() and not read.exists()
    assert unread.exists() and other.exists()


def test_a_reload_finds_the_running_job_and_its_result(tmp_path, monkeypatch):
    model = ROOT / "sample_models" / "mlp.py"
    at = app_test(monkeypatch, tmp_path, model)
    at.run()
    at.switch_page("views/profile.py").run()
    next(b for b in at.button if b.label == "Verify vs loop").click().run()
    job = at.session_state["job"]
    assert at.query_params.get("job") == job.id  # the address keeps the id

    # the browser reloads: a new session, with only the address (token and job id) to go on
    again = app_test(monkeypatch, tmp_path, model)
    again.query_params["job"] = job.id
    again.run()
    assert not again.exception, [e.value for e in again.exception]
    assert again.session_state["job"] == job
    assert "found the verify job" in "\n".join(i.value for i in again.info)
    again.switch_page("views/profile.py").run()
    assert again.query_params.get("job") == job.id  # page links drop the query string; the job id comes back
    deadline = time.time() + 180
    while _session_job(again) is not None:
        assert time.time() < deadline, "the job did not finish"
        time.sleep(1)
        again.run()
    assert not again.error, [e.value for e in again.error]
    assert again.session_state["verify_result"]["n"] == again.session_state["history"].present.n_members
    assert "MATCH" in "\n".join(s.value for s in again.success)
    assert "job" not in again.query_params  # over: a later reload has nothing to find
    assert not job.path.exists()  # result read, folder removed
    _assert_reaped(job.pid)


def _session_job(at) -> jobs.Job | None:
    return at.session_state["job"] if "job" in at.session_state else None


@pytest.mark.parametrize("forged", ["../../etc", "profile-zzzz9999"])
def test_a_forged_job_id_in_the_address_is_refused(tmp_path, monkeypatch, forged):
    at = app_test(monkeypatch, tmp_path, ROOT / "sample_models" / "mlp.py")
    at.query_params["job"] = forged
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    shown = "\n".join(e.value for e in at.error)
    assert "not resuming a job" in shown
    assert ("not a job id of this app" if ".." in forged else "no job profile-zzzz9999") in shown
    assert _session_job(at) is None
    assert "job" not in at.query_params


def test_a_request_with_an_unknown_task_runs_nothing_and_says_so(tmp_path):
    """Was: any task but "verify" ran a profile (autotune and all) in its place."""
    from stagewise.app import worker

    (tmp_path / "request.json").write_text(json.dumps({"task": "verfy", "model_path": str(tmp_path / "never_read.py"),
                                                       "plan": residual_plan().to_json()}))
    assert worker.main([str(tmp_path)]) == 1
    res = json.loads((tmp_path / "result.json").read_text())
    assert not res["ok"] and "unknown task 'verfy'" in res["error"] and "profile, verify" in res["error"]
    assert not (tmp_path / "progress.jsonl").exists()  # not even "loading the model"
