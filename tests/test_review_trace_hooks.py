"""What a trace runs once and keeps no trace of, checked against plain torch: autograd hooks set inside forward()
(a gradient reversal by Tensor.register_hook, lossy saved-tensor hooks) are refused where the batched module
would train with the plain gradient; the autograd.Function doing the same and save_on_cpu train as the loop."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner import MemberError, TraceError

torch.set_num_threads(1)
N = 3


def _loop_grads(members, x):
    return _loop_grads_of(members, x)


def _batched_grads(members, x):
    return _batched_grads_of(planner.propose(planner.trace(members[0], (x,)), n_members=N), members, x)


def _batched_grads_of(plan, members, x, pick=lambda out: out):
    """The batched module's gradients of sum(pick(out)**2) per stacked parameter ([N, ...])."""
    ens = executor.build(plan, members)
    pick(ens(x)).pow(2).sum().backward()
    return {k: p.grad for k, p in ens.named_stacked_parameters()}


def _loop_grads_of(members, x, pick=lambda out: out):
    """Each member's own gradients of sum(pick(out)**2), as a torch training loop computes them (on copies)."""
    out = {}
    for m in [copy.deepcopy(m) for m in members]:
        pick(m(x)).pow(2).sum().backward()
        for k, p in m.named_parameters():
            out.setdefault(k, []).append(p.grad)
    return {k: torch.stack(v) for k, v in out.items()}


# --- 1. autograd hooks in forward() --------------------------------------------------------------------------

class HookScaled(nn.Module):
    """A gradient scale on an activation (MuZero's, a DANN reversal with -1): eager backward runs it."""

    def __init__(self, factor=0.1):
        super().__init__()
        self.fc1, self.fc2, self.factor = nn.Linear(8, 16), nn.Linear(16, 4), factor

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * self.factor)
        return self.fc2(h)


