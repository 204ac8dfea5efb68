"""Silent wrong answers found in session 33's reviews and known items, each against the plain member loop."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError

N = 3

HELPER_CFG = {"temperature": 1.0}
GAIN = 2.0


def _sharpen(h):
    """A helper forward() calls (fx traces through it): the global it reads is baked into the graph."""
    return h / HELPER_CFG["temperature"]


class UsesHelpers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def _gain(self, h):
        return h * GAIN

    def forward(self, x):
        return self._gain(torch.softmax(_sharpen(self.fc(x)), -1))


def test_a_setting_read_in_a_helper_function_or_method_is_watched():
    global GAIN
    torch.manual_seed(0)
    members = [UsesHelpers() for _ in range(N)]
    x = torch.randn(6, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
        try:
            HELPER_CFG["temperature"] = 0.25  # the loop reads 0.25 now; the graph held 1.0 (0.57 off, no word)
            with pytest.raises(ExecutionError, match=r"module-level 'HELPER_CFG'"):
                ens(x)
            HELPER_CFG["temperature"] = 1.0
            GAIN = 3.0  # read by a method forward() calls
            with pytest.raises(ExecutionError, match="module-level 'GAIN'"):
                ens(x)
        finally:
            HELPER_CFG["temperature"], GAIN = 1.0, 2.0
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_the_stage_gradient_check_sees_a_small_tensor_wholly_wrong():
    """Autotune / profile judged a stage's gradients normwise over each member's whole gradient: a bias gradient
    1e-4 of the weight's, wholly wrong (doubled), was 1e-4 of the member's scale, at the float32 tolerance."""
    from stagewise.executor.stage_grads import grads_check  # noqa: PLC0415

    torch.manual_seed(0)
    w = torch.randn(N, 64, 64)
    b = torch.randn(N, 64) * 2e-4
    check = grads_check([w, b], N)
    assert check([w.clone(), b.clone()]) == 0.0
    assert check([w * (1 + 1e-6), b * (1 + 1e-6)]) < 1e-5  # rounding-sized differences pass
    assert check([w.clone(), b * 2]) > 1e-3  # was ~1e-4: the tolerance itself
    # a gradient that cancels to almost nothing (noise 3e-6 of the member's scale) is not judged on its own scale
    zero_ish = torch.randn(N, 64) * 1e-9
    check = grads_check([w, zero_ish], N)
    assert check([w, zero_ish + 3e-6 * w.abs().amax(dim=(1, 2))[:, None]]) < 1e-4


@pytest.mark.parametrize("draw", ["dropout2d", "alpha_dropout", "feature_alpha_dropout", "rrelu"])
def test_wide_on_a_random_op_of_a_shared_input_draws_per_member(draw):
    """wide ran an op with no N-first argument once and shared it unless it knew the op draws: F.dropout2d,
    alpha_dropout, feature_alpha_dropout and rrelu of a shared input gave every member one draw (2.51 off)."""
    import copy  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    fn = getattr(F, draw)

    class InputDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(fn(x, training=True) if draw == "rrelu" else fn(x, 0.5, True))

    torch.manual_seed(0)
    members = [InputDrop().train() for _ in range(N)]
    x = torch.randn(2, 8, 16)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    for s in plan.stages:
        if s.mode is planner.StageMode.EXCLUDED:
            plan = planner.set_options(plan, graph, s.id, strategy="wide")
    assert any(s.options.strategy.value == "wide" for s in plan.stages)
    ens = executor.build(plan, copy.deepcopy(members)).train()
    torch.manual_seed(5)
    with torch.no_grad():
        got = ens(x)
    torch.manual_seed(5)
    with torch.no_grad():
        want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class _Args:
    """What argparse / a dataclass config gives a training script: settings as attributes of one object."""

    def __init__(self):
        self.temperature = 1.0


args = _Args()
size = 4  # a module-level loop variable named like the method forward() calls (`x.size(0)`)


class ReadsAnObjectsSetting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).view(x.size(0), -1)
        return torch.softmax(h / args.temperature, -1)


def test_a_setting_read_off_a_module_level_object_is_watched_and_a_method_name_is_not_a_global():
    global size
    torch.manual_seed(0)
    members = [ReadsAnObjectsSetting() for _ in range(N)]
    x = torch.randn(6, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        try:
            for size in (4, 1, 7):  # was refused from the second call: `size` taken for a global forward() reads
                torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
            args.temperature = 5.0  # the graph held 1.0: 0.27 off, no word
            with pytest.raises(ExecutionError, match=r"module-level 'args.temperature'.*was 1.0"):
                ens(x)
        finally:
            args.temperature, size = 1.0, 4
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_a_captured_plan_makes_the_batched_modules_checks_and_runs_its_hooks():
    """executor.capture(ens) replayed its graphs without the batched module's per-call checks: a module-level
    setting changed since build was answered from the stale graph (0.27 off), and hooks on ens never fired."""
    torch.manual_seed(0)
    members = [ReadsGlobalsHere() for _ in range(N)]
    x = torch.randn(5, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members).eval()
    fast = executor.capture(ens, backend=executor.ReplayBackend())
    seen = []
    ens.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), torch.stack([m(x) for m in members]))
        assert seen == [torch.Size([N, 5, 8])]  # the hook on the batched module fired through the captured one
        try:
            HERE["temperature"] = 5.0
            with pytest.raises(ExecutionError, match=r"module-level 'HERE'"):
                fast(x)
        finally:
            HERE["temperature"] = 1.0
        torch.testing.assert_close(fast(x), torch.stack([m(x) for m in members]))


HERE = {"temperature": 1.0}


class ReadsGlobalsHere(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.fc(x) / HERE["temperature"], -1)


# --- state several members (or two names) hold as one memory, written by forward() ----------------------------------

from stagewise.planner.errors import MemberError  # noqa: E402


class SharedCodebook(nn.Module):
    def __init__(self):
        super().__init__()
        self.codes = nn.Parameter(torch.randn(5, 4), requires_grad=False)  # frozen: an EMA codebook

    def forward(self, h):
        d = torch.cdist(h, self.codes)
        with torch.no_grad():
            self.codes.mul_(0.9).add_(0.1 * h.mean(0))
        return d


class SharedEma(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, h):
        with torch.no_grad():  # (torch.export's graph: aten.add.out(..., out=ema))
            torch.add(self.ema * 0.9, h.mean(0) * 0.1, out=self.ema)
        return h - self.ema


class UsesShared(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.shared = shared

    def forward(self, x):
        return self.shared(self.fc(x))


@pytest.mark.parametrize("kind", ["frozen parameter", "out= write"])
def test_state_members_share_and_forward_writes_is_refused(kind):
    """A frozen Parameter shared by the members and written in place (0.48..0.95 off over 3 calls), a shared buffer
    written with `out=` (8.8e-2..0.2 off): each member got a copy. Refused as a shared buffer written in place is."""
    torch.manual_seed(0)
    shared = SharedCodebook() if kind == "frozen parameter" else SharedEma()
    members = [UsesShared(shared).eval() for _ in range(N)]
    x = torch.randn(8, 6)
    plan = planner.propose(planner.trace(members[0], (x,)), n_members=N)
    with pytest.raises(MemberError, match=r"members \[0, 1, 2\] hold one tensor as (parameter `shared.codes`|buffer `shared.ema`)"):
        executor.build(plan, members)


class MaxNormTied(nn.Module):
    """An embedding with max_norm (its lookup renormalises the rows it reads, in place) and an output head."""

    def __init__(self, tie: str):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.out = nn.Linear(4, 10, bias=False)
        with torch.no_grad():
            self.emb.weight.mul_(3)
        if tie == "data":
            self.out.weight = nn.Parameter(self.emb.weight.data)  # another Parameter on the same memory
        elif tie == "tied":
            self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_an_embeddings_max_norm_write_is_seen_by_the_aliasing_checks():
    """nn.Embedding(max_norm=)'s renormalisation wrote a weight another name shares (3.90 off), or members tying the
    head differently (3.90): no in-place node shows it, so the checks missed it."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 1]])
    torch.manual_seed(0)
    members = [MaxNormTied("data").eval() for _ in range(N)]
    plan = planner.propose(planner.trace(members[0], (ids,)), n_members=N)
    with pytest.raises(MemberError, match=r"`emb.weight` and parameter `out.weight` are two tensors on one memory"):
        executor.build(plan, members)
    torch.manual_seed(0)
    members = [MaxNormTied(t).eval() for t in ("none", "tied", "tied")]
    plan = planner.propose(planner.trace(members[0], (ids,)), n_members=N)
    with pytest.raises(MemberError, match=r"members tie parameters differently \(out.weight = emb.weight"):
        executor.build(plan, members)


