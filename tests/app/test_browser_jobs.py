"""Real-browser tests of the Profile page's jobs: what only a browser shows (reload, address, adopt across pages).

Both run a real profile of sample_models/mlp.py in a worker process started by the app
(`streamlit run` on a free localhost port, headless Debian Chromium; the server fixture
and helpers are test_browser.py's). Screenshots go to tests/artifacts/ (git-ignored).

- A reload while the profile runs finds the job again from the address (?job=...), shows
  its result when it is done, attaches it to the plan, and leaves neither a zombie worker
  nor its job folder behind. The worker is paused (SIGSTOP) around the reload, so the
  reload always lands while it runs however fast or busy the machine is.
- After an autotuned N sweep, Adopt makes the plan of the report on screen the plan:
  the Plan page shows that N, that stage count and each stage's "runs as", and the
  Export page's plan JSON carries the report.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_browser import ARTIFACTS, ROOT, WAIT_MS, _free_port, chromium_page, server  # noqa: F401 (server: the fixture)

from stagewise.app import launch

pytestmark = [pytest.mark.browser, pytest.mark.slow]

MLP = ROOT / "sample_models" / "mlp.py"
DATA_DEPENDENT = ROOT / "sample_models" / "data_dependent.py"  # batched and member-loop stages; autotune varies them by N
JOB_WAIT_MS = 240_000  # a profile with autotune compiles; on a busy machine that takes minutes


def _page(failure_png: str, height: int):
    return chromium_page(failure_png, width=1400, height=height)


def _open_profile_page(page, url: str) -> None:
    page.goto(url)
    page.get_by_role("link", name="Profile").click()
    page.get_by_role("button", name="Profile", exact=True).wait_for(timeout=WAIT_MS)


def _start_profile(page, ns: str, autotune: bool = False) -> None:
    box = page.get_by_label(re.compile("N sweep"))
    box.fill(ns)
    box.press("Enter")  # a text input commits on Enter (or blur)
    if autotune:
        page.get_by_text("Autotune each stage's strategy first").click()
        page.get_by_role("checkbox", name=re.compile("Autotune")).wait_for(state="attached", timeout=WAIT_MS)
    page.wait_for_timeout(500)  # let the widget values reach the server before the button's rerun
    page.get_by_role("button", name="Profile", exact=True).click()


def _job_id(page) -> str:
    page.wait_for_url(re.compile(r"[?&]job=profile-"), timeout=WAIT_MS)
    return re.search(r"[?&]job=(profile-[a-z0-9_]{8})", page.url).group(1)


def _wait_for(what: str, check, timeout: float = 60.0):
    """Poll `check()` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# The rows of a st.dataframe as {column: cell text}: Glide's grid draws on a canvas and keeps
# an accessible <table role="grid"> of the rows it shows inside that canvas.
TABLE_JS = """
(grid) => {
  const rows = Array.from(grid.querySelectorAll('tr')).map(tr => Array.from(tr.querySelectorAll('th, td')).map(c => c.innerText.trim()));
  const head = rows.shift() || [];
  return rows.map(r => Object.fromEntries(head.map((h, i) => [h, r[i]])));
}
"""


def _table(page, column: str) -> list[dict[str, str]]:
    """The rows of the (only) dataframe on the page that has `column`."""
    grid = page.locator("[data-testid=stDataFrame] table[role=grid]").filter(
        has=page.locator("th", has_text=re.compile(rf"^{re.escape(column)}$")))
    _expect_one(grid)
    return grid.first.evaluate(TABLE_JS)


def _expect_one(locator) -> None:
    locator.first.wait_for(state="attached", timeout=WAIT_MS)
    assert locator.count() == 1, f"{locator.count()} tables match"


def _show_n(page, n: int) -> None:
    """Pick N = n in the Profile page's "Show the report for N =" radio and wait for its report."""
    page.locator("[data-testid=stRadio]").get_by_text(str(n), exact=True).click()
    page.get_by_text(re.compile(rf"^N = {n} on cpu")).wait_for(timeout=WAIT_MS)
    page.get_by_role("button", name=f"Adopt the autotuned plan for N = {n}").wait_for(timeout=WAIT_MS)
    _wait_for_results(page)


def _wait_for_profile(page) -> None:
    """Wait for the sweep's result (its N picker) or its failure, and fail on the latter with its message."""
    done = page.get_by_text("Show the report for N =")
    failed = page.get_by_text(re.compile(r"^profile failed"))
    done.or_(failed).first.wait_for(timeout=JOB_WAIT_MS)
    assert failed.count() == 0, failed.first.inner_text()
    _wait_for_results(page)


