"""Shared fixtures for the spine's tests.

Tracing a sample takes 0.02-1.5 s, so each sample is loaded and traced once per
test session (`sample("mlp") -> (src, graph)`). Tests must treat the cached
ModelGraph as read-only (edits are pure, so they never touch it).

Tiers: everything runs on CPU; `@pytest.mark.gpu` tests skip without CUDA.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import textwrap
import warnings
from pathlib import Path

import networkx as nx
import pytest
import torch
from torch import nn

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a GPU machine's python as it is (`make test-gpu`) may lack the test extras: see HYPOTHESIS_FILES
    HealthCheck = settings = None

from stagewise import planner
from stagewise.planner import StageMode

ROOT = Path(__file__).resolve().parent.parent
SAMPLES_DIR = ROOT / "sample_models"
SAMPLE_NAMES = sorted(p.stem for p in SAMPLES_DIR.glob("*.py") if p.stem != "__init__")
EXPORT_SAMPLES = {"shape_loop"}  # fx cannot trace these; torch.export does

# hypothesis: no deadline (tracing and vmap are slow and jittery) and the same examples every run,
# so CI is reproducible; tests take modest example counts through `examples(n)`. For a longer,
# random search: STAGEWISE_HYPOTHESIS_SCALE=10 pytest tests/test_edits.py
HYPOTHESIS_SCALE = float(os.environ.get("STAGEWISE_HYPOTHESIS_SCALE", "1"))
if settings is not None:
    settings.register_profile(
        "stagewise", deadline=None, derandomize=HYPOTHESIS_SCALE <= 1,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile("stagewise")


# The app tier needs streamlit and plotly. A GPU machine runs the suite with the python it has
# (`make test-gpu`), often without them: the app tests are then not collected, and
# tests/test_app_dependencies.py says so in the summary instead of the run failing on imports.
APP_PACKAGES = ("streamlit", "plotly")
MISSING_APP_PACKAGES = [m for m in APP_PACKAGES if importlib.util.find_spec(m) is None]
# Without hypothesis the files that import it are left out (and test_app_dependencies.py says so), not the whole run.
HYPOTHESIS_FILES = ["test_edits.py", "test_review_adversarial.py", "test_training.py"]
MISSING_TEST_PACKAGES = ["hypothesis"] if settings is None else []
collect_ignore_glob = (["app/test_*.py"] if MISSING_APP_PACKAGES else []) + (HYPOTHESIS_FILES if MISSING_TEST_PACKAGES else [])


def examples(n: int) -> int:
    """A test's hypothesis example count, scaled by STAGEWISE_HYPOTHESIS_SCALE."""
    return max(1, int(n * HYPOTHESIS_SCALE))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker itself: keywords hold path names too (a folder named gpu)
            item.add_marker(skip)


def precision_flags() -> tuple:
    """The process-wide switches that change float32 results on CUDA (they exist on CPU builds too)."""
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled())


@pytest.fixture(autouse=True)
def _precision_flags_unchanged():
    """Every test leaves TF32, matmul precision and cuDNN's modes as it found them: on a GPU a flag left behind
    changes what every later test computes (cuDNN's TF32 is on by default). A leak is put back and fails the test."""
    before = precision_flags()
    yield
    after = precision_flags()
    if after != before:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision, bench, det, algos = before
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = bench, det
        torch.use_deterministic_algorithms(algos)
        pytest.fail(f"the test changed process-wide precision flags (matmul.allow_tf32, cudnn.allow_tf32, float32 matmul "
                    f"precision, cudnn.benchmark, cudnn.deterministic, deterministic algorithms) from {before} to {after}; "
                    "restore them (e.g. in a finally)")


@functools.lru_cache(maxsize=None)
def load_sample(name: str) -> tuple[planner.ModelSource, planner.ModelGraph]:
    """(source, graph) for sample_models/<name>.py, traced once per session."""
    src = planner.load_model_file(SAMPLES_DIR / f"{name}.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export and vmap-fallback warnings are expected here
        graph = planner.trace(src.model, src.example_inputs)
    return src, graph


@pytest.fixture(scope="session")
def sample():
    """The cached loader: `src, graph = sample("mlp")`."""
    return load_sample


@pytest.fixture
def write_model(tmp_path):
    """Write a model file from source text (dedented) and return its path."""

    def write(text: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


TINY_MODEL = '''
"""A tiny model file used by tests."""
import torch
import torch.nn as nn


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


def example_inputs():
    return (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),)
'''


class ScaleInPlace(nn.Module):
    """An in-place update of an activation that another node read before it (needs an order edge)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        early = h + 1
        h.mul_(2)
        return h - 1, early


class RunningTotal(nn.Module):
    """Accumulates the input mean in a buffer (the update must see a traced value to land in the graph)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(x.detach().mean(0))
        return self.fc(x) + self.total


def check_plan_invariants(plan: planner.Plan, graph: planner.ModelGraph) -> None:
    """The plan invariants, computed here independently of planner.validate."""
    dag = graph.dag
    placed = [n for s in plan.stages for n in s.nodes]
    assert sorted(placed) == sorted(graph.compute_nodes), "every compute node in exactly one stage"
    assert len(placed) == len(set(placed))
    assert [s.id for s in plan.stages] == [f"s{i}" for i in range(len(plan.stages))]
    owner = {n: i for i, s in enumerate(plan.stages) for n in s.nodes}
    for s in plan.stages:
        assert list(s.nodes) == sorted(s.nodes, key=graph.topo_index), f"{s.id} nodes out of graph order"
        inside = set(s.nodes)
        below = set().union(*(nx.descendants(dag, n) for n in inside)) - inside
        above = set().union(*(nx.ancestors(dag, n) for n in inside)) - inside
        assert not (below & above), f"{s.id} is not convex: {sorted(below & above)[:3]} lie between its nodes"
        if s.mode is StageMode.BATCHED:
            assert all(dag.nodes[n]["batchable"] for n in s.nodes), f"batched {s.id} holds an unbatchable node"
            assert s.reason == ""
        else:
            assert s.reason, f"excluded {s.id} has no reason"
    for u, v in dag.edges:  # stage ids are a topological order of the stage graph (so it is acyclic)
        if u in owner and v in owner:
            assert owner[u] <= owner[v], f"edge {u}->{v} goes from {plan.stages[owner[u]].id} back to {plan.stages[owner[v]].id}"


def assert_trains_like_the_loop(ens, members, inputs: tuple, names=None, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """One forward and backward (loss: the sum of squares) of the batched module and of each member on `inputs`
    (shared by every member): the outputs, and the stacked gradients of `names` (every parameter when None), alike."""
    out = ens(*inputs)
    want = torch.stack([m(*inputs) for m in members])
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    out.square().sum().backward()
    want.square().sum().backward()
    got = dict(ens.named_stacked_parameters())
    for name in names or [k for k, _ in members[0].named_parameters()]:
        torch.testing.assert_close(got[name].grad, torch.stack([m.get_parameter(name).grad for m in members]),
                                   rtol=rtol, atol=atol)
