"""Stacked optimizers, from a review: each test compares with what torch does (N torch optimizers, the member loop).

Complex parameters (an FNO's spectral weights) step as torch's Adam steps them, viewed as real; a per-member list for
a flag or one (beta1, beta2) pair per member is refused (both were read silently otherwise); the per-tensor cache stays
bounded under a scheduler cycling betas; the derived-lr refusal's fix is per param group and right when run; torch's
ReduceLROnPlateau takes a sweep with an lr=0 member; an lr write from exec'd code is named as unread.
"""
import re

import pytest
import torch

from stagewise import executor
from stagewise.executor import StackedAdam, StackedAdamW, StackedSGD
from stagewise.planner.errors import OptimizerError

torch.set_num_threads(1)
N = 3


def _pair(make_stacked, make_torch, shapes, dtype=torch.complex64, steps=6, seed=0, between=None):
    """Step a stacked optimizer and N torch optimizers on the same grads; return [(stacked p, torch ps)] per shape."""
    g = torch.Generator().manual_seed(seed)
    stacked = [torch.randn((N, *s), generator=g, dtype=d).requires_grad_() for s, d in zip(shapes, dtype)] \
        if isinstance(dtype, (list, tuple)) else [torch.randn((N, *s), generator=g, dtype=dtype).requires_grad_() for s in shapes]
    members = [[p.detach()[i].clone().requires_grad_() for p in stacked] for i in range(N)]
    opt = make_stacked(stacked)
    refs = [make_torch(ps, i) for i, ps in enumerate(members)]
    for k in range(steps):
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) * (5.0 if k < 2 else 0.2) for p in stacked]
        for p, gr in zip(stacked, grads):
            p.grad = gr.clone()
        opt.step()
        for i, (ps, o) in enumerate(zip(members, refs)):
            for m, gr in zip(ps, grads):
                m.grad = gr[i].clone()
            o.step()
        if between is not None:
            between(k, opt, refs)
    return [(p, [ps[j] for ps in members]) for j, p in enumerate(stacked)]


def _assert_members(pairs, rtol=2e-6, atol=1e-7):
    for p, ms in pairs:
        for i, m in enumerate(ms):
            torch.testing.assert_close(p.detach()[i], m.detach(), rtol=rtol, atol=atol)


LRS, B1, B2, EPS, WD = [0.1, 0.05, 0.02], [0.9, 0.8, 0.7], [0.999, 0.99, 0.9], [1e-8, 1e-6, 1e-3], [0.0, 0.1, 0.01]

ADAMS = {
    "adam": (lambda ps: StackedAdam(ps, N, lr=0.1), lambda ps, i: torch.optim.Adam(ps, lr=0.1)),
    "adam_per_member": (lambda ps: StackedAdam(ps, N, lr=LRS, betas=(B1, B2), eps=EPS, weight_decay=WD),
                        lambda ps, i: torch.optim.Adam(ps, lr=LRS[i], betas=(B1[i], B2[i]), eps=EPS[i], weight_decay=WD[i])),
    "amsgrad": (lambda ps: StackedAdam(ps, N, lr=0.1, amsgrad=True), lambda ps, i: torch.optim.Adam(ps, lr=0.1, amsgrad=True)),
    "amsgrad_per_member": (lambda ps: StackedAdam(ps, N, lr=LRS, betas=(B1, 0.99), amsgrad=True, maximize=True),
                           lambda ps, i: torch.optim.Adam(ps, lr=LRS[i], betas=(B1[i], 0.99), amsgrad=True, maximize=True)),
    "adamw": (lambda ps: StackedAdamW(ps, N, lr=0.1, weight_decay=0.1), lambda ps, i: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)),
    "adamw_per_member": (lambda ps: StackedAdamW(ps, N, lr=LRS, weight_decay=WD, eps=EPS),
                         lambda ps, i: torch.optim.AdamW(ps, lr=LRS[i], weight_decay=WD[i], eps=EPS[i])),
}


