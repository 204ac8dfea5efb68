"""Real models from the libraries users have: Hugging Face models built from tiny configs (no hub download).

Each is planned, saved and loaded as JSON, built without example inputs (the plan
records the traced shapes) and compared with the plain loop over the same members
on two calls at one shape and a call at another batch size and sequence length
(export keeps those dims dynamic). fx cannot trace these models, so they exercise
the torch.export path and ModelOutput dataclasses coming back with N-first tensors.
Skipped when transformers is not installed.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._pytree import tree_leaves

from stagewise import executor
from stagewise import planner

transformers = pytest.importorskip("transformers")

N = 3
VOCAB = 100


def _ids(b, t, g):
    return torch.randint(0, VOCAB, (b, t), generator=g)


def bert():
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=VOCAB, max_position_embeddings=32)
    return (lambda: transformers.BertModel(cfg).eval()), (lambda b, t, g: (_ids(b, t, g),))


def gpt2(use_cache=False):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=use_cache,
                                  bos_token_id=0, eos_token_id=0)
    return (lambda: transformers.GPT2Model(cfg).eval()), (lambda b, t, g: (_ids(b, t, g),))


def vit():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=4, num_channels=3)
    return (lambda: transformers.ViTModel(cfg).eval()), (lambda b, t, g: (torch.randn(b, 3, 16, 16, generator=g),))


def t5():
    cfg = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                                vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0, pad_token_id=0)

    def inputs(b, t, g):  # encoder ids, encoder mask (last positions padded), decoder ids
        mask = torch.ones(b, t, dtype=torch.long)
        mask[:, t - 2:] = 0
        return _ids(b, t, g), mask, _ids(b, t // 2, g)

    return (lambda: transformers.T5Model(cfg).eval()), inputs


ZOO = {"bert": bert, "gpt2": gpt2, "vit": vit, "t5": t5}


def _loop(members, inputs):
    with torch.no_grad():
        return [m(*inputs) for m in members]


def _assert_matches_loop(got, want, call):
    """Every tensor of the member loop's outputs, stacked, equals the batched module's (same pytree order)."""
    got_leaves = [t for t in tree_leaves(dict(got)) if isinstance(t, torch.Tensor)]
    want_outs = [[t for t in tree_leaves(dict(w)) if isinstance(t, torch.Tensor)] for w in want]
    assert got_leaves and len(got_leaves) == len(want_outs[0]), f"call {call}: outputs {list(got)}"
    for k, g in enumerate(got_leaves):
        torch.testing.assert_close(g, torch.stack([w[k] for w in want_outs]), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"call {call}, output {k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_model_matches_the_loop_on_two_calls_and_two_shapes(name):
    make, inputs = ZOO[name]()
    g = torch.Generator().manual_seed(0)
    members = []
    for i in range(N):
        torch.manual_seed(100 + i)
        members.append(make())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export and vmap-fallback warnings
        graph = planner.trace(copy.deepcopy(members[0]), inputs(2, 8, g))
        assert graph.tracer == "export" and "torch.fx failed" in graph.tracer_note
        plan = planner.Plan.loads(planner.propose(graph, N).dumps())
        ens = executor.build(plan, members)  # no example_inputs: built from the recorded shapes (token ids as zeros)
        first = plan.inputs[0]
        assert first.dynamic_dim(0) is not None, "the batch dim should stay dynamic"
        for call, (b, t) in enumerate([(2, 8), (2, 8), (3, 6)]):
            x = inputs(b, t, g)
            with torch.no_grad():
                got = ens(*x)
            _assert_matches_loop(got, _loop(members, x), call)
    hidden = got["last_hidden_state"]
    assert hidden.shape[:2] == (N, 3)
    assert (hidden[0] - hidden[1]).abs().max() > 1e-3  # members really differ


@pytest.mark.slow
def test_verify_reports_a_match_for_bert():
    make, inputs = bert()
    members = []
    for i in range(N):
        torch.manual_seed(100 + i)
        members.append(make())
    x = inputs(2, 8, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = planner.propose(planner.trace(copy.deepcopy(members[0]), x), N)
        report = executor.verify(plan, members, x)
    assert report.ok, report.to_text()


def test_gpt2_with_its_cache_is_refused_with_the_fix():
    make, inputs = gpt2(use_cache=True)  # GPT2Config's default
    with warnings.catch_warnings(), pytest.raises(planner.TraceError, match=r"GPT2Model returns a DynamicCache .*use_cache=False"):
        warnings.simplefilter("ignore")
        planner.trace(make(), inputs(2, 8, torch.Generator().manual_seed(0)))


def test_batch_one_with_an_attention_mask_runs_where_export_gave_the_mask_its_own_batch_symbol():
    """Was: InputError "torch.export traced that dim for sizes of 2 and more" at batch 1 (ALBERT, GPT-NeoX, MPNet):
    export gave input_ids' and attention_mask's batch dims separate symbols, and the mask's, cut to one row alone,
    made the model itself fail; dims of one example size are now cut together when one alone cannot be."""
    cfg = transformers.AlbertConfig(embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32)
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(transformers.AlbertModel(cfg).eval())
    g = torch.Generator().manual_seed(0)
    ids, mask = _ids(2, 8, g), torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(copy.deepcopy(members[0]), (ids, mask))
        ens = executor.build(planner.propose(graph, N), copy.deepcopy(members))
        with torch.no_grad():
            got = ens(ids[:1], mask[:1])["last_hidden_state"]
            want = torch.stack([m(ids[:1], mask[:1])["last_hidden_state"] for m in members])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
