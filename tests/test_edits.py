"""Plan edits: unit tests, and hypothesis-driven random edit sequences.

The property tests apply random merge/split/exclude/include sequences to the
sample graphs and to random DAG models (Linear / elementwise / two-branch adds,
with a few `.item()` nodes so some nodes cannot be batched). After every
accepted edit the plan invariants hold and the plan is built and matches the
member loop on two calls (every few edits also executor.verify, which checks the
stage boundaries). A refused edit raises EditError and leaves the plan as it was.
"""
from __future__ import annotations

import copy
import functools
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

from stagewise import executor
from stagewise import planner
from stagewise.executor.baselines import stack_outputs
from stagewise.executor.profile import max_rel_error
from stagewise.planner import EditError, Plan, PlanMismatchError, StageMode, Strategy
from stagewise.planner.validate import stage_graph
from conftest import SAMPLE_NAMES, check_plan_invariants, examples

RTOL = 1e-4


def modes(plan: Plan) -> list[tuple[tuple[str, ...], str]]:
    return [(s.nodes, s.mode.value) for s in plan.stages]


@pytest.fixture(scope="module")
def dd(sample):
    """data_dependent: s0 (fc1, relu, abs_1, max_1) | s1 item | s2 (add, truediv, fc2) | s3 sign_branch | s4 fc3."""
    _, graph = sample("data_dependent")
    return planner.propose(graph, 3), graph


def test_data_dependent_layout(dd):
    plan, _ = dd
    assert modes(plan) == [
        (("fc1", "relu", "abs_1", "max_1"), "batched"), (("item",), "excluded"), (("add", "truediv", "fc2"), "batched"),
        (("sign_branch",), "excluded"), (("fc3",), "batched")]


# --- merge ---------------------------------------------------------------------------

def test_merge_refused_when_a_path_leaves_and_returns(dd):
    plan, graph = dd
    with pytest.raises(EditError) as info:
        planner.merge(plan, graph, "s0", "s2")
    msg = str(info.value)
    assert msg.startswith("merge('s0', 's2'): would create a cycle s0 -> s1 -> s2")
    assert "max_1 -> item -> add" in msg
    assert "merge s1 into them as well, or split s1 first" in msg


def test_merge_batched_with_excluded_gives_excluded(dd):
    plan, graph = dd
    merged = planner.merge(plan, graph, "s0", "s1")
    check_plan_invariants(merged, graph)
    assert modes(merged)[0] == (("fc1", "relu", "abs_1", "max_1", "item"), "excluded")
    assert "data-dependent value" in merged.stages[0].reason
    assert len(merged.stages) == 4 and merged.fingerprint == plan.fingerprint and merged.n_members == 3


def test_merge_is_symmetric_in_nodes(dd):
    plan, graph = dd
    assert modes(planner.merge(plan, graph, "s0", "s1")) == modes(planner.merge(plan, graph, "s1", "s0"))


def test_merge_two_batched_keeps_first_options(sample):
    _, graph = sample("mlp")
    plan = planner.split(planner.propose(graph, 2), graph, "s0", at="act")
    plan = planner.set_options(plan, graph, "s1", chunk_size=2)
    merged = planner.merge(plan, graph, "s1", "s0")
    assert modes(merged) == [(("fc1", "act", "fc2"), "batched")]
    assert merged.stages[0].options.chunk_size == 2


def test_merge_chain_through_the_excluded_stage(sample):
    _, graph = sample("transformer_block")
    plan = planner.propose(graph, 2)
    with pytest.raises(EditError, match="s0 -> s1 -> s2"):
        planner.merge(plan, graph, "s0", "s2")
    one = planner.merge(planner.merge(plan, graph, "s0", "s1"), graph, "s0", "s1")
    assert len(one.stages) == 1 and one.stages[0].mode is StageMode.EXCLUDED
    with pytest.raises(EditError, match="'scaled_dot_product_attention' cannot be batched.*exclude\\('scaled_dot_product_attention'\\)"):
        planner.include(one, graph, "s0")


