"""Hugging Face models built from a tiny config (no hub download): fx cannot trace
them, so the torch.export fallback is used, and the ModelOutput dataclass comes
back with N-first tensors. Skipped when transformers is not installed."""
from __future__ import annotations

import pytest
import torch

import executor
import planner

transformers = pytest.importorskip("transformers")

N = 3


def _bert():
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=100, max_position_embeddings=32)
    return lambda: transformers.BertModel(cfg).eval()


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=32, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    return lambda: transformers.GPT2Model(cfg).eval()


@pytest.mark.parametrize("make", [_bert(), _gpt2()], ids=["bert", "gpt2"])
def test_hf_model_traces_with_export_and_matches_the_loop(make):
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    graph = planner.trace(make(), (ids,))
    assert graph.tracer == "export"
    assert "torch.fx failed" in graph.tracer_note
    plan = planner.propose(graph, N)
    members = []
    for i in range(N):
        torch.manual_seed(100 + i)
        members.append(make())
    report = executor.verify(plan, members, (ids,))
    assert report.ok, report.to_text()
    out = executor.build(plan, members, example_inputs=(ids,))(ids)
    hidden = out["last_hidden_state"]
    assert hidden.shape == (N, 2, 8, 32)
    with torch.no_grad():
        for i, m in enumerate(members):
            torch.testing.assert_close(hidden[i], m(ids)["last_hidden_state"], rtol=1e-4, atol=1e-5)
    assert (hidden[0] - hidden[1]).abs().max() > 1e-3  # members really differ
