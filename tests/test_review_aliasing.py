"""State stacking would part, and grad-mode branches a trace keeps: each was a silent wrong answer.

- one member's two names for one memory that are not one tensor object (a buffer registered as `fc.weight.data`,
  a view of it, a plain attribute): stacked apart, a write through one name (an optimizer step, forward() in place)
  no longer reached the other;
- one buffer several members hold, which forward() or BatchNorm updates: the loop updates the one tensor member
  after member, the batched module updated a copy per member;
- forward() branching on torch.is_grad_enabled() / torch.is_inference_mode_enabled(): the trace kept the branch of
  the build's grad mode, and a call in the other ran it where the member loop took the other.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError, MemberError

N = 3
X = torch.randn(6, 8)


def _members(cls, n=N, **kw):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(cls(**kw))
    return out


def _build(members, x=X):
    return executor.build(planner.propose(planner.trace(members[0], (x,)), len(members)), members)


def _loop(members, x=X):
    with torch.no_grad():
        return torch.stack([m(x) for m in members])


class BufferOnWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("w", self.fc.weight.data)

    def forward(self, x):
        return self.fc(x) + x @ self.w.t()


class BufferViewingWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("w", self.fc.weight.data.t())  # a view: another tensor object on the weight's memory

    def forward(self, x):
        return self.fc(x) + x @ self.w


class AttributeOnWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w_ref = self.fc.weight.data  # a plain attribute: fx bakes in `self.w_ref.t()` as a constant

    def forward(self, x):
        return self.fc(x) + x @ self.w_ref.t()


@pytest.mark.parametrize("cls", [BufferOnWeight, BufferViewingWeight, AttributeOnWeight])
def test_training_a_parameter_another_name_shares_memory_with_is_refused(cls):
    """Was: after 3 SGD steps off by 0.25 (relative), the other name's stacked copy left behind; verify said MATCH."""
    members = _members(cls)
    ens = _build(members)
    with torch.no_grad():  # inference: every name still holds the same values
        torch.testing.assert_close(ens(X), _loop(members), rtol=1e-5, atol=1e-5)
    with pytest.raises(ExecutionError, match=r"holds the trainable parameter fc\.weight \(on one memory with .*`w(_ref)?`\)"):
        ens(X).sum().backward()
    for p in ens.parameters():
        p.requires_grad_(False)
    ens(X)  # frozen: nothing can move one name apart from the other


class WritesAliasedBuffer(BufferOnWeight):
    def forward(self, x):
        self.w.mul_(0.5)
        return self.fc(x)


def test_a_forward_writing_a_buffer_on_a_parameters_memory_is_refused_at_build():
    """Was: off by 0.99 on the first call (the write halves fc.weight in the loop, not the stacked weight)."""
    with pytest.raises(MemberError, match=r"parameter `fc\.weight` and buffer `w` are two tensors on one memory, and "
                                          r"forward\(\) writes it in place"):
        _build(_members(WritesAliasedBuffer))


def _sharing(shared: nn.Module, cls):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(cls(shared))
    return out


class Counted(nn.Module):
    def __init__(self, counter):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("n", counter)

    def forward(self, x):
        self.n.add_(1)
        return self.fc(x) * self.n


def test_a_buffer_members_share_that_forward_writes_is_refused_at_build():
    """Was: the loop's members saw counts 1, 2, 3 and the batched copies 1 each: off by 0.67 on the first call."""
    counter = torch.zeros(())
    members = [Counted(counter) for _ in range(N)]
    with pytest.raises(MemberError, match=r"members \[0, 1, 2\] hold one tensor as buffer `n`, and forward\(\) writes it"):
        _build(members)


class Normed(nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 16), bn, nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def test_a_batchnorm_members_share_is_refused_in_training_and_runs_in_eval():
    """Was: 3 training calls, then eval: off by 0.18 (each member's copy of the shared running statistics)."""
    bn = nn.BatchNorm1d(16, affine=False)
    members = [m.train() for m in _sharing(bn, Normed)]
    with pytest.raises(MemberError, match="hold one tensor as buffer `bn.running_mean`, and a layer updates it in training"):
        _build(members)
    members = [m.eval() for m in members]
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members), rtol=1e-5, atol=1e-5)
    with pytest.raises(ExecutionError, match=r"\.train\(True\) is refused: members \[0, 1, 2\] hold one tensor"):
        ens.train()
    ens.training = True  # the flag set by hand: every layer keeps its own mode, the shared statistics are only read
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members), rtol=1e-5, atol=1e-5)