@pytest.mark.parametrize("name", list(ADAMS))
def test_complex_adam_matches_torch(name):
    """Was: 0.39 off after 3 steps (complex arithmetic where torch views complex as real); amsgrad a raw
    NotImplementedError "maximum_cpu"."""
    make, ref = ADAMS[name]
    _assert_members(_pair(make, ref, [(4, 3), (5,)]))


def test_complex_and_real_params_in_one_adam_with_reset():
    """A model with spectral (complex) and real weights: two buckets, each as torch; reset_member restarts one member."""
    def between(k, opt, refs):
        if k == 2:
            opt.reset_member(1)
            refs[1].__init__(refs[1].param_groups[0]["params"], lr=LRS[1], amsgrad=True)  # a fresh torch Adam
    pairs = _pair(lambda ps: StackedAdam(ps, N, lr=LRS, amsgrad=True), lambda ps, i: torch.optim.Adam(ps, lr=LRS[i], amsgrad=True),
                  [(4, 3), (6,)], dtype=[torch.complex64, torch.float32], between=between)
    _assert_members(pairs)


SGDS = {
    "nesterov_wd": dict(lr=LRS, momentum=[0.9, 0.5, 0.8], nesterov=True, weight_decay=WD),
    "idle_member_dampening": dict(lr=LRS, momentum=[0.9, 0.0, 0.5], dampening=[0.1, 0.3, 0.0], maximize=True),
    "plain": dict(lr=0.1),
}


@pytest.mark.parametrize("name", list(SGDS))
def test_complex_sgd_matches_torch(name):
    """SGD's update is real-linear: complex parameters step as torch's (checked, not changed)."""
    kw = SGDS[name]
    per = lambda i: {k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()}  # noqa: E731
    _assert_members(_pair(lambda ps: StackedSGD(ps, N, **kw), lambda ps, i: torch.optim.SGD(ps, **per(i)), [(4, 3), (5,)]))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_per_member_complex_matches_torch(norm_type):
    """Was: a raw NotImplementedError ("lt_cpu" for ComplexFloat) from the max_norm check."""
    g = torch.Generator().manual_seed(1)
    ps = [torch.randn(N, 4, 2, generator=g, dtype=torch.complex64).requires_grad_(), torch.randn(N, 5, generator=g).requires_grad_()]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * 10
    members = [[p.detach()[i].clone().requires_grad_() for p in ps] for i in range(N)]
    for i, ms in enumerate(members):
        for m, p in zip(ms, ps):
            m.grad = p.grad[i].clone()
    max_norm = [1.0, 50.0, 3.0]
    norms = executor.clip_grad_norm_per_member_(ps, max_norm, N, norm_type=norm_type)
    ref = torch.stack([torch.nn.utils.clip_grad_norm_(ms, max_norm[i], norm_type=norm_type) for i, ms in enumerate(members)])
    assert norms.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(norms, ref, rtol=1e-6, atol=0)
    for j, p in enumerate(ps):
        for i in range(N):
            torch.testing.assert_close(p.grad[i], members[i][j].grad, rtol=1e-6, atol=0)


# --- flags and betas: one form each ----------------------------------------------------------------

FLAG_CASES = [
    (lambda ps, v: StackedAdam(ps, N, lr=0.1, amsgrad=v), "amsgrad"),
    (lambda ps, v: StackedSGD(ps, N, lr=0.1, momentum=0.9, nesterov=v), "nesterov"),
    (lambda ps, v: StackedAdamW(ps, N, lr=0.1, maximize=v), "maximize"),
    (lambda ps, v: StackedAdam([{"params": ps, "amsgrad": v}], N, lr=0.1), "amsgrad"),
]


@pytest.mark.parametrize("case", range(len(FLAG_CASES)))
@pytest.mark.parametrize("value", [[True, False, False], (False, True, False), torch.tensor([True, False, True])])
def test_flag_per_member_refused(case, value):
    """Was: amsgrad=[True, False, False] (any non-empty list) run as True for every member (maximize: 0.57 off)."""
    make, flag = FLAG_CASES[case]
    with pytest.raises(OptimizerError, match=rf"{flag}=.* is not one bool.*{flag}=True or {flag}=False.*one optimizer per value"):
        make([torch.zeros(N, 2, requires_grad=True)], value)


