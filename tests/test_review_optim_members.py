"""From the review of optimizers and the stacked state: a SAM written as a plain class wrapping a torch optimizer
(SamsungLabs' ASAM) takes its gradient norm over all members and is warned about, as torch's own norm functions on a
stacked gradient are, while torch's optimizers and per-member norms stay silent; torch's prune / spectral_norm /
weight_norm / parametrize on the batched module's stacked state are refused with the state left as it was; a
functional instance norm updating a buffer several members share is refused as F.batch_norm's is. References: N
separate training runs with torch optimizers, the member loop."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from stagewise import executor, planner
from stagewise.executor.habits import JointNormWarning
from stagewise.planner.errors import MemberError
from test_review_optim_verify import Net, batched_and_members  # the optimizer review's small model and its module

N = 3


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)




def batches(n: int = N, steps: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 5, 8, generator=g), torch.randn(n, 5, 4, generator=g)) for _ in range(steps)]


def loss_of(model, x, y, batched: bool):
    out = model(x)
    return ((out - y) ** 2).mean(dim=(-2, -1)).sum() if batched else ((out - y) ** 2).mean()


def joint_norm_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, JointNormWarning)]


def worst_error(ens, members) -> float:
    """Largest normwise relative error of a member's state in the batched module against its own run."""
    sd = ens.member_state_dicts()
    return max(float((sd[i][k] - v).norm() / v.norm()) for i, m in enumerate(members) for k, v in m.state_dict().items())


# --- 1. an ASAM / SAM written as a plain class wrapping a torch optimizer -------------------------

class SAM:
    """SamsungLabs/ASAM's SAM (asam.py): not a torch.optim.Optimizer; one gradient norm over all parameters."""

    def __init__(self, optimizer, model, rho=0.5):
        self.optimizer, self.model, self.rho = optimizer, model, rho
        self.state = {}

    @torch.no_grad()
    def ascent_step(self):
        grads = []
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            grads.append(torch.norm(p.grad, p=2))
        grad_norm = torch.norm(torch.stack(grads), p=2) + 1.e-16
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            eps = self.state.get(p)
            if eps is None:
                eps = torch.clone(p).detach()
                self.state[p] = eps
            eps[...] = p.grad[...]
            eps.mul_(self.rho / grad_norm)
            p.add_(eps)
        self.optimizer.zero_grad()

    @torch.no_grad()
    def descent_step(self):
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            p.sub_(self.state[p])
        self.optimizer.step()
        self.optimizer.zero_grad()