class GradScale(torch.autograd.Function):
    """The fix the refusal names: the same scale as an autograd.Function, which stagewise keeps with its backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(factor)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0], None


class FunctionScaled(HookScaled):
    """The factor a buffer, which may differ per member (a sweep of the reversal's strength)."""

    def __init__(self, factor=0.1):
        super().__init__(factor)
        del self.factor
        self.register_buffer("factor", torch.tensor(factor))

    def forward(self, x):
        return self.fc2(GradScale.apply(torch.relu(self.fc1(x)), self.factor))


class LossySaved(nn.Module):
    """Activation compression: tensors saved for backward packed to bfloat16 (the gradients move by ~1e-3)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 4)

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t.float()):
            h = torch.tanh(self.fc1(x))
            return self.fc2(h * h)


class SavedOnCpu(LossySaved):
    def forward(self, x):
        with torch.autograd.graph.save_on_cpu():
            h = torch.tanh(self.fc1(x))
            return self.fc2(h * h)


def test_a_tensor_hook_in_forward_is_refused_where_it_changes_the_gradient():
    torch.manual_seed(0)
    members, x = [HookScaled() for _ in range(N)], torch.randn(5, 8)
    want = _loop_grads(members, x)
    unhooked = [copy.deepcopy(m) for m in members]
    for m in unhooked:
        m.factor = 1.0
    # the hook matters: the loop's fc1 gradient is a tenth of the graph's own (what the batched module trained with)
    torch.testing.assert_close(want["fc1.weight"], 0.1 * _loop_grads(unhooked, x)["fc1.weight"], rtol=1e-5, atol=1e-7)
    with pytest.raises(TraceError, match=r"Tensor\.register_hook.*autograd\.Function"):
        planner.trace(members[0], (x,))
    with torch.no_grad():  # planned without gradients the guarded hook does not run; build's trace sees it
        plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(TraceError, match=r"Tensor\.register_hook"):
            executor.build(plan, members)


def test_the_autograd_function_the_refusal_names_trains_as_the_loop():
    torch.manual_seed(0)
    factors = [0.1, -1.0, 0.5]  # a scale, a reversal, another scale
    members, x = [FunctionScaled(f) for f in factors], torch.randn(5, 8)
    got, want = _batched_grads(members, x), _loop_grads(members, x)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    hooked = [HookScaled(f) for f in factors]
    for h, m in zip(hooked, members):
        h.load_state_dict({k: v for k, v in m.state_dict().items() if k != "factor"})
    torch.testing.assert_close(_loop_grads(hooked, x)["fc1.weight"], want["fc1.weight"], rtol=1e-5, atol=1e-7)


def test_lossy_saved_tensor_hooks_in_forward_are_refused():
    torch.manual_seed(0)
    members, x = [LossySaved() for _ in range(N)], torch.randn(5, 8)
    with pytest.raises(TraceError, match=r"saved_tensors_hooks.*save_on_cpu"):
        planner.trace(members[0], (x,))


def test_save_on_cpu_in_forward_trains_as_the_loop():
    torch.manual_seed(0)
    members, x = [SavedOnCpu() for _ in range(N)], torch.randn(5, 8)
    got, want = _batched_grads(members, x), _loop_grads(members, x)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# --- 2. a Python branch on an integer buffer's value -------------------------------------------------------------

class ActNormInit(nn.Module):
    """Glow's ActNorm (rosinality/glow-pytorch): a data-dependent init guarded by a uint8 buffer's value."""

    def __init__(self):
        super().__init__()
        self.loc, self.scale = nn.Parameter(torch.zeros(1, 3, 1, 1)), nn.Parameter(torch.ones(1, 3, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if self.initialized.item() == 0:
            with torch.no_grad():
                flat = x.transpose(0, 1).reshape(3, -1)
                self.loc.data.copy_(-flat.mean(1).view(1, 3, 1, 1))
                self.scale.data.copy_(1 / (flat.std(1).view(1, 3, 1, 1) + 1e-6))
            self.initialized.fill_(1)
        return self.scale * (x + self.loc)


class CountBranch(nn.Module):
    """A running normaliser that skips the mean on its first call: `if self.count.item() == 0` (int64)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.tensor(0))
        self.register_buffer("mean", torch.full((4,), 0.5))
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        if self.count.item() == 0:
            return self.l(x)
        return self.l(x - self.mean)


