"""Review: per-member values a trace bakes in, held where the old per-member comparison did not look.

Members were traced again (and their constants compared, lifted or refused) only when their public plain attributes
differed from member 0's. A private attribute (`self._t`), a numpy scalar, a slots dataclass, a config value four
levels deep or under a tuple key, a class attribute of factory-made classes, a bound method's object, a tensor in a
namespace or a numpy array all ran with member 0's value for every member, off by ~1. planner.snapshot.held_values now
digests everything the modules hold; members that differ anywhere are traced again, and a leaf module holding
different values (which runs as member 0's copy) is refused.
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from stagewise import executor, planner
from stagewise.planner.errors import MemberError

N = 3
SCALES = (0.5, 2.0, -1.5)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Private(Base):
    def __init__(self, s):
        super().__init__()
        self._t = s

    def forward(self, x):
        return self.fc(x) * self._t


class NumpyScalar(Base):
    def __init__(self, s):
        super().__init__()
        self.t = np.float32(s)

    def forward(self, x):
        return self.fc(x) * float(self.t)


@dataclass(slots=True)
class SlotsConfig:
    scale: float


class Slots(Base):
    def __init__(self, s):
        super().__init__()
        self.cfg = SlotsConfig(s)

    def forward(self, x):
        return self.fc(x) * self.cfg.scale


class DeepDict(Base):
    def __init__(self, s):
        super().__init__()
        self.cfg = {"a": {"b": {"c": {"scale": s}}}, ("k", 1): s}

    def forward(self, x):
        return self.fc(x) * self.cfg["a"]["b"]["c"]["scale"] + self.cfg[("k", 1)]


def factory_class(s):
    class Scaled(Base):
        scale = s

        def forward(self, x):
            return self.fc(x) * self.scale
    return Scaled


class Helper:
    def __init__(self, s):
        self.s = s

    def apply(self, y):
        return y * self.s


class BoundMethod(Base):
    def __init__(self, s):
        super().__init__()
        self.f = Helper(s).apply

    def forward(self, x):
        return self.f(self.fc(x))


class TensorInNamespace(Base):
    def __init__(self, s):
        super().__init__()
        self.ns = types.SimpleNamespace(w=torch.full((4,), s))

    def forward(self, x):
        return self.fc(x) * self.ns.w.exp()


class NumpyArray(Base):
    def __init__(self, s):
        super().__init__()
        self.a = np.full((4,), s, dtype=np.float32)

    def forward(self, x):
        return self.fc(x) + torch.from_numpy(self.a)


MODELS = {
    "private attribute": Private,
    "numpy scalar": NumpyScalar,
    "slots dataclass": Slots,
    "deep dict and tuple key": DeepDict,
    "factory class attribute": lambda s: factory_class(s)(),
    "bound method's object": BoundMethod,
    "tensor in a namespace": TensorInNamespace,
    "numpy array": NumpyArray,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_values_held_anywhere_are_each_members_own(name):
    members = []
    for i, s in enumerate(SCALES):
        torch.manual_seed(i)
        members.append(MODELS[name](s))
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    ens = executor.build(planner.propose(graph, N), members, example_inputs=(x,))
    for shape in ((5, 4), (2, 4)):
        x = torch.randn(*shape)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class RowScale(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = torch.full((4, 1), s)  # a plain tensor attribute of a parametrization

    def forward(self, w):
        return w * self.s


def scaled_linear(s):
    torch.manual_seed(0)
    fc = nn.Linear(4, 4)
    parametrize.register_parametrization(fc, "weight", RowScale(s))
    return nn.Sequential(fc)


def test_a_leaf_module_holding_other_values_per_member_is_refused():
    members = [scaled_linear(s) for s in SCALES]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    with pytest.raises(MemberError, match="leaf module .* holds besides its parameters"):
        executor.build(plan, members)


def test_leaf_modules_holding_the_same_values_build():
    members = [scaled_linear(0.5) for _ in range(N)]
    for i, m in enumerate(members):
        torch.manual_seed(10 + i)
        m[0].parametrizations.weight.original.data.normal_()
    x = torch.randn(5, 4)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class DtypeAttr(Base):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return self.fc(x).to(self.dtype).float()


def test_a_value_that_cannot_be_given_per_member_is_refused():
    members = [DtypeAttr(d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    with pytest.raises(MemberError, match="member 0: torch.float32"):
        executor.build(plan, members)


class HeldGenerator(Base):
    """Each member its own noise stream: the traced graph would keep member 0's generator for all."""

    def __init__(self, seed, static=False):
        super().__init__()
        self.gen, self.static = torch.Generator().manual_seed(seed), static

    def forward(self, x):
        noise = torch.randn(4, generator=self.gen) if self.static else torch.randn(x.shape, generator=self.gen)
        return self.fc(x) + noise


