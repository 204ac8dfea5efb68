"""Wide rules for attention modules: nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder.

Input format: x [N, B, L, E] (batch_first) or [N, L, B, E], N-first like every wide value; member
parameters stacked [N, *param_shape]. The in-projection is one batched GEMM over the member axis
against the packed [N, E, 3E] weight for self-attention (two when only key is value, three for
separate q/k/v weights: column slices of one relaid weight, no copies); the members fold into the
batch axis of one scaled_dot_product_attention call ([N*B, heads, L, head_dim]); the out-projection
is one more batched GEMM. Masks (bool or float, 2-D/3-D attn_mask, key_padding_mask, shared or per
member) become one additive float mask, as torch.nn.functional.multi_head_attention_forward makes.
The encoder layer composes that with two batched Linears and per-member LayerNorm affines.

Refused (the rule returns None, the WideRunner falls back): unbatched encoder inputs, dropout while
training, add_bias_kv / add_zero_attn, activations other than ReLU/GELU/tanh/SiLU. is_causal=True without a
mask is plain attention where torch's fast path runs (which ignores the hint) and an ExecutionError elsewhere
(where torch raises). Where torch's
TransformerEncoder would run a key-padding-masked batch as a nested tensor (eval, no grad), its
output has zeros at the padded positions: mirrored (masked attention, then those positions zeroed).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.executor.strategies.wide_ops import NFirst, affine, gemm, is_nf, relaid
from stagewise.planner.errors import ExecutionError

FULLY_MASKED = ("a query row of nn.MultiheadAttention has every key masked out: torch answers NaN there on its fast "
                "path (eval, batch_first self-attention, bool masks) and 0 on its slow path, so a batched answer could "
                "differ from the member loop's; exclude this stage (it then runs as the loop) or keep at least one key "
                "unmasked per row")

CAUSAL_WITHOUT_MASK = ("nn.MultiheadAttention is called with is_causal=True and no attn_mask: torch raises 'Need attn_mask "
                       "if specifying the is_causal hint' here (only its inference fast path, batch_first self-attention "
                       "in eval without gradients, runs, and ignores the hint), so the member loop fails too; pass the "
                       "mask itself, attn_mask=nn.Transformer.generate_square_subsequent_mask(L), with is_causal=True")

MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal")
LAYER_ARGS = ("src", "src_mask", "src_key_padding_mask", "is_causal")
ENCODER_ARGS = ("src", "mask", "src_key_padding_mask", "is_causal")
ACTIVATION_FUNCTIONS = (F.relu, F.gelu, torch.relu, torch.tanh, F.silu)
ACTIVATION_MODULES = (nn.ReLU, nn.Tanh, nn.SiLU)


def _bind(names: tuple, args: tuple, kwargs: dict) -> Optional[dict]:
    """Arguments by name, or None for one the module does not take."""
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _sub(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _rank(x: Any) -> int:
    return x.rank if is_nf(x) else x.dim()


def _float_mask(mask: Any, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A bool mask (True = masked out) as additive float (-inf), as torch's _canonical_mask; [N, ...] or shared."""
    if mask is None:
        return None
    t = mask.t if is_nf(mask) else mask
    if t.dtype == torch.bool:
        t = torch.zeros_like(t, dtype=dtype).masked_fill_(t, float("-inf"))
    return t


# --- nn.MultiheadAttention ----------------------------------------------------------------

def mha_supported(module: nn.Module) -> bool:
    """add_bias_kv, add_zero_attn (rare) and attention dropout while training are refused."""
    return module.bias_k is None and not module.add_zero_attn and not (module.training and module.dropout > 0)


