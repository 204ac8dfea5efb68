"""Silent wrong answers found in session 35's reviews and known items, each against the plain member loop."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError, OptimizerError, PlanMismatchError

N = 3


def _members(cls, n: int = N, **kw) -> list[nn.Module]:
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(cls(**kw))
    return out


def _build(members, x, strategy=None, input_mode="shared"):
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, len(members), input_mode=input_mode)
    if strategy is not None:
        for st in plan.stages:
            plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    return executor.build(plan, members)


def _calls_match(ens, loop, calls):
    """Each call (a tuple of inputs, shared) through `ens` and the member loop, each followed by a backward of the sum
    of squares: outputs and every parameter's accumulated gradient against the loop's."""
    for call in calls:
        out = ens(*call)
        ref = torch.stack([m(*call) for m in loop])
        torch.testing.assert_close(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        for name, p in ens.named_stacked_parameters():
            torch.testing.assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in loop]), msg=name)


def _same_state(ens, loop):
    for k, v in ens.state_dict().items():
        k = k.removeprefix("stacked.")
        want = torch.stack([m.state_dict()[k] for m in loop])
        torch.testing.assert_close(v, want, msg=k, rtol=1e-5, atol=1e-6)


class CheckpointedNorm(nn.Module):
    """A block with a BatchNorm run through torch.utils.checkpoint (memory-bound training), a BatchNorm after it
    outside the region; `when_training`: checkpointed only in training mode, as Hugging Face and timm do."""

    def __init__(self, reentrant=False, when_training=False, momentum=0.1):
        super().__init__()
        self.reentrant, self.when_training = reentrant, when_training
        self.a = nn.Linear(4, 8)
        self.blk = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU())
        self.bn2 = nn.BatchNorm1d(8)
        self.o = nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if self.training or not self.when_training:
            h = checkpoint(self.blk, h, use_reentrant=self.reentrant)
        else:
            h = self.blk(h)
        return self.o(self.bn2(h))


@pytest.mark.parametrize("strategy", [None, "loop"])
@pytest.mark.parametrize("kw", [{}, {"when_training": True}, {"momentum": None}])
def test_checkpointed_batchnorm_updates_twice_as_the_loop(kw, strategy):
    """Eager torch recomputes a checkpointed region in backward, so a BatchNorm inside it updates its statistics a
    second time per step (num_batches_tracked 6 after 3 steps, eval outputs 0.046 off before): the batched module
    repeats that update when backward reaches its outputs; the BatchNorm outside the region updates once."""
    members = _members(CheckpointedNorm, **kw)
    for m in members:  # traced in eval where the region exists only in training (the trace sees no checkpoint)
        m.train(not kw.get("when_training"))
    x = torch.randn(5, 4)
    loop = [copy.deepcopy(m).train() for m in members]
    ens = _build(members, x, strategy)
    ens.train()
    for step in range(3):
        xs = x * (step + 1) + step
        ref = torch.stack([m(xs) for m in loop])
        out = ens(xs)
        torch.testing.assert_close(out, ref)
        (ref ** 2).sum().backward()
        (out ** 2).sum().backward()
    _same_state(ens, loop)
    assert loop[0].blk[1].num_batches_tracked.item() == 6
    ens.eval()
    for m in loop:
        m.eval()
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]))


def test_checkpointed_batchnorm_calls_without_backward_and_backward_twice():
    """No backward: one update (the loop recomputes nothing). Two calls, then one backward of both: each call's
    region recomputed. retain_graph and a second backward: a third update; autograd.grad then backward (a
    gradient penalty) works through the graph the second update left."""
    members = _members(CheckpointedNorm, momentum=0.3)
    x = torch.randn(6, 4)
    loop = [copy.deepcopy(m) for m in members]
    ens = _build(members, x)
    ens.train()
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]))  # no backward
    _same_state(ens, loop)
    outs = [ens(x * 2), ens(x - 1)]
    refs = [torch.stack([m(x * 2) for m in loop]), torch.stack([m(x - 1) for m in loop])]
    sum(r.sum() for r in refs).backward()
    sum(o.sum() for o in outs).backward()
    _same_state(ens, loop)
    out, ref = ens(x + 1), torch.stack([m(x + 1) for m in loop])
    ref.sum().backward(retain_graph=True)
    out.sum().backward(retain_graph=True)
    ref.square().sum().backward()
    out.square().sum().backward()
    _same_state(ens, loop)
    xg = (x * 0.5).requires_grad_()
    out = ens(xg)
    refs = [m(xg) for m in loop]
    g_ens, = torch.autograd.grad(out.sum(), xg, create_graph=True)
    g_ref, = torch.autograd.grad(sum(r.sum() for r in refs), xg, create_graph=True)
    torch.testing.assert_close(g_ens, g_ref)
    (out.sum() + g_ens.square().sum()).backward()
    (sum(r.sum() for r in refs) + g_ref.square().sum()).backward()
    _same_state(ens, loop)
    for name, p in ens.named_stacked_parameters():
        torch.testing.assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in loop]), msg=name)


class CheckpointedInstanceNorm(nn.Module):
    """An InstanceNorm tracking running statistics inside a checkpointed region."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(2, 4, 3)
        self.norm = nn.InstanceNorm1d(4, track_running_stats=True, affine=True)

    def forward(self, x):
        return checkpoint(lambda h: torch.relu(self.norm(self.c(h))), x, use_reentrant=False).mean(-1)


