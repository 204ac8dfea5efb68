"""Silent wrong answers found in session 33's reviews and known items, each against the plain member loop."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError

N = 3

HELPER_CFG = {"temperature": 1.0}
GAIN = 2.0


def _sharpen(h):
    """A helper forward() calls (fx traces through it): the global it reads is baked into the graph."""
    return h / HELPER_CFG["temperature"]


class UsesHelpers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def _gain(self, h):
        return h * GAIN

    def forward(self, x):
        return self._gain(torch.softmax(_sharpen(self.fc(x)), -1))


def test_a_setting_read_in_a_helper_function_or_method_is_watched():
    global GAIN
    torch.manual_seed(0)
    members = [UsesHelpers() for _ in range(N)]
    x = torch.randn(6, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
        try:
            HELPER_CFG["temperature"] = 0.25  # the loop reads 0.25 now; the graph held 1.0 (0.57 off, no word)
            with pytest.raises(ExecutionError, match=r"module-level 'HELPER_CFG'"):
                ens(x)
            HELPER_CFG["temperature"] = 1.0
            GAIN = 3.0  # read by a method forward() calls
            with pytest.raises(ExecutionError, match="module-level 'GAIN'"):
                ens(x)
        finally:
            HELPER_CFG["temperature"], GAIN = 1.0, 2.0
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
