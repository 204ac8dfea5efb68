"""AppTest (streamlit.testing.v1) tests of every page, driven through widgets as a keyboard user would.

The app opens on sample_models/transformer_block.py: stages s0 (batched, attention
projections), s1 (excluded: scaled_dot_product_attention) and s2 (batched, the rest).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from stagewise import planner
from stagewise.app import autosave
from app_fakes import app_test

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_models"


@pytest.fixture
def at(tmp_path, monkeypatch) -> AppTest:
    app = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py")  # with the token, as `stagewise ui`
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    return app


def plan_of(at: AppTest) -> planner.Plan:
    return at.session_state["history"].present


def button(at: AppTest, label: str):
    matches = [b for b in at.button if b.label == label]
    assert matches, f"no button {label!r}; buttons: {[b.label for b in at.button]}"
    return matches[0]


def select(at: AppTest, *items: str) -> None:
    at.multiselect(key="selection").set_value(list(items)).run()


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def test_opens_on_the_sample_with_a_coloured_graph(at):
    p = plan_of(at)
    assert [s.id for s in p.stages] == ["s0", "s1", "s2"]
    assert "3 stages" in texts(at.markdown)
    chart = at.get("plotly_chart")[0]
    # s1, the attention, is excluded from vmap and starts as wide (the members folded into its batch axis)
    assert '"customdata"' in chart.proto.spec and "s1 \\u00b7 batched (wide)" in chart.proto.spec
    assert not at.error


def test_select_merge_undo_redo(at):
    select(at, "s1", "s2")
    button(at, "Merge").click().run()
    at.button(key="pending_apply").click().run()  # s2's batched nodes would loop: confirmed after the warning
    assert len(plan_of(at).stages) == 2
    assert "merge s1+s2 → 2 stages" in texts(at.success)
    assert at.multiselect(key="selection").value == []  # selection cleared after an edit
    button(at, "Undo").click().run()
    assert len(plan_of(at).stages) == 3
    button(at, "Redo").click().run()
    assert len(plan_of(at).stages) == 2
    button(at, "Reset").click().run()
    assert len(plan_of(at).stages) == 3
    assert Path(autosave.autosave_path()).is_file()  # every edit autosaves
    assert autosave.load().plan == plan_of(at)


def test_selecting_nodes_acts_on_their_stages(at):
    select(at, "ln1", "scaled_dot_product_attention")  # nodes of s0 and s1
    button(at, "Merge").click().run()
    at.button(key="pending_apply").click().run()
    p = plan_of(at)
    assert len(p.stages) == 2 and p.stage_of("ln1") == p.stage_of("scaled_dot_product_attention")


def test_refused_merge_shows_the_library_message_and_keeps_the_plan(at):
    before = plan_of(at)
    select(at, "s0", "s2")  # s1 sits between them
    button(at, "Merge").click().run()
    assert "would create a cycle" in texts(at.error)
    assert plan_of(at) == before and len(at.session_state["history"].entries) == 1


def test_split_exclude_include(at):
    select(at, "proj")
    button(at, "Split").click().run()
    p = plan_of(at)
    assert len(p.stages) == 4 and p.stage_of("proj").nodes[0] == "proj"
    select(at, "ln2")
    button(at, "Exclude").click().run()
    p = plan_of(at)
    assert p.stage_of("ln2").mode.value == "excluded" and p.stage_of("proj").mode.value == "excluded"
    select(at, "ln2")
    button(at, "Include").click().run()
    assert plan_of(at).stage_of("ln2").mode.value == "batched"
    at.radio(key="edit_scope").set_value("selected nodes only").run()
    select(at, "ffn_1")
    button(at, "Exclude").click().run()
    p = plan_of(at)
    assert p.stage_of("ffn_1").nodes == ("ffn_1",) and p.stage_of("ffn_1").mode.value == "excluded"
    assert p.stage_of("ffn_0").mode.value == "batched"


def test_refused_include_of_unbatchable_node(at):
    select(at, "s1")
    button(at, "Include").click().run()
    assert "cannot be batched" in texts(at.error)
    assert plan_of(at).stage("s1").mode.value == "excluded"


def test_set_strategy_on_selected_stage(at):
    select(at, "s0")
    at.selectbox(key="strategy").set_value("compile")
    at.number_input(key="chunk_size").set_value(2)
    button(at, "Set strategy").click().run()
    opts = plan_of(at).stage("s0").options
    assert opts.strategy.value == "compile" and opts.chunk_size == 2


def test_collapse_and_search(at):
    at.multiselect(key="collapsed").set_value(["ffn"]).run()
    spec = at.get("plotly_chart")[0].proto.spec
    assert "module:ffn" in spec and '"ffn_1"' not in spec
    at.multiselect(key="collapsed").set_value([]).run()
    at.selectbox(key="collapse_depth").set_value(2).run()  # ffn.0, ffn.1, ffn.2: one node each, drawn as the node
    assert at.multiselect(key="collapsed").value == []  # the control shows what is collapsed: nothing worth a box
    spec = at.get("plotly_chart")[0].proto.spec
    assert "module:ffn" not in spec and '"ffn_1"' in spec
    at.selectbox(key="collapse_depth").set_value(1).run()
    assert at.multiselect(key="collapsed").value == ["ffn"]
    button(at, "Expand all").click().run()
    assert at.multiselect(key="collapsed").value == [] and '"ffn_1"' in at.get("plotly_chart")[0].proto.spec
    at.text_input(key="search").set_value("ffn").run()
    button(at, "Select 3 hits").click().run()
    assert at.multiselect(key="selection").value == ["ffn_0", "ffn_1", "ffn_2"]


def test_graphviz_view(at):
    at.toggle(key="show_dot").set_value(True).run()
    dot = at.get("graphviz_chart")[0].proto.spec
    assert "cluster_s1" in dot and "rankdir=TB" in dot


# -- Model page -------------------------------------------------------------------------------


def model_page(at: AppTest) -> AppTest:
    return at.switch_page("views/model.py").run()


def upload_model(at: AppTest, name: str, content: bytes) -> None:
    at.file_uploader(key="model_upload").upload(name, content, "text/x-python")
    at.run()
    button(at, "Load uploaded model").click().run()


def test_open_another_sample(at):
    model_page(at)
    table = at.dataframe[0].value
    assert len(table) == 29 and not table.set_index("node").loc["scaled_dot_product_attention", "batchable"]
    at.selectbox(key="sample_choice").set_value(str(SAMPLES / "data_dependent.py"))
    at.number_input(key="n_new").set_value(4)
    button(at, "Open sample").click().run()
    p = plan_of(at)
    assert p.model == "data_dependent.py" and p.n_members == 4 and len(p.stages) == 5


def test_upload_a_model_file(at):
    model_page(at)
    upload_model(at, "my_mlp.py", (SAMPLES / "mlp.py").read_bytes())
    assert not at.error, texts(at.error)
    p = plan_of(at)
    assert p.model == "my_mlp.py" and len(p.stages) == 1
    assert at.session_state["model_ref"].label == "my_mlp.py"


@pytest.mark.parametrize("content, message", [
    (b"def build_model(:\n", "syntax error at line 1"),
    (b"import torch\ndef example_inputs():\n    return (torch.randn(2),)\n", "build_model"),
])
def test_broken_upload_shows_error_and_keeps_previous_plan(at, content, message):
    before, ref = plan_of(at), at.session_state["model_ref"]
    model_page(at)
    upload_model(at, "broken.py", content)
    assert message in texts(at.error)
    assert plan_of(at) == before and at.session_state["model_ref"] == ref


def test_weights_that_do_not_fit_are_refused(at, tmp_path):
    import torch
    from safetensors.torch import save_file

    before = plan_of(at)
    bad = tmp_path / "member_0.safetensors"
    save_file({"fc1.weight": torch.zeros(3, 3)}, str(bad))
    model_page(at)
    at.file_uploader(key="model_upload").upload("mlp.py", (SAMPLES / "mlp.py").read_bytes(), "text/x-python")
    at.file_uploader(key="weights_upload").upload("member_0.safetensors", bad.read_bytes(), "application/octet-stream")
    at.run()
    button(at, "Load uploaded model").click().run()
    assert "member_0.safetensors" in texts(at.error)
    assert plan_of(at) == before


def test_weights_set_n_to_the_number_of_files(at, tmp_path):
    import importlib.util

    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("mlp_sample", SAMPLES / "mlp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model_page(at)
    at.file_uploader(key="model_upload").upload("mlp.py", (SAMPLES / "mlp.py").read_bytes(), "text/x-python")
    uploader = at.file_uploader(key="weights_upload")
    for i in range(3):
        path = tmp_path / f"member_{i}.safetensors"
        save_file({k: v.contiguous() for k, v in mod.build_model().state_dict().items()}, str(path))
        uploader.upload(path.name, path.read_bytes(), "application/octet-stream")
    at.run()
    button(at, "Load uploaded model").click().run()
    assert not at.error, texts(at.error)
    assert plan_of(at).n_members == 3 and len(at.session_state["model_ref"].weights) == 3


def test_upload_a_pt2_export_archive(at, tmp_path):
    import torch

    src = planner.load_source(SAMPLES / "mlp.py")
    archive = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(src.model, src.example_inputs), str(archive))
    model_page(at)
    at.file_uploader(key="model_upload").upload("mlp.pt2", archive.read_bytes(), "application/octet-stream")
    at.run()
    button(at, "Load uploaded model").click().run()
    assert not at.error, texts(at.error)
    assert plan_of(at).model == "mlp.pt2" and len(plan_of(at).stages) == 1


def test_n_and_input_mode_are_undoable_edits(at):
    model_page(at)
    at.number_input(key="n_current").set_value(4).run()
    assert plan_of(at).n_members == 4
    at.radio(key="input_mode_x").set_value("per_member").run()
    assert plan_of(at).input_mode("x").value == "per_member"
    at.switch_page("views/plan.py").run()
    button(at, "Undo").click().run()
    assert plan_of(at).input_mode("x").value == "shared" and plan_of(at).n_members == 4


def test_precision_and_whole_plan_capture_are_undoable_edits_shown_on_the_plan_page(at):
    model_page(at)
    at.selectbox(key="plan_dtype").set_value("bfloat16").run()
    at.checkbox(key="plan_capture").check().run()
    assert plan_of(at).dtype == "bfloat16" and plan_of(at).capture
    at.switch_page("views/plan.py").run()
    assert any("precision bfloat16 · whole-plan capture on GPU" in m.value for m in at.markdown)
    button(at, "Undo").click().run()
    assert plan_of(at).dtype == "bfloat16" and not plan_of(at).capture
    button(at, "Undo").click().run()
    assert plan_of(at).dtype == "float32"


# -- Export, autosave, Profile ----------------------------------------------------------------


class _KeptStorage:
    """Wraps AppTest's in-memory media storage and keeps every instance, so downloads can be read after a run."""

    instances: list = []

    def __new__(cls, *args, **kwargs):
        from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage

        storage = MemoryMediaFileStorage(*args, **kwargs)
        cls.instances.append(storage)
        return storage


