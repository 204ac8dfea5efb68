"""The graph view's structure: folds of repeated blocks, click to expand/collapse/unfold, one-node modules."""
from __future__ import annotations

from app_fakes import residual_graph, transformer_like_graph

from stagewise.app import graph_view as gv
from stagewise.app.figure import build_figure, drawing_of
from stagewise.planner.plan import InputSpec, Plan, Stage


def _data(blocks=6):
    return gv.graph_data(transformer_like_graph(blocks))


def test_identical_blocks_in_a_chain_fold_into_one_box():
    data = _data(6)
    layers = [f"layers.{i}" for i in range(6)]
    view = gv.collapse(data, layers)
    (fid,) = view.folds
    assert fid == "fold:layers.0-5" and view.folds[fid] == tuple(layers)
    # the fold stands for every node of the six blocks
    assert set(view.expand([fid])) == {n.name for n in data.nodes if n.module_path.startswith("layers.")}
    assert view.ids == ("x", fid, "output")
    assert view.kind(fid) == "fold" and view.kind("x") == "node"
    assert ("x", fid) in view.edges
    # unfolded, the six blocks are boxes of their own again
    unfolded = gv.collapse(data, layers, unfolded=["layers"])
    assert not unfolded.folds and sum(v.startswith(gv.MODULE_PREFIX) for v in unfolded.ids) == 6


def test_blocks_that_differ_or_are_too_few_do_not_fold():
    data = _data(2)
    assert not gv.collapse(data, ["layers.0", "layers.1"]).folds  # two blocks: below MIN_FOLD
    data = _data(4)
    assert not gv.collapse(data, ["layers.0", "layers.2", "layers.3"]).folds  # layers.1 open: the run is broken
    g = transformer_like_graph(4)
    g.dag.nodes["layers_2_fc1"]["shape"] = "[32, 128]"  # one block differs: the run splits around it
    view = gv.collapse(gv.graph_data(g), [f"layers.{i}" for i in range(4)])
    assert not view.folds


def test_a_one_node_module_is_drawn_as_its_node():
    data = gv.graph_data(residual_graph())
    view = gv.collapse(data, ["head"])  # head holds only `out`
    assert "out" in view.ids and "module:head" not in view.ids


def test_clicks_expand_unfold_and_collapse():
    data = _data(6)
    view = gv.collapse(data, ["layers"])
    assert view.ids.count("module:layers") == 1
    # a click on the collapsed `layers` box opens one level: the blocks become boxes (and fold)
    ch = gv.toggle(data, view, "module:layers", ["layers"], [])
    assert set(ch.collapsed) == {f"layers.{i}" for i in range(6)} and "expanded layers" in ch.message
    view = gv.collapse(data, ch.collapsed, ch.unfolded)
    assert list(view.folds) == ["fold:layers.0-5"]
    # a click on the fold shows the six blocks
    ch = gv.toggle(data, view, "fold:layers.0-5", ch.collapsed, ch.unfolded)
    assert ch.unfolded == ("layers",)
    view = gv.collapse(data, ch.collapsed, ch.unfolded)
    # a click on block 2 opens it: its parts with more than one node (ffn) become boxes, the rest are nodes
    ch = gv.toggle(data, view, "module:layers.2", ch.collapsed, ch.unfolded)
    assert "layers.2" not in ch.collapsed and "layers.2.ffn" in ch.collapsed
    view = gv.collapse(data, ch.collapsed, ch.unfolded)
    assert "layers_2_q" in view.ids and "module:layers.2.ffn" in view.ids
    assert not view.folds and "module:layers.4" in view.ids  # the other blocks stay unfolded
    # the tag of an expanded module collapses it again, with everything inside
    ch = gv.toggle(data, view, gv.OPEN_PREFIX + "layers", ch.collapsed, ch.unfolded)
    assert ch.collapsed == ("layers",) and ch.unfolded == ()


def test_a_click_is_told_apart_from_a_box_selection():
    click = {"selection": {"points": [{"customdata": "module:layers"}, {"customdata": "module:layers"}], "box": [], "lasso": []}}
    assert gv.clicked_view_id(click) == "module:layers"  # a wide box answers with several hit points: still one click
    box = {"selection": {"points": [{"customdata": "a"}], "box": [{"x": [0, 1], "y": [0, 1]}], "lasso": []}}
    assert gv.clicked_view_id(box) is None
    assert gv.clicked_view_id({"selection": {"points": []}}) is None and gv.clicked_view_id(None) is None


def test_expanded_modules_get_a_frame_and_a_tag_that_collapses_them():
    data = _data(3)
    names = [n.name for n in data.nodes]
    plan = Plan("t", "fx", 2, (InputSpec("x"),), (Stage("s0", tuple(names[1:-1])),))
    view = gv.collapse(data, ["layers.1.ffn"])
    fig = build_figure(data, view, plan)
    tags = next(t for t in fig.data if t.name == "module tags")
    assert {gv.OPEN_PREFIX + f"layers.{i}" for i in range(3)} <= set(tags.customdata)
    assert gv.OPEN_PREFIX + "layers.1.ffn" not in tags.customdata  # collapsed: a box, not a frame
    d = drawing_of(data, view)
    assert "module:layers.1.ffn" in d.boxes