@pytest.mark.parametrize("a, b, message", [
    ("s0", "s0", "cannot be merged with itself"),
    ("s0", "s9", "no stage 's9'; stages are \\['s0', 's1', 's2', 's3', 's4'\\]"),
    ("x", "s1", "no stage 'x'"),
])
def test_merge_refusals(dd, a, b, message):
    plan, graph = dd
    with pytest.raises(EditError, match=message):
        planner.merge(plan, graph, a, b)


# --- split ---------------------------------------------------------------------------

def test_split_at_a_node(dd):
    plan, graph = dd
    new = planner.split(plan, graph, "s0", at="abs_1")
    check_plan_invariants(new, graph)
    assert modes(new)[:2] == [(("fc1", "relu"), "batched"), (("abs_1", "max_1"), "batched")]
    assert [s.id for s in new.stages] == [f"s{i}" for i in range(6)]


def test_split_off_a_convex_selection(sample):
    _, graph = sample("moe")
    plan = planner.propose(graph, 2)
    nodes = plan.stages[0].nodes
    first_expert = nodes[nodes.index("experts_0_fc1"):nodes.index("experts_0_fc2") + 1]  # fc1, relu, fc2
    new = planner.split(plan, graph, "s0", at=first_expert)
    check_plan_invariants(new, graph)
    assert len(first_expert) == 3 and tuple(first_expert) in [s.nodes for s in new.stages]