def test_checkpointed_instance_norm_updates_twice_as_the_loop():
    members = _members(CheckpointedInstanceNorm)
    x = torch.randn(3, 2, 9)
    loop = copy.deepcopy(members)
    ens = _build(members, x)
    for step in range(3):
        ref = torch.stack([m(x + step) for m in loop])
        out = ens(x + step)
        torch.testing.assert_close(out, ref)
        ref.sum().backward()
        out.sum().backward()
    _same_state(ens, loop)


class HParams:
    """A plain settings class of the script's (not a dataclass, Namespace or *Config)."""

    def __init__(self):
        self.scale = 2.0


class HeldSettings(nn.Module):
    """Reads a plain settings object and a dict every call; keeps a per-call log in a dict nothing computes with."""

    def __init__(self, hp, cfg):
        super().__init__()
        self.hp, self.cfg = hp, cfg
        self.l = nn.Linear(4, 4)
        self.log = {"last_rows": 0}

    def forward(self, x):
        self.log["last_rows"] = 0 * self.log["last_rows"]  # written by forward(): not a setting
        return self.l(x) * self.hp.scale + self.cfg["shift"]


@pytest.mark.parametrize("which", ["object", "dict"])
def test_plain_settings_object_or_dict_changed_after_build_refused(which):
    """A plain class's object or a dict the members hold, changed after build: the loop read the new value, the
    batched module the traced one (4.19 off): refused naming the field; set back, calls run again."""
    hp, cfg = HParams(), {"scale": 9.0, "shift": 1.0}
    members = _members(HeldSettings, hp=hp, cfg=cfg)
    x = torch.randn(2, 4)
    ens = _build(members, x)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))  # the loop wrote its log: still runs
    if which == "object":
        hp.scale = 5.0
    else:
        cfg["shift"] = 3.0
    with pytest.raises(ExecutionError, match="scale" if which == "object" else "shift"):
        ens(x)
    hp.scale, cfg["shift"] = 2.0, 1.0
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


class NonPersistentScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4) * 1.5, persistent=False)

    def forward(self, x):
        return self.bn(self.fc(x)) * self.scale


def test_deep_copied_archive_members_build(tmp_path):
    """copy.deepcopy of a torch.export module registers a non-persistent buffer as persistent: such copies were refused
    as "a plan made for another model" (the state_dict gained a key); the graph is the same, they build, and each
    member's own buffer values run."""
    import warnings  # noqa: PLC0415
    path = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(NonPersistentScale().train(), (torch.randn(5, 8),)), str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = planner.load_source(str(path))
        plan = planner.propose(planner.trace(src.model, src.example_inputs), N)
    members = src.members(N)
    with torch.no_grad():
        for i, m in enumerate(members):
            m.scale.fill_(i + 1.0)
    ens = executor.build(plan, copy.deepcopy(members))
    for x in (torch.randn(5, 8), torch.randn(5, 8) * 3):
        ref = torch.stack([m(x) for m in members])
        torch.testing.assert_close(ens(x), ref)


class SizeOneBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[0] == 1:  # a single sample takes another path (torch.export traces the >= 2 one)
            return -h
        return h


