"""Writes into a tensor that no in-place op name shows: `out=`, `__setitem__` / `operator.setitem`, a write through
`.data`. Each must keep every later read of the tensor after it, in whatever stage the planner puts them.

Was: the planner saw these as pure ops (or, for `.data`, as a value of its own), put the later read `neg(h)` in a
stage before the write, and the proposed plan answered off by 0.7 to 1.35, while the per-stage check passed."""
from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import TraceError

N = 3

FORMS = {
    "out_keyword": lambda h: torch.add(h, 1.0, out=h),
    "clamp_out": lambda h: torch.clamp(h, min=0.0, out=h),
    "setitem_method": lambda h: h.__setitem__(h < 0, 0.0),
    "setitem_operator": lambda h: operator.setitem(h, (slice(None), 0), 5.0),
    "iadd_method": lambda h: h.__iadd__(2.0),
    "through_data": lambda h: h.data.add_(1.0),
}


def _model(write):
    class WritesThenReads(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = self.l1(x) * 1.0
            write(h)
            return self.l2(torch.neg(h))

    return WritesThenReads


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_write_named_otherwise_keeps_later_reads_after_it(form):
    cls = _model(FORMS[form])
    torch.manual_seed(0)
    members = [cls() for _ in range(N)]
    x = torch.randn(5, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)
    assert executor.verify(plan, members, (x,)).ok


def test_a_tuple_of_out_tensors_is_refused_naming_the_plain_form():
    class MaxOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x)
            v, i = h[:, 0] * 0.0, torch.zeros(h.shape[0], dtype=torch.long)
            torch.max(h, 1, out=(v, i))
            return v

    with pytest.raises(TraceError, match=r"tuple of out= tensors.*v, i = torch.max"):
        planner.trace(MaxOut(), (torch.randn(3, 4),))
