"""Silent wrong answers found by review in how built modules are called and trained, each against the plain loop
over members (or refused by name): plain tensor attributes forward() writes, output keys made from a per-member
attribute, per_member inputs whose rows share memory, whole-plan capture of aliased inputs, gradient hooks on
member parameters, an lr written into a stacked optimizer's param group, torch.func.grad over the batched module."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from stagewise import executor, planner
from stagewise.executor import StackedSGD
from stagewise.planner.errors import ExecutionError, InputError, MemberError, OptimizerError, TraceError

N = 3


def _members(make):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(make().eval())
    return out


def _build(members, example, mode="shared", strategy=None):
    graph = planner.trace(copy.deepcopy(members[0]), example)
    plan = planner.propose(graph, n_members=N, input_mode=mode)
    if strategy is not None:
        for s in plan.stages:
            plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    return executor.build(plan, copy.deepcopy(members)), plan


# --- a tensor held as a plain attribute, written in place by forward() ------------------------------------------

class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.count = nn.Linear(8, 8), torch.zeros(1)  # not a buffer: stacked nowhere, kept once

    def forward(self, x):
        self.count.add_(1)
        return self.l(x) * self.count


def test_a_plain_tensor_attribute_written_by_forward_is_refused_and_left_as_it_was():
    """Was: every member ran with the count of build time (factor 1, 0, 0 where the loop had 2, 1, 1), and tracing
    ran forward() on the caller's model eight times (count 8)."""
    m = Counter()
    with pytest.raises(TraceError, match=r"'count'.*buffer"):
        planner.trace(m, (torch.randn(4, 8),))
    assert m.count.item() == 0


# --- output structure made from a per-member attribute ------------------------------------------------------

class Named(nn.Module):
    def __init__(self, name="run0"):
        super().__init__()
        self.l, self.name = nn.Linear(8, 8), name

    def forward(self, x):
        return {self.name: self.l(x)}


def test_members_whose_output_keys_differ_are_refused_by_name():
    """Was: every member's output came back under member 0's key, and verify said MATCH (leaves only)."""
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(Named(f"run{i}").eval())
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 8),))
    with pytest.raises(MemberError, match=r"another structure.*name"):
        executor.build(planner.propose(graph, n_members=N), members)


# --- per_member inputs whose member rows share memory, written in place ------------------------------------

class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, a):
        a.mul_(2)
        return self.fc(a)


def _expanded():
    return torch.randn(5, 4).expand(N, 5, 4)


def _windows():  # member i's rows are rows i..i+4 of one series (unfold-like)
    return torch.randn(4 * (N + 4)).as_strided((N, 5, 4), (4, 4, 1))


@pytest.mark.parametrize("strategy", ["vmap", "wide", "loop"])
@pytest.mark.parametrize("make", [_expanded, _windows])
def test_a_written_per_member_input_whose_rows_share_memory_is_refused(make, strategy):
    """Was: the loop writes member i's rows before member i+1 reads them; vmap and wide wrote all at once (off by
    up to 5.5), and an expanded input was copied first (off by 0.35)."""
    ens, _ = _build(_members(WritesInput), (torch.randn(5, 4),), mode="per_member", strategy=strategy)
    with torch.no_grad(), pytest.raises(InputError, match=r"'a'.*share memory.*clone"):
        ens(make())
    x = make().clone()  # its own rows: as the loop
    want = torch.stack([m(x[i].clone()) for i, m in enumerate(_members(WritesInput))])
    with torch.no_grad():
        torch.testing.assert_close(ens(x), want, rtol=1e-6, atol=1e-6)


def test_inputs_that_are_read_only_may_share_memory():
    ens, _ = _build(_members(lambda: nn.Linear(4, 4)), (torch.randn(5, 4),), mode="per_member")
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(ens(x.expand(N, 5, 4)), torch.stack([m(x) for m in _members(lambda: nn.Linear(4, 4))]))


# --- whole-plan capture, inputs sharing memory -----------------------------------------------------------------

class WritesFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, a, b):
        a.mul_(2)
        return self.fc(a) + b