# --- Python values forward() counts on ----------------------------------------------------------------------------

from stagewise.planner.errors import TraceError  # noqa: E402


class FrameCounter(nn.Module):
    """An RL agent annealing a temperature by the frames it has seen: `self.frames += x.size(0)`."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.frames = 0

    def forward(self, x):
        self.frames += x.size(0)
        return torch.softmax(self.fc(x) / (1 + self.frames * 0.01), -1)


class RunningCount(nn.Module):
    """An observation normaliser whose count is a Python float (torch.export traces it: fx fails on `len`)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.register_buffer("mean", torch.zeros(6))
        self.count = 1e-4

    def forward(self, x):
        n = len(x)
        with torch.no_grad():
            self.mean.mul_(self.count / (self.count + n)).add_(x.sum(0) / (self.count + n))
        self.count = self.count + n
        return self.fc(x - self.mean)


class LastBatch(nn.Module):
    """A value set from the inputs alone (the same after every call on them): not a counter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.last_batch = 0

    def forward(self, x):
        self.last_batch = x.shape[0]
        return self.fc(x)


@pytest.mark.parametrize("cls", [FrameCounter, RunningCount])
def test_a_python_number_forward_counts_on_is_refused_at_trace(cls):
    """fx put back the Proxy of `self.frames += x.size(0)` (a size read, taken for a cache) and torch.export restores
    attributes itself: the graph held the traced value, 0.39 off after 4 calls (a normaliser's count: 0.385)."""
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(16, 6)
    before = {k: v for k, v in vars(model).items() if isinstance(v, (int, float))}
    with pytest.raises(TraceError, match=r"changes Python value\(s\) of the model on every call"):
        planner.trace(model, (x,))
    assert {k: v for k, v in vars(model).items() if isinstance(v, (int, float))} == before  # the model as it was


def test_a_value_set_from_the_inputs_alone_is_not_a_counter():
    torch.manual_seed(0)
    members = [LastBatch() for _ in range(N)]
    x = torch.randn(5, 6)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


# --- exceptions a stage hands on as they are ----------------------------------------------------------------------


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.g, self.fc2 = nn.Linear(16, 32), nn.GRU(32, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.g(torch.relu(self.fc1(x)))[0])


def test_activation_checkpoint_around_the_batched_module_trains_as_the_loop():
    """torch's non-reentrant checkpoint stops a recomputation early with an exception it catches itself: wrapped
    into an ExecutionError by the stage, backward failed ("check the input shapes")."""
    import copy  # noqa: PLC0415
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    torch.manual_seed(0)
    members = [TwoStages() for _ in range(N)]
    x = torch.randn(N, 4, 5, 16)
    plan = planner.propose(planner.trace(members[0], (x[0],)), n_members=N, input_mode="per_member")
    assert len(plan.stages) > 1
    ens = executor.build(plan, copy.deepcopy(members))
    loop = copy.deepcopy(members)
    for i, m in enumerate(loop):
        (checkpoint(m, x[i], use_reentrant=False) ** 2).mean().backward()
    (checkpoint(ens, x, use_reentrant=False) ** 2).mean(dim=(1, 2, 3)).sum().backward()
    named = dict(ens.named_stacked_parameters())
    for i, m in enumerate(loop):
        for k, p in m.named_parameters():
            torch.testing.assert_close(named[k].grad[i], p.grad, rtol=1e-5, atol=1e-6)


class Allocates(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h + h.new_zeros(x.shape[0] ** 4).sum()  # 16 elements at batch 2; 6e17 bytes at 20000


def test_out_of_memory_in_a_stage_keeps_its_type():
    """Batch-size back-off code catches torch.OutOfMemoryError / the allocator's RuntimeError by type: the stage
    turned it into an ExecutionError. Handed on as it is, with a note naming the stage."""
    torch.manual_seed(0)
    members = [Allocates() for _ in range(N)]
    ens = executor.build(planner.propose(planner.trace(members[0], (torch.randn(2, 4),)), N), members)
    with pytest.raises(RuntimeError, match="can't allocate memory|out of memory") as caught:
        ens(torch.randn(20000, 4))
    assert not isinstance(caught.value, ExecutionError)
    assert any("in stage" in note for note in getattr(caught.value, "__notes__", []))


class LearnableAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.log_scale = (torch.randn(()) * 0.5).requires_grad_()  # learnable, not registered

    def forward(self, x):
        return self.fc(x) * self.log_scale.exp()


def test_a_learnable_plain_tensor_attribute_is_refused_where_gradients_are_recorded():
    """Held as a constant, it got no gradient (the loop's 6.65) and verify(grads=True) said MATCH."""
    torch.manual_seed(0)
    members = [LearnableAttribute() for _ in range(N)]
    x = torch.randn(5, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with pytest.raises(ExecutionError, match=r"'log_scale' as a plain tensor that requires grad"):
        ens(x)
    with torch.no_grad():  # inference is unaffected
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


# --- a layer's mode set on the batched module's own modules -------------------------------------------------------

import copy  # noqa: E402


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _freeze_bn(model):
    model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()


def test_batchnorm_frozen_by_class_on_the_batched_module_stays_frozen():
    """`model.train(); for m in model.modules(): if isinstance(m, nn.BatchNorm2d): m.eval()` found nothing on the
    batched module (its modules were state holders): its statistics moved, 0.30 off the loop's outputs."""
    torch.manual_seed(0)
    members = [ConvBN() for _ in range(N)]
    for m in members:
        with torch.no_grad():
            m.bn.running_mean.uniform_(-1, 1)
    x = torch.randn(4, 3, 6, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]).train(), (x,)), N)
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    _freeze_bn(ens)
    for m in members:
        _freeze_bn(m)
    before = ens.stacked.bn.running_mean.clone()
    for x in (x, torch.randn(2, 3, 8, 8), x):  # calls after the first, and another input shape
        got, want = ens(x), torch.stack([m(x) for m in members])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ens.stacked.bn.running_mean, before, rtol=0, atol=0)
    assert isinstance(ens.stacked.bn, nn.BatchNorm2d) and not ens.stacked.bn.training
    with pytest.raises(AttributeError, match=r"'bn' of the batched module is the members' BatchNorm2d as stacked state"):
        ens.stacked.bn.momentum  # noqa: B018 - a layer setting is the members', not here


class MLPDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _mc_dropout(model):
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.train()


def test_mc_dropout_set_by_class_draws_as_the_loop_and_survives_copies():
    """MC dropout on the batched module stayed deterministic (the loop's two calls differ by 1.02)."""
    torch.manual_seed(0)
    members = [MLPDrop() for _ in range(N)]
    for m in members:
        _mc_dropout(m)
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    ens.eval()
    with torch.no_grad():
        a, b = ens(x), ens(x)
        assert torch.equal(a, b)  # all eval: deterministic
        for target in (ens, copy.deepcopy(ens)):
            _mc_dropout(target)
            torch.manual_seed(3)
            got = target(x)
            torch.manual_seed(3)
            torch.testing.assert_close(got, torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)
        buffer = __import__("io").BytesIO()
        torch.save(ens, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert isinstance(loaded.stacked.drop, nn.Dropout) and loaded.stacked.drop.training
        loaded.stacked.drop.eval()  # reaches the loaded module's own layers
        torch.testing.assert_close(loaded(x), loaded(x), rtol=0, atol=0)


class Gate(nn.Module):
    """A module of the model's own whose forward() branches on self.training (traced through: one side kept)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        return h * 0.5 if self.training else h


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.out = Gate(), nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.gate(x))


def test_a_mode_change_of_a_traced_through_branch_is_refused():
    torch.manual_seed(0)
    members = [WithGate().eval() for _ in range(N)]
    x = torch.randn(3, 6)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with pytest.raises(ExecutionError, match=r"forward\(\) of .gate. \(Gate\) reads self.training"):
        ens.stacked.gate.train()


# --- containers a refused trace leaves as they were ---------------------------------------------------------------

import collections  # noqa: E402
import types as _types  # noqa: E402


class FrameStack(nn.Module):
    """A policy stacking its last k observations in a deque attribute."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 2)
        self.frames = collections.deque([torch.zeros(2, 4)] * 3, maxlen=3)

    def forward(self, obs):
        self.frames.append(obs)
        return self.fc(torch.cat(list(self.frames), -1))


class Counters(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.kind = kind
        self.stats = collections.defaultdict(int) if kind == "defaultdict" else _types.SimpleNamespace(n=0)
        self.hist = collections.deque(maxlen=100)

    def forward(self, x):
        if self.kind == "defaultdict":
            self.stats["updates"] += 1
            k = self.stats["updates"]
        elif self.kind == "namespace":
            self.stats.n += 1
            k = self.stats.n
        else:
            self.hist.append(x.shape[0])
            k = len(self.hist)
        return self.fc(x) * k


@pytest.mark.parametrize("make", [FrameStack, lambda: Counters("defaultdict"), lambda: Counters("namespace"),
                                  lambda: Counters("deque")])
def test_a_refused_trace_leaves_the_models_containers_as_they_were(make):
    """Only exact lists and dicts were put back: a deque was left holding fx Proxies (the model's own call then
    returned a Proxy), a defaultdict / SimpleNamespace counter at 1; a deque counter of sizes was accepted."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 4)
    before = {k: (list(v) if isinstance(v, collections.deque) else copy.copy(v)) for k, v in vars(model).items()
              if k in ("frames", "stats", "hist")}
    with pytest.raises(TraceError):
        planner.trace(model, (x,))
    for k, v in before.items():
        now = getattr(model, k)
        if isinstance(now, collections.deque):
            assert len(now) == len(v) and all(a is b for a, b in zip(now, v)), k
        else:
            assert vars(now) == vars(v) if isinstance(now, _types.SimpleNamespace) else dict(now) == dict(v), k
    assert isinstance(model(x), torch.Tensor)


class CountsCalls(nn.Module):
    """A call counter written in place in forward(): torch.fx cannot record it, so the plan is torch.export's."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 5)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_a_layer_mode_a_torch_export_graph_fixed_is_refused():
    """On a torch.export plan the graph holds the batch norm's op with its mode fixed: ens.stacked.bn.eval() did
    nothing (0.30 off, statistics moving); refused now, while the traced mode itself is accepted."""
    torch.manual_seed(0)
    members = [CountsCalls().train() for _ in range(N)]
    x = torch.randn(4, 3, 8, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    assert plan.tracer == "export"
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    ens.stacked.bn.train()  # the traced mode: nothing to refuse
    with pytest.raises(ExecutionError, match=r"'bn' \(BatchNorm2d\) reads self.training.*torch.export fixes the mode"):
        ens.stacked.bn.eval()


# --- per-member numbers that record gradients ---------------------------------------------------------------------

import torch.nn.functional as F  # noqa: E402


class GumbelHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 4), nn.Linear(4, 2)

    def forward(self, x, tau):
        return self.out(F.gumbel_softmax(self.fc(x), tau=tau))


def test_a_per_member_number_recording_gradients_keeps_them_through_a_loop_stage():
    """A learned temperature per member (`taus` requiring grad) reached the loop stage as Python numbers: no
    gradient (the loop's up to 0.031), and verify(grads=True) crashed on the loop's own call."""
    N_ = 3
    torch.manual_seed(0)
    members = [GumbelHead() for _ in range(N_)]
    xs = torch.randn(N_, 5, 8)
    plan = planner.propose(planner.trace(members[0], (xs[0], 1.0)), n_members=N_, input_mode="per_member")
    ens = executor.build(plan, copy.deepcopy(members))
    taus = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    torch.manual_seed(1)
    out = ens(xs, taus)
    (out ** 2).mean(dim=(1, 2)).sum().backward()
    ref = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    torch.manual_seed(1)
    for i, m in enumerate(members):
        (m(xs[i], ref[i]) ** 2).mean().backward()
    assert taus.grad is not None
    torch.testing.assert_close(taus.grad, ref.grad, rtol=1e-5, atol=1e-7)
    report = executor.verify(plan, copy.deepcopy(members), (xs, torch.tensor([0.5, 1.0, 2.0], requires_grad=True)),
                             grads=True)
    assert report.ok, report.to_text()


class ParametersInAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.extra = [nn.Parameter(torch.randn(4) * 0.1)]  # a plain list: not registered

    def forward(self, x):
        return self.fc(x) + self.extra[0]


def test_a_parameter_in_a_plain_list_is_refused_where_gradients_are_recorded():
    """Read as a constant, it got no gradient (the loop's norms 5.4..9.5) and verify(grads=True) said MATCH."""
    torch.manual_seed(0)
    members = [ParametersInAList() for _ in range(N)]
    x = torch.randn(5, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with pytest.raises(ExecutionError, match=r"'extra\[0\]' as a plain tensor that requires grad"):
        ens(x)


class AttnHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.o(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x)))


def test_calls_from_several_threads_give_each_its_own_answer():
    """A vmap stage swaps each call's state into its stage module's slots: calls from 4 threads mixed (1-3 of 1200
    wrong, by up to 0.77). Calls wait for each other now."""
    import sys  # noqa: PLC0415
    import threading  # noqa: PLC0415

    torch.manual_seed(0)
    members = [AttnHead().eval() for _ in range(N)]
    x = torch.randn(2, 8, 16)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), copy.deepcopy(members))
    worst, interval = [], sys.getswitchinterval()

    def client(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(150):
            xx = torch.randn(2, 8, 16, generator=gen)
            with torch.no_grad():
                worst.append(float((ens(xx) - torch.stack([m(xx) for m in members])).abs().max()))

    sys.setswitchinterval(1e-5)  # thread switches (and a race) far more often
    try:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(worst) == 600 and max(worst) < 1e-5


# --- state written where no node shows it ---------------------------------------------------------------------------


@torch.library.custom_op("stagewise_s33::track_max_second", mutates_args={"buf"})
def track_max_second(h: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    buf.copy_(torch.maximum(buf, h.abs().amax(0)))
    return h / buf


@track_max_second.register_fake
def _(h, buf):
    return torch.empty_like(h)


@torch.library.custom_op("stagewise_s33::track_max_first", mutates_args={"buf"})
def track_max_first(buf: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    buf.copy_(torch.maximum(buf, h.abs().amax(0)))
    return h / buf


@track_max_first.register_fake
def _(buf, h):
    return torch.empty_like(h)


class TrackMaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, buf):
        buf.copy_(torch.maximum(buf, h.detach().abs().amax(0)))
        return h / buf

    @staticmethod
    def backward(ctx, g):
        return g, None


class Observer(nn.Module):
    """An activation-range observer updating its buffer inside an op, then reading it (55.6 off after 3 calls: the
    later read was planned before the write)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc, self.g = nn.Linear(6, 4), nn.Linear(6, 4)
        self.register_buffer("mx", torch.ones(4))

    def forward(self, x):
        h = self.fc(x)
        if self.how == "second":
            y = track_max_second(h, self.mx)
        elif self.how == "first":
            y = track_max_first(self.mx, h)
        else:
            y = TrackMaxFunction.apply(h, self.mx)
        return y + self.g(x) * self.mx


@pytest.mark.parametrize("how", ["second", "function"])
def test_state_written_inside_a_custom_op_or_a_function_is_refused_at_trace(how):
    with pytest.raises(TraceError, match=r"writes its argument\(s\) \['buf'\] in place|writes 'mx' in place inside"):
        planner.trace(Observer(how), (torch.randn(5, 6),))


def test_a_custom_op_writing_its_first_argument_is_ordered_as_an_in_place_op():
    torch.manual_seed(0)
    members = [Observer("first") for _ in range(N)]
    loop = copy.deepcopy(members)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (torch.randn(5, 6),)), N)
    ens = executor.build(plan, members)
    with torch.no_grad():
        for scale in (1, 3, 5):
            x = torch.randn(5, 6) * scale
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), rtol=1e-5, atol=1e-5)


class ClipsThroughData(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        r = torch.tanh(self.a(x))
        r.data.clamp_(-0.2, 0.2)  # clip without autograd seeing it
        return self.b(r)


def test_wide_set_on_a_data_write_runs_as_the_loop():
    """wide ran `.data` and its write on N-first copies: the clip never reached `r` (0.72 off)."""
    torch.manual_seed(0)
    members = [ClipsThroughData() for _ in range(N)]
    xs = torch.randn(N, 5, 16)
    graph = planner.trace(members[0], (xs[0],))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    for s in plan.stages:
        if s.mode is planner.StageMode.EXCLUDED:
            plan = planner.set_options(plan, graph, s.id, strategy="wide")
    with pytest.warns(UserWarning, match="strategy 'wide' is not applied"):
        ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        torch.testing.assert_close(ens(xs), torch.stack([m(xs[i]) for i, m in enumerate(members)]), rtol=1e-5, atol=1e-6)


class RefreshesOnLoad(nn.Module):
    """A derived buffer a load_state_dict post-hook refreshes (what copying the tensors into a row skipped: 3.87 off)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", self.fc.weight.detach().norm().reshape(1), persistent=False)
        self.register_load_state_dict_post_hook(RefreshesOnLoad._refresh)

    @staticmethod
    def _refresh(module, incompatible):
        with torch.no_grad():
            module.scale.copy_(module.fc.weight.norm().reshape(1))

    def forward(self, x):
        return self.fc(x) / self.scale


def test_load_member_state_dict_refuses_a_model_that_loads_with_hooks():
    torch.manual_seed(0)
    members = [RefreshesOnLoad() for _ in range(N)]
    x = torch.randn(2, 4)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with pytest.raises(MemberError, match=r"load_member_state_dict\(1\): the members' model loads its state with code"):
        ens.load_member_state_dict(1, RefreshesOnLoad().state_dict())
    plain = executor.build(planner.propose(planner.trace(TwoStages(), (torch.randn(2, 5, 16),)), N),
                           [TwoStages() for _ in range(N)])
    plain.load_member_state_dict(1, TwoStages().state_dict())  # torch's own layers: loaded as before


class ReassignsBuffers(nn.Module):
    """rl_games' RunningMeanStd: new tensors assigned to the buffers in forward(), in training."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(8))
        self.register_buffer("running_var", torch.ones(8))
        self.register_buffer("count", torch.ones(()))

    def forward(self, x):
        if self.training:
            bm, bv, bc = x.mean(0), x.var(0), x.size(0)
            delta = bm - self.running_mean
            tot = self.count + bc
            new_mean = self.running_mean + delta * bc / tot
            new_var = (self.running_var * self.count + bv * bc + delta ** 2 * self.count * bc / tot) / tot
            self.running_mean, self.running_var, self.count = new_mean, new_var, tot
        return ((x - self.running_mean) / torch.sqrt(self.running_var + 1e-5)).clamp(-5, 5)


class NormalisedActor(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.pi = ReassignsBuffers(), nn.Linear(8, 4)

    def forward(self, obs):
        return self.pi(self.norm(obs))


def test_a_buffer_reassigned_in_forward_is_refused_naming_it():
    """Refused before as torch.export's graph "not forward()", blaming a branch on is_compiling() the model lacks."""
    model = NormalisedActor().train()
    before = {k: v for k, v in model.named_buffers()}
    with pytest.raises(TraceError, match=r"assigns new tensors to buffer\(s\) \['norm.running_mean', 'norm.running_var'"):
        planner.trace(model, (torch.randn(16, 8),))
    assert all(model.get_buffer(k) is v for k, v in before.items())


class SwapsStorage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.buf.set_(h.mean(0).detach().clone())
        return h + self.buf


def test_set_on_state_is_refused_at_trace():
    """A loop stage's set_ swapped its row view's storage: the stacked buffer never saw the write (62.7 off)."""
    with pytest.raises(TraceError, match=r"calls Tensor.set_\(\)"):
        planner.trace(SwapsStorage(), (torch.randn(3, 4),))


def test_a_layer_setting_set_on_the_batched_modules_node_is_refused():
    """`m.p = 0.0` on a Dropout found by class changed a number nothing reads."""
    torch.manual_seed(0)
    members = [MLPDrop().eval() for _ in range(N)]
    x = torch.randn(5, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    drops = [m for m in ens.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 1
    with pytest.raises(AttributeError, match=r"setting 'p' here would change nothing"):
        drops[0].p = 0.0


class LogsCalls(nn.Module):
    """Counts its eager calls in a Python attribute nothing computes with (a log): not refused."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.python_calls = 0

    def forward(self, x):
        if not torch.fx._symbolic_trace.is_fx_tracing():  # left alone while traced
            self.python_calls += 1
        return self.fc(x)


def test_a_count_nothing_reads_is_no_counter():
    torch.manual_seed(0)
    members = [LogsCalls() for _ in range(N)]
    x = torch.randn(3, 4)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


class ReadsBygetattr(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.fc(x) / getattr(args, "temperature"), -1)


def test_a_setting_read_by_getattr_is_watched():
    torch.manual_seed(0)
    members = [ReadsBygetattr() for _ in range(N)]
    x = torch.randn(6, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        try:
            args.temperature = 5.0  # the graph held 1.0: 0.27 off, no word
            with pytest.raises(ExecutionError, match=r"module-level 'args.temperature'"):
                ens(x)
        finally:
            args.temperature = 1.0
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
