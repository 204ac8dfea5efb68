"""Wide rules for modules: one kernel for all N members' layers.

Input format: batched activations [N, B, C, *spatial] (N-first); member
parameters stacked [N, *param_shape]. Convolutions and pools fold the member
axis into the channel axis ([B, N*C, *spatial], a view when the tensor came out
of a previous wide conv) and run once, as a grouped convolution; Linear is one
baddbmm (or one GEMM against the concatenated weights for a shared input);
eval-mode norms are one fused multiply-add with per-member scale and shift.
GRU and LSTM project every step's input in one batched GEMM per layer and run each
step as one baddbmm plus the gates (on CUDA torch's fused cell kernel: one launch); attention modules (MultiheadAttention,
TransformerEncoderLayer/Encoder) are in wide_attention. A configuration a rule refuses
outright (SUPPORTED) gets no rule at all, so it shows as a gap in wide_rule_gaps.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from stagewise.executor.strategies.wide_attention import (encoder, encoder_layer, encoder_layer_supported, encoder_supported,
                                                          mha_supported, multihead_attention)
from stagewise.executor.strategies.wide_ops import NFirst, affine, as_nfirst, is_nf, linear, relaid

ModuleRule = Callable[[nn.Module, dict, tuple, dict, int], Optional[Any]]

ELEMENTWISE_MODULES = (
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Identity, nn.LeakyReLU, nn.ELU, nn.Softplus,
    nn.Hardtanh, nn.Mish, nn.ReLU6, nn.SELU, nn.CELU, nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid, nn.Softsign,
)
POOLS = (
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
)


def _nf(state: dict, key: str) -> Any:
    v = state.get(key)
    return NFirst(v) if v is not None else None


def fold_channels(x: torch.Tensor, nhwc: bool = False) -> torch.Tensor:
    """[N, B, C, *sp] -> [B, N*C, *sp]; a view when the tensor came from unfold_channels."""
    n, b, c = x.shape[:3]
    y = x.transpose(0, 1).reshape(b, n * c, *x.shape[3:])
    if nhwc and y.dim() == 4 and not y.is_contiguous(memory_format=torch.channels_last):
        y = y.contiguous(memory_format=torch.channels_last)  # mkldnn's grouped conv is fastest in NHWC
    return y


def unfold_channels(y: torch.Tensor, n: int) -> torch.Tensor:
    """[B, N*C, *sp] -> [N, B, C, *sp] as a view."""
    b, nc = y.shape[:2]
    return y.view(b, n, nc // n, *y.shape[2:]).transpose(0, 1)


# CPU: mkldnn's grouped convolution (and one conv with N*out channels for a shared input) measured
# slower than N separate convolutions (31-34 ms vs 27 ms for 20 x [8, 64, 16, 16] 3x3, one thread),
# so on CPU the default form loops the conv over members and everything around it stays batched.
# Tests flip this to exercise the grouped path, which GPUs take by default.
GROUPED_CONV_ON_CPU = False

# How `conv` batches the members' convolutions (a stage's form: WideRunner reads it from the stage's
# options, autotune tries each where it applies and records the fastest; see CONV_FORMS_DOC).
CONV_FORMS = ("loop", "grouped", "grouped_nhwc", "bmm", "im2col", "grouped_bench", "grouped_nhwc_bench")
CONV_FORMS_DOC = """
loop               one F.conv per member on its slice; results stacked (the CPU default)
grouped            members folded into channels [B, N*C, *sp], one conv with groups = N*groups (the GPU default);
                   a shared input with groups 1 is one ordinary conv with N*out channels
grouped_nhwc       grouped, with input and weights in channels_last (Conv2d; Conv1d runs as grouped)
bmm                pointwise convs (1x1, stride 1, no padding, groups 1) of a per-member input as one baddbmm of
                   [N, out, C] weights on the input itself (no copy of it); every other conv runs as grouped
im2col             every groups-1 conv (numeric padding) of a per-member input as F.unfold + one baddbmm of
                   [N, out, C*k] weights; others as grouped. CUDA only: on CPU F.unfold measured 4-40x slower
                   than the grouped conv (3x3, 8-32 px)
grouped_bench      grouped with torch.backends.cudnn.benchmark on for the call (CUDA only: cuDNN times its
                   algorithms on the first call of each shape and keeps the fastest)
