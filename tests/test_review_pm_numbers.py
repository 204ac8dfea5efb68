"""Per_member Python numbers, checked against plain torch (the member loop, each member called with its own number):
a number reaching an argument that must be a Python number (F.hardtanh's bounds, F.dropout's p, a slice bound,
F.leaky_relu's slope, inside a dict input too) runs its stage as the member loop, decided from the graph at build (was:
refused unless vmap's error text matched, after the stage had written the caller's input); the profile times such a
stage as the loop it runs; a list of numbers is one number per member; an export plan's message shows the number as
given; a shared input interleaved with a written per_member one on one memory is not refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.planner import ExecutionError, InputError
from test_review_build_inputs import Policy  # the export-traced policy with a temperature input

torch.set_num_threads(1)
N = 3
SHAPES = ((5, 4), (2, 4))  # two batch sizes: nothing may be baked in at the traced one
CALLS = 2  # per shape: state (and the runners) may drift between calls
TOL = dict(rtol=1e-6, atol=1e-6)


def members_of(make, n=N):
    torch.manual_seed(0)
    return [make() for _ in range(n)]


def plan_of(members, example, mode):
    return planner.propose(planner.trace(copy.deepcopy(members[0]), example), n_members=N, input_mode=mode)


def quiet_call(ens, *inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ens(*inputs)


def assert_grads_match(ens, ref, batched_loss, member_losses):
    """The stacked parameters' gradients of `batched_loss` are each member's gradients of its own loss."""
    batched_loss.backward()
    for loss in member_losses:
        loss.backward()
    for name, p in ens.named_stacked_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in ref])
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6, msg=name)


# --- 1. a stage writing its input and handing a number to F.leaky_relu ------------------------------------------------

class WritesAndSlopes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, slope):
        x.mul_(2)
        return self.fc3(F.leaky_relu(self.fc(x), slope))


def test_a_stage_writing_its_input_and_taking_a_number_runs_as_the_loop():
    members = members_of(WritesAndSlopes)
    ref = copy.deepcopy(members)
    plan = plan_of(members, (torch.randn(8, 4), 0.1), "per_member")
    ens = executor.build(plan, members)
    slopes = [0.01, 0.1, 0.3]
    for shape in SHAPES:
        for _ in range(CALLS):
            x = torch.randn(N, *shape)
            mine, theirs = x.clone(), x.clone()
            with torch.no_grad():
                got = quiet_call(ens, mine, torch.tensor(slopes))  # was refused, after doubling `mine`
                want = torch.stack([m(theirs[i], s) for i, (m, s) in enumerate(zip(ref, slopes))])
            torch.testing.assert_close(got, want, **TOL)
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)  # the caller's input written as the loop writes it
    x = torch.randn(N, *SHAPES[0])
    theirs = [x[i].clone() for i in range(N)]  # (rows of one tensor: a member's write would move the others' version)
    assert_grads_match(ens, ref, quiet_call(ens, x, torch.tensor(slopes)).square().sum(),
                       [m(theirs[i], s).square().sum() for i, (m, s) in enumerate(zip(ref, slopes))])
    torch.testing.assert_close(x, torch.stack(theirs), rtol=0, atol=0)


# --- 2. numbers reaching ops: the loop where the op takes a Python number, vmap where it takes a tensor --------------

OPS = {  # name: (op of h and the number, the members' numbers, the traced number, whether it takes a Python number)
    "hardtanh": (lambda h, a: F.hardtanh(h, -a, a), [0.1, 0.5, 1.0], 0.5, True),
    "hardtanh_max": (lambda h, a: F.hardtanh(h, 0.0, a), [0.1, 0.5, 2.0], 1.0, True),
    "dropout_p_eval": (lambda h, a: F.dropout(h, a, training=False), [0.0, 0.1, 0.3], 0.5, True),
    "leaky_relu_derived": (lambda h, a: F.leaky_relu(h, a * 0.5), [0.02, 0.2, 0.6], 0.2, True),
    "softplus_beta": (lambda h, a: F.softplus(h, beta=a), [0.5, 1.0, 2.0], 1.0, True),
    "celu": (lambda h, a: F.celu(h, a), [0.5, 1.0, 2.0], 1.0, True),
    "add_alpha": (lambda h, a: torch.add(h, h, alpha=a), [0.5, 1.0, 2.0], 1.0, True),
    "full_like": (lambda h, a: h + torch.full_like(h, a), [0.5, 1.0, 2.0], 1.0, True),
    "clamp_mixed": (lambda h, a: h.clamp(min=-a, max=1.0), [0.1, 0.5, 2.0], 1.0, True),
    "slice": (lambda h, n: h[:, :n].sum(-1, keepdim=True).expand(-1, 6), [1, 2, 3], 2, True),
    "narrow": (lambda h, n: h.narrow(-1, n, 2).mean(-1, keepdim=True) * h, [0, 1, 3], 1, True),
    "roll": (lambda h, n: torch.roll(h, n, -1), [0, 1, 2], 1, True),
    "divide": (lambda h, a: F.softmax(h / a, -1), [0.5, 1.0, 2.0], 1.0, False),
    "clamp_min": (lambda h, a: h.clamp(min=-a), [0.1, 0.5, 2.0], 1.0, False),
    "lerp": (lambda h, a: torch.lerp(h, h.flip(-1), a), [0.1, 0.5, 0.9], 0.5, False),
    "where": (lambda h, a: torch.where(h > 0, h, a), [0.1, 0.5, 0.9], 0.5, False),
}


class Op(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.fc, self.fc2, self.op = nn.Linear(4, 6), nn.Linear(6, 3), op

    def forward(self, x, a):
        return self.fc2(self.op(self.fc(x), a))


@pytest.mark.parametrize("name", list(OPS))
def test_a_per_member_number_runs_its_stage_as_the_loop_where_an_op_takes_a_python_number(name):
    op, values, traced, takes_a_number = OPS[name]
    members = members_of(lambda: Op(op))
    ref = copy.deepcopy(members)
    plan = plan_of(members, (torch.randn(*SHAPES[0]), traced), {"x": "shared", "a": "per_member"})
    ens = executor.build(plan, members)
    for k, shape in enumerate(SHAPES):
        for call in range(CALLS):
            x = torch.randn(*shape)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.no_grad():
                    got = ens(x, torch.tensor(values))  # hardtanh, dropout: refused before ("data-dependent control flow")
            said = [str(w.message) for w in caught if "per_member number" in str(w.message)]
            assert len(said) == (1 if takes_a_number and k == call == 0 else 0), said  # once, at the first call
            if said:
                assert "'a' to " in said[0] and "planner.exclude(plan, graph, 's0')" in said[0]
            with torch.no_grad():
                want = torch.stack([m(x, v) for m, v in zip(ref, values)])
            torch.testing.assert_close(got, want, **TOL)
    x = torch.randn(*SHAPES[1])
    assert_grads_match(ens, ref, ens(x, torch.tensor(values)).square().sum(),
                       [m(x, v).square().sum() for m, v in zip(ref, values)])
    # said by the graph at build: a fresh module knows before any call
    assert bool(executor.build(plan, members).number_loops) == takes_a_number


class DictSlope(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, cfg):
        return self.fc3(F.leaky_relu(self.fc(x) * cfg["scale"].unsqueeze(-1), cfg["slope"]))


def test_a_per_member_number_inside_a_dict_input_runs_its_stage_as_the_loop():
    members = members_of(DictSlope)
    ref = copy.deepcopy(members)
    b = SHAPES[0][0]
    plan = plan_of(members, (torch.randn(*SHAPES[0]), {"scale": torch.ones(b), "slope": 0.1}), {"x": "shared", "cfg": "per_member"})
    ens = executor.build(plan, members)
    slopes = [0.01, 0.1, 0.3]
    for shape in SHAPES:
        for _ in range(CALLS):
            x, scale = torch.randn(*shape), torch.rand(N, shape[0])
            with torch.no_grad():
                got = quiet_call(ens, x, {"scale": scale, "slope": torch.tensor(slopes)})  # was refused (.item())
                want = torch.stack([m(x, {"scale": scale[i], "slope": s}) for i, (m, s) in enumerate(zip(ref, slopes))])
            torch.testing.assert_close(got, want, **TOL)
    assert list(ens.number_loops) == ["s0"] and "cfg['slope']" in ens.number_loops["s0"][0]
    x, scale = torch.randn(*SHAPES[1]), torch.rand(N, SHAPES[1][0])
    assert_grads_match(ens, ref, quiet_call(ens, x, {"scale": scale, "slope": torch.tensor(slopes)}).square().sum(),
                       [m(x, {"scale": scale[i], "slope": s}).square().sum() for i, (m, s) in enumerate(zip(ref, slopes))])


class DictScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, cfg):
        return self.fc(x) * cfg["scale"].unsqueeze(-1) + cfg["shift"]


def test_a_dict_input_of_tensors_stays_batched():
    members = members_of(DictScale)
    plan = plan_of(members, (torch.randn(5, 4), {"scale": torch.ones(5), "shift": torch.zeros(())}),
                   {"x": "shared", "cfg": "per_member"})
    ens = executor.build(plan, members)
    x, cfg = torch.randn(5, 4), {"scale": torch.rand(N, 5), "shift": torch.randn(N, 1, 1)}  # [1, 1] per member: a tensor
    with torch.no_grad():
        got = ens(x, cfg)
        want = torch.stack([m(x, {"scale": cfg["scale"][i], "shift": cfg["shift"][i]}) for i, m in enumerate(members)])
    torch.testing.assert_close(got, want, **TOL)
    assert ens.number_loops == {}


def test_a_copied_module_keeps_running_the_number_stage_as_the_loop():
    members = members_of(lambda: Op(OPS["hardtanh"][0]))
    plan = plan_of(members, (torch.randn(*SHAPES[0]), 0.5), {"x": "shared", "a": "per_member"})
    ens = copy.deepcopy(executor.build(plan, members))
    x, values = torch.randn(*SHAPES[0]), [0.1, 0.5, 1.0]
    with torch.no_grad():
        torch.testing.assert_close(quiet_call(ens, x, torch.tensor(values)),
                                   torch.stack([m(x, v) for m, v in zip(members, values)]), **TOL)


# --- 3. the profile times such a stage as the loop it runs ----------------------------------------------------------

def test_the_profile_runs_a_number_stage_as_the_loop():
    members = members_of(lambda: Op(lambda h, a: F.leaky_relu(h, a)))
    plan = plan_of(members, (torch.randn(*SHAPES[0]), 0.1), {"x": "shared", "a": "per_member"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = executor.profile(plan, members, (torch.randn(*SHAPES[0]), torch.tensor([0.01, 0.2, 0.5])), repeats=2,
                                  baselines=False)
    assert report.end_to_end.ok, report.end_to_end.error  # was: "a stage failed: s0: ... .item()"
    (stage,) = report.stages
    assert stage.result.ok and stage.strategy == "loop" and "per_member Python number ('a' to leaky_relu)" in stage.note


# --- 4. what a per_member number is given as -----------------------------------------------------------------------

def test_a_per_member_number_given_as_a_list_is_one_number_per_member():
    members = members_of(lambda: Op(lambda h, a: F.leaky_relu(h, a)))
    ens = executor.build(plan_of(members, (torch.randn(*SHAPES[0]), 0.1), {"x": "shared", "a": "per_member"}), members)
    values = [0.01, 0.2, 0.5]
    for shape in SHAPES:
        x = torch.randn(*shape)
        with torch.no_grad():
            got = quiet_call(ens, x, values)  # was: InputError telling to stack
            torch.testing.assert_close(got, torch.stack([m(x, v) for m, v in zip(members, values)]), **TOL)
    for wrong, said in ((0.2, r"got a float \(0.2\)"), (torch.tensor([[0.1], [0.2], [0.3]]), r"got a tensor of shape \[3, 1\]"),
                        ([0.1, 0.2], "got a list of 2")):
        with pytest.raises(InputError, match=rf"'a' is a per_member Python number .*a list of 3 numbers, or one tensor of "
                                             rf"shape \[3\].*{said}"):
            quiet_call(ens, torch.randn(*SHAPES[0]), wrong)


class Window(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x, k):
        return self.fc(x)[:, :k]


def test_a_per_member_size_that_gives_members_other_shapes_is_named():
    members = members_of(Window)
    ens = executor.build(plan_of(members, (torch.randn(6, 4), 3), {"x": "shared", "k": "per_member"}), members)
    with pytest.raises(ExecutionError, match=r"different shapes.*per_member number reaches .*\('k' to getitem\)"):
        quiet_call(ens, torch.randn(6, 4), torch.tensor([2, 3, 4]))  # the member loop cannot stack them either
    with torch.no_grad():  # one size for every member: runs
        x = torch.randn(6, 4)
        torch.testing.assert_close(quiet_call(ens, x, [3, 3, 3]), torch.stack([m(x, 3) for m in members]), **TOL)


def test_an_export_plans_number_message_shows_the_number_as_given():
    members = members_of(Policy)
    plan = plan_of(members, (torch.randn(2, 4), 0.1), {"obs": "shared", "temperature": "per_member"})
    assert plan.tracer == "export"
    ens = executor.build(plan, members)
    with pytest.raises(InputError) as caught:  # float32 holds 0.01 as 0.009999999776
        ens(torch.randn(2, 4), torch.tensor([0.01, 0.1, 0.1]))
    assert "member 0's 0.01 would run" in str(caught.value), str(caught.value)
    with pytest.raises(InputError, match="member 1's 0.3 would run"):  # a list is checked for every member too
        ens(torch.randn(2, 4), [0.1, 0.3, 0.1])
    with torch.no_grad():
        obs = torch.randn(2, 4)
        ref = copy.deepcopy(members)
        torch.testing.assert_close(ens(obs, [0.1, 0.1, 0.1]), torch.stack([m(obs, 0.1) for m in ref]), **TOL)


# --- 5. a shared input interleaved with a written per_member input on one memory -----------------------------------

class WritesY(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, y, x):
        y.mul_(2)
        return self.fc(x) + y


def test_a_shared_input_interleaved_with_a_written_per_member_input_is_not_refused():
    members = members_of(WritesY)
    ref = copy.deepcopy(members)
    ens = executor.build(plan_of(members, (torch.randn(2, 4), torch.randn(2, 4)), {"y": "per_member", "x": "shared"}), members)
    for b in (2, 5):
        for _ in range(CALLS):
            z = torch.randn(b, 4, N + 1)  # members' y in z[..., :N], the shared x in z[..., N]: no element in common
            theirs = z.clone()
            with torch.no_grad():
                got = ens(z[..., :N].permute(2, 0, 1), z[..., N])  # was refused: the byte ranges overlap
                want = torch.stack([m(theirs[..., i], theirs[..., N]) for i, m in enumerate(ref)])
            torch.testing.assert_close(got, want, **TOL)
            torch.testing.assert_close(z, theirs, rtol=0, atol=0)
    y = torch.randn(N, 2, 4)
    with pytest.raises(InputError, match="shares memory with the per_member input 'y'"):  # an element in common: refused
        ens(y, y[0])
