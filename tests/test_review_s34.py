"""Silent wrong answers and failures found in session 34's reviews and known items, each against the plain member loop."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner

N = 3


def _members(cls, n: int = N, **kw) -> list[nn.Module]:
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(cls(**kw))
    return out


class Tagged(nn.Linear):
    """A layer with a get_extra_state() value of its own (a quantisation config, a version tag)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.tag = {"v": 0}

    def get_extra_state(self):
        return dict(self.tag)

    def set_extra_state(self, state):
        self.tag = dict(state)


class WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Tagged(4, 4)

    def forward(self, x):
        return self.a(x)


def test_member_state_dicts_hold_each_members_extra_state(tmp_path):
    """member_state_dicts() left a get_extra_state() value out: `member.load_state_dict(sd)` failed, strict, on the
    missing key; the safetensors files left it out without a word."""
    members = _members(WithExtra)
    for i, m in enumerate(members):
        m.a.tag = {"v": i}
    x = torch.randn(2, 4)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    states = ens.member_state_dicts()
    for i, m in enumerate(members):
        assert list(states[i]) == list(m.state_dict())
        fresh = WithExtra()
        fresh.load_state_dict(states[i])  # strict
        assert fresh.a.tag == {"v": i}
        torch.testing.assert_close(fresh(x), m(x), rtol=0, atol=0)
    states[0]["a._extra_state"]["v"] = 99  # a copy: the module's own stays as built
    assert ens.member_state_dicts()[0]["a._extra_state"] == {"v": 0}
    with pytest.warns(UserWarning, match=r"get_extra_state\(\) values \(a\._extra_state\).*safetensors files hold tensors only"):
        paths = executor.save_member_weights(ens, tmp_path / "w")
    assert len(paths) == N


class DetachesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        y = h * 2 + h.sum()
        h.detach_()  # no gradient back through a from here on
        return y + self.b(h)


@pytest.mark.parametrize("strategy", [None, "loop", "wide"])
def test_a_value_detached_in_place_in_forward(strategy):
    """`h.detach_()` failed every call of the proposed plan: a loop stage hands row views, which torch cannot detach in
    place. It is traced as `h.detach()` read by what comes after; values and gradients are the loop's."""
    members = _members(DetachesInPlace)
    x = torch.randn(2, 4)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, N)
    if strategy:
        for st in plan.stages:
            plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    loop = copy.deepcopy(members)
    ens = executor.build(plan, members)
    out = ens(x)
    ref = torch.stack([m(x) for m in loop])
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for name, p in ens.named_stacked_parameters():
        torch.testing.assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in loop]))


class GatedStraightThrough(nn.Module):
    """h's values gated out of autograd's sight through a detached alias; h's gradient passes straight through."""

    def __init__(self):
        super().__init__()
        self.a, self.g, self.b = nn.Linear(8, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        r = self.g(x)[0]
        h.detach().mul_(torch.sigmoid(r.detach()))
        return self.b(r + h)


@pytest.mark.parametrize("strategies", [("loop", "loop", "loop"), ("loop", "wide", "vmap"), ("vmap", "wide", "loop")])
def test_a_write_through_a_detached_alias_keeps_the_gradient(strategies):
    """A loop stage gave each member a private copy of memory its values share, made from the detached alias
    (`h.detach()`) rather than from h: h's later readers got a value without history, and `a` no gradient (0.058,
    the whole gradient), with outputs right."""
    members = _members(GatedStraightThrough)
    xs = torch.randn(N, 2, 5, 8)
    graph = planner.trace(members[0], (xs[0],))
    plan = planner.propose(graph, N, input_mode="per_member")
    assert len(plan.stages) == len(strategies)
    for st, strategy in zip(plan.stages, strategies):
        plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    loop = copy.deepcopy(members)
    ens = executor.build(plan, members)
    out = ens(xs)
    ref = torch.stack([m(xs[i]) for i, m in enumerate(loop)])
    torch.testing.assert_close(out, ref)
    (out ** 2).sum().backward()
    (ref ** 2).sum().backward()
    for name, p in ens.named_stacked_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in loop]))


class ScalesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.fc = nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Linear(8, 3)

    def forward(self, x):
        x.mul_(2)
        return self.fc(self.gn(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("chunk_size", [1, 2])
@pytest.mark.parametrize("grad", [False, True])
def test_a_chunked_stage_writing_a_channels_last_input_writes_once(chunk_size, grad):
    """vmap refuses to say a channels_last input's layout to GroupNorm; the stage was run again on contiguous copies,
    after the chunked first attempt had already written the first chunk's members: their input written twice (0.022)."""
    members = _members(ScalesInput)
    x = torch.randn(N, 2, 4, 6, 6)
    graph = planner.trace(copy.deepcopy(members[0]), (x[0].clone(),))
    plan = planner.propose(graph, N, input_mode="per_member")
    plan = planner.set_options(plan, graph, plan.stages[0].id, chunk_size=chunk_size)
    ens = executor.build(plan, copy.deepcopy(members))
    channels_last = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
    xb, xl = channels_last.clone(), channels_last.clone()
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ens(xb)
        want = torch.stack([m(xl[i]) for i, m in enumerate(members)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xb, xl, rtol=0, atol=0)  # the caller's tensor written once, as the loop writes it


class TypedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def __call__(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # for type checkers only
        return super().__call__(x, scale=scale)

    def forward(self, x, scale=1.0):
        return torch.relu(self.fc(x)) * scale


class WithTypedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = TypedBlock(), TypedBlock()

    def forward(self, x):
        return self.b(self.a(x), scale=0.5)


class ChangesArguments(TypedBlock):
    def __call__(self, x, scale=1.0):
        return super().__call__(x, scale=2 * scale)


def test_a_call_override_that_only_hands_its_arguments_on_plans():
    """`def __call__(self, x: Tensor) -> Tensor: return super().__call__(x)`, written for type checkers, was refused as
    code around forward() the trace would drop; one that changes what it hands on stays refused."""
    from stagewise.planner.errors import TraceError  # noqa: PLC0415

    members = _members(WithTypedBlocks)
    x = torch.randn(2, 4)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(TraceError, match="overrides __call__"):
        planner.trace(ChangesArguments(), (x,))


class TiedSpectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.utils.spectral_norm(nn.Linear(6, 4))
        self.dec_bias = nn.Parameter(torch.zeros(6))

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.enc(x)), self.enc.weight.t(), self.dec_bias)


def test_the_hook_based_spectral_norm_read_outside_its_module_is_named():
    """The refusal blamed autograd-node and saved-tensor hooks the model does not have; the cause is the hook-based
    spectral_norm's weight, a plain attribute, read outside its module after a call under no_grad."""
    from stagewise.planner.errors import TraceError  # noqa: PLC0415

    torch.manual_seed(0)
    m = TiedSpectral().eval()
    with torch.no_grad():
        m(torch.randn(5, 6))
    with pytest.raises(TraceError, match=r"hook-based spectral_norm / weight_norm \(enc\.weight\).*parametrizations"):
        planner.trace(m, (torch.randn(5, 6),))
