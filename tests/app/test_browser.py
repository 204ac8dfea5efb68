"""One real-browser test: `streamlit run` on a free localhost port, driven by headless Debian Chromium.

Loads the Plan page from the tokened address `stagewise ui` prints, waits for the
graph, clicks a node, clicks a node of another stage (clicks add to the selection),
merges, checks that the stage count went down, undoes, and box-selects three nodes;
then follows a page link and reloads (the token survives), and opens the app
without the token (refused). Screenshots go to tests/artifacts/ (git-ignored); look at them.
"""
from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from stagewise.app import launch

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
MODEL = ROOT / "sample_models" / "transformer_block.py"
WAIT_MS = 45_000  # generous: CI machines are often busy, and a rerun then takes seconds
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

# Centre of the marker whose customdata is `id`, in page coordinates (Plotly draws
# one <g class="trace"> per scatter trace, in data order, one path.point per point).
POINT_JS = """
(id) => {
  const gd = document.querySelector('.js-plotly-plot');
  const traces = gd.querySelectorAll('.scatterlayer .trace');
  for (let t = 0; t < gd.data.length; t++) {
    const cd = gd.data[t].customdata || [];
    const i = Array.from(cd).indexOf(id);
    if (i >= 0 && gd.data[t].mode !== 'lines') {
      const pts = traces[t].querySelectorAll('path.point');
      const r = pts[i].getBoundingClientRect();
      return [r.x + r.width / 2, r.y + r.height / 2];
    }
  }
  return null;
}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STACK = ROOT / "tests" / "app" / "models" / "transformer_stack.py"  # 24 identical blocks, 652 nodes


@pytest.fixture
def server(tmp_path, request):
    model = getattr(request, "param", MODEL)
    port = _free_port()
    token = launch.new_token()
    env = launch.environment(model)  # exactly what `stagewise ui MODEL` runs, from another directory
    env[launch.TOKEN_ENV] = token
    env["STAGEWISE_AUTOSAVE"] = str(tmp_path / "autosave.json")
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    log = open(tmp_path / "streamlit.log", "wb")
    proc = subprocess.Popen(launch.command(port), cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "streamlit.log").read_text()
                time.sleep(0.2)
        yield launch.url(port, token)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
        # pytest shows a test's captured output only when it fails: then the server's own log is there too
        print(f"--- the app server's log ({tmp_path / 'streamlit.log'}), last 4000 characters:")
        print((tmp_path / "streamlit.log").read_text(errors="replace")[-4000:])


@contextlib.contextmanager
def chromium_page(failure_png: str, width: int = 1500, height: int = 1500):
    """(playwright sync_api, a page of headless Debian Chromium); skips with the fix when either is missing;
    on a failure, a screenshot of what the page showed goes to tests/artifacts/<failure_png>."""
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed at /usr/bin/chromium (apt-get install chromium, or `make test` as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        try:
            yield sync_api, page
        except Exception as e:
            page.screenshot(path=str(ARTIFACTS / failure_png))
            try:  # what the page said, in the failure itself: CI keeps the log, not the screenshot
                e.add_note(f"the page at {page.url} showed:\n{page.inner_text('body', timeout=5000)[-3000:]}")
            except Exception as unread:  # the page itself is gone: say so, keep the first error
                e.add_note(f"(the page's text could not be read: {unread})")
            raise
        finally:
            browser.close()


def _stage_count(page) -> int:
    text = page.get_by_text(re.compile(r"\d+ stages? \(")).first.inner_text()
    return int(re.search(r"(\d+) stages? \(", text).group(1))


def _click_node(page, node: str) -> None:
    xy = page.evaluate(POINT_JS, node)
    assert xy is not None, f"node {node} not drawn"
    page.mouse.move(xy[0] - 15, xy[1])  # Plotly picks the clicked point from hover data: hover first
    page.mouse.move(*xy, steps=3)
    page.wait_for_timeout(300)
    page.mouse.click(*xy)


def _select_by_clicks(page, labels: list[str]) -> None:
    """Click each node in turn until every label shows in the selection and stays there.

    On a busy machine a click can land while the chart is still redrawing from the previous one
    (Plotly then reports an empty selection, which clears ours): such a click is made again, up to
    three rounds, so the test checks what a user sees after clicking, not the machine's load.
    """
    for _ in range(3):
        for label in labels:
            if page.get_by_text(label).count() == 0:
                _click_node(page, label.split(" (", 1)[0])
                page.get_by_text(label).wait_for(timeout=WAIT_MS)
                page.wait_for_timeout(1000)  # let the chart redraw with the selection outline
        page.wait_for_timeout(1000)
        if all(page.get_by_text(label).count() > 0 for label in labels):
            return
    raise AssertionError(f"clicking the nodes did not leave {labels} selected")


def test_click_select_and_merge_in_chromium(server):
    with chromium_page("failure.png") as (sync_api, page):
        page.goto(server)
        page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=90_000)
        page.wait_for_timeout(1000)
        page.screenshot(path=str(ARTIFACTS / "plan_initial.png"))
        before = _stage_count(page)
        assert before == 3

        page.wait_for_timeout(500)
        # ln1 is in stage s0, sdpa in s1 (excluded): clicks add to the selection, mirrored into the multiselect
        _select_by_clicks(page, ["ln1 (s0)", "scaled_dot_product_attention (s1)"])
        page.screenshot(path=str(ARTIFACTS / "plan_selected.png"))

        merge = page.get_by_role("button", name="Merge")
        sync_api.expect(merge).to_be_enabled(timeout=WAIT_MS)
        merge.click()
        # s0's batched nodes would become a member loop: the app says so and waits
        page.get_by_text("into a member loop", exact=False).first.wait_for(timeout=WAIT_MS)
        assert _stage_count(page) == before
        page.screenshot(path=str(ARTIFACTS / "plan_merge_warning.png"))
        page.get_by_role("button", name=re.compile("Apply anyway")).click()
        # (not the text "merge s0+s1": the warning itself holds it, so that wait passed before the rerun on a busy
        # machine) the warning gone, and the stage count down by one
        sync_api.expect(page.get_by_role("button", name=re.compile("Apply anyway"))).to_have_count(0, timeout=WAIT_MS)
        page.get_by_text(re.compile(rf"\b{before - 1} stages? \(")).first.wait_for(timeout=WAIT_MS)
        page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=WAIT_MS)
        page.wait_for_timeout(1000)
        assert _stage_count(page) == before - 1
        page.screenshot(path=str(ARTIFACTS / "plan_merged.png"))

        page.get_by_role("button", name="Undo").click()
        page.get_by_text("undid: merge s0+s1").wait_for(timeout=WAIT_MS)
        assert _stage_count(page) == before

        # box select from the chart toolbar picks several nodes at once
        page.wait_for_timeout(1000)
        page.locator(".js-plotly-plot").hover()
        page.locator(".modebar-btn[data-val='select']").click()
        a, c = page.evaluate(POINT_JS, "ffn_0"), page.evaluate(POINT_JS, "ffn_2")
        page.mouse.move(a[0] - 30, a[1] - 10)
        page.mouse.down()
        page.mouse.move(c[0] + 30, c[1] + 10, steps=8)
        page.mouse.up()
        for node in ("ffn_0", "ffn_1", "ffn_2"):
            page.get_by_text(f"{node} (s2)").wait_for(timeout=WAIT_MS)
        page.screenshot(path=str(ARTIFACTS / "plan_box_selected.png"))

        # a page link drops the query string; the app puts the token back, so a reload still gets in
        page.get_by_role("link", name="Model").click()
        page.get_by_text("Open a model").wait_for(timeout=WAIT_MS)
        page.wait_for_timeout(1000)
        assert "token=" in page.url, page.url
        page.reload()
        page.get_by_text("Open a model").wait_for(timeout=WAIT_MS)
        assert page.get_by_text("Access refused").count() == 0

        # the address without the token: nothing but the refusal
        stranger = page.context.browser.new_page(viewport={"width": 1200, "height": 800})
        stranger.goto(server.split("?", 1)[0])
        stranger.get_by_text("Access refused").wait_for(timeout=WAIT_MS)
        assert stranger.locator(".js-plotly-plot").count() == 0
        stranger.screenshot(path=str(ARTIFACTS / "no_token_refused.png"))


def _wait_for_box(page, vid: str) -> None:
    page.wait_for_function("(id) => { const gd = document.querySelector('.js-plotly-plot');"
                           " return gd && gd.data && gd.data.some(t => (t.customdata || []).includes(id)); }",
                           arg=vid, timeout=WAIT_MS)
    page.wait_for_timeout(800)


@pytest.mark.parametrize("server", [STACK], indirect=True)
def test_click_expands_and_collapses_modules_and_the_wheel_scrolls(server):
    with chromium_page("failure.png", height=1000) as (_, page):
        page.goto(server)
        # a big graph opens collapsed, and the 24 identical blocks are one box
        _wait_for_box(page, "fold:layers.0-23")
        page.screenshot(path=str(ARTIFACTS / "stack_folded.png"))
        _click_node(page, "fold:layers.0-23")
        _wait_for_box(page, "module:layers.5")  # unfolded: one box per block
        assert page.evaluate(POINT_JS, "fold:layers.0-23") is None
        _click_node(page, "module:layers.5")
        _wait_for_box(page, "layers_5_q")  # expanded in place: its nodes are drawn, the other blocks stay boxes
        assert page.evaluate(POINT_JS, "module:layers.4") is not None
        page.screenshot(path=str(ARTIFACTS / "stack_block_expanded.png"))
        _click_node(page, "open:layers.5")  # its tag collapses it again
        _wait_for_box(page, "module:layers.5")
        assert page.evaluate(POINT_JS, "layers_5_q") is None
        # the multiselect shows the truth: 24 blocks collapsed
        assert page.get_by_text("layers.23", exact=True).count() >= 1

        # the mouse wheel over the (tall) graph scrolls the page instead of zooming the chart
        xy = page.evaluate(POINT_JS, "module:layers.2")
        page.mouse.move(*xy)
        before = page.evaluate("() => document.querySelector('section.stMain, .main, [data-testid=stAppScrollToBottomContainer]') ? 0 : 0")
        y0 = page.evaluate(POINT_JS, "module:layers.2")[1]
        page.mouse.wheel(0, 600)
        page.wait_for_timeout(800)
        y1 = page.evaluate(POINT_JS, "module:layers.2")[1]
        assert before == 0 and y1 < y0 - 300, f"the page did not scroll under the wheel ({y0} -> {y1})"
