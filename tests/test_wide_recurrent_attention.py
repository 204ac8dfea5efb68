"""Wide rules for nn.LSTM, nn.MultiheadAttention, nn.TransformerEncoderLayer and nn.TransformerEncoder
against the plain member loop (float32, rtol 1e-5 / atol 1e-6), on two calls and two input shapes,
shared and per-member inputs; refused configurations are refused; whole models through the planner."""
from __future__ import annotations

import itertools
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError
from stagewise.executor.autotune import candidate_strategies, tune
from stagewise.executor.strategies import WideRunner, wide_rule_gaps
from stagewise.executor.strategies.wide_attention import encoder, encoder_layer, multihead_attention
from stagewise.executor.strategies.wide_layers import lstm, module_rule
from stagewise.executor.strategies.wide_ops import NFirst, is_nf
from stagewise.planner.plan import StageMode, StageOptions, Strategy

RTOL, ATOL = 1e-5, 1e-6
B, H_IN, HID = 2, 5, 7
E, HEADS = 8, 2


@pytest.fixture(autouse=True)
def seeded():
    """The same random inputs and masks every run."""
    torch.manual_seed(0)


def stacked(mods: list) -> dict:
    """The members' state stacked [N, ...], as BatchedModule holds it."""
    states = [m.state_dict() for m in mods]
    return {k: torch.stack([s[k] for s in states]) for k in states[0]}


def member_view(tree, i: int):
    """Member i's arguments: NFirst values sliced (one slice per NFirst, so `query is key` survives)."""
    cache: dict = {}
    return tree_map(lambda a: cache.setdefault(id(a), a.t[i]) if is_nf(a) else a, tree, is_leaf=is_nf)


def nfirst(tree):
    return tree_map(lambda a: a.t if is_nf(a) else a, tree, is_leaf=is_nf)


def stack_members(outs: list):
    if outs[0] is None:
        return None
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs)
    return tuple(stack_members([o[j] for o in outs]) for j in range(len(outs[0])))


def check_rule(rule, mods: list, arg_sets: list) -> None:
    """rule(stacked state, args) == the member loop, two calls per argument set ((args, kwargs) each)."""
    n, state = len(mods), stacked(mods)
    with torch.no_grad():
        for args, kwargs in arg_sets:
            for _ in range(2):
                got = rule(mods[0], state, args, kwargs, n)
                assert got is not None, "the rule refused a supported case"
                want = stack_members([m(*member_view(args, i), **member_view(kwargs, i)) for i, m in enumerate(mods)])
                torch.testing.assert_close(nfirst(got), want, rtol=RTOL, atol=ATOL)


def value(t: torch.Tensor, n: int, shared: bool):
    """A shared value (plain tensor, no member axis) or a per-member one (NFirst [N, ...])."""
    return t if shared else NFirst(torch.stack([t] + [torch.randn_like(t) if t.is_floating_point() else t for _ in range(n - 1)]))


def members(make, n: int) -> list:
    torch.manual_seed(0)
    return [make().eval() for _ in range(n)]


# --- nn.LSTM ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, shared", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("batch_first, layers, bias", list(itertools.product([True, False], [1, 2], [True, False])))
@pytest.mark.parametrize("hx", [None, "shared", "member"])
def test_lstm_matches_the_loop(n, shared, batch_first, layers, bias, hx):
    mods = members(lambda: nn.LSTM(H_IN, HID, num_layers=layers, batch_first=batch_first, bias=bias), n)
    sets = []
    for b, t in ((B, 4), (3, 6)):  # a second input shape: nothing baked in
        x = value(torch.randn(*((b, t) if batch_first else (t, b)), H_IN), n, shared)
        args = (x,)
        if hx is not None:
            args += ((value(torch.randn(layers, b, HID), n, hx == "shared"), value(torch.randn(layers, b, HID), n, hx == "shared")),)
        sets.append((args, {}))
    check_rule(lstm, mods, sets)


@pytest.mark.parametrize("shared", [True, False])
def test_lstm_unbatched_input_and_hx_keyword(shared):
    mods = members(lambda: nn.LSTM(H_IN, HID, num_layers=2), 3)
    sets = [((value(torch.randn(t, H_IN), 3, shared),), {"hx": (value(torch.randn(2, HID), 3, shared), value(torch.randn(2, HID), 3, False))})
            for t in (4, 6)]
    check_rule(lstm, mods, sets)


# --- nn.MultiheadAttention ------------------------------------------------------------------