def download_bytes(url: str) -> bytes:
    name = url.rsplit("/", 1)[-1]
    for storage in reversed(_KeptStorage.instances):
        try:
            return storage.get_file(name).content
        except Exception:  # MediaFileStorageError: not in this run's storage, try the previous one
            continue
    raise AssertionError(f"download {url} not found")


def test_export_json_equals_the_session_plan(at, monkeypatch):
    import streamlit.testing.v1.app_test as app_test_module

    monkeypatch.setattr(app_test_module, "MemoryMediaFileStorage", _KeptStorage)
    select(at, "s0", "s1")
    button(at, "Merge").click().run()
    at.switch_page("views/export.py").run()
    assert not at.exception
    p = plan_of(at)
    buttons = {b.label: b for b in at.get("download_button")}
    assert "Download .dot" in buttons
    downloaded = download_bytes(buttons["Download plan JSON"].proto.url).decode()
    assert downloaded == p.dumps()
    assert planner.Plan.loads(downloaded).to_json() == p.to_json()
    from stagewise import executor  # the downloaded plan is one executor.build accepts

    src = planner.load_source(SAMPLES / "transformer_block.py")
    loaded = planner.Plan.loads(downloaded)
    out = executor.build(loaded, src.members(loaded.n_members))(*src.example_inputs)
    assert out.shape[0] == loaded.n_members
    shown = [c.value for c in at.code if c.language == "json"]
    assert shown == [p.dumps().rstrip("\n")]
    snippet = next(c.value for c in at.code if c.language == "python")
    assert "executor.build(plan, src.members(plan.n_members))" in snippet


