"""A per-member scalar under the `wide` strategy promotes as it does in each member's op.

In the member loop (and under vmap and compile) a per-member number, a 0-dim buffer or parameter, or a lifted sweep
attribute is 0-dim in each member's op, and torch's type promotion lets a 0-dim tensor of the same category leave a
dimensioned one's dtype alone (float32 activations / a float64 temperature stay float32, bfloat16 ones / a float32
number stay bfloat16). Stacked it is [N]: the wide strategy once aligned it to [N, 1, 1], which promoted the whole
activation (a float64 output where the loop's is float32, or the next Linear refusing the mixed dtypes). Every stage
is forced to `wide` and compared with the plain member loop: outputs, their dtypes, and gradients.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from stagewise import executor, planner
from stagewise.planner.plan import StageOptions, Strategy

N = 3
TEMPS = [0.5, 1.0, 2.0]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
GRAD_TOL = {**TOL, torch.float32: dict(rtol=1e-4, atol=1e-5)}  # summed over rows in another order than the loop's


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


class Temp(nn.Module):
    """Activations divided by a per-member temperature (an input) and a sweep attribute; returns the activation too."""

    def __init__(self, temp=1.0):
        super().__init__()
        self.fc1, self.fc2, self.temp = nn.Linear(8, 8), nn.Linear(8, 4), temp

    def forward(self, x, t):
        h = self.fc1(x) / t / self.temp
        return self.fc2(h), h


class Lifted(Temp):
    """Only the sweep attribute (different per member: lifted to a stacked constant)."""

    def forward(self, x):
        return self.fc2(self.fc1(x) / self.temp)


class Buf64(nn.Module):
    """A float64 0-dim buffer and a float64 0-dim parameter in a float32 model."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("temp", torch.tensor(0.7, dtype=torch.float64))
        self.logit_scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        h = self.fc1(x) / self.temp
        return self.fc2(h) * self.logit_scale.exp(), h


class Threshold(nn.Module):
    """A comparison against a per-member threshold: each member compares in float32 (its 0-dim float64 operand is
    rounded to float32 first), so x == float32(t) is not above t; in float64 it is."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, t):
        return self.fc(x * (x > t).float())


def wide(members, example, input_mode="shared"):
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), example), n_members=N, input_mode=input_mode)
    plan = plan.with_stages([replace(s, options=StageOptions(strategy=Strategy.WIDE)) for s in plan.stages])
    return executor.build(plan, members)


def leaves(out):
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def check(members, ens, args, member_args, dtype=torch.float32, grads=True):
    """`ens(*args)` against each member's `m(*member_args[i])`: every output's dtype and values, and (grads) every
    parameter's gradient of the same loss."""
    ref = [copy.deepcopy(m) for m in members]
    got = leaves(ens(*args))
    wants = [leaves(m(*member_args[i])) for i, m in enumerate(ref)]
    for i, want in enumerate(wants):
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            assert g[i].dtype == w.dtype, f"member {i} output {k}: wide {g[i].dtype}, loop {w.dtype}"
            torch.testing.assert_close(g[i], w, **TOL[dtype], msg=lambda s: f"member {i} output {k}: {s}")
    if not grads:
        return
    sum(o.float().square().sum() for o in got).backward()
    for i, want in enumerate(wants):
        sum(o.float().square().sum() for o in want).backward()
    for key, p in ens.named_stacked_parameters():
        for i, m in enumerate(ref):
            want = dict(m.named_parameters())[key].grad
            if want is None:  # a parameter the forward does not read (none in the stacked gradient either)
                assert p.grad is None or not p.grad[i].any(), key
                continue
            assert p.grad[i].dtype == want.dtype, key
            torch.testing.assert_close(p.grad[i], want, **GRAD_TOL[dtype], msg=lambda s: f"member {i} grad {key}: {s}")


@pytest.mark.parametrize("form", ["numpy", "double"])
def test_float64_per_member_number_keeps_float32_activations(form):
    """Was: InputError (the next Linear's baddbmm got float64 activations); the returned activation came back float64."""
    members = [Temp() for _ in range(N)]
    temps = torch.from_numpy(np.array(TEMPS)) if form == "numpy" else torch.tensor(TEMPS, dtype=torch.double)
    x = torch.randn(4, 8)
    ens = wide(members, (x, 0.5), {"x": "shared", "t": "per_member"})
    check(members, ens, (x, temps), [(x, t) for t in TEMPS])


def test_float64_per_member_number_returned_activation_stays_float32():
    """Was: the returned activation came back float64 where each member's is float32 (verify: MISMATCH)."""

    class Scaled(Temp):
        def forward(self, x, t):
            return self.fc1(x) / t

    members = [Scaled() for _ in range(N)]
    x = torch.randn(4, 8)
    ens = wide(members, (x, 0.5), {"x": "shared", "t": "per_member"})
    check(members, ens, (x, torch.from_numpy(np.array(TEMPS))), [(x, t) for t in TEMPS])


def test_float64_scalar_buffer_and_parameter():
    """Was: InputError (float64 activations into a float32 Linear) where vmap, loop and compile answer."""
    members = [Buf64() for _ in range(N)]
    with torch.no_grad():
        for i, m in enumerate(members):
            m.temp.fill_(0.5 + i)
            m.logit_scale.fill_(1.0 + 0.5 * i)
    x = torch.randn(4, 8)
    ens = wide(members, (x,))
    check(members, ens, (x,), [(x,)] * N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["list", "float32 tensor"])
def test_low_precision_members_with_a_per_member_number(dtype, form):
    """Was: InputError (the number, float32 as number_dtype makes it, promoted bfloat16/float16 activations)."""
    members = [Temp(0.5 + i).to(dtype) for i in range(N)]
    x = torch.randn(4, 8, dtype=dtype)
    ens = wide(members, (x, 0.5), {"x": "shared", "t": "per_member"})
    temps = list(TEMPS) if form == "list" else torch.tensor(TEMPS)
    check(members, ens, (x, temps), [(x, t) for t in TEMPS], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lifted_sweep_attribute_in_low_precision(dtype):
    """Was: InputError for bfloat16 members (the lifted attribute is a float32 [N] constant)."""
    members = [Lifted(0.5 + i).to(dtype) for i in range(N)]
    x = torch.randn(4, 8, dtype=dtype)
    ens = wide(members, (x,))
    check(members, ens, (x,), [(x,)] * N, dtype=dtype)


def test_comparison_with_a_float64_per_member_threshold_compares_as_each_member():
    """Was: the comparison ran in float64, so an x equal to float32(t) counted as above t for every member."""
    members = [Threshold() for _ in range(N)]
    thresholds = [0.1, 0.3, 0.7]
    x = torch.tensor([[0.1, 0.3, 0.7, 0.2], [0.7, 0.1, 0.3, 0.9]], dtype=torch.float32)
    ens = wide(members, (x, 0.1), {"x": "shared", "t": "per_member"})
    check(members, ens, (x, torch.tensor(thresholds, dtype=torch.float64)), [(x, t) for t in thresholds])


def test_same_dtype_per_member_number_unchanged():
    """A float32 per-member number beside float32 activations: nothing to cast (the common case keeps its path)."""
    members = [Temp() for _ in range(N)]
    x = torch.randn(4, 8)
    ens = wide(members, (x, 0.5), {"x": "shared", "t": "per_member"})
    check(members, ens, (x, torch.tensor(TEMPS)), [(x, t) for t in TEMPS])
