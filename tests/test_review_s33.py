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


def test_the_stage_gradient_check_sees_a_small_tensor_wholly_wrong():
    """Autotune / profile judged a stage's gradients normwise over each member's whole gradient: a bias gradient
    1e-4 of the weight's, wholly wrong (doubled), was 1e-4 of the member's scale, at the float32 tolerance."""
    from stagewise.executor.stage_grads import grads_check  # noqa: PLC0415

    torch.manual_seed(0)
    w = torch.randn(N, 64, 64)
    b = torch.randn(N, 64) * 2e-4
    check = grads_check([w, b], N)
    assert check([w.clone(), b.clone()]) == 0.0
    assert check([w * (1 + 1e-6), b * (1 + 1e-6)]) < 1e-5  # rounding-sized differences pass
    assert check([w.clone(), b * 2]) > 1e-3  # was ~1e-4: the tolerance itself
    # a gradient that cancels to almost nothing (noise 3e-6 of the member's scale) is not judged on its own scale
    zero_ish = torch.randn(N, 64) * 1e-9
    check = grads_check([w, zero_ish], N)
    assert check([w, zero_ish + 3e-6 * w.abs().amax(dim=(1, 2))[:, None]]) < 1e-4


@pytest.mark.parametrize("draw", ["dropout2d", "alpha_dropout", "feature_alpha_dropout", "rrelu"])
def test_wide_on_a_random_op_of_a_shared_input_draws_per_member(draw):
    """wide ran an op with no N-first argument once and shared it unless it knew the op draws: F.dropout2d,
    alpha_dropout, feature_alpha_dropout and rrelu of a shared input gave every member one draw (2.51 off)."""
    import copy  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    fn = getattr(F, draw)

    class InputDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(fn(x, training=True) if draw == "rrelu" else fn(x, 0.5, True))

    torch.manual_seed(0)
    members = [InputDrop().train() for _ in range(N)]
    x = torch.randn(2, 8, 16)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    for s in plan.stages:
        if s.mode is planner.StageMode.EXCLUDED:
            plan = planner.set_options(plan, graph, s.id, strategy="wide")
    assert any(s.options.strategy.value == "wide" for s in plan.stages)
    ens = executor.build(plan, copy.deepcopy(members)).train()
    torch.manual_seed(5)
    with torch.no_grad():
        got = ens(x)
    torch.manual_seed(5)
    with torch.no_grad():
        want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class _Args:
    """What argparse / a dataclass config gives a training script: settings as attributes of one object."""

    def __init__(self):
        self.temperature = 1.0


args = _Args()
size = 4  # a module-level loop variable named like the method forward() calls (`x.size(0)`)


class ReadsAnObjectsSetting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).view(x.size(0), -1)
        return torch.softmax(h / args.temperature, -1)


def test_a_setting_read_off_a_module_level_object_is_watched_and_a_method_name_is_not_a_global():
    global size
    torch.manual_seed(0)
    members = [ReadsAnObjectsSetting() for _ in range(N)]
    x = torch.randn(6, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        try:
            for size in (4, 1, 7):  # was refused from the second call: `size` taken for a global forward() reads
                torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
            args.temperature = 5.0  # the graph held 1.0: 0.27 off, no word
            with pytest.raises(ExecutionError, match=r"module-level 'args.temperature'.*was 1.0"):
                ens(x)
        finally:
            args.temperature, size = 1.0, 4
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_a_captured_plan_makes_the_batched_modules_checks_and_runs_its_hooks():
    """executor.capture(ens) replayed its graphs without the batched module's per-call checks: a module-level
    setting changed since build was answered from the stale graph (0.27 off), and hooks on ens never fired."""
    torch.manual_seed(0)
    members = [ReadsGlobalsHere() for _ in range(N)]
    x = torch.randn(5, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members).eval()
    fast = executor.capture(ens, backend=executor.ReplayBackend())
    seen = []
    ens.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), torch.stack([m(x) for m in members]))
        assert seen == [torch.Size([N, 5, 8])]  # the hook on the batched module fired through the captured one
        try:
            HERE["temperature"] = 5.0
            with pytest.raises(ExecutionError, match=r"module-level 'HERE'"):
                fast(x)
        finally:
            HERE["temperature"] = 1.0
        torch.testing.assert_close(fast(x), torch.stack([m(x) for m in members]))


HERE = {"temperature": 1.0}


class ReadsGlobalsHere(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.fc(x) / HERE["temperature"], -1)
