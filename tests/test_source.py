"""Model sources: the model-file contract, members, and errors naming the file."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from stagewise import planner
from stagewise.planner import MemberError, ModelLoadError
from conftest import SAMPLE_NAMES, SAMPLES_DIR, TINY_MODEL


def states_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_load(sample, name):
    src, _ = sample(name)
    assert src.name == name
    assert src.path == SAMPLES_DIR / f"{name}.py"
    assert isinstance(src.model, nn.Module)
    assert isinstance(src.example_inputs, tuple) and src.example_inputs
    members = src.members(2)
    assert len(members) == 2 and all(type(m) is type(src.model) for m in members)


def test_default_members_differ_and_are_reproducible(write_model):
    src = planner.load_model_file(write_model(TINY_MODEL))
    a, b = src.members(3), src.members(3)
    assert not states_equal(a[0], a[1]) and not states_equal(a[1], a[2])
    assert all(states_equal(x, y) for x, y in zip(a, b))


def test_members_leave_the_global_rng_alone(write_model):
    src = planner.load_model_file(write_model(TINY_MODEL))
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    src.members(4)
    assert torch.equal(torch.rand(3), want)


def test_build_members_is_used_when_defined(write_model):
    path = write_model(TINY_MODEL + '''
calls = []

def build_members(n):
    calls.append(n)
    out = []
    for i in range(n):
        m = build_model()
        torch.nn.init.constant_(m[0].weight, float(i))
        out.append(m)
    return out
''')
    members = planner.load_model_file(path).members(3)
    assert [m[0].weight.flatten()[0].item() for m in members] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("n", [0, -1, 2.5, "3"])
def test_members_refuses_bad_counts(write_model, n):
    src = planner.load_model_file(write_model(TINY_MODEL))
    with pytest.raises(MemberError, match="integer >= 1"):
        src.members(n)


def test_build_members_wrong_count(write_model):
    path = write_model(TINY_MODEL + "\ndef build_members(n):\n    return [build_model()]\n")
    with pytest.raises(MemberError, match=r"build_members\(3\) returned 1 modules"):
        planner.load_model_file(path).members(3)


def test_build_members_not_modules(write_model):
    path = write_model(TINY_MODEL + "\ndef build_members(n):\n    return [1] * n\n")
    with pytest.raises(ModelLoadError, match=r"build_members\(2\) must return a list of nn.Module"):
        planner.load_model_file(path).members(2)


def test_example_inputs_may_be_a_single_tensor(write_model):
    path = write_model(TINY_MODEL.replace("return (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),)",
                                          "return torch.randn(3, 4)"))
    src = planner.load_model_file(path)
    assert isinstance(src.example_inputs, tuple) and src.example_inputs[0].shape == (3, 4)


BROKEN_FILES = {
    "no example_inputs": ("import torch.nn as nn\ndef build_model():\n    return nn.Linear(2, 2)\n",
                          r"model.py defines no example_inputs\(\)"),
    "no build_model": ("import torch\ndef example_inputs():\n    return (torch.zeros(2),)\n",
                       r"model.py defines no build_model\(\)"),
    "syntax error": ("def build_model(:\n    pass\n", r"model.py has a syntax error at line 1"),
    "import fails": ("import torch\nraise RuntimeError('no GPU here')\n", r"model.py failed to import: RuntimeError: no GPU here \(line 2\)"),
    "missing package": ("import not_a_real_package_xyz\n", r"model.py failed to import: ModuleNotFoundError"),
    "build_model raises": (TINY_MODEL.replace("return nn.Sequential", "raise ValueError('bad width')\n    return nn.Sequential"),
                           r"build_model\(\) raised ValueError: bad width"),
    "build_model not a module": ("import torch\ndef build_model():\n    return 3\ndef example_inputs():\n    return (torch.zeros(2),)\n",
                                 r"build_model\(\) returned int, not an nn.Module"),
    "example_inputs raises": (TINY_MODEL.replace("return (torch.randn", "1 / 0\n    return (torch.randn"),
                              r"example_inputs\(\) raised ZeroDivisionError"),
    "example_inputs a dict": (TINY_MODEL.replace("return (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),)",
                                                 "return {'x': torch.zeros(3, 4)}"),
                              r"example_inputs\(\) must return a tuple of inputs, got dict"),
    "sys.exit at import": ("import sys\nsys.exit(3)\n", r"model.py called sys.exit\(3\) while being imported"),
    "sys.exit in build_model": (TINY_MODEL.replace("return nn.Sequential", "raise SystemExit('done')\n    return nn.Sequential"),
                                r"build_model\(\) called sys.exit\('done'\)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_broken_model_files(write_model, case):
    text, message = BROKEN_FILES[case]
    with pytest.raises(ModelLoadError, match=message):
        planner.load_model_file(write_model(text))


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="model file .*nope.py does not exist"):
        planner.load_model_file(tmp_path / "nope.py")


def test_failed_import_leaves_no_module_behind(write_model):
    import sys

    before = set(sys.modules)
    with pytest.raises(ModelLoadError):
        planner.load_model_file(write_model("raise RuntimeError('x')\n"))
    assert not [m for m in set(sys.modules) - before if m.startswith("_stagewise_model_")]


def test_same_stem_in_two_folders_does_not_clash(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "model.py").write_text(TINY_MODEL)
    (b / "model.py").write_text(TINY_MODEL.replace("nn.Linear(8, 2)", "nn.Linear(8, 5)"))
    src_a, src_b = planner.load_model_file(a / "model.py"), planner.load_model_file(b / "model.py")
    x = src_a.example_inputs[0]
    assert src_a.model(x).shape == (3, 2) and src_b.model(x).shape == (3, 5)
    assert src_a.members(1)[0](x).shape == (3, 2)  # members come from their own file


def test_load_source_dispatches_by_suffix(tmp_path, write_model):
    assert planner.load_source(write_model(TINY_MODEL)).name == "model"
    other = tmp_path / "model.onnx"
    other.write_text("x")
    with pytest.raises(ModelLoadError, match=r"unknown model format '.onnx'"):
        planner.load_source(other)


def test_bad_export_archives(tmp_path):
    with pytest.raises(ModelLoadError, match="export archive .*missing.pt2 does not exist"):
        planner.load_source(tmp_path / "missing.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(ModelLoadError, match="junk.pt2 is not a torch.export archive"):
        planner.load_source(junk)


def test_read_state_dict_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="weight file .*w.pt does not exist"):
        planner.read_state_dict(tmp_path / "w.pt")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ModelLoadError, match="junk.safetensors could not be read"):
        planner.read_state_dict(junk)
    not_a_dict = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], not_a_dict)
    with pytest.raises(ModelLoadError, match="list.pt does not hold a state_dict"):
        planner.read_state_dict(not_a_dict)


def test_keyboard_interrupt_at_import_still_propagates(write_model):
    with pytest.raises(KeyboardInterrupt):
        planner.load_model_file(write_model("raise KeyboardInterrupt\n"))


def test_sys_exit_at_import_leaves_no_module_behind(write_model):
    import sys

    before = set(sys.modules)
    with pytest.raises(ModelLoadError, match="sys.exit"):
        planner.load_model_file(write_model("import sys\nsys.exit()\n"))
    assert not [m for m in set(sys.modules) - before if m.startswith("_stagewise_model_")]


def test_weight_file_with_pickled_objects_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "marker"

    class WritesMarker:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    path = tmp_path / "member0.pt"
    torch.save({"weight": torch.zeros(2), "extra": WritesMarker()}, path)
    with pytest.raises(ModelLoadError) as info:
        planner.read_state_dict(path)
    message = str(info.value)
    assert "\n" not in message
    assert "member0.pt holds objects other than tensors" in message and "state_dict()" in message
    assert not marker.exists()


def test_unreadable_weight_file_error_is_one_line(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(ModelLoadError, match="junk.pt could not be read") as info:
        planner.read_state_dict(junk)
    assert "\n" not in str(info.value)


# --- model files as people lay them out ------------------------------------------------------------------------------

BLOCK = "import torch\n\nclass Block(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n" \
        "        self.l = torch.nn.Linear(4, 4)\n\n    def forward(self, x):\n        return self.l(x)\n"
USES = "import torch\n{imp}\n\ndef build_model():\n    return Block()\n\ndef example_inputs():\n    return (torch.randn(2, 4),)\n"


@pytest.mark.parametrize("layout, imp", [
    ("sibling", "from layers import Block"),  # `python model.py` finds its folder's modules
    ("package", "from .layers import Block"),  # a file in a package, relative import
    ("package", "from mypkg.layers import Block"),  # minGPT's layout, from the repo root
])
def test_a_model_file_imports_what_python_would_import_from_it(tmp_path, monkeypatch, layout, imp):
    """Refused as 'No module named ...' / 'no known parent package' where Python runs the file."""
    folder = tmp_path / "mypkg"
    folder.mkdir()
    if layout == "package":
        (folder / "__init__.py").write_text("")
    (folder / "layers.py").write_text(BLOCK)
    (folder / "model.py").write_text(USES.format(imp=imp))
    monkeypatch.chdir(tmp_path)
    for name in [m for m in list(__import__("sys").modules) if m == "layers" or m.startswith("mypkg")]:
        monkeypatch.delitem(__import__("sys").modules, name)
    before = list(__import__("sys").path)
    members = planner.load_model_file("mypkg/model.py").members(2)
    assert len(members) == 2 and members[0] is not members[1]
    assert __import__("sys").path == before  # (put back as it was)


def test_a_module_level_model_returned_by_build_model_is_refused(write_model):
    """N members were one object: trained, the loop trains it N times (weight files each loaded into it in turn)."""
    path = write_model("import torch\nmodel = torch.nn.Linear(4, 2)\n\ndef build_model():\n    return model\n\n"
                       "def example_inputs():\n    return (torch.randn(2, 4),)\n")
    with pytest.raises(ModelLoadError, match=r"same module object for members 0 and 1.*new model in each call"):
        planner.load_model_file(path).members(3)


def test_argparse_at_import_is_named(write_model, monkeypatch):
    monkeypatch.setattr("sys.argv", ["stagewise", "plan", "model.py", "-n", "2"])
    path = write_model("import argparse, torch\nargs = argparse.ArgumentParser().parse_args()\n\n"
                       "def build_model():\n    return torch.nn.Linear(4, 2)\n\ndef example_inputs():\n    return (torch.randn(2, 4),)\n")
    with pytest.raises(ModelLoadError, match=r"parse_args\(\) read stagewise's own command line"):
        planner.load_model_file(path)


def test_a_helper_module_of_the_same_name_in_another_project_or_edited_is_imported_afresh(tmp_path, monkeypatch):
    """Python keeps `layers` by name: project B's model got project A's Block (0.87 off), and an edited layers.py was
    not read again."""
    for project, scale in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / project
        folder.mkdir()
        (folder / "layers.py").write_text(BLOCK.replace("return self.l(x)", f"return self.l(x) * {scale}"))
        (folder / "model.py").write_text(USES.format(imp="from layers import Block"))
    monkeypatch.delitem(__import__("sys").modules, "layers", raising=False)
    x = torch.randn(2, 4)
    a = planner.load_model_file(tmp_path / "a" / "model.py").members(1)[0]
    b = planner.load_model_file(tmp_path / "b" / "model.py").members(1)[0]
    torch.testing.assert_close(b(x), b.l(x) * 2.0)
    torch.testing.assert_close(a(x), a.l(x) * 1.0)
    import os, time
    edited = tmp_path / "b" / "layers.py"
    edited.write_text(BLOCK.replace("return self.l(x)", "return self.l(x) * 3.0"))
    os.utime(edited, (time.time() + 5, time.time() + 5))
    c = planner.load_model_file(tmp_path / "b" / "model.py").members(1)[0]
    torch.testing.assert_close(c(x), c.l(x) * 3.0)


def test_a_helper_imported_inside_build_model_is_imported_afresh_too(tmp_path, monkeypatch):
    for project, scale in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / project
        folder.mkdir()
        (folder / "layers2.py").write_text(BLOCK.replace("return self.l(x)", f"return self.l(x) * {scale}"))
        (folder / "model.py").write_text("import torch\n\ndef build_model():\n    from layers2 import Block\n"
                                          "    return Block()\n\ndef example_inputs():\n    return (torch.randn(2, 4),)\n")
    monkeypatch.delitem(__import__("sys").modules, "layers2", raising=False)
    x = torch.randn(2, 4)
    planner.load_model_file(tmp_path / "a" / "model.py").members(1)
    b = planner.load_model_file(tmp_path / "b" / "model.py").members(1)[0]
    torch.testing.assert_close(b(x), b.l(x) * 2.0)
