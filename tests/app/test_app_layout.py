"""Layout, collapse, search and figure building on small fakes (no streamlit, no tracing)."""
from __future__ import annotations

from app_fakes import random_dag, residual_graph, residual_plan

from stagewise.app import graph_view as gv
from stagewise.app.figure import FigureOptions, build_figure, drawing_of
from stagewise.app.dot_view import plan_dot
from stagewise.app.layout import layered_layout, layers_of
from stagewise.planner.plan import Stage, StageMode


def test_layers_follow_edges_top_to_bottom():
    data = gv.graph_data(residual_graph())
    pos = layered_layout([n.name for n in data.nodes], data.edges)
    for u, v in data.edges:
        assert pos[u][1] > pos[v][1], f"{u} should be drawn above {v}"
    assert pos["x"][1] == 0


def test_nodes_of_a_layer_are_spaced():
    g = random_dag(300, seed=3)
    data = gv.graph_data(g)
    pos = layered_layout([n.name for n in data.nodes], data.edges)
    by_y: dict[float, list[float]] = {}
    for x, y in pos.values():
        by_y.setdefault(y, []).append(x)
    for xs in by_y.values():
        xs.sort()
        assert all(b - a >= 0.999 for a, b in zip(xs, xs[1:]))


def test_cyclic_view_still_gets_layers():
    layers = layers_of(["a", "b", "c"], [("a", "b"), ("b", "a"), ("b", "c")])
    assert sorted(map(sorted, layers)) == [["a", "b"], ["c"]]


def test_collapse_contracts_module_and_expands_back():
    data = gv.graph_data(residual_graph())
    view = gv.collapse(data, ["block", "block.fc1"])  # nested choice folds into the outer one
    assert "module:block" in view.ids and "block_fc1" not in view.ids
    assert view.expand(["module:block"]) == ["block_fc1", "block_act", "block_fc2"]
    assert ("x", "module:block") in view.edges and ("module:block", "add") in view.edges
    assert data.module_paths() == ["block", "head", "block.act", "block.fc1", "block.fc2"]


def test_search_matches_name_target_and_module():
    data = gv.graph_data(residual_graph())
    assert gv.search(data, "FC") == ["block_fc1", "block_fc2"]
    assert gv.search(data, "head") == ["out"]
    assert gv.search(data, "  ") == []


def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def test_figure_draws_regions_boxes_and_hit_points_per_stage():
    data, plan = gv.graph_data(residual_graph()), residual_plan()
    view = gv.collapse(data)
    fig = build_figure(data, view, plan, FigureOptions(selected=frozenset({"add"})))
    names = [t.name for t in fig.data]
    # the stage regions come first and carry the legend
    assert names[:3] == ["s0 · batched (vmap) · 4 nodes", "s1 · member loop · 1 node", "s2 · batched (vmap) · 1 node"]
    hits = [t for t in fig.data if t.name.endswith(" nodes") and t.mode == "markers"]
    assert sorted(set(c for t in hits for c in t.customdata)) == sorted(view.ids)  # every box answers clicks
    loop = _trace(fig, "s1 · member loop · 1 node")
    assert loop.fillpattern.shape == "/" and loop.line.dash == "dash"  # hatched and dashed, never a stage colour
    assert _trace(fig, "s1 boxes").fillcolor == gv.EXCLUDED_FILL
    assert "not batchable</b>: calls .item()" in _trace(fig, "s1 nodes").hovertext[0]
    assert _trace(fig, "cannot batch").line.color == gv.CANNOT_BATCH
    assert _trace(fig, "selected").line.color == "#000000"
    labels = _trace(fig, "labels")
    assert "<b>add</b>" in labels.text[list(view.ids).index("add")]


def test_every_edge_is_drawn_with_an_arrow_and_skip_edges_are_routed():
    data, plan = gv.graph_data(residual_graph()), residual_plan()
    view = gv.collapse(data)
    d = drawing_of(data, view)
    assert {(e.tail, e.head) for e in d.edges} == set(view.edges)
    assert all(len(e.arrow) == 4 for e in d.edges)
    fig = build_figure(data, view, plan)
    assert sum(1 for v in _trace(fig, "edges").x if v is None) == len(view.edges)
    # the skip edge x -> add does not run through the boxes of the block it skips
    skip = next(e for e in d.edges if (e.tail, e.head) == ("x", "add"))
    for vid in ("block_fc1", "block_act", "block_fc2"):
        b = d.boxes[vid]
        inside = [p for p in skip.path if abs(p[0] - b.x) < b.w / 2 and abs(p[1] - b.y) < b.h / 2]
        assert not inside, f"x -> add crosses {vid}"


