"""The PyTorch tutorial TransformerModel ("Language Modeling with nn.Transformer"), as the tutorial writes it, traces
(torch.export) and runs as the member loop.

fx stops on `self.pe[:x.size(0)]` (a traced size slicing a buffer), and export stopped inside nn.TransformerEncoder:
given no is_causal, torch compares the mask with the square subsequent mask by value
(`bool((mask == causal).all())`, a GuardOnDataDependentSymNode Eq(u0, 1)), so the model was refused. The trace now
takes that hint as the caller gave it (False for none) and applies the mask itself; nn.TransformerDecoder's tgt_mask
goes through the same detection. Outputs and parameter gradients are compared with the member loop, in eval and in
train mode (dropout 0 there: the loop's Dropout draws would differ in order), with the mask made inside forward()
and given as an input (one member's not causal), batch_first False as in the tutorial and True.
"""
from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import Tensor, nn

from stagewise import executor, planner
from stagewise.planner import TraceError, tracers

torch.set_num_threads(1)
N, NTOKEN, D, HEADS, HID, LAYERS, S, B = 3, 20, 8, 2, 16, 2, 5, 3


class PositionalEncoding(nn.Module):
    """The tutorial's, with the sequence on dim 0 ([S, B, D]) or, batch_first, on dim 1 ([B, S, D])."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000, batch_first: bool = False):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.batch_first = batch_first
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.transpose(0, 1) if batch_first else pe)

    def forward(self, x: Tensor) -> Tensor:
        if self.batch_first:
            x = x + self.pe[:, :x.size(1)]
        else:
            x = x + self.pe[:x.size(0)]
        return self.dropout(x)


class TransformerModel(nn.Module):
    """The tutorial's TransformerModel (batch_first passed on to the layer and the positional encoding)."""

    def __init__(self, ntoken: int, d_model: int, nhead: int, d_hid: int, nlayers: int, dropout: float = 0.5,
                 batch_first: bool = False):
        super().__init__()
        self.model_type = 'Transformer'
        self.batch_first = batch_first
        self.pos_encoder = PositionalEncoding(d_model, dropout, batch_first=batch_first)
        encoder_layers = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout, batch_first=batch_first)
        self.transformer_encoder = nn.TransformerEncoder(encoder_layers, nlayers)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntoken)

    def forward(self, src: Tensor, src_mask: Tensor = None) -> Tensor:
        src = self.embedding(src) * math.sqrt(self.d_model)
        src = self.pos_encoder(src)
        if src_mask is None:
            length = src.size(1) if self.batch_first else len(src)
            src_mask = nn.Transformer.generate_square_subsequent_mask(length).to(src.device)
        output = self.transformer_encoder(src, src_mask)
        output = self.linear(output)
        return output


class DecoderModel(nn.Module):
    """The tutorial's model with an nn.TransformerDecoder over an encoded memory, the causal mask on the target."""

    def __init__(self, dropout: float = 0.5, batch_first: bool = False):
        super().__init__()
        self.batch_first = batch_first
        self.embedding = nn.Embedding(NTOKEN, D)
        self.pos_encoder = PositionalEncoding(D, dropout, batch_first=batch_first)
        self.memory = nn.Linear(D, D)
        layer = nn.TransformerDecoderLayer(D, HEADS, HID, dropout, batch_first=batch_first)
        self.decoder = nn.TransformerDecoder(layer, LAYERS)
        self.linear = nn.Linear(D, NTOKEN)

    def forward(self, tgt: Tensor, tgt_mask: Tensor = None) -> Tensor:
        x = self.pos_encoder(self.embedding(tgt) * math.sqrt(D))
        if tgt_mask is None:
            tgt_mask = nn.Transformer.generate_square_subsequent_mask(x.size(1) if self.batch_first else len(x))
        return self.linear(self.decoder(x, torch.tanh(self.memory(x)), tgt_mask=tgt_mask))


