"""A plan's stored verdicts against the members it is built for (R4 F1).

The fingerprint leaves out constants (`F.batch_norm(..., training=self.training)` traces the flag as one), and a
plan file's `reason` can be edited by hand, so build judges each stage by the verdicts of the members' own graph:
an excluded stage's `compile` / `wide` by the stored reason joined with the fresh one, a batched stage by the fresh
structure. Every result is checked against the plain member loop (outputs over three calls, and the statistics
buffer), or refused with a PlanMismatchError / ExecutionError naming the node.
"""
import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stagewise import executor, planner

torch.set_num_threads(1)
N = 3


class ViewStats(nn.Module):
    """Running statistics held as views of one buffer: vmap drops their update (norm_stats_view_check)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("stats", torch.stack([torch.zeros(8), torch.ones(8)]))

    def forward(self, x):
        h = F.batch_norm(self.fc(x), self.stats[0], self.stats[1], training=self.training, momentum=0.5)
        return h + self.stats[0]  # the statistics are read after the update


class GruViewStats(nn.Module):
    """A GRU (an excluded stage run wide) followed by the view-of-buffer batch norm."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 8)
        self.register_buffer("stats", torch.stack([torch.zeros(8), torch.ones(8)]))

    def forward(self, x):
        h, _ = self.gru(x)
        h = F.batch_norm(self.fc(h).flatten(0, 1), self.stats[0], self.stats[1], training=self.training, momentum=0.5)
        return h + self.stats[0]


def members(cls, train):
    torch.manual_seed(0)
    return [cls().train(train) for _ in range(N)]


def plan_of(mem, x):
    g = planner.trace(mem[0], (x[0],))
    return g, planner.propose(g, n_members=N, input_mode="per_member")


def through_file(plan, edit=None):
    data = plan.to_json()
    if edit is not None:
        edit(data)
    return planner.Plan.loads(json.dumps(data))


def check_against_loop(plan, mem, x, calls=3):
    ens = executor.build(plan, [copy.deepcopy(m) for m in mem])
    ref = [copy.deepcopy(m) for m in mem]
    with torch.no_grad():
        for _ in range(calls):
            y = ens(x)
            r = torch.stack([m(x[i]) for i, m in enumerate(ref)])
            torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ens.state_dict()["stacked.stats"], torch.stack([m.stats for m in ref]), rtol=1e-5, atol=1e-5)
    return ens


def test_user_excluded_compile_of_an_eval_plan_is_refused_on_training_members():
    # planned in eval (the norm updates nothing, vmap runs it), excluded by hand and compiled; built in training
    x = torch.randn(N, 5, 8)
    mem = members(ViewStats, train=False)
    g, plan = plan_of(mem, x)
    plan = planner.exclude(plan, g, "batch_norm")
    plan = planner.set_options(plan, g, plan.stage_of("batch_norm").id, strategy="compile")
    plan = through_file(plan)
    for m in mem:
        m.train()
    with pytest.raises(planner.StagewiseError, match="view of buffer 'stats'.*cannot run strategy 'compile'"):
        executor.build(plan, [copy.deepcopy(m) for m in mem])
    # the loop the message offers is right
    loop = planner.Plan.loads(json.dumps(plan.to_json()).replace('"compile"', '"loop"'))
    check_against_loop(loop, mem, x)


def test_hand_edited_reason_does_not_let_compile_drop_the_update():
    # a train-mode plan whose excluded stage's reason was edited in the file to "excluded by user"
    x = torch.randn(N, 5, 8)
    mem = members(ViewStats, train=True)
    _, plan = plan_of(mem, x)

    def edit(data):
        for s in data["stages"]:
            if "batch_norm" in s["nodes"]:
                s["options"]["strategy"], s["reason"] = "compile", "excluded by user"

    with pytest.raises(planner.StagewiseError, match="view of buffer 'stats'.*cannot run strategy 'compile'"):
        executor.build(through_file(plan, edit), [copy.deepcopy(m) for m in mem])


def test_user_excluded_compile_still_builds_where_the_fresh_graph_agrees():
    # the same exclusion built on the eval members it was planned from: compile (aot_eager here) runs, loop-equal
    from stagewise.executor.strategies import compiled

    x = torch.randn(N, 5, 8)
    mem = members(ViewStats, train=False)
    g, plan = plan_of(mem, x)
    plan = planner.exclude(plan, g, "batch_norm")
    sid = plan.stage_of("batch_norm").id
    plan = through_file(planner.set_options(plan, g, sid, strategy="compile"))
    backend, compiled.BACKEND = compiled.BACKEND, "aot_eager"
    try:
        ens = check_against_loop(plan, mem, x)
    finally:
        compiled.BACKEND = backend
    assert ens.plan.stage(sid).reason == planner.edits.USER_EXCLUDED


def test_wide_stage_with_a_stale_safe_reason_runs_the_norm_per_member():
    # everything merged into the GRU's excluded stage in eval (reason: no batching rule for gru), run wide;
    # built in training, wide must not run the view-of-buffer norm under vmap
    x = torch.randn(N, 5, 4, 8)
    mem = members(GruViewStats, train=False)
    g, plan = plan_of(mem, x)
    while len(plan.stages) > 1:
        plan = planner.merge(plan, g, plan.stages[0].id, plan.stages[1].id)
    plan = through_file(planner.set_options(plan, g, "s0", strategy="wide"))
    assert "view of buffer" not in plan.stages[0].reason
    for m in mem:
        m.train()
    ens = check_against_loop(plan, mem, x)
    assert "view of buffer 'stats'" in ens.plan.stages[0].reason  # the stage's reason now says why


def test_batched_stage_of_an_eval_plan_is_refused_on_training_members():
    # the norm in a batched (vmap) stage, planned in eval, built in training: vmap would drop the update
    x = torch.randn(N, 5, 8)
    mem = members(ViewStats, train=False)
    _, plan = plan_of(mem, x)
    plan = through_file(plan)
    for m in mem:
        m.train()
    with pytest.raises(planner.PlanMismatchError, match=r"batched stage s0 holds 'batch_norm'.*view of buffer 'stats'.*exclude\('batch_norm'\)"):
        executor.build(plan, [copy.deepcopy(m) for m in mem])


def test_batched_batchnorm_module_of_an_eval_plan_still_builds_on_training_members():
    # nn.BatchNorm1d's whole buffers batch under vmap in training: not refused, and loop-equal
    class BN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, x):
            return self.bn(self.fc(x))

    x = torch.randn(N, 5, 8)
    mem = members(BN, train=False)
    _, plan = plan_of(mem, x)
    assert [s.mode.value for s in plan.stages] == ["batched"]
    for m in mem:
        m.train()
    ens = executor.build(plan, [copy.deepcopy(m) for m in mem])
    ref = [copy.deepcopy(m) for m in mem]
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(ref)]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ens.state_dict()["stacked.bn.running_mean"], torch.stack([m.bn.running_mean for m in ref]))
