"""planner.diff_plans and `stagewise diff`: stage groups matched by their nodes, plan-level changes,
measured times from either plan's profile, and diff(1)'s exit codes.

transformer_block proposes s0 (batched), s1 (excluded: scaled_dot_product_attention, run wide), s2 (batched);
mlp proposes one stage s0 = fc1, act, fc2.
"""
from __future__ import annotations

import json

import pytest

from stagewise import planner
from stagewise.app import cli
from stagewise.planner import ChangeKind, PlanMismatchError
from stagewise.planner.measured import measured_stage_times


@pytest.fixture
def tb(sample):
    _, graph = sample("transformer_block")
    return graph, planner.propose(graph, n_members=4)


@pytest.fixture
def mlp(sample):
    _, graph = sample("mlp")
    return graph, planner.propose(graph, n_members=4)


def kinds(diff) -> list[str]:
    return [r["change"] for r in diff.rows()]


def test_identical_plans(tb):
    _, plan = tb
    diff = planner.diff_plans(plan, planner.Plan.loads(plan.dumps()))
    assert diff.identical and diff.plan_changes == ()
    assert kinds(diff) == ["same", "same", "same"]
    assert diff.summary() == "The plans are identical: 3 stages, N=4."
    assert diff.changed_nodes() == []
    assert diff.nodes["scaled_dot_product_attention"].before == "s1" == diff.nodes["scaled_dot_product_attention"].after


def test_a_merge_names_the_stages_and_the_nodes_that_now_loop(tb):
    graph, plan = tb
    merged = planner.merge(plan, graph, "s1", "s2")
    diff = planner.diff_plans(plan, merged)
    assert not diff.identical
    assert kinds(diff) == ["same", "merged"]
    change = diff.stages[1]
    assert change.kind is ChangeKind.MERGED and (change.before, change.after) == (("s1", "s2"), ("s1",))
    assert change.runs_as_before == ("batched (wide)", "batched (vmap)") and change.runs_as_after == ("member loop",)
    assert diff.summary() == "s1 and s2 merged into s1; 9 nodes now excluded from vmap (were batched); 1 stage unchanged."
    assert diff.nodes["proj"].before == "s2" and diff.nodes["proj"].after == "s1" and diff.nodes["proj"].changed
    assert diff.nodes["proj"].mode_before == "batched" and diff.nodes["proj"].mode_after == "excluded"
    assert not diff.nodes["ln1"].changed
    assert len(diff.changed_nodes()) == 10
    row = diff.rows()[1]
    assert row == {"change": "merged", "before": "s1, s2", "after": "s1", "nodes": 10,
                   "runs as before": "batched (wide), batched (vmap)", "runs as after": "member loop",
                   "before ms": None, "after ms": None, "details": "2 stages → 1"}


def test_the_other_way_round_is_a_split(tb):
    graph, plan = tb
    merged = planner.merge(plan, graph, "s1", "s2")
    diff = planner.diff_plans(merged, plan)
    assert kinds(diff) == ["same", "split"]
    assert diff.stages[1].before == ("s1",) and diff.stages[1].after == ("s1", "s2")
    assert "s1 split into s1 and s2; 9 nodes now batched (were excluded)" in diff.summary()


def test_split_and_regroup(mlp):
    graph, plan = mlp
    at_act, at_fc2 = planner.split(plan, graph, "s0", "act"), planner.split(plan, graph, "s0", "fc2")
    diff = planner.diff_plans(plan, at_act)
    assert kinds(diff) == ["split"] and diff.summary() == "s0 split into s0 and s1."
    assert diff.rows()[0]["details"] == "1 stage → 2"
    regrouped = planner.diff_plans(at_fc2, at_act)  # [fc1, act] [fc2] -> [fc1] [act, fc2]
    assert kinds(regrouped) == ["regrouped"]
    assert regrouped.summary() == "s0 and s1 regrouped as s0 and s1."
    assert regrouped.nodes["act"].before == "s0" and regrouped.nodes["act"].after == "s1"


def test_excluding_a_stage_is_a_change_of_mode_and_strategy(mlp):
    graph, plan = mlp
    diff = planner.diff_plans(plan, planner.exclude(plan, graph, "s0"))
    assert kinds(diff) == ["changed"]
    assert [(f.field, f.old, f.new) for f in diff.stages[0].fields] == [
        ("mode", "batched", "excluded"), ("strategy", "vmap", "loop")]
    assert diff.rows()[0]["details"] == "mode batched → excluded, strategy vmap → loop"
    assert diff.summary() == ("s0 now excluded (was batched), now runs loop (was vmap); "
                              "3 nodes now excluded from vmap (were batched).")


