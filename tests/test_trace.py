"""Tracing: fx first, torch.export as fallback; per-node shapes, dtypes, params, FLOPs; fingerprints."""
from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from stagewise import planner
from stagewise.planner import NodeInfo, TraceError
from stagewise.planner.graph import COMPUTE_OPS, _normalise_module_path, describe_shape, fingerprint_lines
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


# --- what the trace assumed of the inputs (shape guards of an export trace) -------------------

import copy  # noqa: E402

from stagewise import executor  # noqa: E402
from stagewise.planner import InputError, InputMode  # noqa: E402
from stagewise.planner.plan import DynamicDim  # noqa: E402


class ShapeBranch(nn.Module):
    """fx cannot trace `if x.shape[1] > 10`; export keeps dim 1 dynamic with the guard x.shape[1] >= 11."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[1] > 10:
            h = h.cumsum(1)
        else:
            h = h * 2
        return h.mean(1)


class PairLoop(nn.Module):
    """Two inputs whose batch dims export ties together (x + y), and a loop over x.shape[1] (fixed dim)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.fc(y)
        for t in range(x.shape[1]):
            h = torch.tanh(h + self.fc(x[:, t]))
        return h


def _members(cls, n, seed=0):
    torch.manual_seed(seed)
    return [cls().eval() for _ in range(n)]


def _loop(members, *inputs, per_member=False):
    with torch.no_grad():
        return torch.stack([m(*(x[i] for x in inputs) if per_member else inputs) for i, m in enumerate(members)])


def _built(cls, example, n=3, mode="shared"):
    members = _members(cls, n)
    graph = planner.trace(copy.deepcopy(members[0]), example)
    plan = planner.propose(graph, n, mode)
    plan = planner.Plan.loads(plan.dumps())  # what a saved plan file gives back
    return plan, members, executor.build(plan, members)  # no example_inputs: the plan's traced shapes are used


def test_export_plan_records_traced_shapes_and_dynamic_dims(sample):
    src, graph = sample("shape_loop")
    plan = planner.propose(graph, 2)
    (x,) = plan.inputs
    assert (x.shape, x.dtype) == ((8, 12, 32), "float32")
    assert x.dynamic_dim(0) == DynamicDim(0, symbol="d0")  # batch: any size
    assert x.dynamic_dim(1) is None and x.dynamic_dim(2) is None  # unrolled loop and Linear's in-features: fixed


def test_fx_plan_records_every_dim_as_dynamic(sample):
    _, graph = sample("mlp")
    (x,) = planner.propose(graph, 2).inputs
    assert (x.shape, x.dtype) == ((32, 64), "float32")
    assert [d.dim for d in x.dynamic_dims] == [0, 1]


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_export_plan_called_at_another_sequence_length_refuses_before_running(mode):
    plan, members, ens = _built(ShapeLoopTiny, (torch.randn(2, 6, 4),), mode=mode)
    assert plan.tracer == "export"
    x = torch.randn(2, 9, 4)
    if mode == "per_member":
        x = x.expand(3, -1, -1, -1).contiguous()
    calls = []
    for p in ens.programs:  # nothing may run
        p.module.register_forward_pre_hook(lambda *a: calls.append(1))
    where = r" \(of each member's input, after the member axis\)" if mode == "per_member" else ""
    with pytest.raises(InputError, match=rf"input 'x' has size 9 at dim 1{where}, but the plan was traced with torch.export "
                                         r"at size 6 and the trace fixed that dim; pass size 6 there or re-plan"):
        ens(x)
    assert not calls


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_export_plan_takes_other_batch_sizes_and_matches_the_loop(mode):
    plan, members, ens = _built(ShapeLoopTiny, (torch.randn(2, 6, 4),), mode=mode)
    per_member = mode == "per_member"
    g = torch.Generator().manual_seed(3)
    for batch in (2, 5, 5, 1):  # two calls at one shape, other shapes, size 1 (export's guards accept it too)
        x = torch.randn(*((3,) if per_member else ()), batch, 6, 4, generator=g)
        with torch.no_grad():
            got = ens(x)
        torch.testing.assert_close(got, _loop(members, x, per_member=per_member), rtol=1e-5, atol=1e-6)
    assert (got[0] - got[1]).abs().max() > 1e-3  # members really differ


