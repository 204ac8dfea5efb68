"""Excluded stages that start as `wide` (planner.propose.excluded_default): an attention call without dropout, and
torch's attention modules as leaves. Each checked against the member loop as the plan runs untuned, in eval and in
training, and with dropout while training, where the module runs once per member drawing as the loop draws.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.strategies.wide_layers import module_rule
from stagewise.planner import Strategy
from stagewise.planner.propose import WIDE_BY_DEFAULT, WIDE_MODULE_BY_DEFAULT

N = 3
SHAPES = ((2, 5), (3, 7))  # (batch, sequence): two input shapes, nothing baked in


class Encoder(nn.Module):
    def __init__(self, dropout=0.0, layers=0):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=dropout, batch_first=True)
        self.layer = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False) if layers else layer
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.layer(self.inp(x)))


class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Sdpa(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.qkv, self.p = nn.Linear(16, 48), p

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p).transpose(1, 2).flatten(2)


class SubclassedLayer(nn.TransformerEncoderLayer):
    """Computes something else than its class: no wide default, no wide rule."""

    def forward(self, src, *args, **kwargs):
        return super().forward(src, *args, **kwargs) * 2


def members(make, train=False):
    torch.manual_seed(0)
    return [make().train(train) for _ in range(N)]


def x_of(b, t, d):
    return torch.randn(b, t, d, generator=torch.Generator().manual_seed(b * 100 + t))


def plan_of(ms, d):
    graph = planner.trace(copy.deepcopy(ms[0]).eval(), (x_of(2, 5, d),))
    return graph, planner.propose(graph, n_members=N)


def excluded(plan):
    return [s for s in plan.stages if s.mode is planner.StageMode.EXCLUDED]


@pytest.mark.parametrize("make, d", [(Encoder, 8), (lambda: Encoder(layers=2), 8), (Attend, 16)])
def test_attention_modules_start_as_wide_and_match_the_loop_in_eval_and_training(make, d):
    ms = members(make)
    _, plan = plan_of(ms, d)
    (stage,) = excluded(plan)
    assert stage.options.strategy is Strategy.WIDE and stage.options.note == WIDE_MODULE_BY_DEFAULT
    assert executor.verify(planner.Plan.loads(plan.dumps()), ms, (x_of(2, 5, d),), rtol=1e-5).ok
    ens = executor.build(plan, copy.deepcopy(ms))
    with torch.no_grad():
        for b, t in SHAPES:
            x = x_of(b, t, d)
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in ms]), rtol=1e-5, atol=1e-5)
    # training, dropout 0: the same values and gradients as the loop's
    ens.train()
    loop = [copy.deepcopy(m).train() for m in ms]
    x = x_of(2, 5, d)
    ens(x).square().sum().backward()
    sum(m(x).square().sum() for m in loop).backward()
    for name, p in ens.named_parameters():
        want = torch.stack([dict(m.named_parameters())[name.replace("stacked.", "", 1)].grad for m in loop])
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5)


def test_with_dropout_the_wide_module_trains_as_the_member_loop_draws():
    """Dropout while training: wide refuses the encoder layer, and the stage runs it once per member, drawing from the
    global generator in member order, as the loop stage does: under one seed the two plans give the same values."""
    ms = members(lambda: Encoder(dropout=0.3), train=False)
    graph, plan = plan_of(ms, 8)
    assert excluded(plan)[0].options.strategy is Strategy.WIDE
    looped = planner.set_options(plan, graph, excluded(plan)[0].id, strategy="loop")
    wide_ens, loop_ens = executor.build(plan, copy.deepcopy(ms)).train(), executor.build(looped, copy.deepcopy(ms)).train()
    for seed, (b, t) in enumerate(SHAPES + SHAPES[:1]):  # calls at two shapes, and the first again
        x = x_of(b, t, 8)
        wide_ens.zero_grad(set_to_none=True)
        loop_ens.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        got = wide_ens(x)
        torch.manual_seed(seed)
        want = loop_ens(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert (got[0] - got[1]).abs().max() > 1e-3  # members drew their own masks
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, p), (_, q) in zip(wide_ens.named_parameters(), loop_ens.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():  # eval: no dropout, wide again, as the loop
        torch.testing.assert_close(wide_ens.eval()(x), loop_ens.eval()(x), rtol=1e-5, atol=1e-5)


def test_an_attention_call_without_dropout_starts_as_wide_with_dropout_as_the_loop():
    ms = members(Sdpa)
    _, plan = plan_of(ms, 16)
    (stage,) = excluded(plan)
    assert stage.options.strategy is Strategy.WIDE and stage.options.note == WIDE_BY_DEFAULT
    assert executor.verify(plan, ms, (x_of(2, 5, 16),), rtol=1e-5).ok
    _, dropping = plan_of(members(lambda: Sdpa(p=0.2)), 16)
    assert [s.options.strategy for s in excluded(dropping)] == [Strategy.LOOP]


def test_subclasses_start_as_the_loop():
    class WithSubclass(Encoder):
        def __init__(self):
            super().__init__()
            self.layer = SubclassedLayer(16, 4, 32, dropout=0.0, batch_first=True)

    ms = members(WithSubclass)
    graph, plan = plan_of(ms, 8)
    # traced inside (its exact nn.MultiheadAttention may start as wide), or a leaf that starts as the loop
    for stage in excluded(plan):
        leaves = [graph.fx_node(n) for n in stage.nodes]
        if any(n.op == "call_module" and n.target == "layer" for n in leaves):
            assert stage.options.strategy is Strategy.LOOP
    assert executor.verify(plan, ms, (x_of(2, 5, 8),), rtol=1e-5).ok


class Recurrent(nn.Module):
    def __init__(self, kind="gru", **kw):
        super().__init__()
        self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(8, 8, batch_first=True, **kw)
        self.head = nn.Linear(16 if kw.get("bidirectional") else 8, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_recurrent_modules_start_as_wide_and_match_the_loop(kind):
    ms = members(lambda: Recurrent(kind, num_layers=2))
    _, plan = plan_of(ms, 8)
    (stage,) = excluded(plan)
    assert stage.options.strategy is Strategy.WIDE
    assert executor.verify(planner.Plan.loads(plan.dumps()), ms, (x_of(2, 5, 8),), rtol=1e-5,
                           more_inputs=[(x_of(3, 7, 8),)]).ok


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_recurrent_dropout_while_training_runs_the_module_per_member_as_the_loop(kind):
    """Dropout between layers while training: wide refuses, and the module runs once per member as the loop does."""
    ms = members(lambda: Recurrent(kind, num_layers=2, dropout=0.4))
    graph, plan = plan_of(ms, 8)
    sid = excluded(plan)[0].id
    wide = executor.build(plan, copy.deepcopy(ms)).train()
    loop = executor.build(planner.set_options(plan, graph, sid, strategy="loop"), copy.deepcopy(ms)).train()
    for seed, (b, t) in enumerate(SHAPES + SHAPES[:1]):  # calls at two shapes, and the first again
        x = x_of(b, t, 8)
        torch.manual_seed(seed)
        got = wide(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, loop(x), rtol=1e-5, atol=1e-6)


class Projected(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True, proj_size=4)

    def forward(self, x):
        return self.rnn(x)[0]


def test_a_module_subclass_with_its_own_forward_gets_no_wide_rule():
    class Plus(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    assert module_rule(nn.Linear(2, 2)) is not None
    assert module_rule(nn.modules.linear.NonDynamicallyQuantizableLinear(2, 2)) is not None  # MHA's out_proj: same forward
    assert module_rule(Plus(2, 2)) is None
    assert module_rule(SubclassedLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()) is None


def test_bidirectional_and_projected_recurrences_start_as_the_loop():
    for make in (lambda: Recurrent(bidirectional=True), Projected):
        _, plan = plan_of(members(make), 8)
        assert [s.options.strategy for s in excluded(plan)] == [Strategy.LOOP]
