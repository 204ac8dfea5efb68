"""From the review of optimizers and verify: third-party optimizers that take norms over a whole stacked parameter
(SAM's gradient norm, LAMB's trust ratio) are warned about; verify(grads=True) takes a gradient that is rounding noise
in the loop (a conv bias before BatchNorm) as a match without hiding a real error; verify takes a per_member Python
number as one number, and says so when the member loop itself fails. References: N torch optimizers, the member loop."""
from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.habits import JointNormWarning
from stagewise.planner.errors import InputError

verify_module = importlib.import_module("stagewise.executor.verify")  # `executor.verify` is the function
N = 3


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def batched_and_members(n: int = N):
    members = []
    for i in range(n):
        torch.manual_seed(i)
        members.append(Net())
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 8),)), n_members=n, input_mode="per_member")
    return executor.build(plan, copy.deepcopy(members)), members


def batch(step: int, n: int = N):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 5, 8, generator=g), torch.randn(n, 5, 4, generator=g)


def member_loss(out, y):  # [N]: each member's own loss
    return ((out - y) ** 2).mean(dim=(-2, -1))


def worst_member_error(ens, members) -> float:
    saved = ens.member_state_dicts()
    return max(((saved[i][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
               for i, m in enumerate(members) for k, v in m.state_dict().items())


def mixing_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, JointNormWarning)]


# --- 1. third-party optimizers reducing over a whole stacked parameter ---------------------------

class Lamb(torch.optim.Optimizer):
    """pytorch-lamb (cybertronai) as widely copied: a trust ratio from norms over the whole parameter."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                beta1, beta2 = group["betas"]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = state["exp_avg"] / state["exp_avg_sq"].sqrt().add(group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm().clamp(0, 10), update.norm()
                trust = 1.0 if w_norm == 0 or u_norm == 0 else w_norm / u_norm
                p.add_(update, alpha=-group["lr"] * trust)


class SAM(torch.optim.Optimizer):
    """davda54/sam as published: first_step climbs along grad / (norm over all parameters); second_step restores the
    weights and steps the base optimizer (its step is the only one the training loop reaches)."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    def _grad_norm(self, n):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.norm(torch.stack([g.norm(p=2) for g in grads]), p=2)

    @torch.no_grad()
    def first_step(self, n=None):
        norm = self._grad_norm(n)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                scale = group["rho"] / (norm + 1e-12)
                if scale.dim():  # per member: [N] viewed [N, 1, ...]
                    scale = scale.view(-1, *[1] * (p.dim() - 1))
                self.state[p]["old_p"] = p.detach().clone()
                p.add_(p.grad * scale)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()
        self.zero_grad()


class PerMemberSAM(SAM):
    """SAM written for stacked parameters: each member's gradient norm over its own slices; says so."""

    stagewise_per_member = True

    def _grad_norm(self, n):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if n is None:  # one member's own model
            return super()._grad_norm(n)
        return torch.sqrt(sum((g.reshape(n, -1) ** 2).sum(1) for g in grads))


def train_sam(kind, steps: int = 3):
    ens, members = batched_and_members()
    opt = kind(ens.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, rho=0.5)
    own = [kind(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, rho=0.5) for m in members]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            x, y = batch(s)
            member_loss(ens(x), y).sum().backward()
            opt.first_step(N)
            member_loss(ens(x), y).sum().backward()
            opt.second_step()
            for i, m in enumerate(members):
                F.mse_loss(m(x[i]), y[i]).backward()
                own[i].first_step()
                F.mse_loss(m(x[i]), y[i]).backward()
                own[i].second_step()
    return worst_member_error(ens, members), mixing_warnings(caught)


def test_lamb_on_stacked_parameters_warns_naming_it_and_the_fix():
    # was: 2e-2 off N torch Lambs after 4 steps (each member's trust ratio from all members' norms), no word
    ens, members = batched_and_members()
    opt = Lamb(ens.parameters(), lr=0.01, weight_decay=0.01)
    own = [Lamb(m.parameters(), lr=0.01, weight_decay=0.01) for m in members]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(4):
            x, y = batch(s)
            opt.zero_grad()
            member_loss(ens(x), y).sum().backward()
            opt.step()
            for i, m in enumerate(members):
                own[i].zero_grad()
                F.mse_loss(m(x[i]), y[i]).backward()
                own[i].step()
    assert worst_member_error(ens, members) > 1e-3  # what the warning is about: the members mixed
    said = mixing_warnings(caught)
    assert len(said) == 1, said  # once, at the first step
    assert "Lamb" in said[0] and "stacked [N, ...] parameter" in said[0] and "per member" in said[0]
    assert "executor.StackedSGD" in said[0] and "stagewise_per_member = True" in said[0]


def test_sam_stepping_its_base_optimizer_is_warned_about():
    # was: 0.09-0.41 off N torch SAMs after 4 steps (one gradient norm over all members), no word: SAM's own step never
    # runs, its base torch.optim.SGD (per element) is what steps
    error, said = train_sam(SAM)
    assert error > 1e-2
    assert len(said) == 1 and ".SAM steps a batched module's stacked parameters" in said[0], said


def test_sam_with_per_member_norms_that_says_so_trains_as_n_torch_sams_without_a_warning():
    error, said = train_sam(PerMemberSAM)
    assert said == []
    assert error < 2e-5


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    lambda ps: torch.optim.NAdam(ps, lr=0.01),
    lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps, lr=0.01),  # a subclass keeping Adam's step
    lambda ps: executor.StackedAdam(ps, N, lr=[0.01, 0.02, 0.03]),
], ids=["sgd", "adam", "adamw", "rmsprop", "adagrad", "nadam", "adam_subclass", "stacked_adam"])
def test_per_element_optimizers_are_not_warned_about(make):
    ens, _ = batched_and_members()
    opt = make(ens.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(2):
            x, y = batch(s)
            opt.zero_grad()
            member_loss(ens(x), y).sum().backward()
            opt.step()
    assert mixing_warnings(caught) == []


# --- 2. verify(grads=True): a gradient that is rounding noise in the loop ------------------------

class ConvBN(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.c, self.bn, self.fc = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.c(x))).mean((2, 3)))


