"""Modes and freezing: what a member decides by its flags, against the plain loop over the members.

A Python branch on `self.training` (or F.dropout / F.batch_norm given it) is decided when forward() is
traced; a batched module built from an eval-mode trace ran the eval branch after .train() (0.3-0.5 off the
loop), one from a training-mode trace the training branch after .eval(). It now refuses the other mode,
naming the fix. Leaf Dropout / BatchNorm (fx call_module nodes) still follow .train() / .eval().
Members that freeze different parameters trained (or froze) member 0's choice for all; now refused at build.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.optim import StackedSGD
from stagewise.planner.errors import ExecutionError, MemberError

N = 3


def make(cls, training: bool, n: int = N, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [cls().train(training) for _ in range(n)]


def build(members, x, input_mode="shared"):
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=len(members), input_mode=input_mode)
    return executor.build(plan, [copy.deepcopy(m) for m in members]), plan


def loop(members, x, training: bool) -> torch.Tensor:
    return torch.stack([m.train(training)(x) for m in members])


# --- the models: each reads self.training somewhere the trace decides -----------------------------

class RootBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        x = self.fc(x)
        if self.training:  # deterministic "noise": the loop's result is known exactly in both modes
            x = x + 0.5 * x.sin()
        return x


class FunctionalDropout(nn.Module):
    """Same graph structure in both modes (the fingerprint cannot tell): only a kwarg differs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, training=self.training)


class MyNorm(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))

    def forward(self, x):
        return F.batch_norm(x, self.mean, self.var, training=self.training, momentum=0.1)


class FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = MyNorm()

    def forward(self, x):
        return self.norm(self.fc(x))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x) * (2.0 if self.training else 1.0)


class SubmoduleBranch(nn.Module):
    """The branch sits in a non-leaf submodule."""

    def __init__(self):
        super().__init__()
        self.block = Scaled()
        self.out = nn.Linear(6, 6)

    def forward(self, x):
        return self.out(torch.relu(self.block(x)))


def _noisy(module, x):
    """A helper elsewhere reading the module's flag (not in a method)."""
    return x + 0.25 * x.cos() if module.training else x


class HelperBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return _noisy(self, self.fc(x))


class Leaves(nn.Module):
    """Leaf modules only: fx keeps them as call_module nodes, which follow .train() / .eval()."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


class LeavesExport(Leaves):
    """fx cannot trace `range(x.shape[0])`: torch.export traces it, inside BatchNorm too."""

    def forward(self, x):
        for _ in range(x.shape[0]):
            pass
        return self.drop(self.bn(self.fc(x)))


class PlainExport(nn.Module):
    """An export plan whose code reads no training flag: both modes run the one graph."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        for _ in range(x.shape[0]):
            pass
        return torch.tanh(self.fc(x))