def multihead_attention(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """nn.MultiheadAttention of every member. Returns (out, weights or None) shaped like the module's
    output with the member axis first: out [N, B, L, E] (batch_first) or [N, L, B, E] ([N, L, E]
    unbatched); weights [N, B, L, S] averaged over heads, else [N, B, heads, L, S]."""
    bound = _bind(MHA_ARGS, args, kwargs)
    if bound is None or not mha_supported(module) or len(bound) < 3:
        return None
    q, k, v = bound["query"], bound["key"], bound["value"]
    rank = _rank(q)
    if rank not in (2, 3) or _rank(k) != rank or _rank(v) != rank:
        return None
    batch_first = module.batch_first and rank == 3
    kpm = bound.get("key_padding_mask")
    if rank == 2:  # unbatched: a batch of one, seq-first ([L, E] -> [L, 1, E]), as torch does
        if bound.get("is_causal") and bound.get("attn_mask") is None:
            raise ExecutionError(CAUSAL_WITHOUT_MASK)  # torch's fast path takes batched inputs only
        q, k, v = _unbatched(q, k, v)
        if kpm is not None:
            kpm = NFirst(kpm.t.unsqueeze(1)) if is_nf(kpm) else kpm.unsqueeze(0)
    out, weights = attention(module, state, q, k, v, n, batch_first, key_padding_mask=kpm,
                             attn_mask=bound.get("attn_mask"), need_weights=bound.get("need_weights", True),
                             average_weights=bound.get("average_attn_weights", True),
                             is_causal=bound.get("is_causal", False))
    if out is None:
        return None
    if rank == 2:
        out, weights = out.squeeze(2), (weights.squeeze(1) if weights is not None else None)
    return (NFirst(out), NFirst(weights) if weights is not None else None)


def _unbatched(*xs: Any) -> tuple:
    """[L, E] inputs (shared, or [N, L, E] batched) given a batch axis of one: [L, 1, E]."""
    same = {id(x): x for x in xs}
    lifted = {i: (NFirst(x.t.unsqueeze(2)) if is_nf(x) else x.unsqueeze(1)) for i, x in same.items()}
    return tuple(lifted[id(x)] for x in xs)  # keeps `query is key` identities


def attention(module: nn.Module, state: dict, query: Any, key: Any, value: Any, n: int, batch_first: bool, *,
              key_padding_mask: Any = None, attn_mask: Any = None, need_weights: bool = False,
              average_weights: bool = True, is_causal: bool = False,
              fully_masked_ok: bool = False) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Batched multi-head attention core: query/key/value NFirst [N, *, E] or shared [*, E] with * = (B, L)
    if batch_first else (L, B). Returns (out [N, *, E], weights [N, B, (heads,) L, S] or None), or
    (None, None) where it refuses (masks torch refuses). Raises ExecutionError for a fully masked row where
    torch's fast path (NaN) and slow path (0) disagree, unless `fully_masked_ok` (the encoder's nested-tensor
    mirror, where torch drops the padded positions), and for is_causal without a mask where torch raises (off
    its fast path; on it torch ignores the hint: plain attention here too)."""
    if is_causal and attn_mask is None:
        if not _fast_path_taken(module, state, query, key, value, batch_first, key_padding_mask):
            raise ExecutionError(CAUSAL_WITHOUT_MASK)
        is_causal = False
    dtype = (query.t if is_nf(query) else query).dtype
    masks = [m.t if is_nf(m) else m for m in (key_padding_mask, attn_mask) if m is not None]
    if any(m.dtype != torch.bool and m.dtype != dtype for m in masks):
        return None, None  # torch refuses such masks (integer, or another float dtype): let it say so
    fast = not fully_masked_ok and _fast_path_possible(module, state, query, key, value, batch_first, need_weights)
    if fast and any(bool((m if m.dtype == torch.bool else torch.isneginf(m)).all(dim=-1).any()) for m in masks):
        raise ExecutionError(FULLY_MASKED)
    e, heads = module.embed_dim, module.num_heads
    dh = e // heads
    b_dim, l_dim = (1, 2) if batch_first else (2, 1)  # of an N-first tensor
    qp, kp, vp = _in_projection(module, state, query, key, value, n)
    batch, tgt, src = qp.shape[b_dim], qp.shape[l_dim], kp.shape[l_dim]
    qh, kh, vh = (_heads(t, batch_first, heads) for t in (qp, kp, vp))  # [N*B, heads, L or S, dh]
    causal = is_causal and key_padding_mask is None and not need_weights  # torch's SDPA-is_causal case
    mask = None if causal else _merged_mask(attn_mask, key_padding_mask, n, batch, heads, tgt, src, qh.dtype)
    if fast and len(masks) > 1 and mask is not None and bool(torch.isneginf(mask).all(dim=-1).any()):
        raise ExecutionError(FULLY_MASKED)  # masked out by the two masks together (causal, and left padding)
    if need_weights:
        scores = torch.matmul(qh * math.sqrt(1.0 / dh), kh.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        o = torch.matmul(weights, vh)
        weights = weights.view(n, batch, heads, tgt, src)
        weights = weights.mean(dim=2) if average_weights else weights
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal)
        weights = None
    o = o.view(n, batch, heads, tgt, dh)
    o = o.permute(0, 1, 3, 2, 4) if batch_first else o.permute(0, 3, 1, 2, 4)
    o = o.reshape(n, *((batch, tgt) if batch_first else (tgt, batch)), e)
    out = gemm(NFirst(o), relaid(state["out_proj.weight"], "bmm"), _nf(state.get("out_proj.bias")), n)
    return out, weights


def _fast_path_taken(module: nn.Module, state: dict, query: Any, key: Any, value: Any, batch_first: bool,
                     key_padding_mask: Any) -> bool:
    """Whether torch's MultiheadAttention takes its fast path (torch._native_multi_head_attention) for a batched
    call, which ignores is_causal where no attn_mask is given; off it, torch raises for such a call. The same
    conditions as MultiheadAttention.forward, the stacked `state` standing for the module's own tensors."""
    tensors = [x.t if is_nf(x) else x for x in (query, key, value)] + [
        state.get(k) for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")]
    kpm = key_padding_mask.t if is_nf(key_padding_mask) else key_padding_mask
    dtype = tensors[0].dtype
    return (_fast_path_form(module, query, key, value, batch_first)
            and tensors[3] is not None and tensors[4] is not None and tensors[3].dtype == tensors[4].dtype == dtype
            and (kpm is None or not torch.is_floating_point(kpm))
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)))


