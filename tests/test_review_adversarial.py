"""Adversarial review of the wide LSTM / MultiheadAttention / TransformerEncoder(Layer) rules, opened leaf
modules and the plan diff: every case is compared with the plain member loop (float32, rtol 1e-5 / atol 1e-6)
or must be refused with a StagewiseError. Cases that show a bug are kept as strict xfails naming it."""
from __future__ import annotations

import copy
import json
import warnings
from dataclasses import replace

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stagewise import executor, planner
from stagewise.executor.strategies.wide_attention import encoder, encoder_layer, multihead_attention
from stagewise.executor.strategies.wide_layers import lstm
from stagewise.executor.strategies.wide_ops import NFirst
from stagewise.planner import EditError
from stagewise.planner.diff import ChangeKind
from stagewise.planner.plan import StageOptions, Strategy
from conftest import examples
from test_edits import draw_edit, subject
from test_open_modules import Stack
from test_wide_recurrent_attention import check_rule, member_view, nfirst, stack_members, stacked, value

RTOL, ATOL = 1e-5, 1e-6
E, HEADS = 8, 2


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def make_members(make, n: int) -> list:
    torch.manual_seed(0)
    return [make().eval() for _ in range(n)]


def loop_or_error(mods: list, args: tuple, kwargs: dict):
    """The stacked member outputs, or the exception the loop raises."""
    try:
        return stack_members([m(*member_view(args, i), **member_view(kwargs, i)) for i, m in enumerate(mods)])
    except Exception as e:  # noqa: BLE001 - what torch raises is the answer
        return e


# --- rule level: shapes, dtypes, strides the rule tests did not use ------------------------------

RULES = {
    "lstm": (lambda: nn.LSTM(E, 5, num_layers=2, batch_first=True), lstm, 1),
    "mha": (lambda: nn.MultiheadAttention(E, HEADS, batch_first=True), multihead_attention, 3),
    "layer": (lambda: nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True), encoder_layer, 1),
    "encoder": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True), 2,
                                              enable_nested_tensor=False), encoder, 1),
}


