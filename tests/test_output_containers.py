"""Outputs in a container of the model's own type, traced by torch.fx: an OrderedDict or a Hugging Face
`ModelOutput` came back from the batched module as a plain dict (`out.logits` and `out[0]` failed where the member
loop's output has them), and a layer handed such an object got a dict. fx records every dict as a plain one; the
tracer now builds these with a node of their type. Each case is compared against the member loop."""
from __future__ import annotations

import collections
import copy
import pickle
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch import nn

from stagewise import executor, planner

N = 3
transformers_utils = pytest.importorskip("transformers.utils")


@dataclass
class ClassifierOutput(transformers_utils.ModelOutput):
    """As a Hugging Face model declares its output: optional fields, those left None drop out."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.GELU())
        self.head = nn.Linear(8, 4)

    def forward(self, x, labels):
        h = self.body(x)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits, labels)
        return ClassifierOutput(loss=loss, logits=logits)  # hidden left None


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x):
        return collections.OrderedDict(second=self.b(x), first=self.a(x).relu())


class Reads(nn.Module):
    """A layer handed an OrderedDict reads it by key and checks its type, as the eager call does."""

    def __init__(self):
        super().__init__()
        self.inner = Heads()
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        parts = self.inner(x)
        return self.out(torch.cat(list(parts.values()), -1))


def members_of(cls):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(cls().eval())
    return out


def built(cls, inputs):
    members = members_of(cls)
    graph = planner.trace(copy.deepcopy(members[0]), inputs)
    assert graph.tracer == "fx"
    return members, executor.build(planner.propose(graph, N), members)


def test_a_model_output_keeps_its_type_fields_and_positions():
    x, labels = torch.randn(5, 6), torch.randint(0, 4, (5,))
    members, ens = built(Classifier, (x, labels))
    out = ens(x, labels)
    loop = [m(x, labels) for m in members]
    assert type(out) is ClassifierOutput
    assert list(out.keys()) == list(loop[0].keys()) == ["loss", "logits"]
    assert out.hidden is None
    torch.testing.assert_close(out.logits, torch.stack([o.logits for o in loop]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[0], torch.stack([o.loss for o in loop]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.to_tuple()[1], out["logits"])


def test_a_model_output_trains_as_the_loop_does():
    x, labels = torch.randn(5, 6), torch.randint(0, 4, (5,))
    members, ens = built(Classifier, (x, labels))
    ens(x, labels).loss.sum().backward()
    for m in members:
        m(x, labels).loss.backward()
    for name, p in ens.named_stacked_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in members])
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)


def test_an_ordered_dict_output_keeps_its_type_and_key_order():
    x = torch.randn(4, 6)
    members, ens = built(Heads, (x,))
    for x in (x, torch.randn(7, 6), torch.randn(2, 3, 6)):  # calls on other values and shapes
        out = ens(x)
        assert type(out) is collections.OrderedDict
        assert list(out) == ["second", "first"]
        for k in out:
            torch.testing.assert_close(out[k], torch.stack([m(x)[k] for m in members]), rtol=1e-5, atol=1e-6)


def test_an_ordered_dict_handed_between_layers():
    x = torch.randn(4, 6)
    members, ens = built(Reads, (x,))
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


def test_the_output_type_survives_verify_pickle_and_a_plan_file(tmp_path):
    x, labels = torch.randn(5, 6), torch.randint(0, 4, (5,))
    members, ens = built(Classifier, (x, labels))
    assert executor.verify(ens.plan, members, (x, labels)).ok
    again = pickle.loads(pickle.dumps(ens))
    assert type(again(x, labels)) is ClassifierOutput
    rebuilt = executor.build(planner.Plan.load(ens.plan.save(tmp_path / "plan.json")), members)
    torch.testing.assert_close(rebuilt(x, labels).logits, ens(x, labels).logits)