def mha_inputs(n: int, shared: bool, batch_first: bool, qkv: str, kdim: int, b: int, tgt: int, src: int) -> tuple:
    """(query, key, value): self-attention (one value), key is value, or three different values."""
    def seq(length, dim):
        return value(torch.randn(*((b, length) if batch_first else (length, b)), dim), n, shared)

    q = seq(tgt, E)
    if qkv == "self":
        return q, q, q
    k = seq(src, kdim)
    return (q, k, k) if qkv == "kv" else (q, k, seq(src, kdim))


@pytest.mark.parametrize("n, shared", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("qkv, kdim", [("self", E), ("kv", E), ("separate", E), ("kv", 6), ("separate", 6)])
@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_matches_the_loop(n, shared, batch_first, qkv, kdim, need_weights, average, bias):
    mods = members(lambda: nn.MultiheadAttention(E, HEADS, bias=bias, kdim=kdim, vdim=kdim, batch_first=batch_first), n)
    assert mods[0]._qkv_same_embed_dim == (kdim == E)
    kwargs = {"need_weights": need_weights, "average_attn_weights": average}
    sets = [(mha_inputs(n, shared, batch_first, qkv, kdim, b, tgt, tgt if qkv == "self" else tgt + 1), kwargs)
            for b, tgt in ((B, 4), (3, 5))]
    check_rule(multihead_attention, mods, sets)


def padding_mask(b: int, s: int, dtype=torch.bool) -> torch.Tensor:
    """True (or -inf) = padded; the first key is never padded, so no row is fully masked."""
    m = torch.rand(b, s) > 0.6
    m[:, 0] = False
    return m if dtype == torch.bool else torch.zeros(b, s).masked_fill(m, float("-inf"))


def attn_mask(shape: tuple, dtype=torch.bool) -> torch.Tensor:
    m = torch.rand(*shape) > 0.7
    m[..., 0] = False
    return m if dtype == torch.bool else torch.randn(*shape).masked_fill(m, float("-inf"))


MASKS = ["key_padding", "key_padding_float", "attn_2d", "attn_2d_float", "attn_3d", "both", "key_padding_member",
         "attn_3d_member", "causal"]


def mask_kwargs(kind: str, n: int, b: int, length: int) -> dict:
    """Keyword arguments of nn.MultiheadAttention for one mask kind (self-attention, L = S = length)."""
    if kind == "key_padding":
        return {"key_padding_mask": padding_mask(b, length)}
    if kind == "key_padding_float":
        return {"key_padding_mask": padding_mask(b, length, torch.float32)}
    if kind == "attn_2d":
        return {"attn_mask": attn_mask((length, length))}
    if kind == "attn_2d_float":
        return {"attn_mask": attn_mask((length, length), torch.float32)}
    if kind == "attn_3d":
        return {"attn_mask": attn_mask((b * HEADS, length, length), torch.float32)}
    if kind == "both":
        return {"attn_mask": attn_mask((length, length)), "key_padding_mask": padding_mask(b, length)}
    if kind == "key_padding_member":
        return {"key_padding_mask": NFirst(torch.stack([padding_mask(b, length) for _ in range(n)]))}
    if kind == "attn_3d_member":
        return {"attn_mask": NFirst(torch.stack([attn_mask((b * HEADS, length, length), torch.float32) for _ in range(n)]))}
    assert kind == "causal"
    return {"attn_mask": nn.Transformer.generate_square_subsequent_mask(length), "is_causal": True}


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kind", MASKS)
def test_multihead_attention_masks_match_the_loop(shared, batch_first, need_weights, kind):
    n = 3
    mods = members(lambda: nn.MultiheadAttention(E, HEADS, batch_first=batch_first), n)
    sets = []
    for b, length in ((B, 4), (3, 6)):
        x = mha_inputs(n, shared, batch_first, "self", E, b, length, length)
        sets.append((x, {"need_weights": need_weights, **mask_kwargs(kind, n, b, length)}))
    check_rule(multihead_attention, mods, sets)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("qkv", ["self", "separate"])
def test_multihead_attention_unbatched(shared, qkv):
    mods = members(lambda: nn.MultiheadAttention(E, HEADS, batch_first=True), 3)
    sets = []
    for length in (4, 6):
        q = value(torch.randn(length, E), 3, shared)
        qkv_args = (q, q, q) if qkv == "self" else (q, value(torch.randn(length + 1, E), 3, shared), value(torch.randn(length + 1, E), 3, shared))
        kpm = torch.zeros(length + (qkv != "self"), dtype=torch.bool)
        kpm[-1] = True
        sets.append((qkv_args, {"key_padding_mask": kpm}))
    check_rule(multihead_attention, mods, sets)


# --- nn.TransformerEncoderLayer / nn.TransformerEncoder ------------------------------------

def encoder_inputs(n: int, shared: bool, batch_first: bool, b: int, length: int):
    return value(torch.randn(*((b, length) if batch_first else (length, b)), E), n, shared)


LAYER_MASKS = [None, "src_mask", "key_padding", "both", "causal"]


def layer_mask_kwargs(kind, b: int, length: int, names=("src_mask", "src_key_padding_mask")) -> dict:
    if kind is None:
        return {}
    if kind == "causal":
        return {names[0]: nn.Transformer.generate_square_subsequent_mask(length), "is_causal": True}
    out = {}
    if kind in ("src_mask", "both"):
        out[names[0]] = attn_mask((length, length))
    if kind in ("key_padding", "both"):
        out[names[1]] = padding_mask(b, length)
    return out


@pytest.mark.parametrize("n, shared", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_module"])
def test_encoder_layer_matches_the_loop(n, shared, batch_first, norm_first, activation):
    act = nn.GELU() if activation == "gelu_module" else activation
    mods = members(lambda: nn.TransformerEncoderLayer(E, HEADS, 16, activation=act, batch_first=batch_first,
                                                      norm_first=norm_first), n)
    sets = [((encoder_inputs(n, shared, batch_first, b, length),), {}) for b, length in ((B, 4), (3, 6))]
    check_rule(encoder_layer, mods, sets)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", LAYER_MASKS[1:])
def test_encoder_layer_masks_match_the_loop(shared, batch_first, kind):
    mods = members(lambda: nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=batch_first), 3)
    sets = [((encoder_inputs(3, shared, batch_first, b, length),), layer_mask_kwargs(kind, b, length)) for b, length in ((B, 4), (3, 6))]
    check_rule(encoder_layer, mods, sets)


@pytest.mark.parametrize("n, shared", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("final_norm", [True, False])
@pytest.mark.parametrize("kind", [None, "src_mask", "key_padding", "causal", "causal_detected"])
def test_encoder_matches_the_loop(n, shared, batch_first, final_norm, kind):
    def make():
        layer = nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=batch_first)
        return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E) if final_norm else None, enable_nested_tensor=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor with batch_first=False
        mods = members(make, n)
    sets = []
    for b, length in ((B, 4), (3, 6)):
        if kind == "causal_detected":  # torch detects a causal mask given without the hint
            kwargs = {"mask": nn.Transformer.generate_square_subsequent_mask(length)}
        else:
            kwargs = layer_mask_kwargs(kind, b, length, names=("mask", "src_key_padding_mask"))
        sets.append(((encoder_inputs(n, shared, batch_first, b, length),), kwargs))
    check_rule(encoder, mods, sets)


