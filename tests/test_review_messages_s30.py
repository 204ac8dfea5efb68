"""Review findings (s30): verify's gradient tolerance for low-precision members, its note when no finite output value
was compared, and the messages for a `.data =` assignment in forward() and for members sharing a frozen backbone
built fresh. Each against what torch itself gives (a float64 run, the member loop)."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import MemberError, TraceError

from test_train_tuning_tolerance import CNN as _CNN  # noqa: E402

torch.set_num_threads(1)


# --- 1. verify(grads=True) on bfloat16 members as given (float32 plan) ---------------------------------------------

def test_verify_grads_of_bfloat16_members_at_their_precision():
    """The members compute in bfloat16 (the plan is float32): the loop's own gradients are a bfloat16 rounding away
    from exact (a ReLU at the rounding boundary switches), so verify judges them at the low-precision gradient
    tolerance, as it does for a bfloat16 plan. The batched gradients are within 5e-2 of a float64 run of each member
    (the verdict's reference): MATCH. It was MISMATCH at 1e-1 (rtol 3e-2) though the loop was the farther one."""
    dt = torch.bfloat16
    torch.manual_seed(0)
    members = [_CNN().eval().to(dt) for _ in range(3)]
    torch.manual_seed(5)
    torch.randn(4, 8)
    x = torch.randn(2, 3, 8, 8, dtype=dt)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    assert plan.dtype == "float32"
    # the reference: the batched module's gradients against float64 runs of the members
    ens = executor.build(plan, members)
    torch.manual_seed(1)
    w = torch.randn(2, 5, dtype=dt)
    (ens(x) * w).sum().backward()
    stacked = dict(ens.named_stacked_parameters())
    for i, m in enumerate(members):
        r64 = copy.deepcopy(m).double()
        (r64(x.double()) * w.double()).sum().backward()
        for name in ("c1.weight", "c2.weight", "fc.weight"):
            g64 = r64.get_parameter(name).grad
            err = ((stacked[name].grad[i].double() - g64).abs().max() / g64.abs().max()).item()
            assert err < 5e-2, (i, name, err)
    report = executor.verify(plan, members, (x,), grads=True)
    assert report.ok, report.to_text()
    assert {"c1.weight", "c2.weight"} <= {r.name for r in report.gradients}


def test_grads_tolerance_one_definition():
    """verify, autotune(train=True) and profile_train judge gradients by one function: float32 members and plan at
    1e-4, bfloat16 members at the low-precision 0.25 (stage_grads re-exports verify's)."""
    import importlib
    stage_grads = importlib.import_module("stagewise.executor.stage_grads")
    verify = importlib.import_module("stagewise.executor.verify")
    assert stage_grads.grads_tolerance is verify.grads_tolerance
    assert stage_grads.members_grads_rtol is verify.members_grads_rtol
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(0)
    members = [_CNN().eval() for _ in range(2)]
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=2)
    assert verify.grads_tolerance(plan, members) == pytest.approx(1e-4)
    low = [copy.deepcopy(m).to(torch.bfloat16) for m in members]
    assert verify.grads_tolerance(plan, low) == verify.LOW_PRECISION_GRADS_RTOL
    assert verify.grads_tolerance(plan, members, rtol=1e-2) == pytest.approx(1e-2)


# --- 2. verify when every loop output is NaN / inf ----------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