def test_capture_with_one_tensor_passed_as_two_written_arguments_matches_the_loop():
    """Was: each argument got its own static buffer, so the write to `a` no longer reached `b` (off by 2.8)."""
    members = _members(WritesFirst)
    ens, _ = _build(members, (torch.randn(5, 4), torch.randn(5, 4)), mode="per_member")
    fast = executor.capture(ens, backend=executor.ReplayBackend())
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(N, 5, 4)
            y = x.clone()
            got = fast(x, x)
            want = torch.stack([m(y[i], y[i]) for i, m in enumerate(members)])
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(x, y)


def test_capture_without_clones_fed_its_own_output_matches_the_loop():
    """Was: the written input was copied back into the caller's tensor, which was the graph's own output buffer,
    overwriting the output just computed (off by 0.67 from the second step)."""
    members = _members(WritesInput)
    ens, _ = _build(members, (torch.randn(5, 4),), mode="per_member")
    fast = executor.capture(ens, backend=executor.ReplayBackend(), clone_outputs=False)
    x = torch.randn(N, 5, 4)
    y = x.clone()
    with torch.no_grad():
        for _ in range(3):
            x = fast(x)
            y = torch.stack([m(y[i]) for i, m in enumerate(members)])
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# --- gradient hooks on the members' parameters -----------------------------------------------------------------

def test_gradient_hooks_on_member_parameters_refuse_training_not_inference():
    """Was: a hook masking rows of an embedding's gradient was dropped; the frozen rows moved 0.15 in 3 steps."""
    members = _members(lambda: nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)))
    mask = torch.ones(10, 1)
    mask[:5] = 0
    for m in members:
        m[0].weight.register_hook(lambda g: g * mask)
    ids = torch.randint(0, 10, (6,))
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (ids,)), n_members=N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(ids), torch.stack([m(ids) for m in members]))
    with pytest.raises(ExecutionError, match=r"gradient hooks on \['0.weight'\].*named_stacked_parameters"):
        ens(ids).sum().backward()


# --- an lr written into a stacked optimizer's param group ------------------------------------------------------

def test_an_lr_written_by_user_code_while_member_lrs_differ_is_refused():
    """Was: `g["lr"] = 0.004` (a warm-up) scaled each member's own lr (0.01, 0.02, 0.04 -> 4e-5, 8e-5, 1.6e-4) where
    N torch optimizers all run at 0.004."""
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=[0.01, 0.02, 0.04])
    with pytest.raises(OptimizerError, match=r"set_hyperparameter\('lr', 0.004\)"):
        for g in opt.param_groups:
            g["lr"] = 0.004
    with pytest.raises(OptimizerError, match="set_hyperparameter"):
        opt.param_groups[0].update(lr=0.004)  # dict.update does not pass __setitem__ by itself
    for g in opt.param_groups:  # relative to the group's own lr: each member's lr scaled, as on N torch optimizers
        g["lr"] *= 0.5
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([0.005, 0.01, 0.02], dtype=torch.float64))
    opt.param_groups[0]["initial_lr"] = opt.param_groups[0]["lr"] * 2  # the base, as a factor of the group's lr
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * 0.1  # a schedule written by hand as a factor of the base (timm's habit)
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([0.001, 0.002, 0.004], dtype=torch.float64))
    same = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=0.01)
    for g in same.param_groups:  # every member at the same lr: the write sets it, as on a torch optimizer
        g["lr"] = 0.004
    torch.testing.assert_close(same.get_hyperparameter("lr"), torch.full((N,), 0.004, dtype=torch.float64))


def test_an_lr_from_a_config_or_with_a_floor_is_refused_and_pure_factors_in_any_form_scale_each_member():
    """Was: the source line was matched by a pattern, so `g["lr"] = cfg["lr"] * warm` (an absolute lr read from a
    config) scaled each member's own lr (0.001..0.03 -> 5e-6..1.5e-4 where N torch optimizers run at 5e-3), and
    `g["lr"] = max(g["lr"] * 0.5, 2e-3)` put the floor on the shared scale (2e-6.. instead of 2e-3), both without a
    word; `g.__setitem__("lr", g["lr"] * 0.1)` was refused."""
    lrs = [0.01, 0.02, 0.04]
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=lrs)
    cfg = {"lr": 5e-3}
    with pytest.raises(OptimizerError, match=r"set_hyperparameter\('lr', 0.0025\)"):
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * 0.5
    with pytest.raises(OptimizerError, match="otherwise than by a factor"):
        for g in opt.param_groups:
            g["lr"] = max(g["lr"] * 0.5, 2e-3)
    with pytest.raises(OptimizerError, match="otherwise than by a factor"):
        for g in opt.param_groups:
            g["lr"] += 1e-3  # an offset: lr_i + 1e-3 on each torch optimizer
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor(lrs, dtype=torch.float64))  # nothing written
    warm = 0.5
    for g in opt.param_groups: g["lr"] = g["lr"] * warm  # noqa: E701 - one line, as in many training loops
    [g.__setitem__("lr", g["lr"] / 2) for g in opt.param_groups]
    for g in opt.param_groups:
        g.update(lr=2 * g["lr"] * 0.5)
    for g in opt.param_groups:
        g["lr"] = (
            g["lr"]
            * 2
        )
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor(lrs, dtype=torch.float64) / 2)


