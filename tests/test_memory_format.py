"""A `forward()` that asks for a memory format (`x.contiguous(memory_format=torch.channels_last)`, `.to(...)`,
`.clone(...)`) runs as the member loop does, under the proposed plan and under a forced `wide` strategy.

vmap cannot lay out one member's [B, C, H, W] inside the stacked [N, B, C, H, W] (torch refuses channels_last on a
rank-5 tensor), yet the planner's probe once passed `.to(memory_format=torch.channels_last)` after a conv: its
stacked copies kept the conv's channels_last layout, the batched module's stacked rows are contiguous, and the
proposed plan failed at its first call. The wide strategy lays each member out in the format (the values are the
same either way). Every result is compared with the plain member loop; a layout is a hint, so only values count,
except where the wide result's layout is checked to be each member's.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import EditError
from stagewise.planner.plan import StageOptions, Strategy

N = 3


class Laid(nn.Module):
    """A conv net that asks for channels_last on its input, after the conv and on a clone."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = x.contiguous(memory_format=torch.channels_last)
        y = self.c(x).to(memory_format=torch.channels_last)
        y = torch.relu(y.clone(memory_format=torch.channels_last))
        return self.fc(y.mean(dim=(2, 3)))


class Laid3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv3d(2, 3, 2)

    def forward(self, x):
        return self.c(x.to(memory_format=torch.channels_last_3d)).contiguous(memory_format=torch.channels_last_3d) * 2


def _loop(members, x):
    return torch.stack([m(x[i]) for i, m in enumerate(members)])


@pytest.mark.parametrize("cls, shape", [(Laid, (2, 3, 8, 8)), (Laid3d, (2, 2, 4, 4, 4))])
@pytest.mark.parametrize("forced", [None, Strategy.WIDE, Strategy.VMAP])
def test_memory_format_runs_as_the_loop(cls, shape, forced):
    torch.manual_seed(0)
    members = [cls() for _ in range(N)]
    x = torch.randn(N, *shape)
    graph = planner.trace(members[0], (x[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    if forced is not None:
        plan = plan.with_stages([replace(s, options=StageOptions(strategy=forced)) for s in plan.stages])
    ens = executor.build(plan, members)
    for batch in (x, x[:, :1], torch.randn(N, 5, *shape[1:])):  # calls at more than one batch size
        torch.testing.assert_close(ens(batch), _loop(members, batch), rtol=1e-5, atol=1e-6)
    report = executor.verify(plan, members, (x,))  # two calls, and a second batch size of its own
    assert report.ok, report.to_text()


def test_wide_lays_each_member_out_channels_last():
    from stagewise.executor.strategies.wide_ops import NFirst, call_function  # noqa: PLC0415

    x = torch.randn(N, 2, 3, 5, 6)
    out = call_function(torch.Tensor.contiguous, "contiguous", (NFirst(x),), {"memory_format": torch.channels_last}, N)
    assert torch.equal(out.t, x)
    for i in range(N):
        assert out.t[i].is_contiguous(memory_format=torch.channels_last)
    # a rank the format does not apply to has no wide rule (vmap then refuses it, as the member's op does)
    assert call_function(torch.Tensor.contiguous, "contiguous", (NFirst(torch.randn(N, 3, 5)),),
                         {"memory_format": torch.channels_last}, N) is None


def test_stage_options_take_a_strategy_name():
    assert StageOptions(strategy="wide").strategy is Strategy.WIDE
    assert StageOptions(strategy="wide").to_json()["strategy"] == "wide"
    with pytest.raises(EditError, match="unknown strategy 'wid'; use one of vmap, loop, wide"):
        StageOptions(strategy="wid")
    with pytest.raises(EditError, match="chunk_size must be a positive integer"):
        StageOptions(chunk_size=0)