_NOTHING_FINITE = r"^out: every member's loop output is all NaN / inf, so no finite value of it was compared"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_verify_notes_no_finite_output_compared(bad):
    """Every loop output NaN (inf input: NaN too): the batched NaN sit where the loop's do, so MATCH, and a note says
    no finite value was compared."""
    torch.manual_seed(0)
    members = [_MLP() for _ in range(3)]
    x = torch.randn(4, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    xb = x.clone()
    xb[:, 0] = bad
    loop = torch.stack([m(xb) for m in members])
    assert not torch.isfinite(loop).any()
    report = executor.verify(plan, members, (xb,))
    assert report.ok
    assert sum(bool(re.search(_NOTHING_FINITE, n)) for n in report.notes) == 1, report.notes


def test_verify_no_note_where_some_output_is_finite():
    torch.manual_seed(0)
    members = [_MLP() for _ in range(3)]
    x = torch.randn(4, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    xb = x.clone()
    xb[0, 0] = float("nan")  # one row NaN, the others compared
    report = executor.verify(plan, members, (xb,))
    assert report.ok
    assert not any(re.search("no finite value", n) for n in report.notes)


def test_verify_nan_positions_still_compared():
    """A NaN where the loop has a number (or a number where it has NaN) stays a mismatch."""
    from stagewise.executor.verify import compare
    nan = float("nan")
    assert not compare("out", torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0]), 1e-4)[0].ok
    assert not compare("out", torch.tensor([1.0, 1.0]), torch.tensor([nan, 1.0]), 1e-4)[0].ok
    assert compare("out", torch.tensor([nan, nan]), torch.tensor([nan, nan]), 1e-4)[0].ok


# --- 3. `.data =` in forward() under torch.export --------------------------------------------------------------------

class _Momentum(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.online = nn.Linear(4, 4)
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for po, pt in zip(self.online.parameters(), self.target.parameters()):
                if self.inplace:
                    pt.mul_(0.99).add_(po.detach(), alpha=0.01)
                else:
                    pt.data = pt.data * 0.99 + po.data * 0.01
            t = self.target(x)
        return self.online(x), t


def test_data_assignment_in_forward_named_with_the_fix():
    torch.manual_seed(0)
    model = _Momentum(inplace=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TraceError) as e:
        planner.trace(model, (torch.randn(2, 4),))
    msg = str(e.value)
    assert re.search(r"_Momentum\.forward\(\) assigns a tensor's \.data, at `pt\.data = pt\.data \* 0\.99 \+ po\.data \* "
                     r"0\.01` \(test_review_messages_s30\.py:\d+\)", msg), msg
    assert "pk.mul_(m).add_(pq.detach(), alpha=1 - m)" in msg
    assert "data-dependent Python control flow" not in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the diagnosis ran on the side


def test_inplace_momentum_update_matches_loop():
    """The fix the message names: the in-place form traces, and trains like the member loop."""
    torch.manual_seed(0)
    members = [_Momentum(inplace=True) for _ in range(3)]
    x = torch.randn(2, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    loop = [copy.deepcopy(m) for m in members]
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    for _ in range(2):
        got = ens(x)
        want = [m(x) for m in loop]
        for k in range(2):
            torch.testing.assert_close(got[k], torch.stack([w[k] for w in want]), rtol=1e-6, atol=1e-6)
    for i, m in enumerate(loop):
        state = ens.member_state_dicts()[i]
        torch.testing.assert_close(state["target.weight"], m.target.weight, rtol=1e-6, atol=1e-6)


# --- 4a. members sharing a frozen backbone under a norm_eval train() override, built fresh ---------------------------

class _NormEval(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(8, 4)

    def train(self, mode=True):
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x):
        return self.head(F.relu(self.backbone(x)).mean((2, 3)))


class _Plain(_NormEval):
    train = nn.Module.train


def _shared(cls):
    torch.manual_seed(0)
    bb = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).requires_grad_(False)
    return [cls(bb) for _ in range(3)], torch.rand(2, 3, 8, 8)


def test_shared_frozen_backbone_fresh_names_member_train():
    members, x = _shared(_NormEval)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=3)
    with pytest.raises(MemberError) as e:
        executor.build(plan, members)
    assert re.search(r"since _NormEval\.train\(\) keeps that layer in eval .*call \.train\(\) on each member before "
                     r"build", str(e.value)), str(e.value)
    # the fix it names: built, and trains like the loop
    for m in members:
        m.train()
    ens = executor.build(plan, members)
    ens.train()
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)


def test_shared_backbone_without_override_no_train_hint():
    members, x = _shared(_Plain)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=3)
    with pytest.raises(MemberError) as e:
        executor.build(plan, members)
    assert "copy.deepcopy the module for each member" in str(e.value)
    assert "before build" not in str(e.value)

