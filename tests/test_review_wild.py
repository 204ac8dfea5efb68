"""Review: model patterns written the way people outside this project write them, each compared with the plain
Python loop over the members (float32, tight tolerance: outputs, state after every call, gradients) on more than one
call and more than one input shape, under the default plan and with every stage forced to `loop` and to `wide`;
or refused with a StagewiseError naming the problem and the fix. Models live in tests/wild_models.py."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from stagewise import executor, planner
from stagewise.planner.plan import StageOptions, Strategy

import wild_models as W

N = 3
RTOL, ATOL = 1e-5, 1e-6
STRATEGIES = [None, Strategy.LOOP, Strategy.WIDE]  # None: the proposed plan (vmap / member loop)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def everything(plan, strategy):
    return plan if strategy is None else plan.with_stages([replace(s, options=StageOptions(strategy=strategy)) for s in plan.stages])


def member_view(x, i, mode):
    return x[i] if mode == "per_member" and isinstance(x, torch.Tensor) else x


def fresh(inputs):
    """A copy of the inputs: a model that writes into its input must see the same input in both runs."""
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def stacked_leaves(outs):
    per_member = [tree_flatten(o)[0] for o in outs]
    return [torch.stack(col) if isinstance(col[0], torch.Tensor) else col[0] for col in zip(*per_member)]


def floating_loss(out, n=None):
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if n is None:
        return sum((x ** 2).mean() for x in leaves)
    return sum((x ** 2).reshape(n, -1).mean(1).sum() for x in leaves)


def build_for(make, first_inputs, mode="shared", strategy=None, train=False, n=N):
    members = [make(i) for i in range(n)]
    for m in members:
        m.train(train)
    reference = copy.deepcopy(members)
    one = tuple(member_view(x, 0, mode) for x in first_inputs)
    plan = everything(planner.propose(planner.trace(copy.deepcopy(members[0]), one), n, mode), strategy)
    return plan, executor.build(plan, members).train(train), reference


def assert_matches_loop(make, calls, mode="shared", strategy=None, train=False, grads=False, rtol=RTOL, atol=ATOL,
                        grad_rtol=1e-4, n=N):
    """Every call: outputs, then every member's state_dict, then (grads) every parameter's gradient."""
    plan, ens, reference = build_for(make, calls[0], mode, strategy, train, n)
    for c, inputs in enumerate(calls):
        if grads:
            ens.zero_grad(set_to_none=True)
            got = ens(*fresh(inputs))
            floating_loss(got, n).backward()
        else:
            with torch.no_grad():
                got = ens(*fresh(inputs))
        outs = []
        for i, m in enumerate(reference):
            args = fresh(tuple(member_view(x, i, mode) for x in inputs))
            if grads:
                m.zero_grad(set_to_none=True)
                out = m(*args)
                floating_loss(out).backward()
            else:
                with torch.no_grad():
                    out = m(*args)
            outs.append(out)
        got_leaves, want_leaves = tree_flatten(got)[0], stacked_leaves(outs)
        assert len(got_leaves) == len(want_leaves), f"call {c}: output structure"
        for k, (a, b) in enumerate(zip(got_leaves, want_leaves)):
            assert isinstance(a, type(b)) or isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor), f"call {c} leaf {k}: {type(a)}"
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"call {c} leaf {k}: {m}")
            else:
                assert a == b
        states = ens.member_state_dicts()
        for i, m in enumerate(reference):
            for key, v in m.state_dict().items():
                torch.testing.assert_close(states[i][key], v, rtol=rtol, atol=atol, msg=lambda m: f"call {c} member {i} {key}: {m}")
        if grads:
            for key, p in ens.named_stacked_parameters():
                for i, m in enumerate(reference):
                    want = dict(m.named_parameters())[key].grad
                    assert (p.grad is None) == (want is None) or (want is None and not p.grad[i].any()), f"call {c} {key} grad presence"
                    if want is not None:
                        err = (p.grad[i] - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                        assert err <= grad_rtol, f"call {c} member {i} {key} gradient relative error {err:.2e}"
    return plan, ens


def two_shapes(*shape, calls=2):
    """`calls` inputs at `shape`, then `calls` with the first dim one larger and the second (if any) too."""
    other = (shape[0] + 2,) + tuple(s + 1 for s in shape[1:-1]) + shape[-1:]
    return [(torch.randn(*shape),) for _ in range(calls)] + [(torch.randn(*other),) for _ in range(calls)]


def per_member_shapes(*shape, calls=2):
    return [(torch.randn(N, *x.shape),) for (x,) in two_shapes(*shape, calls=calls)]


# --- attention, caches, tying --------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cls", [W.GPT2Attention, W.CausalSDPA, W.Rotary])
def test_attention_patterns_match_the_loop(cls, strategy):
    assert_matches_loop(lambda i: cls(), two_shapes(2, 5, W.D), strategy=strategy)


@pytest.mark.parametrize("cls", [W.CausalSDPA])
def test_attention_patterns_per_member_and_gradients(cls):
    assert_matches_loop(lambda i: cls(), per_member_shapes(2, 5, W.D), mode="per_member")
    assert_matches_loop(lambda i: cls(), two_shapes(2, 5, W.D), train=True, grads=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_embedding_and_head_outputs_and_gradients(strategy):
    calls = [(torch.randint(0, 11, (2, 5)),), (torch.randint(0, 11, (3, 6)),)]
    assert_matches_loop(lambda i: W.TiedLM(), calls, strategy=strategy)
    if strategy is not Strategy.WIDE:
        assert_matches_loop(lambda i: W.TiedLM(), calls, strategy=strategy, train=True, grads=True)


# --- parametrizations ---------------------------------------------------------------------------------
# was: the loop strategy copy.copy'd the stage module, which a parametrized module refuses (a RuntimeError
# about serialization); wide read `weight` from the state of a Linear whose weight is computed (KeyError)

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "old_spectral_norm"])
def test_weight_and_spectral_norm_in_eval(kind, strategy):
    assert_matches_loop(lambda i: W.Normed(kind), two_shapes(6, 4), strategy=strategy)


def test_old_weight_norm_cannot_be_copied_so_build_stops():
    """torch cannot deepcopy a module under the deprecated nn.utils.weight_norm (its weight is a non-leaf
    attribute); build copies member 0 and stops there with a MemberError naming the replacement."""
    members = [W.Normed("old_weight_norm") for _ in range(N)]
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 4),)), N)
    with pytest.raises(planner.MemberError, match="cannot be copied.*parametrizations.weight_norm"):
        executor.build(plan, members)


@pytest.mark.parametrize("strategy", [None, Strategy.LOOP])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "old_spectral_norm"])
def test_spectral_norm_power_iteration_in_training_updates_each_members_vectors(kind, strategy):
    """spectral_norm updates its u (and v) buffers in a training forward: every call, every member."""
    assert_matches_loop(lambda i: W.Normed(kind), two_shapes(6, 4), strategy=strategy, train=True)
    assert_matches_loop(lambda i: W.Normed(kind), two_shapes(6, 4), strategy=strategy, train=True, grads=True)


# --- hooks and scripted submodules: refused (were silently ignored or run with member 0's) -----------------

def _hooked(where):
    def make(i):
        m = W.Net()
        scale = float(i + 1)
        if where == "root forward":
            m.register_forward_hook(lambda mod, inp, out: out - 3.0)
        elif where == "root pre":
            m.register_forward_pre_hook(lambda mod, inp: (inp[0] * 0.5,))
        elif where == "leaf forward":
            m.fc1.register_forward_hook(lambda mod, inp, out: out * scale)
        elif where == "leaf pre":
            m.fc2.register_forward_pre_hook(lambda mod, inp: (inp[0] + 1.0,))
        elif where == "leaf backward":
            m.fc1.register_full_backward_hook(lambda mod, gi, go: None)
        return m
    return make


@pytest.mark.parametrize("where", ["root forward", "root pre", "leaf forward", "leaf pre", "leaf backward"])
def test_members_with_hooks_are_refused_naming_the_hook(where):
    make = _hooked(where)
    with pytest.raises(planner.TraceError, match=r"module hooks .*Remove the hooks"):
        planner.trace(make(0), (torch.randn(5, 4),))
    # a plan made without the hooks, then members that have them: build refuses too
    plan = planner.propose(planner.trace(W.Net(), (torch.randn(5, 4),)), N)
    with pytest.raises(planner.MemberError, match=r"member 0 has module hooks"):
        executor.build(plan, [make(i) for i in range(N)])


def test_hook_only_on_a_later_member_is_refused():
    plan = planner.propose(planner.trace(W.Net(), (torch.randn(5, 4),)), N)
    members = [W.Net() for _ in range(N)]
    members[2].fc1.register_forward_hook(lambda mod, inp, out: out * 2)
    with pytest.raises(planner.MemberError, match=r"member 2 has module hooks \(fc1 \(forward hook\)"):
        executor.build(plan, members)


def test_tracing_leaves_no_vmap_tensor_on_the_model():
    """was: the capability probe ran the old weight_norm's pre-hook under vmap, which stored a BatchedTensor as
    the user's `fc.weight` (reading it afterwards: 'Cannot access storage of BatchedTensorImpl')"""
    model = W.Normed("old_weight_norm")
    planner.trace(model, (torch.randn(5, 4),))
    assert not torch._C._functorch.is_batchedtensor(model.fc.weight)
    model.fc.weight.sum().item()