class TwoWay(nn.Module):
    """a = l1(x); c = l3(x); outputs l2(a) and a + c: selections can be convex yet feed each other."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        a = self.l1(x)
        c = self.l3(x)
        return self.l2(a), a + c


@pytest.fixture(scope="module")
def two_way():
    graph = planner.trace(TwoWay(), (torch.randn(2, 4),))
    plan = planner.propose(graph, 2)
    assert modes(plan) == [(("l1", "l3", "l2", "add"), "batched")]
    return plan, graph


def test_split_refused_when_the_parts_feed_each_other(two_way):
    plan, graph = two_way
    with pytest.raises(EditError) as info:
        planner.split(plan, graph, "s0", at={"l1", "add"})
    msg = str(info.value)
    assert "the two parts would feed each other (l1 -> l2 and l3 -> add)" in msg and "split at a single node instead" in msg
    assert modes(planner.split(plan, graph, "s0", at={"l1", "l2"})) == [(("l1", "l2"), "batched"), (("l3", "add"), "batched")]


def test_merge_refused_when_the_stage_graph_would_cycle_through_a_third_stage(two_way):
    """{l1} and {add} are convex together, but {l1, add} -> {l3, l2} -> {l1, add} would be a stage cycle."""
    plan, graph = two_way
    plan = planner.split(planner.split(plan, graph, "s0", at="l3"), graph, "s1", at="add")
    assert modes(plan) == [(("l1",), "batched"), (("l3", "l2"), "batched"), (("add",), "batched")]
    with pytest.raises(EditError, match=r"merge\('s0', 's2'\): refused.*cycle"):
        planner.merge(plan, graph, "s0", "s2")
    assert len(planner.merge(planner.merge(plan, graph, "s0", "s1"), graph, "s0", "s1").stages) == 1


@pytest.mark.parametrize("at, message", [
    ("fc1", "'fc1' is the first node of s0, nothing comes before it"),
    ("fc3", "node 'fc3' is not in stage s0"),
    ({"fc1", "abs_1"}, "would not be convex: path fc1 -> relu -> abs_1"),
    ({"relu"}, "would not be convex: path fc1 -> relu -> abs_1"),
    ({"fc1", "relu", "abs_1", "max_1"}, "select some but not all nodes of s0"),
    ({"fc3"}, "nodes \\['fc3'\\] are not in stage s0"),
])
def test_split_refusals(dd, at, message):
    plan, graph = dd
    with pytest.raises(EditError, match=message):
        planner.split(plan, graph, "s0", at=at)


# --- exclude / include -------------------------------------------------------------------

def test_exclude_stage_and_include_back(dd):
    plan, graph = dd
    out = planner.exclude(plan, graph, "s4")
    s4 = out.stage("s4")
    assert s4.mode is StageMode.EXCLUDED and s4.reason == "excluded by user" and s4.options.strategy is Strategy.LOOP
    assert planner.include(out, graph, "s4") == plan


def test_exclude_a_node_carves_it_out(dd):
    plan, graph = dd
    out = planner.exclude(plan, graph, "relu")
    check_plan_invariants(out, graph)
    assert modes(out)[:3] == [(("fc1",), "batched"), (("relu",), "excluded"), (("abs_1", "max_1"), "batched")]
    assert out.stage_of("relu").reason == "excluded by user"
    assert len(out.stages) == 7


def test_exclude_the_only_node_excludes_the_stage(dd):
    plan, graph = dd
    assert planner.exclude(plan, graph, "fc3") == planner.exclude(plan, graph, "s4")


def test_exclude_a_node_with_branches(sample):
    """Carving a node out of a stage with parallel branches keeps both remaining parts convex."""
    _, graph = sample("moe")
    plan = planner.propose(graph, 2)
    for node in plan.stages[0].nodes[1:6]:
        check_plan_invariants(planner.exclude(plan, graph, node), graph)


@pytest.mark.parametrize("edit, message", [
    (lambda p, g: planner.exclude(p, g, "s1"), "stage s1 is already excluded"),
    (lambda p, g: planner.exclude(p, g, "nope"), "no stage or node named 'nope'"),
    (lambda p, g: planner.include(p, g, "s0"), "stage s0 is already batched"),
    (lambda p, g: planner.include(p, g, "s1"), "include\\('s1'\\): node 'item' cannot be batched \\(data-dependent value"),
    (lambda p, g: planner.include(p, g, "s7"), "no stage 's7'"),
])
def test_exclude_include_refusals(dd, edit, message):
    plan, graph = dd
    with pytest.raises(EditError, match=message):
        edit(plan, graph)


def test_edits_refuse_another_graph(dd, sample):
    plan, _ = dd
    _, mlp_graph = sample("mlp")
    for edit in (lambda: planner.merge(plan, mlp_graph, "s0", "s1"), lambda: planner.exclude(plan, mlp_graph, "s0"),
                 lambda: planner.split(plan, mlp_graph, "s0", at="relu"), lambda: planner.include(plan, mlp_graph, "s1")):
        with pytest.raises(EditError, match=f"fingerprint {plan.fingerprint}.*another graph \\({mlp_graph.fingerprint}\\)"):
            edit()


def test_set_options(dd):
    plan, graph = dd
    out = planner.set_options(plan, graph, "s0", chunk_size=2, note="hand-tuned")
    assert out.stage("s0").options.chunk_size == 2 and out.stage("s0").options.note == "hand-tuned"
    assert planner.set_options(plan, graph, "s1", strategy="loop").stage("s1").options.strategy is Strategy.LOOP
    for kwargs, message in [({"speed": 3}, "unknown options \\['speed'\\]"), ({"strategy": "warp"}, "unknown strategy 'warp'"),
                            ({"chunk_size": 0}, "chunk_size must be a positive integer"), ({"chunk_size": 1.5}, "chunk_size")]:
        with pytest.raises(EditError, match=message):
            planner.set_options(plan, graph, "s0", **kwargs)
    with pytest.raises(EditError, match="s1 is excluded .*cannot run under vmap; use loop or wide"):
        planner.set_options(plan, graph, "s1", strategy="vmap")


def test_edits_drop_a_stale_profile(dd):
    plan, graph = dd
    profiled = plan.with_profile({"stages": []})
    assert planner.exclude(profiled, graph, "s4").profile is None


def test_refused_edit_leaves_the_plan_alone(dd):
    plan, graph = dd
    before = plan.dumps()
    with pytest.raises(EditError):
        planner.merge(plan, graph, "s0", "s2")
    assert plan.dumps() == before


def test_edited_plan_still_matches_the_loop(dd, sample):
    plan, graph = dd
    src, _ = sample("data_dependent")
    plan = planner.exclude(plan, graph, "relu")
    plan = planner.merge(plan, graph, "s5", "s6")
    plan = planner.split(plan, graph, "s4", at="fc2")
    assert modes(plan)[-3:] == [(("add", "truediv"), "batched"), (("fc2",), "batched"), (("sign_branch", "fc3"), "excluded")]
    report = executor.verify(plan, src.members(3), src.example_inputs)
    assert report.ok, report.to_text()


# --- validate: hand-edited plan files ------------------------------------------------------------

def hand_edited(plan: Plan, edit) -> Plan:
    """The plan after `edit(json_dict)`, as a user editing the JSON file would leave it (loads does not validate)."""
    d = json.loads(plan.dumps())
    edit(d)
    return Plan.loads(json.dumps(d))


def _stage(d: dict, sid: str) -> dict:
    return next(s for s in d["stages"] if s["id"] == sid)


def _batch(*sids):
    def edit(d):
        for sid in sids:
            s = _stage(d, sid)
            s["mode"], s["reason"], s["options"]["strategy"] = "batched", "", "vmap"
    return edit


def _merge_s0_s1_batched(d):
    d["stages"][0]["nodes"] += d["stages"][1]["nodes"]
    del d["stages"][1]


@pytest.mark.parametrize("edit, node", [(_batch("s1"), "item"), (_batch("s3"), "sign_branch"), (_batch("s3", "s1"), "item"),
                                        (_merge_s0_s1_batched, "item")], ids=["s1", "s3", "both", "last-in-stage"])
def test_validate_refuses_a_batched_stage_holding_an_unbatchable_node(dd, edit, node):
    plan, graph = dd
    edited = hand_edited(plan, edit)
    message = rf"batched stage s\d holds '{node}', which cannot be batched: data-dependent value .*exclude\('{node}'\)"
    with pytest.raises(PlanMismatchError, match=message):
        planner.validate(edited, graph)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


@pytest.mark.parametrize("edit, message", [
    (_set("fingerprint", "0000000000000000"), "plan fingerprint 0000000000000000 does not match the model's"),
    (lambda d: d["inputs"][0].__setitem__("name", "y"), r"plan inputs \['y'\] differ from the model's \['x'\]"),
    (lambda d: d["stages"][4]["nodes"].append("nope"), "stage s4 names node 'nope', which the graph does not have"),
    (lambda d: d["stages"][4]["nodes"].append("x"), "stage s4 names node 'x', which the graph does not have"),
    (lambda d: d["stages"][2]["nodes"].insert(0, "item"), r"node 'item' is in two stages \(s1 and s2\)"),
    (lambda d: d["stages"].pop(4), r"nodes \['fc3'\] are in no stage"),
    (lambda d: (d["stages"][0]["nodes"].append("add"), d["stages"][2]["nodes"].remove("add")),
     "stage s0 is not convex: path max_1 -> item -> add leaves it and comes back"),
], ids=["fingerprint", "inputs", "unknown", "placeholder", "twice", "missing", "convexity"])
def test_validate_refuses_hand_edited_plans(dd, edit, message):
    plan, graph = dd
    with pytest.raises(PlanMismatchError, match=message):
        planner.validate(hand_edited(plan, edit), graph)
    assert planner.validate(plan, graph) is plan


def test_validate_refuses_stages_that_feed_each_other(two_way):
    """{l1, add} and {l3, l2} are each convex, but l1 -> l2 and l3 -> add make the stage graph a cycle."""
    plan, graph = two_way

    def edit(d):
        stage = d["stages"][0]
        d["stages"] = [dict(copy.deepcopy(stage), id="s0", nodes=["l1", "add"]), dict(copy.deepcopy(stage), id="s1", nodes=["l3", "l2"])]

    with pytest.raises(PlanMismatchError, match="stage graph has a cycle s0 -> s1 -> s0"):
        planner.validate(hand_edited(plan, edit), graph)


# --- random DAG models --------------------------------------------------------------------

class RandomDAG(nn.Module):
    """A random fx-traceable model: Linear (as modules and as F.linear on parameters, i.e. get_attr
    nodes), elementwise, reshapes through sizes, two-branch adds, in-place adds and `.item()` rescalings.

    The architecture comes from `arch_seed` (Python RNG); weights from torch's RNG.
    Input layout [B, D]; output one [B, D] tensor, or a tuple of two. The input is first
    shifted by a per-member parameter, so every value, and so every output, depends on the
    member's weights: a member mix-up anywhere shows in the comparison with the loop.
    """

    KINDS = ("linear", "linear", "flinear", "relu", "tanh", "scale", "add", "add", "inplace", "item", "reshape")

    def __init__(self, arch_seed: int, n_ops: int = 10, d: int = 6):
        super().__init__()
        rng = random.Random(arch_seed)
        self.layers = nn.ModuleDict()
        self.shift = nn.Parameter(torch.randn(d))
        self.spec: list[tuple] = []
        n_items = 0
        for i in range(n_ops):
            kind = rng.choice(self.KINDS)
            if kind == "item" and n_items >= 2:
                kind = "relu"
            n_items += kind == "item"
            a = rng.randrange(i + 1)
            if kind == "linear":
                self.layers[f"l{i}"] = nn.Linear(d, d)
                self.spec.append((kind, a, f"l{i}"))
            elif kind == "flinear":
                self.register_parameter(f"w{i}", nn.Parameter(torch.randn(d, d) / d ** 0.5))
                self.spec.append((kind, a, f"w{i}"))
            elif kind in ("add", "inplace"):
                self.spec.append((kind, a, rng.randrange(i + 1)))
            else:
                self.spec.append((kind, a, None))
        self.second_output = rng.randrange(n_ops + 1) if rng.random() < 0.4 else None

    def forward(self, x):
        values = [x + self.shift]
        for kind, a, b in self.spec:
            v = values[a]
            if kind == "linear":
                v = self.layers[b](v)
            elif kind == "relu":
                v = torch.relu(v)
            elif kind == "tanh":
                v = torch.tanh(v)
            elif kind == "scale":
                v = v * 0.5
            elif kind == "reshape":  # sizes (Python ints) cross stage boundaries too
                rows = v.shape[0]
                v = v.reshape(rows, 2, -1).flatten(1)
            elif kind == "flinear":
                v = F.linear(v, getattr(self, b))
            elif kind == "add":
                v = v + values[b]
            elif kind == "inplace":  # a fresh value, updated in place (readers before and after must stay right)
                v = v * 1.0
                v.add_(values[b])
            else:  # item: a Python float crosses into the next ops
                s = v.abs().mean().item()
                v = v / (1.0 + s)
            values.append(v)
        if self.second_output is not None:
            return values[-1], values[self.second_output]
        return values[-1]


DAG_SEEDS = [3, 11, 17, 42]


@functools.lru_cache(maxsize=None)
def subject(name: str):
    """(graph, members(n), one member's example inputs) for a sample or 'dag<seed>'."""
    if name.startswith("dag"):
        seed = int(name[3:])
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))

        def members(n):
            out = []
            for i in range(n):
                torch.manual_seed(1000 * seed + i)
                out.append(RandomDAG(seed).eval())
            return out

        return planner.trace(members(1)[0], (x,)), members, (x,)
    from conftest import load_sample

    src, graph = load_sample(name)
    return graph, src.members, src.example_inputs