grouped_nhwc_bench grouped_nhwc with cudnn.benchmark on (CUDA only)
"""
CUDA_ONLY_FORMS = ("grouped_bench", "grouped_nhwc_bench")


def default_conv_form(device: torch.device) -> str:
    """The form a stage without a recorded one runs: per-member convs on CPU, grouped on GPU."""
    return "grouped" if GROUPED_CONV_ON_CPU or device.type != "cpu" else "loop"


def conv_forms(module: nn.Module, device: torch.device) -> list[str]:
    """The forms that run `module` differently from one another on `device` (the default first)."""
    forms = [default_conv_form(device)]
    forms += [f for f in ("loop", "grouped") if f not in forms]
    if isinstance(module, nn.Conv2d):
        forms.append("grouped_nhwc")
    if _pointwise(module):
        forms.append("bmm")
    if device.type == "cuda":
        forms += ["im2col"] if module.groups == 1 and not isinstance(module.padding, str) else []
        forms += ["grouped_bench"] + (["grouped_nhwc_bench"] if isinstance(module, nn.Conv2d) else [])
    return forms


def _pointwise(module: nn.Module) -> bool:
    """A 1x1 conv with stride 1, no padding and groups 1: a matrix product over channels."""
    return (module.groups == 1 and not isinstance(module.padding, str) and all(k == 1 for k in module.kernel_size)
            and all(s == 1 for s in module.stride) and all(p == 0 for p in module.padding))


class _CudnnBenchmark:
    """torch.backends.cudnn.benchmark on for a block (the flag alone; TF32 and determinism stay as set)."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True

    def __exit__(self, *exc) -> None:
        torch.backends.cudnn.benchmark = self.saved


def conv(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int, form: str = "") -> Any:
    """Conv1d/2d of every member in the stage's `form` (CONV_FORMS_DOC; "" = default_conv_form).

    Input format: x NFirst [N, B, C, *sp] (per member) or a shared [B, C, *sp]; weights [N, out, in/groups, *k].
    Returns NFirst [N, B, out, *sp'] (a strided view for the folded and bmm forms); None for
    what it does not batch (padding modes other than zeros, unbatched inputs, extra arguments).
    """
    if module.padding_mode != "zeros" or kwargs or len(args) != 1:
        return None
    x = args[0]
    spatial = 1 if isinstance(module, nn.Conv1d) else 2
    if (x.rank if is_nf(x) else x.dim()) != spatial + 2:
        return None  # unbatched input: leave it to vmap
    t = x.t if is_nf(x) else x
    form = form or default_conv_form(t.device)
    if form.endswith("_bench"):
        if t.device.type != "cuda":
            form = form[: -len("_bench")]  # cuDNN's benchmark mode means nothing off CUDA
        else:
            with _CudnnBenchmark():
                return _conv(module, state, x, n, spatial, form[: -len("_bench")])
    return _conv(module, state, x, n, spatial, form)


def _conv(module: nn.Module, state: dict, x: Any, n: int, spatial: int, form: str) -> NFirst:
    w = state["weight"]  # [N, out, in/groups, *k]
    b = state.get("bias")
    opts = dict(stride=module.stride, padding=module.padding, dilation=module.dilation)
    fn = F.conv1d if spatial == 1 else F.conv2d
    if form == "loop":
        xs = [x.t[i] for i in range(n)] if is_nf(x) else [x] * n
        return NFirst(torch.stack([fn(xi, w[i], b[i] if b is not None else None, groups=module.groups, **opts)
                                   for i, xi in enumerate(xs)]))
    if is_nf(x) and ((form == "bmm" and _pointwise(module))
                     or (form == "im2col" and module.groups == 1 and not isinstance(module.padding, str))):
        return NFirst(_conv_bmm(module, w, b, x.t, spatial))
    nhwc = form == "grouped_nhwc" and spatial == 2
    w_cat = relaid(w, "conv_nhwc") if nhwc else w.reshape(-1, *w.shape[2:])
    b_cat = b.reshape(-1) if b is not None else None
    if is_nf(x):
        y = fn(fold_channels(x.t, nhwc), w_cat, b_cat, groups=n * module.groups, **opts)
    else:
        xs = x.contiguous(memory_format=torch.channels_last) if nhwc else x
        if module.groups == 1:
            y = fn(xs, w_cat, b_cat, **opts)  # a shared input: one ordinary conv with N*out channels
        else:
            y = fn(xs.repeat(1, n, *([1] * spatial)), w_cat, b_cat, groups=n * module.groups, **opts)
    return NFirst(unfold_channels(y, n))


