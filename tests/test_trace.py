"""Tracing: fx first, torch.export as fallback; per-node shapes, dtypes, params, FLOPs; fingerprints."""
from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

import planner
from planner import NodeInfo, TraceError
from planner.graph import COMPUTE_OPS, _normalise_module_path, describe_shape, fingerprint_lines
from conftest import EXPORT_SAMPLES, SAMPLE_NAMES, RunningTotal, ScaleInPlace


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_graph_structure(sample, name):
    src, graph = sample(name)
    dag = graph.dag
    assert isinstance(dag, nx.DiGraph) and nx.is_directed_acyclic_graph(dag)
    fx_names = [n.name for n in graph.gm.graph.nodes]
    assert graph.node_names == fx_names and set(dag.nodes) == set(fx_names)
    for u, v in dag.edges:  # node_names is a topological order
        assert graph.topo_index(u) < graph.topo_index(v)
    for node in graph.gm.graph.nodes:
        assert {d.name for d in node.all_input_nodes} == set(dag.predecessors(node.name))
    assert graph.input_names == [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    assert len(graph.input_names) == len(src.example_inputs)
    assert graph.compute_nodes == [n for n in fx_names if dag.nodes[n]["op"] in COMPUTE_OPS]
    assert not any(dag.nodes[n]["op"] in ("placeholder", "output") for n in graph.compute_nodes)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_every_node_is_annotated(sample, name):
    _, graph = sample(name)
    for n in graph.node_names:
        info = graph.info(n)
        assert isinstance(info, NodeInfo) and info.name == n
        assert set(NodeInfo.__dataclass_fields__) <= set(graph.dag.nodes[n])
        assert info.shape != "?", f"{n} has no recorded shape"
        assert isinstance(info.params, int) and info.params >= 0
        assert isinstance(info.flops, int) and info.flops >= 0
        assert isinstance(info.batchable, bool)
        assert info.batchable == (info.reason == "")
    assert sum(graph.dag.nodes[n]["flops"] for n in graph.node_names) > 0


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_tracer_choice(sample, name):
    _, graph = sample(name)
    if name in EXPORT_SAMPLES:
        assert graph.tracer == "export"
        assert "torch.fx failed" in graph.tracer_note and "Proxy" in graph.tracer_note
        assert not any(n.op == "call_module" for n in graph.gm.graph.nodes), "export guard module should be dropped"
    else:
        assert graph.tracer == "fx" and graph.tracer_note == ""


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_parameter_counts_add_up(sample, name):
    """Every parameter is owned by exactly one node (its call_module or get_attr)."""
    src, graph = sample(name)
    total = sum(graph.dag.nodes[n]["params"] for n in graph.node_names)
    assert total == sum(p.numel() for p in src.model.parameters())


def test_mlp_node_details(sample):
    _, graph = sample("mlp")
    fc1 = graph.info("fc1")
    assert (fc1.op, fc1.target, fc1.module_path) == ("call_module", "fc1 (Linear)", "fc1")
    assert fc1.shape == "[32, 128]" and fc1.dtype == "float32"
    assert fc1.params == 64 * 128 + 128
    assert fc1.flops == 2 * 32 * 64 * 128
    assert graph.info("act").flops == 0 and graph.info("act").params == 0
    assert graph.info("x").op == "placeholder" and graph.info("x").shape == "[32, 64]"
    assert graph.info("output").shape == "[32, 64]"
    assert graph.compute_nodes == ["fc1", "act", "fc2"]


def test_export_nodes_keep_module_paths(sample):
    _, graph = sample("shape_loop")
    linears = [n for n in graph.compute_nodes if graph.dag.nodes[n]["target"] == "aten.linear.default"]
    assert len(linears) == 2 * 12  # the loop is unrolled at the example length
    assert {graph.dag.nodes[n]["module_path"] for n in linears} == {"cell", "rec"}
    assert all(graph.dag.nodes[n]["flops"] == 2 * 8 * 32 * 32 for n in linears)
    weights = [n for n in graph.compute_nodes if graph.dag.nodes[n]["op"] == "get_attr"]
    assert sorted(graph.dag.nodes[n]["params"] for n in weights) == [32, 32 * 32, 32 * 32]


def test_trace_does_not_modify_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planner.trace(model, (torch.randn(5, 4),))
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_probe_false_skips_capability():
    class ItemModel(nn.Module):
        def forward(self, x):
            return x * x.sum().item()

    unprobed = planner.trace(ItemModel(), (torch.randn(3),), probe=False)
    assert all(d["batchable"] for _, d in unprobed.dag.nodes(data=True))
    probed = planner.trace(ItemModel(), (torch.randn(3),))
    assert not probed.dag.nodes["item"]["batchable"]


# --- fingerprints -------------------------------------------------------------

def test_fingerprint_is_stable_and_ignores_weight_values(write_model):
    src = planner.load_model_file(write_model(_tiny(8)))
    a, b = src.members(2)
    fa = planner.trace(a, src.example_inputs).fingerprint
    assert fa == planner.trace(b, src.example_inputs).fingerprint
    assert fa == planner.trace(a, src.example_inputs).fingerprint
    assert len(fa) == 16 and int(fa, 16) >= 0


def test_fingerprint_sees_shapes_and_structure(write_model):
    base = planner.load_model_file(write_model(_tiny(8), "a.py"))
    wider = planner.load_model_file(write_model(_tiny(9), "b.py"))
    fb = planner.trace(base.model, base.example_inputs).fingerprint
    fw = planner.trace(wider.model, wider.example_inputs).fingerprint
    assert fb != fw
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    assert planner.trace(other, base.example_inputs).fingerprint != fb


def test_fingerprint_lines_show_structure_and_state(sample):
    _, graph = sample("mlp")
    lines = fingerprint_lines(graph.gm)
    assert "fc1 = call_module fc1:Linear(x)" in lines
    assert "state fc1.weight: [128, 64] torch.float32" in lines
    assert planner.fingerprint(graph.gm) == graph.fingerprint


def test_retrace_matches_trace(sample):
    for name in ("mlp", "shape_loop"):
        src, graph = sample(name)
        again = planner.retrace(src.members(1)[0], graph.tracer, src.example_inputs)
        assert again.fingerprint == graph.fingerprint
        assert again.node_names == graph.node_names


def test_retrace_errors(sample):
    src, _ = sample("mlp")
    with pytest.raises(TraceError, match="unknown tracer 'jit'"):
        planner.retrace(src.model, "jit", src.example_inputs)
    with pytest.raises(TraceError, match="needs example inputs.*example_inputs="):
        planner.retrace(src.model, "export", None)
    shape_src, _ = sample("shape_loop")
    with pytest.raises(TraceError, match="torch.fx cannot trace this member.*re-plan"):
        planner.retrace(shape_src.model, "fx", None)


# --- models that cannot be traced -------------------------------------------------------

class BranchOnData(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_both_tracers_fail_names_both_reasons():
    with pytest.raises(TraceError) as info:
        planner.trace(BranchOnData(), (torch.randn(3),))
    msg = str(info.value)
    assert msg.startswith("BranchOnData cannot be traced")
    assert "torch.fx failed: TraceError" in msg and "torch.export failed:" in msg
    assert "torch.cond" in msg  # says what to do


def test_example_inputs_that_do_not_fit():
    with pytest.raises(TraceError, match="failed on the example inputs.*example_inputs"):
        planner.trace(nn.Linear(4, 2), (torch.randn(3, 5),))


# --- small helpers ---------------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (torch.zeros(2, 3), "[2, 3]"),
    (torch.tensor(1.0), "[]"),
    ((torch.zeros(1), torch.zeros(2, 2)), "([1], [2, 2])"),
    ([torch.zeros(1)] * 8, "([1], [1], [1], [1], [1], [1], ...)"),
    (torch.Size([4, 5]), "Size[4, 5]"),
    (None, "None"),
    (3, "int"),
    (2.5, "float"),
])
def test_describe_shape(value, text):
    assert describe_shape(value) == text