def _members(make, train: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    return [m.train() if train else m.eval() for m in members]


def _tokens(batch_first: bool, length: int = S, batch: int = B) -> Tensor:
    """One token batch per member: [N, S, B] (or [N, B, S] batch_first)."""
    shape = (N, batch, length) if batch_first else (N, length, batch)
    return torch.randint(0, NTOKEN, shape, generator=torch.Generator().manual_seed(1))


def _masks(length: int = S) -> Tensor:
    """Members 0 and 2 get the causal mask, member 1 a causal window of 3 keys, which is not (torch finds 0 and 2
    causal). -inf and 0 only: torch's fused inference path reads a float mask as a bool one (README)."""
    causal = nn.Transformer.generate_square_subsequent_mask(length)
    window = causal.masked_fill(torch.ones(length, length, dtype=torch.bool).tril(-3), float("-inf"))
    return torch.stack([causal, window, causal])


def _build(members: list[nn.Module], inputs: tuple):
    graph = planner.trace(copy.deepcopy(members[0]), tuple(x[0] for x in inputs))
    assert graph.tracer == "export"
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    return executor.build(plan, members)


def _loop(members: list[nn.Module], inputs: tuple) -> Tensor:
    return torch.stack([m(*(x[i] for x in inputs)) for i, m in enumerate(members)])


def _assert_like_the_loop(make, train: bool, mask_input: bool, batch_first: bool, rtol=1e-5, atol=1e-5) -> None:
    members = _members(make, train)
    inputs = (_tokens(batch_first),) + ((_masks(),) if mask_input else ())
    ens = _build(members, inputs)
    if not train:
        with torch.no_grad():
            torch.testing.assert_close(ens(*inputs), _loop(members, inputs), rtol=rtol, atol=atol)
            # other sizes: the batch, and the sequence length (the mask made in forward() or given at that length)
            # where the trace kept it dynamic; the tutorial's len(src) makes a Python int of it, which fixes it
            length = S if not (batch_first or mask_input) else S + 3
            longer = (_tokens(batch_first, length, B + 2),) + ((_masks(length),) if mask_input else ())
            torch.testing.assert_close(ens(*longer), _loop(members, longer), rtol=rtol, atol=atol)
        return
    if mask_input:  # the masks record gradients too: torch gives one to member 1's only (it drops a causal mask)
        masks = inputs[1].clone().requires_grad_(True)
        own = [m.clone().requires_grad_(True) for m in inputs[1]]
        out, want = ens(inputs[0], masks), torch.stack([m(inputs[0][i], own[i]) for i, m in enumerate(members)])
    else:
        out, want = ens(*inputs), _loop(members, inputs)
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    out.square().sum().backward()
    want.square().sum().backward()
    got = dict(ens.named_stacked_parameters())
    for name, _ in members[0].named_parameters():
        torch.testing.assert_close(got[name].grad, torch.stack([m.get_parameter(name).grad for m in members]),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    if mask_input:
        loop = torch.stack([torch.zeros_like(m) if m.grad is None else m.grad for m in own])
        assert [m.grad is None for m in own] == [True, False, True]
        torch.testing.assert_close(masks.grad, loop, rtol=rtol, atol=atol)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_input", [False, True], ids=["mask_in_forward", "mask_as_input"])
def test_tutorial_transformer_in_eval_runs_as_the_member_loop(batch_first, mask_input):
    _assert_like_the_loop(lambda: TransformerModel(NTOKEN, D, HEADS, HID, LAYERS, 0.2, batch_first), False,
                          mask_input, batch_first)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_input", [False, True], ids=["mask_in_forward", "mask_as_input"])
def test_tutorial_transformer_trains_as_the_member_loop(batch_first, mask_input):
    _assert_like_the_loop(lambda: TransformerModel(NTOKEN, D, HEADS, HID, LAYERS, 0.0, batch_first), True,
                          mask_input, batch_first)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_decoder_with_a_causal_tgt_mask_runs_as_the_member_loop(batch_first, train):
    _assert_like_the_loop(lambda: DecoderModel(0.0 if train else 0.2, batch_first), train, False, batch_first)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_decoder_with_a_per_member_tgt_mask_runs_as_the_member_loop(train):
    _assert_like_the_loop(lambda: DecoderModel(0.0 if train else 0.2), train, True, False)


def test_torchs_causal_detection_is_back_after_a_trace_and_after_a_failed_one():
    from torch.nn.modules import transformer
    detect = transformer._detect_is_causal_mask

    class Refused(nn.Module):  # neither tracer follows a branch on an input's values
        def forward(self, x):
            return x * 2 if bool(x.sum() > 0) else x

    planner.trace(TransformerModel(NTOKEN, D, HEADS, HID, LAYERS, 0.2).eval(), (_tokens(False)[0],))
    assert transformer._detect_is_causal_mask is detect
    with pytest.raises(TraceError):
        planner.trace(Refused(), (torch.randn(3),))
    assert transformer._detect_is_causal_mask is detect
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    assert transformer._detect_is_causal_mask(mask) is True  # torch's own, reading the values


def test_a_graph_that_never_needed_the_values_is_unchanged():
    """is_causal given, or no mask: the detection answered so before without reading the mask; same graph."""
    class Given(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = PositionalEncoding(D, 0.0)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, HID, 0.0), 1, enable_nested_tensor=False)
            self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, HEADS, HID, 0.0), 1)

        def forward(self, x, mask):
            h = self.enc(self.pos(x), mask, is_causal=True)
            return self.dec(h, h) + self.dec(h, h, tgt_mask=mask, tgt_is_causal=False)

    model, args = Given().eval(), (torch.randn(S, B, D), nn.Transformer.generate_square_subsequent_mask(S))
    now = tracers._export(copy.deepcopy(model), args).code
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracers, "_causal_masks_as_given", contextlib.nullcontext, raising=False)
        before = tracers._export(copy.deepcopy(model), args).code
    assert now == before