def test_lr_writes_through_initial_lr_or_dict_merge_are_checked_and_more_factor_forms_scale():
    """Was silent: `g["initial_lr"] = 0.05` then `g["lr"] = g["initial_lr"] * 1.0` (accepted as a factor), and
    `g |= {"lr": 0.05}` (dict.__ior__ skipped the check), both scaled each member's own lr; a walrus, a conditional
    factor, operator.setitem and g.get("lr") were refused."""
    import operator

    lrs = [0.1, 0.2, 0.4]
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=lrs)
    g = opt.param_groups[0]
    with pytest.raises(OptimizerError, match=r"\['initial_lr'\] = 0.05 written"):
        g["initial_lr"] = 0.05
    with pytest.raises(OptimizerError, match="set_hyperparameter"):
        g |= {"lr": 0.05}
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor(lrs, dtype=torch.float64))
    cond = True
    g["initial_lr"] = g["lr"]  # the base a hand-written schedule scales: a factor (1) of the group's own lr
    g["lr"] = (v := g["lr"] * 0.5)  # noqa: F841
    g["lr"] = g["lr"] * 2 if cond else g["lr"]
    operator.setitem(g, "lr", g.get("lr") / 2)
    g |= {"lr": g["lr"] * 4}
    g.update({"lr": g["lr"] / 4})
    g["lr"] = g["initial_lr"] * 0.5
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor(lrs, dtype=torch.float64) / 2)


# --- torch.func.grad over functional_call of the batched module -----------------------------------------------

def test_torch_func_grad_through_a_plan_with_a_loop_stage_matches_the_loop():
    """Was a raw RuntimeError ("Cannot access data pointer of Tensor that doesn't have storage")."""
    make = lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # noqa: E731
    members = _members(make)
    x, y = torch.randn(N, 6, 4), torch.randn(N, 6, 2)
    ens, _ = _build(members, (x[0],), mode="per_member", strategy="loop")
    params = {k: v.detach() for k, v in ens.named_parameters()}
    got = grad(lambda p: ((functional_call(ens, p, (x,)) - y) ** 2).mean(dim=(1, 2)).sum())(params)
    for i, m in enumerate(members):
        ((m(x[i]) - y[i]) ** 2).mean().backward()
    for k, g in got.items():
        name = k.replace("stacked.", "", 1)
        torch.testing.assert_close(g, torch.stack([m.get_parameter(name).grad for m in members]), rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # and the module runs on after it
        torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]))


# --- None and Python numbers among the example inputs ------------------------------------------------------

class Optional_(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=None):
        y = self.fc(x)
        if mask is not None:
            y = y.masked_fill(~mask, 0.0)
        if scale is not None:
            y = y * scale
        return y


def test_an_explicit_none_input_traces_and_a_number_input_rebuilds_from_the_plan_file(tmp_path):
    """Was: fx traced the None as a value (`~mask` failed: a TraceError blaming the example inputs), and an export
    plan with a Python-number input could not be built from its file (its value was not recorded)."""
    members = _members(Optional_)
    x = torch.randn(2, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x, None, 2.0))
    assert graph.tracer == "export"
    path = tmp_path / "plan.json"
    planner.propose(graph, n_members=N).save(path)
    plan = planner.Plan.load(path)
    assert plan.inputs[-1].value == 2.0
    ens = executor.build(plan, members)  # no example inputs: the plan's own
    with torch.no_grad():
        torch.testing.assert_close(ens(x, None, 2.0), torch.stack([m(x, None, 2.0) for m in members]))
        with pytest.raises(InputError, match="scale == 2.0"):
            ens(x, None, 3.0)


