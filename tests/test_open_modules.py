"""Opening leaf modules (planner.opening): trace inside nn.TransformerEncoderLayer / nn.MultiheadAttention,
plan the ops inside, and check the batched plan against the member loop."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.app import cli
from stagewise.planner.opening import resolve_open_modules
from conftest import MISSING_APP_PACKAGES, ROOT

N = 3
RTOL = 1e-5

MODEL_FILE = textwrap.dedent('''
    import torch
    from torch import nn


    class Stack(nn.Module):
        """A stack of torch.nn encoder layers: each one leaf of fx's default trace."""

        def __init__(self, depth=2):
            super().__init__()
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
                                        for _ in range(depth))
            self.head = nn.Linear(32, 8)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)


    def build_model():
        return Stack().eval()


    def example_inputs():
        return (torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)),)
''')


_NS: dict = {}
exec(compile(MODEL_FILE, "stack.py", "exec"), _NS)  # the model file the CLI and app tests load, as a class here
Stack = _NS["Stack"]


class Attend(nn.Module):
    """A user module around nn.MultiheadAttention (fx cannot trace inside it: it branches on query.dim())."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def members(cls, n: int = N) -> list[nn.Module]:
    torch.manual_seed(0)
    return [cls().eval() for _ in range(n)]


def example() -> tuple:
    return (torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)),)


def test_opening_encoder_layers_gives_nodes_under_their_paths():
    m = members(Stack, 1)[0]
    closed = planner.trace(m, example())
    assert [(leaf.path, leaf.type_name) for leaf in closed.leaf_modules()][:2] == [
        ("layers.0", "TransformerEncoderLayer"), ("layers.1", "TransformerEncoderLayer")]
    graph = planner.trace(m, example(), open_modules=["layers.*"])
    assert graph.tracer == "fx" and graph.opened_modules == ("layers.0", "layers.1")
    inside = [n for n in graph.compute_nodes if graph.dag.nodes[n]["module_path"].startswith("layers.0")]
    assert {graph.dag.nodes[n]["module_path"] for n in inside} >= {"layers.0", "layers.0.linear1", "layers.0.norm1"}
    assert any(graph.dag.nodes[n]["op"] == "call_function" and graph.dag.nodes[n]["module_path"] == "layers.0" for n in inside)
    assert "layers.0" not in {leaf.path for leaf in graph.leaf_modules()}
    assert sum(graph.dag.nodes[n]["flops"] for n in inside) > 0  # the closed layer measured as one node; now per op
    attn = next(leaf for leaf in graph.leaf_modules() if leaf.path == "layers.0.self_attn")
    assert attn.type_name == "MultiheadAttention"


def test_opened_encoder_plan_matches_the_member_loop_and_round_trips(tmp_path):
    ms = members(Stack)
    graph = planner.trace(ms[0], example(), open_modules=["TransformerEncoderLayer"])
    plan = planner.propose(graph, n_members=N)
    assert plan.opened_modules == ("layers.0", "layers.1")
    assert any(s.mode is planner.StageMode.BATCHED and len(s.nodes) > 3 for s in plan.stages)
    assert executor.verify(plan, ms, example(), rtol=RTOL).ok
    loaded = planner.Plan.load(plan.save(tmp_path / "plan.json"))
    assert json.loads((tmp_path / "plan.json").read_text())["opened_modules"] == ["layers.0", "layers.1"]
    assert loaded == plan
    module = executor.build(loaded, ms)
    with torch.no_grad():
        got = module(*example())
        want = torch.stack([m(*example()) for m in ms])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)


def test_multihead_attention_opens_through_torch_export():
    ms = members(Attend)
    graph = planner.trace(ms[0], example(), open_modules=["attn"])
    assert graph.tracer == "export" and graph.opened_modules == ("attn",)
    assert "opened modules attn" in graph.tracer_note and "torch.export" in graph.tracer_note
    assert graph.leaf_modules() == []
    inside = [n for n in graph.compute_nodes if graph.dag.nodes[n]["module_path"].startswith("attn")]
    assert len(inside) > 5
    plan = planner.propose(graph, n_members=N)
    assert executor.verify(planner.Plan.loads(plan.dumps()), ms, example(), rtol=RTOL).ok


def test_fingerprint_includes_the_opened_modules():
    m = members(Stack, 1)[0]
    closed = planner.trace(m, example())
    opened = planner.trace(m, example(), open_modules=["layers.0"])
    assert closed.fingerprint != opened.fingerprint
    assert opened.fingerprint == planner.trace(m, example(), open_modules=["layers.0"]).fingerprint
    # an export graph is the same whatever is opened; the plan still records (and the fingerprint holds) what was asked
    a = members(Attend, 1)[0]
    assert planner.trace(a, example(), open_modules=["attn"]).fingerprint != planner.trace(a, example(), open_modules=["attn.out_proj"]).fingerprint


def test_names_resolve_to_paths_globs_and_class_names():
    m = Stack(depth=3)
    assert resolve_open_modules(m, ["layers.*"]) == ("layers.0", "layers.1", "layers.2")
    assert resolve_open_modules(m, ["TransformerEncoderLayer"]) == ("layers.0", "layers.1", "layers.2")
    assert resolve_open_modules(m, ["**.self_attn"]) == ("layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn")
    assert resolve_open_modules(m, ["layers.1", "layers.1"]) == ("layers.1",)
    assert resolve_open_modules(Attend(), []) == ()


def test_opening_a_module_fx_already_traces_inside_is_a_no_op():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Attend()

        def forward(self, x):
            return self.inner(x)

    m = Outer().eval()
    assert resolve_open_modules(m, ["inner"]) == ()
    assert planner.trace(m, example(), open_modules=["inner"]).fingerprint == planner.trace(m, example()).fingerprint


def test_unknown_module_names_the_path_and_what_can_be_opened():
    with pytest.raises(planner.TraceError) as e:
        planner.trace(Stack().eval(), example(), open_modules=["layers.9"])
    msg = str(e.value)
    assert "'layers.9'" in msg and "layers.0 (TransformerEncoderLayer)" in msg and "head (Linear)" in msg


def test_plan_for_opened_modules_refuses_a_graph_traced_otherwise():
    ms = members(Stack)
    plan = planner.propose(planner.trace(ms[0], example(), open_modules=["layers.0"]), n_members=N)
    with pytest.raises(planner.PlanMismatchError, match=r"opens modules \['layers.0'\]"):
        planner.validate(plan, planner.trace(ms[0], example()))


def test_plan_files_without_opened_modules_load_and_read_the_same():
    for path in sorted((ROOT / "tests" / "golden").glob("*.json")):
        text = path.read_text()
        plan = planner.Plan.loads(text, source=str(path))
        assert plan.opened_modules == ()
        assert "opened_modules" not in plan.to_json()
        assert plan.dumps() == text


@pytest.mark.parametrize("bad", ["layers.0", [1], [""], {"a": 1}])
def test_malformed_opened_modules_is_a_plan_file_error(bad):
    d = json.loads(next((ROOT / "tests" / "golden").glob("*.json")).read_text())
    d["opened_modules"] = bad
    with pytest.raises(planner.PlanFileError, match="opened_modules must be a list of module paths"):
        planner.Plan.from_json(d)


def test_cli_plan_open_and_show(tmp_path, capsys):
    model = tmp_path / "stack.py"
    model.write_text(MODEL_FILE)
    out = tmp_path / "plan.json"
    code = cli.main(["plan", str(model), "-n", "3", "--open", "layers.*", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert planner.Plan.load(out).opened_modules == ("layers.0", "layers.1")
    assert cli.main(["show", str(out), str(model)]) == 0  # traced as the plan was: the fingerprints agree
    assert cli.main(["run", str(out), str(model)]) == 0
    capsys.readouterr()
    assert cli.main(["plan", str(model), "--open", "layers.7"]) == 2
    assert "no module 'layers.7'" in capsys.readouterr().err


def _open_view_script():
    import streamlit as st

    from stagewise.app import open_view, state

    st.session_state["access_granted"] = True  # what presenting the token sets (app/state.access_refusal)
    state.init()
    state.show_flash()
    open_view.open_modules_ui()


# the app tier (streamlit's AppTest): left out like tests/app/ where streamlit/plotly are missing (`make test-gpu`)
@pytest.mark.skipif(bool(MISSING_APP_PACKAGES), reason=f"app test: {', '.join(MISSING_APP_PACKAGES)} not installed")
def test_app_opens_selected_leaf_modules(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from stagewise.app import launch

    model = tmp_path / "stack.py"
    model.write_text(MODEL_FILE)
    monkeypatch.setenv("STAGEWISE_AUTOSAVE", str(tmp_path / "autosave.json"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(launch.MODEL_ENV, str(model))
    monkeypatch.setenv(launch.OPEN_ENV, json.dumps(["layers.1"]))  # `stagewise ui stack.py --open layers.1`
    at = AppTest.from_function(_open_view_script, default_timeout=120).run()
    assert not at.exception
    assert at.session_state["history"].present.opened_modules == ("layers.1",)
    at.multiselect(key="open_modules_choice").set_value(["layers.0"]).run()
    next(b for b in at.button if b.label == "Open selected leaf modules").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    plan = at.session_state["history"].present
    assert plan.opened_modules == ("layers.0", "layers.1") and plan.n_members == 8
    next(b for b in at.button if b.label == "Close opened modules").click().run()
    assert at.session_state["history"].present.opened_modules == ()


class _PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), 2)
        self.fc = nn.Linear(16, 2)

    def forward(self, x, kpm):
        return self.fc(self.enc(x, src_key_padding_mask=kpm))


def test_torchs_attention_modules_traced_through_warn_at_build_that_their_fast_path_is_not_followed():
    """Review: opened (or exported), nn.TransformerEncoder ran its dense ops where torch's module, in eval without
    gradients, zeroes padded positions (0.55 off there), with no word; closed, the plan follows torch's paths."""
    members = [_PaddedEncoder().eval() for _ in range(3)]
    x, kpm = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    opened = planner.propose(planner.trace(members[0], (x, kpm), open_modules=["enc"]), 3)
    with pytest.warns(UserWarning, match=r"nn.TransformerEncoder, nn.TransformerEncoderLayer as the ops it traced "
                                         r"\((opened|torch.export)\).*fast path"):
        executor.build(opened, members)
    import warnings

    closed = planner.propose(planner.trace(members[0], (x, kpm)), 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*as the ops it traced.*")
        ens = executor.build(closed, members)
    kpm[1, 3:] = True
    with torch.no_grad():
        torch.testing.assert_close(ens(x, kpm), torch.stack([m(x, kpm) for m in members]), rtol=1e-4, atol=1e-5)
