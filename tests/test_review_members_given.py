"""Review: members given as something other than N modules (state dicts, file paths, a method not called, one
module, wrappers, lazy or quantized modules) get an error naming what was given and the way to modules, at build,
verify, autotune and profile alike; they got raw AttributeErrors, TypeErrors or a misleading 're-plan'."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner import MemberError

N = 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


X = torch.randn(3, 4)


def plan():
    return planner.propose(planner.trace(MLP(), (X,)), N)


CASES = {
    "state dicts": (lambda: [MLP().state_dict() for _ in range(N)], r"member 0 is a OrderedDict.*load_state_dict"),
    "file paths": (lambda: ["a.safetensors", "b.safetensors"], r"member 0 is a str.*planner.load_source"),
    "a method not called": (lambda: planner.load_model_file.__call__, r"a function: call it"),
    "one module": (lambda: MLP(), r"got one MLP: pass \[member_0, member_1"),
    "compiled members": (lambda: [torch.compile(MLP()) for _ in range(N)], r"OptimizedModule wrapper.*m\._orig_mod"),
    "DataParallel members": (lambda: [nn.DataParallel(MLP()) for _ in range(N)], r"DataParallel wrapper.*m\.module"),
    "quantized members": (lambda: [torch.ao.quantization.quantize_dynamic(MLP(), {nn.Linear}, dtype=torch.qint8)
                                   for _ in range(N)], r"quantized module \(fc1: Linear\)"),
    "lazy members": (lambda: [nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2)) for _ in range(N)],
                     r"lazy module's parameter not made yet.*run the model once"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("call", ["build", "autotune", "profile"])
def test_members_that_are_not_modules_are_named_with_the_fix(case, call):
    make, message = CASES[case]
    p = plan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        members = make()
    with pytest.raises(MemberError, match=message):
        if call == "build":
            executor.build(p, members)
        elif call == "autotune":
            executor.autotune(p, members, (X,), budget="quick")
        else:
            executor.profile(p, members, (X,), repeats=1)


@pytest.mark.parametrize("case", ["quantized members", "lazy members"])
def test_such_a_model_is_refused_at_trace_too(case):
    make, message = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make()[0]
    with pytest.raises(planner.TraceError, match=r"quantized module \(fc1: Linear\)" if case == "quantized members"
                       else r"lazy modules not yet initialised"):
        planner.trace(model, (X,))


def test_a_compiled_submodule_is_named_with_its_plain_module():
    """Refused as 'forward replaced on the instance' with a subclass fix that does not fit."""
    class WithCompiled(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.compile(MLP())

        def forward(self, x):
            return self.block(x)

    with pytest.raises(planner.TraceError, match=r"torch.compile'd submodule\(s\) 'block'.*m\.block = m\.block\._orig_mod"):
        planner.trace(WithCompiled(), (X,))


def test_members_in_a_module_list_are_the_members():
    """A regression of today's check: an nn.ModuleList of the members was refused as 'one ModuleList'."""
    members = nn.ModuleList(MLP() for _ in range(N))
    with torch.no_grad():
        torch.testing.assert_close(executor.build(plan(), members)(X), torch.stack([m(X) for m in members]))