def test_excluding_one_node_carves_it_out(mlp):
    graph, plan = mlp
    diff = planner.diff_plans(plan, planner.exclude(plan, graph, "act"))
    assert kinds(diff) == ["split"]
    assert diff.summary() == "s0 split into s0, s1 and s2; 1 node now excluded from vmap (was batched)."
    assert diff.nodes["act"].mode_after == "excluded" and diff.nodes["fc1"].mode_after == "batched"


def test_strategy_and_chunk_size_changes(tb):
    graph, plan = tb
    wide = planner.set_options(plan, graph, "s2", strategy="wide")
    diff = planner.diff_plans(plan, wide)
    assert kinds(diff) == ["same", "same", "changed"]
    assert diff.summary() == "s2 now runs wide (was vmap); 2 stages unchanged."
    chunked = planner.set_options(plan, graph, "s0", chunk_size=2)
    assert planner.diff_plans(plan, chunked).summary() == "s0 chunk size none → 2; 2 stages unchanged."


def test_plan_level_changes(tb):
    _, plan = tb
    other = planner.set_dtype(plan, "bfloat16").with_n_members(8).with_input_modes({"x": "per_member"})
    diff = planner.diff_plans(plan, other)
    assert not diff.identical and kinds(diff) == ["same", "same", "same"]
    assert [(f.field, f.old, f.new) for f in diff.plan_changes] == [
        ("n_members", 4, 8), ("dtype", "float32", "bfloat16"), ("input x", "shared", "per_member")]
    assert diff.summary() == "N 4 → 8; dtype float32 → bfloat16; input x shared → per_member; 3 stages unchanged."
    assert not diff.changed_nodes()  # plan-level settings colour no node


def test_plans_of_different_models_are_refused(tb, mlp):
    _, a = tb
    _, b = mlp
    with pytest.raises(PlanMismatchError) as e:
        planner.diff_plans(a, b)
    msg = str(e.value)
    assert a.fingerprint in msg and b.fingerprint in msg and "same model" in msg


def test_stages_only_one_plan_holds(mlp):
    graph, plan = mlp
    two = planner.split(plan, graph, "s0", "fc2")
    partial = two.with_stages(two.stages[:1])  # a hand-edited file that lost fc2's stage
    diff = planner.diff_plans(two, partial)
    assert kinds(diff) == ["same", "removed"]
    assert diff.summary() == "s1 removed (1 node only in the first plan); 1 stage unchanged."
    assert diff.nodes["fc2"].after is None and diff.nodes["fc2"].changed
    assert kinds(planner.diff_plans(partial, two)) == ["same", "added"]


def _ok(ms: float) -> dict:
    return {"ok": True, "time": {"median_ms": ms}}


def test_measured_times_come_from_each_plans_profile(tb):
    graph, plan = tb
    # as `stagewise profile -o` stores it: no copy of the plan, each stage entry names its nodes and strategy label
    before = plan.with_profile({
        "stages": [{"id": s.id, "nodes": list(s.nodes), "strategy": s.options.strategy.value, "result": _ok(ms)}
                   for s, ms in zip(plan.stages, (1.0, 0.5, 2.0))],
        "end_to_end": _ok(3.6)})
    merged = planner.merge(plan, graph, "s1", "s2")
    # as the app attaches a worker's report: the profiled plan inside; the merged stage was measured as it is
    after = merged.with_profile({"stages": [{"id": "s1", "result": _ok(1.2)}, {"id": "s0", "result": _ok(1.0)}],
                                 "end_to_end": _ok(2.3), "plan": merged.to_json()})
    diff = planner.diff_plans(before, after)
    assert [(r["before ms"], r["after ms"]) for r in diff.rows()] == [(1.0, 1.0), (2.5, 1.2)]
    assert diff.end_to_end_ms == (3.6, 2.3)
    assert diff.summary() == ("s1 and s2 merged into s1: 2.5 ms → 1.2 ms; 9 nodes now excluded from vmap (were batched); "
                              "1 stage unchanged; end to end 3.6 ms → 2.3 ms.")
    unmeasured_side = planner.diff_plans(before, merged)  # a plan without a profile: times on one side only
    assert unmeasured_side.rows()[1]["after ms"] is None and "2.5 ms → not measured" in unmeasured_side.summary()


