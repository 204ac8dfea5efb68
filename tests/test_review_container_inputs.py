"""verify, profile and autotune on a plan whose per_member input is a container (a batch dict): each member is given
its part, row i of each tensor leaf and, of an [N] leaf, the Python number it holds (as the batched module takes a
number inside a per_member container). Before: a raw `KeyError: 0` from indexing the dict itself."""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from test_review_pm_numbers import N, SHAPES, DictSlope, members_of, plan_of

from stagewise import executor, planner

torch.set_num_threads(1)


class BatchDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, batch):
        return self.fc(batch["x"]) * batch["w"]


def _dict_plan():
    torch.manual_seed(0)
    members = [BatchDict() for _ in range(N)]
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), ({"x": torch.randn(5, 4), "w": torch.randn(5, 1)},)),
                           n_members=N, input_mode="per_member")
    return members, plan, {"x": torch.randn(N, 5, 4), "w": torch.randn(N, 5, 1)}


def test_verify_and_profile_of_a_per_member_dict_input():
    members, plan, batch = _dict_plan()
    report = executor.verify(plan, members, (batch,), grads=True)
    assert report.ok, report.to_text()
    prof = executor.profile(plan, members, (batch,), repeats=2, warmup=1)
    assert all(s.result.ok for s in prof.stages), prof.to_text()


def test_autotune_of_a_per_member_dict_input_matches_the_loop():
    members, plan, batch = _dict_plan()
    tuned = executor.autotune(plan, members, (batch,), repeats=2, budget="quick")
    with torch.no_grad():
        got = executor.build(tuned, members)(batch)
        want = torch.stack([m({"x": batch["x"][i], "w": batch["w"][i]}) for i, m in enumerate(members)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_verify_and_profile_give_each_member_its_number_from_a_dict():
    members = members_of(DictSlope)
    b = SHAPES[0][0]
    plan = plan_of(members, (torch.randn(*SHAPES[0]), {"scale": torch.ones(b), "slope": 0.1}),
                   {"x": "shared", "cfg": "per_member"})
    inputs = (torch.randn(*SHAPES[0]), {"scale": torch.rand(N, b), "slope": torch.tensor([0.01, 0.1, 0.3])})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the number stage's note
        report = executor.verify(plan, members, inputs)
        prof = executor.profile(plan, members, inputs, repeats=2, warmup=1)
    assert report.ok, report.to_text()
    assert all(s.result.ok for s in prof.stages), prof.to_text()


def test_verify_compares_the_gradients_inside_a_container_input():
    members, plan, batch = _dict_plan()
    batch["x"].requires_grad_(True)
    report = executor.verify(plan, members, (batch,), grads=True)
    assert report.ok, report.to_text()
    row = next(r for r in report.gradients if r.name == "input batch['x']")
    assert row.ok and row.max_rel < 1e-5
    assert not any("not compared" in n for n in report.notes), report.notes