def test_export_plan_with_a_guarded_range():
    plan, members, ens = _built(ShapeBranch, (torch.randn(4, 12, 8),))
    (x,) = plan.inputs
    assert x.dynamic_dim(1).min == 11 and x.dynamic_dim(1).max is None  # the branch taken holds for >= 11
    for shape in [(4, 12, 8), (6, 20, 8), (6, 20, 8)]:
        inp = torch.randn(*shape)
        torch.testing.assert_close(ens(inp), _loop(members, inp), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"input 'x' has size 8 at dim 1; the plan's torch.export trace accepts 11\.\.any"):
        ens(torch.randn(4, 8, 8))  # the other branch: the loop would compute h * 2, the plan cumsum


def test_export_plan_checks_dtype_rank_and_tied_dims():
    plan, members, ens = _built(PairLoop, (torch.randn(3, 5, 4), torch.randn(3, 4)))
    x, y = plan.inputs
    assert x.dynamic_dim(0).symbol == y.dynamic_dim(0).symbol != ""  # export ties the two batch dims
    a, b = torch.randn(7, 5, 4), torch.randn(7, 4)
    torch.testing.assert_close(ens(a, b), _loop(members, a, b), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"input 'y' has size 6 at dim 0, but input 'x' has size 7 at dim 0.*equal"):
        ens(a, torch.randn(6, 4))
    with pytest.raises(InputError, match=r"input 'x' is float64.*assumed float32; pass .to\(torch.float32\)"):
        ens(a.double(), b)
    with pytest.raises(InputError, match=r"input 'y' has 3 dims \[1, 7, 4\].*traced with 2 dims \[3, 4\]"):
        ens(a, b[None])


def test_fx_plan_is_not_checked_against_traced_shapes(sample):
    src, graph = sample("mlp")  # fx graphs are shape- and dtype-generic: other shapes must not be refused
    plan = planner.propose(graph, 2)
    members = src.members(2)
    ens = executor.build(plan, members)
    for x in (torch.randn(7, 64), torch.randn(3, 5, 64)):
        torch.testing.assert_close(ens(x), _loop(members, x), rtol=1e-5, atol=1e-6)


class ShapeLoopTiny(nn.Module):
    """shape_loop in small: a Python loop over x.shape[1] that fx cannot trace and export unrolls."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(4, 4)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 4)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(x[:, t]) + h)
        return h


def test_old_plan_file_without_shapes_is_still_guarded():
    plan, members, _ = _built(ShapeLoopTiny, (torch.randn(2, 6, 4),))
    d = plan.to_json()
    d["inputs"] = [{"name": i["name"], "mode": i["mode"]} for i in d["inputs"]]  # as written before shapes were recorded
    old = planner.Plan.from_json(d)
    assert old.inputs[0].shape is None
    with pytest.raises(TraceError, match="example_inputs="):
        executor.build(old, members)
    ens = executor.build(old, members, example_inputs=(torch.randn(2, 6, 4),))
    x = torch.randn(4, 6, 4)
    torch.testing.assert_close(ens(x), _loop(members, x), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"condition of the plan's torch.export trace \(Guard failed: x.size\(\)\[1\] == 6\)"):
        ens(torch.randn(4, 9, 4))  # export's own guard, kept as a backstop


# --- forward() parameters with defaults --------------------------------------------------------

class WithDefaults(nn.Module):
    """Like timm's ViT blocks: forward(x, attn_mask=None, is_causal=False)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, flag=False, scale=2.0):
        h = self.fc(x)
        if mask is not None:
            h = h * mask
        if flag:
            h = h + 1
        return h * scale


