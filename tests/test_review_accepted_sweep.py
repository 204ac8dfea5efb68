"""The models the trace's gradient comparison and buffer-value watch accept, each against the plain member loop over
3 calls at 2 batch sizes, forward and parameter gradients (and input gradients where the input requires grad): a
check that what is accepted is also right beyond the one call and shape its own test makes. Members differ in their
weights and in the buffers the model reads."""
from __future__ import annotations

import copy

import pytest
import torch
from test_review_loaded_branches import _initialised
from test_review_trace_values import ActivationById, ActivationByWhere, DropoutCheckpointed, FunctionReversal, NanGuard
from test_review_value_reads_after_build import GuardedBatchNorm

from stagewise import executor, planner

torch.set_num_threads(1)
N, CALLS, BATCHES = 3, 3, (5, 3)  # (not 2: a training BatchNorm over 2 rows is ill-conditioned, float32 loop and batched both 1e-3 off float64)


def _members(name):
    torch.manual_seed(0)
    return {
        "function_reversal": lambda: ([FunctionReversal(lam) for lam in (0.1, 0.5, 1.0)], (8,)),
        "dropout_checkpoint_eval": lambda: ([DropoutCheckpointed().eval() for _ in range(N)], (8,)),
        "nan_guard": lambda: ([NanGuard(k) for k in (0, 2, 3)], (4,)),
        "branch_all_alike": lambda: ([ActivationById(k) for k in (0, 1, 5)], (4,)),
        "choice_on_tensors": lambda: ([ActivationByWhere(k) for k in (0, 2, 2)], (4,)),
        "guard_beside_batchnorm": lambda: ([GuardedBatchNorm(k) for k in (0, 1, 2)], (4,)),
        "glow_actnorm_initialised": lambda: (_initialised(N), (3, 5, 5)),
    }[name]()


def _close_normwise(got, want, what, floor=0.0, rtol=1e-4):  # (executor.stage_grads.GRAD_RTOL)
    """Each member's gradient within rtol of its norm, or of `floor` where it is smaller: a gradient that is zero up
    to rounding (a bias before a training-mode BatchNorm, which takes the batch mean out) has no relative error."""
    for i, (a, b) in enumerate(zip(got, want)):
        err = float((a - b).norm() / max(float(b.norm()), floor, 1e-12))
        assert err < rtol, f"{what} member {i}: {err:.2e} of its norm off"


@pytest.mark.parametrize("name", ["function_reversal", "dropout_checkpoint_eval", "nan_guard", "branch_all_alike",
                                  "choice_on_tensors", "guard_beside_batchnorm", "glow_actnorm_initialised"])
@pytest.mark.parametrize("input_mode", ["shared", "per_member"])
def test_accepted_models_run_and_train_as_the_loop_over_calls_and_shapes(name, input_mode):
    members, feature = _members(name)
    loop = copy.deepcopy(members)
    x0 = torch.randn(BATCHES[0], *feature)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x0,)), n_members=N, input_mode=input_mode)
    ens = executor.build(plan, members)
    torch.manual_seed(1)
    for b in BATCHES:
        for _ in range(CALLS):
            x = torch.randn(*((N,) if input_mode == "per_member" else ()), b, *feature)
            xb = x.clone().requires_grad_(True)
            got = ens(xb)
            ens.zero_grad()
            # a fixed random weighting of the outputs (sum(out**2) after a BatchNorm is a constant of x: its x.grad
            # would be rounding alone)
            w = torch.randn_like(got)
            (got * w).sum().backward()
            wants, input_grads = [], []
            for i, m in enumerate(loop):
                m.zero_grad()
                xi = (x[i] if input_mode == "per_member" else x).clone().requires_grad_(True)
                out = m(xi)
                (out * w[i]).sum().backward()
                wants.append(out.detach())
                input_grads.append(xi.grad)
            torch.testing.assert_close(got.detach(), torch.stack(wants), rtol=1e-5, atol=1e-6)
            want_x = torch.stack(input_grads) if input_mode == "per_member" else sum(input_grads)
            if input_mode == "per_member":
                _close_normwise(xb.grad, want_x, "x.grad")
            else:
                _close_normwise(xb.grad[None], want_x[None], "x.grad")
            want_grads = {k: torch.stack([dict(m.named_parameters())[k].grad for m in loop])
                          for k, _ in ens.named_stacked_parameters()}
            floor = 1e-2 * max(float(g.norm()) for g in want_grads.values())  # (a bias before a BatchNorm: rounding)
            for k, p in ens.named_stacked_parameters():
                _close_normwise(p.grad, want_grads[k], k, floor)
    for k, t in ens.stacked_state.items():  # state forward() updates (BatchNorm statistics) moved as the loop's
        if not t.is_floating_point() or k in dict(ens.named_stacked_parameters()):
            continue
        torch.testing.assert_close(t, torch.stack([dict(m.named_buffers())[k] for m in loop]), rtol=1e-5, atol=1e-6)
