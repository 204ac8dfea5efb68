"""Plan, Stage and StageOptions: frozen types, JSON round trip, and bad plan files."""
from __future__ import annotations

import dataclasses
import json

import pytest

from stagewise import planner
from stagewise.planner.plan import DynamicDim
from stagewise.planner import InputMode, InputSpec, Plan, PlanFileError, PlanMismatchError, Stage, StageMode, StageOptions, Strategy
from conftest import SAMPLE_NAMES


def small_plan(**kw) -> Plan:
    base = dict(
        fingerprint="0123456789abcdef",
        tracer="fx",
        n_members=4,
        inputs=(InputSpec("x", InputMode.PER_MEMBER), InputSpec("y")),
        stages=(
            Stage("s0", ("fc1", "relu"), options=StageOptions(chunk_size=2, note="tuned")),
            Stage("s1", ("item",), StageMode.EXCLUDED, reason="data-dependent", options=StageOptions(Strategy.LOOP)),
            Stage("s2", ("fc2",), options=StageOptions(Strategy.COMPILE)),
        ),
        model="sample_models/mlp.py",
    )
    base.update(kw)
    return Plan(**base)


def plan_dict(**changes) -> dict:
    d = small_plan().to_json()
    d.update(changes)
    return d


# --- round trips -----------------------------------------------------------------

def test_round_trip_keeps_every_field():
    plan = small_plan(profile={"stages": [{"id": "s0", "ms": 1.5}]})
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert again.stages[0].options == StageOptions(chunk_size=2, note="tuned")
    assert again.stages[1].mode is StageMode.EXCLUDED and again.stages[1].reason == "data-dependent"
    assert again.inputs[0].mode is InputMode.PER_MEMBER and again.inputs[1].mode is InputMode.SHARED
    assert again.profile == {"stages": [{"id": "s0", "ms": 1.5}]}


@pytest.mark.parametrize("name", SAMPLE_NAMES)
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_round_trip_of_proposed_plans(sample, name, mode):
    _, graph = sample(name)
    plan = planner.propose(graph, n_members=3, input_mode=mode, model=name)
    assert Plan.loads(plan.dumps()) == plan
    assert Plan.from_json(plan.to_json()) == plan


def test_dumps_is_canonical():
    plan = small_plan()
    text = plan.dumps()
    assert text.endswith("}\n")
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    assert list(json.loads(text)) == sorted(json.loads(text))
    assert json.loads(text)["schema_version"] == planner.SCHEMA_VERSION


def test_save_and_load(tmp_path):
    plan = small_plan()
    path = plan.save(tmp_path / "plan.json")
    assert path == tmp_path / "plan.json"
    assert Plan.load(path) == plan
    assert path.read_text() == plan.dumps()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temp file left behind


def test_save_replaces_existing_file(tmp_path):
    path = tmp_path / "plan.json"
    small_plan(n_members=2).save(path)
    small_plan(n_members=7).save(path)
    assert Plan.load(path).n_members == 7


# --- frozen values and functional updates -------------------------------------------

def test_plan_and_stage_are_frozen():
    plan = small_plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.n_members = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages[0].mode = StageMode.EXCLUDED
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages[0].options.chunk_size = 1


def test_with_n_members_keeps_stages_and_drops_profile():
    plan = small_plan(profile={"x": 1})
    other = plan.with_n_members(9)
    assert other.n_members == 9 and other.stages == plan.stages and other.profile is None
    assert plan.n_members == 4 and plan.profile == {"x": 1}


def test_with_input_modes():
    plan = small_plan()
    other = plan.with_input_modes({"y": "per_member"})
    assert other.input_mode("y") is InputMode.PER_MEMBER and other.input_mode("x") is InputMode.PER_MEMBER
    assert plan.input_mode("y") is InputMode.SHARED
    with pytest.raises(PlanMismatchError, match="unknown inputs.*'z'"):
        plan.with_input_modes({"z": "shared"})


@pytest.mark.parametrize("n", [0, -1, 2.0, "3", None])
def test_plan_refuses_bad_member_counts(n):
    with pytest.raises(planner.StagewiseError, match="n_members"):
        small_plan(n_members=n)


def test_lookups_name_what_is_known():
    plan = small_plan()
    assert plan.stage("s1").nodes == ("item",)
    assert plan.stage_of("fc2").id == "s2"
    with pytest.raises(PlanMismatchError, match="s9.*s0, s1, s2"):
        plan.stage("s9")
    with pytest.raises(PlanMismatchError, match="'nope'"):
        plan.stage_of("nope")
    with pytest.raises(PlanMismatchError, match="'z'"):
        plan.input_mode("z")


# --- bad plan files ----------------------------------------------------------------

def test_not_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"schema_version": 1,')
    with pytest.raises(PlanFileError, match="broken.json is not valid JSON"):
        Plan.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(PlanFileError, match="cannot read plan file .*nothere.json"):
        Plan.load(tmp_path / "nothere.json")


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_wrong_schema_version(version):
    d = plan_dict(schema_version=version)
    with pytest.raises(PlanFileError, match=f"schema_version is {version!r}.*version {planner.SCHEMA_VERSION}"):
        Plan.from_json(d, source="p.json")


