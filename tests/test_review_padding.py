"""An embedding's padding row gets no gradient in any member, whatever the strategy.

torch's embedding backward, reached from outside a vmap whose indices and weight both carry the member
axis, kept the padding row's gradient at zero for member 0 only: members 1..N-1 trained their padding
rows (BERT's pad token among them) where the member loop does not. executor.stages puts a
no_grad_at_padding node after every lookup with a padding row. Compared with the loop: outputs,
every gradient, and two Adam steps.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.planner.plan import Strategy

from test_review_wild import everything

N = 3
VOCAB, DIM = 7, 5


class ModuleLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(VOCAB, DIM, padding_idx=0), nn.Linear(DIM, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids).tanh()).sum(1)


class FunctionalLookup(nn.Module):
    """F.embedding with a negative padding_idx (the last row) on a weight of its own."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM))

    def forward(self, ids):
        return (F.embedding(ids, self.table, padding_idx=-1) ** 2).sum(1)


def ids(batch, length, pad, g):
    x = torch.randint(0, VOCAB, (N, batch, length), generator=g)
    x[:, :, 0] = pad  # every member looks its padding row up
    return x


@pytest.mark.parametrize("strategy", [None, Strategy.VMAP, Strategy.LOOP, Strategy.WIDE])
@pytest.mark.parametrize("make, pad", [(ModuleLookup, 0), (FunctionalLookup, VOCAB - 1)], ids=["module", "functional"])
def test_padding_rows_train_like_the_loop(make, pad, strategy):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    reference = copy.deepcopy(members)
    g = torch.Generator().manual_seed(1)
    example = ids(4, 6, pad, g)
    plan = everything(planner.propose(planner.trace(copy.deepcopy(members[0]), (example[0],)), N, "per_member"), strategy)
    ens = executor.build(plan, members)
    opt = executor.StackedAdam(ens.parameters(), N, lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in reference]
    for step, (batch, length) in enumerate([(4, 6), (2, 9), (4, 6)]):
        x = ids(batch, length, pad, g)
        opt.zero_grad()
        out = ens(x)
        (out ** 2).sum().backward()
        want = []
        for i, (m, o) in enumerate(zip(reference, ref_opts)):
            o.zero_grad()
            y = m(x[i])
            (y ** 2).sum().backward()
            want.append(y.detach())
        torch.testing.assert_close(out.detach(), torch.stack(want), rtol=1e-5, atol=1e-6)
        for name, p in ens.named_stacked_parameters():
            ref_grads = torch.stack([dict(m.named_parameters())[name].grad for m in reference])
            torch.testing.assert_close(p.grad, ref_grads, rtol=1e-5, atol=1e-6, msg=lambda s: f"step {step} {name}: {s}")
            if p.dim() == 3 and p.shape[1] == VOCAB:
                assert p.grad[:, pad].abs().max() == 0, f"step {step}: a member's padding row got a gradient"
        opt.step()
        for o in ref_opts:
            o.step()


def test_inference_is_untouched():
    """No gradient recorded: the lookup's output goes on as it is (no extra node runs)."""
    torch.manual_seed(0)
    members = [ModuleLookup() for _ in range(N)]
    x = ids(4, 6, 0, torch.Generator().manual_seed(2))
    ens = executor.build(planner.propose(planner.trace(members[0], (x[0],)), N, "per_member"), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]))