class Table(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("table", table)

    def forward(self, x):
        return self.fc(x) + self.table


def test_a_buffer_members_share_and_nothing_writes_is_fine():
    table = torch.randn(4)
    members = [Table(table) for _ in range(N)]
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members))
    ens(X).sum().backward()  # training updates the Linear; the shared buffer is only read


class GradBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        if not torch.is_grad_enabled():  # an inference-only post-processing path
            y = y.clamp(min=0)
        return y


class InferenceBranch(GradBranch):
    def forward(self, x):
        y = self.fc(x)
        if torch.is_inference_mode_enabled():
            y = y.clamp(min=0)
        return y


class ReadsGradMode(GradBranch):
    def forward(self, x):
        self.seen = torch.is_grad_enabled()
        return self.fc(x)


def test_a_call_in_a_grad_mode_whose_branch_the_trace_did_not_keep_is_refused():
    """Was: off by 0.79 under torch.no_grad() (the traced grad branch ran where the loop clamped)."""
    members = _members(GradBranch)
    ens = _build(members)
    torch.testing.assert_close(ens(X), torch.stack([m(X) for m in members]))
    with torch.no_grad(), pytest.raises(ExecutionError, match=r"gradients off \(torch.no_grad\(\)\) is refused: forward\(\) "
                                                               r"reads torch.is_grad_enabled.*plan a second module"):
        ens(X)
    with torch.no_grad():  # planned in that mode, the module keeps that branch
        plan = planner.propose(planner.trace(members[0], (X,)), N)
    built = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(built(X), _loop(members))
    with pytest.raises(ExecutionError, match="a call with gradients on is refused"):
        built(X)


def test_a_call_under_inference_mode_is_refused_where_forward_reads_it():
    members = _members(InferenceBranch)
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members))
    with torch.inference_mode(), pytest.raises(ExecutionError, match=r"under torch.inference_mode\(\) is refused"):
        ens(X)


def test_reading_the_grad_mode_without_branching_on_it_refuses_nothing():
    members = _members(ReadsGradMode)
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members))
    with torch.inference_mode():
        ens(X)


class ScaledInRegion(nn.Module):
    """A number per member inside a torch.no_grad() region, which torch.export keeps as a graph of its own."""

    def __init__(self, f):
        super().__init__()
        self.q, self.f = nn.Linear(8, 8), f

    def forward(self, x):
        h = self.q(x)
        if h.shape[0] > 1:  # fx cannot trace this: torch.export it is
            h = h + 1
        with torch.no_grad():
            s = torch.sqrt(torch.tensor(h.size(-1), dtype=torch.float) * self.f)
        return h / s


def test_members_differing_in_a_number_inside_a_region_export_keeps_apart_match_the_loop():
    """Was: off by 0.38 silently (float32 too): every member ran member 0's number, which the region's graph held;
    then refused; the number is now handed into the region's graph per member (executor.constants._lift_into_region)."""
    members = []
    for i, f in enumerate((1.0, 2.0, 3.0)):
        torch.manual_seed(i)
        members.append(ScaledInRegion(f))
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members), rtol=1e-6, atol=1e-6)
    alike = [ScaledInRegion(2.0) for _ in range(N)]
    ens = _build(alike)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(alike))


class Backboned(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.bb, self.head = backbone, nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.bb(x))


def test_a_frozen_backbone_members_share_with_batchnorm_in_eval_trains_the_heads():
    """Review: refused at build (the shared BatchNorm's statistics counted as written) though in eval mode it only
    reads them. Training the heads matches the loop; .train() (which would put the BatchNorm in training) is refused."""
    backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()).requires_grad_(False).eval()
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(Backboned(backbone))
        members[-1].head.train()
    ens = _build(members)
    ens(X).sum().backward()
    for member in members:
        member(X).sum().backward()
    for k, p in ens.named_stacked_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, torch.stack([dict(m.named_parameters())[k].grad for m in members]))
    with pytest.raises(ExecutionError, match=r"\.train\(True\) is refused: members \[0, 1, 2\] hold one tensor"):
        ens.train()


