"""autotune and verify with a forward() that writes its inputs in place.

1. autotune (inference and train=True) copied the inputs of a stage that writes in place, and the whole-plan
   candidates' inputs where forward() writes them, inside every timed call: a stage doing `x[..., :1].mul_(2)` on a
   24 MB input was timed at the copy's cost (ms) instead of the call's (us). The copies are now made once and refilled
   outside the timed call (input_writes.FreshInputs, timing.Prepared); every checked call still sees the caller's
   values, and the caller's tensors are never written.
2. `with torch.no_grad(): x.clamp_(0, 1)` on a per_member input (a write inside the no_grad region a torch.export trace
   makes) was refused at build with a message asking for `x = x + ...`.
3. verify copied each input apart, so a shared input on the memory of a per_member input forward() writes
   (`verify(plan, members, (y[0], y))`) came out as a MATCH where the batched module refuses that call.
"""
from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.autotune import tune
from stagewise.executor.autotune_train import tune_training
from stagewise.planner.errors import InputError

torch.set_num_threads(1)
N = 3


class WritesBigInput(nn.Module):
    """Doubles a thin slice of a large per_member input in place (the batched module writes the caller's rows, as the
    loop does), with a data-dependent number between two stages, so autotune also races whole-plan candidates."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(1))

    def forward(self, x):
        x[..., :1].mul_(2)
        k = x[..., :1].sum().item()
        return x[..., :1] * self.scale * k


def _loop(members, x):
    return torch.stack([copy.deepcopy(m)(x[i].clone()) for i, m in enumerate(members)])


def _clone_ms(x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.clone()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_autotune_times_calls_without_the_input_copy_and_keeps_the_callers_values(train, monkeypatch):
    from stagewise.executor import candidates

    timed: list[tuple[str, float]] = []  # every timing round's (candidate, fastest sample), stage and whole-plan ones
    interleaved = candidates.interleaved

    def spy(fns, *args, **kwargs):
        out = interleaved(fns, *args, **kwargs)
        for label, t in out.items():
            timed.append((label, t.min_ms))
        return out

    monkeypatch.setattr(candidates, "interleaved", spy)
    torch.manual_seed(0)
    members = [WritesBigInput() for _ in range(N)]
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 8),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    assert len(plan.stages) > 1
    x = torch.randn(N, 4, 2_000_000)  # 96 MB: its copy takes milliseconds, the call well under one
    before = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned, found = (tune_training if train else tune)(plan, members, (x,), repeats=5, budget="quick")
    assert torch.equal(x, before), "autotune wrote the caller's input"
    # every candidate checked against the loop on the caller's values (drifted values would differ by 2**k)
    results = [r for rs in found.values() for r in rs if r.ok]
    assert results and all(r.max_rel_err is None or r.max_rel_err <= 1e-6 for r in results), results
    if not train:
        assert {"per-stage", "merged/loop"} <= {label for label, _ in timed}  # the whole-plan candidates were timed
    copy_ms = _clone_ms(before)
    # (in training the loop candidate of the writing stage gives each member its own copy of the memory the members
    # share, as the batched module's loop stage does (stage_grads._own_rows): that copy is the call's own)
    slow = [(label, round(ms, 2)) for label, ms in timed if ms > 0.2 * copy_ms and not (train and label == "loop")]
    assert not slow, f"timed with the input copy: {slow} (a copy takes {copy_ms:.1f} ms)"
    got = executor.build(tuned, members)(x.clone())
    torch.testing.assert_close(got, _loop(members, x), rtol=1e-6, atol=1e-6)


class ClampsUnderNoGrad(nn.Module):
    """Clamps its input in place under torch.no_grad() (torch.export traces the block as a region op whose subgraph
    does the write), then reads it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            x.clamp_(0, 1)
        return self.fc(x)


def _clamp_plan(members, mode="per_member"):
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(2, 4),))
    return planner.propose(graph, n_members=N, input_mode=mode)


def test_a_write_under_no_grad_into_a_per_member_input_runs_as_the_member_loop():
    """Was refused at build: "forward() writes the per_member input 'x' in place in a way the export trace does not
    record ...; write x = x + ...". The batched module writes the caller's rows as each member writes its own x."""
    torch.manual_seed(2)
    members = [ClampsUnderNoGrad() for _ in range(N)]
    plan = _clamp_plan(members)
    assert plan.tracer == "export"
    x = 2 * torch.randn(N, 2, 4)
    loop_x = x.clone()
    want = torch.stack([copy.deepcopy(m)(loop_x[i]) for i, m in enumerate(members)])
    ens = executor.build(plan, members)
    got_x = x.clone()
    with torch.no_grad():
        got = ens(got_x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_x, loop_x)  # the caller's x clamped, as the loop left it
    # with gradients: x a leaf that requires grad (written under no_grad, as torch lets the loop), each member's
    # gradient as its own separate run gives it
    xs = [x[i].clone().requires_grad_() for i in range(N)]
    torch.stack([copy.deepcopy(m)(xs[i]) for i, m in enumerate(members)]).pow(2).sum().backward()
    xb = x.clone().requires_grad_()
    ens(xb).pow(2).sum().backward()
    torch.testing.assert_close(xb.detach(), torch.stack([t.detach() for t in xs]), rtol=0, atol=0)
    torch.testing.assert_close(xb.grad, torch.stack([t.grad for t in xs]), rtol=1e-6, atol=1e-6)
    assert executor.verify(plan, members, (x.clone(),)).ok


def test_a_write_under_no_grad_into_a_shared_input_is_refused_by_name():
    members = [ClampsUnderNoGrad() for _ in range(N)]
    with pytest.raises(InputError, match=r"torch.no_grad\(\).*writes the shared input .x. in place.*x = x\.clone\(\)"):
        executor.build(_clamp_plan(members, "shared"), members)


class WritesRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, s, y):
        y.mul_(2)
        return self.fc(y) + s


def _rows_plan(members):
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(2, 4), torch.randn(2, 4)))
    return planner.propose(graph, n_members=N, input_mode={"s": "shared", "y": "per_member"})


def test_verify_refuses_the_inputs_the_batched_module_refuses():
    """verify copied each input apart, so `(y[0], y)` (a shared input on a row of a per_member input forward() writes)
    and rows of one tensor (`y0.expand(N, ...)`) came out as a MATCH where the module refuses the call."""
    torch.manual_seed(3)
    members = [WritesRows() for _ in range(N)]
    plan = _rows_plan(members)
    y = torch.randn(N, 2, 4)
    ens = executor.build(plan, members)
    for inputs in [(y[0], y), (torch.randn(2, 4), torch.randn(2, 4).expand(N, 2, 4))]:
        with pytest.raises(InputError) as refused:
            ens(*inputs)
        kept = [t.clone() for t in inputs]
        with pytest.raises(InputError) as said:
            executor.verify(plan, members, inputs)
        assert str(said.value) == str(refused.value)
        assert all(torch.equal(a, b) for a, b in zip(inputs, kept))
    report = executor.verify(plan, members, (y[0].clone(), y), more_inputs=[(y[1], y)])
    assert report.ok and any("refused up front" in n for n in report.notes), report.to_text()