def test_export_plan_edited_to_accept_a_size_the_graph_does_not_hold_refused():
    """A plan file whose dynamic dim's min was edited from 2 to 1 ran size 1 through the >= 2 branch (2.1 off, no
    error): build checks sizes below 2 again and refuses, naming the dim; the plan as made still builds and refuses
    size 1 at the call, and a plan whose dims hold at size 0 builds and runs there."""
    members = [SizeOneBranch().eval() for _ in range(N)]
    x = torch.randn(3, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    assert plan.tracer == "export"
    d = plan.to_json()
    assert [dd["min"] for dd in d["inputs"][0]["dynamic_dims"] if dd["dim"] == 0] == [2]
    for dd in d["inputs"][0]["dynamic_dims"]:
        dd["min"] = 1
    with pytest.raises(PlanMismatchError, match=r"size 1 for dim 0 of input 'x'.*min 1, planning found 2"):
        executor.build(planner.Plan.from_json(d), members)
    ens = executor.build(plan, members)
    for call in (x, torch.randn(5, 4)):
        torch.testing.assert_close(ens(call), torch.stack([m(call) for m in members]))


def test_verify_gives_a_per_member_number_on_an_export_plan_its_traced_value(tmp_path):
    """`stagewise plan --input-mode s=per_member` on a torch.export plan was accepted and `stagewise run` then failed:
    verify made other values per member, which the plan (the number fixed at its traced value) refuses. Every member
    is given the traced value, and the plan verifies."""
    from stagewise.app import cli  # noqa: PLC0415
    model = tmp_path / "numexp.py"
    model.write_text(
        "import math, torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(4, 4)\n"
        "    def forward(self, x, s: float):\n"
        "        h = self.fc(x)\n"
        "        for t in range(x.shape[0]):\n"
        "            h = h + 0.0\n"
        "        return h * math.copysign(1.0, s)\n"
        "def build_model(): return M().eval()\n"
        "def example_inputs(): return (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), -1.5)\n")
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", str(model), "-n", "3", "--input-mode", "x=shared", "s=per_member", "-o", str(plan)]) == 0
    assert cli.main(["run", str(plan), str(model)]) == 0


class SpectralD(nn.Module):
    """A discriminator whose spectral norm's power iteration writes its buffers in training."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.fc3 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc3(torch.nn.functional.leaky_relu(self.fc1(x), 0.2))


def test_torch_func_grad_over_the_input_of_a_module_writing_its_state():
    """An R1 penalty written with torch.func (`torch.func.grad(lambda x: D(x).sum())(x)`) on a training D that
    writes state: the input-aliasing check asked a functorch wrapper for its storage (raw NotImplementedError)."""
    members = _members(SpectralD)
    loop = copy.deepcopy(members)
    x = torch.randn(N, 6, 8)
    ens = _build(members, x[0], input_mode="per_member")
    ens.train()
    for call in (x, x * 2):
        got = torch.func.grad(lambda xx: ens(xx).sum())(call)
        want = torch.stack([torch.func.grad(lambda xx: m(xx).sum())(call[i]) for i, m in enumerate(loop)])
        torch.testing.assert_close(got, want)
    _same_state(ens, loop)


class QuantizedWeight(nn.Module):
    """Weight-only int8: a qint8 buffer with a scale of its own, dequantized in forward()."""

    def __init__(self, spread=1.0):
        super().__init__()
        w = torch.randn(4, 6) * spread
        self.register_buffer("qw", torch.quantize_per_tensor(w, float(w.abs().max() / 127), 0, torch.qint8))
        self.b = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.qw.dequantize(), self.b)


class QuantizesInForward(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(6, 8)
        self.register_buffer("s", torch.full((8,), 0.05))
        self.register_buffer("z", torch.zeros(8, dtype=torch.long))

    def forward(self, x):
        h = self.fc(x)
        if self.how == "tensor":  # numbers: one grid for every member
            return torch.quantize_per_tensor(h, 0.05, 0, torch.quint8).dequantize()
        if self.how == "buffers":  # each member's own scale
            return torch.quantize_per_tensor(h, self.s[0], self.z[0], torch.quint8).dequantize()
        if self.how == "dynamic":
            return torch.quantize_per_tensor_dynamic(h, torch.quint8, False).dequantize()
        return torch.quantize_per_channel(h, self.s, self.z, 1, torch.qint8).dequantize()


@pytest.mark.parametrize("how", ["buffers", "dynamic", "channel"])
def test_quantized_values_refused_at_trace(how):
    """torch's stack puts quantized tensors on the first one's scale: members' quantized outputs came back on member
    0's grid (16.0 off), a wide stage's quantize -> dequantize too (4.12), per-channel ones crashed the trace raw."""
    with pytest.raises(planner.TraceError, match=r"makes quantized tensors \(node 'quantize_per_.*fake quantization"):
        planner.trace(QuantizesInForward(how), (torch.randn(5, 6),))


@pytest.mark.parametrize("strategy", [None, "loop", "wide"])
def test_quantizing_on_a_grid_of_numbers_runs(strategy):
    """A scale and zero point written as numbers are every member's: such a quantize -> dequantize stacks exactly."""
    members = _members(QuantizesInForward, how="tensor")
    x = torch.randn(5, 6)
    ens = _build(members, x, strategy)
    with torch.no_grad():
        for call in (x, x[:3] * 2):
            torch.testing.assert_close(ens(call), torch.stack([m(call) for m in members]))


def test_quantized_state_refused_at_trace_and_build():
    """Members holding qint8 weights with scales of their own were stacked onto member 0's scale (10.3 off)."""
    members = [QuantizedWeight(spread=(i + 1) ** 2) for i in range(N)]
    x = torch.randn(5, 6)
    with pytest.raises(planner.TraceError, match=r"reads quantized state \(qw\)"):
        planner.trace(members[0], (x,))
    plain = planner.propose(planner.trace(nn.Linear(6, 4), (x,)), N)
    with pytest.raises(Exception, match=r"reads quantized state \(qw\)"):
        executor.build(plain, members)


class PaddedLookup(nn.Module):
    """An embedding with a padding row: nn.Embedding under torch.export (a no_grad region), or F.embedding under fx."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.e = nn.Embedding(20, 5, padding_idx=0)
        self.fc = nn.Linear(5, 2)

    def forward(self, ids):
        if self.how == "export":
            with torch.no_grad():
                n_real = (ids != 0).sum(-1, keepdim=True).clamp(min=1)
            return self.fc(self.e(ids)).sum(1) / n_real
        p = 0 if self.how == "fx" else -1
        return self.fc(torch.nn.functional.embedding(ids, self.e.weight, padding_idx=p,
                                                     scale_grad_by_freq=self.how == "fx_last")).sum(1)


@pytest.mark.parametrize("how", ["export", "fx", "fx_last"])
@pytest.mark.parametrize("strategy", ["wide", None])
def test_shared_ids_keep_every_members_padding_row_untrained(how, strategy):
    """Shared ids under `wide` came back N-first from the index check, and torch's both-batched embedding rule trained
    members 1..N-1's padding rows (0.36 / 0.48, the whole row; the loop: 0): they stay shared."""
    members = _members(PaddedLookup, how=how)
    loop = copy.deepcopy(members)
    ids = torch.tensor([[1, 3, 3, 0], [5, 0, 7, 19]])
    ens = _build(members, ids, strategy)
    _calls_match(ens, loop, [(ids,), (torch.tensor([[0, 2, 19, 0], [4, 4, 0, 1], [19, 0, 0, 6]]),)])


class LabelEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.lab = nn.Embedding(5, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.fc(x + self.lab(y))


@pytest.mark.parametrize("strategy", ["vmap", "wide", "loop"])
def test_per_sample_gradients_through_an_embedding_under_the_callers_vmap(strategy):
    """vmap(grad(functional_call(ens, ...))) with each sample's own label: the index check read its numbers with
    .item() under the caller's vmap (a raw vmap error); an index out of range there was not checked at all, and
    read another member's row (the members' tables are one under torch.func's rule): refused as the loop refuses."""
    from torch.func import functional_call, grad, vmap  # noqa: PLC0415
    members = _members(LabelEmbedding)
    b = 4
    x, y = torch.randn(N, b, 8), torch.randint(0, 5, (N, b))
    graph = planner.trace(copy.deepcopy(members[0]), (x[0], y[0]))
    plan = planner.propose(graph, N, input_mode="per_member")
    for st in plan.stages:
        plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    ens = executor.build(plan, copy.deepcopy(members))
    params = {k: v.detach() for k, v in ens.named_parameters()}

    def loss(p, xb, yb):
        return functional_call(ens, p, (xb[:, None], yb[:, None])).square().sum()
    for call_x, call_y in ((x, y), (x * 2, (y + 1) % 5)):
        got = vmap(grad(loss), in_dims=(None, 1, 1))(params, call_x, call_y)  # [B, N, ...]
        for i, m in enumerate(members):
            mp = {k: v.detach() for k, v in m.named_parameters()}
            want = vmap(grad(lambda p, xb, yb: functional_call(m, p, (xb[None], yb[None])).square().sum()),
                        in_dims=(None, 0, 0))(mp, call_x[i], call_y[i])
            for k, v in want.items():
                torch.testing.assert_close(got["stacked." + k][:, i], v, msg=k)
    bad = y.clone()
    bad[0, 1] = 5  # one past the table: the loop raises IndexError
    if strategy != "loop":
        with pytest.raises(planner.InputError, match=r"under the caller's transform.*hold 5, outside \[0, 5\)"):
            with torch.no_grad():
                vmap(lambda xb, yb: ens(xb[:, None], yb[:, None])[:, 0], in_dims=1, out_dims=1)(x, bad)


class Guidance(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 8)
        self.lab = nn.Linear(1, 8)

    def forward(self, x, w: float):
        ec = self.net(x) + self.lab.weight.sum()
        eu = self.net(x)
        return eu + w * (ec - eu)  # classifier-free guidance with scale w


@pytest.mark.parametrize("strategy", ["vmap", "wide", "loop"])
def test_forward_mode_and_callers_vmap_over_a_per_member_number(strategy):
    """torch.func.jvp / jacfwd with respect to a per-member Python number input: the loop strategy turned its [N]
    tensor into numbers and dropped the tangent (1.89 off, the whole derivative); vmap over a grid of them crashed
    raw there (a BatchedTensor has no data pointer)."""
    from torch.func import jacfwd, jvp, vmap  # noqa: PLC0415
    members = _members(Guidance)
    x = torch.randn(N, 4, 8)
    graph = planner.trace(copy.deepcopy(members[0]), (x[0], 2.0))
    plan = planner.propose(graph, N, input_mode="per_member")
    for st in plan.stages:
        plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    ens = executor.build(plan, copy.deepcopy(members))
    for w in (torch.tensor([1.0, 2.5, 4.0]), torch.tensor([0.5, -1.0, 3.0])):
        def loop(v):
            return torch.stack([m(x[i], v[i]) for i, m in enumerate(members)])
        torch.testing.assert_close(jvp(lambda v: ens(x, v), (w,), (torch.ones(N),))[1],
                                   jvp(loop, (w,), (torch.ones(N),))[1])
        torch.testing.assert_close(jacfwd(lambda v: ens(x, v))(w), jacfwd(loop)(w))
        grid = torch.stack([w, w * 2])
        torch.testing.assert_close(vmap(lambda v: ens(x, v))(grid), torch.stack([loop(v) for v in grid]))


class NullLabel(nn.Module):
    """Classifier-free guidance: the null label is the embedding's padding row (loaded weights: not zero)."""

    def __init__(self):
        super().__init__()
        self.lab = nn.Embedding(5, 8, padding_idx=4)
        with torch.no_grad():
            self.lab.weight[4].normal_()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y, drop):
        y = torch.where(drop, torch.full_like(y, 4), y)
        return self.fc(x + self.lab(y))


@pytest.mark.parametrize("strategy", ["vmap", "wide", "loop"])
def test_forward_mode_derivative_keeps_the_padding_rows_tangent(strategy):
    """jvp with respect to the parameters through a lookup of the padding row: the padding guard detached the row's
    output, which dropped its forward-mode tangent too (1.33 off; a Hessian-vector product 20.4); reverse mode still
    gives the padding row no gradient."""
    from torch.func import functional_call, jvp  # noqa: PLC0415
    members = _members(NullLabel)
    x, y = torch.randn(N, 4, 8), torch.randint(0, 4, (N, 4))
    drop = torch.zeros(N, 4, dtype=torch.bool)
    drop[:, 1] = True
    graph = planner.trace(copy.deepcopy(members[0]), (x[0], y[0], drop[0]))
    plan = planner.propose(graph, N, input_mode="per_member")
    for st in plan.stages:
        plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    ens = executor.build(plan, copy.deepcopy(members))
    params = {k: v.detach() for k, v in ens.named_parameters()}
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    for call in ((x, y, drop), (x * 2, (y + 1) % 4, ~drop)):
        got = jvp(lambda p: functional_call(ens, p, call), (params,), (tangents,))[1]
        for i, m in enumerate(members):
            mp = {k: v.detach() for k, v in m.named_parameters()}
            mt = {k: tangents["stacked." + k][i] for k in mp}
            want = jvp(lambda p: functional_call(m, p, tuple(c[i] for c in call)), (mp,), (mt,))[1]
            torch.testing.assert_close(got[i], want)
    loop = copy.deepcopy(members)
    out = ens(x, y, drop)
    ref = torch.stack([m(x[i], y[i], drop[i]) for i, m in enumerate(loop)])
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = dict(ens.named_stacked_parameters())["lab.weight"].grad
    torch.testing.assert_close(grads, torch.stack([m.lab.weight.grad for m in loop]))
    assert grads[:, 4].abs().max() == 0


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.fc1(x)))


