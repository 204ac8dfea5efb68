"""Running statistics handed to a functional batch norm as views of one buffer (`self.stats[0]`, `self.stats[1]`):
vmap drops the update of a view of a stacked buffer without a word, so the batched module's statistics stayed as they
were (outputs 0.45-0.80 off the loop over three calls, the buffer never moved). Such a node runs as the member loop."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner

N = 3


class ObsNorm(nn.Module):
    """An observation normaliser keeping [mean; var] in one buffer, read again after the update."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)
        self.register_buffer("stats", torch.stack([torch.zeros(4), torch.ones(4)]))

    def forward(self, x):
        mean, var = (self.stats[0], self.stats[1]) if self.how == "index" else self.stats.unbind(0)
        x = F.batch_norm(x, mean, var, None, None, True, 0.1, 1e-5)
        return self.fc(x) + self.stats[0]


@pytest.mark.parametrize("how", ["index", "unbind"])
def test_running_statistics_held_as_views_of_one_buffer_update_as_in_the_loop(how):
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(ObsNorm(how).eval())
    x = torch.randn(6, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    reasons = [s.reason for s in plan.stages if s.reason]
    assert any("view of buffer 'stats'" in r for r in reasons), reasons
    ens = executor.build(plan, copy.deepcopy(members))
    torch.manual_seed(5)
    for _ in range(3):
        xi = torch.randn(N, 6, 4) + 3
        with torch.no_grad():
            got = ens(xi)
            want = torch.stack([m(xi[i]) for i, m in enumerate(members)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i, m in enumerate(members):
        torch.testing.assert_close(ens.member_state_dicts()[i]["stats"], m.stats, rtol=1e-6, atol=1e-6)
    assert executor.verify(plan, [ObsNorm(how).eval() for _ in range(N)], (torch.randn(N, 6, 4) + 3,), calls=3).ok