class SignBranch(nn.Module):
    """`if self.s.item() > 0` with a small positive s: only zero or a sign flip takes the other side."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.tensor(0.1))
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x) * (2.0 if self.s.item() > 0 else -1.0)


@pytest.mark.parametrize("make, x, setup", [
    (ActNormInit, torch.randn(4, 3, 5, 5), lambda m: m(torch.randn(8, 3, 5, 5) * 3)),  # member 0 initialised
    (CountBranch, torch.randn(5, 4), lambda m: m.count.fill_(7)),  # member 0 resumed from a checkpoint
    (SignBranch, torch.randn(5, 4), lambda m: None),
], ids=["glow_actnorm_uint8", "count_int64", "float_sign"])
def test_a_branch_on_a_buffer_value_member_0_holds_apart_is_refused_at_build(make, x, setup):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    setup(members[0])
    for m in members[1:]:  # the others on the branch's other side, as fresh members are
        for name, b in m.named_buffers():
            if name in ("initialized", "count", "s"):
                b.fill_(0)
    # the loop's member 1 against member 1 on member 0's side of the branch (what a graph baked from member 0 runs)
    as_member0 = copy.deepcopy(members[1])
    for name, b in as_member0.named_buffers():
        b.copy_(dict(members[0].named_buffers())[name])
    with torch.no_grad():
        assert (copy.deepcopy(members[1])(x) - as_member0(x)).abs().max() > 0.05
    # member 0's graph writes no state (its side of the branch stays taken), so the trace keeps it and the build, which
    # traces each member with its own buffers, refuses the members on the other side, naming the first
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    with pytest.raises(MemberError, match=r"member 1 with its own buffers .*than member 0"):
        executor.build(plan, members)


def test_ordinary_buffers_read_as_tensors_are_not_refused():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)
            self.register_buffer("scale", torch.tensor(0.1))
            self.register_buffer("steps", torch.tensor(3))

        def forward(self, x):
            return self.head(self.bn(self.conv(x)).relu().mean((2, 3))) * self.scale + self.steps

    members, x = [Net().eval() for _ in range(N)], torch.randn(2, 3, 8, 8)
    for i, m in enumerate(members):
        m.steps.fill_(i)  # member 0's 0 and the others' values: no branch, nothing to refuse
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), n_members=N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


# --- 3. a tensor forward() stores as a plain attribute -----------------------------------------------------------

class KLEncoder(nn.Module):
    """A VAE encoder keeping its KL term as `self.kl` for the loss to read (the avandekleut tutorial's)."""

    def __init__(self, loop_over_rows=False):
        super().__init__()
        self.l1, self.mu, self.logvar, self.kl = nn.Linear(16, 32), nn.Linear(32, 3), nn.Linear(32, 3), 0
        self.loop_over_rows = loop_over_rows

    def forward(self, x):
        if self.loop_over_rows:  # a loop over a size: torch.fx fails, torch.export traces it
            h = torch.cat([torch.relu(self.l1(x[i:i + 1])) for i in range(x.shape[0])])
        else:
            h = torch.relu(self.l1(x))
        mu, logvar = self.mu(h), self.logvar(h)
        self.kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum()
        return mu


class VAE(nn.Module):
    def __init__(self, loop_over_rows=False):
        super().__init__()
        self.encoder, self.decoder = KLEncoder(loop_over_rows), nn.Linear(3, 16)
        self.maps = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.cache = None

    def forward(self, x):
        if self.cache is None or self.cache.shape[0] != x.shape[1]:  # a table sized by the input, filled once
            self.cache = torch.arange(x.shape[1], dtype=x.dtype)
        return self.decoder(self.encoder(x + self.cache))


@pytest.mark.parametrize("loop_over_rows", [False, True], ids=["fx", "export"])
def test_a_tensor_stored_as_an_attribute_warns_once_and_the_outputs_match(loop_over_rows):
    torch.manual_seed(0)
    members, x = [VAE(loop_over_rows) for _ in range(N)], torch.randn(6, 16)
    with pytest.warns(UserWarning) as record:
        graph = planner.trace(members[0], (x,))
    assert graph.tracer == ("export" if loop_over_rows else "fx")
    ours = [str(w.message) for w in record if "stores a tensor" in str(w.message)]
    assert len(ours) == 1 and "KLEncoder.kl (model.encoder.kl)" in ours[0] and "out, kl = model(x)" in ours[0], ours
    ens = executor.build(planner.propose(graph, n_members=N), members)  # not refused: outputs as the loop's
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([copy.deepcopy(m)(x) for m in members]), rtol=1e-5, atol=1e-6)