def test_deepcopy_and_save_right_after_a_functional_call_transform():
    """copy.deepcopy(ens) / torch.save(ens) right after torch.func.grad(functional_call(ens, ...)) copied the
    transform's wrapped tensors (raw 'Cannot access storage of TensorWrapper')."""
    import io  # noqa: PLC0415
    from torch.func import functional_call, grad  # noqa: PLC0415
    members = _members(TwoLayers)
    x = torch.randn(N, 4, 8)
    ens = _build(members, x[0], input_mode="per_member")
    params = {k: v.detach() for k, v in ens.named_parameters()}
    grad(lambda p: functional_call(ens, p, (x,)).square().sum())(params)
    twin = copy.deepcopy(ens)
    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for call in (x, x * 2):
        want = torch.stack([m(call[i]) for i, m in enumerate(members)])
        for module in (ens, twin, loaded):
            torch.testing.assert_close(module(call), want)


@torch.fx.wrap
def _scaled_by_helper(mod, x):
    return mod(x) * 2


@torch.fx.wrap
def _run_packed(rnn, x, lengths):
    p = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    o, _ = rnn(p)
    return torch.nn.utils.rnn.pad_packed_sequence(o, batch_first=True, total_length=x.shape[1])[0]


class ModuleIntoHelper(nn.Module):
    """A submodule handed into a torch.fx.wrap helper (the way to hide pack_padded_sequence from the tracer)."""

    def __init__(self, rnn=False):
        super().__init__()
        self.rnn = nn.GRU(6, 8, batch_first=True) if rnn else None
        self.lin = nn.Linear(8 if rnn else 6, 6)

    def forward(self, x, lengths):
        if self.rnn is not None:
            return self.lin(_run_packed(self.rnn, x, lengths))
        return _scaled_by_helper(self.lin, x)


