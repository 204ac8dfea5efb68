"""Model inputs written in place by forward(), and sparse embeddings under every strategy, each against the plain
loop over members."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.plan import StageOptions, Strategy

from test_review_leftovers import SparseEmbedding  # nn.Embedding(sparse=True), or F.embedding(sparse=True)

N = 3


def _with_strategy(plan, strategy):
    return plan.with_stages([replace(s, options=StageOptions(strategy=strategy)) for s in plan.stages])


# --- a model input written in place ---------------------------------------------------------------------------

def bump(x):
    x.add_(1)  # inside a function fx keeps closed (torch.fx.wrap): only running the model shows the write


torch.fx.wrap("bump")


class Writes(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.how = nn.Linear(4, 4), how

    def forward(self, x):
        if self.how == "iadd":
            x += 1
        elif self.how == "imul_view":
            x[0] *= 2  # an augmented assignment into a view of the input
        elif self.how == "clone_then_iadd":
            x = x.clone()
            x += 1  # the model's own copy: nothing the caller sees
        elif self.how == "iadd_hidden_from_fx":
            bump(x)
        elif self.how == "h_iadd":
            h = self.fc(x)
            h += 1  # an intermediate value: traced as before
            return h
        return self.fc(x)


def _plan(make, x, mode="shared"):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    return members, planner.propose(planner.trace(copy.deepcopy(members[0]), (x.clone(),)), n_members=N, input_mode=mode)


@pytest.mark.parametrize("how, tracer", [("iadd", "fx"), ("iadd", "export"), ("imul_view", "export")])
def test_a_shared_input_written_by_augmented_assignment_is_refused(how, tracer, monkeypatch):
    """fx records `x += 1` on an input as operator.iadd (it recorded an out-of-place add: a write the graph hid);
    `x[0] *= 2` assigns into the input, which fx cannot trace (export records it)."""
    if tracer == "export":
        from stagewise.planner import graph as graph_module
        monkeypatch.setattr(graph_module, "_fx_trace", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no fx")))
    members, plan = _plan(lambda: Writes(how), torch.randn(2, 4))
    assert plan.tracer == tracer
    with pytest.raises(planner.InputError, match=r"writes the shared input 'x' in place.*x = x\.clone\(\)"):
        executor.build(plan, members)


def test_a_write_the_graph_cannot_show_is_found_by_running_member_0():
    members, plan = _plan(lambda: Writes("iadd_hidden_from_fx"), torch.randn(2, 4))
    with pytest.raises(planner.InputError, match=r"forward\(\) writes the shared input 'x' in place"):
        executor.build(plan, members)
    with pytest.raises(planner.InputError, match=r"per_member input 'x' in place in a way the fx trace does not record"):
        _, plan = _plan(lambda: Writes("iadd_hidden_from_fx"), torch.randn(2, 4), mode="per_member")
        executor.build(plan, members)


@pytest.mark.parametrize("how", ["clone_then_iadd", "h_iadd", "none"])
def test_writes_the_caller_does_not_see_are_not_refused(how):
    members, plan = _plan(lambda: Writes(how), torch.randn(2, 4))
    ref = copy.deepcopy(members)
    x = torch.randn(3, 4)
    before = x.clone()
    with torch.no_grad():
        got = executor.build(plan, members)(x)
        want = torch.stack([m(x) for m in ref])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x, before)


@pytest.mark.parametrize("how", ["iadd", "imul_view"])
def test_a_per_member_input_written_by_augmented_assignment_matches_the_loop(how):
    members, plan = _plan(lambda: Writes(how), torch.randn(2, 4), mode="per_member")
    ref = copy.deepcopy(members)
    x = torch.randn(N, 2, 4)
    a, b = x.clone(), x.clone()
    with torch.no_grad():
        got = executor.build(plan, members)(a)
        want = torch.stack([m(b[i]) for i, m in enumerate(ref)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a, b)  # the caller's rows written as the loop writes them


def test_the_build_time_run_leaves_member_state_and_random_streams_alone():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.drop = nn.BatchNorm1d(4), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.bn(x))

    members, plan = _plan(Noisy, torch.randn(5, 4))
    state = copy.deepcopy(members[0].state_dict())
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    executor.build(plan, members)
    torch.testing.assert_close(torch.rand(3), expected)
    for k, v in members[0].state_dict().items():
        torch.testing.assert_close(v, state[k])


# --- sparse embeddings under vmap and loop ----------------------------------------------------------------------

@pytest.mark.parametrize("strategy", [Strategy.VMAP, Strategy.LOOP])
@pytest.mark.parametrize("functional", [False, True])
def test_sparse_embedding_answers_inference_and_refuses_its_gradient_by_name(strategy, functional):
    """Was torch's bare error from backward(): vmap "reshape is not implemented for sparse tensors", the loop
    "Could not run 'aten::select_backward' with arguments from the 'SparseCPU' backend"."""
    torch.manual_seed(0)
    members = [SparseEmbedding(functional) for _ in range(N)]
    ref = copy.deepcopy(members)
    x = torch.randint(0, 10, (2, 3))
    plan = _with_strategy(planner.propose(planner.trace(members[0], (x,)), n_members=N), strategy)
    for train in (False, True):
        ens = executor.build(plan, members).train(train)
        with torch.no_grad():
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in ref]), rtol=1e-6, atol=1e-6)
        got = ens(x)  # gradients enabled: the forward answers too
        torch.testing.assert_close(got.detach(), torch.stack([m(x) for m in ref]).detach(), rtol=1e-6, atol=1e-6)
        with pytest.raises(planner.ExecutionError, match=r"embedding \w+ has sparse=True.*sparse=False"):
            got.pow(2).sum().backward()


@pytest.mark.parametrize("strategy", [Strategy.VMAP, Strategy.LOOP, Strategy.WIDE])
def test_a_frozen_sparse_embedding_trains_the_rest(strategy):
    torch.manual_seed(0)
    members = [SparseEmbedding() for _ in range(N)]
    for m in members:
        m.e.weight.requires_grad_(False)
    ref = copy.deepcopy(members)
    x = torch.randint(0, 10, (2, 3))
    plan = _with_strategy(planner.propose(planner.trace(members[0], (x,)), n_members=N), strategy)
    ens = executor.build(plan, members).train()
    ens(x).pow(2).sum().backward()
    for m in ref:
        m(x).pow(2).sum().backward()
    grads = dict(ens.named_stacked_parameters())
    torch.testing.assert_close(grads["l.weight"].grad, torch.stack([m.l.weight.grad for m in ref]), rtol=1e-5, atol=1e-6)


# --- autotune(train=True) of a module traced in training mode that branches on self.training ------------------

class TrainingBranch(nn.Module):
    """Refuses eval() once built (forward reads self.training); `dropout` adds random draws to the branch."""

    def __init__(self, dropout):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 8), nn.Linear(8, 4), nn.Dropout(0.5 if dropout else 0.0)

    def forward(self, x):
        h = self.fc1(x)
        if self.training:
            h = self.drop(h) + 0.1
        return self.fc2(torch.relu(h))


@pytest.mark.parametrize("dropout", [False, True])
def test_autotune_for_training_checks_a_module_bound_to_training_mode_in_that_mode(dropout):
    """Was: autotune_train switched the module to eval() for its gradient check, which such a module refuses."""
    torch.manual_seed(0)
    members = [TrainingBranch(dropout).train() for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    with pytest.raises(planner.ExecutionError, match="self.training"):
        executor.build(plan, members).eval()
    from stagewise.executor.autotune_train import tune_training
    tuned, found = tune_training(plan, members, (x,), repeats=1, warmup=0)
    assert executor.autotune(plan, members, (x,), train=True, repeats=1).stages  # the public call: a plan, no crash
    assert {s.options.strategy for s in tuned.stages} <= {Strategy.VMAP, Strategy.WIDE, Strategy.LOOP}
    random_stages = [s.id for s in tuned.stages if any("drop" in n for n in s.nodes)] if dropout else []
    for stage in tuned.stages:
        ok = {r.strategy for r in found[stage.id] if r.ok}
        if stage.id in random_stages:
            # the loop draws as the reference does, and wide too (it runs the dropout once per member); vmap draws
            # other (equally valid) masks: unchecked, not chosen
            assert stage.options.strategy in (Strategy.LOOP, Strategy.WIDE) and ok <= {"loop", "wide"}, found[stage.id]
        else:
            assert "vmap" in ok, found[stage.id]  # checked in training mode, exactly
    ens = executor.build(tuned, members)  # the tuned plan trains as the loop does
    ref = copy.deepcopy(members)
    torch.manual_seed(1)
    ens(x).pow(2).sum().backward()
    if not dropout:
        for m in ref:
            m(x).pow(2).sum().backward()
        got = dict(ens.named_stacked_parameters())["fc1.weight"].grad
        torch.testing.assert_close(got, torch.stack([m.fc1.weight.grad for m in ref]), rtol=1e-5, atol=1e-6)


def test_a_channels_last_input_into_a_group_norm_stage_runs():
    """Was: "NYI: querying is_contiguous inside of vmap for memory_format other than torch.contiguous_format"."""
    members = [torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8)) for _ in range(3)]
    x = torch.randn(2, 3, 13, 11)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), 3), members)
    with torch.no_grad():
        for batch in (2, 5, 5):  # calls at two batch sizes
            x = torch.randn(batch, 3, 13, 11).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-4, atol=1e-5)


class _DictBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, batch):
        return self.fc(batch["x"]) * batch["w"][..., None]


def test_a_dict_input_planned_per_member_takes_its_tensors_member_first():
    """Was: every call refused with "needs a leading member axis ...; got dict", which no dict can satisfy."""
    members = [_DictBatch() for _ in range(3)]
    batch = {"x": torch.randn(4, 8), "w": torch.rand(4)}
    ens = executor.build(planner.propose(planner.trace(members[0], (batch,)), 3, input_mode="per_member"), members)
    with torch.no_grad():
        for rows in (4, 6, 6):  # calls at two batch sizes
            stacked = {"x": torch.randn(3, rows, 8), "w": torch.rand(3, rows)}
            want = torch.stack([m({k: v[i] for k, v in stacked.items()}) for i, m in enumerate(members)])
            torch.testing.assert_close(ens(stacked), want)
        with pytest.raises(planner.InputError, match=r"a dict whose tensors are shaped \[\[4, 8\], \[4\]\]"):
            ens(batch)