def test_prelu_members_with_other_initial_slopes_build_and_match_the_loop():
    """Was refused ("PReLU.init cannot be given per member"): `init` only sets the initial weight, which is state."""
    members = [nn.Sequential(nn.Linear(4, 4), nn.PReLU(4, init=a)).eval() for a in (0.1, 0.25, 0.3)]
    x = torch.randn(2, 4)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(-x.abs()), torch.stack([m(-x.abs()) for m in members]))


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, x):
        return nn.functional.dropout(self.l(x), 0.5, self.training)


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_functional_dropout_forced_to_wide_draws_as_the_loop_draws(mode):
    """Was: vmap's raw "called random operation while in randomness error mode", with "check the input shapes"."""
    members = [m.train() for m in _members(FunctionalDropout)]
    x = torch.randn(5, 6) if mode == "shared" else torch.randn(N, 5, 6)
    ens, _ = _build(members, ((x if mode == "shared" else x[0]),), mode=mode, strategy="wide")
    ens.train()
    torch.manual_seed(3)
    got = ens(x)
    torch.manual_seed(3)
    want = torch.stack([m(x if mode == "shared" else x[i]) for i, m in enumerate(members)])
    torch.testing.assert_close(got, want)
    got.sum().backward()


def test_none_for_an_input_traced_as_a_tensor_is_an_input_error():
    """Was a vmap TypeError from inside the stage (`~None`)."""
    members = _members(Optional_)
    x, mask = torch.randn(2, 4), torch.rand(2, 4) > 0.3
    ens, _ = _build(members, (x, mask))
    with torch.no_grad():
        torch.testing.assert_close(ens(x, mask), torch.stack([m(x, mask) for m in members]))
        with pytest.raises(InputError, match="'mask' was traced as a tensor, got None"):
            ens(x, None)


def test_a_pruned_model_is_refused_with_prune_remove_as_the_fix():
    """Was refused with "handle.remove()" advice, which does not apply to torch.nn.utils.prune."""
    from torch.nn.utils import prune

    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    with pytest.raises(TraceError, match=r"pruned.*'0'.*prune.remove\(module, 'weight'\)"):
        planner.trace(m, (torch.randn(2, 4),))
    prune.remove(m[0], "weight")
    planner.trace(m, (torch.randn(2, 4),))


class Keywords(nn.Module):
    def __init__(self, reads):
        super().__init__()
        self.l, self.reads = nn.Linear(4, 4), reads

    def forward(self, x, **kwargs):
        return self.l(x) * (kwargs.get("scale", 2.0) if self.reads else 1.0)


@pytest.mark.parametrize("reads", [False, True])
def test_a_forward_taking_keywords_traces_without_them_and_matches_the_loop(reads):
    """Was: fx made the **kwargs dict a graph input; read, the trace failed with "'list' object has no attribute
    'get'" blaming the example inputs, unread, the batched module wanted two inputs."""
    members = _members(lambda: Keywords(reads))
    x = torch.randn(2, 4)
    ens, plan = _build(members, (x,))
    assert [i.name for i in plan.inputs] == ["x"]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_rows_overlap_looks_between_members_only():
    from stagewise.executor.input_writes import rows_overlap

    assert rows_overlap(torch.randn(4, 3).expand(N, 4, 3))  # every member the same rows
    assert rows_overlap(torch.randn(4 * (N + 4)).as_strided((N, 5, 4), (4, 4, 1)))  # windows
    assert not rows_overlap(torch.randn(N, 1, 4).expand(N, 3, 4))  # a broadcast inside each member's own row
    assert not rows_overlap(torch.randn(5, N, 4).transpose(0, 1))
    assert not rows_overlap(torch.randn(N, 6, 4)[:, ::2])
    assert not rows_overlap(torch.randn(N, 3, 8, 8).to(memory_format=torch.channels_last))


class LazyCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.cache = nn.Linear(4, 4), None

    def forward(self, x):
        if self.cache is None:
            self.cache = self.fc.weight.detach().sum(0)
        return self.fc(x) + self.cache