@pytest.mark.parametrize("rnn", [False, True])
@pytest.mark.parametrize("strategy", [None, "loop", "wide"])
def test_a_submodule_handed_into_a_wrapped_helper_runs_each_members(rnn, strategy):
    """fx records `helper(self.lin, x)` with a get_attr of the submodule, which no stage counted as state: every
    member ran member 0's layer (6.22 off; an LSTM through pack_padded_sequence 0.31)."""
    members = _members(ModuleIntoHelper, rnn=rnn)
    loop = copy.deepcopy(members)
    x, lengths = torch.randn(4, 7, 6), torch.tensor([7, 3, 5, 2])
    graph = planner.trace(copy.deepcopy(members[0]), (x, lengths))
    plan = planner.propose(graph, N)
    if strategy is not None:
        for st in plan.stages:
            plan = planner.set_options(plan, graph, st.id, strategy=strategy)
    ens = executor.build(plan, members)
    _calls_match(ens, loop, [(x, lengths), (x[:3] * 2, torch.tensor([2, 7, 4]))])


class UsesShared(nn.Module):
    def __init__(self, shared, out):
        super().__init__()
        self.shared = shared
        self.head = nn.Linear(8, out)

    def forward(self, x):
        return self.head(torch.relu(self.shared(x)))


def test_a_layer_two_models_share_built_as_two_batched_modules_warns():
    """A generator and a discriminator sharing a layer, built as two batched modules: each trains its own copy (the
    other's answers 0.074 off after one step, silently): warned, naming the parameter and the fix. Building twice
    from the same members (a train and an eval module) or from copies does not warn."""
    import warnings  # noqa: PLC0415
    x = torch.randn(4, 8)
    shared = [nn.Linear(8, 8) for _ in range(N)]
    gens = [UsesShared(s, 2) for s in shared]
    discs = [UsesShared(s, 1) for s in shared]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _build(gens, x)
        _build(gens, x)  # the same members again
        _build(copy.deepcopy(discs), x)
    assert not [w for w in caught if "earlier batched module" in str(w.message)]
    with pytest.warns(UserWarning, match=r"parameter 'shared.weight' is also a parameter of UsesShared members"):
        _build(discs, x)
    assert first is not None


class RecurrentWithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        o, _ = self.rnn(x)
        steps = torch.tensor([0.5, 1.0, 2.0])  # a constant made in forward(): the graph reads a non-state tensor
        return self.head(o[:, -3:] * steps[:, None])


def test_rnn_with_a_constant_trains():
    """Training was refused blaming 'rnn._flat_weights[0]' as an unregistered learnable tensor (nn.RNNBase's own
    list of its registered parameters) wherever the graph read a constant."""
    members = _members(RecurrentWithConstant)
    loop = copy.deepcopy(members)
    x = torch.randn(2, 5, 4)
    ens = _build(members, x)
    _calls_match(ens, loop, [(x,), (torch.randn(3, 5, 4),)])


class UncalibratedQAT(nn.Module):
    def __init__(self):
        super().__init__()
        import torch.ao.quantization as tq  # noqa: PLC0415
        self.fc = nn.Linear(6, 8)
        self.wq = tq.FakeQuantize(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.wq(self.fc.weight), self.fc.bias)


def test_a_buffer_forward_resizes_is_put_back_at_its_size():
    """An uncalibrated per-channel observer resizes its empty min_val / max_val in forward(): the trace's restore
    copied the [0] snapshot into the [8] buffer (raw RuntimeError). The buffers are put back at their size, and the
    trace answers with a StagewiseError."""
    import warnings  # noqa: PLC0415
    model = UncalibratedQAT().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            planner.trace(model, (torch.randn(5, 6),))
        except planner.StagewiseError:
            pass
    assert model.wq.activation_post_process.min_val.shape == (0,)


class DrawsWithGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, gen):
        return self.fc(x + torch.randn(x.shape, generator=gen))


def test_a_generator_input_refused_by_name():
    """A torch.Generator passed into forward() was refused blaming a Python branch and torch.export's internals."""
    with pytest.raises(planner.TraceError, match=r"an input is a torch.Generator.*per_member"):
        planner.trace(DrawsWithGenerator(), (torch.randn(2, 4), torch.Generator().manual_seed(0)))


class Float8Head(nn.Module):
    def __init__(self, s=1.0):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.register_buffer("s", torch.tensor(s))

    def forward(self, x):
        return (self.fc(x) / self.s).to(torch.float8_e4m3fn)


def test_verify_compares_float8_outputs():
    """verify crashed on float8 outputs (torch has no isfinite kernel for them)."""
    members = [Float8Head(s) for s in (0.5, 1.0, 4.0)]
    x = torch.randn(5, 6) * 3
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    report = executor.verify(plan, members, (x,))
    assert report.ok, report.to_text()


class SparseBag(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.e = nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(4, 1)

    def forward(self, ids):
        if self.how == "export":
            with torch.no_grad():  # a region: traced with torch.export
                k = (ids >= 0).float().mean()
            return self.fc(self.e(ids)).squeeze(-1) * k
        offsets = torch.arange(0, ids.numel(), ids.shape[1])
        return self.fc(torch.embedding_bag(self.e.weight, ids.flatten(), offsets, False, 0, True)[0]).squeeze(-1)


@pytest.mark.parametrize("how", ["export", "fx"])
def test_sparse_embedding_bag_training_refused_by_name(how):
    """EmbeddingBag(sparse=True) under torch.export, and torch.embedding_bag(sparse=True), failed in backward with a
    bare NotImplementedError: refused by name as nn.Embedding(sparse=True) is; inference runs."""
    members = _members(SparseBag, how=how)
    ids = torch.tensor([[1, 3, 3, 0], [5, 0, 7, 19]])
    ens = _build(members, ids)
    with torch.no_grad():
        torch.testing.assert_close(ens(ids), torch.stack([m(ids) for m in members]))
    with pytest.raises(ExecutionError, match="has sparse=True"):
        ens(ids).sum().backward()


class RenormTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, ids, table):
        return self.fc(torch.nn.functional.embedding(ids, table, max_norm=1.0)).squeeze(-1)


def test_an_input_table_renormalised_by_max_norm():
    """F.embedding(max_norm=) renormalises the rows of an input table in place: per_member, refused blaming a
    `table += ...` forward() does not hold; it runs now, writing the caller's rows as the loop does (shared: refused
    naming the write)."""
    members = _members(RenormTable)
    ids = torch.tensor([[1, 3, 3, 0], [5, 0, 7, 11]])
    graph = planner.trace(copy.deepcopy(members[0]), (ids, torch.randn(12, 3) * 3))
    plan = planner.propose(graph, N, input_mode={"ids": "shared", "table": "per_member"})
    ens = executor.build(plan, members)
    for call in (ids, ids[:1] + 1):
        tables = torch.randn(N, 12, 3) * 3
        theirs = tables.clone()
        with torch.no_grad():
            out = ens(call, tables)
            ref = torch.stack([m(call, theirs[i]) for i, m in enumerate(members)])
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(tables, theirs)
    shared = planner.propose(graph, N, input_mode={"ids": "shared", "table": "shared"})
    with pytest.raises(planner.InputError, match="writes the shared input 'table' in place"):
        executor.build(shared, members)


class NormedRecurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.utils.parametrizations.weight_norm(nn.LSTM(4, 6, batch_first=True), "weight_hh_l0")
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_weight_normalised_lstm_builds():
    """A weight-normalised LSTM was refused as a leaf holding other values per member: its _flat_weight_refs, the
    RNN's references to its own (parametrized) weights."""
    members = _members(NormedRecurrence)
    loop = copy.deepcopy(members)
    x = torch.randn(3, 5, 4)
    ens = _build(members, x)
    _calls_match(ens, loop, [(x,), (torch.randn(2, 5, 4),)])


def test_clip_with_a_float_member_count_refused_by_name():
    p = torch.zeros(N, 4, requires_grad=True)
    p.grad = torch.ones(N, 4)
    with pytest.raises(OptimizerError, match="n_members must be a positive int"):
        executor.clip_grad_norm_per_member_([p], N, 1.0)


class TakesPacked(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 6)

    def forward(self, packed):
        return self.rnn(packed)[1]


def test_a_packed_sequence_input_refused_by_name():
    """A PackedSequence input crashed the trace raw (the probe rebuilt one from its in_dims)."""
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 4), torch.tensor([5, 3]))
    with pytest.raises(planner.TraceError, match="an input is a PackedSequence"):
        planner.trace(TakesPacked(), (packed,))


class CheckpointedWithAux(nn.Module):
    """An auxiliary head before the checkpointed block; `export`: a torch.no_grad() region sends the trace to
    torch.export."""

    def __init__(self, export=False):
        super().__init__()
        self.export = export
        self.a = nn.Linear(4, 8)
        self.aux = nn.Linear(8, 1)
        self.blk = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.o = nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if self.export:
            with torch.no_grad():
                k = (x > 0).float().mean()
            h = h * k
        return self.aux(h), self.o(checkpoint(self.blk, h, use_reentrant=False))