def _fast_path_possible(module: nn.Module, state: dict, query: Any, key: Any, value: Any, batch_first: bool,
                        need_weights: bool) -> bool:
    """Whether torch's own MultiheadAttention could take its fast path here (a superset of its conditions, without
    the data-dependent ones): where it can, a fully masked row is NaN in the loop, and 0 in the batched kernels.
    Not while gradients are recorded through it (torch then takes its slow path: finite answers)."""
    return not need_weights and _fast_path_form(module, query, key, value, batch_first) and not _records_grad(state, query)


def _records_grad(state: dict, *xs: Any) -> bool:
    """Whether a call records gradients through `state` or the inputs `xs` (torch's fast paths then stand aside)."""
    tensors = [x.t if is_nf(x) else x for x in xs] + list(state.values())
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _fast_path_form(module: nn.Module, query: Any, key: Any, value: Any, batch_first: bool) -> bool:
    """The fast-path conditions of MultiheadAttention.forward that depend on the module, the flags and the form of
    the call alone (self-attention, batch first), not on the tensors' dtypes or gradients."""
    return (torch.backends.mha.get_fastpath_enabled() and not torch.is_autocast_enabled() and not module.training
            and batch_first and query is key and key is value and module.num_heads % 2 == 0
            and module._qkv_same_embed_dim and module.bias_k is None and module.bias_v is None and not module.add_zero_attn)


def _nf(t: Optional[torch.Tensor]) -> Optional[NFirst]:
    return NFirst(t) if t is not None else None