class PerMemberSAM(SAM):
    """The same SAM with its norm taken per member, as the warning's fix says: [N] norms viewed [N, 1, ...]."""

    def __init__(self, optimizer, model, rho=0.5, n_members=N):
        super().__init__(optimizer, model, rho)
        self.n = n_members

    @torch.no_grad()
    def ascent_step(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        norms = torch.stack([torch.linalg.vector_norm(p.grad.reshape(self.n, -1), dim=1) for p in params])
        grad_norm = torch.linalg.vector_norm(norms, dim=0) + 1.e-16  # [N]
        for p in params:
            self.state[p] = p.grad * (self.rho / grad_norm).view((self.n,) + (1,) * (p.dim() - 1))
            p.add_(self.state[p])
        self.optimizer.zero_grad()


def train_sam(kind, model, data, batched: bool):
    opt = kind(torch.optim.SGD(model.parameters(), lr=0.1), model, rho=0.5)
    for x, y in data:
        loss_of(model, x, y, batched).backward()
        opt.ascent_step()
        loss_of(model, x, y, batched).backward()
        opt.descent_step()


def test_asam_plain_class_on_stacked_parameters_is_warned_about():
    # before: no warning, and each member 0.27-0.40 off its own run (one gradient norm over all members)
    ens, members = batched_and_members()
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_sam(SAM, ens, data, batched=True)
    messages = joint_norm_warnings(caught)
    assert len(messages) == 1, messages
    assert "torch.linalg.vector_norm" in messages[0] and "per member" in messages[0]
    assert [w.filename for w in caught if issubclass(w.category, JointNormWarning)] == [__file__]  # the norm's line
    for i, m in enumerate(members):
        train_sam(SAM, m, [(x[i], y[i]) for x, y in data], batched=False)
    assert worst_error(ens, members) > 0.05  # what the warning is about: N separate runs differ


def test_sam_with_per_member_norms_matches_separate_runs_without_a_warning():
    ens, members = batched_and_members()
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_sam(PerMemberSAM, ens, data, batched=True)
    assert not joint_norm_warnings(caught)
    for i, m in enumerate(members):
        train_sam(SAM, m, [(x[i], y[i]) for x, y in data], batched=False)
    assert worst_error(ens, members) < 1e-5


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_torch_optimizer_loops_with_a_per_member_clip_stay_silent(kind):
    ens, members = batched_and_members()
    data = batches()
    opt = kind(ens.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            opt.zero_grad()
            loss_of(ens, x, y, batched=True).backward()
            executor.clip_grad_norm_per_member_(ens.parameters(), 0.5, N)
            opt.step()
    assert not joint_norm_warnings(caught)
    for i, m in enumerate(members):
        own = kind(m.parameters(), lr=0.01)
        for x, y in data:
            own.zero_grad()
            loss_of(m, x[i], y[i], batched=False).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            own.step()
    assert worst_error(ens, members) < 1e-5


@pytest.mark.parametrize("foreach", [False, True])
def test_torch_clip_grad_norm_is_warned_about_once_as_before(foreach):
    ens, _ = batched_and_members()
    x, y = batches(steps=1)[0]
    loss_of(ens, x, y, batched=True).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_(ens.parameters(), 1.0, foreach=foreach)
    messages = joint_norm_warnings(caught)
    assert len(messages) == 1 and "clip_grad_norm_" in messages[0], messages


NORMS_OVER_ALL_MEMBERS = {
    "Tensor.norm": lambda g: g.norm(),
    "torch.norm p=2": lambda g: torch.norm(g, p=2),
    "of .data": lambda g: g.data.norm(2),
    "of .detach()": lambda g: g.detach().norm(),
    "torch.linalg.norm": lambda g: torch.linalg.norm(g),
    "torch.linalg.vector_norm": lambda g: torch.linalg.vector_norm(g),
    "over the member axis": lambda g: g.norm(dim=0),
    "torch._foreach_norm": lambda g: torch._foreach_norm([g]),
}


@pytest.mark.parametrize("name", list(NORMS_OVER_ALL_MEMBERS))
def test_norms_over_all_members_of_a_stacked_gradient_warn(name):
    ens, _ = batched_and_members()
    x, y = batches(steps=1)[0]
    loss_of(ens, x, y, batched=True).backward()
    grad = ens.stacked.fc1.weight.grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = NORMS_OVER_ALL_MEMBERS[name](grad)
    assert len(joint_norm_warnings(caught)) == 1
    torch.testing.assert_close(value if not isinstance(value, (list, tuple)) else value[0],
                               torch.linalg.vector_norm(grad.clone(), dim=0 if name == "over the member axis" else None),
                               rtol=1e-6, atol=0)  # torch's own numbers: the warning changes nothing


def test_per_member_norms_and_declared_classes_stay_silent():
    ens, _ = batched_and_members()
    x, y = batches(steps=1)[0]
    loss_of(ens, x, y, batched=True).backward()
    grad = ens.stacked.fc1.weight.grad

    class JointOnPurpose:
        stagewise_per_member = True

        def norm(self):
            return grad.norm()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_member = [grad.norm(dim=(1, 2)), torch.linalg.vector_norm(grad.reshape(N, -1), dim=1),
                      grad.flatten(1).norm(dim=-1), torch.linalg.vector_norm(grad[1])]
        JointOnPurpose().norm()
        ens.stacked.fc1.weight.norm()  # a parameter, not a gradient: documented as the user's own reduction
    assert not joint_norm_warnings(caught)
    want = torch.stack([torch.linalg.vector_norm(grad[i]) for i in range(N)])
    for value in per_member[:3]:
        torch.testing.assert_close(value, want, rtol=1e-6, atol=0)


def test_a_model_with_norms_traced_after_a_batched_module_exists_matches_the_loop():
    # torch.linalg's norms are watched while batched modules exist: tracing, compiling and scripting see torch's own
    batched_and_members()

    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return F.normalize(h, dim=-1) + torch.linalg.vector_norm(h, dim=-1, keepdim=True) + h.norm()

    torch.manual_seed(0)
    models = [Normed() for _ in range(N)]
    x = torch.randn(5, 8)
    graph = planner.trace(models[0], (x,))
    targets = [n.target for n in graph.gm.graph.nodes if n.op == "call_function"]
    assert torch._C._linalg.linalg_vector_norm in targets  # torch's function, not the watcher
    ens = executor.build(planner.propose(graph, n_members=N, input_mode="shared"), copy.deepcopy(models))
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in models]), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script's: it still resolves torch's norms
        scripted = torch.jit.script(lambda_free_norm)
    torch.testing.assert_close(scripted(x), lambda_free_norm(x))