@pytest.mark.parametrize("export", [False, True])
@pytest.mark.parametrize("loss_on", ["aux", "main", "both"])
def test_checkpointed_norm_updated_again_only_where_backward_reaches_it(export, loss_on):
    """torch recomputes a checkpointed region only where backward reaches it: a loss on the auxiliary head alone
    updates the block's statistics once, as the loop does."""
    members = _members(CheckpointedWithAux, export=export)
    loop = copy.deepcopy(members)
    x = torch.randn(6, 4)
    ens = _build(members, x)
    for step in range(2):
        outs = ens(x + step)
        refs = [m(x + step) for m in loop]
        pick = {"aux": (0,), "main": (1,), "both": (0, 1)}[loss_on]
        sum(outs[k].square().sum() for k in pick).backward()
        sum(r[k].square().sum() for r in refs for k in pick).backward()
    _same_state(ens, loop)


class Scheduled(nn.Module):
    """A KL weight kept in a dict a method of the model moves between epochs; a fill value read into an index write."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.sched = {"beta": 0.0, "fill": 2.0}

    def set_epoch(self, e):
        self.sched["beta"] = min(1.0, e / 2)

    def forward(self, x):
        y = self.l(x) * (1 + self.sched["beta"])
        y[:, 0] = self.sched["fill"]
        return y


@pytest.mark.parametrize("change", ["set_epoch", "fill"])
def test_settings_a_method_moves_or_an_index_write_reads_are_watched(change):
    """A dict key a method other than forward() writes (`set_epoch`), or one read on the right of an index write
    (`y[:, 0] = self.sched["fill"]`), was taken as written by the model itself and not watched (1.40 / 5.0 off)."""
    members = _members(Scheduled)
    x = torch.randn(2, 4)
    ens = _build(members, x)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    for m in members:
        if change == "set_epoch":
            m.set_epoch(2)
        else:
            m.sched["fill"] = 7.0
    with pytest.raises(ExecutionError, match="beta" if change == "set_epoch" else "fill"):
        ens(x)


class CheckpointedVariants(nn.Module):
    """`how`: "twice" calls the region's BatchNorm twice; "gated": checkpointed only in training (Hugging Face /
    timm style), to be planned in eval on a batch of one."""

    def __init__(self, how=""):
        super().__init__()
        self.how = how
        self.stem = nn.Linear(4, 8)
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def region(self, h):
        if self.how == "twice":
            return torch.relu(self.bn(self.lin(self.bn(h))))
        return torch.relu(self.bn(self.lin(h)))

    def forward(self, x):
        h = self.stem(x)
        if self.how != "gated" or self.training:
            h = checkpoint(self.region, h, use_reentrant=False)
        else:
            h = self.region(h)
        return self.head(h)


@pytest.mark.parametrize("case", ["frozen region", "grad of the head alone", "backward inputs", "gated, batch of one"])
def test_checkpointed_norm_second_update_only_where_torch_recomputes(case):
    """A frozen region (linear probing) records nothing for backward, and a backward asked for the head's weight
    alone never runs the region: torch recomputes nothing there (the batched module updated twice: 0.119 / 0.107
    off). A model checkpointing only in training, planned in eval on a batch of one (BatchNorm refuses that in
    training), updated once (0.121 off): its probe takes the batch twice."""
    members = _members(CheckpointedVariants, how="gated" if case.startswith("gated") else "")
    if case == "frozen region":
        for m in members:
            m.stem.requires_grad_(False)
            m.lin.requires_grad_(False)
            m.bn.requires_grad_(False)
    if case.startswith("gated"):
        for m in members:
            m.eval()
    loop = [copy.deepcopy(m).train() for m in members]
    x = torch.randn(1 if case.startswith("gated") else 6, 4)
    ens = _build(members, x)
    ens.train()
    for step in range(3):
        xs = torch.randn(6, 4)
        out, refs = ens(xs), [m(xs) for m in loop]
        if case == "grad of the head alone":
            torch.autograd.grad(out.square().sum(), [ens.stacked.head.weight])
            for m, r in zip(loop, refs):
                torch.autograd.grad(r.square().sum(), [m.head.weight])
        elif case == "backward inputs":
            out.square().sum().backward(inputs=[ens.stacked.head.weight])
            for m, r in zip(loop, refs):
                r.square().sum().backward(inputs=[m.head.weight])
        else:
            out.square().sum().backward()
            sum(r.square().sum() for r in refs).backward()
    _same_state(ens, loop)


def test_a_norm_called_twice_in_a_checkpointed_region_refused_in_training():
    """Two updates per call inside the region cannot be told apart after the call (9 counts against the loop's 12,
    0.011 off): refused in training with gradients, naming the layer; inference runs."""
    members = _members(CheckpointedVariants, how="twice")
    x = torch.randn(6, 4)
    ens = _build(members, x)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(ExecutionError, match="bn updates running statistics inside a torch.utils.checkpoint region"):
        ens(x)


class PeakPosition(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        h = self.l(x)
        r, c = torch.where(h == h.amax())  # the peak's position: one per member, a value-dependent shape
        return h * (r.float().mean() + c.float().mean())


def test_wide_one_argument_where_is_not_elementwise():
    """`wide` ran torch.where(cond) on the stacked mask as an elementwise op: the indices held the member axis (1.32)."""
    members = _members(PeakPosition)
    x = torch.randn(6, 8)
    ens = _build(members, x, "wide")
    with torch.no_grad():
        for call in (x, x * 2 + 1):
            torch.testing.assert_close(ens(call), torch.stack([m(call) for m in members]))


def test_assigning_a_module_into_the_state_tree_refused():
    """`ens.stacked.fc2 = saved_head` (a reset, an EMA copy, a LoRA wrapper, a tie by module) changed nothing the stages
    run (0.68 / 1.07 / 0.33 off): refused, naming the path and the in-place loads."""
    members = _members(TwoLayers)
    ens = _build(members, torch.randn(4, 8))
    with pytest.raises(AttributeError, match="assigning a module to 'fc2' of the batched module's state tree"):
        ens.stacked.fc2 = nn.Linear(16, 8)
    with pytest.raises(AttributeError, match="assigning a module to 'fc2'"):
        ens.stacked.fc2 = ens.stacked.fc1
    x = torch.randn(4, 8)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


class ConjugatedSpectrum(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.cfloat))

    def forward(self, x):
        z = torch.fft.fft(x) * self.w
        if isinstance(x, torch.Tensor):  # always true when called; false for torch.fx's Proxy
            z = z.conj()
        return z


def test_trace_compares_complex_outputs_in_both_parts():
    """The check that torch.fx's graph is forward() compared complex outputs by their real part: a branch fx takes the
    wrong way that conjugates was accepted, and the batched module returned the conjugate (19.8 off)."""
    members = _members(ConjugatedSpectrum)
    x = torch.randn(4, 8)
    ens = _build(members, x)
    with torch.no_grad():
        for call in (x, x * 2):
            torch.testing.assert_close(ens(call), torch.stack([m(call) for m in members]))


class RobustScale(nn.Module):
    """Integer-valued features scaled by their largest magnitude: values tie."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        peak = getattr(x.abs(), self.how)()
        return self.l(x / (peak + 1))