def conv_bn_case(seed: int = 0):
    torch.manual_seed(seed)
    members = [ConvBN() for _ in range(4)]  # training mode: the conv bias's gradient is zero in exact arithmetic
    plan = planner.propose(planner.trace(members[0], (torch.randn(8, 3, 16, 16),)), n_members=4, input_mode="per_member")
    return plan, members, (torch.randn(4, 8, 3, 16, 16),)


def grad_rows(report) -> dict:
    return {r.name: r for r in report.gradients}


def test_verify_grads_takes_a_conv_bias_before_batchnorm_as_a_match():
    # was: MISMATCH, grad c.bias max rel 1.5e-4 (its float32 noise against 1e-3 of the member's gradient norm)
    plan, members, inputs = conv_bn_case()
    report = executor.verify(plan, members, inputs, grads=True, more_inputs=())
    rows = grad_rows(report)
    assert report.ok, report.to_text()
    assert rows["c.bias"].ok and rows["c.bias"].max_abs > 0  # noise, not an exact zero, compared
    assert all(r.max_rel < 1e-4 for r in report.gradients)


def perturbed_grads(monkeypatch, name: str, change) -> None:
    """verify builds the batched module, then the gradient of one stacked parameter is changed by a hook (`change`)."""
    real = verify_module.build

    def build(*args, **kwargs):
        module = real(*args, **kwargs)
        dict(module.named_stacked_parameters())[name].register_hook(change)
        return module

    monkeypatch.setattr(verify_module, "build", build)


def test_verify_grads_still_reports_a_real_error_in_a_large_or_a_noise_level_gradient(monkeypatch):
    plan, members, inputs = conv_bn_case()
    # a 1e-3 error in a gradient of ordinary size (the conv weight's)
    perturbed_grads(monkeypatch, "c.weight", lambda g: g * 1.001)
    report = executor.verify(plan, members, inputs, grads=True, more_inputs=())
    assert not grad_rows(report)["c.weight"].ok and grad_rows(report)["c.bias"].ok
    # an error in the gradient that is zero in the loop, of 1e-4 of the member's whole gradient norm (~17 here)
    monkeypatch.undo()
    perturbed_grads(monkeypatch, "c.bias", lambda g: g + 5e-4)
    report = executor.verify(plan, members, inputs, grads=True, more_inputs=())
    assert not grad_rows(report)["c.bias"].ok and not report.ok


# --- 3. verify's inputs: a per_member Python number; the loop itself failing -----------------------

class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, temperature):
        return F.softmax(self.fc(x) / temperature, -1)


def temperature_case():
    torch.manual_seed(0)
    members = [Temperature() for _ in range(N)]
    x = torch.randn(2, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x, 1.0))
    return planner.propose(graph, n_members=N, input_mode={"temperature": "per_member"}), members, x


def test_verify_takes_a_per_member_python_number_for_every_member_or_a_list_one_each():
    # was: TypeError: 'float' object is not subscriptable
    plan, members, x = temperature_case()
    for given, each in [(0.7, [0.7] * N), ([0.5, 1.0, 2.0], [0.5, 1.0, 2.0]), (torch.tensor(0.7), [0.7] * N)]:
        report = executor.verify(plan, members, (x, given))
        assert report.ok and report.max_rel < 1e-6, report.to_text()
        # what verify compared: the member loop on each member's own number, as torch runs it
        ens = executor.build(plan, copy.deepcopy(members), example_inputs=(x, 1.0))
        with torch.no_grad():
            got = ens(x, torch.tensor(each, dtype=torch.float32))
            want = torch.stack([m(x, t) for m, t in zip(members, each)])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert verify_module.member_inputs(plan, (x, 0.7), 2)[1] == 0.7