def test_old_spectral_norm_settings_must_agree():
    plan = planner.propose(planner.trace(W.Normed("old_spectral_norm"), (torch.randn(5, 4),)), 2)
    members = [W.Normed("old_spectral_norm"), W.Normed("old_weight_norm")]
    with pytest.raises(planner.StagewiseError):
        executor.build(plan, members)


def test_scripted_submodules_are_refused():
    with pytest.raises(planner.TraceError, match=r"torch.jit-scripted or -traced submodule\(s\) 'a'.*without torch.jit.script"):
        planner.trace(W.Scripted(), (torch.randn(5, 4),))


# --- grad mode inside forward ---------------------------------------------------------------------------
# was: fx ran `with torch.no_grad()` at trace time and recorded nothing, so the batched module gave fc
# gradients the members never get (and an optimizer moved weights the loop leaves alone)

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("how", ["no_grad", "set_grad_enabled"])
def test_no_grad_regions_get_no_gradient(how, strategy):
    plan, ens = assert_matches_loop(lambda i: W.NoGrad(how), two_shapes(5, 4), strategy=strategy, train=True, grads=True)
    assert plan.tracer == "export"
    assert dict(ens.named_stacked_parameters())["fc.weight"].grad is None


def test_an_fx_plan_of_a_no_grad_model_is_refused_at_build(monkeypatch):
    """A plan file traced with fx before no_grad was detected: build re-traces with fx and must not run it."""
    import contextlib
    from stagewise.planner import graph as graph_module
    with monkeypatch.context() as patched:
        patched.setattr(graph_module, "_grad_mode_watch", lambda: contextlib.nullcontext([]))
        # (and before the trace compared input gradients, which sees x's gradient the no_grad region changes)
        patched.setattr(graph_module, "_input_grads_disagree", lambda *a, **k: None)
        plan = planner.propose(planner.trace(W.NoGrad(), (torch.randn(5, 4),)), N)
    assert plan.tracer == "fx"
    with pytest.raises(planner.TraceError, match=r"turns gradients off .*re-plan"):
        executor.build(plan, [W.NoGrad() for _ in range(N)])