def test_layout_does_not_move_nodes_when_the_plan_changes():
    data, plan = gv.graph_data(residual_graph()), residual_plan()
    view = gv.collapse(data)
    merged = plan.with_stages([Stage("s0", plan.stages[0].nodes + plan.stages[1].nodes + plan.stages[2].nodes,
                                     StageMode.EXCLUDED, reason="r")])
    before = _trace(build_figure(data, view, plan), "labels")
    after = _trace(build_figure(data, view, merged), "labels")
    assert list(before.x) == list(after.x) and list(before.y) == list(after.y)


def test_stage_regions_hug_their_boxes():
    from stagewise.app.dot_layout import Box, regions

    boxes = {"a": Box(50, 100, 40, 20), "b": Box(50, 60, 40, 20), "c": Box(120, 60, 40, 20), "d": Box(50, 20, 40, 20)}
    shapes = regions(boxes, {"s": ["a", "b", "c"], "t": ["d"]}, pad=5)
    (poly,) = shapes["s"]  # rows a and b+c are adjacent: one staircase polygon
    xs, ys = [p[0] for p in poly], [p[1] for p in poly]
    assert min(xs) == 25 and max(xs) == 145 and max(ys) == 115 and min(ys) == 45
    assert poly[0] == poly[-1]
    # the row of a spans only a (25..75), the row of b and c spans both
    assert (75, 115) in poly and (145, 45) in poly
    assert len(shapes["t"]) == 1


def test_the_spine_runs_straight_down():
    from app_fakes import transformer_like_graph

    data = gv.graph_data(transformer_like_graph(blocks=6))
    view = gv.collapse(data)
    d = drawing_of(data, view)
    if d.engine != "dot":
        import pytest
        pytest.skip("the Graphviz dot program is not installed")
    adds = [n.name for n in data.nodes if n.name.startswith("add")]
    assert len({round(d.boxes[a].x) for a in adds}) == 1, "the residual stream should be one straight column"
    assert d.width < 600


def test_figure_colours_by_measured_time():
    data, plan = gv.graph_data(residual_graph()), residual_plan()
    view = gv.collapse(data)
    fig = build_figure(data, view, plan, FigureOptions(stage_times={"s0": 2.0, "s1": 5.0}))
    assert fig.data[1].name == "s1: 5 ms" and fig.data[2].name == "s2: not measured"
    unmeasured = _trace(fig, "s2 boxes")  # white, dotted: no colour on the time scale, so it cannot read as fast
    assert unmeasured.fillcolor == gv.UNMEASURED_FILL and unmeasured.line.dash == "dot"
    assert _trace(fig, "s1 boxes").fillcolor != _trace(fig, "s0 boxes").fillcolor


def test_stage_colours_follow_the_stage_not_its_position():
    from dataclasses import replace

    plan = residual_plan()
    colors = gv.stage_colors(plan)
    # a stage in front of s0 (its first node carved off) renumbers everything: the other stages keep their colours
    split = plan.with_stages([Stage("s0", ("block_fc1",)), replace(plan.stages[0], id="s1", nodes=plan.stages[0].nodes[1:]),
                              replace(plan.stages[1], id="s2"), replace(plan.stages[2], id="s3")])
    after = gv.stage_colors(split)
    assert after["s0"] == colors["s0"]  # the first part keeps the stage's colour
    assert after["s3"] == colors["s2"]
    merged = plan.with_stages([Stage("s0", plan.stages[0].nodes + plan.stages[1].nodes + plan.stages[2].nodes)])
    assert gv.stage_colors(merged)["s0"] == colors["s0"]  # a merge keeps the first stage's colour
    assert not set(gv.PALETTE) & {"#d62728", "#ff9896", gv.CANNOT_BATCH, gv.EXCLUDED_FILL}  # never red, never loop grey