def _wait_for_results(page) -> None:
    """Wait until the report on screen is drawn: its metrics, its stage table and its charts (no skeletons left)."""
    page.get_by_text("speedup vs loop").first.wait_for(timeout=WAIT_MS)
    page.locator("[data-testid=stDataFrame]").first.wait_for(timeout=WAIT_MS)
    page.locator(".js-plotly-plot").first.wait_for(timeout=WAIT_MS)
    page.wait_for_function("() => !document.querySelector('[data-testid=stSkeleton]')", timeout=WAIT_MS)
    page.wait_for_timeout(500)


def _proc_state(pid: int) -> str:
    """The process state letter of `pid` ("Z": a zombie nobody reaped), "" when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def _worker_pid(job_dir: Path) -> int:
    rec = _wait_for(f"{job_dir}/job.json", lambda: (job_dir / "job.json").is_file() and (job_dir / "job.json").read_text())
    pid = int(json.loads(rec)["pid"])
    assert job_dir.as_posix().encode() in Path(f"/proc/{pid}/cmdline").read_bytes(), "job.json names another process"
    return pid


@pytest.mark.parametrize("server", [MLP], indirect=True)
def test_reload_during_a_profile_finds_the_job_and_reaps_its_worker(server, tmp_path):
    jobs_dir = tmp_path / "cache" / "stagewise" / "jobs"  # the fixture's XDG_CACHE_HOME
    pid = 0
    with _page("failure_jobs_reload.png", 1200) as (sync_api, page):
        try:
            _open_profile_page(page, server)
            _start_profile(page, "2, 8")  # 8: the plan's N, so the report is attached to the plan
            job_id = _job_id(page)
            job_dir = jobs_dir / job_id
            pid = _worker_pid(job_dir)
            os.kill(pid, signal.SIGSTOP)  # the reload lands while the job runs, however fast the worker is
            page.get_by_text("profile: ").first.wait_for(timeout=WAIT_MS)  # the live progress bar
            assert not (job_dir / "result.json").exists()
            page.screenshot(path=str(ARTIFACTS / "profile_running.png"))

            page.reload()
            page.get_by_text(f"found the profile job {job_id}").wait_for(timeout=WAIT_MS)
            # polling again, from the new session; a reload starts the session over (the model is opened and
            # traced again before the page is drawn), which on a busy machine takes more than a rerun
            page.get_by_text("profile: ").first.wait_for(timeout=JOB_WAIT_MS)
            sync_api.expect(page.get_by_role("button", name="Cancel")).to_be_visible(timeout=WAIT_MS)
            assert f"job={job_id}" in page.url and "token=" in page.url
            page.screenshot(path=str(ARTIFACTS / "profile_reloaded.png"))
            os.kill(pid, signal.SIGCONT)

            _wait_for_profile(page)
            page.get_by_text(re.compile(r"^N = 8 on cpu")).wait_for(timeout=WAIT_MS)  # the report of the plan's N
            sync_api.expect(page.get_by_role("button", name="Cancel")).to_have_count(0, timeout=WAIT_MS)
            assert "job=" not in page.url, page.url  # over: a reload has nothing to find
            assert page.get_by_text("failed").count() == 0
            page.screenshot(path=str(ARTIFACTS / "profile_done_after_reload.png"))

            # the worker is reaped (no zombie) and its folder removed
            _wait_for(f"worker {pid} reaped", lambda: _proc_state(pid) in ("", "X"), timeout=30)
            _wait_for(f"{job_dir} removed", lambda: not job_dir.exists(), timeout=30)

            # the result was attached to the plan: the Export page says so
            page.get_by_role("link", name="Export").click()
            page.get_by_text("Includes the last profile report").wait_for(timeout=WAIT_MS)
        finally:
            if pid and _proc_state(pid) == "T":
                os.kill(pid, signal.SIGCONT)  # never leave a stopped worker behind


@pytest.mark.parametrize("server", [DATA_DEPENDENT], indirect=True)
def test_adopt_after_an_autotuned_sweep_shows_that_plan_on_the_plan_and_export_pages(server):
    with _page("failure_jobs_adopt.png", 1400) as (sync_api, page):
        _open_profile_page(page, server)
        _start_profile(page, "2, 4", autotune=True)  # neither is the plan's N (8): nothing is attached yet
        _wait_for_profile(page)
        page.get_by_text(re.compile(r"^N = 4 on cpu")).wait_for(timeout=WAIT_MS)  # the last N is shown first
        tables = {4: _table(page, "strategy")}
        _show_n(page, 2)
        tables[2] = _table(page, "strategy")
        n = 4 if len(tables[4]) > len(tables[2]) else 2  # the richer plan (autotune may merge all into one stage)
        if n == 4:
            _show_n(page, 4)
        profiled = tables[n]
        assert profiled and all(r["stage"] for r in profiled), profiled
        page.screenshot(path=str(ARTIFACTS / "adopt_profile_shown.png"))
        page.get_by_role("button", name=f"Adopt the autotuned plan for N = {n}").click()
        page.get_by_text(re.compile(rf"adopt the autotuned plan for N = {n} → \d+ stages")).wait_for(timeout=WAIT_MS)

        # the Plan page shows exactly that plan: its N, its stage count, each stage's "runs as" and time
        page.get_by_role("link", name="Plan").click()
        page.get_by_text("Stages", exact=True).wait_for(timeout=WAIT_MS)
        page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=WAIT_MS)
        summary = page.locator("[data-testid=stMarkdownContainer]").filter(has_text="traced with").first.inner_text()
        assert re.search(rf"\b{len(profiled)} stages? \(", summary) and f"N = {n} " in summary, summary
        shown = _table(page, "runs as")
        assert [r["stage"] for r in shown] == [r["stage"] for r in profiled], (shown, profiled)
        for plan_row, prof_row in zip(shown, profiled):
            strategy = prof_row["strategy"]
            assert plan_row["runs as"] == ("member loop" if strategy == "loop" else f"batched ({strategy})"), \
                (plan_row, prof_row)
            assert plan_row["last ms"] == prof_row["ms"], (plan_row, prof_row)  # the report is the plan's profile
        page.wait_for_function("() => !document.querySelector('[data-testid=stSkeleton]')", timeout=WAIT_MS)
        page.screenshot(path=str(ARTIFACTS / "adopt_plan_page.png"), full_page=True)

        # the Export page's plan JSON is that plan with the report inside
        page.get_by_role("link", name="Export").click()
        page.get_by_text("Includes the last profile report").wait_for(timeout=WAIT_MS)
        page.get_by_text("Plan JSON", exact=True).click()
        code = page.locator("[data-testid=stExpander] [data-testid=stCode] code").first
        code.wait_for(timeout=WAIT_MS)
        exported = json.loads(code.inner_text())
        assert exported["n_members"] == n
        assert [s["id"] for s in exported["stages"]] == [r["stage"] for r in profiled]
        assert [s["options"]["strategy"] for s in exported["stages"]] == [r["strategy"] for r in profiled]
        assert exported["profile"]["n_members"] == n and exported["profile"]["autotuned"] is True
        page.screenshot(path=str(ARTIFACTS / "adopt_export_page.png"))


UPLOAD_LIMIT_MB = 1  # a server started with a small upload limit, so a too-large file stays small


@pytest.fixture
def small_upload_server(tmp_path):
    """The app as test_browser's `server` starts it, with --server.maxUploadSize=1 after launch's 512 (the last one holds)."""
    port = _free_port()
    token = launch.new_token()
    env = {**launch.environment(MLP), launch.TOKEN_ENV: token, "STAGEWISE_AUTOSAVE": str(tmp_path / "autosave.json"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with open(tmp_path / "streamlit.log", "wb") as log:
        proc = subprocess.Popen([*launch.command(port), f"--server.maxUploadSize={UPLOAD_LIMIT_MB}"], cwd=tmp_path,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for("the app's port", lambda: _port_open(port) or proc.poll() is not None, timeout=60)
            assert proc.poll() is None, (tmp_path / "streamlit.log").read_text()
            yield launch.url(port, token)
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def test_uploaders_state_the_limit_that_applies_and_the_way_around_it(small_upload_server, tmp_path):
    big = tmp_path / "big_model.py"
    big.write_bytes(b"# padding\n" * (UPLOAD_LIMIT_MB * 2**20 // 10 + 1000))  # just over the limit
    with _page("failure_jobs_upload.png", 1000) as (sync_api, page):
        page.goto(small_upload_server)
        page.get_by_role("link", name="Model").click()
        page.get_by_role("tab", name="Upload").click()
        note = page.get_by_text(f"Up to {UPLOAD_LIMIT_MB} MB per file")
        note.wait_for(timeout=WAIT_MS)
        assert "stagewise ui path/to/model.pt2" in note.inner_text() and "--weights" in note.inner_text()
        # Streamlit's own dropzones (model and weights) say the same limit
        zones = page.locator("[data-testid=stFileUploaderDropzoneInstructions]")
        sync_api.expect(zones).to_have_count(2, timeout=WAIT_MS)
        for i in range(2):
            sync_api.expect(zones.nth(i)).to_contain_text(f"{UPLOAD_LIMIT_MB}MB per file", timeout=WAIT_MS)
        page.locator("[data-testid=stFileUploader] input[type=file]").first.set_input_files(str(big))
        refused = page.get_by_text(re.compile(rf"File must be {UPLOAD_LIMIT_MB}(\.0)?MB or smaller"))
        refused.wait_for(timeout=WAIT_MS)  # refused in the browser: the app never receives it
        page.screenshot(path=str(ARTIFACTS / "upload_too_large.png"))
        page.get_by_role("button", name="Load uploaded model").click()
        page.get_by_text("choose a .py model file or a .pt2 archive first").wait_for(timeout=WAIT_MS)
