"""Regressions from the first run of the GPU tier on an H100 machine (torch 2.11, transformers 5.17), checked on CPU."""
from __future__ import annotations

import types
from pathlib import Path

from torch import nn

from stagewise.planner.module_refusals import call_override_refusal


def _layer_module() -> types.ModuleType:
    """A stand-in for transformers 5.17's modeling_layers: GradientCheckpointingLayer overrides __call__ and calls
    forward (through torch.utils.checkpoint when gradient checkpointing is on)."""
    mod = types.ModuleType("transformers.modeling_layers")
    exec("import torch.nn as nn\n"
         "class GradientCheckpointingLayer(nn.Module):\n"
         "    gradient_checkpointing = False\n"
         "    def __call__(self, *args, **kwargs):\n"
         "        return super().__call__(*args, **kwargs)\n", mod.__dict__)
    return mod


def test_transformers_checkpointing_layers_are_not_refused_but_other_call_overrides_are():
    layer = _layer_module().GradientCheckpointingLayer

    class Block(layer):  # BertLayer, GPT2Block, ViTLayer, T5Block, BartEncoderLayer derive from it in 5.17
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    class Wrapped(nn.Module):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 2  # changes the values: must stay refused

        def forward(self, x):
            return x

    assert call_override_refusal(nn.Sequential(Block(), Block()), "Model") is None
    refusal = call_override_refusal(nn.Sequential(Block(), Wrapped()), "Model")
    assert refusal and "submodule 1 (Wrapped) overrides __call__" in refusal


class _Stop(Exception):
    pass


def test_the_export_retrace_at_build_gets_example_inputs_where_member_0_lives(monkeypatch):
    """build retraces an export plan on zeros of the traced shapes: made on the CPU, they failed against members on
    CUDA (the H100 run: shape_loop, "found two different devices cpu, cuda:0"). Meta members stand in for CUDA here."""
    import importlib

    import torch

    from stagewise import executor, planner

    build_module = importlib.import_module("stagewise.executor.build")
    src = planner.load_model_file(Path(__file__).parents[1] / "sample_models" / "shape_loop.py")
    plan = planner.propose(planner.trace(src.model, src.example_inputs), 2, "shared")
    assert plan.tracer == "export"
    seen = []

    def spy(model, tracer, example, *args, **kwargs):
        seen.append(({x.device.type for x in example if x is not None}, {p.device.type for p in model.parameters()}))
        raise _Stop

    monkeypatch.setattr(build_module, "retrace", spy)
    for device in ("cpu", "meta"):
        members = [m.to(device) for m in src.members(2)]
        try:
            executor.build(plan, members)
        except _Stop:
            pass
        assert seen[-1] == ({device}, {device})
    assert planner.inputs.example_inputs_from(plan.inputs)[0].device == torch.device("cpu")  # the default stays


def test_an_input_traced_as_none_is_shared_whatever_a_plan_says():
    """One place decides: InputSpec. A plan file (or an edit) asking per_member for an input traced as None reads as
    shared, so the module and the checks that read plan.input_mode agree."""
    from stagewise.planner.plan import InputMode, InputSpec

    spec = InputSpec("token_type_ids", InputMode.PER_MEMBER, None, "NoneType")
    assert spec.mode is InputMode.SHARED
    assert InputSpec.from_json({**spec.to_json(), "mode": "per_member"}).mode is InputMode.SHARED
    assert InputSpec("x", InputMode.PER_MEMBER, (2, 3), "float32").mode is InputMode.PER_MEMBER


def test_export_graphs_hold_no_stride_dependent_views(tmp_path):
    """torch 2.11 (the CUDA machine's): nn.MultiheadAttention opened through torch.export failed under vmap with
    "view size is not compatible": export keeps `permute(...).view(...)` because the attention kernel's output
    happened to be laid out for it, and the batched output is not. Both export paths (tracing, and a saved
    archive's module) hold reshapes instead, and the opened module still matches the member loop. The fingerprint
    is the traced graph's, so plans saved before keep matching."""
    import torch
    from test_open_modules import Attend  # nn.MultiheadAttention(32, 4) inside a user module

    from stagewise import executor, planner
    from stagewise.planner.graph import fingerprint
    from stagewise.planner.tracers import _export

    torch.manual_seed(0)
    members = [Attend().eval() for _ in range(3)]
    x = torch.randn(2, 5, 32)
    view = torch.ops.aten.view.default

    def calls(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    graph = planner.trace(members[0], (x,), open_modules=["attn"])
    assert graph.tracer == "export"
    assert view not in calls(graph.gm) and torch.ops.aten.reshape.default in calls(graph.gm)
    traced = _export(members[0], (x,))
    assert view in calls(traced) and graph.fingerprint == fingerprint(traced, ("attn",))
    assert executor.verify(planner.propose(graph, n_members=3), members, (x,), rtol=1e-5).ok

    path = tmp_path / "attend.pt2"
    torch.export.save(torch.export.export(members[0], (x,), strict=False), path)
    loaded = planner.load_export(path)
    from_archive = planner.trace(loaded.model, loaded.example_inputs)
    assert view not in calls(from_archive.gm)
    plan = planner.propose(from_archive, n_members=3)
    assert executor.verify(plan, loaded.members(3), (x,), rtol=1e-5).ok


def test_a_view_whose_base_is_written_in_place_stays_a_view():
    """torch.export's graph keeps in-place ops (`h.add_(1)` after `v = h.view(-1)`): v must see the write, which a
    reshape that copied would not. Such views stay views; the others become reshapes. Values as the model's."""
    import torch

    from stagewise.planner.tracers import _export, views_as_reshapes

    class WritesAfterAView(nn.Module):
        def forward(self, x):
            h = x * 2
            v = h.view(-1)
            h.add_(1)  # v sees it
            w = (x + 1).view(-1)  # nothing writes here: may become a reshape
            return v + w

    x = torch.randn(2, 3)
    gm = _export(WritesAfterAView(), (x,))
    views_as_reshapes(gm)
    calls = [(n.target, n.args[0].target if isinstance(n.args[0], torch.fx.Node) else None)
             for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.view.default, torch.ops.aten.mul.Tensor) in calls  # v's base is written: a view
    assert (torch.ops.aten.reshape.default, torch.ops.aten.add.Tensor) in calls
    torch.testing.assert_close(gm(x), WritesAfterAView()(x))