def test_an_excluded_stage_run_wide_is_drawn_batched():
    from stagewise.planner.plan import StageOptions, Strategy

    data, plan = gv.graph_data(residual_graph()), residual_plan()
    wide = plan.with_stages([plan.stages[0], Stage("s1", ("item",), StageMode.EXCLUDED, reason="calls .item()",
                                                   options=StageOptions(strategy=Strategy.WIDE)), plan.stages[2]])
    view = gv.collapse(data)
    fig = build_figure(data, view, wide)
    s1 = fig.data[1]
    assert s1.name == "s1 · batched (wide) · 1 node"
    assert s1.line.color == gv.stage_colors(wide)["s1"] and s1.line.dash == "solid" and s1.fillpattern.shape is None
    assert "batched (wide), excluded from vmap" in _trace(fig, "s1 nodes").hovertext[0]


def test_measured_times_land_only_on_stages_measured_as_they_are():
    from stagewise.app.profile_view import measured_stage_times

    plan = residual_plan()
    ok = {"ok": True, "time": {"median_ms": 3.0}}
    merged_report = {"stages": [{"id": "s0", "result": ok}],
                     "plan": plan.with_stages([Stage("s0", ("block_fc1", "block_act", "block_fc2", "add", "item", "out"),
                                                     StageMode.EXCLUDED, reason="r")]).to_json()}
    assert measured_stage_times(plan, merged_report) == {}  # the merged stage's time is not s0's
    same = {"stages": [{"id": "s0", "result": ok}, {"id": "s2", "result": ok}], "plan": plan.to_json()}
    assert measured_stage_times(plan, same) == {"s0": 3.0, "s2": 3.0}
    assert measured_stage_times(plan, {"stages": [{"id": "s0", "result": ok}]}) == {}  # no plan: nothing to match


def test_selection_event_maps_points_to_nodes():
    data = gv.graph_data(residual_graph())
    view = gv.collapse(data, ["block"])
    event = {"selection": {"points": [{"customdata": "module:block"}, {"customdata": ["add"]}, {"x": 1}]}}
    assert gv.selection_from_event(event, view) == ["block_fc1", "block_act", "block_fc2", "add"]
    assert gv.selection_from_event(None, view) == []


def test_thousand_node_graph_draws_every_box_and_edge():
    from stagewise.planner.plan import Plan, Stage, InputSpec

    g = random_dag(1000)
    data = gv.graph_data(g)
    names = [n.name for n in data.nodes]
    plan = Plan("random1000", "fx", 4, (InputSpec("x"),),
                tuple(Stage(f"s{i}", tuple(names[j:j + 10])) for i, j in enumerate(range(0, 1000, 10))))
    # how fast: benchmarks/graph_view.py (timings are measured there, not asserted here)
    view = gv.collapse(data)
    fig = build_figure(data, view, plan, FigureOptions(selected=frozenset(names[:5])))
    hits = {c for t in fig.data if t.mode == "markers" and t.name.endswith(" nodes") for c in t.customdata}
    assert hits == set(view.ids)
    assert sum(1 for v in next(t for t in fig.data if t.name == "edges").x if v is None) == len(view.edges)


def test_dot_has_a_cluster_per_stage_and_dashed_excluded():
    data, plan = gv.graph_data(residual_graph()), residual_plan()
    dot = plan_dot(data, gv.collapse(data), plan)
    assert dot.count("subgraph cluster_") == 3
    assert "rankdir=TB" in dot and "dashed" in dot
    assert '"block_fc1" -> "block_act"' in dot or "block_fc1 -> block_act" in dot


def test_auto_collapse_picks_the_finest_level_that_fits():
    data = gv.graph_data(random_dag(1000))  # modules layers (1), layers.<k> (50), layers.<k>.sub<j> (200)
    assert gv.auto_collapse(data, max_view=60) == 2 and len(gv.modules_at_depth(data, 2)) == 50
    assert gv.auto_collapse(data, max_view=250) == 3 and len(gv.modules_at_depth(data, 3)) == 200
    assert gv.auto_collapse(data, max_view=1) == 1 and gv.auto_collapse(data, max_view=0) == 0


def test_sources_sit_just_above_their_first_consumer():
    # x -> a -> b -> c, and a weight w used only by c: w belongs next to c, not in the top row
    pos = layered_layout(["x", "w", "a", "b", "c"], [("x", "a"), ("a", "b"), ("b", "c"), ("w", "c")])
    assert pos["x"][1] == 0 and pos["w"][1] == pos["b"][1] > pos["c"][1]