def left_aligned_padding(b: int, s: int) -> torch.Tensor:
    """Padding at the end of each row (lengths s, s-1, ...): what torch's nested-tensor path takes."""
    return torch.arange(s).expand(b, s) >= torch.arange(s, s - b, -1).clamp_min(1).unsqueeze(1)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("kind", ["left_aligned", "left_aligned_member", "scattered"])
def test_encoder_nested_tensor_path_matches_the_loop(shared, kind):
    """With a key padding mask torch's encoder runs a nested tensor (eval, no grad) and returns zeros
    at the padded positions where the mask is left-aligned; the rule mirrors both outcomes."""
    mods = members(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True), 2,
                                                 norm=nn.LayerNorm(E)), 3)
    assert mods[0].use_nested_tensor
    sets = []
    for b, length in ((B, 4), (3, 6)):
        if kind == "left_aligned":
            kpm = left_aligned_padding(b, length)
        elif kind == "left_aligned_member":
            kpm = NFirst(torch.stack([left_aligned_padding(b, length).roll(i, 0) for i in range(3)]))
        else:
            kpm = padding_mask(b, length)
            kpm[0, -1], kpm[0, 1] = False, True  # padding before a real token in row 0: not left-aligned
        sets.append(((encoder_inputs(3, shared, True, b, length),), {"src_key_padding_mask": kpm}))
    check_rule(encoder, mods, sets)
    (x,), kwargs = member_view(sets[0], 0)
    with torch.no_grad():
        zeros = mods[0](x, **kwargs)[kwargs["src_key_padding_mask"]] == 0
    assert bool(zeros.all()) == (kind != "scattered")  # the nested path did run (or did not)