@pytest.mark.parametrize("seed", DAG_SEEDS)
def test_every_output_of_a_random_dag_depends_on_the_member(seed):
    """Two members on the same input give different values in every output."""
    _, members, (x,) = subject(f"dag{seed}")
    a, b = members(2)
    with torch.no_grad():
        outs_a, outs_b = a(x), b(x)
    outs_a, outs_b = (o if isinstance(o, tuple) else (o,) for o in (outs_a, outs_b))
    for oa, ob in zip(outs_a, outs_b):
        assert (oa - ob).abs().max() > 1e-3 * ob.abs().max()


def test_random_dags_have_unbatchable_nodes():
    kinds = [planner.unbatchable(subject(f"dag{s}")[0]) for s in DAG_SEEDS]
    assert any(kinds) and all(all(n.startswith("item") for n in k) for k in kinds)
    ops = {graph.dag.nodes[n]["target"] for s in DAG_SEEDS for graph in [subject(f"dag{s}")[0]] for n in graph.compute_nodes}
    assert {"add_", "item"} <= ops and any(t.startswith("w") for t in ops)  # in-place and get_attr nodes appear
    assert sum(len(subject(f"dag{s}")[0].compute_nodes) for s in DAG_SEEDS) > 40


def draw_edit(data, plan: Plan, graph):
    """One random edit as (label, thunk), mostly ones that may be accepted; some are bound to be refused."""
    ids = [s.id for s in plan.stages]
    excluded = [s.id for s in plan.stages if s.mode is StageMode.EXCLUDED]
    kind = data.draw(st.sampled_from(["merge_next", "split", "exclude_node", "include", "merge_next", "split_set",
                                      "merge_any", "exclude", "merge_next", "split", "unknown"]))
    if kind.startswith("merge"):
        a = data.draw(st.sampled_from(ids))
        after = sorted(stage_graph(plan, graph).successors(a))
        others = [i for i in ids if i != a] or ids
        b = data.draw(st.sampled_from(after if kind == "merge_next" and after else others))
        return f"merge({a}, {b})", lambda: planner.merge(plan, graph, a, b)
    if kind.startswith("split"):
        s = data.draw(st.sampled_from([s for s in plan.stages if len(s.nodes) > 1] or plan.stages))
        if kind == "split":
            at = data.draw(st.sampled_from(s.nodes[1:] or s.nodes))
        else:
            at = data.draw(st.sets(st.sampled_from(s.nodes), min_size=1))
        return f"split({s.id}, at={at})", lambda: planner.split(plan, graph, s.id, at=at)
    if kind == "exclude":
        a = data.draw(st.sampled_from(ids))
        return f"exclude({a})", lambda: planner.exclude(plan, graph, a)
    if kind == "exclude_node":
        n = data.draw(st.sampled_from(graph.compute_nodes))
        return f"exclude({n})", lambda: planner.exclude(plan, graph, n)
    if kind == "include":
        a = data.draw(st.sampled_from(excluded or ids))
        return f"include({a})", lambda: planner.include(plan, graph, a)
    return "merge(s0, s999)", lambda: planner.merge(plan, graph, "s0", "s999")