def test_flag_written_into_group_refused_and_bool_tensor_accepted():
    opt = StackedAdam([torch.zeros(N, 2, requires_grad=True)], N, lr=0.1)
    with pytest.raises(OptimizerError, match="amsgrad=.* is not one bool"):
        opt.param_groups[0]["amsgrad"] = [True, False, False]
    assert opt.param_groups[0]["amsgrad"] is False
    # a 0-d bool tensor is one flag: as torch's Adam with that flag
    _assert_members(_pair(lambda ps: StackedAdam(ps, N, lr=0.1, amsgrad=torch.tensor(True)),
                          lambda ps, i: torch.optim.Adam(ps, lr=0.1, amsgrad=True), [(5,)], dtype=torch.float32))


@pytest.mark.parametrize("n", [2, 3, 1])
def test_betas_per_member_pairs_refused(n):
    """Was: at N=2, betas=[(0.9, 0.999), (0.8, 0.99)] read transposed (member 0 at (0.9, 0.8)), 0.57 off in 20 steps."""
    pairs = [(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)][:n]
    with pytest.raises(OptimizerError, match=r"one \(beta1, beta2\) pair per member.*betas=\(beta1_per_member, beta2_per_member\)"):
        StackedAdam([torch.zeros(n, 2, requires_grad=True)], n, betas=pairs)
    with pytest.raises(OptimizerError, match=r"one \(beta1, beta2\) pair per member"):
        StackedAdam([torch.zeros(n, 2, requires_grad=True)], n).set_hyperparameter("betas", [list(b) for b in pairs])


def test_betas_tuple_form_from_pairs_matches_torch():
    """The form the refusal names, built from per-member pairs, gives each member its own betas."""
    global N
    pairs = [(0.9, 0.999), (0.5, 0.9)]
    old, N = N, 2
    try:
        _assert_members(_pair(lambda ps: StackedAdam(ps, 2, lr=1e-2, betas=tuple(zip(*pairs))),
                              lambda ps, i: torch.optim.Adam(ps, lr=1e-2, betas=pairs[i]), [(4,)], dtype=torch.float32, steps=20))
    finally:
        N = old


# --- the per-tensor cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_cache_bounded_under_one_cycle(kind):
    """Was: two entries more per step (every [N] betas / momentum tensor OneCycleLR's writes made, held for ever)."""
    sizes = []

    cls, ref_cls, kw = (StackedAdam, torch.optim.Adam, {}) if kind == "adam" else (StackedSGD, torch.optim.SGD, {"momentum": 0.9})
    scheds = {"r": []}

    def make(ps):
        opt = cls(ps, N, lr=0.1, **kw)
        scheds["s"] = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=400)
        return opt

    def ref(ps, i):
        o = ref_cls(ps, lr=0.1, **kw)
        scheds["r"].append(torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=400))
        return o

    def between(k, opt, refs):
        scheds["s"].step()
        for s in scheds["r"]:
            s.step()
        sizes.append(len(opt._versioned))

    _assert_members(_pair(make, ref, [(4,), (3, 2)], dtype=torch.float32, steps=200, between=between))
    assert max(sizes[10:]) == sizes[10] and max(sizes) <= 12, sizes[::20]


def test_cache_bounded_under_set_hyperparameter_per_step():
    """A hand-written per-member warmup through set_hyperparameter (each call makes new [N] tensors) vs N torch AdamWs."""
    base = torch.tensor([1e-3, 3e-3, 1e-2], dtype=torch.float64)
    sizes = []

    def between(k, opt, refs):
        f = min(1.0, (k + 2) / 50)
        opt.set_hyperparameter("lr", base * f)
        for i, o in enumerate(refs):
            o.param_groups[0]["lr"] = float(base[i]) * f
        sizes.append(len(opt._versioned))

    pairs = _pair(lambda ps: StackedAdamW(ps, N, lr=base * 0.02), lambda ps, i: torch.optim.AdamW(ps, lr=float(base[i]) * 0.02),
                  [(4,)], dtype=torch.float32, steps=200, between=between)
    _assert_members(pairs)
    assert max(sizes[10:]) == sizes[10] and max(sizes) <= 12, sizes[::20]