EAGER_FAILS = {"on": False}


class FailsEagerly(nn.Module):
    """Fails when called eagerly once EAGER_FAILS is on; its fx trace (and so the batched module) does not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if EAGER_FAILS["on"] and not torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            raise ValueError("this model refuses eager calls")
        return self.fc(x)


def test_verify_says_the_member_loop_itself_fails():
    # was: the model's raw ValueError traceback from inside verify
    torch.manual_seed(0)
    members = [FailsEagerly() for _ in range(N)]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(members[0], (x,)), N)
    EAGER_FAILS["on"] = True
    try:
        with pytest.raises(InputError, match=r"the plain loop over members itself fails \(member 0.*ValueError: this "
                                             r"model refuses eager calls") as e:
            executor.verify(plan, members, (x,))
        assert "pass inputs each member takes" in str(e.value)
    finally:
        EAGER_FAILS["on"] = False


class OnlyFiveRows(nn.Module):
    """Takes batches of 5 rows alone when called eagerly; its fx trace (and so the batched module) takes any."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if not torch.fx._symbolic_trace.is_fx_symbolic_tracing() and x.shape[0] != 5:
            raise ValueError(f"{x.shape[0]} rows: this model takes 5")
        return self.fc(x)


def test_a_further_input_set_the_loop_cannot_take_is_still_a_note_with_the_models_error():
    torch.manual_seed(0)
    members = [OnlyFiveRows() for _ in range(N)]
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(members[0], (x,)), N)
    report = executor.verify(plan, members, (x,), more_inputs=[(torch.randn(7, 4),)])
    assert report.ok and report.shapes == ["[5, 4]"]
    assert report.notes == ["input shape [7, 4] not compared: the member loop itself fails on it (ValueError: 7 rows: "
                            "this model takes 5)"]


class LayerScaleBlock(nn.Module):
    """A ConvNeXt-style block behind a layer scale of 1e-6 (its usual init): the branch's gradients are ~1e-6 of the
    member's whole gradient, as small as float32 noise of a gradient that is zero in exact arithmetic."""

    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, 4)
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1, self.pw2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(1e-6 * torch.ones(d))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        s = self.stem(x)
        h = self.dw(s).permute(0, 2, 3, 1)
        h = self.pw2(F.gelu(self.pw1(self.norm(h)))) * self.gamma
        return self.head((s + h.permute(0, 3, 1, 2)).mean((2, 3)))


@pytest.mark.parametrize("name, change", [("dw.weight", lambda g: -g), ("pw1.weight", lambda g: g * 0)],
                         ids=["sign_flipped", "zeroed"])
def test_verify_grads_reports_a_wrong_gradient_of_a_branch_behind_a_small_layer_scale(monkeypatch, name, change):
    # the noise floor alone (1e-5 of the member's gradient norm) took these as matches: 3.9e-6 and 1.9e-6 of it
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(LayerScaleBlock())
    x = torch.randn(4, 3, 32, 32)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N, input_mode="shared")
    assert executor.verify(plan, members, (x,), grads=True, more_inputs=()).ok
    perturbed_grads(monkeypatch, name, change)
    report = executor.verify(plan, members, (x,), grads=True, more_inputs=())
    assert not grad_rows(report)[name].ok and not report.ok


def test_an_adam_subclass_made_before_any_plain_adam_is_not_warned_about(tmp_path):
    # torch's Optimizer.__init__ writes a profiling wrapper of Adam.step into the class of the first instance made:
    # a subclass made first held a `step` of its own and was taken for an unknown optimizer (a false JointNormWarning)
    import subprocess
    import sys
    script = tmp_path / "first.py"
    script.write_text(
        "import warnings, torch\n"
        "from torch import nn\n"
        "from stagewise import executor, planner\n"
        "class HookedAdam(torch.optim.Adam):\n"
        "    def __init__(self, params, **kw):\n"
        "        super().__init__(params, **kw)\n"
        "        self.register_step_post_hook(lambda *a: None)\n"
        "members = [nn.Linear(4, 4) for _ in range(3)]\n"
        "x = torch.randn(2, 4)\n"
        "plan = planner.propose(planner.trace(members[0], (x,)), n_members=3, input_mode='shared')\n"
        "ens = executor.build(plan, members)\n"
        "opt = HookedAdam(ens.parameters(), lr=1e-3)\n"
        "assert 'step' in HookedAdam.__dict__  # what torch did\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    ens(x).sum().backward(); opt.step()\n"
        "names = [type(w.message).__name__ for w in caught if 'JointNorm' in type(w.message).__name__]\n"
        "assert not names, names\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