def _in_projection(module: nn.Module, state: dict, query: Any, key: Any, value: Any, n: int) -> tuple:
    """q, k, v as [N, *, E]: one GEMM for self-attention, as torch's _in_projection_packed splits it."""
    e = module.embed_dim
    b = state.get("in_proj_bias")  # [N, 3E] or None
    bias = lambda lo, hi: NFirst(b[:, lo:hi]) if b is not None else None  # noqa: E731
    if not module._qkv_same_embed_dim:
        return tuple(gemm(x, relaid(state[f"{name}_proj_weight"], "bmm"), bias(i * e, (i + 1) * e), n)
                     for i, (name, x) in enumerate((("q", query), ("k", key), ("v", value))))
    wt = relaid(state["in_proj_weight"], "bmm")  # [N, E, 3E]: column slices below are views
    if key is value and query is key:
        return gemm(query, wt, _nf(b), n).split(e, dim=-1)
    q = gemm(query, wt[..., :e], bias(0, e), n)
    if key is value:
        return (q, *gemm(key, wt[..., e:], bias(e, 3 * e), n).split(e, dim=-1))
    return q, gemm(key, wt[..., e: 2 * e], bias(e, 2 * e), n), gemm(value, wt[..., 2 * e:], bias(2 * e, 3 * e), n)