def second_call_inputs(inputs: tuple) -> tuple:
    """Other values of the same shapes (float inputs rescaled and shifted; others as they are)."""
    return tuple(x * 0.5 + 0.25 if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def built_matches_the_loop(plan: Plan, members: list, inputs: tuple, label: str) -> None:
    """executor.build(plan) against the member loop on two calls with different inputs."""
    module = executor.build(plan, members, example_inputs=executor.member_inputs(plan, inputs, 0))
    for call, x in enumerate((inputs, second_call_inputs(inputs))):
        with torch.no_grad():
            got = module(*x)
        want = stack_outputs(executor.loop_outputs(plan, members, x))
        err = max_rel_error(got, want)
        assert err <= RTOL, f"after {label}, call {call + 1}: max rel err {err:.2e} vs the member loop\n{plan.dumps()}"


def run_edit_sequence(data, name: str, steps: int, verify_every: int | None, n: int = 2) -> int:
    """Random edits from the proposal; every plan reached is checked, built and compared with the loop."""
    graph, members, example = subject(name)
    mode = data.draw(st.sampled_from(["shared", "per_member"]), label="input mode")
    plan = planner.propose(graph, n, input_mode=mode)
    inputs = executor.batched_inputs(plan, example)
    the_members = members(n)
    built_matches_the_loop(plan, the_members, inputs, "propose")
    accepted = 0
    for _ in range(steps):
        label, edit = draw_edit(data, plan, graph)
        before = plan.dumps()
        try:
            new = edit()
        except EditError as e:
            assert str(e), label
            assert plan.dumps() == before, f"{label} was refused but changed the plan"
            continue
        check_plan_invariants(new, graph)
        assert planner.validate(new, graph) is new
        assert Plan.loads(new.dumps()) == new
        assert (new.fingerprint, new.n_members, new.inputs) == (plan.fingerprint, plan.n_members, plan.inputs)
        assert plan.dumps() == before, f"{label} changed its input plan"
        plan = new
        accepted += 1
        built_matches_the_loop(plan, the_members, inputs, label)
        if verify_every and accepted % verify_every == 0:
            report = executor.verify(plan, members(n), inputs)
            assert report.ok, f"after {label}:\n{report.to_text()}"
    return accepted


@settings(max_examples=examples(40))
@given(data=st.data(), seed=st.sampled_from(DAG_SEEDS))
def test_random_edits_on_random_dags(data, seed):
    run_edit_sequence(data, f"dag{seed}", steps=10, verify_every=3)


@settings(max_examples=examples(40))
@given(data=st.data(), name=st.sampled_from(SAMPLE_NAMES))
def test_random_edits_on_samples(data, name):
    run_edit_sequence(data, name, steps=10, verify_every=None)


@pytest.mark.slow
@settings(max_examples=examples(12))
@given(data=st.data(), name=st.sampled_from(sorted(set(SAMPLE_NAMES) - {"shape_loop"})))
def test_random_edits_on_samples_still_match_the_loop(data, name):
    run_edit_sequence(data, name, steps=6, verify_every=3)


@pytest.mark.parametrize("seed", DAG_SEEDS)
def test_random_dag_proposals_match_the_loop(seed):
    graph, members, example = subject(f"dag{seed}")
    for mode in ("shared", "per_member"):
        plan = planner.propose(graph, 3, input_mode=mode)
        check_plan_invariants(plan, graph)
        report = executor.verify(plan, members(3), executor.batched_inputs(plan, example))
        assert report.ok, report.to_text()


def test_excluding_parameter_fetches_and_single_steps(sample):
    """Carve a get_attr (a weight fetch) and one unrolled step out of the export graph; still matches the loop."""
    src, graph = sample("shape_loop")
    plan = planner.propose(graph, 3, input_mode="per_member")
    plan = planner.exclude(planner.exclude(plan, graph, "cell_weight"), graph, "tanh_3")
    check_plan_invariants(plan, graph)
    assert [s.mode.value for s in plan.stages] == ["excluded", "batched", "batched", "excluded", "batched"]
    report = executor.verify(plan, src.members(3), executor.batched_inputs(plan, src.example_inputs))
    assert report.ok, report.to_text()


def test_exclude_then_include_a_node_restores_its_stage(dd):
    plan, graph = dd
    carved = planner.exclude(plan, graph, "relu")
    assert len(carved.stages) == len(plan.stages) + 2
    assert planner.include(carved, graph, carved.stage_of("relu").id) == plan


def test_exclude_then_include_a_node_with_branches_restores_its_stage(sample):
    _, graph = sample("moe")
    plan = planner.propose(graph, 2)
    for node in plan.stages[0].nodes[1:6]:
        carved = planner.exclude(plan, graph, node)
        restored = planner.include(carved, graph, carved.stage_of(node).id)
        assert restored.stages == plan.stages, node


def test_exclude_then_include_keeps_a_split_and_options_next_to_it(sample):
    """was: include merged the carved node into every batched neighbour, one the user had split off with its own
    strategy too, and the merged stage took that neighbour's options."""
    _, graph = sample("mlp")
    plan = planner.propose(graph, 3)
    first, second = plan.stages[0].nodes[0], plan.stages[0].nodes[1]
    split = planner.split(plan, graph, plan.stages[0].id, at=second)
    split = planner.set_options(split, graph, split.stage_of(first).id, strategy="wide")
    carved = planner.exclude(split, graph, second)
    restored = planner.include(carved, graph, carved.stage_of(second).id)
    assert restored.stages == split.stages
    assert Plan.from_json(json.loads(json.dumps(carved.to_json()))).stages == carved.stages  # the origin is saved


def test_include_of_a_whole_excluded_stage_does_not_merge_it(dd):
    """Only a carved-out node is merged back: a stage excluded whole comes back as it was."""
    plan, graph = dd
    out = planner.include(planner.exclude(plan, graph, "s0"), graph, "s0")
    assert out == plan