def test_fx_parameters_with_defaults_take_their_defaults():
    members = _members(WithDefaults, 3)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(2, 4),))
    assert graph.tracer == "fx" and graph.input_names == ["x"]
    plan = planner.propose(graph, 3)
    ens = executor.build(plan, members)
    for x in (torch.randn(2, 4), torch.randn(5, 4)):
        torch.testing.assert_close(ens(x), _loop(members, x), rtol=1e-5, atol=1e-6)


def test_fx_parameters_given_by_the_example_stay_inputs():
    members = _members(WithDefaults, 2)
    example = (torch.randn(2, 4), torch.rand(2, 4))
    graph = planner.trace(copy.deepcopy(members[0]), example)
    assert graph.input_names == ["x", "mask"]  # flag and scale keep their defaults
    ens = executor.build(planner.propose(graph, 2), members)
    x, mask = torch.randn(3, 4), torch.rand(3, 4)
    torch.testing.assert_close(ens(x, mask), _loop(members, x, mask), rtol=1e-5, atol=1e-6)
    again = planner.retrace(copy.deepcopy(members[0]), "fx", None, ["x", "mask"])
    assert again.fingerprint == graph.fingerprint


def test_packed_sequences_are_refused_naming_them_and_the_fix():
    # Was: both tracers' errors (`__cuda_array_interface__` must be a dict; zeros() got a FakeTensor) and advice about
    # Python control flow, which says nothing of the packing.
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.r, self.bn = nn.LSTM(5, 4, batch_first=True), nn.BatchNorm1d(7)

        def forward(self, x, lengths):
            p = pack_padded_sequence(self.bn(x), lengths, batch_first=True, enforce_sorted=False)
            y, (h, c) = self.r(p)
            return pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])[0], h

    model = Packed()
    stats = model.bn.running_mean.clone()
    with pytest.raises(planner.TraceError, match=r"packs sequences .*mask the padding"):
        planner.trace(model, (torch.randn(2, 7, 5), torch.tensor([7, 4])))
    assert torch.equal(model.bn.running_mean, stats)  # the look at forward() changed nothing


class _VmapInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 4))

    def forward(self, x):
        return torch.vmap(lambda w: x @ w)(self.w).sum(0)


def test_a_forward_calling_torch_vmap_itself_is_named_not_blamed_on_the_example_inputs():
    """Was: "the traced graph failed on the example inputs ... check that example_inputs() matches"."""
    with pytest.raises(TraceError, match=r"forward\(\) calls torch.vmap .* itself.*batched tensor ops"):
        planner.trace(_VmapInside(), (torch.randn(5, 4),))


class _MaskIfTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, mask):
        y = self.fc(x)
        if isinstance(mask, torch.Tensor):  # false for an fx proxy: fx dropped the mask
            y = y * mask[..., None]
        return y


class _RnnOutputTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.GRU(8, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        out = self.rnn(x)
        if isinstance(out, tuple):  # the common idiom: fx's graph then failed on the example inputs
            out = out[0]
        return self.fc(out)


def test_an_fx_graph_that_is_not_forward_on_the_example_inputs_falls_back_to_export():
    """Was: the mask silently dropped (1.2 off, every call accepted); the tuple idiom refused ("check that
    example_inputs() matches")."""
    from stagewise import executor

    torch.manual_seed(0)
    members = [_MaskIfTensor() for _ in range(3)]
    x, mask = torch.randn(2, 5, 8), (torch.rand(2, 5) > 0.5).float()
    graph = planner.trace(members[0], (x, mask))
    assert graph.tracer == "export" and "other values than forward()" in graph.tracer_note
    ens = executor.build(planner.propose(graph, 3), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x, mask), torch.stack([m(x, mask) for m in members]))
    graph = planner.trace(_RnnOutputTuple(), (torch.randn(2, 5, 8),))
    assert graph.tracer == "export" and "fails on the example inputs where forward() runs" in graph.tracer_note


