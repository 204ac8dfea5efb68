"""Worker processes: results come back as files, and a crash there is an error result, not a dead app."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from app import jobs, launch
from app.export_page import snippet
from app_fakes import residual_plan

ROOT = Path(__file__).resolve().parents[2]


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
    assert env["PYTHONPATH"].split(":")[0] == str(ROOT)
    from planner.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        launch.environment(tmp_path / "nope.py")


def test_shipped_config_is_localhost_and_private():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    cfg = tomllib.loads((ROOT / "app" / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "127.0.0.1" and cfg["server"]["enableXsrfProtection"] is True
    assert cfg["browser"]["gatherUsageStats"] is False and cfg["server"]["maxUploadSize"] > 0


def test_snippet_builds_the_exported_plan(tmp_path):
    import planner

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
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from app.launch import main; main(None, {port}, headless=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**__import__("os").environ, "STAGEWISE_AUTOSAVE": str(tmp_path / "a.json")})
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.3).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.3)
        else:
            raise AssertionError("the app did not start listening")
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