@pytest.mark.parametrize("n, shared", [(1, False), (2, True), (3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(RULES))
def test_rules_on_batch_one_length_one_and_float64(name, dtype, n, shared):
    make, rule, copies = RULES[name]
    mods = [m.to(dtype) for m in make_members(make, n)]
    sets = []
    for b, t in ((1, 1), (1, 5), (3, 1)):  # batch of one, sequence of one
        x = value(torch.randn(b, t, E, dtype=dtype), n, shared)
        sets.append(((x,) * copies, {}))
    check_rule(rule, mods, sets)


@pytest.mark.parametrize("name", list(RULES))
def test_rules_on_non_contiguous_inputs(name):
    make, rule, copies = RULES[name]
    mods = make_members(make, 3)
    sets = []
    for b, t in ((2, 4), (3, 6)):
        per_member = NFirst(torch.randn(t, 3, b, E).permute(1, 2, 0, 3))  # [N, B, T, E], strided
        shared = torch.randn(t, b, E).transpose(0, 1)
        sets += [((per_member,) * copies, {}), ((shared,) * copies, {})]
    check_rule(rule, mods, sets)


@pytest.mark.parametrize("name", ["lstm", "mha", "layer", "encoder"])
def test_rules_in_bfloat16_match_the_bfloat16_loop(name):
    make, rule, copies = RULES[name]
    mods = [m.to(torch.bfloat16) for m in make_members(make, 3)]
    x = torch.randn(3, 2, 5, E, dtype=torch.bfloat16)
    with torch.no_grad():
        got = nfirst(rule(mods[0], stacked(mods), (NFirst(x),) * copies, {}, 3))
        want = stack_members([m(*(x[i],) * copies) for i, m in enumerate(mods)])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def fully_masked(kind: str, b: int, length: int) -> dict:
    """A key padding mask with a whole batch row padded, or an attention mask with a whole query row masked."""
    if kind == "key_padding":
        m = torch.zeros(b, length, dtype=torch.bool)
        m[-1] = True
        return {"key_padding_mask": m}
    m = torch.zeros(length, length, dtype=torch.bool)
    m[1] = True
    return {"attn_mask": m}


def check_nan_like_the_loop(rule, mods, args, kwargs):
    """The rule answers like the loop (NaN where the loop has NaN), or refuses loudly naming the fully masked row."""
    with torch.no_grad():
        want = loop_or_error(mods, args, kwargs)
        try:
            got = nfirst(rule(mods[0], stacked(mods), args, kwargs, len(mods)))
        except planner.StagewiseError as e:
            leaves = [t for t in torch.utils._pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
            assert "every key masked out" in str(e) and any(bool(torch.isnan(t).any()) for t in leaves), str(e)
            return
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)


FAST_PATH_NAN = ("torch's MHA fast path (eval, no grad, batch_first, self-attention) gives NaN for a fully masked "
                 "row; the wide rule's SDPA gives 0 there (wide_attention.attention)")


@pytest.mark.parametrize("kind", ["key_padding", "attn_row"])
@pytest.mark.parametrize("batch_first, need_weights", [
    (False, False), (False, True), (True, True),
    (True, False),  # torch's fast path: NaN rows; the rule refuses (FAST_PATH_NAN was the bug)
])
def test_mha_fully_masked_rows_like_the_loop(kind, batch_first, need_weights):
    mods = make_members(lambda: nn.MultiheadAttention(E, HEADS, batch_first=batch_first), 3)
    x = torch.randn(2, 4, E) if batch_first else torch.randn(4, 2, E)
    check_nan_like_the_loop(multihead_attention, mods, (x, x, x), {"need_weights": need_weights, **fully_masked(kind, 2, 4)})


@pytest.mark.parametrize("batch_first", [False, True])
def test_encoder_layer_fully_masked_rows_like_the_loop(batch_first):
    mods = make_members(lambda: nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=batch_first), 3)
    x = torch.randn(2, 4, E) if batch_first else torch.randn(4, 2, E)
    kpm = fully_masked("key_padding", 2, 4)["key_padding_mask"]
    check_nan_like_the_loop(encoder_layer, mods, (x,), {"src_key_padding_mask": kpm})


def test_nested_encoder_fully_masked_rows_like_the_loop():
    mods = make_members(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True), 2), 3)
    x = torch.randn(2, 4, E)
    check_nan_like_the_loop(encoder, mods, (x,), {"src_key_padding_mask": fully_masked("key_padding", 2, 4)["key_padding_mask"]})


BAD_MASK = ("torch refuses integer masks (and a float16 mask for float32 attention); with need_weights=True the wide "
            "rule adds them as float scores and answers (wide_attention._float_mask passes non-bool masks through)")


@pytest.mark.parametrize("need_weights", [False, True])  # True was BAD_MASK
@pytest.mark.parametrize("mask", ["uint8 key_padding", "long attn", "float16 key_padding"])
def test_mha_masks_torch_refuses_are_not_answered(mask, need_weights):
    mods = make_members(lambda: nn.MultiheadAttention(E, HEADS, batch_first=True), 2)
    x = torch.randn(2, 4, E)
    kwargs = {"need_weights": need_weights}
    if mask == "uint8 key_padding":
        kwargs["key_padding_mask"] = (torch.rand(2, 4) > 0.5).to(torch.uint8)
    elif mask == "long attn":
        kwargs["attn_mask"] = (torch.rand(4, 4) > 0.5).long()
    else:
        kwargs["key_padding_mask"] = torch.zeros(2, 4, dtype=torch.float16)
    assert isinstance(loop_or_error(mods, (x, x, x), kwargs), Exception)  # the loop raises
    with torch.no_grad():
        try:
            got = multihead_attention(mods[0], stacked(mods), (x, x, x), kwargs, 2)
        except RuntimeError:
            got = None  # raising (an ExecutionError in a stage) is what the loop does too
    assert got is None, "the rule answered inputs torch refuses"