class _Policy(nn.Module):
    """An RL policy as written with torch.distributions (default validate_args): log-prob of given actions, entropy."""

    def __init__(self, returns_distribution=False):
        super().__init__()
        self.pi, self.returns_distribution = nn.Linear(6, 4), returns_distribution

    def forward(self, obs, actions):
        dist = torch.distributions.Categorical(logits=self.pi(obs))
        if self.returns_distribution:
            return dist
        return dist.log_prob(actions), dist.entropy()


def test_a_policy_built_on_torch_distributions_is_traced_with_their_checks_off():
    """Was: refused ("Remove data-dependent Python control flow"): the distributions' argument checks branch on values."""
    from stagewise import executor

    torch.manual_seed(0)
    checks = torch.distributions.Distribution._validate_args
    members = [_Policy() for _ in range(3)]
    obs, actions = torch.randn(5, 6), torch.randint(0, 4, (5,))
    ens = executor.build(planner.propose(planner.trace(members[0], (obs, actions)), 3), members)
    with torch.no_grad():
        got, want = ens(obs, actions), [m(obs, actions) for m in members]
    for k in range(2):
        torch.testing.assert_close(got[k], torch.stack([w[k] for w in want]))
    assert torch.distributions.Distribution._validate_args == checks  # the checks as they were afterwards
    with pytest.raises(TraceError, match=r"returns a Categorical \(a torch.distributions object\).*return its parameters"):
        planner.trace(_Policy(returns_distribution=True), (obs, actions))


class _ListInExport(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, xs):
        return sum(self.fc(x) for x in xs)  # iterating a proxy: torch.export it is


def test_a_container_input_of_a_model_that_needs_export_is_refused_at_trace_naming_the_fix():
    """Was: trace and propose took it (inputs xs_0, xs_1), then build failed with "too many positional arguments"."""
    with pytest.raises(TraceError, match=r"takes a list as input 0, and this model needs torch.export.*separate arguments"):
        planner.trace(_ListInExport(), ([torch.randn(4, 8), torch.randn(4, 8)],))


class _AuxWhenTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc(x)
        aux = h.pow(2).mean() * 0.1 if torch.is_grad_enabled() else h.new_zeros(())
        return h, aux


def test_the_fx_check_runs_forward_in_the_traces_grad_mode_and_leaves_the_random_state():
    """Review: the check ran under no_grad, where the model took its other side, so fx was dropped for export (or
    refused where export could not trace); it also moved torch's global random state."""
    torch.manual_seed(123)
    graph = planner.trace(_AuxWhenTraining(), (torch.randn(5, 8),))
    after = torch.rand(3)
    assert graph.tracer == "fx", graph.tracer_note
    torch.manual_seed(123)
    torch.nn.Linear(8, 4)  # the model's own draws, as above
    torch.randn(5, 8)
    torch.testing.assert_close(after, torch.rand(3))


def test_int_of_a_tensor_is_named_with_the_item_fix():
    class Truncate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            return h.flatten()[:int((h > 0).sum())].sum() * h

    with pytest.raises(planner.TraceError, match=r"int\(\) of a tensor.*write t\.item\(\) instead"):
        planner.trace(Truncate(), (torch.randn(5, 8),))


@pytest.mark.parametrize("flag", ["torch.fx._symbolic_trace.is_fx_tracing()", "torch.compiler.is_compiling()"])
def test_a_branch_on_being_traced_is_refused_where_export_takes_it(flag):
    """fx's graph disagrees (or fx fails) and torch.export takes the traced side as well: the batched module was 0.5 off
    the loop, unchecked."""
    ns = {"torch": torch, "nn": nn}
    exec(f'''
class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        for _ in range(x.shape[0]):  # a loop over a shape: fx fails
            y = y + 0
        if {flag}:
            return y
        return y * 2
''', ns)
    with pytest.raises(TraceError, match=r"torch.export's graph is not forward\(\).*is_compiling"):
        planner.trace(ns["Flagged"]().eval(), (torch.randn(3, 8),))