def test_no_grad_model_trained_with_adamw_equals_torch():
    members = [W.NoGrad() for _ in range(N)]
    loop = copy.deepcopy(members)
    x = torch.randn(5, 4)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members).train()
    opt = executor.StackedAdamW(ens.parameters(), N, lr=[0.1, 0.05, 0.01], weight_decay=0.5)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.5) for m, lr in zip(loop, [0.1, 0.05, 0.01])]
    for _ in range(3):
        opt.zero_grad()
        floating_loss(ens(x), N).backward()
        opt.step()
        for m, o in zip(loop, opts):
            o.zero_grad()
            floating_loss(m(x)).backward()
            o.step()
    for i, m in enumerate(loop):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.member_state_dicts()[i][k], v, rtol=1e-5, atol=1e-6)


# --- in-place writes, buffers, Python numbers, containers --------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_in_place_writes_to_the_input_and_inplace_relu(mode, strategy):
    if mode == "shared":  # the loop writes the caller's one tensor once per member: not batchable, refused at build
        with pytest.raises(planner.InputError, match=r"in place.*clone\(\)"):
            build_for(lambda i: W.InplaceOnInput(), two_shapes(5, 4)[0], mode, strategy, False, N)
        return
    assert_matches_loop(lambda i: W.InplaceOnInput(), per_member_shapes(5, 4), mode=mode, strategy=strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("make", [W.NonPersistent, W.Temperature, lambda i: W.Params(), lambda i: W.Route("a"),
                                  lambda i: W.DictOut(), lambda i: W.DataclassOut(), lambda i: W.KeywordOnly(),
                                  lambda i: W.Checkpointed()],
                         ids=["nonpersistent", "temperature", "paramlist", "moduledict", "dict", "dataclass", "kwonly", "checkpoint"])
def test_containers_numbers_and_outputs_match_the_loop(make, strategy):
    # dataclass outputs under wide were: an NFirst wrapper left inside the output (wide._any_nf saw no dataclass)
    assert_matches_loop(make, two_shapes(5, 4), strategy=strategy)


@pytest.mark.parametrize("make", [W.Temperature, lambda i: W.Params(), lambda i: W.Checkpointed()], ids=["temperature", "paramlist", "checkpoint"])
def test_containers_and_numbers_gradients(make):
    assert_matches_loop(make, two_shapes(5, 4), train=True, grads=True)


def test_module_dict_routing_that_differs_per_member_is_refused():
    plan = planner.propose(planner.trace(W.Route("a"), (torch.randn(5, 4),)), 2)
    with pytest.raises(planner.MemberError, match="another graph"):
        executor.build(plan, [W.Route("a"), W.Route("b")])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_int_and_bool_inputs(mode, strategy):
    shapes = [(2, 5), (2, 5), (3, 6)]
    lead = (N,) if mode == "per_member" else ()
    calls = [(torch.randint(0, 10, lead + s), torch.rand(lead + s) > 0.5) for s in shapes]
    assert_matches_loop(lambda i: W.IntBool(), calls, mode=mode, strategy=strategy)


# --- randomness: each member draws its own ------------------------------------------------------------------

def identical_members(make, strategy, train, x, n=N, calls=1):
    """Members with the same weights: with their own draws the outputs differ; returns whether members 0 and 1 agree."""
    members = [make() for _ in range(n)]
    for m in members[1:]:
        m.load_state_dict(members[0].state_dict())
    for m in members:
        m.train(train)
    plan = everything(planner.propose(planner.trace(copy.deepcopy(members[0]), (x[:5],)), n), strategy)
    ens = executor.build(plan, members).train(train)
    with torch.no_grad():
        outs = [ens(x) for _ in range(calls)]
    return plan, outs


def test_stochastic_depth_with_item_is_refused():
    """was: fx ran `torch.rand(1).item() < p` once at trace time and baked the branch it took into the graph"""
    with pytest.raises(planner.TraceError, match=r"draws random numbers from no traced input \(rand\)"):
        planner.trace(W.StochasticDepth().train(), (torch.randn(5, 4),))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stochastic_depth_draws_per_member_and_per_call(strategy):
    """was: fx baked one draw of `torch.rand(1) >= p` into the graph: the branch was kept or dropped forever"""
    x = torch.randn(2, 4)
    plan, outs = identical_members(W.StochasticDepthTensor, strategy, True, x, calls=30)
    assert plan.tracer == "export"
    kept = torch.stack([~torch.isclose(o, x.expand_as(o)).all(-1).all(-1) for o in outs]).float()  # [calls, N]
    assert 0.2 < kept.mean() < 0.8, kept.mean()
    assert (kept.min(1).values != kept.max(1).values).any(), "members always drew the same"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("cls", [W.RowDrop, W.InputNoise])
def test_draws_from_shared_inputs_are_per_member(cls, train, strategy):
    """was: wide computed a random op with no per-member input once and gave every member the same draw"""
    x = torch.randn(64, 4)
    try:
        _, (out,) = identical_members(cls, strategy, train, x)
    except planner.StagewiseError as e:  # a random op in eval under vmap: refused, naming randomness
        assert "random" in str(e)
        return
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])