def test_import_plan_json(at, tmp_path):
    src = planner.load_source(SAMPLES / "transformer_block.py")
    g = planner.trace(src.model, src.example_inputs)
    wanted = planner.merge(planner.propose(g, 8), g, "s1", "s2")
    at.switch_page("views/export.py").run()
    at.file_uploader(key="plan_upload").upload("p.json", wanted.dumps().encode(), "application/json")
    at.run()
    button(at, "Import plan").click().run()
    assert plan_of(at).stages == wanted.stages


def test_broken_start_model_shows_error_and_pages_still_work(tmp_path, monkeypatch):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    at = app_test(monkeypatch, tmp_path, broken).run()
    assert not at.exception and "boom at import" in texts(at.error)
    assert "No model is loaded" in texts(at.info)
    at.switch_page("views/model.py").run()
    assert at.selectbox(key="sample_choice").value.endswith(".py")
    button(at, "Open sample").click().run()
    assert plan_of(at) is not None


def test_restore_from_autosave(tmp_path, monkeypatch):
    src = planner.load_source(SAMPLES / "transformer_block.py")
    g = planner.trace(src.model, src.example_inputs)
    edited = planner.merge(planner.propose(g, 8, model="transformer_block.py"), g, "s0", "s1")
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py")  # opens on another model
    autosave.save(edited, str(SAMPLES / "transformer_block.py"))
    at.run()
    assert "An autosaved plan exists" in texts(at.info)
    assert plan_of(at).model == "mlp.py"
    at.button(key="restore_autosave").click().run()
    assert plan_of(at).stages == edited.stages
    assert not any("autosaved plan exists" in t for t in texts(at.info).splitlines())
    button(at, "Undo").click().run()  # back to the proposed plan of that model
    assert len(plan_of(at).stages) == 3