class StochasticDepth(nn.Module):
    """The training branch draws a Python-level coin fx cannot record: training mode cannot be traced."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        if self.training and random.random() < 0.5:
            return x
        return self.fc(x)


BRANCHING = [RootBranch, FunctionalDropout, FunctionalBatchNorm, SubmoduleBranch, HelperBranch]


@pytest.mark.parametrize("cls", BRANCHING, ids=lambda c: c.__name__)
def test_eval_trace_refuses_train_and_names_the_fix(cls):
    """Was: .train() ran the eval branch, 0.3-0.5 off the loop in training mode, no error."""
    x = torch.randn(5, 6)
    members = make(cls, training=False)
    ens, _ = build(members, x)
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, False), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"self\.training.*eval mode.*\.train\(\) on the model before planner\.trace"):
        ens.train()
    assert not ens.training  # nothing changed: still usable for evaluation
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [RootBranch, FunctionalBatchNorm, SubmoduleBranch, HelperBranch], ids=lambda c: c.__name__)
def test_train_trace_trains_like_the_loop_and_refuses_eval(cls):
    """Was: .eval() ran the training branch, 0.4 off the loop. In its own mode it still equals the loop, step after step."""
    x = torch.randn(5, 6)
    members = make(cls, training=True)
    ens, _ = build(members, x)
    ref = copy.deepcopy(members)
    opt = StackedSGD(ens.parameters(), N, lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ref]
    for _ in range(3):
        out = ens(x)
        want = loop(ref, x, True)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        opt.zero_grad()
        (out ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for o in opts:
            o.zero_grad()
        (want ** 2).mean(dim=(1, 2)).sum().backward()  # the loop's own outputs: its forward ran once, like ens's
        for o in opts:
            o.step()
    for i, state in enumerate(ens.member_state_dicts()):
        for k, v in ref[i].state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"self\.training.*training mode.*separate module from members in eval mode"):
        ens.eval()
    assert ens.training


def test_the_flag_set_by_hand_is_refused_at_the_call():
    """`ens.training = True` skips train(): the call itself checks the flag (the loop would run the other branch)."""
    x = torch.randn(5, 6)
    ens, _ = build(make(RootBranch, training=False), x)
    ens.training = True
    with pytest.raises(ExecutionError, match=r"training flag set to True"):
        ens(x)
    with pytest.raises(ExecutionError, match=r"training flag set to True"):
        ens.run_stages(x)
    ens.training = False
    ens(x)


def test_a_parent_module_switching_modes_reaches_the_refusal():
    x = torch.randn(5, 6)
    ens, _ = build(make(RootBranch, training=False), x)
    parent = nn.Sequential(ens)
    with pytest.raises(ExecutionError, match=r"self\.training"):
        parent.train()


def test_a_training_branch_that_cannot_be_traced_refuses_training_with_the_reason():
    x = torch.randn(5, 6)
    ens, _ = build(make(StochasticDepth, training=False), x)
    with pytest.raises(ExecutionError, match=r"in training mode it cannot be traced"):
        ens.train()


@pytest.mark.parametrize("traced_in", [False, True])
def test_leaf_dropout_and_batchnorm_follow_the_mode_either_way(traced_in):
    """fx call_module leaves read their flag at run time: both modes equal the loop, whatever the trace's mode."""
    x = torch.randn(5, 6)
    members = make(Leaves, training=traced_in)
    for mode in (True, False, True):
        ens, _ = build(members, x)
        ens.train(mode)
        ref = copy.deepcopy(members)
        torch.testing.assert_close(ens(x), loop(ref, x, mode), rtol=1e-5, atol=1e-6)
        for i, state in enumerate(ens.member_state_dicts()):  # BatchNorm's running statistics per member
            torch.testing.assert_close(state["bn.running_mean"], ref[i].bn.running_mean, rtol=1e-5, atol=1e-6)


def test_export_plan_with_batchnorm_refuses_the_other_mode():
    """torch.export traces inside BatchNorm: an eval trace's .train() was 1.4 off the loop."""
    x = torch.randn(5, 6)
    members = make(LeavesExport, training=False)
    ens, plan = build(members, x)
    assert plan.tracer == "export"
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, False), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"torch\.export.*BatchNorm.*eval mode"):
        ens.train()


def test_export_plan_reading_no_flag_switches_modes_freely():
    x = torch.randn(5, 6)
    members = make(PlainExport, training=False)
    ens, plan = build(members, x)
    assert plan.tracer == "export"
    for mode in (True, False):
        ens.train(mode)
        torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, mode), rtol=1e-5, atol=1e-6)


def _noisy_act(module, x):
    return torch.relu(x) + (0.1 * x if module.training else 0.0)


ACTS = {"noisy": _noisy_act}


class RegistryBranch(nn.Module):
    """The flag is read by a function found through a table of activations."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.kind = "noisy"

    def forward(self, x):
        return ACTS[self.kind](self, self.fc(x))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class OwnTrain(nn.Module):
    """train() of its own sets a flag forward() reads: no `training` in forward's code."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.noisy = False

    def train(self, mode=True):
        super().train(mode)
        self.noisy = mode
        return self

    def forward(self, x):
        x = self.fc(x)
        return x + 0.5 * x.sin() if self.noisy else x


def test_a_flag_set_by_its_own_train_method_is_found():
    x = torch.randn(5, 6)
    members = make(OwnTrain, training=False)
    ens, _ = build(members, x)
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, False), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"in training mode it traces to another graph"):
        ens.train()


def test_reads_training_finds_the_patterns():
    """The filter that spares a second trace: False only where no traced code names `training`."""
    from stagewise.executor.build import reads_training
    assert not reads_training(PlainExport()) and not reads_training(Two(), "fx")
    for cls in BRANCHING + [Leaves, StochasticDepth, RegistryBranch, Attention]:
        assert reads_training(cls()), cls.__name__  # export traces inside every module
    for cls in BRANCHING + [StochasticDepth, RegistryBranch]:
        assert reads_training(cls(), "fx"), cls.__name__
    assert not reads_training(Leaves(), "fx") and not reads_training(Attention(), "fx")  # fx leaves read it at run time
    assert reads_training(Attention(), "fx", ["attn"])  # opened: traced inside