@pytest.mark.parametrize("strategy", [None, Strategy.LOOP])
def test_dropout_masks_are_per_member_with_the_right_rate_and_scale(strategy):
    x = torch.randn(100, 4)
    members = [W.DropoutNet() for _ in range(N)]
    for m in members[1:]:
        m.load_state_dict(members[0].state_dict())
    _, (out,) = identical_members(lambda: copy.deepcopy(members[0]), strategy, True, x)
    full = members[0].fc(x).detach()
    dropped = out == 0
    assert all(0.45 < dropped[i].float().mean() < 0.55 for i in range(N))
    assert not torch.equal(dropped[0], dropped[1])
    torch.testing.assert_close(out[~dropped], (2 * full.expand_as(out))[~dropped])


def test_dropout_in_training_under_wide_draws_a_mask_per_member_not_a_shared_one():
    """Was refused (vmap cannot draw); the dropout module now runs once per member, as the loop: its own mask each."""
    _, (out,) = identical_members(W.DropoutNet, Strategy.WIDE, True, torch.randn(10, 4))
    assert (out[0] - out[1]).abs().max() > 1e-3, "the members shared one mask"


# --- stacked optimizers with per-member hyper-parameters vs N torch.optim optimizers ---------------------------

LRS, WDS = [0.1, 0.03, 0.01], [0.0, 0.1, 0.01]
OPTIMIZERS = {
    "sgd": (lambda ps: executor.StackedSGD(ps, N, lr=LRS, momentum=[0.9, 0.5, 0.0], weight_decay=WDS, dampening=0.1),
            lambda ps, i: torch.optim.SGD(ps, lr=LRS[i], momentum=[0.9, 0.5, 0.0][i], weight_decay=WDS[i], dampening=0.1)),
    "nesterov": (lambda ps: executor.StackedSGD(ps, N, lr=LRS, momentum=[0.9, 0.5, 0.3], weight_decay=WDS, nesterov=True),
                 lambda ps, i: torch.optim.SGD(ps, lr=LRS[i], momentum=[0.9, 0.5, 0.3][i], weight_decay=WDS[i], nesterov=True)),
    "adam": (lambda ps: executor.StackedAdam(ps, N, lr=LRS, betas=([0.9, 0.8, 0.5], [0.999, 0.99, 0.9]), weight_decay=WDS,
                                             eps=[1e-8, 1e-6, 1e-4]),
             lambda ps, i: torch.optim.Adam(ps, lr=LRS[i], betas=((0.9, 0.999), (0.8, 0.99), (0.5, 0.9))[i], weight_decay=WDS[i],
                                            eps=[1e-8, 1e-6, 1e-4][i])),
    "adamw": (lambda ps: executor.StackedAdamW(ps, N, lr=LRS, weight_decay=WDS),
              lambda ps, i: torch.optim.AdamW(ps, lr=LRS[i], weight_decay=WDS[i])),
    "amsgrad": (lambda ps: executor.StackedAdam(ps, N, lr=LRS, amsgrad=True),
                lambda ps, i: torch.optim.Adam(ps, lr=LRS[i], amsgrad=True)),
}


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stacked_optimizers_equal_n_torch_optimizers_over_steps(name, mode):
    """Tied weights, a frozen layer, BatchNorm, per-member lr / momentum / betas / eps / weight decay,
    two batch sizes, 4 steps: every member's whole state_dict as its own torch.optim run leaves it."""
    make_opt, make_torch = OPTIMIZERS[name]
    members = [W.TiedFrozenBN().train() for _ in range(N)]
    loop = copy.deepcopy(members)
    lead = (N,) if mode == "per_member" else ()
    batches = [torch.randint(0, 10, lead + (b,)) for b in (16, 16, 12, 12)]
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (batches[0][0] if lead else batches[0],)), N, mode),
                         members).train()
    opt = make_opt(list(ens.parameters()))
    opts = [make_torch(m.parameters(), i) for i, m in enumerate(loop)]
    for idx in batches:
        opt.zero_grad()
        floating_loss(ens(idx), N).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(loop, opts)):
            o.zero_grad()
            floating_loss(m(idx[i] if lead else idx)).backward()
            o.step()
    states = ens.member_state_dicts()
    for i, m in enumerate(loop):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(states[i][k], v, rtol=1e-5, atol=1e-6, msg=lambda e: f"member {i} {k}: {e}")
    assert torch.equal(ens.stacked_state["frozen.weight"], torch.stack([m.frozen.weight for m in members]))