# --- whole models through executor.build ------------------------------------------------------------

class Body(nn.Module):
    """Linear -> one leaf module (LSTM, MHA, encoder layer or encoder) -> Linear."""

    def __init__(self, kind: str, **kw):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(6, E)
        if kind == "lstm":
            self.body = nn.LSTM(E, E, num_layers=2, batch_first=True)
        elif kind == "mha":
            self.body = nn.MultiheadAttention(E, kw.get("nhead", HEADS), batch_first=kw.get("batch_first", True),
                                              dropout=kw.get("dropout", 0.0))
        elif kind == "layer":
            self.body = nn.TransformerEncoderLayer(E, kw.get("nhead", HEADS), 16, batch_first=kw.get("batch_first", True),
                                                   dropout=kw.get("dropout", 0.0), activation=kw.get("activation", "relu"),
                                                   norm_first=kw.get("norm_first", False), layer_norm_eps=kw.get("eps", 1e-5))
        else:
            assert kind == "encoder_rms"
            layer = nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True, norm_first=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # enable_nested_tensor with norm_first
                self.body = nn.TransformerEncoder(layer, 2, norm=nn.RMSNorm(E, eps=1e-5), enable_nested_tensor=False)
        self.out = nn.Linear(E, 3)

    def forward(self, x):
        h = self.inp(x)
        if self.kind == "lstm":
            h = self.body(h)[0]
        elif self.kind == "mha":
            h = self.body(h, h, h, need_weights=False)[0]
        else:
            h = self.body(h)
        return self.out(h)


def everything(plan, strategy: Strategy):
    return plan.with_stages([replace(s, options=StageOptions(strategy=strategy)) for s in plan.stages])


def built(mods: list, strategy: Strategy | None = Strategy.WIDE, mode: str = "shared"):
    x = torch.randn(2, 5, 6)
    plan = planner.propose(planner.trace(mods[0], (x,)), len(mods), mode)
    return executor.build(everything(plan, strategy) if strategy else plan, mods)


def inputs_for(n: int, mode: str) -> list:
    shapes = ((2, 5, 6), (3, 7, 6))
    return [torch.randn(*s) if mode == "shared" else torch.randn(n, *s) for s in shapes]


def assert_matches_the_loop(module, mods: list, mode: str = "shared", calls: int = 2) -> None:
    for x in inputs_for(len(mods), mode):
        for _ in range(calls):
            with torch.no_grad():
                got = module(x)
                want = torch.stack([m(x if mode == "shared" else x[i]) for i, m in enumerate(mods)])
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


LEAF_ATTRS = ("members that differ in an attribute of a submodule inside a leaf module (self_attn.num_heads, "
              "self_attn.batch_first, norm1.eps, the activation module's class) build and run with member 0's value: "
              "executor.constants._differences compares only the leaf's own attributes")


@pytest.mark.parametrize("strategy", [None, Strategy.WIDE])
@pytest.mark.parametrize("differs", [{"nhead": 4}, {"batch_first": False}, {"eps": 0.5},
                                     {"activation": (nn.Tanh(), nn.SiLU())}],
                         ids=["nhead", "batch_first", "norm_eps", "activation_class"])
def test_sweep_inside_an_encoder_layer_is_refused(differs, strategy):
    """Encoder layers of a sweep: member 1 differs in a value inside the layer; build must refuse (or be right)."""
    (key, val), = differs.items()
    first, other = val if isinstance(val, tuple) else (None, val)
    torch.manual_seed(0)
    mods = [Body("layer", **({key: first} if first is not None else {})).eval(), Body("layer", **{key: other}).eval()]
    try:
        module = built(mods, strategy)
    except planner.StagewiseError:
        return
    assert_matches_the_loop(module, mods)


@pytest.mark.parametrize("kind, differs", [("layer", {"norm_first": True}), ("layer", {"activation": "gelu"}),
                                           ("mha", {"nhead": 4}), ("mha", {"batch_first": False})])
