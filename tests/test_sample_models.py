"""Checks on the sample model files in sample_models/.

Each file is loaded from its path (the way planner.load_model_file does), so
the tests do not depend on sample_models being importable as a package.
"""
import importlib.util
from pathlib import Path

import pytest
import torch

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "sample_models"
EXPECTED = {
    "mlp", "deep_mlp", "resblock", "transformer_block", "gru",
    "moe", "cnn", "data_dependent", "shape_loop",
}
FX_UNTRACEABLE = {"shape_loop"}  # Python loop over x.shape: fx fails, torch.export works
SAMPLES = sorted(p.stem for p in SAMPLES_DIR.glob("*.py") if p.stem != "__init__")


def load(name):
    path = SAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"sample_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_expected_samples_present():
    assert EXPECTED <= set(SAMPLES)
    assert (SAMPLES_DIR / "__init__.py").exists()


@pytest.mark.parametrize("name", SAMPLES)
def test_model_file_interface(name):
    mod = load(name)
    assert mod.__doc__ and mod.__doc__.strip(), "model file needs a module docstring"
    assert callable(getattr(mod, "build_model", None))
    assert callable(getattr(mod, "example_inputs", None))
    model = mod.build_model()
    assert isinstance(model, torch.nn.Module)
    assert not any(m.training for m in model.modules()), "build_model() must return eval mode"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    args = mod.example_inputs()
    assert isinstance(args, tuple) and len(args) > 0
    assert all(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args)
    # fixed seed: example_inputs() is reproducible
    for a, b in zip(args, mod.example_inputs()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", SAMPLES)
def test_output_finite_and_deterministic(name):
    mod = load(name)
    model = mod.build_model()
    args = mod.example_inputs()
    with torch.no_grad():
        out1 = model(*args)
        out2 = model(*args)
    assert isinstance(out1, torch.Tensor)
    assert out1.dtype == torch.float32
    assert torch.isfinite(out1).all()
    assert torch.equal(out1, out2)


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - FX_UNTRACEABLE))
def test_fx_symbolic_trace(name):
    mod = load(name)
    model = mod.build_model()
    args = mod.example_inputs()
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), model(*args), rtol=0, atol=0)


def test_shape_loop_fails_fx_but_exports():
    mod = load("shape_loop")
    model = mod.build_model()
    args = mod.example_inputs()
    with pytest.raises(Exception, match="Proxy"):
        torch.fx.symbolic_trace(model)
    ep = torch.export.export(model, args)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*args), model(*args), rtol=0, atol=0)
    assert list(ep.state_dict) == list(model.state_dict())


def test_data_dependent_fx_nodes():
    mod = load("data_dependent")
    gm = torch.fx.symbolic_trace(mod.build_model())
    ops = {(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes}
    assert ("call_method", "item") in ops
    assert ("call_function", "sign_branch") in ops


def test_data_dependent_fails_under_vmap():
    mod = load("data_dependent")
    members = [mod.build_model() for _ in range(2)]
    params, buffers = torch.func.stack_module_state(members)
    (x,) = mod.example_inputs()
    f = lambda p, x: torch.func.functional_call(members[0], p, (x,))
    with pytest.raises(RuntimeError, match=r"\.item\(\)"):
        torch.func.vmap(f, in_dims=(0, None))({**params, **buffers}, x)


@pytest.mark.parametrize("name", [n for n in SAMPLES if hasattr(load(n), "build_members")])
def test_build_members(name):
    mod = load(name)
    members = mod.build_members(3)
    assert len(members) == 3
    ref = mod.build_model()
    for m in members:
        assert type(m) is type(ref)
        assert not any(s.training for s in m.modules())
        assert list(m.state_dict()) == list(ref.state_dict())
    # members differ from each other ...
    k = next(iter(ref.state_dict()))
    assert not torch.equal(members[0].state_dict()[k], members[1].state_dict()[k])
    # ... and are reproducible
    again = mod.build_members(3)
    for a, b in zip(members, again):
        for key in a.state_dict():
            assert torch.equal(a.state_dict()[key], b.state_dict()[key])
