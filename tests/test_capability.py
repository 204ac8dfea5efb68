"""Capability: the vmap probe decides per node whether it can run batched, and says why not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import planner
from stagewise.planner.capability import DEFAULT_CHECK, classify_vmap_error
from conftest import SAMPLE_NAMES, RunningTotal

EXPECTED_UNBATCHABLE = {  # sample -> {node: words the reason must contain}
    "mlp": {},
    "deep_mlp": {},
    "resblock": {},
    "moe": {},
    "cnn": {},
    "shape_loop": {},
    "gru": {"gru": "no batching rule for gru"},
    "data_dependent": {"item": "data-dependent value", "sign_branch": "data-dependent value"},
    "transformer_block": {"scaled_dot_product_attention": "no batching rule for scaled_dot_product_attention"},
}


def test_every_sample_has_an_expectation():
    assert set(EXPECTED_UNBATCHABLE) == set(SAMPLE_NAMES)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_verdicts(sample, name):
    _, graph = sample(name)
    got = planner.unbatchable(graph)
    want = EXPECTED_UNBATCHABLE[name]
    assert set(got) == set(want)
    for node, words in want.items():
        assert words in got[node]
    for n in graph.node_names:  # inputs, outputs and parameter fetches never need a verdict
        if graph.dag.nodes[n]["op"] in ("placeholder", "output", "get_attr"):
            assert graph.dag.nodes[n]["batchable"]


def fresh_graph(model: nn.Module, *inputs: torch.Tensor):
    """Trace a model made by the test (eval mode), not a cached sample: annotate_capability writes to the graph."""
    return planner.trace(model.eval(), tuple(inputs))


def test_inplace_buffer_update():
    graph = fresh_graph(RunningTotal(), torch.randn(2, 4))
    got = planner.unbatchable(graph)
    assert list(got) == ["add_"]
    assert "in-place update of buffer 'total' (add_)" in got["add_"]


def test_inplace_on_an_activation_is_fine():
    class Act(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            h.mul_(2)
            return h

    assert planner.unbatchable(fresh_graph(Act(), torch.randn(2, 4))) == {}


def test_batchnorm_in_training_mode():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.train()
    graph = planner.trace(model, (torch.randn(5, 4),))
    got = planner.unbatchable(graph)
    assert list(got) == ["_1"]  # fx names Sequential's child "1" as node "_1"
    assert "running_mean/running_var" in got["_1"] and "training mode" in got["_1"] and ".eval()" in got["_1"]
    model.eval()
    assert planner.unbatchable(planner.trace(model, (torch.randn(5, 4),))) == {}


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return F.dropout(h, p=0.5, training=True) + torch.rand_like(h)


def test_randomness():
    got = planner.unbatchable(fresh_graph(Noisy(), torch.randn(2, 4)))
    assert set(got) == {"dropout", "rand_like"}
    assert all(r.startswith("randomness in") for r in got.values())


@torch.fx.wrap
def threshold_by_mean(x):
    return x * (1.0 if x.mean().item() > 0 else -1.0)


@torch.fx.wrap
def softsign_wrapped(x):
    return x / (1 + x.abs())


class Wrapped(nn.Module):
    def forward(self, x):
        return threshold_by_mean(softsign_wrapped(x))


def test_opaque_functions_are_probed_not_allow_listed():
    """Both are opaque call_function nodes; only running them under vmap tells them apart."""
    graph = fresh_graph(Wrapped(), torch.randn(3, 4))
    assert planner.unbatchable(graph).keys() == {"threshold_by_mean"}
    assert graph.dag.nodes["softsign_wrapped"]["batchable"]


def test_python_on_sizes_is_batchable():
    class Reshape(nn.Module):
        def forward(self, x):
            n = x.shape[0]
            return x.reshape(n, -1) * 2

    graph = fresh_graph(Reshape(), torch.randn(3, 4, 2))
    assert planner.unbatchable(graph) == {}


def test_user_checks_compose_with_chain():
    calls = []

    def no_fc2(graph, node):
        calls.append(node.name)
        return "user: keep fc2 in a loop" if node.name == "fc2" else None

    src = planner.load_model_file("sample_models/mlp.py")
    graph = planner.trace(src.model, src.example_inputs, probe=False)
    planner.annotate_capability(graph, planner.chain(no_fc2, DEFAULT_CHECK))
    assert planner.unbatchable(graph) == {"fc2": "user: keep fc2 in a loop"}
    assert set(calls) == {"fc1", "act", "fc2"}  # only ops are checked
    plan = planner.propose(graph, n_members=2)
    assert [(s.nodes, s.mode.value, s.reason) for s in plan.stages] == [
        (("fc1", "act"), "batched", ""), (("fc2",), "excluded", "user: keep fc2 in a loop")]


def test_chain_first_reason_wins():
    first = lambda g, n: "first"  # noqa: E731
    second = lambda g, n: "second"  # noqa: E731
    none = lambda g, n: None  # noqa: E731
    assert planner.chain(none, first, second)(None, None) == "first"
    assert planner.chain(none, none)(None, None) is None
    assert planner.chain()(None, None) is None


class _Node:
    name = "op"
    op = "call_function"
    target = torch.sin


@pytest.mark.parametrize("message, words", [
    ("vmap: It looks like you're calling .item() on a Tensor", "data-dependent value"),
    ("Data dependent control flow is not supported", "data-dependent value"),
    ("vmap: called random operation while in randomness error mode", "randomness in sin"),
    ("Batching rule not implemented for aten::foo", "no batching rule for sin"),
    ("vmap: inplace arithmetic(self, *extra_args) is not possible", "in-place update not possible"),
    ("something else entirely", "fails under vmap: RuntimeError: something else"),
])
def test_classify_vmap_error(message, words):
    assert words in classify_vmap_error(_Node(), RuntimeError(message))


def test_classify_empty_message():
    assert "fails under vmap: ValueError: ValueError" in classify_vmap_error(_Node(), ValueError())


def test_an_aten_attention_op_without_a_batching_rule_is_not_counted_as_batchable():
    """Was batchable in a torch.export graph: vmap's fallback warning for the aten op went to stderr, not Python,
    so every Hugging Face attention ran through vmap's per-member fallback instead of `wide`."""
    import warnings

    from stagewise import planner

    class Attend(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x):
            if x.shape[0] > 1:  # a branch on a size: traced with torch.export
                x = x * 2
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(Attend(), (torch.randn(2, 5, 8),))
    assert graph.tracer == "export"
    attention = [n for n in graph.dag if "scaled_dot_product" in str(graph.dag.nodes[n].get("target"))]
    assert attention and all(not graph.dag.nodes[n]["batchable"] for n in attention)
    assert "no batching rule" in graph.dag.nodes[attention[0]]["reason"]