def test_one_warning_per_attribute_of_many_layers():
    class Bayes(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.l, self.log_prior = nn.Linear(i, o), 0

        def forward(self, x):
            self.log_prior = -0.5 * (self.l.weight ** 2).sum()
            return self.l(x)

    net = nn.Sequential(Bayes(8, 16), nn.ReLU(), Bayes(16, 3))
    with pytest.warns(UserWarning) as record:
        planner.trace(net, (torch.randn(5, 8),))
    ours = [str(w.message) for w in record if "stores a tensor" in str(w.message)]
    assert len(ours) == 1 and "model.0.log_prior, model.2.log_prior" in ours[0], ours


# --- 4. a view of a parameter passed into a leaf module ----------------------------------------------------------

class LatentsNorm(nn.Module):
    """Perceiver: learned latents expanded over the batch into PreNorm's LayerNorm."""

    def __init__(self, d=16):
        super().__init__()
        self.latents, self.norm, self.proj = nn.Parameter(torch.randn(6, d)), nn.LayerNorm(d), nn.Linear(8, d)

    def forward(self, x):
        return self.norm(self.latents.unsqueeze(0).expand(x.shape[0], -1, -1)) + self.proj(x).mean(1, keepdim=True)


class LatentsAttention(nn.Module):
    """Perceiver / DETR: learned queries (a view of a parameter) into nn.MultiheadAttention."""

    def __init__(self, d=16):
        super().__init__()
        self.latents, self.inp = nn.Parameter(torch.randn(1, 6, d)), nn.Linear(8, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        kv = self.inp(x)
        return self.attn(self.latents.expand(x.shape[0], -1, -1), kv, kv, need_weights=False)[0]


@pytest.mark.parametrize("make", [LatentsNorm, LatentsAttention])
def test_a_parameter_view_into_a_leaf_module_traces_and_trains_as_the_loop(make):
    torch.manual_seed(0)
    members, x = [make().eval() for _ in range(N)], torch.randn(2, 9, 8)
    graph = planner.trace(members[0], (x,))
    assert sum(graph.dag.nodes[n]["flops"] for n in graph.compute_nodes) > 0  # FLOPs still counted
    got, want = _batched_grads(members, x), _loop_grads(members, x)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# --- 5. a new autograd leaf returned by forward() ----------------------------------------------------------------

class Siren(nn.Module):
    """SIREN (vsitzmann/siren): returns the coordinates it made a leaf, for d output / d coords."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(2, 32), nn.Linear(32, 1)

    def forward(self, coords):
        coords = coords.clone().detach().requires_grad_(True)
        return self.l2(torch.sin(30 * self.l1(coords))), coords


class SirenPlain(Siren):
    """The fix the refusal names: the caller's input requires grad."""

    def forward(self, coords):
        return self.l2(torch.sin(30 * self.l1(coords)))


def test_a_new_leaf_returned_warns_and_the_named_fix_differentiates_as_the_loop():
    torch.manual_seed(0)
    c, members = torch.rand(20, 2) * 2 - 1, [Siren() for _ in range(N)]
    out, coords = members[0](c)
    assert coords.requires_grad and coords.is_leaf  # what the caller differentiates with respect to, in the loop
    with pytest.warns(UserWarning, match=r"new autograd leaf.*requires_grad_\(\)"):
        plan = planner.propose(planner.trace(members[0], (c,)), n_members=N)
    # not refused: the outputs and the parameters' gradients are the loop's
    got, want = _batched_grads_of(plan, members, c, lambda out: out[0]), _loop_grads_of(members, c, lambda out: out[0])
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    plain = [SirenPlain() for _ in range(N)]
    for p, m in zip(plain, members):
        p.load_state_dict(m.state_dict())
    plan = planner.propose(planner.trace(plain[0], (c,)), n_members=N, input_mode="per_member")
    ens = executor.build(plan, plain)
    cs = c.expand(N, -1, -1).clone().requires_grad_()
    got = torch.autograd.grad(ens(cs).sum(), cs)[0]
    want = []
    for m in plain:
        ci = c.clone().requires_grad_()
        want.append(torch.autograd.grad(m(ci).sum(), ci)[0])
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    loop = []
    for m in members:  # the same derivative as SIREN's own, taken with respect to the leaf it returns
        out, coords = m(c)
        loop.append(torch.autograd.grad(out.sum(), coords)[0])
    torch.testing.assert_close(got, torch.stack(loop), rtol=1e-5, atol=1e-5)


def test_a_new_leaf_returned_traced_without_gradients_runs_inference_as_the_loop():
    torch.manual_seed(0)
    c, members = torch.rand(20, 2), [Siren() for _ in range(N)]
    with torch.no_grad():
        ens = executor.build(planner.propose(planner.trace(members[0], (c,)), n_members=N), members)
        out, coords = ens(c)
        torch.testing.assert_close(out, torch.stack([m(c)[0] for m in members]), rtol=1e-5, atol=1e-6)