class FlatViews(nn.Module):
    """Parameters made as views of one flat tensor the module keeps and forward() never reads."""

    def __init__(self):
        super().__init__()
        self.flat = torch.randn(8 * 4 + 4)
        self.w = nn.Parameter(self.flat[:32].view(4, 8))
        self.b = nn.Parameter(self.flat[32:])

    def forward(self, x):
        return x @ self.w.t() + self.b


def test_a_tensor_attribute_forward_never_reads_does_not_refuse_training():
    members = _members(FlatViews)
    ens = _build(members)
    ens(X).sum().backward()  # the graph reads no constant: the attribute cannot go stale in it


def _helper_module():
    """A module of helpers the model's module did not define: it imported the function by name."""
    import sys
    import types

    helpers = types.ModuleType("grad_helpers_of_a_test")
    helpers.__file__ = __file__
    exec("from torch import is_grad_enabled\n"
         "def clamp_without_grad(y):\n"
         "    return y if is_grad_enabled() else y.clamp(min=0)\n", vars(helpers))
    sys.modules[helpers.__name__] = helpers
    return helpers


_HELPERS = _helper_module()


class ReadsGradModeOfAHelper(GradBranch):
    def forward(self, x):
        return _HELPERS.clamp_without_grad(self.fc(x))


def test_a_grad_mode_read_in_a_helper_of_another_module_is_seen():
    """Review: `from torch import is_grad_enabled` in a helper module was not watched: off by 1.33 under no_grad."""
    members = _members(ReadsGradModeOfAHelper)
    ens = _build(members)
    torch.testing.assert_close(ens(X), torch.stack([m(X) for m in members]))
    with torch.no_grad(), pytest.raises(ExecutionError, match="reads torch.is_grad_enabled"):
        ens(X)


class RegionAndRead(nn.Module):
    """Traced by torch.export (a branch on a size), with a torch.no_grad() region, reading the grad mode to no effect."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.shape[0] > 1:
            y = y + 1
        with torch.no_grad():
            scale = y.abs().mean() + 1
        torch.is_grad_enabled()  # read, with no effect on the graph
        return y / scale


def test_reading_the_grad_mode_next_to_a_no_grad_region_refuses_nothing():
    """Review: every call under no_grad or inference_mode was refused (export inlines the region when traced without
    gradients, so the two traces always differed); the other mode is now traced with the reads answering otherwise."""
    members = _members(RegionAndRead)
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members))
    with torch.inference_mode():
        ens(X)


def test_members_holding_parameters_on_one_memory_are_refused_in_training():
    """Review: members made with load_state_dict(assign=True) from one state dict hold other Parameter objects on one
    memory; the loop trains that memory once per member, the batched module copies: 0.61 off after training."""
    proto = BufferOnWeight()
    members = []
    for _ in range(N):
        m = BufferOnWeight()
        m.load_state_dict({k: v for k, v in proto.state_dict().items() if k != "w"}, strict=False, assign=True)
        del m.w
        m.register_buffer("w", torch.zeros(8, 8))
        members.append(m)
    ens = _build(members)
    with pytest.raises(ExecutionError, match=r"members share the trainable parameter\(s\) \['fc.weight', 'fc.bias'\] "
                                             r"\(one tensor, or tensors on one memory"):
        ens(X).sum().backward()


class FunctionalNorm(nn.Module):
    """timm's BatchNormAct: running statistics updated through F.batch_norm, not an nn.BatchNorm leaf."""

    def __init__(self, stats):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mean", stats[0])
        self.register_buffer("var", stats[1])

    def forward(self, x):
        return torch.nn.functional.batch_norm(self.fc(x), self.mean, self.var, training=True)


def test_statistics_members_share_updated_by_functional_batch_norm_are_refused():
    """Review: accepted, each member's copy of the shared statistics updated apart (0.14 off in eval afterwards)."""
    stats = (torch.zeros(8), torch.ones(8))
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(FunctionalNorm(stats))
    with pytest.raises(MemberError, match="hold one tensor as buffer `mean`, and forward"):
        _build(members)


