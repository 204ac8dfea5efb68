"""torch utilities written for one model, called on a batched module: `clip_grad_norm_` over all members together is
said where it happens, and `swa_utils.update_bn` recomputes every member's BatchNorm statistics as it would on each
member (it found no BatchNorm layer in the batched module and changed nothing)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

from stagewise import executor, planner

N = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Linear(6, 2)
        self.bn1d = nn.BatchNorm1d(6)

    def forward(self, x):
        h = self.bn(self.conv(x)).relu().mean((2, 3))
        return self.head(self.bn1d(h))


def _built(mode="train", make=Net):
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    for m in members:
        getattr(m, mode)()
    x = torch.randn(4, 3, 8, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), n_members=N), members)
    return ens, [copy.deepcopy(m) for m in members]


def _loader(seed=1, batches=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.zeros(4)) for _ in range(batches)]


def test_clip_grad_norm_over_all_members_warns_and_still_clips_jointly():
    ens, _ = _built()
    ens(torch.randn(4, 3, 8, 8)).square().sum().backward()
    grads = [p.grad.clone() for p in ens.parameters()]
    with pytest.warns(executor.JointNormWarning, match="clip_grad_norm_per_member_"):
        norm = torch.nn.utils.clip_grad_norm_(ens.parameters(), 0.1)
    # what torch computes is unchanged: one norm over everything
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(norm, want)
    for p, g in zip(ens.parameters(), grads):
        torch.testing.assert_close(p.grad, g * (0.1 / (want + 1e-6)))


def test_clip_names_imported_before_and_get_total_norm_warn_too():
    from torch.nn.utils import clip_grad_norm_, get_total_norm  # bound names: the module-level norm is what is watched
    ens, _ = _built()
    ens(torch.randn(4, 3, 8, 8)).sum().backward()
    with pytest.warns(executor.JointNormWarning):
        clip_grad_norm_(list(ens.parameters()), 1.0)
    with pytest.warns(executor.JointNormWarning):
        torch.nn.utils.get_total_norm([p.grad for p in ens.parameters()])
    del get_total_norm


def test_per_member_clip_and_other_models_stay_quiet():
    ens, _ = _built()
    other = nn.Linear(3, 2)
    ens(torch.randn(4, 3, 8, 8)).sum().backward()
    other(torch.randn(2, 3)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", executor.JointNormWarning)
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
        executor.clip_grad_norm_per_member_(list(ens.parameters()), 1.0, N)
        warnings.filterwarnings("ignore", category=executor.JointNormWarning)  # the documented way to mean it
        torch.nn.utils.clip_grad_norm_(ens.parameters(), 1.0)


def test_one_member_is_its_own_norm():
    torch.manual_seed(0)
    m = Net().train()
    x = torch.randn(4, 3, 8, 8)
    ens = executor.build(planner.propose(planner.trace(m, (x,)), n_members=1), [m])
    ens(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", executor.JointNormWarning)
        torch.nn.utils.clip_grad_norm_(ens.parameters(), 1.0)


def _assert_stats(ens, ref):
    for name in ("bn", "bn1d"):
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            got = getattr(getattr(ens.stacked, name), buf)
            want = torch.stack([getattr(getattr(m, name), buf) for m in ref])
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6, msg=f"{name}.{buf}")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_update_bn_recomputes_every_members_statistics(mode):
    ens, ref = _built(mode)
    ens.train()
    ens(torch.randn(4, 3, 8, 8) * 3 + 1)  # statistics moved away from what update_bn will find
    for m in ref:
        m.train()(torch.randn(4, 3, 8, 8) * 3 + 1)
        m.train(mode == "train")
    ens.train(mode == "train")
    swa_utils.update_bn(_loader(), ens)
    for m in ref:
        swa_utils.update_bn(_loader(), m)
    _assert_stats(ens, ref)
    assert ens.training == (mode == "train")
    ens.eval()
    x = torch.randn(5, 3, 8, 8)
    torch.testing.assert_close(ens(x), torch.stack([m.eval()(x) for m in ref]), rtol=1e-5, atol=1e-5)


def test_update_bn_through_an_averaged_model():
    ens, ref = _built()
    swa = swa_utils.AveragedModel(ens)
    swa.update_parameters(ens)
    swa_utils.update_bn(_loader(batches=3), swa)
    for m in ref:
        swa_utils.update_bn(_loader(batches=3), m)
    _assert_stats(swa.module, ref)


def test_update_bn_with_an_empty_loader_resets_as_torch_does():
    ens, ref = _built()
    ens(torch.randn(4, 3, 8, 8))
    swa_utils.update_bn([], ens)
    for m in ref:
        m(torch.randn(4, 3, 8, 8))
        swa_utils.update_bn([], m)
    _assert_stats(ens, ref)


class ExportedNet(Net):
    """`isinstance` of a proxy sends the trace to torch.export, whose graph holds batch norm as an aten op."""

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            x = x - 0.5
        return super().forward(x)


class FrozenBN(Net):
    """mmcv's norm_eval: train() keeps the 2-d BatchNorm in eval, so torch's update_bn leaves its statistics reset."""

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self


@pytest.mark.parametrize("make", [ExportedNet, FrozenBN])
def test_update_bn_on_export_graphs_and_layers_kept_in_eval(make):
    ens, ref = _built(make=make)
    if make is ExportedNet:
        assert ens.plan.tracer == "export"
    swa_utils.update_bn(_loader(), ens)
    for m in ref:
        swa_utils.update_bn(_loader(), m)
    _assert_stats(ens, ref)


def test_update_bn_refuses_a_batch_norm_called_with_its_own_momentum():
    class Functional(Net):
        def forward(self, x):
            h = nn.functional.batch_norm(self.conv(x), self.bn.running_mean, self.bn.running_var, self.bn.weight,
                                         self.bn.bias, self.training, 0.2)
            return self.head(self.bn1d(h.relu().mean((2, 3))))

    ens, _ = _built(make=Functional)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(planner.ExecutionError, match="update_bn on each member"):
        swa_utils.update_bn(_loader(), ens)
    for k, v in ens.state_dict().items():  # refused before any change
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


class TwoViews(nn.Module):
    """SimSiam/BYOL: two augmented views through one encoder, so its BatchNorm runs twice per forward."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.enc(x) - self.enc(x.flip(0) * 2))