def _heads(t: torch.Tensor, batch_first: bool, heads: int) -> torch.Tensor:
    """[N, B, L, E] (batch_first) or [N, L, B, E] -> [N*B, heads, L, E/heads] (members folded into the batch)."""
    if not batch_first:
        t = t.transpose(1, 2)
    n, b, length, e = t.shape
    return t.reshape(n, b, length, heads, e // heads).transpose(2, 3).reshape(n * b, heads, length, e // heads)


def _merged_mask(attn_mask: Any, key_padding_mask: Any, n: int, batch: int, heads: int, tgt: int, src: int,
                 dtype: torch.dtype) -> Optional[torch.Tensor]:
    """attn_mask ([L, S] or [B*heads, L, S]) + key_padding_mask ([B, S]), each shared or per member,
    as one additive float mask for SDPA on [N*B, heads, L, S]: [1, 1, L, S] when it is the same for
    every member and batch row, else [N*B, heads or 1, L, S]."""
    parts = []
    am = _float_mask(attn_mask, dtype)
    if am is not None:
        lead = n if is_nf(attn_mask) else 1
        parts.append(am.reshape(lead, 1, 1, tgt, src) if _rank(attn_mask) == 2 else am.reshape(lead, batch, heads, tgt, src))
    kpm = _float_mask(key_padding_mask, dtype)
    if kpm is not None:
        parts.append(kpm.reshape(n if is_nf(key_padding_mask) else 1, batch, 1, 1, src))
    if not parts:
        return None
    mask = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    if mask.shape[0] == 1 and mask.shape[1] == 1:
        return mask[0]
    return mask.expand(n, batch, *mask.shape[2:]).reshape(n * batch, *mask.shape[2:])


# --- nn.TransformerEncoderLayer / nn.TransformerEncoder ----------------------------------------

def _activation_ok(act: Any) -> bool:
    if isinstance(act, nn.GELU):
        return act.approximate == "none"  # torch's fast path runs exact GELU for any nn.GELU: refuse the other
    return isinstance(act, ACTIVATION_MODULES) or any(act is f for f in ACTIVATION_FUNCTIONS)


def encoder_layer_supported(module: nn.Module) -> bool:
    """Dropout while training (a random stream per member), unusual activations, and parts of other classes than
    the ones this rule computes (an RMSNorm, a Linear subclass) are refused."""
    dropping = module.training and any(m.p > 0 for m in (module.dropout, module.dropout1, module.dropout2))
    parts = (type(module.norm1) is nn.LayerNorm and type(module.norm2) is nn.LayerNorm
             and type(module.linear1) is nn.Linear and type(module.linear2) is nn.Linear
             and type(module.self_attn) is nn.MultiheadAttention)
    return parts and not dropping and mha_supported(module.self_attn) and _activation_ok(module.activation)


def encoder_supported(module: nn.Module) -> bool:
    """Every layer a supported nn.TransformerEncoderLayer, and the final norm, if any, a LayerNorm."""
    return (module.norm is None or type(module.norm) is nn.LayerNorm) and all(
        type(layer) is nn.TransformerEncoderLayer and encoder_layer_supported(layer) for layer in module.layers)


def encoder_layer(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """nn.TransformerEncoderLayer of every member: x [N, B, L, E] (batch_first) or [N, L, B, E] -> same shape."""
    bound = _bind(LAYER_ARGS, args, kwargs)
    if bound is None or not bound or not encoder_layer_supported(module) or _rank(bound["src"]) != 3:
        return None
    out = _layer(module, state, bound["src"], bound.get("src_mask"), bound.get("src_key_padding_mask"),
                 bool(bound.get("is_causal")), n)
    return NFirst(out) if out is not None else None


def encoder(module: nn.Module, state: dict, args: tuple, kwargs: dict, n: int) -> Any:
    """nn.TransformerEncoder of every member: its layers one after another (each batched), then its norm."""
    bound = _bind(ENCODER_ARGS, args, kwargs)
    if bound is None or not bound or not encoder_supported(module) or _rank(bound["src"]) != 3:
        return None
    kpm, mask, x = bound.get("src_key_padding_mask"), bound.get("mask"), bound["src"]
    nested = _runs_nested(module, state, x, mask, kpm)
    if nested is None:
        return None
    is_causal = _detect_causal(mask, bound.get("is_causal"), _member_shape(x)[1 if module.layers[0].self_attn.batch_first else 0])
    if is_causal is None:
        return None
    for i, layer in enumerate(module.layers):
        y = _layer(layer, _sub(state, f"layers.{i}."), x, mask, kpm, is_causal, n, fully_masked_ok=nested)
        if y is None:
            return None
        x = NFirst(y)
    out = x.t
    if nested:  # torch's nested-tensor run leaves zeros where the keys were padded, then its final norm runs on them
        padded = _float_mask(kpm, out.dtype) != 0
        out = out.masked_fill(padded.reshape(padded.shape[0] if is_nf(kpm) else 1, *padded.shape[-2:], 1), 0.0)
    return NFirst(_norm(module.norm, _sub(state, "norm."), NFirst(out)) if module.norm is not None else out)


def _runs_nested(module: nn.Module, state: dict, x: Any, mask: Any, kpm: Any) -> Optional[bool]:
    """Whether torch's TransformerEncoder would run these inputs as a nested tensor (its 'sparsity
    fast path': a key padding mask, eval, no grad, ...), which zeroes the padded positions of the
    output; None where members differ (a per-member mask left-aligned for some only)."""
    first = module.layers[0]
    if (kpm is None or mask is not None or not getattr(module, "use_nested_tensor", False) or first.training
            or not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled()
            or (getattr(module, "mask_check", True) and torch.compiler.is_compiling())):
        return False
    tensors = [x.t if is_nf(x) else x] + list(_sub(state, "layers.0.").values())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if not getattr(module, "mask_check", True):
        return True
    keep = (_float_mask(kpm, torch.float32) == 0)
    keeps = list(keep) if is_nf(kpm) else [keep]
    src = (x.t[0] if is_nf(x) else x)
    aligned = [bool(torch._nested_tensor_from_mask_left_aligned(src, k)) for k in keeps]
    return aligned[0] if all(a == aligned[0] for a in aligned) else None


def _member_shape(x: Any) -> torch.Size:
    return x.t.shape[1:] if is_nf(x) else x.shape


def _detect_causal(mask: Any, is_causal: Optional[bool], length: int) -> Optional[bool]:
    """torch's _detect_is_causal_mask for every member: a causal hint when the mask is the square
    subsequent mask; None where members disagree (a per-member mask, causal for some only)."""
    if is_causal is not None or mask is None:
        return bool(is_causal)
    m = _float_mask(mask, torch.float32)
    if m.shape[-2:] != (length, length) or _rank(mask) != 2:
        return False
    causal = nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float32, device=m.device)
    same = (m == causal).flatten(-2).all(dim=-1)  # one verdict per member ([] for a shared mask)
    if bool(same.all()):
        return True
    return False if not bool(same.any()) else None


def _norm(module: nn.LayerNorm, state: dict, x: Any) -> torch.Tensor:
    """LayerNorm with per-member affine: [N, ..., E] (a shared x gets its member axis here)."""
    shape = list(module.normalized_shape)
    y = F.layer_norm(x.t if is_nf(x) else x, shape, None, None, module.eps)
    y = y if is_nf(x) else y.unsqueeze(0)
    return affine(y, _nf(state.get("weight")), _nf(state.get("bias")), len(shape))


def _encoder_fast_path(module: nn.Module, state: dict, x: Any) -> bool:
    """Whether torch's TransformerEncoderLayer.forward takes its fused fast path (torch._transformer_encoder_layer_fwd)
    for this call: the conditions of its forward that depend on the module, the flags and the call's form."""
    attn = module.self_attn
    return (torch.backends.mha.get_fastpath_enabled() and not module.training and _rank(x) == 3 and attn.batch_first
            and attn.in_proj_bias is not None and attn._qkv_same_embed_dim and module.activation_relu_or_gelu
            and module.norm1.eps == module.norm2.eps and attn.num_heads % 2 == 0 and not torch.is_autocast_enabled()
            and not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
            and not _records_grad(state, x))


def _as_bool(mask: Any) -> Any:
    """A float mask as torch's fused encoder layer reads it (nonzero = masked out); other masks as they are."""
    if mask is None:
        return None
    t = mask.t if is_nf(mask) else mask
    if not t.is_floating_point():
        return mask
    return NFirst(t != 0) if is_nf(mask) else t != 0


def _layer(module: nn.Module, state: dict, x: Any, mask: Any, kpm: Any, is_causal: bool, n: int,
           fully_masked_ok: bool = False) -> Optional[torch.Tensor]:
    """One encoder layer on NFirst or shared x; returns [N, *, E] (None where attention refuses)."""
    batch_first = module.self_attn.batch_first
    activation = module.activation
    if _encoder_fast_path(module, state, x):
        # torch's fused encoder layer reads a float mask as bool (any nonzero value masks the key out, an additive bias
        # too), ignores the is_causal hint (the mask alone counts), and picks ReLU or GELU by the flag its constructor
        # set (an activation assigned later is not read): as it does, so that a fully masked row is refused as for a
        # bool mask
        mask, kpm = (_as_bool(m) for m in (mask, kpm))
        is_causal = False
        activation = F.gelu if module.activation_relu_or_gelu == 2 else F.relu
    attn_state = _sub(state, "self_attn.")

    def sa(y: Any) -> Optional[torch.Tensor]:
        return attention(module.self_attn, attn_state, y, y, y, n, batch_first, key_padding_mask=kpm,
                         attn_mask=mask, is_causal=is_causal, fully_masked_ok=fully_masked_ok)[0]

    def ff(y: torch.Tensor) -> torch.Tensor:
        h = activation(gemm(NFirst(y), relaid(state["linear1.weight"], "bmm"), _nf(state.get("linear1.bias")), n))
        return gemm(NFirst(h), relaid(state["linear2.weight"], "bmm"), _nf(state.get("linear2.bias")), n)

    norm1 = lambda y: _norm(module.norm1, _sub(state, "norm1."), y)  # noqa: E731
    norm2 = lambda y: _norm(module.norm2, _sub(state, "norm2."), y)  # noqa: E731
    if module.norm_first:
        a = sa(NFirst(norm1(x)))
        if a is None:
            return None
        h = a + (x.t if is_nf(x) else x)
        return h + ff(norm2(NFirst(h)))
    a = sa(x)
    if a is None:
        return None
    h = norm1(NFirst(a + (x.t if is_nf(x) else x)))
    return norm2(NFirst(h + ff(h)))
