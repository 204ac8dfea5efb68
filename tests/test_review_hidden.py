"""Review: state a trace cannot see. Python-level random draws and clocks read in forward(), torch.inference_mode(),
global module hooks, a forward or __call__ the trace does not run, config held in dicts and objects, and function
attributes closing over the member's own modules. Each was a silent wrong answer (the batched module differed from
the plain loop over the members); each now matches the loop or is refused naming the problem and the fix."""
from __future__ import annotations

import copy
import random
import time
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.module as torch_module
from torch import nn

from stagewise import executor, planner

N = 3
X = torch.randn(5, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def plan_for(model, n=N):
    return planner.propose(planner.trace(copy.deepcopy(model), (X,)), n)


def assert_matches_loop(members, train=False, grads=False, shapes=((5, 4), (7, 4)), calls=2):
    """Outputs (and with `grads` every parameter's gradient) equal the member loop, over calls and two input shapes."""
    for m in members:
        m.train(train)
    reference = copy.deepcopy(members)
    plan = plan_for(members[0], len(members))
    ens = executor.build(plan, members).train(train)
    for shape in shapes:
        for _ in range(calls):
            x = torch.randn(*shape)
            ens.zero_grad(set_to_none=True)
            got = ens(x)
            outs = []
            for m in reference:
                m.zero_grad(set_to_none=True)
                outs.append(m(x))
            torch.testing.assert_close(got, torch.stack(outs), rtol=1e-5, atol=1e-6)
            if grads:
                (got ** 2).sum().backward()
                sum((o ** 2).sum() for o in outs).backward()
                for name, p in ens.named_stacked_parameters():
                    for i, m in enumerate(reference):
                        want = dict(m.named_parameters())[name].grad
                        if want is None:
                            assert p.grad is None or not p.grad[i].any(), f"{name}: gradient where the loop has none"
                        else:
                            torch.testing.assert_close(p.grad[i], want, rtol=1e-4, atol=1e-6)
    return plan, ens


# --- 1. Python-level random draws and clocks --------------------------------------------------------------
# was: fx (and torch.export) ran `random.random()` once while tracing and baked the draw into the graph; every
# call of every member reused it where the loop drew anew (outputs off by up to 4x)

class PyRandomBranch(Net):
    p = 0.5

    def forward(self, x):
        if random.random() < self.p:  # layer drop with Python's random
            return x
        return super().forward(x)


class PyUniform(Net):
    def forward(self, x):
        return super().forward(x) * random.uniform(0.5, 1.5)


class NumpyDraw(Net):
    def forward(self, x):
        return super().forward(x) * float(np.random.rand())


class HeldGenerator(Net):
    def __init__(self, kind):
        super().__init__()
        self.rng = np.random.default_rng(0) if kind == "numpy" else random.Random(0)

    def forward(self, x):
        return super().forward(x) * float(self.rng.random())


class Clock(Net):
    def forward(self, x):
        return super().forward(x) * (time.perf_counter() % 1.0)


@pytest.mark.parametrize("make, named", [
    (PyRandomBranch, r"random\.random"), (PyUniform, r"random\.uniform"), (NumpyDraw, r"numpy\.random\.rand"),
    (lambda: HeldGenerator("numpy"), r"rng \(a numpy.random.*Generator: its state moved\)"),
    (lambda: HeldGenerator("python"), r"rng \(a random\.Random: its state moved\)"),
])
def test_python_random_draws_in_forward_are_refused_naming_the_call_and_torch_fix(make, named):
    with pytest.raises(planner.TraceError, match=rf"draws Python-level random numbers \({named}.*bake.*"
                                                 r"Fix: draw with torch on a tensor"):
        planner.trace(make(), (X,))


def test_a_clock_read_in_forward_is_refused_naming_it():
    with pytest.raises(planner.TraceError, match=r"reads the clock \(time\.perf_counter\).*pass the value in as an input"):
        planner.trace(Clock(), (X,))


def test_a_random_draw_refused_under_export_too_and_at_build(monkeypatch):
    """A model fx cannot trace goes to torch.export, which bakes the draw just the same; a plan made before the
    watch existed is refused when build traces member 0 again."""
    class Untraceable(PyUniform):
        def forward(self, x):
            if x.shape[0] > 100:  # control flow on a shape: fx fails, torch.export traces it
                return x
            return super().forward(x)

    with pytest.raises(planner.TraceError, match=r"random\.uniform"):
        planner.trace(Untraceable(), (X,))
    from stagewise.planner import graph as graph_module
    with monkeypatch.context() as patched:
        patched.setattr(graph_module, "_host_state_refused", lambda model: __import__("contextlib").nullcontext())
        patched.setattr(graph_module, "_fx_disagrees", lambda *a: None)  # (nor the check of a graph against forward())
        plan = plan_for(PyUniform())
    with pytest.raises(planner.TraceError, match=r"random\.uniform"):
        executor.build(plan, [PyUniform() for _ in range(N)])


def test_seeded_draws_and_torch_draws_stay_allowed_and_the_random_state_is_untouched():
    """Tracing an ordinary model neither refuses nor moves Python's or numpy's random state."""
    before, np_before = random.getstate(), np.random.get_state()[1].copy()
    graph = planner.trace(Net(), (X,))
    assert graph.tracer == "fx" and graph.tracer_note == ""
    assert random.getstate() == before and (np.random.get_state()[1] == np_before).all()
    assert random.random is not None and "watched" not in getattr(random.random, "__qualname__", "")


# --- 2. torch.inference_mode() inside forward ---------------------------------------------------------------
# was: neither fx nor torch.export records inference_mode, so the batched module gave `a` gradients the members
# never get; now the region is traced as torch.no_grad() (same values, no gradients) through torch.export

class InferenceRegion(nn.Module):
    def __init__(self, decorated=False):
        super().__init__()
        self.a, self.b, self.decorated = nn.Linear(4, 4), nn.Linear(4, 4), decorated

    @torch.inference_mode()
    def features(self, x):
        return self.a(x)

    def forward(self, x):
        if self.decorated:
            h = self.features(x)
        else:
            with torch.inference_mode():
                h = self.a(x)
        return self.b(h.clone())


@pytest.mark.parametrize("decorated", [False, True])
def test_inference_mode_regions_get_no_gradient(decorated):
    plan, ens = assert_matches_loop([InferenceRegion(decorated) for _ in range(N)], train=True, grads=True)
    assert plan.tracer == "export"
    assert dict(ens.named_stacked_parameters())["a.weight"].grad is None
    assert dict(ens.named_stacked_parameters())["b.weight"].grad is not None


def test_inference_mode_in_eval_matches_the_loop():
    assert_matches_loop([InferenceRegion() for _ in range(N)])


# --- 3. global module hooks ------------------------------------------------------------------------------------
# was: the loop fires them on every module call of every member; the batched module fired them once on itself with
# N-first values and on leaf modules inside vmap (a global backward hook's change to gradients was lost: off by 4x)

GLOBAL_HOOKS = {
    "register_module_forward_hook": lambda: torch_module.register_module_forward_hook(lambda m, i, o: None),
    "register_module_forward_pre_hook": lambda: torch_module.register_module_forward_pre_hook(lambda m, i: None),
    "register_module_full_backward_hook": lambda: torch_module.register_module_full_backward_hook(lambda m, gi, go: None),
}


@pytest.mark.parametrize("api", list(GLOBAL_HOOKS))
def test_global_module_hooks_are_refused_at_trace_build_and_call(api):
    fix = r"Remove them \(handle.remove\(\)\)"
    handle = GLOBAL_HOOKS[api]()
    try:
        with pytest.raises(planner.TraceError, match=rf"global module hooks .*{api}.*{fix}"):
            planner.trace(Net(), (X,))
    finally:
        handle.remove()
    plan = plan_for(Net())
    handle = GLOBAL_HOOKS[api]()
    try:
        with pytest.raises(planner.MemberError, match=rf"global module hooks .*{api}.*{fix}"):
            executor.build(plan, [Net() for _ in range(N)])
    finally:
        handle.remove()
    ens = executor.build(plan, [Net() for _ in range(N)])
    handle = GLOBAL_HOOKS[api]()  # registered after build: the call refuses
    try:
        with pytest.raises(planner.ExecutionError, match=rf"global module hooks .*{api}.*{fix}"):
            ens(X)
    finally:
        handle.remove()
    assert ens(X).shape == (N, 5, 4)


def test_torch_own_global_hooks_do_not_refuse():
    """FlopCounterMode registers global hooks of its own (torch.utils.module_tracker): they only watch."""
    ens = executor.build(plan_for(Net()), [Net() for _ in range(N)])
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        ens(X)
    assert counter.get_total_flops() > 0


def test_global_registration_hooks_do_not_change_the_stacked_state():
    """was: build registered the stacked state as parameters again, so a parameter registration hook applied twice
    (members were made with it, then the batched module's state went through it once more: outputs off by 2.4)."""
    handle = torch_module.register_module_parameter_registration_hook(
        lambda mod, name, p: nn.Parameter(p.detach() * 2) if p is not None else None)
    try:
        assert_matches_loop([Net() for _ in range(N)])
    finally:
        handle.remove()


# --- 4. forward / __call__ the trace does not run; config it did not compare --------------------------------

def _replaced_forward(member, scale):
    member.forward = types.MethodType(lambda self, x: self.fc2(self.fc1(x) * scale), member)
    return member


def test_a_forward_replaced_on_the_instance_is_refused():
    """was: fx traces type(model).forward, so a replaced forward was ignored (every member, outputs off by 4)"""
    with pytest.raises(planner.TraceError, match=r"Net has forward replaced on the instance.*subclass's forward\(\)"):
        planner.trace(_replaced_forward(Net(), 3.0), (X,))
    plan = plan_for(Net())
    members = [Net() for _ in range(N)]
    _replaced_forward(members[1], 3.0)
    with pytest.raises(planner.MemberError, match=r"member 1 \(Net\) has forward replaced on the instance"):
        executor.build(plan, members)
    leaf = Net()
    fc = leaf.fc1
    fc.forward = lambda x: F.linear(x, fc.weight, fc.bias) * 2  # reads the original's weights from a copy
    with pytest.raises(planner.TraceError, match=r"submodule fc1 \(Linear\) has forward replaced"):
        planner.trace(leaf, (X,))


class DoubledCall(Net):
    def __call__(self, x):
        return super().__call__(x) * 2


def test_a_class_overriding_call_is_refused():
    """was: the trace runs forward() only, so the member loop's `* 2` in __call__ was dropped"""
    with pytest.raises(planner.TraceError, match=r"DoubledCall overrides __call__.*Move that code into forward\(\)"):
        planner.trace(DoubledCall(), (X,))


class DictConfig(nn.Module):
    def __init__(self, act="relu", scale=1.0):
        super().__init__()
        self.fc, self.cfg = nn.Linear(4, 4), {"act": act, "scale": scale}

    def forward(self, x):
        h = self.fc(x) * self.cfg["scale"]
        return F.relu(h) if self.cfg["act"] == "relu" else F.gelu(h)


class ObjectConfig(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.fc, self.config = nn.Linear(4, 4), types.SimpleNamespace(scale=scale)

    def forward(self, x):
        return self.fc(x) * self.config.scale


def test_numbers_in_config_dicts_and_objects_are_per_member():
    """was: only plain attributes were compared across members, so a sweep's value in `self.cfg` or
    `self.config` was member 0's for every member"""
    assert_matches_loop([DictConfig(scale=float(i + 1)) for i in range(N)])
    assert_matches_loop([ObjectConfig(float(i + 1)) for i in range(N)])


def test_a_branch_chosen_by_a_config_dict_string_is_refused():
    plan = plan_for(DictConfig("relu"))
    with pytest.raises(planner.MemberError, match=r"member 1 traces to another graph"):
        executor.build(plan, [DictConfig("relu" if i == 0 else "gelu") for i in range(N)])


def test_a_counter_kept_in_a_dict_in_forward_is_refused():
    class Counting(Net):
        def __init__(self):
            super().__init__()
            self.stats = {"calls": 0}

        def forward(self, x):
            self.stats["calls"] += 1
            return super().forward(x) * self.stats["calls"]

    with pytest.raises(planner.TraceError, match=r"changes attribute\(s\) \"stats\['calls'\]\".*tensor buffer"):
        planner.trace(Counting(), (X,))


class ClosureAct(Net):
    def __init__(self, k):
        super().__init__()
        self.act = lambda x: torch.relu(x) * k

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_a_lambda_attribute_closing_over_a_number_per_member_matches_the_loop():
    """was: members' lambdas compared by name only, so member 0's `k` ran for every member"""
    assert_matches_loop([ClosureAct(float(i + 1)) for i in range(N)])


class ClosureOverSelf(Net):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(4))
        self.gate = lambda x: x * self.alpha

    def forward(self, x):
        return self.fc2(self.gate(self.fc1(x)))


def test_a_function_attribute_closing_over_the_module_is_refused():
    """was: the traced copy's lambda read the original member 0's `alpha` (as a constant: every member, no gradient)"""
    with pytest.raises(planner.TraceError, match=r"attribute 'gate' is a function that closes over a module.*Make it a method"):
        planner.trace(ClosureOverSelf(), (X,))


def test_trace_watches_leave_nothing_patched_after_concurrent_traces_or_a_failed_start(monkeypatch):
    """The watches replace process-wide functions while tracing: two threads tracing at once, or a failure while a
    watch starts, must leave torch, random and time as they were (and another thread's no_grad is not forward()'s)."""
    import threading

    from stagewise.planner import trace_watch

    originals = (random.random, time.time, torch._C._set_grad_enabled, torch._C._InferenceMode)

    def traces():
        for _ in range(30):
            with trace_watch._host_state_refused(Net()), trace_watch._grad_mode_watch(), \
                    trace_watch._inference_mode_as_no_grad(), trace_watch._input_writes_recorded():
                time.sleep(0.0005)

    threads = [threading.Thread(target=traces) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (random.random, time.time, torch._C._set_grad_enabled, torch._C._InferenceMode) == originals
    assert "__iadd__" not in vars(torch.fx.Proxy)

    with trace_watch._grad_mode_watch() as turned_off:
        other = threading.Thread(target=lambda: torch.set_grad_enabled(False))
        other.start()
        other.join()
    assert not turned_off

    def interrupted(rng):
        raise KeyboardInterrupt
    monkeypatch.setattr(trace_watch, "_rng_state", interrupted)  # after the functions are wrapped
    with pytest.raises(KeyboardInterrupt):
        with trace_watch._HostStateWatch(Net()):
            pass
    assert random.random is originals[0] and time.time is originals[1]
    assert trace_watch._PATCHING.acquire(blocking=False)
    trace_watch._PATCHING.release()


class SeededNoise(Net):
    """Per-member seeded noise (fixed evaluation noise): the reseed runs once while traced, then the draws go unseeded."""

    def __init__(self, seed=0, how="manual_seed"):
        super().__init__()
        self.seed, self.how = seed, how

    def forward(self, x):
        if self.how == "manual_seed":
            torch.manual_seed(self.seed)
        else:
            torch.random.set_rng_state(torch.random.get_rng_state())
        y = super().forward(x)
        return y + torch.randn_like(y)


@pytest.mark.parametrize("how, named", [("manual_seed", "torch.manual_seed"), ("set_rng_state", r"torch(\.random)?\.set_rng_state")])
def test_seeding_torch_in_forward_is_refused(how, named):
    """Was: 1.6 off the loop, the batched module's draws unseeded and different call after call, with no error."""
    with pytest.raises(planner.TraceError, match=rf"seeds torch.s random number generator \({named}\).*seed outside forward"):
        planner.trace(SeededNoise(how=how), (torch.randn(2, 4),))