def lambda_free_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, 2.0, [1]) + torch.linalg.norm(t)


# --- 2. prune / spectral_norm / weight_norm / parametrize on the stacked state --------------------

class Zero(nn.Module):
    def forward(self, w):
        return w * 0


REPARAMETRIZE = {
    "prune.l1_unstructured": (lambda s: prune.l1_unstructured(s.fc1, "weight", amount=0.9), "prune"),
    "prune.global_unstructured": (lambda s: prune.global_unstructured(
        [(s.fc1, "weight"), (s.fc2, "weight")], pruning_method=prune.L1Unstructured, amount=0.5), "prune"),
    "prune of a bias": (lambda s: prune.random_unstructured(s.fc1, "bias", amount=0.5), "prune"),
    "spectral_norm": (lambda s: torch.nn.utils.spectral_norm(s.fc1), "spectral_norm"),
    "weight_norm": (lambda s: torch.nn.utils.weight_norm(s.fc1), "weight_norm"),
    "parametrizations.spectral_norm": (lambda s: parametrizations.spectral_norm(s.fc1), "parametrize"),
    "parametrizations.weight_norm": (lambda s: parametrizations.weight_norm(s.fc1), "parametrize"),
    "parametrizations.orthogonal": (lambda s: parametrizations.orthogonal(s.fc2), "parametrize"),  # writes first
    "register_parametrization": (lambda s: parametrize.register_parametrization(s.fc1, "weight", Zero()), "parametrize"),
}


@pytest.mark.parametrize("name", list(REPARAMETRIZE))
def test_reparametrizing_the_stacked_state_is_refused_and_leaves_it_as_it_was(name):
    # before: a warning that a hook never fires (or none), then a KeyError from members.tree_tensor at the next call
    apply, util = REPARAMETRIZE[name]
    ens, members = batched_and_members()
    before = list(ens.named_parameters())
    values = [p.detach().clone() for _, p in before]
    keys = list(ens.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's old weight_norm
        with pytest.raises(MemberError, match=rf"torch\.nn\.utils\.{util}.*each member before planning"):
            apply(ens.stacked)
    after = list(ens.named_parameters())
    assert [k for k, _ in after] == [k for k, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))
    assert all(torch.equal(v, p) for v, (_, p) in zip(values, after)) and list(ens.state_dict()) == keys
    # the batched module still trains as N separate runs
    data = batches(steps=2)
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        loss_of(ens, x, y, batched=True).backward()
        opt.step()
    for i, m in enumerate(members):
        own = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in data:
            own.zero_grad()
            loss_of(m, x[i], y[i], batched=False).backward()
            own.step()
    assert worst_error(ens, members) < 1e-5


def test_a_state_tensor_taken_out_after_build_is_named_at_the_next_call():
    ens, members = batched_and_members()
    x = torch.randn(N, 5, 8)
    weight = ens.stacked.fc1.weight
    del ens.stacked.fc1.weight
    with pytest.raises(MemberError, match=r"no tensor 'fc1\.weight'.*put back"):
        ens(x)
    ens.stacked.fc1.weight = weight  # the fix the error names
    torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]), rtol=1e-5, atol=1e-6)


# --- 3. the norm-statistics table taken from planner.capability ---------------------------------

class SharedInstanceNorm(nn.Module):
    def __init__(self, mean, var):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("rm", mean)
        self.register_buffer("rv", var)

    def forward(self, x):
        return F.instance_norm(self.fc(x).transpose(1, 2), self.rm, self.rv)  # use_input_stats: True by default


def test_instance_norm_updating_a_buffer_members_share_is_refused():
    # before: members.written_state read F.instance_norm's flag as False when not passed, so the build went on and the
    # shared running mean came out 0.065 off the member loop's (which updates the one tensor member after member)
    mean, var = torch.zeros(4), torch.ones(4)
    torch.manual_seed(0)
    members = [SharedInstanceNorm(mean, var) for _ in range(N)]
    x = torch.randn(2, 6, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    with pytest.raises(MemberError, match="hold one tensor as buffer `rm`"):
        executor.build(plan, members)