def test_a_function_from_a_table_reading_the_flag_is_found():
    x = torch.randn(5, 6)
    ens, _ = build(make(RegistryBranch, training=False), x)
    with pytest.raises(ExecutionError, match=r"self\.training"):
        ens.train()


def test_an_opened_module_reading_the_flag_refuses_the_other_mode():
    """Opened, nn.MultiheadAttention is traced inside: its dropout's `training=self.training` is fixed by the trace."""
    x = torch.randn(2, 5, 6)
    members = make(Attention, training=False)
    graph = planner.trace(members[0], (x,), open_modules=["attn"])
    plan = planner.propose(graph, n_members=N, input_mode="shared")
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, False), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"self\.training"):
        ens.train()


# --- members that freeze different parameters ------------------------------------------------------

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("frozen_member", [1, 0])
def test_members_freezing_different_parameters_are_refused(frozen_member):
    """Was: member 0's requires_grad for all (member 1's frozen fc1.weight trained, 6e-2 off after steps; or
    member 0's frozen one frozen for every member)."""
    x = torch.randn(5, 6)
    members = make(Two, training=False)
    members[frozen_member].fc1.weight.requires_grad_(False)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=N, input_mode="shared")
    ens = executor.build(plan, members)  # inference runs (review: refused at build before)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(ExecutionError, match=r"(?i)member 1 (freezes|trains) \['fc1\.weight'\].*freeze the same "
                                             r"parameters in every member.*inference \(torch.no_grad\(\)\) is unaffected"):
        ens.train()(x).sum().backward()


def test_members_freezing_the_same_parameters_train_like_the_loop():
    x = torch.randn(5, 6)
    members = make(Two, training=True)
    for m in members:
        m.fc1.weight.requires_grad_(False)
    ens, _ = build(members, x)
    assert not ens.stacked_state["fc1.weight"].requires_grad
    opt = StackedSGD([p for p in ens.parameters() if p.requires_grad], N, lr=0.1)
    ref = copy.deepcopy(members)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in ref]
    for _ in range(3):
        opt.zero_grad()
        (ens(x) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for m, o in zip(ref, opts):
            o.zero_grad()
            (m(x) ** 2).mean().backward()
            o.step()
    for i, state in enumerate(ens.member_state_dicts()):
        for k, v in ref[i].state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_members_in_mixed_modes_run_as_built_and_refuse_only_what_differs():
    """Root in training, the branching block in eval: the graph as built equals the members as they are; train()
    would flip the block's branch (refused); eval() leaves the root's own code alone (allowed)."""
    x = torch.randn(5, 6)
    members = make(SubmoduleBranch, training=True)
    for m in members:
        m.block.eval()
    ens, _ = build(members, x)
    assert ens.training
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in copy.deepcopy(members)]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"a mix of training and eval modes.*in training mode it traces to another graph"):
        ens.train()
    ens.eval()
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, False), rtol=1e-5, atol=1e-6)


# --- dropout of probability 0: the identity in both modes ---------------------------------------------