# --- lr writes -----------------------------------------------------------------------------------------

def test_derived_lr_fix_in_message_is_per_group_and_right():
    """Was: the message's fix (get reads group 0, set writes all) gave a 10x head group the body's lrs."""
    lrs = [0.1, 0.2, 0.3]
    body, head = torch.zeros(N, 4, requires_grad=True), torch.zeros(N, 2, requires_grad=True)
    opt = StackedSGD([{"params": [body], "lr": lrs}, {"params": [head], "lr": [10 * x for x in lrs]}], N, lr=lrs)
    refs = [torch.optim.SGD([{"params": [torch.zeros(4)], "lr": lrs[i]}, {"params": [torch.zeros(2)], "lr": 10 * lrs[i]}])
            for i in range(N)]
    with pytest.raises(OptimizerError) as info:
        for g in opt.param_groups:
            g["lr"] = max(g["lr"] * 0.5, 1e-3)
    code = re.search(r"for k in range\(len\(opt\.param_groups\)\): .*?group=k\)", str(info.value))
    assert code is not None, str(info.value)
    exec(code.group(0), {"opt": opt})  # the suggested code, as the user would run it
    for o in refs:
        for g in o.param_groups:
            g["lr"] = max(g["lr"] * 0.5, 1e-3)
    for k in range(2):
        torch.testing.assert_close(opt.get_hyperparameter("lr", k),
                                   torch.tensor([o.param_groups[k]["lr"] for o in refs], dtype=torch.float64), rtol=1e-12, atol=0)


def test_torch_plateau_on_sweep_with_zero_lr_member():
    """Was: refused ("would leave member 2's lr at 0 where the shared scale gives it 0")."""
    lrs = [0.1, 0.01, 0.0]
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=lrs)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    refs = [torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=x) for x in lrs]
    ref_scheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5) for o in refs]
    for _ in range(4):
        sched.step(1.0)
        for s in ref_scheds:
            s.step(1.0)
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([o.param_groups[0]["lr"] for o in refs],
                                                                          dtype=torch.float64), rtol=1e-12, atol=0)
    # a member below eps keeps its lr under torch, where the shared scale would halve it: still refused
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=[0.1, 0.01, 1e-9])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    with pytest.raises(OptimizerError, match="would leave member 2's lr at 1e-09 where the shared scale gives it 5e-10"):
        for _ in range(2):
            sched.step(1.0)


def test_lr_write_without_source_names_it():
    """Was: `g["lr"] *= 0.5` from exec'd code refused as if it wrote an lr of its own; from a file it scales, as torch."""
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=[0.1, 0.2, 0.3])
    for g in opt.param_groups:
        g["lr"] *= 0.5
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([0.05, 0.1, 0.15], dtype=torch.float64))
    with pytest.raises(OptimizerError, match="source could not be read.*Run it from a file"):
        exec(compile('for g in opt.param_groups: g["lr"] *= 0.5', "<string>", "exec"), {"opt": opt})
    torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([0.05, 0.1, 0.15], dtype=torch.float64))


def test_betas_as_a_tuple_of_per_member_pairs_at_two_members_is_refused():
    """((0.9, 0.999), (0.5, 0.9)) read as (beta1s, beta2s) gave member 0 beta1 0.9 > beta2 0.5: 0.29 off after 20 steps."""
    params = [torch.nn.Parameter(torch.randn(2, 3))]
    with pytest.raises(OptimizerError, match=r"one \(beta1, beta2\) pair per member"):
        executor.StackedAdam(params, n_members=2, betas=((0.9, 0.999), (0.5, 0.9)))
    executor.StackedAdam(params, n_members=2, betas=((0.9, 0.8), (0.999, 0.99)))  # (beta1s, beta2s): accepted