@pytest.mark.parametrize("how", ["max", "min", "median"])
def test_full_reductions_split_their_gradient_at_ties_as_the_loop(how):
    """vmap's rule for a full max / min / median gave the whole gradient to one tied element where torch splits it
    (0.389 off on the input's gradient): each member runs it."""
    members = _members(RobustScale, how=how)
    x = torch.tensor([[1.0, -3.0, 3.0, 2.0], [3.0, 0.0, 1.0, -3.0]])
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N, input_mode="per_member")
    ens = executor.build(plan, members)
    for xs in (torch.stack([x, -x, x * 2]), torch.stack([x.flip(0), x, -x])):
        xs = xs.clone().requires_grad_()
        ref_in = xs.detach().clone().requires_grad_()
        ens(xs).sum().backward()
        torch.stack([m(ref_in[i]) for i, m in enumerate(members)]).sum().backward()
        torch.testing.assert_close(xs.grad, ref_in.grad)


class TwoOutputRegion(nn.Module):
    """One checkpointed region with two outputs, one through the BatchNorm and one not."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.side = nn.Linear(8, 2)
        self.o = nn.Linear(8, 2)

    def region(self, h):
        return self.bn(h), self.side(h)

    def forward(self, x):
        main, side = checkpoint(self.region, self.a(x), use_reentrant=False)
        return self.o(main), side


@pytest.mark.parametrize("loss_on", [0, 1])
def test_a_loss_on_any_output_of_the_region_recomputes_all_of_it(loss_on):
    """torch recomputes the whole region when backward reaches any of its outputs: a loss on the output that does not
    go through the BatchNorm updates it a second time too (3 counts against the loop's 6 before)."""
    members = _members(TwoOutputRegion)
    loop = copy.deepcopy(members)
    x = torch.randn(6, 4)
    ens = _build(members, x)
    for step in range(3):
        out, refs = ens(x + step), [m(x + step) for m in loop]
        out[loss_on].square().sum().backward()
        sum(r[loss_on].square().sum() for r in refs).backward()
    _same_state(ens, loop)


class CountsEpisodes(nn.Module):
    """A dict the training script moves, read only by extra_repr (not by forward())."""

    def __init__(self):
        super().__init__()
        self.pi = nn.Linear(4, 2)
        self.stats = {"episodes": 0}

    def extra_repr(self):
        return f"episodes={self.stats['episodes']}"

    def forward(self, obs):
        return self.pi(obs).softmax(-1)


def test_a_dict_only_extra_repr_reads_is_not_watched_and_stacked_state_names_are_fixed():
    """A counter only extra_repr reads was refused once the script moved it; putting another tensor under a name of
    ens.stacked_state left the stages on the old one (0.945 off) and is refused."""
    members = _members(CountsEpisodes)
    x = torch.randn(5, 4)
    ens = _build(members, x)
    for m in members:
        m.stats["episodes"] += 1
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(TypeError, match="write into them in place"):
        ens.stacked_state["pi.weight"] = torch.zeros(N, 2, 4)
    with torch.no_grad():
        ens.stacked_state["pi.bias"].add_(1.0)
    for m in members:
        with torch.no_grad():
            m.pi.bias.add_(1.0)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


class NeedsRealInputsToTrain(nn.Module):
    """Checkpointed in training only, and refusing all-zero inputs there (as a model needing labels would fail)."""

    def __init__(self):
        super().__init__()
        self.blk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))

    def forward(self, x):
        if self.training:
            if not bool(x.abs().sum()):
                raise ValueError("needs real inputs")
            return checkpoint(self.blk, x, use_reentrant=False)
        return self.blk(x)


def test_build_warns_where_its_checkpoint_probe_cannot_tell():
    """The probe runs on zero stand-ins of the traced shapes; where forward() refuses them in training mode, build
    warns that the checkpointed norms are not known (it said nothing before)."""
    members = [m.eval() for m in _members(NeedsRealInputsToTrain)]
    x = torch.randn(4, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    with pytest.warns(UserWarning, match="which of them run inside a checkpointed region is not known"):
        executor.build(plan, members)