class FunctionalDropout(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.lin, self.p = nn.Linear(6, 6), p

    def forward(self, x):
        return F.dropout(self.lin(x), self.p, self.training) + torch.dropout(x, p=self.p, train=self.training)


@pytest.mark.parametrize("traced_train", [True, False], ids=["traced_train", "traced_eval"])
def test_dropout_zero_switches_modes_but_dropout_above_zero_refuses(traced_train):
    """The traces differ only in the training flag of dropouts with p = 0 (nothing dropped either way): not refused."""
    x = torch.randn(2, 6)
    members = make(FunctionalDropout, training=traced_train)
    ens, _ = build(members, x)
    ens.train(not traced_train)
    torch.testing.assert_close(ens(x), loop(copy.deepcopy(members), x, not traced_train), rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    members = [FunctionalDropout(p=0.3).train(traced_train) for _ in range(N)]
    ens, _ = build(members, x)
    with pytest.raises(ExecutionError, match=r"dropout.*0\.3"):
        ens.train(not traced_train)


class _NormEval(nn.Module):
    """mmcv's `norm_eval`: train() keeps the BatchNorm in eval mode (statistics frozen while fine-tuning)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self


def test_train_keeps_the_layer_modes_a_models_own_train_sets():
    """Was: ens.train() put the BatchNorm in training mode, 0.92 off the loop on the first call (verify said MATCH)."""
    torch.manual_seed(0)
    members = [_NormEval().train() for _ in range(N)]
    for m in members:
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 6, 6)
    loop = copy.deepcopy(members)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    for mode in (True, False, True):
        ens.train(mode)
        for m in loop:
            m.train(mode)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]))
    torch.testing.assert_close(ens.member_state_dicts()[1]["bn.running_mean"], loop[1].bn.running_mean)


class _Dropped(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(p)
        self.attn = nn.MultiheadAttention(8, 2, dropout=p, batch_first=True)

    def forward(self, x):
        h = self.drop(self.fc(x))
        return self.attn(h, h, h, need_weights=False)[0]


def test_dropout_rates_that_differ_run_in_eval_and_refuse_train():
    """Was: accepted in eval, then after ens.train() every member dropped at member 0's rate (zeros 0.50/0.50/0.50
    where the loop had 0.50/0.00/0.90), with no error. The attention's own float rate differing was refused in eval."""
    members = [_Dropped(p).eval() for p in (0.5, 0.0, 0.9)]
    x = torch.randn(2, 5, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(ExecutionError, match=r"\.train\(True\) is refused: members differ in dropout rates, drop\.p "
                                             r"\(member 0: 0\.5, member 1: 0\.0, member 2: 0\.9\).*give the members one rate"):
        ens.train()


class _CausalAttention(nn.Module):
    """nanoGPT's attention: `dropout_p=self.dropout if self.training else 0`, with its pretraining default 0.0."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.qkv, self.dropout = nn.Linear(32, 96), dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, c)


@pytest.mark.parametrize("built_in", ["eval", "train"])
def test_attention_dropout_of_zero_in_either_spelling_switches_modes(built_in):
    """Was: .train() / .eval() refused, the traces differing only in dropout_p=0 against dropout_p=0.0, and the
    message showing the same cut-off text on both sides."""
    torch.manual_seed(0)
    members = [getattr(_CausalAttention(), built_in)() for _ in range(N)]
    x = torch.randn(2, 5, 32)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    for mode in (True, False):
        ens.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(ens(x), torch.stack([m.train(mode)(x) for m in members]))
    members = [getattr(_CausalAttention(0.1), built_in)() for _ in range(N)]  # a real rate: another program by mode
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with pytest.raises(ExecutionError, match=r"traces to another graph \(`\.\.\..*dropout_p = 0.* became `\.\.\..*"
                                             r"dropout_p = 0\.1"
                                             if built_in == "eval" else r"traces to another graph \(`\.\.\..*dropout_p = 0\.1"):
        ens.train(built_in == "eval")


class _TrainTemperature(nn.Module):
    def __init__(self, t, only_in_training=True):
        super().__init__()
        self.fc, self.drop, self.t, self.only = nn.Linear(8, 8), nn.Dropout(0.0), t, only_in_training

    def forward(self, x):
        t = (self.t if self.training else 1.0) if self.only else self.t
        return F.log_softmax(self.drop(self.fc(x)) / t, -1)


@pytest.mark.parametrize("built_in", ["eval", "train"])
def test_a_sweep_value_only_one_mode_reads_refuses_the_switch_into_the_other(built_in):
    """Was: member 0 holding the other mode's value (1.0), the trace was alike in both modes, and after the switch
    every member ran the traced mode's numbers: 0.33 and 1.0 off for members 1 and 2."""
    members = [getattr(_TrainTemperature(t), built_in)() for t in (1.0, 2.0, 4.0)]
    x = torch.randn(16, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(ExecutionError, match=r"members differ in numbers that forward\(\) uses otherwise in "
                                             rf"{'training' if built_in == 'eval' else 'eval'} mode"):
        ens.train(built_in == "eval")
    members = [getattr(_TrainTemperature(t, only_in_training=False), built_in)() for t in (1.0, 2.0, 4.0)]
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    ens.train(built_in == "eval")  # a value both modes read alike: the switch is fine
    for m in members:
        m.train(built_in == "eval")
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_a_stage_that_batches_in_eval_but_not_in_training_says_to_plan_in_training():
    """Was: "Check the input shapes" for BatchNorm(momentum=None) planned in eval and called after .train()."""
    members = [nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5, momentum=None)).eval() for _ in range(N)]
    x = torch.randn(4, 5)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members).train()
    with pytest.raises(ExecutionError, match=r"runs in training mode now.*momentum=None.*plan with members in \.train\(\)"):
        ens(x)