def test_sweep_of_a_leaf_modules_own_attribute_is_refused(kind, differs):
    torch.manual_seed(0)
    mods = [Body(kind).eval(), Body(kind, **differs).eval()]
    with pytest.raises(planner.MemberError, match="members differ"):
        built(mods)


def test_encoder_with_rmsnorm_final_norm_matches_the_loop():  # wide ran the final norm as LayerNorm (fixed)
    module = built(make_members(lambda: Body("encoder_rms"), 2))
    assert_matches_the_loop(module, make_members(lambda: Body("encoder_rms"), 2))


def stacked_body(module) -> list[torch.Tensor]:
    return [t for k, t in module.stacked_state.items() if k.startswith("body.")]


def members_body(mods: list) -> list[torch.Tensor]:
    return [p for m in mods for k, p in m.named_parameters() if k.startswith("body.")]


@pytest.mark.parametrize("kind", ["lstm", "mha", "layer"])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_in_place_updates_and_load_state_dict_are_seen(kind, mode):
    mods = make_members(lambda: Body(kind), 3)
    module = built(mods, mode=mode)
    assert_matches_the_loop(module, mods, mode)
    with torch.no_grad():  # an optimizer step on the stacked state and on each member
        for t in stacked_body(module) + members_body(mods):
            t.add_(0.05)
    assert_matches_the_loop(module, mods, mode)
    fresh = [Body(kind).eval() for _ in range(3)]
    module.load_state_dict({f"stacked.{k}": torch.stack([m.state_dict()[k] for m in fresh]) for k in fresh[0].state_dict()})
    assert_matches_the_loop(module, fresh, mode)


STALE = ("an update through .data (p.data.mul_(...), as EMA code and older optimizers write it) bumps no version "
         "counter and keeps the storage: wide_ops.relaid's cached [N, in, out] weights go stale")


# was STALE (fixed: nothing derived from the weights is kept across calls)
@pytest.mark.parametrize("kind", ["lstm", "mha", "layer"])
def test_update_through_data_is_seen(kind):
    mods = make_members(lambda: Body(kind), 2)
    module = built(mods)
    assert_matches_the_loop(module, mods, calls=1)
    with torch.no_grad():
        for t in stacked_body(module) + members_body(mods):
            t.data.mul_(1.5)
    assert_matches_the_loop(module, mods, calls=1)


def test_update_through_data_is_seen_by_fused_sibling_linears():
    """The sample block's q, k and v Linears read one input: wide runs them as one GEMM on concatenated weights."""
    src = planner.load_model_file(Path(__file__).resolve().parents[1] / "sample_models" / "transformer_block.py")
    mods = src.members(2)
    plan = planner.propose(planner.trace(mods[0], src.example_inputs), 2)
    module = executor.build(everything(plan, Strategy.WIDE), mods)
    x = src.example_inputs[0]
    for scale in (1.0, 1.5):
        with torch.no_grad():
            for t in list(module.parameters()) + [p for m in mods for p in m.parameters()]:
                t.data.mul_(scale)
            got, want = module(x), torch.stack([m(x) for m in mods])
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["lstm", "mha", "layer"])
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_training_gradients_match_the_loop(kind, mode):
    torch.manual_seed(0)
    mods = [Body(kind).train() for _ in range(3)]
    module = built(mods, mode=mode).train()
    x = inputs_for(3, mode)[0]
    (module(x) ** 2).sum().backward()
    for i, m in enumerate(mods):
        (m(x if mode == "shared" else x[i]) ** 2).sum().backward()
    for k, p in module.named_stacked_parameters():
        for i, m in enumerate(mods):
            torch.testing.assert_close(p.grad[i], dict(m.named_parameters())[k].grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["mha", "layer"])