def _conv_bmm(module: nn.Module, w: torch.Tensor, b: Optional[torch.Tensor], x: torch.Tensor, spatial: int) -> torch.Tensor:
    """Per-member conv (groups 1) as im2col + one baddbmm: [N, out, C*k] x [N, C*k, B*L].

    x [N, B, C, *sp] -> [N, B, out, *sp'] (a permuted view of the [N, out, B, *sp'] GEMM output).
    A 1x1 kernel with stride 1 and no padding needs no unfold: the columns are x itself.
    """
    n, batch, c = x.shape[:3]
    out_c = w.shape[1]
    k = tuple(w.shape[3:])
    stride, padding, dilation = module.stride, module.padding, module.dilation
    pointwise = all(s == 1 for s in k) and all(s == 1 for s in stride) and all(p == 0 for p in padding)
    if pointwise:
        out_sp = tuple(x.shape[3:])
        cols = x.reshape(n, batch, c, math.prod(x.shape[3:]))  # [N, B, C, L] (-1 cannot say L for an empty batch)
    else:
        xs = x.reshape(n * batch, c, *x.shape[3:])
        if spatial == 1:  # F.unfold is 2-d only: a length-L signal is a 1 x L image
            xs, k2 = xs.unsqueeze(2), (1,) + k
            s2, p2, d2 = (1,) + tuple(stride), (0,) + tuple(padding), (1,) + tuple(dilation)
        else:
            k2, s2, p2, d2 = k, tuple(stride), tuple(padding), tuple(dilation)
        cols = F.unfold(xs, k2, dilation=d2, padding=p2, stride=s2)  # [N*B, C*k, L]
        in_sp = xs.shape[2:]
        out_sp = tuple((in_sp[i] + 2 * p2[i] - d2[i] * (k2[i] - 1) - 1) // s2[i] + 1 for i in range(2))
        out_sp = out_sp[1:] if spatial == 1 else out_sp
        cols = cols.view(n, batch, cols.shape[1], cols.shape[2])  # [N, B, C*k, L]
    length = cols.shape[-1]
    cols = cols.transpose(1, 2).reshape(n, cols.shape[2], batch * length)  # [N, C*k, B*L]
    w2 = w.reshape(n, out_c, -1)
    y = torch.baddbmm(b.unsqueeze(2), w2, cols) if b is not None else torch.bmm(w2, cols)  # [N, out, B*L]
    return y.view(n, out_c, batch, *out_sp).transpose(1, 2)


def pool(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """Channel-wise pools run once on the folded [B, N*C, *sp] layout."""
    x = args[0]
    spatial = 1 if module.__class__.__name__.endswith("1d") else 2
    if not is_nf(x) or x.rank != spatial + 2 or kwargs or getattr(module, "return_indices", False):
        return None
    y = module(fold_channels(x.t))
    return NFirst(unfold_channels(y, n))


# the per-member input ranks each BatchNorm takes (one member's [B, C, ...])
_BN_RANKS = ((nn.BatchNorm1d, (2, 3)), (nn.BatchNorm2d, (4,)), (nn.BatchNorm3d, (5,)))


def batch_norm(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """Eval-mode BatchNorm: y = x * scale + shift with per-member [N, C] scale/shift."""
    if module.training or state.get("running_mean") is None or kwargs:
        return None
    x = args[0]
    ranks = next((r for kind, r in _BN_RANKS if isinstance(module, kind)), ())
    if (x.rank if is_nf(x) else x.dim()) not in ranks:  # what the module refuses (BatchNorm2d of one unbatched
        return None  # image) vmap runs, to fail as the loop does: channels here are read from dim 2
    t = as_nfirst(x, n)
    scale = torch.rsqrt(state["running_var"] + module.eps)
    if "weight" in state:
        scale = scale * state["weight"]
    shift = -state["running_mean"] * scale
    if "bias" in state:
        shift = shift + state["bias"]
    shape = (n, 1, t.shape[2]) + (1,) * (t.dim() - 3)
    return NFirst(torch.addcmul(shift.view(shape), t, scale.view(shape)))


def layer_norm(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    x = args[0]
    shape = list(module.normalized_shape)
    y = F.layer_norm(x.t if is_nf(x) else x, shape, None, None, module.eps)
    if not is_nf(x):
        y = y.unsqueeze(0)
    return NFirst(affine(y, _nf(state, "weight"), _nf(state, "bias"), len(shape)))


def linear_module(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    if kwargs or len(args) != 1:
        return None
    return NFirst(linear(args[0], NFirst(state["weight"]), _nf(state, "bias"), n))


def stateless(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    if state or kwargs or len(args) != 1 or not is_nf(args[0]):
        return None
    if isinstance(module, nn.Softmax) or isinstance(module, nn.LogSoftmax):
        if module.dim is None:
            return None
        return NFirst(module.__class__(module.dim + 1 if module.dim >= 0 else module.dim)(args[0].t))
    return NFirst(module(args[0].t))


def flatten_module(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    x = args[0]
    if not is_nf(x):
        return None
    shift = lambda d: d + 1 if d >= 0 else d  # noqa: E731
    return NFirst(x.t.flatten(shift(module.start_dim), shift(module.end_dim)))


def gru(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """nn.GRU (unidirectional, eval) for all members: the input projection of every step is
    one baddbmm (or one GEMM for a shared input); each step is one baddbmm plus fused gates.

    Input format: x [N, B, T, in] (batch_first) or [N, T, B, in]; h0 [N, layers, B, H].
    Returns (out [N, B, T, H] or [N, T, B, H], h_n [N, layers, B, H]).
    """
    if module.bidirectional or module.mode != "GRU" or (module.training and module.dropout) or kwargs:
        return None
    x = args[0]
    h0 = args[1] if len(args) > 1 else None
    if (x.rank if is_nf(x) else x.dim()) != 3:
        return None
    t_dim = 1 if module.batch_first else 0  # time axis of one member's input
    inp: Any = x
    hidden = module.hidden_size
    finals = []
    for layer in range(module.num_layers):
        w_ih, w_hh = state[f"weight_ih_l{layer}"], state[f"weight_hh_l{layer}"]
        b_ih, b_hh = state.get(f"bias_ih_l{layer}"), state.get(f"bias_hh_l{layer}")
        gi = linear(inp, NFirst(w_ih), NFirst(b_ih) if b_ih is not None else None, n)  # [N, *, 3H]
        gi = gi.movedim(t_dim + 1, 1)  # [N, T, B, 3H]
        steps, batch = gi.shape[1], gi.shape[2]
        if h0 is not None:
            h = as_nfirst(h0, n)[:, layer]
        else:
            h = gi.new_zeros(n, batch, hidden)
        w_hh_t = relaid(w_hh, "bmm")
        b_hh_b = b_hh.unsqueeze(1) if b_hh is not None else None
        outs = []
        fused = fused_cells(gi)
        if fused:  # [T, N*B, 3H]: one step's gates are one contiguous block
            gi = gi.movedim(1, 0).contiguous().view(steps, n * batch, 3 * hidden)
            h = h.contiguous()
        for step in range(steps):
            gh = torch.baddbmm(b_hh_b, h, w_hh_t) if b_hh_b is not None else torch.bmm(h, w_hh_t)
            if fused:  # torch's fused GRU cell: the gates of every member in one kernel (rows are independent)
                h = fused_gru_cell(gi[step], gh.view(n * batch, 3 * hidden), h.view(n * batch, hidden)).view(n, batch, hidden)
            else:
                g = gi[:, step]
                rz = torch.sigmoid(g[..., : 2 * hidden] + gh[..., : 2 * hidden])
                r, z = rz[..., :hidden], rz[..., hidden:]
                cand = torch.tanh(torch.addcmul(g[..., 2 * hidden:], r, gh[..., 2 * hidden:]))
                h = torch.lerp(cand, h, z)  # (1 - z) * cand + z * h
            outs.append(h)
        out = torch.stack(outs, dim=1)  # [N, T, B, H]
        finals.append(h)
        inp = NFirst(out.movedim(1, t_dim + 1))
    return (inp, NFirst(torch.stack(finals, dim=1)))


def lstm(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """nn.LSTM (unidirectional, proj_size 0, no inter-layer dropout while training) for all members.

    Per layer: the input projection of every step is one baddbmm (for a shared input the input
    broadcast over members, no copy), with both biases folded into it; each step is one baddbmm
    (h @ W_hh^T added onto that step's projection) plus the fused gates. Gate order i, f, g, o.

    Input format: x [N, B, T, in] (batch_first) or [N, T, B, in]; an unbatched member input [N, T, in]
    is run as B = 1. hx = (h0, c0), each [N, layers, B, H] ([N, layers, H] unbatched), shared or per member.
    Returns (out [N, B, T, H] or [N, T, B, H], (h_n [N, layers, B, H], c_n [N, layers, B, H])), shaped
    like nn.LSTM's output with the member axis first; None (not batched here) for anything else.
    """
    if not lstm_supported(module) or set(kwargs) - {"hx"} or len(args) > 2 or not args:
        return None
    x = args[0]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    rank = x.rank if is_nf(x) else x.dim()
    if rank not in (2, 3) or (hx is not None and (not isinstance(hx, (tuple, list)) or len(hx) != 2)):
        return None
    batched = rank == 3
    t_dim = 1 if module.batch_first and batched else 0  # time axis of one member's input
    if not batched:  # [T, in] -> [T, 1, in]
        x = NFirst(x.t.unsqueeze(2)) if is_nf(x) else x.unsqueeze(1)
        hx = tuple(NFirst(h.t.unsqueeze(2)) if is_nf(h) else h.unsqueeze(1) for h in hx) if hx is not None else None
    hidden = module.hidden_size
    fresh = not torch.is_grad_enabled()  # no autograd: each step's fresh buffers may be updated in place
    inp: Any = x
    h_finals, c_finals = [], []
    for layer in range(module.num_layers):
        b_ih, b_hh = state.get(f"bias_ih_l{layer}"), state.get(f"bias_hh_l{layer}")
        bias = NFirst(b_ih + b_hh) if b_ih is not None else None
        gi = linear(inp, NFirst(state[f"weight_ih_l{layer}"]), bias, n)  # [N, B, T, 4H] or [N, T, B, 4H]
        steps, batch = gi.shape[t_dim + 1], gi.shape[2 - t_dim]
        if hx is not None:
            h, c = (as_nfirst(v, n)[:, layer] for v in hx)
        else:
            h = c = gi.new_zeros(n, batch, hidden)
        w_hh_t = relaid(state[f"weight_hh_l{layer}"], "bmm")  # [N, H, 4H]
        outs = []
        fused = fused_cells(gi)
        if fused:  # [T, N*B, 4H]: one step's input gates are one contiguous block
            gi_steps = gi.movedim(t_dim + 1, 0).contiguous().view(steps, n * batch, 4 * hidden)
            h, c = h.contiguous(), c.contiguous()
        for step in range(steps):
            if fused:  # torch's fused LSTM cell: input + hidden gates and the cell update of every member in one kernel
                hy, cy = fused_lstm_cell(gi_steps[step], torch.bmm(h, w_hh_t).view(n * batch, 4 * hidden),
                                         c.view(n * batch, hidden))
                h, c = hy.view(n, batch, hidden), cy.view(n, batch, hidden)
            else:
                h, c = _lstm_cell(torch.baddbmm(gi.select(t_dim + 1, step), h, w_hh_t), c, hidden, fresh)
            outs.append(h)
        h_finals.append(h)
        c_finals.append(c)
        inp = NFirst(torch.stack(outs, dim=t_dim + 1))
    h_n, c_n = torch.stack(h_finals, dim=1), torch.stack(c_finals, dim=1)
    if not batched:
        return (NFirst(inp.t.squeeze(2)), (NFirst(h_n.squeeze(2)), NFirst(c_n.squeeze(2))))
    return (inp, (NFirst(h_n), NFirst(c_n)))


def fused_cells(gates: torch.Tensor) -> bool:
    """Whether GRU/LSTM steps use torch's fused cell kernels (aten `_thnn_fused_gru_cell` / `_thnn_fused_lstm_cell`):
    on CUDA, for the dtypes those kernels take (not bfloat16). One kernel per step for the gate arithmetic instead
    of six: the recurrence is launch-bound (32 steps of a 64-unit GRU, N=16, b8: ~200 launches before)."""
    return gates.is_cuda and gates.dtype in (torch.float32, torch.float16, torch.float64)


def fused_gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor) -> torch.Tensor:
    """h' of one GRU step from [rows, 3H] gate pre-activations (hidden gates with their bias): one CUDA kernel."""
    return torch.ops.aten._thnn_fused_gru_cell(input_gates, hidden_gates, hx)[0]


def fused_lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h', c') of one LSTM step from [rows, 4H] input and hidden gate pre-activations (i, f, g, o): one CUDA kernel."""
    hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(input_gates, hidden_gates, cx)
    return hy, cy


def _lstm_cell(gates: torch.Tensor, c: torch.Tensor, hidden: int, in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) of one step from the pre-activations [N, B, 4H] (i, f, g, o). In place where nothing
    records autograd: measured ~10% faster per LSTM on the 2-core CPU (fewer [N, B, 4H] buffers)."""
    g = torch.tanh(gates[..., 2 * hidden: 3 * hidden])
    s = gates.sigmoid_() if in_place else torch.sigmoid(gates)  # g's quarter too: one kernel beats three slices
    c = torch.addcmul(s[..., hidden: 2 * hidden] * c, s[..., :hidden], g)
    t = torch.tanh(c)
    o = s[..., 3 * hidden:]
    return (t.mul_(o) if in_place else t * o), c


def lstm_supported(module: nn.Module) -> bool:
    """What `lstm` batches: refused ones (bidirectional, proj_size, dropout while training) stay
    rule gaps, so autotune does not offer `wide` for their stage (vmap has no rule for them either)."""
    return (module.mode == "LSTM" and not module.bidirectional and module.proj_size == 0
            and not (module.training and module.dropout))


def inplace_activation(module: nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The in-place form of an activation module (applied to a fresh GEMM output: no second
    [N, B, out] buffer, the data stays in cache), or None where there is none or it differs."""
    t = type(module)
    if t is nn.ReLU:
        return torch.relu_
    if t is nn.GELU:
        approximate = module.approximate
        return lambda y: torch._C._nn.gelu_(y, approximate=approximate)
    if t is nn.Tanh:
        return torch.tanh_
    if t is nn.Sigmoid:
        return torch.sigmoid_
    if t is nn.SiLU:
        return torch._C._nn.silu_
    if t is nn.LeakyReLU:
        slope = module.negative_slope
        return lambda y: torch._C._nn.leaky_relu_(y, slope)
    return None


MODULE_RULES: list[tuple[tuple[type, ...], ModuleRule]] = [
    ((nn.Linear,), linear_module),
    ((nn.Conv1d, nn.Conv2d), conv),
    ((nn.BatchNorm1d, nn.BatchNorm2d), batch_norm),
    ((nn.LayerNorm,), layer_norm),
    (POOLS, pool),
    ((nn.Flatten,), flatten_module),
    ((nn.GRU,), gru),
    ((nn.LSTM,), lstm),
    ((nn.MultiheadAttention,), multihead_attention),
    ((nn.TransformerEncoderLayer,), encoder_layer),
    ((nn.TransformerEncoder,), encoder),
    (ELEMENTWISE_MODULES + (nn.Softmax, nn.LogSoftmax), stateless),
    ((nn.Dropout,), lambda m, s, a, k, n: stateless(m, s, a, k, n) if not m.training else None),
]


# configurations a rule refuses whatever the inputs: module_rule gives None for them, so the node is a
# rule gap (wide_rule_gaps) and autotune does not offer `wide` for a stage vmap cannot run either
SUPPORTED: list[tuple[type, Callable[[nn.Module], bool]]] = [
    (nn.GRU, lambda m: not m.bidirectional and not (m.training and m.dropout)),
    (nn.LSTM, lambda m: lstm_supported(m)),
    (nn.MultiheadAttention, mha_supported),
    (nn.TransformerEncoderLayer, encoder_layer_supported),
    (nn.TransformerEncoder, encoder_supported),
]


def module_rule(module: nn.Module) -> Optional[ModuleRule]:
    """The wide rule for `module`, or None (no rule, or a configuration the rule refuses).

    None too where the module's call does more than its forward on its own parameters: hooks (the old
    weight_norm / spectral_norm) or a parametrization (nn.utils.parametrize: the weight is computed):
    vmap of the module's own call runs those."""
    if any(m._forward_hooks or m._forward_pre_hooks or parametrize.is_parametrized(m) for m in module.modules()):
        return None
    if any(isinstance(module, t) and not ok(module) for t, ok in SUPPORTED):
        return None
    for types, rule in MODULE_RULES:
        if isinstance(module, types):
            # a subclass with a forward of its own computes something else than the class the rule computes
            # (a Linear that adds a constant, an encoder layer with extra steps): no rule, vmap of its own call
            return rule if any(type(module).forward is t.forward for t in types) else None
    return None
