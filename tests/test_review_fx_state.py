"""torch.fx's graph checked against forward() on what they leave in the model, not only on what they return: a
branch fx takes wrongly before a BatchNorm in training changes nothing in the output (the batch statistics take the
shift out) but moves the running statistics, which every later eval call reads."""
from __future__ import annotations

import copy

import torch
from torch import nn

from stagewise import executor, planner

N = 3


class ShiftedBN(nn.Module):
    """`if not isinstance(x, torch.Tensor)` is true for an fx proxy: the graph adds 1 where forward() does not."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        if not isinstance(x, torch.Tensor):  # a numpy image in [0, 1], centred (fx: true for a proxy)
            x = x - 0.5
        return self.head(self.bn(self.conv(x)).relu().mean((2, 3)))


def test_running_statistics_written_by_the_graph_match_forward():
    torch.manual_seed(0)
    members = [ShiftedBN().train() for _ in range(N)]
    ref = [copy.deepcopy(m) for m in members]
    x = torch.randn(4, 3, 8, 8)
    graph = planner.trace(members[0], (x,))
    assert graph.tracer == "export", graph.tracer_note
    ens = executor.build(planner.propose(graph, n_members=N), members)
    ens.train()
    for _ in range(2):
        out = ens(x)
        want = torch.stack([m(x) for m in ref])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ens.stacked.bn.running_mean, torch.stack([m.bn.running_mean for m in ref]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ens.stacked.bn.running_var, torch.stack([m.bn.running_var for m in ref]), rtol=1e-5, atol=1e-6)


def test_an_agreeing_graph_stays_with_fx():
    torch.manual_seed(0)

    class Plain(ShiftedBN):
        def forward(self, x):
            return self.head(self.bn(self.conv(x)).relu().mean((2, 3)))

    model = Plain().train()
    before = copy.deepcopy(model.state_dict())
    graph = planner.trace(model, (torch.randn(4, 3, 8, 8),))
    assert graph.tracer == "fx"
    for k, v in model.state_dict().items():  # the check's runs leave the model as it was
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
