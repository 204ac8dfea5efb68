"""State kept inside a dict or list attribute (`self.mem["h"] = cell(x, self.mem.get("h"))`): the traced graph would
read the value the trace saw on every call. The trace failed on it with a raw `KeyError: 'dim'` from the vmap probe
(fx left a Proxy in the dict, which the checks' eager runs then read); it is now refused by name, as a recurrent state
kept as a plain attribute is. A list of activations kept to look at, and a cache keyed by the input's size, are
still traced and match the member loop."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import TraceError

N = 3


class DictState(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 4)
        self.mem = {}

    def forward(self, x):
        h = self.cell(x, self.mem.get("h"))
        self.mem["h"] = h.detach()
        return h


class ListState(nn.Module):
    """A running history the next call reads (a memory of past encodings)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.history = []

    def forward(self, x):
        h = self.fc(x)
        if self.history:
            h = h + self.history[-1]
        self.history.append(h.detach())
        return h


class KeepsMaps(nn.Module):
    """Activations kept to look at after the call, never read by forward()."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.maps = {}

    def forward(self, x):
        h = self.fc1(x).relu()
        self.maps["hidden"] = h
        return self.fc2(h)


class SizeCache(nn.Module):
    """A table cached by sequence length, made from sizes alone: a cache, not state."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.tables = {}

    def forward(self, x):
        t = x.shape[0]
        if t not in self.tables:
            self.tables[t] = torch.arange(t, dtype=x.dtype).unsqueeze(-1) / t
        return self.fc(x) + self.tables[t]


def members_of(cls):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(cls().eval())
    return out


@pytest.mark.parametrize("cls, name", [(DictState, "DictState.mem"), (ListState, "ListState.history")])
def test_state_inside_a_container_attribute_is_refused_by_name(cls, name):
    model = cls()
    with pytest.raises(TraceError, match=rf"'{name}'.*reads it at the next call.*register_buffer"):
        planner.trace(model, (torch.randn(2, 4),))
    assert model.mem == {} if cls is DictState else model.history == []  # left as it was


@pytest.mark.parametrize("cls", [KeepsMaps, SizeCache])
def test_a_container_only_written_or_sized_by_the_input_is_traced(cls):
    members = members_of(cls)
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    ens = executor.build(planner.propose(graph, N), members)
    for b in (5, 5, 3):
        x = torch.randn(b, 4)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