def test_missing_schema_version():
    d = plan_dict()
    del d["schema_version"]
    with pytest.raises(PlanFileError, match="schema_version"):
        Plan.from_json(d)


@pytest.mark.parametrize("key", ["fingerprint", "tracer", "n_members", "inputs", "stages"])
def test_missing_keys(key):
    d = plan_dict()
    del d[key]
    with pytest.raises(PlanFileError, match=f"missing keys \\['{key}'\\]"):
        Plan.from_json(d)


@pytest.mark.parametrize("text", ["[]", "3", '"plan"', "null"])
def test_not_an_object(text):
    with pytest.raises(PlanFileError, match="expected a JSON object"):
        Plan.loads(text, source="p.json")


BAD_STAGES = {
    "unknown mode": ([{"id": "s0", "nodes": ["a"], "mode": "fast"}], "unknown mode 'fast'"),
    "empty nodes": ([{"id": "s0", "nodes": []}], "non-empty list"),
    "nodes not a list": ([{"id": "s0", "nodes": "a"}], "non-empty list"),
    "node not a string": ([{"id": "s0", "nodes": [1]}], "non-empty list"),
    "unknown strategy": ([{"id": "s0", "nodes": ["a"], "options": {"strategy": "magic"}}], "unknown strategy 'magic'"),
    "chunk zero": ([{"id": "s0", "nodes": ["a"], "options": {"chunk_size": 0}}], "chunk_size"),
    "chunk float": ([{"id": "s0", "nodes": ["a"], "options": {"chunk_size": 1.5}}], "chunk_size"),
    "chunk true": ([{"id": "s0", "nodes": ["a"], "options": {"chunk_size": True}}], "chunk_size must be a positive integer or null, got True"),
    "chunk false": ([{"id": "s0", "nodes": ["a"], "options": {"chunk_size": False}}], "chunk_size"),
    "chunk string": ([{"id": "s0", "nodes": ["a"], "options": {"chunk_size": "4"}}], "chunk_size"),
    "missing id": ([{"nodes": ["a"]}], "malformed"),
    "duplicate ids": ([{"id": "s0", "nodes": ["a"]}, {"id": "s0", "nodes": ["b"]}], "duplicate stage ids \\['s0'\\]"),
    "stage not an object": ([1], "must be a JSON object"),
    "stages not a list": ("s0", "must be JSON lists"),
    "options not an object": ([{"id": "s0", "nodes": ["a"], "options": "vmap"}], "options must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_STAGES))
def test_bad_stages(case):
    stages, message = BAD_STAGES[case]
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(plan_dict(stages=stages))


@pytest.mark.parametrize("inputs", [[{"mode": "shared"}], [{"name": "x", "mode": "sometimes"}], [3], "x"])
def test_bad_inputs(inputs):
    with pytest.raises(PlanFileError):
        Plan.from_json(plan_dict(inputs=inputs))


# --- input specs: what the trace assumed of each input --------------------------------------

def traced_inputs() -> tuple[InputSpec, ...]:
    return (
        InputSpec("ids", InputMode.PER_MEMBER, (2, 12), "int64", (DynamicDim(0, symbol="d0"), DynamicDim(1, min=3, max=64, symbol="d1"))),
        InputSpec("mask", InputMode.SHARED, (2, 12), "bool", (DynamicDim(0, symbol="d0"),)),
        InputSpec("n", InputMode.SHARED, None, "int"),
    )


def test_input_specs_round_trip():
    plan = small_plan(inputs=traced_inputs())
    again = Plan.loads(plan.dumps())
    assert again == plan
    entry = json.loads(plan.dumps())["inputs"][0]
    assert entry == {"name": "ids", "mode": "per_member", "shape": [2, 12], "dtype": "int64",
                     "dynamic_dims": [{"dim": 0, "symbol": "d0"}, {"dim": 1, "min": 3, "max": 64, "symbol": "d1"}]}


def test_plan_file_without_input_specs_loads():
    """A plan file written before input shapes were recorded (inputs hold only name and mode)."""
    text = json.dumps({"schema_version": 1, "fingerprint": "0123456789abcdef", "tracer": "export", "n_members": 2,
                       "inputs": [{"name": "x", "mode": "shared"}], "stages": [{"id": "s0", "nodes": ["fc"]}]})
    plan = Plan.loads(text)
    assert plan.inputs == (InputSpec("x"),)
    assert (plan.inputs[0].shape, plan.inputs[0].dtype, plan.inputs[0].dynamic_dims) == (None, None, ())
    assert json.loads(plan.dumps())["inputs"] == [{"name": "x", "mode": "shared"}]  # saved again as it was


def test_with_input_modes_keeps_the_traced_spec():
    plan = small_plan(inputs=traced_inputs()).with_input_modes({"mask": "per_member"})
    assert plan.inputs[1].mode is InputMode.PER_MEMBER and plan.inputs[1].shape == (2, 12) and plan.inputs[1].dtype == "bool"


BAD_SPECS = {
    "shape not a list": ({"shape": "2x12", "dtype": "int64"}, "shape must be a list"),
    "negative size": ({"shape": [2, -1], "dtype": "int64"}, "shape must be a list"),
    "dtype not a string": ({"shape": [2], "dtype": 64}, "dtype must be a string"),
    "dims not a list": ({"shape": [2], "dtype": "int64", "dynamic_dims": 0}, "dynamic_dims must be a list"),
    "dim not an object": ({"shape": [2], "dtype": "int64", "dynamic_dims": [0]}, "each dynamic_dims entry"),
    "dim outside shape": ({"shape": [2], "dtype": "int64", "dynamic_dims": [{"dim": 1}]}, "dynamic dim 1 is outside"),
    "bad max": ({"shape": [2], "dtype": "int64", "dynamic_dims": [{"dim": 0, "max": "big"}]}, "each dynamic_dims entry"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_input_specs(case):
    fields, message = BAD_SPECS[case]
    with pytest.raises(PlanFileError, match=f"input 'x': {message}"):
        Plan.from_json(plan_dict(inputs=[{"name": "x", "mode": "shared", **fields}]))


@pytest.mark.parametrize("n", [0, -2, 1.5, "8", None, True])
def test_bad_member_count_in_file(n):
    with pytest.raises(PlanFileError, match="n_members"):
        Plan.from_json(plan_dict(n_members=n))


def test_defaults_for_optional_stage_fields():
    d = plan_dict(stages=[{"id": "s0", "nodes": ["a", "b"]}])
    del d["model"], d["profile"]
    plan = Plan.from_json(d)
    assert plan.stages == (Stage("s0", ("a", "b")),)
    assert plan.stages[0].mode is StageMode.BATCHED and plan.stages[0].options == StageOptions()
    assert plan.model == "" and plan.profile is None


@pytest.mark.parametrize("profile", [[1], "fast", 3])
def test_profile_must_be_an_object(profile):
    with pytest.raises(PlanFileError, match="'profile' block is malformed \\(expected a JSON object or null"):
        Plan.from_json(plan_dict(profile=profile))


BAD_PROFILES = {
    "stages not a list": ({"stages": 5}, "'stages' and 'baselines' must be lists"),
    "baselines not a list": ({"baselines": {"loop": 1}}, "'stages' and 'baselines' must be lists"),
    "stage not an object": ({"stages": ["s0"]}, "stages\\[0\\] must be an object with a string 'id'"),
    "stage without id": ({"stages": [{"result": None}]}, "stages\\[0\\] must be an object with a string 'id'"),
    "result not an object": ({"stages": [{"id": "s0", "result": "fast"}]}, "stages\\[0\\].result must be an object or null"),
    "time not an object": ({"end_to_end": {"ok": True, "time": 3}}, "end_to_end.time must be an object or null"),
    "time not a number": ({"baselines": [{"ok": True, "time": {"median_ms": "1 ms"}}]}, "baselines\\[0\\].time.median_ms must be a number"),
    "candidates not a list": ({"stages": [{"id": "s0", "candidates": 1}]}, "stages\\[0\\].candidates must be a list"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_malformed_profile_block_names_the_file_and_the_problem(case):
    profile, message = BAD_PROFILES[case]
    with pytest.raises(PlanFileError, match="p.json: the 'profile' block is malformed .*" + message):
        Plan.loads(json.dumps(plan_dict(profile=profile)), source="p.json")


def test_a_real_profile_block_is_accepted():
    profile = {"stages": [{"id": "s0", "result": {"ok": True, "time": {"median_ms": 1.5, "repeats": 5}}, "loop": None,
                           "candidates": [{"ok": False, "time": None, "error": "oom"}]}],
               "end_to_end": {"ok": True, "time": {"median_ms": 2.0}}, "baselines": [{"strategy": "loop", "ok": True, "time": None}]}
    assert Plan.from_json(plan_dict(profile=profile)).profile == profile


def test_invalid_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(small_plan().dumps().replace('"fx"', '"f\xe9"').encode("latin-1"))
    with pytest.raises(PlanFileError, match=r"latin1.json is not UTF-8 text \(bad byte at offset \d+\)"):
        Plan.load(path)


def test_deep_nesting_names_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(PlanFileError, match="deep.json nests JSON too deeply"):
        Plan.load(path)
    with pytest.raises(PlanFileError, match="deep.json nests JSON too deeply"):
        Plan.loads('{"profile": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001, source="deep.json")


def test_save_into_a_missing_folder(tmp_path):
    with pytest.raises(PlanFileError, match="cannot write plan file .*nofolder.*check that the folder exists"):
        small_plan().save(tmp_path / "nofolder" / "plan.json")
