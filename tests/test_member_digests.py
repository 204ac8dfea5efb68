"""Review: ways members differ besides their weights that planner.snapshot.held_values did not see.

stagewise traces member 0 and retraces only the members whose `held_values` digest differs from member 0's
(executor.constants.lift_member_constants). The digest missed: lambdas and a factory's nested functions (digested by
name only), a value held after a large Python table (the walk stopped at 20,000 leaves), sets of tuples (items by
type name), range / slice / deque / Decimal attributes (their class only), inherited or string `__slots__`, the
closures of factory-made classes, and -0.0 against 0.0 (graph constants compared with ==). Each ran every member with
member 0's value: a silent wrong answer of 0.5-3.6. A buffer registered as None in some members crashed aliasing_of
(raw AttributeError), and a sparse COO plain tensor attribute crashed build (torch.equal has no sparse kernel).

Each test builds the batched module and compares it with the loop `[m(x) for m in members]`: it must match within
1e-5, or build must refuse with a stagewise error.
"""
from __future__ import annotations

import array
import collections
import copy
import dataclasses
import decimal
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import MemberError, StagewiseError
from stagewise.planner import snapshot

N = 3


def _x() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1))


def batched_or_refused(make, x: torch.Tensor | None = None, refusal: list | None = None) -> str:
    """Build the batched module of make()'s members and compare it with their loop: 'ran' (matching within 1e-5) or
    'refused' (a stagewise error, appended to `refusal`). A mismatch fails the test."""
    x = _x() if x is None else x
    members, loop = make(), make()
    plan = planner.propose(planner.trace(make()[0], (x,)), n_members=len(members), input_mode="shared")
    try:
        ens = executor.build(plan, members)
    except StagewiseError as e:
        assert str(e), "a refusal says why"
        if refusal is not None:
            refusal.append(e)
        return "refused"
    with torch.no_grad():
        got = ens(x)
        want = torch.stack([m(x) for m in loop])
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"batched module differs from the member loop by {diff}"
    return "ran"


def seeded(factory):
    @functools.wraps(factory)
    def make():
        torch.manual_seed(0)
        return factory()
    return make


# F4: functions held as attributes -----------------------------------------------------------------------------------

ACTS = {"swish": lambda x: x * torch.sigmoid(x),
        "mish": lambda x: x * torch.tanh(F.softplus(x)),
        "square": lambda x: x * x}