def test_train_warns_once_that_layers_put_in_eval_by_hand_go_into_training_mode():
    """Review: a BatchNorm frozen by hand before build trained again after ens.eval(); ens.train(), with no word."""
    members = [nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)).train() for _ in range(N)]
    for m in members:
        m[1].eval()
    x = torch.randn(4, 5)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens.eval()  # moves nothing the hand set: nothing to say
    with pytest.warns(UserWarning, match=r"layers put in another mode by hand \(1\).*override train\(\) in the model class"):
        ens.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens.eval()
        ens.train()  # said once


class _FreezeBN(_NormEval):
    """A `freeze_bn` train(): BatchNorm in eval and its affine weights frozen; and, as mmcv's ResNet.train, no return."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale

    def train(self, mode=True):
        nn.Module.train(self, mode)
        if mode:
            self.bn.eval()
            self.bn.weight.requires_grad_(False)
            self.bn.bias.requires_grad_(False)


def test_train_follows_a_train_override_that_freezes_parameters_and_build_leaves_the_members_flags():
    """Was: the override's requires_grad_(False) reached the user's members at build (copies sharing their tensors), a
    root train() returning None crashed build, and ens.train() left the BatchNorm weights trainable (0.02 off after 3
    SGD steps, 0.12 off in eval afterwards)."""
    torch.manual_seed(0)
    members = [_FreezeBN(s) for s in (1.0, 2.0, 3.0)]
    for m in members:
        m.eval()
    x = torch.randn(4, 3, 6, 6)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    assert all(m.bn.weight.requires_grad for m in members)
    loop = copy.deepcopy(members)
    ens.train()
    for m in loop:
        m.train()
    assert not ens.stacked_state["bn.weight"].requires_grad
    opt = StackedSGD([p for p in ens.parameters() if p.requires_grad], N, lr=0.01)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01) for m in loop]
    for _ in range(3):
        opt.zero_grad()
        ens(x).square().sum().backward()
        opt.step()
        for m, o in zip(loop, opts):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for k in ("conv.weight", "bn.weight", "fc.weight"):
        torch.testing.assert_close(ens.stacked_state[k].detach(), torch.stack([dict(m.named_parameters())[k] for m in loop]).detach())


class _ReversibleFreeze(_NormEval):
    def train(self, mode=True):
        nn.Module.train(self, mode)
        self.bn.requires_grad_(mode)  # trainable in training, frozen in eval: back and forth
        return self


def test_train_puts_back_the_flags_a_reversible_override_sets():
    """Review: after ens.eval(); ens.train() the BatchNorm stayed frozen where the loop's trains again (1.67 off after
    3 SGD steps)."""
    members = [_ReversibleFreeze().train() for _ in range(N)]
    x = torch.randn(4, 3, 6, 6)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    ens.eval()
    assert not ens.stacked_state["bn.weight"].requires_grad
    ens.train()
    assert ens.stacked_state["bn.weight"].requires_grad and ens.stacked_state["bn.bias"].requires_grad


class _ReadsGradMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        return h + (h.pow(2).mean() if torch.is_grad_enabled() else 0.0)


def test_verify_checks_a_module_that_refuses_calls_without_gradients_in_its_traced_mode():
    """Review: verify's calls ran under torch.no_grad(), which this module refuses, so verify raised."""
    members = [_ReadsGradMode() for _ in range(N)]
    x = torch.randn(5, 6)
    plan = planner.propose(planner.trace(members[0], (x,)), N)
    for grads in (False, True):
        assert executor.verify(plan, members, (x,), grads=grads).ok


def test_lazy_modules_not_yet_initialised_are_named_with_the_fix():
    """Review: they were refused as "module hooks (LazyModuleMixin._infer_parameters) ... remove the hooks"."""
    with pytest.raises(planner.TraceError, match=r"lazy modules not yet initialised \('0'\).*Call each member once"):
        planner.trace(nn.Sequential(nn.LazyLinear(4), nn.ReLU()), (torch.randn(3, 5),))