# --- plan edits, JSON round trip with other members, precision ---------------------------------------------

def _edited_plans(plan, graph):
    """The proposed plan, every node excluded one at a time where allowed, split at each node, everything merged."""
    yield plan
    for node in graph.compute_nodes[:6]:
        try:
            yield planner.exclude(plan, graph, node)
        except planner.EditError:
            pass
        stage = next(s for s in plan.stages if node in s.nodes)
        try:
            yield planner.split(plan, graph, stage.id, at=node)
        except planner.EditError:
            pass
    merged = plan
    while len(merged.stages) > 1:
        try:
            merged = planner.merge(merged, graph, merged.stages[0].id, merged.stages[1].id)
        except planner.EditError:
            break
    yield merged


@pytest.mark.parametrize("make", [lambda: W.CausalSDPA(), lambda: W.Norms(group=True)], ids=["sdpa", "norms"])
def test_edited_plans_round_tripped_through_json_run_other_members_like_the_loop(make, tmp_path):
    x, x2 = torch.randn(2, 5, W.D), torch.randn(3, 7, W.D)
    if isinstance(make(), W.Norms):
        x, x2 = torch.randn(6, 4), torch.randn(9, 4)
    graph = planner.trace(make().eval(), (x,))
    plan = planner.propose(graph, N)
    for k, edited in enumerate(_edited_plans(plan, graph)):
        path = tmp_path / f"plan{k}.json"
        edited.save(path)
        loaded = planner.Plan.load(path)
        others = [make().eval() for _ in range(N)]  # not the members the plan was traced from
        loop = copy.deepcopy(others)
        ens = executor.build(loaded, others)
        for inp in (x, x2, x):
            with torch.no_grad():
                got, want = ens(inp), torch.stack([m(inp) for m in loop])
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda e: f"plan {k}: {e}")


