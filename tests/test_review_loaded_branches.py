"""Members loaded from a checkpoint whose forward() branches on a buffer's value that a tried value flips (Glow's
ActNorm, `if self.initialized.item() == 0`, every member initialised): the plain graph of member 0 writes no state,
so it stands, and executor.build checks every member's own buffers (before: refused at trace, a false refusal of
every trained Glow). Member 0 not initialised (its graph runs the init and writes state) is refused at trace as
before; members apart from member 0 are refused at build."""
from __future__ import annotations

import copy

import pytest
import torch
from test_review_trace_hooks import N, ActNormInit, CountBranch

from stagewise import executor, planner
from stagewise.planner import ExecutionError, MemberError, TraceError

torch.set_num_threads(1)


def _initialised(n):
    torch.manual_seed(0)
    members = [ActNormInit() for _ in range(n)]
    for m in members:
        m(torch.randn(8, 3, 5, 5) * 3 + torch.randn(1, 3, 1, 1))  # each its own data-dependent init
    return members


def test_trained_glow_actnorm_members_build_and_train_as_the_loop():
    members, x = _initialised(N), torch.randn(4, 3, 5, 5)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    ens = executor.build(plan, members)
    loop = copy.deepcopy(members)
    out = ens(x)
    torch.testing.assert_close(out, torch.stack([m(x) for m in loop]), rtol=1e-5, atol=1e-6)
    out.pow(2).sum().backward()
    for m in loop:
        m(x).pow(2).sum().backward()
    for k, p in ens.named_stacked_parameters():
        torch.testing.assert_close(p.grad, torch.stack([dict(m.named_parameters())[k].grad for m in loop]),
                                   rtol=1e-5, atol=1e-6)


def test_an_uninitialised_member_beside_initialised_ones_is_refused_at_build():
    members, x = _initialised(N), torch.randn(4, 3, 5, 5)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    members[2].initialized.fill_(0)
    with pytest.raises(MemberError, match="member 2 with its own buffers"):
        executor.build(plan, members)


def test_a_member_reset_after_build_is_refused_at_the_next_call():
    members, x = _initialised(N), torch.randn(4, 3, 5, 5)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), members)
    with torch.no_grad():
        ens.stacked_state["initialized"][1] = 0
        with pytest.raises(ExecutionError, match="member 1's buffers changed since build"):
            ens(x)


def test_member_0_uninitialised_is_still_refused_at_trace():
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"buffer's values into Python"):
        planner.trace(ActNormInit(), (torch.randn(4, 3, 5, 5),))


def test_a_count_resumed_from_a_checkpoint_runs_as_the_loop():
    torch.manual_seed(0)
    members, x = [CountBranch() for _ in range(N)], torch.randn(5, 4)
    for i, m in enumerate(members):
        m.count.fill_(7 + i)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