def test_a_time_counts_only_for_a_stage_measured_as_it_is(tb):
    graph, plan = tb
    report = {"stages": [{"id": "s0", "nodes": list(plan.stages[0].nodes), "strategy": "vmap/chunk=2", "result": _ok(4.0)},
                         {"id": "s2", "nodes": list(plan.stages[2].nodes), "strategy": "wide", "result": _ok(9.0)},
                         {"id": "s1", "nodes": ["scaled_dot_product_attention"], "strategy": "loop",
                          "result": {"ok": False, "error": "boom", "time": None}}]}
    # s0: the chunked vmap label names vmap; s2 was measured wide but the plan runs it vmap; s1 failed
    assert measured_stage_times(plan, report) == {"s0": 4.0}
    assert measured_stage_times(plan, {"stages": [{"id": "s0", "result": _ok(1.0)}]}) == {}  # nothing to match on


def test_to_json_is_plain_json(tb):
    graph, plan = tb
    diff = planner.diff_plans(plan, planner.merge(plan, graph, "s0", "s1").with_n_members(2))
    d = json.loads(json.dumps(diff.to_json()))
    assert d["identical"] is False and d["fingerprint"] == plan.fingerprint
    assert d["plan_changes"] == [{"field": "n_members", "old": 4, "new": 2}]
    assert [s["change"] for s in d["stages"]] == ["merged", "same"]
    assert d["nodes"]["ln1"] == {"before": "s0", "after": "s0", "changed": True}
    assert d["nodes"]["proj"] == {"before": "s2", "after": "s1", "changed": False}
    assert d["summary"] == diff.summary()


# -- the CLI ------------------------------------------------------------------------------------------------


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def plan_files(tb, tmp_path):
    graph, plan = tb
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plan.save(a)
    planner.set_options(planner.merge(plan, graph, "s1", "s2"), graph, "s0", strategy="wide").save(b)
    return a, b


def test_cli_diff_of_identical_plans_exits_0(plan_files, capsys):
    a, _ = plan_files
    code, out, err = run_cli(capsys, "diff", a, a)
    assert code == 0 and err == ""
    assert out.startswith("The plans are identical: 3 stages, N=4.\n")
    assert "\nsame       s1           s1             1                           batched (wide)\n" in out


def test_cli_diff_of_different_plans_exits_1_with_a_table(plan_files, capsys):
    a, b = plan_files
    code, out, err = run_cli(capsys, "diff", a, b)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == "s0 now runs wide (was vmap); s1 and s2 merged into s1; 9 nodes now excluded from vmap (were batched)."
    assert lines[2].split() == ["change", "before", "after", "#", "details", "runs", "as"]
    assert lines[3].split()[:4] == ["changed", "s0", "s0", "17"]
    assert lines[3].endswith("strategy vmap → wide     batched (vmap) → batched (wide)")
    assert lines[4].split()[:5] == ["merged", "s1,", "s2", "s1", "10"]
    assert lines[4].endswith("2 stages → 1             batched (wide), batched (vmap) → member loop")
    assert len(lines) == 5


def test_cli_diff_json(plan_files, capsys):
    a, b = plan_files
    code, out, _ = run_cli(capsys, "diff", a, b, "--json")
    assert code == 1
    d = json.loads(out)
    assert d["identical"] is False
    assert [(s["change"], s["before"], s["after"]) for s in d["stages"]] == [("changed", "s0", "s0"), ("merged", "s1, s2", "s1")]
    assert d["nodes"]["proj"]["after"] == "s1"


def test_cli_diff_errors_exit_2_in_one_line(plan_files, mlp, tmp_path, capsys):
    a, _ = plan_files
    other = mlp[1].save(tmp_path / "mlp.json")
    code, out, err = run_cli(capsys, "diff", a, other)
    assert code == 2 and out == ""
    assert err.startswith("stagewise diff: error: cannot diff plans of different models") and len(err.splitlines()) == 1
    code, _, err = run_cli(capsys, "diff", a, tmp_path / "missing.json")
    assert code == 2 and "cannot read plan file" in err and "missing.json" in err


def test_cli_diff_shows_the_measured_times_of_profiled_plans(tb, tmp_path, capsys):
    graph, plan = tb
    profiled = plan.with_profile({  # as `stagewise profile -o` stores it
        "stages": [{"id": s.id, "nodes": list(s.nodes), "strategy": s.options.strategy.value, "result": _ok(ms)}
                   for s, ms in zip(plan.stages, (1.0, 0.5, 2.0))], "end_to_end": _ok(3.5)})
    a = profiled.save(tmp_path / "profiled.json")
    b = planner.merge(plan, graph, "s1", "s2").save(tmp_path / "merged.json")
    code, out, _ = run_cli(capsys, "diff", a, b)
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("s1 and s2 merged into s1: 2.5 ms → not measured;")
    assert lines[0].endswith("; end to end 3.5 ms → not measured.")
    assert lines[2].split()[4] == "ms"
    assert "  1 ms → not measured  " in lines[3] and "  2.5 ms → not measured  " in lines[4]