@pytest.mark.parametrize("make", [lambda i: W.CausalSDPA(), lambda i: W.TiedLM(), W.Temperature], ids=["sdpa", "tied", "temperature"])
def test_bfloat16_plans_are_within_the_documented_tolerance_and_verify_agrees(make):
    from stagewise.executor.verify import DTYPE_RTOL
    inputs = (torch.randint(0, 11, (2, 5)),) if make(0).__class__ is W.TiedLM else (torch.randn(2, 5, W.D) if make(0).__class__ is W.CausalSDPA else torch.randn(5, 4),)
    members = [make(i) for i in range(N)]
    plan = planner.set_dtype(planner.propose(planner.trace(copy.deepcopy(members[0]), inputs), N), "bfloat16")
    report = executor.verify(plan, members, inputs)
    assert report.ok, report.to_text()
    ens = executor.build(plan, members)
    with torch.no_grad():
        got, want = ens(*inputs), torch.stack([m(*inputs) for m in members])
    assert got.dtype == want.dtype
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= DTYPE_RTOL["bfloat16"], err
    assert err > 0  # it really ran in bfloat16


# --- normalisation and embeddings -----------------------------------------------------------------------

@pytest.mark.parametrize("strategy", [None, Strategy.LOOP])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("train", [False, True])
def test_batchnorm_momentum_none_num_batches_tracked_and_groupnorm(momentum, train, strategy):
    """Cumulative averages (momentum=None) divide by num_batches_tracked: both compared after every call."""
    assert_matches_loop(lambda i: W.Norms(momentum), two_shapes(6, 4), strategy=strategy, train=train)