@pytest.mark.parametrize("static", [False, True])
def test_a_held_torch_generator_is_refused_at_trace(static):
    with pytest.raises(planner.errors.TraceError, match="Generator"):
        planner.trace(HeldGenerator(1, static), (torch.randn(2, 4),))


def test_a_call_inside_parametrize_cached_is_refused():
    members = [scaled_linear(0.5) for _ in range(N)]
    x = torch.randn(5, 4)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    with parametrize.cached():
        with pytest.raises(planner.errors.ExecutionError, match="parametrize.cached"):
            ens(x)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class Threshold(Base):
    def __init__(self, s):
        super().__init__()
        self.thr, self.q = s, abs(s) + 0.5

    def forward(self, x):
        y = self.fc(x)
        return (y > self.thr).float() + y // self.q + y % self.q


class Alpha(Base):
    def __init__(self, s):
        super().__init__()
        self.a = s

    def forward(self, x):
        return torch.add(self.fc(x), x, alpha=self.a)


def test_comparisons_and_floor_division_take_per_member_numbers():
    members = [Threshold(s) for s in SCALES]
    x = torch.randn(5, 4)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-5)


def test_a_per_member_setting_that_has_no_tensor_form_is_refused_by_name():
    members = [Alpha(s) for s in SCALES]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    with pytest.raises(MemberError, match="alpha= or beta="):
        executor.build(plan, members)


def test_per_member_numbers_of_a_float64_model_keep_float64():
    members = []
    for i, s in enumerate((1e40, 1e41, 0.1)):
        torch.manual_seed(i)
        members.append(Private(s).double())
    x = torch.randn(5, 4, dtype=torch.float64)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-12, atol=0)


def test_half_precision_members_are_verified_at_their_own_precision():
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).half())
    x = torch.randn(8, 16, dtype=torch.float16)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    report = executor.verify(plan, members, (x,))
    assert report.ok and report.rtol >= 5e-3


class _ActByAttribute(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc, self.act = torch.nn.Linear(4, 4), act

    def forward(self, x):
        return self.act(self.fc(x))


def test_members_choosing_other_functions_are_refused_naming_the_line():
    """Was: "traces to another graph ... build them from one class and config", for members of one class."""
    import torch.nn.functional as F

    members = [_ActByAttribute(F.relu), _ActByAttribute(F.gelu), _ActByAttribute(F.relu)]
    x = torch.randn(3, 4)
    plan = planner.propose(planner.trace(members[0], (x,)), 3)
    with pytest.raises(MemberError, match=r"member 1 traces to another graph than member 0 \(member 0's `relu = .*` is "
                                          r"its `gelu = .*per-member choice of layer or function"):
        executor.build(plan, members)


class _ReturnsItsNumber(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self.fc, self.t = torch.nn.Linear(4, 4), t

    def forward(self, x):
        return self.fc(x), self.t


def test_a_per_member_number_returned_as_a_python_value_is_refused_naming_the_fix():
    members = [_ReturnsItsNumber(t) for t in (0.5, 1.0, 2.0)]
    x = torch.randn(3, 4)
    with pytest.raises(MemberError, match=r"returns it as a Python number.*return it as a tensor"):
        executor.build(planner.propose(planner.trace(members[0], (x,)), 3), members)