def test_a_cache_filled_lazily_from_parameters_leaves_the_model_whole_and_verify_runs():
    """Was: planner.trace left an fx Proxy in the model's `cache` (its forward then returned a Proxy), and verify
    failed with KeyError: 'sum_1' (the member traced again after running takes the other branch)."""
    m = LazyCache()
    x = torch.randn(5, 4)
    planner.trace(m, (x,))
    assert m.cache is None and type(m(x)) is torch.Tensor
    members = _members(LazyCache)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N)
    report = executor.verify(plan, members, (x,))
    assert report.ok and not report.notes, report.notes  # a retrace puts back what forward() cached: all compared


# --- sweeps through torch.export (every Hugging Face model traces that way) ------------------------------------

class Sweep(nn.Module):
    """A sweep's number used three ways; a branch on a shape sends the trace to torch.export."""

    def __init__(self, value, how):
        super().__init__()
        self.value, self.how = value, how
        self.emb, self.fc = nn.Embedding(8, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] > 100:
            x = x * 2
        if self.how == "dropout":  # rate swept, members in eval: no effect
            return torch.nn.functional.dropout(self.fc(x), self.value, self.training)
        if self.how == "eq":  # an id swept (CLIP's eos_token_id)
            return self.fc(x) * (torch.arange(x.shape[1]) == self.value).float()[None, :, None]
        t = x.shape[1]  # T5's buckets: the number added in place into a tensor made alike for every member
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        buckets = torch.zeros_like(rel)
        buckets += (torch.log(rel.abs().float() + 1) / math.log(self.value)).to(torch.long).clamp(max=7)
        return x + self.emb(buckets).mean(-1).mean(-1)[None, :, None]