def test_batchnorm_momentum_none_under_wide_in_training_runs_per_member():
    # was refused loudly (vmap cannot read the count BatchNorm's cumulative average reads); wide now runs it per member
    assert_matches_loop(lambda i: W.Norms(None), two_shapes(6, 4), strategy=Strategy.WIDE, train=True)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_gradients(momentum):
    assert_matches_loop(lambda i: W.BatchNormHead(momentum), two_shapes(6, 4), train=True, grads=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kwargs", [{"max_norm": 1.0}, {"padding_idx": 0}], ids=["max_norm", "padding_idx"])
def test_embedding_max_norm_renormalises_each_members_weight(kwargs, strategy):
    """max_norm rewrites the rows it reads in the weight itself, in forward: state compared after each call."""
    calls = [(torch.randint(0, 10, (2, 5)),), (torch.randint(0, 10, (2, 5)),), (torch.randint(0, 10, (3, 6)),)]
    assert_matches_loop(lambda i: W.Embeddings(**kwargs), calls, strategy=strategy)
    if "padding_idx" in kwargs:
        assert_matches_loop(lambda i: W.Embeddings(**kwargs), calls, strategy=strategy, train=True, grads=True)


def test_members_with_another_activation_class_are_refused():
    plan = planner.propose(planner.trace(W.Net(), (torch.randn(5, 4),)), 2)
    other = W.Net()
    other.act = nn.GELU()
    with pytest.raises(planner.MemberError):
        executor.build(plan, [W.Net(), other])


def test_members_in_another_dtype_are_refused():
    plan = planner.propose(planner.trace(W.Net(), (torch.randn(5, 4),)), 2)
    with pytest.raises(planner.MemberError, match="float64"):
        executor.build(plan, [W.Net(), W.Net().double()])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_contiguous_and_cross_member_shared_parameters(strategy):
    shared = nn.Parameter(torch.randn(6, 4))

    def make(i):
        m = W.Net()
        m.fc1.weight = nn.Parameter(torch.randn(4, 6).t()) if i == 0 else shared  # non-contiguous; members 1, 2 share one
        return m
    assert_matches_loop(make, two_shapes(5, 4), strategy=strategy)


def test_training_members_that_share_a_parameter_is_refused_inference_is_not():
    """was: members holding one Parameter trained as N independent copies (the loop steps one tensor)."""
    shared = nn.Parameter(torch.randn(6, 4))

    def make(i):
        m = W.Net()
        if i > 0:
            m.fc1.weight = shared
        return m

    members = [make(i) for i in range(N)]
    x = torch.randn(5, 4)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=RTOL, atol=ATOL)
    with pytest.raises(planner.ExecutionError, match=r"share the trainable parameter.*fc1\.weight.*deepcopy"):
        ens(x)
    shared.requires_grad_(False)
    members[0].fc1.weight.requires_grad_(False)  # every member freezes fc1.weight (members that differ are refused)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), N), members)
    ens(x).sum().backward()  # frozen in the members: nothing to update apart