def test_profile_page_runs_verify_in_a_worker(at):
    at.switch_page("views/profile.py").run()
    assert not at.exception
    from stagewise import executor

    if not hasattr(executor, "profile"):
        assert "not available yet" in texts(at.warning)
    button(at, "Verify vs loop").click().run()
    assert at.session_state["job"] is not None
    deadline = time.time() + 120
    while at.session_state["job"] is not None and "job" in at.session_state and time.time() < deadline:
        time.sleep(1)
        at.run()
        if "job" not in at.session_state:
            break
    assert "verify_result" in at.session_state, texts(at.error)
    assert "MATCH" in texts(at.success)


def _wait_for_job(at: AppTest, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while "job" in at.session_state and at.session_state["job"] is not None and time.time() < deadline:
        time.sleep(1)
        at.run()


def test_profile_attaches_report_to_plan_and_export(at):
    at.switch_page("views/model.py").run()
    at.number_input(key="n_current").set_value(2).run()
    at.switch_page("views/profile.py").run()
    at.text_input(key="sweep_ns").set_value("1, 2")  # includes the plan's N=2, whose report is attached
    button(at, "Profile").click().run()
    _wait_for_job(at)
    assert not at.exception and not at.error, texts(at.error)
    p = plan_of(at)
    assert p.profile is not None and p.profile["n_members"] == 2
    labels = [m.label for m in at.metric]
    assert "stagewise ms" in labels and "speedup vs loop" in labels
    assert len(at.session_state["profile_result"]) == 2  # the sweep
    at.switch_page("views/export.py").run()
    shown = [c.value for c in at.code if c.language == "json"][0]
    assert '"profile": {' in shown
    at.switch_page("views/plan.py").run()
    table = next(d.value for d in at.dataframe if "last ms" in d.value.columns)
    assert table["last ms"].notna().all()  # measured time in the stage table
    at.toggle(key="color_by_time").set_value(True).run()
    assert "stage ms" in at.get("plotly_chart")[0].proto.spec


def test_cancel_a_running_profile(at):
    at.switch_page("views/profile.py").run()
    button(at, "Verify vs loop").click().run()
    assert at.session_state["job"] is not None
    job = at.session_state["job"]
    button(at, "Cancel").click().run()
    assert "job" not in at.session_state or at.session_state["job"] is None
    assert "verify cancelled" in texts(at.info)
    assert not job.path.exists() and len(plan_of(at).stages) == 3


# -- the app shows and applies the truth (issue 10: adopt, overlay, warnings, colours) ----------------


def _tuned_report(at: AppTest, n: int, strategy: str) -> dict:
    """A report as the worker returns it for an autotuned profile at N=n: the whole model one excluded stage run `strategy`."""
    p = plan_of(at)
    nodes = tuple(x for s in p.stages for x in s.nodes)
    tuned = p.with_n_members(n).with_stages([planner.Stage("s0", nodes, planner.StageMode.EXCLUDED, reason="merged",
                                                           options=planner.StageOptions(strategy=planner.Strategy(strategy)))])
    ok = {"ok": True, "time": {"median_ms": float(n)}, "strategy": strategy}
    report = {"n_members": n, "device": "cpu", "device_name": "cpu", "autotuned": True, "plan": tuned.to_json(),
              "stages": [{"id": "s0", "mode": "excluded", "strategy": strategy, "result": ok, "loop": ok}],
              "end_to_end": ok, "baselines": [dict(ok, strategy="loop")]}
    return {"n": n, "report": report, "text": f"N={n}"}


def test_adopt_applies_the_report_on_screen_with_its_profile(at):
    at.session_state["profile_result"] = [_tuned_report(at, 2, "wide"), _tuned_report(at, 8, "compile"),
                                           _tuned_report(at, 16, "wide")]
    at.switch_page("views/profile.py").run()
    assert at.radio(key="shown_n").value == 8  # the plan's N is shown first
    assert any("N = 8" in s.value for s in at.subheader)
    button(at, "Adopt the autotuned plan for N = 8").click().run()
    p = plan_of(at)
    assert p.n_members == 8 and p.stages[0].options.strategy.value == "compile"
    assert p.profile is not None and p.profile["n_members"] == 8  # the report stays with the plan
    at.switch_page("views/plan.py").run()
    assert "1 stage (1 batched, 0 member loops; 1 excluded from vmap)" in texts(at.markdown)
    table = next(d.value for d in at.dataframe if "last ms" in d.value.columns)
    assert table["runs as"].tolist() == ["batched (compile)"]
    assert table["last ms"].tolist() == ["8"]
    at.switch_page("views/export.py").run()
    assert '"profile": {' in [c.value for c in at.code if c.language == "json"][0]
    at.switch_page("views/profile.py").run()
    at.radio(key="shown_n").set_value(16).run()
    button(at, "Adopt the autotuned plan for N = 16").click().run()
    assert plan_of(at).n_members == 16 and plan_of(at).profile["n_members"] == 16


def test_the_profile_page_says_how_a_captured_plan_replayed(at):
    result = _tuned_report(at, 8, "wide")
    result["report"]["capture"] = [{"stages": ["s0"], "mode": "graph", "reason": ""}]
    at.session_state["profile_result"] = [result]
    at.switch_page("views/profile.py").run()
    assert "Whole-plan capture: one CUDA graph (s0)" in texts(at.caption)


def test_time_overlay_marks_stages_the_report_did_not_measure(at):
    at.session_state["profile_result"] = [_tuned_report(at, 8, "wide")]  # measured one merged stage, not these three
    at.switch_page("views/profile.py").run()
    assert "not measured as they are" in texts(at.caption)
    spec = at.get("plotly_chart")[-1].proto.spec
    assert "s0: not measured" in spec and "s0: 8 ms" not in spec


def test_merge_into_a_loop_warns_first_and_cancel_keeps_the_plan(at):
    before = plan_of(at)
    select(at, "s0", "s1")
    button(at, "Merge").click().run()
    assert plan_of(at) == before  # not applied yet
    # s0's nodes and s1's attention (batched, wide) would all run as a loop
    assert f"turns {len(before.stage('s0').nodes) + 1} batched nodes into a member loop" in texts(at.warning)
    at.button(key="pending_cancel").click().run()
    assert plan_of(at) == before and "pending_edit" not in at.session_state
    select(at, "s0", "s1")
    button(at, "Merge").click().run()
    at.button(key="pending_apply").click().run()
    assert len(plan_of(at).stages) == 2


def test_exclude_then_include_a_node_restores_the_stage(at):
    before = plan_of(at)
    select(at, "proj")
    at.radio(key="edit_scope").set_value("selected nodes only").run()
    select(at, "proj")
    button(at, "Exclude").click().run()
    assert len(plan_of(at).stages) > len(before.stages)
    select(at, "proj")
    button(at, "Include").click().run()
    assert plan_of(at).stages == before.stages


def test_dismissed_autosave_is_not_offered_again(tmp_path, monkeypatch):
    src = planner.load_source(SAMPLES / "transformer_block.py")
    g = planner.trace(src.model, src.example_inputs)
    edited = planner.merge(planner.propose(g, 8, model="transformer_block.py"), g, "s0", "s1")
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py")
    autosave.save(edited, str(SAMPLES / "transformer_block.py"))
    at.run()
    at.button(key="dismiss_autosave").click().run()
    again = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()  # a reload: a new session
    assert not any("autosaved plan exists" in t for t in texts(again.info).splitlines())


def test_the_autotune_budget_goes_to_the_job(at, monkeypatch):
    from stagewise.app import jobs

    seen = {}

    def fake_start(task, *args, **kwargs):
        seen.update(kwargs, task=task)
        raise jobs.JobError("not started in this test")

    monkeypatch.setattr(jobs, "start", fake_start)
    at.switch_page("views/profile.py").run()
    assert at.selectbox(key="budget").disabled  # only autotune has a budget
    at.checkbox(key="autotune").check().run()
    at.selectbox(key="budget").set_value("quick").run()
    button(at, "Profile").click().run()
    assert seen["task"] == "profile" and seen["autotune"] is True and seen["budget"] == "quick"
