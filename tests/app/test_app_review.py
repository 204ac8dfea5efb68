"""App findings of a review: edited plans lost by opening another model, a profile report lost on reload,
a plan imported for another N than the loaded weight files, the Exclude button on a wide stage, and
messages naming command-line fixes inside the app.

Driven with streamlit's AppTest as a user would (app_fakes.app_test: the token set and presented).
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from stagewise import executor, planner
from stagewise.app import autosave
from app_fakes import app_test

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_models"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def plan_of(at) -> planner.Plan:
    return at.session_state["history"].present


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def button(at, label: str):
    matches = [b for b in at.button if b.label == label]
    assert matches, f"no button {label!r}; buttons: {[b.label for b in at.button]}"
    return matches[0]


def select(at, *items: str) -> None:
    at.multiselect(key="selection").set_value(list(items)).run()


def open_sample(at, name: str) -> None:
    at.switch_page("views/model.py").run()
    at.selectbox(key="sample_choice").set_value(str(SAMPLES / name))
    button(at, "Open sample").click().run()
    assert not at.exception and not at.error, texts(at.error)


def upload_model(at, name: str, content: bytes, weights: list[Path] = ()) -> None:
    at.switch_page("views/model.py").run()
    at.file_uploader(key="model_upload").upload(name, content, "text/x-python")
    up = at.file_uploader(key="weights_upload")
    for w in weights:
        up.upload(w.name, w.read_bytes(), "application/octet-stream")
    at.run()
    button(at, "Load uploaded model").click().run()


def matches_the_member_loop(plan: planner.Plan, model_file: Path) -> None:
    """The plan's batched module against plain torch: each member called on its own, stacked (float32)."""
    src = planner.load_source(model_file)
    members = src.members(plan.n_members)
    with torch.no_grad():
        got = executor.build(plan, members)(*executor.batched_inputs(plan, src.example_inputs))
        want = torch.stack([m(*src.example_inputs) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- 1. opening another model never throws the edited plan away ------------------------------------------------


def test_opening_another_model_keeps_the_edited_plan_and_offers_it_back(tmp_path, monkeypatch):
    """Before: opening deep_mlp overwrote the autosave of the edited mlp plan at once (autosave: deep_mlp, 1 stage)."""
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    select(at, "act")
    button(at, "Split").click().run()
    edited = plan_of(at)
    assert len(edited.stages) == 2 and autosave.load().plan == edited

    open_sample(at, "deep_mlp.py")
    assert plan_of(at).model == "deep_mlp.py"
    rec = autosave.load()
    assert (Path(rec.model_path).name, rec.plan) == ("mlp.py", edited)  # not overwritten by the fresh proposal

    again = app_test(monkeypatch, tmp_path, SAMPLES / "deep_mlp.py").run()  # a reload offers the edited plan
    assert "An autosaved plan exists: mlp.py, 2 stages" in texts(again.info)

    # the first edit of the new model takes the latest place; the mlp plan is kept beside it
    at.number_input(key="n_current").set_value(3).run()
    assert Path(autosave.load().model_path).name == "deep_mlp.py" and autosave.load().plan.n_members == 3
    assert autosave.saved_for(edited.fingerprint).plan == edited

    open_sample(at, "mlp.py")  # opened again: its edited plan is offered for it
    assert "An autosaved plan exists for this model: mlp.py, 2 stages" in texts(at.info)
    assert autosave.load().plan.n_members == 3  # the deep_mlp edit is not overwritten by mlp's proposal either
    at.button(key="restore_autosave").click().run()
    assert plan_of(at) == edited and not at.error
    matches_the_member_loop(plan_of(at), SAMPLES / "mlp.py")
    at.switch_page("views/plan.py").run()
    button(at, "Undo").click().run()  # one undoable step on the proposed plan
    assert len(plan_of(at).stages) == 1 and autosave.load().plan == plan_of(at)
    deep = planner.trace(*_model_and_inputs(SAMPLES / "deep_mlp.py"))
    assert autosave.saved_for(deep.fingerprint).plan.n_members == 3  # the deep_mlp edit is still kept


def _model_and_inputs(path: Path):
    src = planner.load_source(path)
    return src.model, src.example_inputs


def test_the_restore_advice_for_a_moved_model_does_not_destroy_the_autosave(tmp_path, monkeypatch):
    """Before: following 'open or upload the model again' overwrote the edited autosave with the new proposal."""
    mine = tmp_path / "my_block.py"
    shutil.copy(SAMPLES / "transformer_block.py", mine)
    at = app_test(monkeypatch, tmp_path, mine).run()
    select(at, "s0", "s1")
    button(at, "Merge").click().run()
    at.button(key="pending_apply").click().run()
    edited = plan_of(at)
    assert len(edited.stages) == 2

    moved = tmp_path / "models"
    moved.mkdir()
    shutil.move(str(mine), moved / "my_block.py")  # the user reorganises the folder
    again = app_test(monkeypatch, tmp_path, None).run()  # a reload opens the default sample
    again.button(key="restore_autosave").click().run()
    assert "is gone" in texts(again.error) and "the autosave keeps it" in texts(again.error)

    upload_model(again, "my_block.py", (moved / "my_block.py").read_bytes())  # follow the advice
    assert len(plan_of(again).stages) == 3  # the fresh proposal of the uploaded copy
    assert autosave.load().plan.stages == edited.stages  # the autosave still holds the edited plan
    assert "An autosaved plan exists for this model: my_block.py, 2 stages" in texts(again.info)
    again.button(key="restore_autosave").click().run()
    assert not again.error, texts(again.error)
    assert plan_of(again).stages == edited.stages
    assert again.session_state["model_ref"].path != str(mine)  # onto the upload, where the model is now
    matches_the_member_loop(plan_of(again), moved / "my_block.py")


def test_dismissing_the_offer_for_a_reopened_model_keeps_the_plan_in_the_file(tmp_path, monkeypatch):
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    at.switch_page("views/model.py").run()
    at.number_input(key="n_current").set_value(3).run()
    edited = plan_of(at)
    open_sample(at, "deep_mlp.py")
    open_sample(at, "mlp.py")
    at.button(key="dismiss_autosave").click().run()
    open_sample(at, "deep_mlp.py")
    open_sample(at, "mlp.py")
    assert "autosaved plan exists" not in texts(at.info)  # not offered again
    assert "dismissed" in autosave.autosave_path().read_text() and edited.fingerprint in autosave.autosave_path().read_text()


# -- 2. the profile report of an unedited plan survives a reload ---------------------------------------------------


FAKE_REPORT = {"n_members": 8, "device": "cpu", "device_name": "cpu",
               "stages": [{"id": "s0", "mode": "batched", "strategy": "vmap", "result": {"ok": True, "time": {"median_ms": 1.5}},
                           "loop": {"ok": True, "time": {"median_ms": 3.0}}}],
               "end_to_end": {"ok": True, "time": {"median_ms": 1.6}},
               "baselines": [{"strategy": "loop", "ok": True, "time": {"median_ms": 3.1}}]}


def test_a_profile_report_of_the_unedited_plan_is_attached_after_a_reload(tmp_path, monkeypatch):
    """Before: the reload dropped the offer (stages equal) and with it the report: 'No profile yet'."""
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    profiled = plan_of(at).with_profile(FAKE_REPORT)
    autosave.save(profiled, str(SAMPLES / "mlp.py"))  # what the Profile page saves after attaching a report
    again = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    assert plan_of(again) == profiled and not again.session_state["autosave_offer"]
    assert "autosaved plan exists" not in texts(again.info)
    again.switch_page("views/profile.py").run()
    assert "No profile yet" not in texts(again.info)
    # opened again in the session (from another model): the report comes back too
    open_sample(again, "deep_mlp.py")
    open_sample(again, "mlp.py")
    assert plan_of(again) == profiled


# -- 3. an imported plan's N must match the loaded weight files --------------------------------------------------


def test_importing_a_plan_for_another_n_than_the_weight_files_is_refused(tmp_path, monkeypatch):
    """Before: an N=8 plan was imported over 3 weight files (model page then showed N=8 for 3 members)."""
    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("mlp_for_weights", SAMPLES / "mlp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    weights = []
    for i in range(3):
        torch.manual_seed(i)
        path = tmp_path / f"member_{i}.safetensors"
        save_file({k: v.contiguous() for k, v in mod.build_model().state_dict().items()}, str(path))
        weights.append(path)
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    upload_model(at, "mlp.py", (SAMPLES / "mlp.py").read_bytes(), weights)
    assert plan_of(at).n_members == 3, texts(at.error)
    before = plan_of(at)

    src = planner.load_source(SAMPLES / "mlp.py")
    graph = planner.trace(src.model, src.example_inputs)
    at.switch_page("views/export.py").run()
    at.file_uploader(key="plan_upload").upload("n8.json", planner.propose(graph, 8).dumps().encode(), "application/json")
    at.run()
    button(at, "Import plan").click().run()
    assert plan_of(at) == before
    assert "the plan is for N=8 members, but 3 weight files are loaded" in texts(at.error)
    assert "on the Model page" in texts(at.error)

    at.file_uploader(key="plan_upload").upload("n3.json", planner.split(planner.propose(graph, 3), graph, "s0", at="act")
                                               .dumps().encode(), "application/json")
    at.run()
    button(at, "Import plan").click().run()  # the same N: imported
    assert not at.error and len(plan_of(at).stages) == 2 and plan_of(at).n_members == 3


# -- 5. Exclude on a stage that runs wide --------------------------------------------------------------------------


@pytest.mark.parametrize("scope, pick", [("whole stages", "s1"), ("selected nodes only", "scaled_dot_product_attention")])
def test_the_exclude_button_makes_a_wide_excluded_stage_the_loop(tmp_path, monkeypatch, scope, pick):
    """Before: 'exclude: ... stage s1 is already excluded' (whole stages) or 'is excluded already' (nodes), no fix."""
    at = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    assert plan_of(at).stage("s1").runs_as() == "batched (wide)"
    at.radio(key="edit_scope").set_value(scope).run()
    select(at, pick)
    button(at, "Exclude").click().run()
    assert not at.error, texts(at.error)
    assert plan_of(at).stage("s1").runs_as() == "member loop" and plan_of(at).stage("s1").mode.value == "excluded"
    matches_the_member_loop(plan_of(at), SAMPLES / "transformer_block.py")
    select(at, pick)
    button(at, "Exclude").click().run()  # now it is the loop: said, with the app's way back
    assert "excluded already and run as the member loop; Include batches a stage again" in texts(at.error)


# -- 6. app messages name app actions -------------------------------------------------------------------------------


def test_importing_another_models_plan_names_the_model_page(tmp_path, monkeypatch):
    """Before: '... the plan was made for another model or architecture; re-plan with `stagewise plan`'."""
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    src = planner.load_source(SAMPLES / "deep_mlp.py")
    other = planner.propose(planner.trace(src.model, src.example_inputs), 8, model="deep_mlp.py")
    at.switch_page("views/export.py").run()
    at.file_uploader(key="plan_upload").upload("deep.json", other.dumps().encode(), "application/json")
    at.run()
    button(at, "Import plan").click().run()
    error = texts(at.error)
    assert "made for another model or architecture (deep_mlp.py)" in error
    assert "open that model on the Model page" in error and "stagewise plan" not in error
