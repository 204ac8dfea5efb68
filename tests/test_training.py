"""Training N members through a plan: the reference is N separate models, each with its own torch.optim optimizer.

Loss = sum of the members' losses, so member i's gradient is exactly the gradient
of its own loss; k steps through the plan must leave every member's parameters
where k steps of its own optimizer leave them.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor
from stagewise import planner
from stagewise.executor.optim import StackedAdam, StackedAdamW, StackedSGD, clip_grad_norm_per_member_
from stagewise.planner.plan import Strategy

from conftest import load_sample

STEPS = 3
RTOL = 1e-4  # float32; the batched and the loop sum in different orders


def loss_of(out) -> torch.Tensor:
    """A per-member scalar loss of any output pytree (sum of squares of every float tensor leaf, mean-normalised)."""
    leaves = [x for x in torch.utils._pytree.tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum((x.float() ** 2).mean() for x in leaves)


def batched_loss(out, n) -> torch.Tensor:
    """Sum over members of loss_of(member i's output): each leaf is N-first."""
    leaves = [x for x in torch.utils._pytree.tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum((x.float() ** 2).reshape(n, -1).mean(1).sum() for x in leaves)


# Attention's key bias: softmax is shift-invariant, so its true gradient is 0 and what the batched
# module and the loop compute is rounding noise, in different orders. Adam normalises that noise into
# steps of size lr; there the two may differ by up to lr per step, so it is compared with atol = lr x steps.
ADAM_NOISE_ONLY = {"k.bias"}


# Adam divides every gradient element by its own running RMS: an element whose gradient is near
# rounding level moves by up to lr on noise, so Adam rows are compared at 5e-4 of the parameter scale.
ADAM_RTOL = 5e-4


def assert_params_match(ens, members, what, noise_atol=None, rtol=RTOL):
    states = ens.member_state_dicts()
    for i, m in enumerate(members):
        for k, p in m.named_parameters():
            got, want = states[i][k], p.detach()
            if noise_atol is not None and k in ADAM_NOISE_ONLY:
                assert (got - want).abs().max().item() <= noise_atol[i], f"{what}: member {i} {k}"
                continue
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            assert err <= rtol, f"{what}: member {i} {k} relative error {err:.2e}"


def train_both(plan, members, inputs_for_member, batched_inputs, make_opt, make_torch_opt, steps=STEPS, clip=None):
    """k steps through the plan and k steps of each member with its own optimizer; returns (ens, loop members)."""
    n = len(members)
    loop_members = copy.deepcopy(members)
    ens = executor.build(plan, members)
    ens.train()
    for m in loop_members:
        m.train()
    opt = make_opt(list(ens.parameters()))
    torch_opts = [make_torch_opt(m.parameters(), i) for i, m in enumerate(loop_members)]
    for _ in range(steps):
        opt.zero_grad()
        batched_loss(ens(*batched_inputs), n).backward()
        if clip is not None:
            clip_grad_norm_per_member_(list(ens.parameters()), clip, n)
        opt.step()
        for i, (m, o) in enumerate(zip(loop_members, torch_opts)):
            o.zero_grad()
            loss_of(m(*inputs_for_member(i))).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip[i] if isinstance(clip, list) else clip)
            o.step()
    return ens, loop_members


def sample_setup(name, n, mode="shared"):
    src, graph = load_sample(name)
    plan = planner.propose(graph, n_members=n, input_mode=mode)
    members = src.members(n)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    return plan, members, inputs, lambda i: executor.member_inputs(plan, inputs, i)


SAMPLES_WITH_PARAMS = ["mlp", "deep_mlp", "resblock", "transformer_block", "gru", "moe", "cnn", "data_dependent", "shape_loop"]


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("name", SAMPLES_WITH_PARAMS)
def test_sgd_steps_through_the_plan_equal_n_separate_runs(name, n):
    plan, members, inputs, member_in = sample_setup(name, n, "per_member" if name == "mlp" else "shared")
    lrs = [0.05 * (i + 1) / n for i in range(n)]
    ens, loop = train_both(
        plan, members, member_in, inputs,
        lambda ps: StackedSGD(ps, n, lr=lrs, momentum=0.9, weight_decay=1e-3, nesterov=True),
        lambda ps, i: torch.optim.SGD(ps, lr=lrs[i], momentum=0.9, weight_decay=1e-3, nesterov=True),
    )
    assert_params_match(ens, loop, f"{name} N={n}")


@pytest.mark.parametrize("opt_name", ["adam", "adamw"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer_block"])
def test_adam_steps_with_per_member_lr_and_clipping(name, opt_name):
    n = 3
    plan, members, inputs, member_in = sample_setup(name, n)
    lrs = [1e-3, 3e-3, 1e-2]
    clip = [0.5, 1.0, 100.0]
    stacked_cls, torch_cls = (StackedAdam, torch.optim.Adam) if opt_name == "adam" else (StackedAdamW, torch.optim.AdamW)
    ens, loop = train_both(
        plan, members, member_in, inputs,
        lambda ps: stacked_cls(ps, n, lr=lrs, weight_decay=0.01),
        lambda ps, i: torch_cls(ps, lr=lrs[i], weight_decay=0.01),
        clip=clip,
    )
    assert_params_match(ens, loop, f"{name} {opt_name}", noise_atol=[lr * STEPS for lr in lrs], rtol=ADAM_RTOL)


def test_gradients_equal_the_loop_for_every_strategy_that_trains():
    n = 3
    plan, members, inputs, member_in = sample_setup("deep_mlp", n)
    _, graph = load_sample("deep_mlp")
    want = []
    for i, m in enumerate(copy.deepcopy(members)):
        loss_of(m(*member_in(i))).backward()
        want.append({k: p.grad for k, p in m.named_parameters()})
    for strategy in (Strategy.VMAP, Strategy.LOOP, Strategy.WIDE):
        edited = plan
        for s in plan.stages:
            edited = planner.set_options(edited, graph, s.id, strategy=strategy)
        ens = executor.build(edited, members).train()
        batched_loss(ens(*inputs), n).backward()
        for k, p in ens.named_stacked_parameters():
            torch.testing.assert_close(p.grad, torch.stack([w[k] for w in want]), rtol=RTOL, atol=1e-6,
                                       msg=lambda msg: f"{strategy.value} {k}: {msg}")


def test_parameters_are_the_stacked_state_and_nothing_else():
    n = 4
    plan, members, _, _ = sample_setup("mlp", n)
    ens = executor.build(plan, members)
    params = dict(ens.named_parameters())
    assert {k.removeprefix("stacked.") for k in params} == {k for k, _ in members[0].named_parameters()}
    assert all(p.shape[0] == n and isinstance(p, nn.Parameter) for p in params.values())
    assert set(ens.state_dict()) == {f"stacked.{k}" for k in members[0].state_dict()}


class DropNet(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _drop_ens(p, n=4):
    torch.manual_seed(0)
    members = [DropNet(p).eval() for _ in range(n)]
    graph = planner.trace(members[0], (torch.randn(5, 8),))
    return executor.build(planner.propose(graph, n_members=n), members).train(), members


def test_dropout_gives_each_member_its_own_mask_reproducibly():
    ens, members = _drop_ens(0.5)
    x = torch.randn(5, 8)
    torch.manual_seed(7)
    a = ens(x)
    torch.manual_seed(7)
    b = ens(x)
    torch.testing.assert_close(a, b)
    with torch.no_grad():
        ens.stacked_state["fc1.weight"].copy_(ens.stacked_state["fc1.weight"][:1].expand_as(ens.stacked_state["fc1.weight"]))
        ens.stacked_state["fc1.bias"].copy_(ens.stacked_state["fc1.bias"][:1].expand_as(ens.stacked_state["fc1.bias"]))
        ens.stacked_state["fc2.weight"].copy_(ens.stacked_state["fc2.weight"][:1].expand_as(ens.stacked_state["fc2.weight"]))
        ens.stacked_state["fc2.bias"].copy_(ens.stacked_state["fc2.bias"][:1].expand_as(ens.stacked_state["fc2.bias"]))
    same_weights = ens(x)
    assert not torch.allclose(same_weights[0], same_weights[1]), "identical members got identical dropout masks"


def test_dropout_with_p_zero_equals_the_loop_in_training_mode():
    ens, members = _drop_ens(0.0)
    x = torch.randn(5, 8)
    want = torch.stack([m.train()(x) for m in members])
    torch.testing.assert_close(ens(x), want)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_batchnorm_running_statistics_follow_the_loop_in_training(mode):
    n = 3
    torch.manual_seed(0)
    members = [BNNet().eval() for _ in range(n)]
    x1 = torch.randn(6, 3, 8, 8)
    graph = planner.trace(members[0], (x1,))
    plan = planner.propose(graph, n_members=n, input_mode=mode)
    inputs = executor.batched_inputs(plan, (x1,))
    lrs = [0.1, 0.05, 0.01]
    ens, loop = train_both(plan, members, lambda i: executor.member_inputs(plan, inputs, i), inputs,
                           lambda ps: StackedSGD(ps, n, lr=lrs), lambda ps, i: torch.optim.SGD(ps, lr=lrs[i]))
    assert_params_match(ens, loop, "bn")
    states = ens.member_state_dicts()
    for i, m in enumerate(loop):
        for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            torch.testing.assert_close(states[i][k], m.state_dict()[k], rtol=RTOL, atol=1e-6)
    ens.eval()
    for m in loop:
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(*inputs), torch.stack([m(*executor.member_inputs(plan, inputs, i)) for i, m in enumerate(loop)]),
                                   rtol=RTOL, atol=1e-5)


def test_member_state_dicts_load_into_the_architecture_and_round_trip_safetensors(tmp_path):
    n = 3
    plan, members, inputs, member_in = sample_setup("cnn", n)
    ens, loop = train_both(plan, members, member_in, inputs,
                           lambda ps: StackedSGD(ps, n, lr=0.01), lambda ps, i: torch.optim.SGD(ps, lr=0.01))
    src, _ = load_sample("cnn")
    fresh = src.members(n)
    for m, sd in zip(fresh, ens.member_state_dicts()):
        m.load_state_dict(sd)
    paths = executor.save_member_weights(ens, tmp_path / "members")
    assert [p.name for p in paths] == [f"member_{i:03d}.safetensors" for i in range(n)]
    reloaded = planner.load_source(src.path, weights=paths).members(n)
    x = src.example_inputs
    with torch.no_grad():
        for a, b, c in zip(fresh, reloaded, loop):
            c.eval()
            torch.testing.assert_close(a(*x), c(*x), rtol=RTOL, atol=1e-6)
            torch.testing.assert_close(b(*x), c(*x), rtol=RTOL, atol=1e-6)


def test_inference_only_strategy_is_refused_in_training_with_the_fix():
    n = 2
    plan, members, inputs, _ = sample_setup("mlp", n)
    ens = executor.build(plan, members).train()
    ens.runners[0].trainable = False  # as cuda_graph is
    ens.runners = ens.runners  # the steps (and their gradient checks) are made when runners are set
    with pytest.raises(planner.ExecutionError, match="inference-only.*no_grad|no_grad.*inference-only"):
        ens(*inputs)
    with torch.no_grad():
        ens(*inputs)  # inference still runs


# --- property: plan edits never change the gradients -----------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import examples  # noqa: E402
from test_edits import draw_edit  # noqa: E402


def loop_gradients(members, member_in):
    grads = []
    for i, m in enumerate(copy.deepcopy(members)):
        m.train()
        loss_of(m(*member_in(i))).backward()
        grads.append({k: p.grad for k, p in m.named_parameters()})
    return grads


def assert_gradients_match(plan, members, inputs, want, label):
    ens = executor.build(plan, members).train()
    batched_loss(ens(*inputs), len(members)).backward()
    refs = {k: torch.stack([w[k] for w in want]) for k, _ in ens.named_stacked_parameters()}
    # a gradient that is 0 up to rounding (attention's key bias) is compared at the scale of all of them
    floor = 1e-4 * max(r.abs().max().item() for r in refs.values())
    for k, p in ens.named_stacked_parameters():
        err = (p.grad - refs[k]).abs().max().item() / max(refs[k].abs().max().item(), floor, 1e-12)
        assert err <= RTOL, f"after {label}: gradient of {k} off by {err:.2e}\n{plan.dumps()}"


@settings(max_examples=examples(16))
@given(data=st.data(), name=st.sampled_from(["mlp", "deep_mlp", "data_dependent", "moe", "transformer_block"]))
def test_random_plan_edits_never_change_the_gradients(data, name):
    n = 3
    _, graph = load_sample(name)
    plan, members, inputs, member_in = sample_setup(name, n)
    want = loop_gradients(members, member_in)
    assert_gradients_match(plan, members, inputs, want, "propose")
    for _ in range(4):
        label, edit = draw_edit(data, plan, graph)
        try:
            plan = edit()
        except planner.EditError:
            continue
        assert_gradients_match(plan, members, inputs, want, label)


# --- autotune for training ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deep_mlp", "transformer_block"])
def test_training_autotune_chooses_trainable_strategies_checked_by_gradients(name):
    n = 3
    plan, members, inputs, member_in = sample_setup(name, n)
    tuned = executor.autotune(plan, members, inputs, train=True, repeats=3)
    trainable = {Strategy.VMAP, Strategy.WIDE, Strategy.LOOP}
    assert all(s.options.strategy in trainable for s in tuned.stages)
    assert all("forward + backward" in s.options.note for s in tuned.stages), [s.options.note for s in tuned.stages]
    lrs = [0.01 * (i + 1) for i in range(n)]
    ens, loop = train_both(tuned, members, member_in, inputs,
                           lambda ps: StackedSGD(ps, n, lr=lrs, momentum=0.9), lambda ps, i: torch.optim.SGD(ps, lr=lrs[i], momentum=0.9))
    assert_params_match(ens, loop, f"{name} tuned for training")


def test_training_autotune_never_picks_a_strategy_with_wrong_gradients(monkeypatch):
    from stagewise.executor import autotune_train
    from stagewise.executor.stages import RUNNERS

    n = 2
    plan, members, inputs, _ = sample_setup("mlp", n)
    real = RUNNERS[Strategy.WIDE]

    class WrongGradients(real):
        def run(self, args):
            return [type(v)(v.tree.detach()) if hasattr(v, "tree") else v for v in super().run(args)]  # cuts the gradient

    monkeypatch.setitem(RUNNERS, Strategy.WIDE, WrongGradients)
    tuned, found = autotune_train.tune_training(plan, members, inputs, repeats=3)
    wide = [r for r in found[tuned.stages[0].id] if r.strategy == "wide"]
    assert wide and not wide[0].ok
    assert tuned.stages[0].options.strategy is not Strategy.WIDE