@pytest.mark.parametrize("name", ["lstm", "encoder layer"])
def test_rules_carry_gradients_like_the_loop(name):
    """Training through a wide stage: gradients of the stacked state equal each member's own."""
    if name == "lstm":
        make, rule, x = (lambda: nn.LSTM(H_IN, HID, num_layers=2, batch_first=True)), lstm, torch.randn(3, B, 4, H_IN)
    else:
        make, rule, x = (lambda: nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True)), encoder_layer, torch.randn(3, B, 4, E)
    mods = members(make, 3)
    for m in mods:
        m.train()
    state = {k: v.detach().requires_grad_() for k, v in stacked(mods).items()}
    out = rule(mods[0], state, (NFirst(x),), {}, 3)
    ((out[0] if isinstance(out, tuple) else out).t ** 2).sum().backward()
    for i, m in enumerate(mods):
        y = m(x[i])
        ((y[0] if isinstance(y, tuple) else y) ** 2).sum().backward()
        for k, p in m.named_parameters():
            torch.testing.assert_close(state[k].grad[i], p.grad, rtol=1e-4, atol=1e-5)


# --- refusals ---------------------------------------------------------------------------------

REFUSED = {
    "bidirectional LSTM": lambda: nn.LSTM(H_IN, HID, bidirectional=True),
    "LSTM proj_size": lambda: nn.LSTM(H_IN, HID, proj_size=3),
    "LSTM dropout while training": lambda: nn.LSTM(H_IN, HID, num_layers=2, dropout=0.5).train(),
    "bidirectional GRU": lambda: nn.GRU(H_IN, HID, bidirectional=True),
    "MHA add_bias_kv": lambda: nn.MultiheadAttention(E, HEADS, add_bias_kv=True),
    "MHA add_zero_attn": lambda: nn.MultiheadAttention(E, HEADS, add_zero_attn=True),
    "MHA dropout while training": lambda: nn.MultiheadAttention(E, HEADS, dropout=0.1).train(),
    "layer dropout while training": lambda: nn.TransformerEncoderLayer(E, HEADS, 16).train(),
    "layer tanh-GELU": lambda: nn.TransformerEncoderLayer(E, HEADS, 16, activation=nn.GELU(approximate="tanh")),
    "layer custom activation": lambda: nn.TransformerEncoderLayer(E, HEADS, 16, activation=lambda x: x * 2),
    "encoder of a refused layer": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, HEADS, 16, activation=lambda x: x * 2), 2, enable_nested_tensor=False),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_configurations_have_no_rule(name):
    """A configuration no rule batches is a rule gap: autotune then does not offer `wide` for it."""
    assert module_rule(REFUSED[name]()) is None


def test_supported_configurations_have_a_rule():
    for mod in (nn.LSTM(H_IN, HID, num_layers=2, dropout=0.5).eval(), nn.LSTM(H_IN, HID, bias=False),
                nn.MultiheadAttention(E, HEADS, dropout=0.1).eval(), nn.MultiheadAttention(E, HEADS, bias=False, kdim=6, vdim=5),
                nn.TransformerEncoderLayer(E, HEADS, 16).eval(), nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0).train()):
        assert module_rule(mod) is not None, mod


def test_rules_refuse_inputs_they_do_not_mirror():
    """Inputs a rule would get wrong give None (the runner falls back), never a quiet answer."""
    x = NFirst(torch.randn(3, B, 4, E))
    layer = nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True).eval()
    state = stacked([layer] * 3)
    assert encoder_layer(layer, state, (NFirst(torch.randn(3, 4, E)),), {}, 3) is None  # unbatched
    mha = nn.MultiheadAttention(E, HEADS, batch_first=False).eval()  # off torch's fast path, torch raises: so does wide
    xs = NFirst(torch.randn(3, 4, B, E))
    with pytest.raises(ExecutionError, match="is_causal=True and no attn_mask"):
        multihead_attention(mha, stacked([mha] * 3), (xs, xs, xs), {"is_causal": True}, 3)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True).eval()
    assert multihead_attention(mha, stacked([mha] * 3), (x, x, x), {"no_such_arg": 1}, 3) is None
    rnn = nn.LSTM(H_IN, HID)
    assert lstm(rnn, stacked([rnn] * 3), (NFirst(torch.randn(3, 4, B, H_IN)),), {"other": 1}, 3) is None
    nested = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True), 2).eval()
    scattered = torch.tensor([[False, True, False, False], [False, False, False, True]])  # padding before a token
    kpm = NFirst(torch.stack([left_aligned_padding(B, 4), scattered, left_aligned_padding(B, 4)]))
    # torch runs member 0 and 2 as nested tensors (zeros where padded), member 1 not: members differ
    assert encoder(nested, stacked([nested] * 3), (x,), {"src_key_padding_mask": kpm}, 3) is None


