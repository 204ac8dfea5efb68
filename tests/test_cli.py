"""The `stagewise` CLI: plan / run / show, and one-line errors with exit code 2.

Most tests call app.cli.main(argv) in-process (fast); one runs the installed
console script in a subprocess to check the entry point and that no traceback leaks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagewise import executor
from stagewise import planner
from stagewise.app import cli
from conftest import ROOT, TINY_MODEL

MLP = str(ROOT / "sample_models" / "mlp.py")
DEEP = str(ROOT / "sample_models" / "deep_mlp.py")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, command: str, *words: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"stagewise {command}: error: "), lines[0]
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


@pytest.fixture
def mlp_plan(tmp_path, capsys) -> Path:
    path = tmp_path / "plan.json"
    code, _, _ = run_cli(capsys, "plan", MLP, "-n", "3", "-o", path)
    assert code == 0
    return path


def test_plan_prints_the_table_and_writes_json(tmp_path, capsys, sample):
    path = tmp_path / "dd.json"
    code, out, err = run_cli(capsys, "plan", ROOT / "sample_models" / "data_dependent.py", "-n", "4", "-o", path)
    assert code == 0 and err == ""
    assert "5 stages (3 batched, 2 member loops; 2 excluded from vmap), N=4, tracer=fx, inputs: x=shared" in out
    assert "stage  vmap      runs as" in out and "reason" in out
    assert "data-dependent value" in out
    assert f"plan written to {path}" in out
    plan = planner.Plan.load(path)
    _, graph = sample("data_dependent")
    assert plan.n_members == 4 and plan.fingerprint == graph.fingerprint
    assert plan.model.endswith("data_dependent.py")
    assert [s.nodes for s in plan.stages] == [s.nodes for s in planner.propose(graph, 4).stages]


def test_plan_without_output_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "plan", MLP, "-n", "2")
    assert code == 0 and "1 stage (1 batched, 0 member loops; 0 excluded from vmap)" in out
    assert list(tmp_path.iterdir()) == []


def test_plan_export_model_notes_the_tracer(capsys):
    code, out, _ = run_cli(capsys, "plan", ROOT / "sample_models" / "shape_loop.py", "-n", "2")
    assert code == 0
    assert out.startswith("note: torch.fx failed") and "tracer=export" in out


@pytest.mark.parametrize("argv, mode", [
    (["--input-mode", "per_member"], "per_member"),
    (["--input-mode", "x=per_member"], "per_member"),
    ([], "shared"),
])
def test_plan_input_modes(tmp_path, capsys, argv, mode):
    path = tmp_path / "p.json"
    code, _, _ = run_cli(capsys, "plan", MLP, "-n", "2", *argv, "-o", path)
    assert code == 0
    inputs = json.loads(path.read_text())["inputs"]
    assert [(i["name"], i["mode"]) for i in inputs] == [("x", mode)]  # inputs may also record traced shapes


def test_run_exits_0_on_match(mlp_plan, capsys):
    code, out, err = run_cli(capsys, "run", mlp_plan, MLP)
    assert code == 0, err
    assert "MATCH: batched vs loop over 3 members" in out and "MISMATCH" not in out
    assert "output out" in out and "stage  vmap      runs as" in out


def test_run_per_member_plan(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert run_cli(capsys, "plan", ROOT / "sample_models" / "data_dependent.py", "-n", "3", "--input-mode", "per_member", "-o", path)[0] == 0
    code, out, _ = run_cli(capsys, "run", path, ROOT / "sample_models" / "data_dependent.py")
    assert code == 0 and "MATCH" in out and "boundary item" in out


def test_run_exits_1_on_mismatch(mlp_plan, capsys, monkeypatch):
    real = executor.verify

    def broken(*args, **kwargs):
        report = real(*args, **kwargs)
        report.outputs[0].ok = False
        return report

    monkeypatch.setattr(executor, "verify", broken)
    code, out, _ = run_cli(capsys, "run", mlp_plan, MLP)
    assert code == 1 and "MISMATCH" in out


def test_show(mlp_plan, capsys):
    code, out, _ = run_cli(capsys, "show", mlp_plan)
    assert code == 0
    assert "model: " in out and "mlp.py" in out and "fingerprint:" in out
    assert "s0     ok        batched (vmap)" in out and "params" not in out
    code, out, _ = run_cli(capsys, "show", mlp_plan, MLP)
    assert code == 0 and "params" in out and "FLOPs" in out and "16.6k" in out


# --- errors: one line, exit 2 ------------------------------------------------------------

def test_bad_plan_json(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    for argv in (["run", path, MLP], ["show", path]):
        code, out, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, argv[0], "bad.json is not valid JSON")


def test_wrong_schema_version(mlp_plan, capsys):
    d = json.loads(mlp_plan.read_text())
    d["schema_version"] = 99
    mlp_plan.write_text(json.dumps(d))
    code, _, err = run_cli(capsys, "run", mlp_plan, MLP)
    assert_one_line_error(code, err, "run", "schema_version is 99", "stagewise plan")


def test_plan_for_another_model(mlp_plan, capsys, sample):
    code, _, err = run_cli(capsys, "run", mlp_plan, DEEP)
    _, mlp_graph = sample("mlp")
    _, deep_graph = sample("deep_mlp")
    assert_one_line_error(code, err, "run", mlp_graph.fingerprint, deep_graph.fingerprint, "re-plan")
    code, _, err = run_cli(capsys, "show", mlp_plan, DEEP)
    assert_one_line_error(code, err, "show", mlp_graph.fingerprint, deep_graph.fingerprint)


def test_plan_naming_unknown_nodes(mlp_plan, capsys):
    d = json.loads(mlp_plan.read_text())
    d["stages"][0]["nodes"].append("fc9")
    mlp_plan.write_text(json.dumps(d))
    code, _, err = run_cli(capsys, "show", mlp_plan, MLP)
    assert_one_line_error(code, err, "show", "'fc9'")


def test_missing_model_file(tmp_path, capsys, mlp_plan):
    code, _, err = run_cli(capsys, "plan", tmp_path / "nope.py")
    assert_one_line_error(code, err, "plan", "nope.py does not exist")
    code, _, err = run_cli(capsys, "run", mlp_plan, tmp_path / "nope.py")
    assert_one_line_error(code, err, "run", "nope.py does not exist")


def test_missing_plan_file(tmp_path, capsys):
    code, _, err = run_cli(capsys, "show", tmp_path / "nope.json")
    assert_one_line_error(code, err, "show", "cannot read plan file", "nope.json")


def test_model_file_with_syntax_error(capsys, write_model):
    path = write_model("def build_model(:\n    pass\n", "broken.py")
    code, _, err = run_cli(capsys, "plan", path)
    assert_one_line_error(code, err, "plan", "broken.py has a syntax error at line 1")


def test_model_file_without_example_inputs(capsys, write_model):
    path = write_model("import torch.nn as nn\ndef build_model():\n    return nn.Linear(2, 2)\n", "noinputs.py")
    code, _, err = run_cli(capsys, "plan", path)
    assert_one_line_error(code, err, "plan", "noinputs.py defines no example_inputs()")


@pytest.mark.parametrize("argv, words", [
    (["-n", "0"], ["n_members must be an integer >= 1"]),
    (["--input-mode", "sometimes"], ["'sometimes'", "'shared', 'per_member'"]),
    (["--input-mode", "x=shared", "per_member"], ["name=mode per input"]),
    (["--input-mode", "y=shared"], ["unknown inputs ['y']"]),
])
def test_plan_bad_options(capsys, argv, words):
    code, _, err = run_cli(capsys, "plan", MLP, *argv)
    assert_one_line_error(code, err, "plan", *words)


def test_wrong_member_count_from_weights(tmp_path, capsys, mlp_plan):
    import torch

    src = planner.load_model_file(MLP)
    w = tmp_path / "m0.pt"
    torch.save(src.members(1)[0].state_dict(), w)
    code, _, err = run_cli(capsys, "run", mlp_plan, MLP, "--weights", w)
    assert_one_line_error(code, err, "run", "1 weight files given but 3 members asked for")


def test_device_without_cuda(mlp_plan, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli(capsys, "run", mlp_plan, MLP, "--device", "cuda")
    assert_one_line_error(code, err, "run", "no CUDA device")


def test_unexpected_errors_are_one_line_too(mlp_plan, capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(executor, "verify", boom)
    monkeypatch.delenv("STAGEWISE_DEBUG", raising=False)
    code, _, err = run_cli(capsys, "run", mlp_plan, MLP)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unexpected RuntimeError: kaboom" in err and "STAGEWISE_DEBUG=1" in err


# --- the installed console script ----------------------------------------------------------

def _console_script() -> list[str]:
    exe = Path(sys.executable).with_name("stagewise")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "stagewise.app.cli"]


def test_console_script(tmp_path, write_model):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("STAGEWISE_DEBUG", None)
    plan = tmp_path / "tiny.json"
    model = write_model(TINY_MODEL, "tiny.py")
    ok = subprocess.run([*_console_script(), "plan", str(model), "-n", "2", "-o", str(plan)],
                        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "plan written to" in ok.stdout and plan.exists()
    ran = subprocess.run([*_console_script(), "run", str(plan), str(model)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert ran.returncode == 0 and "MATCH" in ran.stdout, ran.stderr
    plan.write_text("[]")
    bad = subprocess.run([*_console_script(), "run", str(plan), str(model)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"stagewise run: error: {plan}: expected a JSON object, got list"]


@pytest.mark.gpu
def test_run_on_cuda(mlp_plan, capsys):
    """Members and inputs come from the model file on the CPU; the batched module runs on the GPU."""
    code, out, err = run_cli(capsys, "run", mlp_plan, MLP, "--device", "cuda")
    assert code == 0, err
    assert "MATCH" in out


def test_untraceable_model_names_both_tracers(capsys, write_model):
    path = write_model('''
import torch
import torch.nn as nn


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def build_model():
    return Branchy()


def example_inputs():
    return (torch.randn(3),)
''', "branchy.py")
    code, _, err = run_cli(capsys, "plan", path)
    assert_one_line_error(code, err, "plan", "Branchy cannot be traced", "torch.fx failed", "torch.export failed")


def test_model_file_that_fails_to_import(capsys, write_model):
    path = write_model("import torch\nraise ImportError('needs flash-attn')\n", "needs.py")
    code, _, err = run_cli(capsys, "plan", path)
    assert_one_line_error(code, err, "plan", "needs.py failed to import: ImportError: needs flash-attn")


def test_plan_output_into_a_missing_folder(tmp_path, capsys):
    code, _, err = run_cli(capsys, "plan", MLP, "-n", "2", "-o", tmp_path / "nofolder" / "p.json")
    assert_one_line_error(code, err, "plan", "cannot write plan file", "check that the folder exists")


# --- .pt2 archives that need unpickling (issue 7, item 7) ------------------------------------

def test_crafted_archive_is_refused_in_one_line_and_runs_nothing(tmp_path, capsys):
    from test_archive_trust import evil_sample_inputs

    marker = tmp_path / "marker"
    evil = evil_sample_inputs(tmp_path, marker)
    code, _, err = run_cli(capsys, "plan", evil)
    assert_one_line_error(code, err, "plan", "evil.pt2", "data/sample_inputs/model.pt", "--trust-archive")
    assert not marker.exists()
    code, _, err = run_cli(capsys, "plan", evil, "--trust-archive")
    assert marker.exists()  # the flag really hands the file to torch's unpickler


def test_plain_archive_needs_no_trust(tmp_path, capsys):
    from test_archive_trust import save_archive

    path = save_archive(tmp_path / "plain.pt2")
    out_plan = tmp_path / "p.json"
    code, out, err = run_cli(capsys, "plan", path, "-n", "2", "-o", out_plan)
    assert code == 0, err
    code, out, err = run_cli(capsys, "run", out_plan, path)
    assert code == 0, err


# --- destinations are checked before the slow work (item 9) -------------------------------

def _forbid(monkeypatch, target, name):
    def called(*a, **k):
        raise AssertionError(f"{name} ran although the output could not be written")

    monkeypatch.setattr(target, name, called)


def test_plan_checks_output_before_loading(tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, planner, "load_source")
    code, _, err = run_cli(capsys, "plan", MLP, "-o", tmp_path / "nofolder" / "p.json")
    assert_one_line_error(code, err, "plan", "cannot write plan file", "nofolder", "does not exist")
    code, _, err = run_cli(capsys, "plan", MLP, "-o", tmp_path)
    assert_one_line_error(code, err, "plan", "cannot write plan file", "it is a folder")


@pytest.mark.parametrize("flag", ["-o", "--trace"])
def test_profile_checks_destinations_before_profiling(mlp_plan, tmp_path, capsys, monkeypatch, flag):
    _forbid(monkeypatch, executor, "profile")
    _forbid(monkeypatch, planner, "load_source")
    code, _, err = run_cli(capsys, "profile", mlp_plan, MLP, flag, tmp_path / "nofolder" / "out.json")
    what = "cannot write plan file" if flag == "-o" else "cannot write the chrome trace"
    assert_one_line_error(code, err, "profile", what, "nofolder", "does not exist")


def test_trace_is_written_whole_and_named(mlp_plan, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    code, out, err = run_cli(capsys, "profile", mlp_plan, MLP, "--repeats", "2", "--trace", trace)
    assert code == 0, err
    assert f"chrome trace: {trace}" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "trace.json"]  # no temp file left


def test_trace_never_names_a_file_it_did_not_write(mlp_plan, tmp_path, capsys, monkeypatch):
    profile_module = sys.modules["stagewise.executor.profile"]
    monkeypatch.setattr(profile_module, "write_chrome_trace", lambda module, inputs, path, device: path)  # writes nothing
    trace = tmp_path / "trace.json"
    saved = tmp_path / "profiled.json"
    code, out, err = run_cli(capsys, "profile", mlp_plan, MLP, "--repeats", "2", "--trace", trace, "-o", saved)
    assert_one_line_error(code, err, "profile", f"the chrome trace was not written to {trace}")
    assert str(trace) not in out and "chrome trace:" not in out
    assert not trace.exists()
    assert planner.Plan.load(saved).profile["trace_path"] is None  # the report kept in the plan names no trace either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "profiled.json"]


# --- loose ends (item 13) ----------------------------------------------------------------------

def test_model_file_calling_sys_exit_is_an_error_not_a_silent_exit(capsys, write_model):
    path = write_model("import sys\nprint('loading')\nsys.exit(0)\n", "exits.py")
    code, _, err = run_cli(capsys, "plan", path)
    assert_one_line_error(code, err, "plan", "exits.py called sys.exit(0) while being imported")


def test_plan_file_with_chunk_size_true_is_refused(mlp_plan, capsys):
    d = json.loads(mlp_plan.read_text())
    d["stages"][0]["options"]["chunk_size"] = True
    mlp_plan.write_text(json.dumps(d))
    code, _, err = run_cli(capsys, "run", mlp_plan, MLP)
    assert_one_line_error(code, err, "run", str(mlp_plan), "chunk_size must be a positive integer or null, got True")


@pytest.mark.parametrize("case", ["latin-1", "deep", "profile"])
def test_damaged_plan_files_are_plan_file_errors(mlp_plan, capsys, case):
    if case == "latin-1":
        mlp_plan.write_bytes(mlp_plan.read_text().replace('"fx"', '"f\u00e9"').encode("latin-1"))
        words = ("is not UTF-8 text",)
    elif case == "deep":
        mlp_plan.write_text("[" * 200_000 + "]" * 200_000)
        words = ("nests JSON too deeply",)
    else:
        d = json.loads(mlp_plan.read_text())
        d["profile"] = {"stages": 3}
        mlp_plan.write_text(json.dumps(d))
        words = ("'profile' block is malformed",)
    code, _, err = run_cli(capsys, "show", mlp_plan)
    assert_one_line_error(code, err, "show", str(mlp_plan), *words)
    assert "unexpected" not in err


def test_plan_capture_flag_sets_whole_plan_capture(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    code, out, _ = run_cli(capsys, "plan", MLP, "-n", 2, "--capture", "-o", out_path)
    assert code == 0 and "whole-plan capture on GPU" in out
    assert planner.Plan.load(out_path).capture
    code, out, _ = run_cli(capsys, "plan", MLP, "-n", 2, "-o", out_path)
    assert code == 0 and "whole-plan capture" not in out and not planner.Plan.load(out_path).capture


def test_outputs_never_replace_the_commands_own_inputs_or_a_read_only_file(tmp_path, capsys, mlp_plan):
    """Was: `plan model.py -o model.py` replaced the model source with JSON, `profile ... --trace plan.json` the
    plan with a chrome trace, and a read-only plan file was replaced (an atomic rename goes past its mode)."""
    model = tmp_path / "model.py"
    model.write_text(Path(MLP).read_text())
    before = model.read_text()
    code, _, err = run_cli(capsys, "plan", model, "-n", "3", "-o", model)
    assert_one_line_error(code, err, "plan", "-o", "the model file")
    assert model.read_text() == before
    plan_text = mlp_plan.read_text()
    code, _, err = run_cli(capsys, "profile", mlp_plan, MLP, "--repeats", "2", "--trace", mlp_plan)
    assert_one_line_error(code, err, "profile", "--trace", "the plan file")
    assert mlp_plan.read_text() == plan_text
    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0o444)
    code, _, err = run_cli(capsys, "plan", MLP, "-n", "3", "-o", locked)
    assert_one_line_error(code, err, "plan", "read-only")
    assert locked.read_text() == "{}"


def test_run_with_grads_compares_every_parameters_gradient(mlp_plan, capsys):
    code, out, err = run_cli(capsys, "run", mlp_plan, MLP, "--grads")
    assert code == 0, err
    assert "output out (with gradients)" in out and "grad fc1.weight" in out and "MATCH" in out
    code, _, err = run_cli(capsys, "run", mlp_plan, MLP, "--grads", "--distributed")
    assert code == 2 and "--grads is not yet checked per rank" in err


def test_a_reader_that_stops_reading_is_no_error(mlp_plan):
    """`stagewise show plan.json | head -1`: an 'unexpected BrokenPipeError ... please report it' before."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("STAGEWISE_DEBUG", None)
    proc = subprocess.Popen([*_console_script(), "show", str(mlp_plan)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # closed before the command writes (it imports torch first)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "unexpected" not in err and "Traceback" not in err


def test_an_input_given_two_modes_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "plan", MLP, "-n", "2", "--input-mode", "x=per_member", "x=shared")
    assert_one_line_error(code, err, "plan", "'x' two modes")
