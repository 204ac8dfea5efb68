"""Wide GRU/LSTM on CUDA step through torch's fused cell kernels (one launch per step for the gates).

On CPU the plumbing (the [T, N*B, G] layout, h0/hx per layer, both time layouts, gradients) is checked with
the fused kernels replaced by reference formulas (torch has them on CUDA only); on a GPU the real kernels run
against the member loop (cuDNN's GRU/LSTM per member), forward and backward, float32.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from stagewise.executor.strategies import wide_layers
from stagewise.executor.strategies.wide_layers import gru, lstm
from stagewise.executor.strategies.wide_ops import NFirst

IN, HID = 5, 7


def gru_cell_reference(ig, hg, hx):
    """What torch's fused GRU cell computes (no bias arguments): r, z = sigmoid, n = tanh(ig_n + r * hg_n)."""
    assert ig.dim() == hg.dim() == hx.dim() == 2 and ig.is_contiguous() and hg.is_contiguous() and hx.is_contiguous()
    ir, iz, i_n = ig.chunk(3, 1)
    hr, hz, h_n = hg.chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    n = torch.tanh(i_n + r * h_n)
    return n + z * (hx - n)


def lstm_cell_reference(ig, hg, cx):
    """What torch's fused LSTM cell computes: gates i, f, g, o of ig + hg."""
    assert ig.dim() == hg.dim() == cx.dim() == 2 and ig.is_contiguous() and hg.is_contiguous() and cx.is_contiguous()
    i, f, g, o = (ig + hg).chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


@pytest.fixture
def reference_cells(monkeypatch):
    """The fused path on CPU: fused_cells says yes, the kernels are the reference formulas (calls counted)."""
    calls = {"gru": 0, "lstm": 0}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(wide_layers, "fused_cells", lambda gates: True)
    monkeypatch.setattr(wide_layers, "fused_gru_cell", counted("gru", gru_cell_reference))
    monkeypatch.setattr(wide_layers, "fused_lstm_cell", counted("lstm", lstm_cell_reference))
    return calls


def stacked(mods):
    return {k: torch.stack([dict(m.named_parameters())[k] for m in mods]) for k, _ in mods[0].named_parameters()}


SHAPES = ((3, 6), (2, 4))  # (batch, steps): two input shapes, nothing baked in


def run_both(kind, n, layers, batch_first, shared_x, with_h0, device, grad=False, dtype=torch.float32, b=3, t=6):
    """The wide rule and the member loop on one input; returns (wide outputs, loop outputs, grads of both).
    Every random value is drawn on the CPU in float32 first: the same numbers on any device and dtype."""
    torch.manual_seed(0)
    make = nn.GRU if kind == "gru" else nn.LSTM
    mods = [make(IN, HID, num_layers=layers, batch_first=batch_first).to(device, dtype) for _ in range(n)]
    shape = (b, t, IN) if batch_first else (t, b, IN)
    x = (torch.randn(*shape) if shared_x else torch.randn(n, *shape)).to(device, dtype)
    x.requires_grad_(grad)
    h0 = torch.randn(n, layers, b, HID).to(device, dtype) if with_h0 else None
    c0 = torch.randn(n, layers, b, HID).to(device, dtype) if with_h0 else None
    state = {k: v.detach().clone().requires_grad_(grad) for k, v in stacked(mods).items()}
    xw = x if shared_x else NFirst(x)
    if kind == "gru":
        args = (xw,) + ((NFirst(h0),) if with_h0 else ())
        out, h_n = gru(mods[0], state, args, {}, n)
        got = (out.t, h_n.t)
    else:
        args = (xw,) + (((NFirst(h0), NFirst(c0)),) if with_h0 else ())
        out, (h_n, c_n) = lstm(mods[0], state, args, {}, n)
        got = (out.t, h_n.t, c_n.t)
    want_parts = []
    for i, m in enumerate(mods):
        xi = x if shared_x else x[i]
        if kind == "gru":
            o, h = m(xi, h0[i]) if with_h0 else m(xi)
            want_parts.append((o, h))
        else:
            o, (h, c) = m(xi, (h0[i], c0[i])) if with_h0 else m(xi)
            want_parts.append((o, h, c))
    want = tuple(torch.stack([p[k] for p in want_parts]) for k in range(len(got)))
    grads = None
    if grad:
        w = [torch.randn(g.shape).to(g.device, g.dtype) for g in got]
        got_grads = torch.autograd.grad(sum((g * c).sum() for g, c in zip(got, w)), [x] + list(state.values()))
        want_grads = torch.autograd.grad(sum((g * c).sum() for g, c in zip(want, w)),
                                         [x] + [p for m in mods for p in m.parameters()])
        per_member = want_grads[1:]
        k = len(state)
        want_state = [torch.stack([per_member[i * k + j] for i in range(n)]) for j in range(k)]
        grads = (got_grads, (want_grads[0],) + tuple(want_state))
    return got, want, grads


CASES = list(itertools.product(["gru", "lstm"], [1, 2], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize("kind, layers, batch_first, shared_x, with_h0", CASES)
def test_the_fused_step_layout_matches_the_loop(reference_cells, kind, layers, batch_first, shared_x, with_h0):
    with torch.no_grad():
        for b, t in SHAPES + SHAPES[:1]:  # two shapes, and the first again
            got, want, _ = run_both(kind, 3, layers, batch_first, shared_x, with_h0, "cpu", b=b, t=t)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert reference_cells[kind] == (6 + 4 + 6) * layers  # one fused call per step and layer: the fused path ran


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_gradients_flow_through_the_fused_step(reference_cells, kind):
    for b, t in SHAPES:
        got, want, (g_got, g_want) = run_both(kind, 3, 2, True, False, True, "cpu", grad=True, b=b, t=t)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


def test_the_fused_kernels_exist_in_this_torch():
    """The ops the CUDA path calls are registered (their kernels are CUDA's; the CPU tests above replace them)."""
    assert torch.ops.aten._thnn_fused_gru_cell.default is not None
    assert torch.ops.aten._thnn_fused_lstm_cell.default is not None


def test_the_fused_kernels_are_cuda_only_and_not_for_bfloat16():
    assert not wide_layers.fused_cells(torch.zeros(2, 3))
    meta = torch.zeros(2, 3, device="meta")
    assert not wide_layers.fused_cells(meta)
    if torch.cuda.is_available():
        assert wide_layers.fused_cells(torch.zeros(2, 3, device="cuda"))
        assert not wide_layers.fused_cells(torch.zeros(2, 3, device="cuda", dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind, layers, batch_first, shared_x, with_h0", CASES)
def test_fused_cells_on_cuda_match_the_member_loop(kind, layers, batch_first, shared_x, with_h0):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            for b, t in SHAPES:
                got, want, _ = run_both(kind, 8, layers, batch_first, shared_x, with_h0, "cuda", b=b, t=t)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got, want, (g_got, g_want) = run_both(kind, 3, layers, batch_first, shared_x, with_h0, "cuda", grad=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # gradients: against float64 on CPU, tightly. The cuDNN loop itself is the less precise side here: on the H100
        # (2026-11-23, 2-layer GRU/LSTM, 6 steps) its float32 gradients were 1.7e-5 / 8.9e-6 off float64 at most,
        # the fused wide cells 6.6e-7 / 2.5e-7 (as CPU float32): the loop is held to what its own error explains.
        _, _, (_, exact) = run_both(kind, 3, layers, batch_first, shared_x, with_h0, "cpu", grad=True, dtype=torch.float64)
        torch.testing.assert_close(tuple(g.double().cpu() for g in g_got), exact, rtol=1e-5, atol=5e-6)
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