def test_dropout_after_switching_to_train_draws_as_the_loop(kind):
    """Built in eval (the rule runs), then .train() with dropout > 0: never the eval answer. Was a clear error (vmap
    cannot draw); the module now runs once per member with its own mask, drawn as the loop draws them."""
    mods = make_members(lambda: Body(kind, dropout=0.5), 2)
    module = built(mods)
    assert_matches_the_loop(module, mods, calls=1)
    looped = built(copy.deepcopy(mods), Strategy.LOOP).train()
    module.train()
    x = torch.randn(2, 5, 6)
    torch.manual_seed(5)
    got = module(x)
    torch.manual_seed(5)
    torch.testing.assert_close(got, looped(x), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert (got - module.eval()(x)).abs().max() > 1e-3  # not the eval answer


def test_autotune_on_attention_matches_the_loop():
    mods = make_members(lambda: Body("mha"), 2)
    x = torch.randn(2, 5, 6)
    plan = planner.propose(planner.trace(mods[0], (x,)), 2, "shared")
    tuned = executor.autotune(plan, mods, (x,), strategies=["vmap", "wide", "loop"], repeats=1)
    report = executor.verify(tuned, mods, (x,), more_inputs=[(torch.randn(3, 7, 6),)])
    assert report.ok, report.to_text()


# --- opened leaf modules ----------------------------------------------------------------------------

class Untraceable(nn.Module):
    """An encoder layer to open, behind data-dependent Python that neither tracer takes."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)

    def forward(self, x):
        if x.sum() > 0:  # fx fails here, inside the trace that switched the fast path off; export fails at once
            return x.tolist()
        return self.layer(x)


@pytest.mark.parametrize("before", [True, False])
def test_mha_fast_path_setting_is_restored_after_a_failed_trace(before):
    saved = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(before)
    try:
        with pytest.raises(planner.TraceError):
            planner.trace(Untraceable().eval(), (torch.randn(2, 5, 32),), open_modules=["layer"])
        assert torch.backends.mha.get_fastpath_enabled() is before
        planner.trace(Stack().eval(), (torch.randn(2, 5, 32),), open_modules=["layers.0"])
        assert torch.backends.mha.get_fastpath_enabled() is before
    finally:
        torch.backends.mha.set_fastpath_enabled(saved)


def stack_sweep(change, opened: list) -> tuple:
    torch.manual_seed(0)
    mods = [Stack().eval() for _ in range(3)]
    change(mods[1])
    x = torch.randn(2, 5, 32)
    return mods, planner.propose(planner.trace(mods[0], (x,), open_modules=opened), 3), x


def more_heads(m):
    m.layers[0].self_attn.num_heads, m.layers[0].self_attn.head_dim = 8, 4


def wider_eps(m):
    m.layers[0].norm1.eps = 0.5


@pytest.mark.parametrize("opened", [["layers.0"], ["TransformerEncoderLayer"], ["layers.*"]])
@pytest.mark.parametrize("change", [more_heads, wider_eps])
def test_sweep_inside_an_opened_module_is_refused(change, opened):
    mods, plan, _ = stack_sweep(change, opened)
    with pytest.raises(planner.MemberError, match="members differ"):
        executor.build(plan, mods)


def no_dropout(m):
    m.layers[0].dropout.p, m.layers[0].dropout1.p, m.layers[0].dropout2.p = 0.0, 0.0, 0.0


def all_dropout(m):
    m.layers[0].dropout.p, m.layers[0].dropout1.p, m.layers[0].dropout2.p = 1.0, 1.0, 1.0


@pytest.mark.parametrize("opened", [
    pytest.param(["layers.0"], id="opened"),
    pytest.param([], id="closed"),
])
def test_sweep_of_dropout_p_in_training_is_refused_or_right(opened):
    """Member 0 drops nothing (p = 0), member 1 everything (p = 1): both deterministic, so comparable."""
    torch.manual_seed(0)
    mods = [Stack().train() for _ in range(2)]
    no_dropout(mods[0])
    all_dropout(mods[1])
    for m in mods:
        m.layers[1].dropout.p = m.layers[1].dropout1.p = m.layers[1].dropout2.p = 0.0
    x = torch.randn(2, 5, 32)
    try:
        module = executor.build(planner.propose(planner.trace(mods[0], (x,), open_modules=opened), 2), mods).train()
    except planner.StagewiseError:
        return
    torch.testing.assert_close(module(x), torch.stack([m(x) for m in mods]), rtol=RTOL, atol=ATOL)


def test_dropout_p_of_an_opened_module_may_differ_in_eval():
    mods, plan, x = stack_sweep(all_dropout, ["layers.0"])
    module = executor.build(plan, mods)
    for call_x in (x, torch.randn(3, 7, 32)):
        with torch.no_grad():
            torch.testing.assert_close(module(call_x), torch.stack([m(call_x) for m in mods]), rtol=RTOL, atol=ATOL)


def test_opened_plan_with_wide_everywhere_round_trips_and_matches_the_loop(tmp_path):
    mods, plan, x = stack_sweep(lambda m: None, ["TransformerEncoderLayer"])
    plan = planner.Plan.load(everything(plan, Strategy.WIDE).save(tmp_path / "plan.json"))
    assert plan.opened_modules == ("layers.0", "layers.1")
    module = executor.build(plan, mods)
    for call_x in (x, x, torch.randn(3, 7, 32)):
        with torch.no_grad():
            torch.testing.assert_close(module(call_x), torch.stack([m(call_x) for m in mods]), rtol=RTOL, atol=ATOL)


class Wrapped(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Doubled(nn.TransformerEncoderLayer):
    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        return super().forward(src, src_mask, src_key_padding_mask, is_causal) * 2


@pytest.mark.parametrize("swap", [lambda m: Wrapped(m.layers[0]), lambda m: nn.Linear(32, 32),
                                  lambda m: Doubled(32, 4, 64, batch_first=True).eval()])
def test_opened_plan_refuses_a_model_with_another_module_at_the_path(tmp_path, swap):
    mods, plan, _ = stack_sweep(lambda m: None, ["layers.0"])
    plan = planner.Plan.load(plan.save(tmp_path / "plan.json"))
    for m in mods:
        m.layers[0] = swap(m)
    with pytest.raises(planner.StagewiseError):
        executor.build(plan, mods)


# --- plan diff ----------------------------------------------------------------------------------------

def layout(plan) -> set:
    return {(frozenset(s.nodes), s.mode, s.options) for s in plan.stages}


def check_diff(a, b) -> None:
    d, back = planner.diff_plans(a, b), planner.diff_plans(b, a)
    nodes = [n for s in a.stages for n in s.nodes]
    assert sorted(d.nodes) == sorted(nodes) == sorted(back.nodes)  # every node once
    for s_a in a.stages:
        assert sum(s_a.id in c.before for c in d.stages) == 1
    for s_b in b.stages:
        assert sum(s_b.id in c.after for c in d.stages) == 1
    assert set(d.changed_nodes()) == set(back.changed_nodes())
    assert d.identical == back.identical == (layout(a) == layout(b) and a.n_members == b.n_members)
    swap = {ChangeKind.MERGED: ChangeKind.SPLIT, ChangeKind.SPLIT: ChangeKind.MERGED}
    assert sorted(swap.get(c.kind, c.kind).value for c in d.stages) == sorted(c.kind.value for c in back.stages)
    json.dumps(d.to_json())
    assert d.summary() and back.summary()


@settings(max_examples=examples(15), deadline=None)
@given(data=st.data(), name=st.sampled_from(["dag3", "dag11", "dag42"]))
def test_diff_of_random_edit_sequences(data, name):
    graph, _, _ = subject(name)
    start = planner.propose(graph, 2, input_mode="shared")
    d = planner.diff_plans(start, start)
    assert d.identical and not d.changed_nodes() and all(c.kind is ChangeKind.SAME for c in d.stages)
    plan = start
    for _ in range(6):
        _, edit = draw_edit(data, plan, graph)
        try:
            plan = edit()
        except EditError:
            continue
        check_diff(start, plan)