class Act(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc, self.out, self.act = nn.Linear(8, 8), nn.Linear(8, 4), act

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def make_act(kind):
    if kind == "double":
        def act(x):
            return x * 2
    elif kind == "tanh":
        def act(x):
            return torch.tanh(x)
    else:
        def act(x):
            return x - 1
    return act


def test_lambdas_from_a_table_are_told_apart():
    assert batched_or_refused(seeded(lambda: [Act(ACTS[k]) for k in ("swish", "mish", "square")])) == "refused"


def test_lambdas_differing_in_a_literal_run_each_members_own():
    assert batched_or_refused(seeded(lambda: [Act(lambda t: t * 2), Act(lambda t: t * 3), Act(lambda t: t * 4)])) == "ran"


def test_nested_functions_of_one_factory_are_told_apart():
    batched_or_refused(seeded(lambda: [Act(make_act(k)) for k in ("double", "tanh", "minus")]))


def test_lambda_digest_holds_the_code():
    a, b = Act(lambda t: t * 2), Act(lambda t: t * 3)
    assert snapshot.held_values(a)["act"] != snapshot.held_values(b)["act"]
    c = Act(a.act)
    assert snapshot.held_values(a)["act"] == snapshot.held_values(c)["act"]


# F5: a value past a large Python table --------------------------------------------------------------------------------

class Head(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.fc, self._scale = nn.Linear(8, 4), scale

    def forward(self, x):
        return self.fc(x) * self._scale


class Vocab(nn.Module):
    def __init__(self, scale, table):
        super().__init__()
        self.vocab = table  # held ahead of the head's private number
        self.head = Head(scale)

    def forward(self, x):
        return self.head(x)


@pytest.mark.parametrize("table", ["dict of 30000 ints", "list of 12000 dicts"])
def test_private_number_after_a_large_table(table):
    def make():
        big = {f"tok{i}": i for i in range(30_000)} if table.startswith("dict") else [{"id": i, "next": i + 1} for i in range(12_000)]
        return [Vocab(s, big) for s in (1.0, 2.0, 3.0)]
    assert batched_or_refused(seeded(make)) == "ran"


def test_leaves_past_the_cap_are_still_compared(monkeypatch):
    monkeypatch.setattr(snapshot, "_HELD_LEAVES", 50)
    big = [{"id": i} for i in range(1000)]
    one, same, other = (snapshot.held_values(Vocab(s, big)) for s in (1.0, 1.0, 2.0))
    assert "<the rest>" in one and one == same and one != other


def test_walk_cut_short_never_judges_members_alike(monkeypatch):
    """Past every cap the digest is equal to no other: the members are traced again (never member 0's for all)."""
    monkeypatch.setattr(snapshot, "_HELD_LEAVES", 50)
    monkeypatch.setattr(snapshot, "_HELD_HASHED", 100)
    big = [{"id": i} for i in range(1000)]
    assert snapshot.held_values(Vocab(1.0, big)) != snapshot.held_values(Vocab(1.0, big))
    assert batched_or_refused(seeded(lambda: [Vocab(s, big) for s in (1.0, 2.0, 3.0)])) == "ran"


# F6: sets ---------------------------------------------------------------------------------------------------------

class Gated(nn.Module):
    def __init__(self, gated):
        super().__init__()
        self.fc, self.gated = nn.Linear(8, 8), gated

    def forward(self, x):
        h = self.fc(x)
        if (0, 1) in self.gated:
            h = h * 2
        return h


@pytest.mark.parametrize("kind", [set, frozenset])
def test_sets_of_tuples(kind):
    batched_or_refused(seeded(lambda: [Gated(kind([(0, 1)])), Gated(kind([(1, 2)])), Gated(kind([(0, 1)]))]))


def test_set_digest_is_order_free():
    a = Gated({(0, 1), (3, 4), ("a", (5, 6))})
    b = Gated(set(reversed(list(a.gated))))
    assert snapshot.held_values(a)["gated"] == snapshot.held_values(b)["gated"]
    assert snapshot.held_values(a)["gated"] != snapshot.held_values(Gated({(0, 1), (3, 4), ("a", (5, 7))}))["gated"]


# F7: objects without a __dict__ ---------------------------------------------------------------------------------------

class Ranged(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.active = range(n)

    def forward(self, x):
        for i in self.active:
            x = torch.tanh(self.layers[i](x))
        return x


class Sliced(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.fc, self.keep = nn.Linear(8, 8), slice(0, k)

    def forward(self, x):
        return self.fc(x)[:, self.keep].sum(-1)


class Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), scale

    def forward(self, x):
        s = self.scale
        s = s[-1] if isinstance(s, (collections.deque, array.array)) else s
        return self.fc(x) * float(s)


@pytest.mark.parametrize("case", ["range", "slice", "deque", "Decimal", "array"])
def test_values_held_in_c(case):
    make = {"range": lambda: [Ranged(n) for n in (4, 2, 3)],
            "slice": lambda: [Sliced(k) for k in (8, 2, 5)],
            "deque": lambda: [Scaled(collections.deque([1.0, k])) for k in (1.0, 2.0, 3.0)],
            "Decimal": lambda: [Scaled(decimal.Decimal(k)) for k in ("1.0", "2.0", "3.0")],
            "array": lambda: [Scaled(array.array("d", [0.0, k])) for k in (1.0, 2.0, 3.0)]}[case]
    batched_or_refused(seeded(make))


# F8: classes a factory makes --------------------------------------------------------------------------------------

def make_block(scale, act):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return act(self.fc(x)) * scale
    return Block


@pytest.mark.parametrize("case", ["closure number", "closure activation"])
def test_factory_classes_closing_over_values(case):
    cfg = {"closure number": [(1.0, torch.tanh), (2.0, torch.tanh), (3.0, torch.tanh)],
           "closure activation": [(1.0, torch.tanh), (1.0, torch.relu), (1.0, F.silu)]}[case]
    batched_or_refused(seeded(lambda: [make_block(s, a)() for s, a in cfg]))


def test_factory_classes_alike_are_alike():
    a, b = make_block(2.0, torch.tanh)(), make_block(2.0, torch.tanh)()
    assert snapshot.held_values(a) == snapshot.held_values(b)


# F10: __slots__ -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class BaseCfg:
    scale: float


@dataclasses.dataclass(slots=True)
class HeadCfg(BaseCfg):
    name: str = "head"


class StrSlots:
    __slots__ = "scale"

    def __init__(self, v):
        self.scale = v


class PrivateSlots(StrSlots):
    __slots__ = ("__hidden",)

    def __init__(self, v):
        super().__init__(1.0)
        self.__hidden = v

    @property
    def value(self):
        return self.scale * self.__hidden


class WithCfg(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc, self._cfg = nn.Linear(8, 4), cfg

    def forward(self, x):
        cfg = self._cfg
        return self.fc(x) * (cfg.value if isinstance(cfg, PrivateSlots) else cfg.scale)


@pytest.mark.parametrize("case", ["inherited dataclass slot", "__slots__ a string", "private slot", "attrs"])
def test_slots_of_every_class(case):
    if case == "attrs":
        attrs = pytest.importorskip("attrs")

        @attrs.define
        class ABase:
            scale: float

        @attrs.define
        class ACfg(ABase):
            name: str = "head"
        mk = ACfg
    else:
        mk = {"inherited dataclass slot": HeadCfg, "__slots__ a string": StrSlots, "private slot": PrivateSlots}[case]
    assert batched_or_refused(seeded(lambda: [WithCfg(mk(v)) for v in (1.0, 2.0, 3.0)])) == "ran"


# F11: the sign of zero -----------------------------------------------------------------------------------------------

class SignOf(nn.Module):
    def __init__(self, off):
        super().__init__()
        self.fc, self.off = nn.Linear(8, 8), off

    def forward(self, x):
        h = self.fc(x)
        return torch.copysign(h, torch.ones_like(h) * self.off)


def test_negative_zero_is_not_zero():
    batched_or_refused(seeded(lambda: [SignOf(o) for o in (0.0, -0.0, 0.0)]))


# F1: a buffer registered as None in some members ------------------------------------------------------------------

class Norm(nn.Module):
    def __init__(self, track):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16, track_running_stats=track), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Masked(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mask", mask)

    def forward(self, x):
        h = self.fc(x)
        return h if self.mask is None else h * self.mask


@pytest.mark.parametrize("case", ["track_running_stats", "buffer None"])
def test_buffer_none_in_some_members_is_refused(case):
    if case == "track_running_stats":
        make = seeded(lambda: [Norm(t).eval() for t in (True, False, True)])
    else:
        make = seeded(lambda: [Masked(m) for m in (torch.ones(8), None, torch.ones(8))])
    refusal: list = []
    assert batched_or_refused(make, refusal=refusal) == "refused"
    assert isinstance(refusal[0], MemberError) and "does not match member 0" in str(refusal[0])


# F9: a sparse tensor held as a plain attribute --------------------------------------------------------------------

class Graph(nn.Module):
    def __init__(self, adj):
        super().__init__()
        self.fc, self.adj = nn.Linear(8, 8), adj

    def forward(self, x):
        return torch.sparse.mm(self.adj, self.fc(x))


def _adjacency(k: int) -> torch.Tensor:
    idx = torch.tensor([[0, 1, 2, 3, 4, 5], [(j + k) % 6 for j in range(6)]])
    return torch.sparse_coo_tensor(idx, torch.ones(6) * (k + 1), (6, 6)).coalesce()


def test_sparse_attribute_alike_builds():
    assert batched_or_refused(seeded(lambda: [Graph(_adjacency(0)) for _ in range(N)])) == "ran"


def test_sparse_attribute_differing_is_refused_with_the_fix():
    refusal: list = []
    if batched_or_refused(seeded(lambda: [Graph(_adjacency(k)) for k in range(N)]), refusal=refusal) == "refused":
        assert isinstance(refusal[0], MemberError) and "register it as a buffer" in str(refusal[0])


def test_sparse_digest_holds_the_values():
    a, b = _adjacency(0), _adjacency(0)
    c = torch.sparse_coo_tensor(a.indices(), a.values() * 2, a.shape).coalesce()
    assert snapshot._tensor_digest(a) == snapshot._tensor_digest(b)
    assert snapshot._tensor_digest(a) != snapshot._tensor_digest(c)
    assert snapshot._tensor_digest(a.to_sparse_csr()) != snapshot._tensor_digest(c.to_sparse_csr())


# identical members stay alike (a differing digest costs a trace, and refuses a leaf module) -------------------------

def test_copies_digest_alike():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = lambda t: t * 2
            self.gated = {(0, 1), ("a", (2, 3))}
            self.active, self.keep = range(3), slice(0, 2)
            self.queue, self.dec = collections.deque([1.0, 2.0], maxlen=4), decimal.Decimal("1.5")
            self.cfg, self.s = HeadCfg(2.0), PrivateSlots(3.0)
            self.adj = _adjacency(1)
            self.block = make_block(2.0, torch.tanh)
            self.vocab = {f"tok{i}": i for i in range(500)}
    m = Holder()
    assert snapshot.held_values(m) == snapshot.held_values(copy.deepcopy(m))


# a value made for the walk (a function's defaults as one tuple) freed and its id reused by the next one's -------------

class Defaults(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.fc = nn.Linear(8, 8)

        def first(h, a=1.0):
            return h * a

        def second(h, b=k):
            return h * b
        self._first, self._second = first, second

    def forward(self, x):
        return self._second(self._first(self.fc(x)))


def test_defaults_of_a_second_function():
    assert batched_or_refused(seeded(lambda: [Defaults(k) for k in (1.0, 2.0, 3.0)])) == "ran"