@pytest.mark.parametrize("how, values", [("dropout", (0.1, 0.3, 0.5)), ("eq", (1, 3, 5))])
def test_export_sweeps_over_an_eval_dropout_rate_and_a_compared_id_match_the_loop(how, values):
    """Were refused: aten.dropout(x, p, False) and aten.eq.Scalar took "a plain Python value" (fx lifted them)."""
    members = [Sweep(v, how).eval() for v in values]
    x = torch.randn(2, 8, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    assert graph.tracer == "export"
    ens = executor.build(planner.propose(graph, n_members=N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_a_swept_number_written_in_place_into_a_shared_tensor_names_the_stage_to_exclude():
    """Was: an InputError blaming the input shapes on every call (vmap cannot write [N] values into the one tensor
    forward() makes for every member)."""
    members = [Sweep(v, "buckets").eval() for v in (128.0, 3.0, 2.0)]
    x = torch.randn(2, 8, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, n_members=N)
    ens = executor.build(plan, members)
    with torch.no_grad(), pytest.raises(ExecutionError, match=r"numbers the members hold differently.*planner.exclude"):
        ens(x)
    stage = next(s.id for s in plan.stages if s.mode.value == "batched")
    ens = executor.build(planner.exclude(plan, graph, stage), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_capture_reads_a_state_tensor_replaced_since_its_last_call():
    """Was: the captured module replayed the old tensors after `ens.stacked.<m>.bias = nn.Parameter(...)` or
    load_state_dict(assign=True) (off by 2.3) until the module itself was called once."""
    members = _members(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(3, 4)
    ens, _ = _build(members, (x,))
    ens.eval()
    fast = executor.capture(ens, backend=executor.ReplayBackend())
    with torch.no_grad():
        fast(x)
        new_bias = torch.randn(N, 2)
        ens.stacked.get_submodule("2").bias = nn.Parameter(new_bias)
        for i, m in enumerate(members):
            m[2].bias.data.copy_(new_bias[i])
        torch.testing.assert_close(fast(x), torch.stack([m(x) for m in members]))
        state = {k: v + 0.5 for k, v in ens.state_dict().items()}
        ens.load_state_dict(state, assign=True)
        for i, m in enumerate(members):
            m.load_state_dict({k[len("stacked."):]: v[i] for k, v in state.items() if k.startswith("stacked.")})
        torch.testing.assert_close(fast(x), torch.stack([m(x) for m in members]))


# --- the whole module through torch.save / torch.load ----------------------------------------------------------

class Swept(nn.Module):
    def __init__(self, slope):
        super().__init__()
        self.fc1, self.fc2, self.slope = nn.Linear(4, 8), nn.Linear(8, 2), slope
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.leaky_relu(self.bn(self.fc1(x)), self.slope) * self.slope)


@pytest.mark.parametrize("strategy", [None, "loop", "wide"])  # None: vmap stages and BatchNorm's loop stage
def test_a_pickled_batched_module_loads_and_runs_and_trains_like_the_loop(tmp_path, strategy):
    """Was: torch.save(ens) failed on a runner's local function (after torch had truncated the file), or saved a
    file that could not be loaded ('_Watched' object has no attribute 'changed')."""
    members = [Swept(s) for s in (0.1, 0.2, 0.3)]
    x = torch.randn(5, 4)
    ens, _ = _build(members, (x,), strategy=strategy)
    path = tmp_path / "ens.pt"
    torch.save(ens, path)
    loaded = torch.load(path, weights_only=False)
    for m in members:
        m.train()
    loaded.train()
    out = loaded(x)
    torch.testing.assert_close(out, torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    for m in members:
        m(x).square().sum().backward()
    got = dict(loaded.named_stacked_parameters())
    torch.testing.assert_close(got["fc1.weight"].grad, torch.stack([m.fc1.weight.grad for m in members]),
                               rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in ens.parameters())  # the saved module is untouched by the loaded one's step


@pytest.mark.parametrize("strategy", ["vmap", "loop", "wide"])
@pytest.mark.parametrize("shape", [(2,), (1, 2), (N + 1, 2)])
def test_state_given_storage_without_its_member_axis_is_refused_by_name(strategy, shape):
    """Was: the loop read row i of whatever it got ([2] -> one number per member, [N+1, 2] -> the extra row
    ignored) and wide broadcast a [1, 2] to every member, all without a word; vmap refused in its own words."""
    members = _members(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    x = torch.randn(3, 4)
    ens, _ = _build(members, (x,), strategy=strategy)
    with torch.no_grad():
        ens(x)
        ens.stacked.get_submodule("2").bias.data = torch.zeros(shape)
        with pytest.raises(ExecutionError, match=r"'2.bias' is now shaped .*member axis first"):
            ens(x)
        ens.stacked.get_submodule("2").bias.data = torch.zeros(N, 2)  # its shape again: runs, and reads it
        torch.testing.assert_close(ens(x), torch.stack([m(x) - m[2].bias for m in members]))
        bias = ens.stacked.get_submodule("2").bias
        bias.data = bias.data[0]  # another shape at the same address
        with pytest.raises(ExecutionError, match="is now shaped"):
            ens(x)
        bias.data = torch.zeros(N, 2)
        torch.testing.assert_close(ens(x), torch.stack([m(x) - m[2].bias for m in members]))


class AttentionWithoutWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        out, _ = self.m(x, x, x, need_weights=False)  # the second item is None
        return out


def test_wide_takes_a_none_item_of_a_modules_outputs():
    """Was: `vmap ... must only return Tensors, got NoneType` (the getitem rule's None read as "no rule")."""
    members = _members(AttentionWithoutWeights)
    x = torch.randn(2, 5, 8)
    ens, _ = _build(members, (x,), strategy="wide")
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


def test_a_plan_file_listing_a_stages_nodes_out_of_order_builds_and_matches_the_loop(tmp_path):
    """Was a bare KeyError from build (`stagewise run`: "unexpected KeyError")."""
    import json

    members = _members(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    path = tmp_path / "plan.json"
    planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N).save(path)
    data = json.loads(path.read_text())
    data["stages"][0]["nodes"].reverse()
    path.write_text(json.dumps(data))
    ens = executor.build(planner.Plan.load(path), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_member_weights_never_mix_two_sets_in_one_folder(tmp_path):
    """Was: saving 2 members where 3 had been saved left member_002 beside them (loading the folder gave 3), and a
    folder path naming a file raised a raw FileExistsError."""
    from stagewise.planner.errors import OutputFileError

    x = torch.randn(3, 4)
    three, _ = _build(_members(lambda: nn.Linear(4, 2)), (x,))
    executor.save_member_weights(three, tmp_path / "w")
    members = _members(lambda: nn.Linear(4, 2))[:2]
    two = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=2), members)
    with pytest.raises(OutputFileError, match="larger set.*member_002"):
        executor.save_member_weights(two, tmp_path / "w")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputFileError, match="it is a file"):
        executor.save_member_weights(two, tmp_path / "afile")
    assert len(executor.save_member_weights(two, tmp_path / "two")) == 2
