"""torch.save / torch.load of a BatchedModule for every sample model and for a torch.export-traced stateful model:
the loaded module answers like the member loop, call after call.

Was: a plan traced by torch.export could not be saved (export's guard function does not pickle; torch.save had
emptied the file by then), and once it could, its stage modules came back wrong: torch.fx traces an unpickled
GraphModule again from its code, running ops on buffers once and keeping the results as constants, so a stage
handing on `self.mem[0]` held a stale copy of the row (off by 3.0, without a word)."""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from conftest import SAMPLE_NAMES, SAMPLES_DIR, load_sample

N = 3


def _round_trip(ens):
    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own FutureWarning about pytree specs
        return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_every_sample_saved_and_loaded_answers_like_the_loop(name, mode):
    src, graph = load_sample(name)
    plan = planner.propose(graph, n_members=N, input_mode=mode)
    members = src.members(N)
    loaded = _round_trip(executor.build(plan, copy.deepcopy(members), example_inputs=src.example_inputs))
    inputs = executor.batched_inputs(plan, src.example_inputs, seed=1)
    per_member = [spec.mode.value == "per_member" for spec in plan.inputs]
    with torch.no_grad():
        for _ in range(2):  # a module holding state (a buffer forward() writes) must go on from where it was
            got = loaded(*inputs)
            want = torch.stack([m(*(x[i] if pm else x for x, pm in zip(inputs, per_member))) for i, m in enumerate(members)])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class Memory(nn.Module):
    """forward() writes a buffer row: torch.export traces it (fx cannot)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)
        self.register_buffer("mem", torch.randn(4, 6))

    def forward(self, x):
        y = self.l(x)
        self.mem[0] = y.mean(0).detach()
        return y @ self.mem.t()


@pytest.mark.parametrize("strategy", [None, "loop", "wide"])
def test_an_export_plan_writing_state_saved_and_loaded_answers_like_the_loop(strategy):
    torch.manual_seed(0)
    members = [Memory().eval() for _ in range(N)]
    x = torch.randn(2, 6)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    assert graph.tracer == "export"
    plan = planner.propose(graph, n_members=N)
    if strategy is not None:
        for stage in plan.stages:
            if stage.mode.value == "batched":
                plan = planner.set_options(plan, graph, stage.id, strategy=strategy)
    loaded = _round_trip(executor.build(plan, copy.deepcopy(members)))
    with torch.no_grad():
        for _ in range(3):  # each call writes the row the next one reads
            torch.testing.assert_close(loaded(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)
    for state, m in zip(loaded.member_state_dicts(), members):
        torch.testing.assert_close(state["mem"], m.mem)


def test_a_module_built_from_a_file_still_saves_after_the_file_is_loaded_again():
    # Was: loading the file again replaced its module under the same name, so a stage calling the file's
    # torch.fx.wrap'd function no longer pickled (ObjMismatchError), as when the app loads the file again.
    path = SAMPLES_DIR / "data_dependent.py"
    src = planner.load_model_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, n_members=N)
    members = src.members(N)
    ens = executor.build(plan, copy.deepcopy(members), example_inputs=src.example_inputs)
    planner.load_model_file(path)
    loaded = _round_trip(ens)
    x = src.example_inputs[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-5)


_OWN_TYPES = '''
import torch
from torch import nn
from typing import NamedTuple


class Out(NamedTuple):
    logits: torch.Tensor
    value: torch.Tensor


@torch.fx.wrap
def scaled_tanh(x):
    return 2.0 * torch.tanh(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.pi, self.v = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 1)

    def forward(self, x):
        h = scaled_tanh(self.fc(x))
        return Out(self.pi(h), self.v(h))


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(5, 8),)
'''


def test_a_module_built_from_a_model_file_with_its_own_types_loads_in_a_new_process(tmp_path):
    """Was: ModuleNotFoundError in any other process: the model file's module name held Python's salted hash()."""
    import subprocess
    import sys

    model = tmp_path / "own_types.py"
    model.write_text(_OWN_TYPES)
    src = planner.load_model_file(str(model))
    ens = executor.build(planner.propose(planner.trace(src.model, src.example_inputs), 3), src.members(3))
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = ens(x)
    torch.save({"ens": ens, "x": x, "want": tuple(want)}, tmp_path / "ens.pt")
    script = (
        "import sys, torch\n"
        "from stagewise import planner\n"
        f"planner.load_model_file({str(model)!r})\n"
        f"saved = torch.load({str(tmp_path / 'ens.pt')!r}, weights_only=False)\n"
        "with torch.no_grad():\n"
        "    got = saved['ens'](saved['x'])\n"
        "assert type(got).__name__ == 'Out' and all(torch.equal(a, b) for a, b in zip(got, saved['want']))\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
