"""Hand-edited plan files from a review: misspelled keys, a vmap strategy on an excluded stage, a byte order
mark; and exclude() of an excluded stage that runs batched (wide).

A misspelled key used to be ignored and its default used: the module built from the file silently
differed from what the file asked for. Every plan file this project wrote before (tests/golden, at
every commit) must keep loading.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stagewise import executor, planner
from stagewise.planner import PlanFileError
from stagewise.planner.plan import Plan, Strategy

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlp_plan_json(sample) -> dict:
    _, g = sample("mlp")
    return planner.propose(g, 2).to_json()


def loop_of(members, inputs) -> torch.Tensor:
    """Plain torch: each member on the (shared) inputs, one after another, stacked."""
    with torch.no_grad():
        return torch.stack([m(*inputs) for m in members])


MISSPELLED = {
    'options "stratgy"': (lambda d: d["stages"][0]["options"].__setitem__("stratgy", "loop"),
                          r"plan: stages\[0\] \('s0'\) options: unknown key 'stratgy' \(did you mean 'strategy'\?\)"),
    'stage "option"': (lambda d: d["stages"][0].__setitem__("option", {"strategy": "loop"}),
                       r"plan: stages\[0\] \('s0'\): unknown key 'option' \(did you mean 'options'\?\)"),
    'top "dtyp"': (lambda d: d.__setitem__("dtyp", "bfloat16"), r"plan: unknown key 'dtyp' \(did you mean 'dtype'\?\)"),
    'top "capture "': (lambda d: d.__setitem__("capture ", True), r"plan: unknown key 'capture ' \(did you mean 'capture'\?\)"),
    'options "chunksize"': (lambda d: d["stages"][0]["options"].__setitem__("chunksize", 2),
                            r"stages\[0\] \('s0'\) options: unknown key 'chunksize' \(did you mean 'chunk_size'\?\)"),
    'input "dtype" floatt32': (lambda d: d["inputs"][0].__setitem__("dtype", "floatt32"),
                               r"input 'x': dtype 'floatt32' is not a torch dtype; did you mean 'float32'\?"),
    'input "shap"': (lambda d: d["inputs"][0].__setitem__("shap", [1]), r"input 'x': unknown key 'shap' \(did you mean 'shape'\?\)"),
    'dynamic dim "maxx"': (lambda d: d["inputs"][0]["dynamic_dims"][0].__setitem__("maxx", 4),
                           r"input 'x': a dynamic_dims entry: unknown key 'maxx' \(did you mean 'max'\?\)"),
}


@pytest.mark.parametrize("case", sorted(MISSPELLED))
def test_a_misspelled_key_is_refused_with_did_you_mean(sample, case):
    """Before: each of these loaded, and the module ran vmap / float32 / no chunks whatever the file said."""
    edit, message = MISSPELLED[case]
    d = mlp_plan_json(sample)
    edit(d)
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(d)
    with pytest.raises(PlanFileError, match="p.json: " + message.removeprefix("plan: ")):  # the file is named
        Plan.loads(json.dumps(d), source="p.json")


def test_correctly_spelled_keys_do_what_they_say_and_match_the_loop(sample):
    """The same edits spelled right: loop strategy and a chunk size load, and the module matches the member loop."""
    src, _ = sample("mlp")
    d = mlp_plan_json(sample)
    d["stages"][0]["options"].update(strategy="loop", chunk_size=2)
    plan = Plan.from_json(d)
    assert plan.stages[0].options.strategy is Strategy.LOOP and plan.stages[0].options.chunk_size == 2
    members = src.members(2)
    with torch.no_grad():
        got = executor.build(plan, members)(*src.example_inputs)
    torch.testing.assert_close(got, loop_of(members, src.example_inputs), rtol=1e-6, atol=1e-6)


def test_a_non_tensor_input_keeps_its_python_type_name():
    d = {"schema_version": 1, "fingerprint": "f", "tracer": "export", "n_members": 2,
         "inputs": [{"name": "n", "mode": "shared", "shape": None, "dtype": "int", "dynamic_dims": [], "value": 3}],
         "stages": [{"id": "s0", "nodes": ["a"]}]}
    assert Plan.from_json(d).inputs[0].dtype == "int"


@pytest.mark.parametrize("path", sorted(GOLDEN_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_golden_plan_still_loads_and_reads_the_same(path):
    text = path.read_text()
    assert Plan.loads(text, source=str(path)).dumps() == text


def _old_form(path: Path) -> dict:
    """The file as stagewise wrote it before 2026-11-21 (tests/golden at 4e8e2a6): inputs with name and mode
    only, excluded stages with the default options {"strategy": "vmap", "chunk_size": null, "note": ""}."""
    d = json.loads(path.read_text())
    d["inputs"] = [{"mode": i["mode"], "name": i["name"]} for i in d["inputs"]]
    for s in d["stages"]:
        if s["mode"] == "excluded":
            s["options"] = {"strategy": "vmap", "chunk_size": None, "note": ""}
    return d


def test_the_old_written_form_of_an_excluded_stage_still_loads_as_the_loop(sample):
    src, graph = sample("data_dependent")
    plan = planner.validate(Plan.from_json(_old_form(GOLDEN_DIR / "data_dependent.json")), graph)
    excluded = [s for s in plan.stages if s.mode.value == "excluded"]
    assert excluded and all(s.runs_as() == "member loop" for s in excluded)
    members = src.members(plan.n_members)
    with torch.no_grad():
        got = executor.build(plan, members)(*src.example_inputs)
    torch.testing.assert_close(got, loop_of(members, src.example_inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [
    {"strategy": "vmap"},  # hand-written: asks for vmap
    {"strategy": "vmap", "chunk_size": 2, "note": ""},
    {"strategy": "vmap", "chunk_size": None, "note": "I want vmap"},
    {"strategy": "cuda_graph", "chunk_size": None, "note": ""},
])
def test_vmap_on_an_excluded_stage_in_a_file_is_refused_as_set_options_refuses_it(options):
    """Before: Stage.__post_init__ quietly turned it into the loop; set_options refuses the same request."""
    d = json.loads((GOLDEN_DIR / "data_dependent.json").read_text())
    d["stages"][1]["options"] = options
    with pytest.raises(PlanFileError, match=r"p.json: stages\[1\] \('s1'\): the stage is excluded \(.*\), so it cannot "
                                            r"run under (vmap|cuda_graph); set its options' \"strategy\" to \"loop\""):
        Plan.loads(json.dumps(d), source="p.json")


def test_an_excluded_stage_without_a_strategy_is_the_loop():
    d = json.loads((GOLDEN_DIR / "data_dependent.json").read_text())
    del d["stages"][1]["options"]
    d["stages"][3]["options"] = {"note": "hand-written"}
    plan = Plan.from_json(d)
    assert plan.stages[1].runs_as() == plan.stages[3].runs_as() == "member loop"


def test_a_byte_order_mark_is_accepted(tmp_path, sample):
    """Before: 'p.json is not valid JSON (Unexpected UTF-8 BOM ...)' for a file saved by Notepad."""
    text = (GOLDEN_DIR / "mlp.json").read_text()
    want = Plan.loads(text)
    path = tmp_path / "p.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert Plan.load(path) == want
    assert Plan.loads("\ufeff" + text) == want
    assert Plan.loads(b"\xef\xbb\xbf" + text.encode()) == want


# -- exclude() of an excluded stage that runs batched (README: "exclude the stage by hand to make it the loop") --

def test_exclude_of_a_wide_excluded_stage_makes_it_the_loop_and_matches_torch(sample):
    """Before: EditError "stage s1 is already excluded", no fix named."""
    src, graph = sample("transformer_block")
    plan = planner.propose(graph, 3)
    s1 = plan.stage("s1")
    assert (s1.mode.value, s1.runs_as()) == ("excluded", "batched (wide)")
    for target in ("s1", "scaled_dot_product_attention"):
        out = planner.exclude(plan, graph, target)
        assert out.stage("s1").runs_as() == "member loop" and out.stage("s1").reason == s1.reason
        assert [s.nodes for s in out.stages] == [s.nodes for s in plan.stages]
    with pytest.raises(planner.EditError, match=r"stage s1 is already excluded and runs as the member loop"):
        planner.exclude(out, graph, "s1")
    members = src.members(3)
    with torch.no_grad():
        got = executor.build(out, members)(*src.example_inputs)
    torch.testing.assert_close(got, loop_of(members, src.example_inputs), rtol=1e-5, atol=1e-5)
