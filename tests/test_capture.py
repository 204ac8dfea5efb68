"""Whole-plan capture (executor.capture): the buffer, lifetime and state rules, checked against the member loop.

Without a GPU the ReplayBackend stands in for the CUDA graph (same static input buffers, same
fixed output tensors, state restored after the capture run); the `gpu` tests capture for real.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.capture import ReplayBackend, capture
from stagewise.planner.errors import ExecutionError

from test_silent_mismatch import CountCalls, RunningMean

N = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def built(make, x, strategy=None, device="cpu"):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    reference = copy.deepcopy(members)
    graph = planner.trace(members[0], (x,))
    plan = planner.propose(graph, n_members=N)
    if strategy is not None:
        plan = plan.with_stages([s.__class__(**{**s.__dict__, "options": planner.StageOptions(strategy=strategy)})
                                 if s.runs_batched else s for s in plan.stages])
    ens = executor.build(plan, members, device=device).eval()
    return ens, [m.to(device).eval() for m in reference]


def loop(reference, x):
    with torch.no_grad():
        return torch.stack([m(x) for m in reference])


def xs(batch, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 8, generator=g).to(device) for _ in range(k)]


@pytest.mark.parametrize("strategy", [None, planner.Strategy.WIDE])
def test_replays_match_the_loop_and_recapture_only_for_a_new_signature(strategy):
    ens, ref = built(MLP, torch.randn(5, 8), strategy)
    cap = capture(ens, backend=ReplayBackend())
    with torch.no_grad():
        for x in xs(5, 3) + xs(7, 2, seed=1) + xs(5, 2, seed=2):
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 2  # batch 5, batch 7; batch 5 again replays the first graph


def test_outputs_are_copies_by_default_and_graph_owned_when_asked():
    ens, ref = built(MLP, torch.randn(5, 8))
    a, b = xs(5, 2)
    with torch.no_grad():
        safe = capture(ens, backend=ReplayBackend())
        first = safe(a)
        safe(b)
        torch.testing.assert_close(first, loop(ref, a), rtol=1e-5, atol=1e-6)  # call 1's result survives call 2
        fast = capture(ens, clone_outputs=False, backend=ReplayBackend())
        first = fast(a)
        second = fast(b)
        assert first is second  # the graph's own tensor: the next call overwrote it
        torch.testing.assert_close(first, loop(ref, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [None, planner.Strategy.WIDE])
def test_state_changed_from_outside_is_seen(strategy):
    ens, ref = built(MLP, torch.randn(5, 8), strategy)
    cap = capture(ens, backend=ReplayBackend())
    x = xs(5, 1)[0]
    with torch.no_grad():
        cap(x)
        for p in ens.parameters():  # an optimizer step, in place
            p.mul_(1.5)
        for m in ref:
            for p in m.parameters():
                p.mul_(1.5)
        torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        assert cap.captures == 2
        ens.load_state_dict({k: v * 0.5 for k, v in ens.state_dict().items()})
        for m in ref:
            m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
        torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        assert cap.captures == 3
        cap(x)
        assert cap.captures == 3  # nothing changed: a replay


@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_state_updated_by_forward_moves_once_per_call(cls):
    x0 = torch.randn(5, 4)
    ens, ref = built(cls, x0)
    cap = capture(ens, backend=ReplayBackend())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(3):  # the warm-up and capture runs must not count
            x = torch.randn(5, 4, generator=g)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    for got, member in zip(ens.member_state_dicts(), ref):
        for k, v in member.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_training_and_gradients_are_refused_with_the_fix():
    ens, _ = built(MLP, torch.randn(5, 8))
    cap = capture(ens, backend=ReplayBackend())
    x = torch.randn(5, 8)
    with pytest.raises(ExecutionError, match="torch.no_grad"):
        cap(x)  # grad enabled and the stacked parameters require grad
    ens.train()
    with torch.no_grad(), pytest.raises(ExecutionError, match=r"\.eval\(\)"):
        cap(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_default_backend_refuses():
    ens, _ = built(MLP, torch.randn(5, 8))
    with pytest.raises(ExecutionError, match="needs the batched module on a CUDA device"):
        capture(ens)


def test_the_oldest_signature_makes_room():
    ens, ref = built(MLP, torch.randn(5, 8))
    cap = capture(ens, max_signatures=2, backend=ReplayBackend())
    with torch.no_grad():
        for batch in (2, 3, 4, 2):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 4 and len(cap._graphs) == 2  # batch 2 was evicted by 4, then captured again


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", [None, planner.Strategy.WIDE])
def test_cuda_graph_of_the_whole_plan_matches_the_loop(strategy):
    ens, ref = built(MLP, torch.randn(5, 8), strategy, device="cuda")
    cap = capture(ens)
    with torch.no_grad():
        for x in xs(5, 3, device="cuda") + xs(7, 2, seed=1, device="cuda"):
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
        for p in ens.parameters():
            p.mul_(1.5)
        for m in ref:
            for p in m.parameters():
                p.mul_(1.5)
        x = xs(7, 1, device="cuda")[0]
        torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
    assert cap.captures == 3


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [RunningMean, CountCalls])
def test_cuda_graph_state_updated_by_forward_moves_once_per_call(cls):
    ens, ref = built(cls, torch.randn(5, 4), device="cuda")
    cap = capture(ens)
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)).cuda()
            torch.testing.assert_close(cap(x), loop(ref, x), rtol=1e-5, atol=1e-6)