class RegionInForward(nn.Module):
    """Hugging Face's rotary embedding: a @torch.no_grad() helper inside forward(), traced by torch.export."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    @torch.no_grad()
    def scale(self, y):
        return y.abs().mean() + 1

    def forward(self, x):
        y = self.fc(x)
        if y.shape[0] > 1:  # fx cannot trace this: torch.export it is
            y = y + 1
        return y / self.scale(y)


def test_a_plan_traced_inside_no_grad_builds_for_inference_and_refuses_training():
    """Was: PlanMismatchError 'made for another model' (Hugging Face Llama planned under torch.no_grad()): export
    records no no_grad region there, and build traced with gradients on. Build now takes that trace; a call that would
    record gradients through it is refused (the regions that stop them are not in it)."""
    members = _members(RegionInForward)
    with torch.no_grad():
        plan = planner.propose(planner.trace(members[0], (X,)), N)
    ens = executor.build(plan, members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members))
    with pytest.raises(ExecutionError, match=r"traced inside torch.no_grad\(\), where torch.export records none of"):
        ens(X).sum().backward()
    for p in ens.parameters():
        p.requires_grad_(False)
    torch.testing.assert_close(ens(X), _loop(members))  # nothing records gradients: it runs


class TensorGradBranch(GradBranch):
    """Branches on a tensor's own autograd state: the trace kept the grad-mode side."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def forward(self, x):
        y = self.fc(x)
        if self.read == "requires_grad" and y.requires_grad:
            y = y * 2
        elif self.read == "grad_fn" and y.grad_fn is not None:  # `is not None` holds for an fx proxy: fx kept it
            y = y * 2
        elif self.read == "is_leaf" and not y.is_leaf:
            y = y * 2
        elif self.read == "is_inference" and y.is_inference():
            y = y.clamp(min=0)
        return y


@pytest.mark.parametrize("read", ["requires_grad", "grad_fn", "is_leaf"])
def test_a_branch_on_a_tensors_autograd_state_is_refused_in_the_mode_the_trace_did_not_take(read):
    """Was: off by 1.6 under torch.no_grad() and torch.inference_mode() (the traced grad branch ran)."""
    members = _members(TensorGradBranch, read=read)
    ens = _build(members)
    assert ens.plan.tracer == "export"  # fx would take `grad_fn is not None` as true whatever the tensor
    torch.testing.assert_close(ens(X), torch.stack([m(X) for m in members]))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), pytest.raises(ExecutionError, match=rf"gradients off \(torch.no_grad\(\)\) is refused: forward\(\) "
                                                         rf"reads a tensor's {read}"):
            ens(X)
    with torch.no_grad():  # planned in that mode, the module keeps that branch
        built = executor.build(planner.propose(planner.trace(members[0], (X,)), N), members)
        torch.testing.assert_close(built(X), _loop(members))


def test_a_branch_on_is_inference_is_refused_under_inference_mode_only():
    """Was: off by 6.4 under torch.inference_mode()."""
    members = _members(TensorGradBranch, read="is_inference")
    ens = _build(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(X), _loop(members))
    with torch.inference_mode(), pytest.raises(ExecutionError, match=r"inference_mode\(\) is refused: forward\(\) reads "
                                                                     r"a tensor's is_inference\(\)"):
        ens(X)


class ReadsParameterFlag(GradBranch):
    def forward(self, x):
        y = self.fc(x)
        return y * 2 if self.fc.weight.requires_grad else y  # a leaf keeps its flag under torch.no_grad()


def test_a_branch_on_a_parameters_requires_grad_runs_in_every_mode():
    members = _members(ReadsParameterFlag)
    ens = _build(members)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            got, want = ens(X), torch.stack([m(X) for m in members])
        torch.testing.assert_close(got, want)


class InputGradBranch(GradBranch):
    def forward(self, x):
        y = self.fc(x)
        return y * 2 if x.requires_grad else y  # input gradients (a saliency map) take the other side


def test_a_branch_on_an_inputs_requires_grad_is_refused_for_inputs_that_record_gradients():
    """Was: off by 1.0 for an input with requires_grad=True (the trace kept the example inputs' side)."""
    members = _members(InputGradBranch)
    ens = _build(members)
    torch.testing.assert_close(ens(X), torch.stack([m(X) for m in members]))
    for mode in (torch.enable_grad, torch.no_grad):  # a leaf keeps its flag under no_grad (a PGD loop's input)
        with mode(), pytest.raises(ExecutionError, match=r"an input that requires grad is refused: forward\(\) reads a "
                                                         r"tensor's requires_grad.*Pass inputs that do not require grad"):
            ens(X.clone().requires_grad_(True))
    ens = _build([m for m in _members(TensorGradBranch, read="requires_grad")])  # an intermediate's flag: inputs free
    ens(X.clone().requires_grad_(True))