@pytest.mark.parametrize("raw, clean", [
    ("L['self'].layers[0].attn", "layers.0.attn"),
    ("L['self'].blocks['enc'].ffn", "blocks.enc.ffn"),
    ("self.cell", "cell"),
    ("L['self']", ""),
    ("cell", "cell"),
])
def test_normalise_module_path(raw, clean):
    assert _normalise_module_path(raw) == clean


def _tiny(width: int) -> str:
    return f'''
import torch
import torch.nn as nn


def build_model():
    return nn.Sequential(nn.Linear(4, {width}), nn.ReLU(), nn.Linear({width}, 2)).eval()


def example_inputs():
    return (torch.randn(3, 4),)
'''


# --- in-place updates: order edges ----------------------------------------------------------


def test_inplace_buffer_update_orders_later_reads():
    model = RunningTotal().eval()
    graph = planner.trace(model, (torch.randn(3, 4),))
    assert torch.equal(model.total, torch.zeros(4)), "tracing ran the update on the model's own buffer"
    dag = graph.dag
    assert dag.edges["add_", "total_1"].get("order") is True  # fx records no data edge here
    assert dag.edges["add_", "add"].get("order") is True
    assert not dag.edges["total", "add_"].get("order")  # a data edge stays a data edge
    assert nx.is_directed_acyclic_graph(dag)
    for u, v in dag.edges:
        assert graph.topo_index(u) < graph.topo_index(v)


def test_inplace_on_an_activation_orders_its_other_readers():
    graph = planner.trace(ScaleInPlace(), (torch.randn(3, 4),))
    assert graph.dag.edges["add", "mul_"].get("order") is True  # read before the update
    assert graph.dag.edges["mul_", "sub"].get("order") is True  # read after it
    plan = planner.exclude(planner.propose(graph, 2), graph, "mul_")
    assert [s.nodes for s in plan.stages] == [("fc", "add"), ("mul_",), ("sub",)]
