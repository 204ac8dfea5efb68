"""How fast the Plan page's graph draws: `python -m benchmarks.graph_view` (also `make bench-graph`).

Traces stacks of the sample transformer block (tests/app/models/transformer_stack.py) with
about 100, 1,000 and 5,000 nodes and times, server side, what the Plan page does:

- first draw: collapse + Graphviz layout + Plotly figure + its JSON (what Streamlit sends),
  with the layout cache empty;
- click (select): the figure again with another selection (the layout is cached);
- click (expand): one module box opened in place (a new view: a new layout);

each for the view the page opens with (big graphs collapsed, identical blocks folded) and for
every node drawn. Medians of `--repeats` runs; writes results/graph-view.md.

The browser's own drawing comes on top: `--browser` (needs playwright and /usr/bin/chromium)
also times, in headless Chromium, the first render of the every-node figure from a page that
has plotly.js already loaded, and a full redraw (Plotly.newPlot: a rerun with new data).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

from stagewise import planner
from stagewise.app import dot_layout
from stagewise.app import graph_view as gv
from stagewise.app.figure import FigureOptions, build_figure, spec_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "graph-view.md"
SIZES = {100: 3, 1000: 37, 5000: 185}  # ~nodes: layers of the 27-node block


def _stack_module():
    spec = importlib.util.spec_from_file_location("_stack", ROOT / "tests" / "app" / "models" / "transformer_stack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


FIGURES: list[tuple[int, str]] = []  # (nodes, figure JSON) of every-node views, for --browser


def measure(layers: int, repeats: int) -> list[dict]:
    mod = _stack_module()
    model = mod.Stack(layers=layers).eval()
    graph = planner.trace(model, mod.example_inputs(), probe=False)
    plan = planner.propose(graph, n_members=4)
    data = gv.graph_data(graph)
    depth = gv.auto_collapse(data) if len(data.nodes) > gv.AUTO_COLLAPSE_NODES else 0
    opened = gv.boxes_at_depth(data, depth) if depth else []
    rows = []
    for label, collapsed in (("as the page opens it", opened), ("every node drawn", [])):
        names = [n.name for n in data.nodes]
        firsts, selects, expands = [], [], []
        boxes = 0
        for _ in range(repeats):
            dot_layout.layout.cache_clear()
            view = gv.collapse(data, collapsed)
            boxes = len(view.ids)
            firsts.append(_timed(lambda: build_figure(data, gv.collapse(data, collapsed), plan).to_json()))
            selects.append(_timed(lambda: build_figure(data, view, plan, FigureOptions(selected=frozenset(names[3:9]))).to_json()))
            target = next((v for v in view.ids if view.kind(v) != "node"), None)
            if target is not None:
                def expand():
                    ch = gv.toggle(data, view, target, collapsed, ())
                    build_figure(data, gv.collapse(data, ch.collapsed, ch.unfolded), plan).to_json()
                expands.append(_timed(expand))
        if not collapsed:
            FIGURES.append((len(data.nodes), build_figure(data, view, plan).to_json()))
        engine = dot_layout.layout(spec_of(data, gv.collapse(data, collapsed))).engine
        rows.append({"nodes": len(data.nodes), "view": label, "boxes": boxes, "engine": engine,
            "first": statistics.median(firsts), "select": statistics.median(selects),
            "expand": statistics.median(expands) if expands else None})
    return rows


REDRAW_JS = """(fig) => { const gd = document.getElementById('g'); const t0 = performance.now();
  return Plotly.newPlot(gd, fig.data, fig.layout).then(() => new Promise(r => requestAnimationFrame(() => r(performance.now() - t0)))); }"""


def browser_times(figures: list[tuple[int, str]], repeats: int) -> dict[int, tuple[float, float]]:
    """{nodes: (first render s, redraw s)} in headless Chromium, plotly.js loaded before the clock starts."""
    import plotly.offline
    from playwright.sync_api import sync_playwright

    page_html = f"<html><body><div id='g'></div><script>{plotly.offline.get_plotlyjs()}</script></body></html>"
    out = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.set_content(page_html)
        for nodes, fig_json in figures:
            fig = json.loads(fig_json)
            times = [page.evaluate(REDRAW_JS, fig) / 1000 for _ in range(repeats + 1)]
            out[nodes] = (times[0], statistics.median(times[1:]))
        browser.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--browser", action="store_true", help="also time drawing in headless Chromium (playwright)")
    ap.add_argument("--sizes", default="100,1000,5000", help="approximate node counts, from " + ", ".join(map(str, SIZES)))
    args = ap.parse_args(argv)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows += measure(SIZES[size], args.repeats)
        for r in rows[-2:]:
            print(f"{r['nodes']:>5} nodes, {r['view']:<22} {r['boxes']:>5} boxes ({r['engine']}): first draw {r['first']:.2f} s, "
                  f"click (select) {r['select']:.2f} s, click (expand) "
                  + (f"{r['expand']:.2f} s" if r["expand"] is not None else "-"), flush=True)
    lines = [f"# Graph view timings (server side, medians of {args.repeats})", "",
             f"Machine: {_cpu_name()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}, dot: {'yes' if dot_layout.has_dot() else 'no (layered fallback)'}.", "",
             "| nodes | view | boxes drawn | first draw s | click: select s | click: expand s |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['view']} | {r['boxes']} | {r['first']:.2f} | {r['select']:.2f} | "
                     + (f"{r['expand']:.2f} |" if r["expand"] is not None else "- |"))
    if args.browser:
        lines += ["", "In headless Chromium (plotly.js already loaded; the figure with every node drawn):", "",
                  "| nodes | first render s | redraw s |", "|---:|---:|---:|"]
        for nodes, (first, redraw) in browser_times(FIGURES, args.repeats).items():
            print(f"{nodes:>5} nodes in Chromium: first render {first:.2f} s, redraw {redraw:.2f} s")
            lines.append(f"| {nodes} | {first:.2f} | {redraw:.2f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