def test_update_bn_refuses_a_batchnorm_run_twice_per_forward_and_keeps_the_statistics():
    torch.manual_seed(0)
    members = [TwoViews().train() for _ in range(N)]
    x = torch.randn(8, 6)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), n_members=N), members)
    ens(x)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(planner.ExecutionError, match="2 times"):
        swa_utils.update_bn([torch.randn(8, 6)], ens)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_update_bn_with_momentum_none_keeps_the_layers_own_average():
    make = lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=None), nn.ReLU(), nn.Linear(6, 2))  # noqa: E731
    torch.manual_seed(0)
    members = [make() for _ in range(N)]
    ens = executor.build(planner.propose(planner.trace(members[0], (torch.randn(8, 4),)), n_members=N), members)
    loader = [torch.randn(8, 4) for _ in range(3)]
    ref = copy.deepcopy(members)
    for m in ref:
        swa_utils.update_bn(loader, m)
    swa_utils.update_bn(loader, ens)
    for b in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ens.stacked.get_submodule("1"), b), torch.stack([getattr(m[1], b) for m in ref]),
                                   rtol=2e-5, atol=2e-6)


def test_update_bn_imported_by_name_after_stagewise_reaches_the_batched_module(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "swa.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom stagewise import executor, planner\n"
        "from torch.optim.swa_utils import update_bn\n"  # bound before any batched module exists
        "torch.manual_seed(0)\n"
        "ms = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)) for _ in range(2)]\n"
        "ens = executor.build(planner.propose(planner.trace(ms[0], (torch.randn(8, 3),)), n_members=2), ms)\n"
        "update_bn([torch.randn(8, 3) + 5], ens)\n"
        "assert float(ens.stacked.get_submodule('1').running_mean.mean()) != 0.0\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_clip_grad_norm_compiles_with_fullgraph():
    ens, _ = _built()
    ens(torch.randn(4, 3, 8, 8)).sum().backward()
    grads = [p.grad for p in ens.parameters()]
    norm = torch.compile(lambda gs: torch.nn.utils.get_total_norm(gs), fullgraph=True, backend="eager")(grads)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