# --- whole models through the planner --------------------------------------------------------

class EncoderModel(nn.Module):
    """Linear -> TransformerEncoder (2 layers) -> Linear; the encoder is one leaf call_module."""

    def __init__(self, norm_first: bool = False):
        super().__init__()
        self.inp = nn.Linear(6, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(E, 3)

    def forward(self, x):
        return self.out(self.enc(self.inp(x)))


class LSTMModel(nn.Module):
    def __init__(self, bidirectional: bool = False):
        super().__init__()
        self.lstm = nn.LSTM(6, HID, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.out = nn.Linear(HID * (2 if bidirectional else 1), 3)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        return self.out(y[:, -1]) + h[-1].sum(-1, keepdim=True) + c[-1].mean(-1, keepdim=True)


N = 3
MODELS = {"encoder": EncoderModel, "encoder norm_first": lambda: EncoderModel(norm_first=True), "lstm": LSTMModel}


def plan_for(make, input_mode: str):
    model_members = members(make, N)
    x = torch.randn(B, 5, 6)
    graph = planner.trace(model_members[0], (x,))
    plan = planner.propose(graph, N, input_mode)
    inputs = (x,) if input_mode == "shared" else (torch.randn(N, B, 5, 6),)
    more = ((torch.randn(3, 7, 6),) if input_mode == "shared" else (torch.randn(N, 3, 7, 6),),)
    return model_members, graph, plan, inputs, more


@pytest.mark.parametrize("input_mode", ["shared", "per_member"])
@pytest.mark.parametrize("name", list(MODELS))
def test_wide_runs_the_stage_vmap_cannot(name, input_mode):
    """The stage holding the leaf module is excluded (vmap has no rule or only its slow fallback); wide is
    a candidate for it, has no rule gaps, and the plan with wide everywhere matches the loop."""
    model_members, graph, plan, inputs, more = plan_for(MODELS[name], input_mode)
    excluded = [s for s in plan.stages if s.mode is StageMode.EXCLUDED]
    assert excluded
    wide = plan.with_stages([replace(s, options=StageOptions(strategy=Strategy.WIDE)) for s in plan.stages])
    module = executor.build(wide, model_members)
    for program, runner in zip(module.programs, module.runners):
        assert isinstance(runner, WideRunner) and wide_rule_gaps(program) == []
        if program.stage.mode is StageMode.EXCLUDED:
            assert Strategy.WIDE in candidate_strategies(program, torch.device("cpu"))
    report = executor.verify(wide, model_members, inputs, more_inputs=more)
    assert report.ok, report.to_text()


@pytest.mark.parametrize("name", ["encoder", "lstm"])
def test_autotune_tries_wide_and_the_result_matches_the_loop(name):
    model_members, graph, plan, inputs, more = plan_for(MODELS[name], "shared")
    tuned, found = tune(plan, model_members, inputs, strategies=["vmap", "wide", "loop"], repeats=3)
    excluded = next(s for s in plan.stages if s.mode is StageMode.EXCLUDED)
    results = found.get(f"per-stage {excluded.id}") or found[excluded.id]  # the former where a merged stage won
    assert {r.strategy for r in results if r.ok} >= {"wide", "loop"}  # chosen by time: never asserted here
    report = executor.verify(tuned, model_members, inputs, more_inputs=more)
    assert report.ok, report.to_text()


def test_refused_module_stage_runs_as_the_loop():
    """A bidirectional LSTM has no rule: wide is no candidate, and autotune keeps the correct loop."""
    model_members, graph, plan, inputs, more = plan_for(lambda: LSTMModel(bidirectional=True), "shared")
    stage = next(s for s in plan.stages if s.mode is StageMode.EXCLUDED)
    module = executor.build(plan.with_stages([replace(s, options=StageOptions(strategy=Strategy.WIDE)) if s is stage else s
                                              for s in plan.stages]), model_members)
    program = next(p for p in module.programs if p.stage.id == stage.id)
    assert wide_rule_gaps(program) == ["lstm"]
    assert Strategy.WIDE not in candidate_strategies(program, torch.device("cpu"))
    tuned = executor.autotune(plan, model_members, inputs, strategies=["vmap", "wide", "loop"], repeats=3)
    assert tuned.stage(stage.id).options.strategy is Strategy.LOOP if len(tuned.stages) > 1 else True
    report = executor.verify(tuned, model_members, inputs, more_inputs=more)
    assert report.ok, report.to_text()


class _EncoderWithMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
        self.fc = nn.Linear(16, 2)

    def forward(self, x, mask):
        return self.fc(self.enc(x, mask))


def test_an_encoder_layer_reads_a_float_mask_as_torchs_fused_path_does():
    """Was: a fully -inf row and an additive bias came back finite where the loop (torch's fused encoder layer, which
    reads a float mask as bool: nonzero masks the key out) gives NaN or other numbers."""
    torch.manual_seed(0)
    members = [_EncoderWithMask().eval() for _ in range(3)]
    x = torch.randn(3, 6, 16)
    ens = executor.build(planner.propose(planner.trace(members[0], (x, torch.zeros(6, 6))), 3), members)
    finfo = torch.full((6, 6), torch.finfo(torch.float32).min).triu(1)  # Hugging Face's way of a causal mask
    bias = torch.zeros(6, 6).index_fill(1, torch.tensor([1, 4]), -0.5)  # an additive bias on two keys
    with torch.no_grad():
        for batch in (3, 5):  # two batch sizes
            xb = torch.randn(batch, 6, 16)
            for mask in (nn.Transformer.generate_square_subsequent_mask(6), finfo, bias, bias):
                torch.testing.assert_close(ens(xb, mask), torch.stack([m(xb, mask) for m in members]))
        row = torch.zeros(6, 6).index_fill(0, torch.tensor([2]), float("-inf"))
        with pytest.raises(ExecutionError, match="every key masked out"):
            ens(x, row)
    # with gradients on, torch takes its slow path, which adds the bias: so does the batched module
    torch.testing.assert_close(ens(x, bias), torch.stack([m(x, bias) for m in members]), rtol=1e-4, atol=1e-5)


class _SelfAttentionPadded(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x, kpm):
        return self.mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0]


def test_a_fully_masked_row_with_gradients_on_runs_as_torchs_slow_path_does():
    """Was: refused as if torch took its fast path, which it does not while gradients are recorded."""
    torch.manual_seed(0)
    members = [_SelfAttentionPadded().eval() for _ in range(3)]
    x, kpm = torch.randn(3, 6, 16), torch.zeros(3, 6, dtype=torch.bool)
    ens = executor.build(planner.propose(planner.trace(members[0], (x, kpm)), 3), members)
    kpm[1] = True
    want = torch.stack([m(x, kpm) for m in members])
    assert not want.isnan().any()
    torch.testing.assert_close(ens(x, kpm), want, rtol=1e-4, atol=1e-5)


class _AlibiEncoder(nn.Module):
    def __init__(self, activation=None):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
        if activation is not None:
            self.enc.activation = activation  # after construction: torch's fused path still reads its ReLU flag

    def forward(self, x, mask):
        return self.enc(x, src_mask=mask, is_causal=True)


@pytest.mark.parametrize("activation", [None, nn.GELU(), nn.Tanh()])
def test_an_encoder_layer_on_torchs_fused_path_follows_its_flag_activation_and_ignores_is_causal(activation):
    """Review: an activation assigned after construction ran where torch's fused path runs ReLU (0.07-0.15 off), and
    is_causal=True with a causal mask plus an ALiBi bias dropped the bias (0.25 off)."""
    torch.manual_seed(0)
    members = [_AlibiEncoder(activation).eval() for _ in range(3)]
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    ens = executor.build(planner.propose(planner.trace(members[0], (torch.randn(2, 6, 16), causal)), 3), members)
    alibi = causal + torch.arange(6.0)[None, :] * -0.1 * (torch.arange(6.0)[:, None] >= torch.arange(6.0)[None, :])
    for batch in (2, 5):  # two batch sizes, each mask called twice
        x = torch.randn(batch, 6, 16)
        for mask in (causal, alibi, alibi):
            with torch.no_grad():
                torch.testing.assert_close(ens(x, mask), torch.stack([m(x, mask) for m in members]))
            torch.testing.assert_close(ens(x, mask), torch.stack([m(x, mask) for m in members]), rtol=1e-4, atol=1e-5)
