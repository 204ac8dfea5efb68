"""Member weights from files (.safetensors, torch.save'd state_dicts) and torch.export archives (.pt2)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagewise import executor
from stagewise import planner
from stagewise.planner import MemberError
from conftest import SAMPLES_DIR

N = 3


def trained_like_members(name: str, n: int = N) -> list[torch.nn.Module]:
    """n members with distinct weights, as someone's training run would leave them."""
    src = planner.load_model_file(SAMPLES_DIR / f"{name}.py")
    members = src.members(n)
    with torch.no_grad():
        for i, m in enumerate(members):
            for p in m.parameters():
                p.add_(0.01 * (i + 1))
    return members


def save_weights(members, folder, suffix: str) -> list:
    paths = []
    for i, m in enumerate(members):
        path = folder / f"member{i}{suffix}"
        state = {k: v.contiguous() for k, v in m.state_dict().items()}
        if suffix == ".safetensors":
            save_file(state, str(path))
        else:
            torch.save(state, path)
        paths.append(path)
    return paths


def assert_same_state(got: torch.nn.Module, want: torch.nn.Module) -> None:
    g, w = got.state_dict(), want.state_dict()
    assert g.keys() == w.keys()
    for k in w:
        assert torch.equal(g[k], w[k]), k


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_members_get_the_file_weights(tmp_path, suffix):
    originals = trained_like_members("mlp")
    paths = save_weights(originals, tmp_path, suffix)
    src = planner.load_source(SAMPLES_DIR / "mlp.py", weights=paths)
    members = src.members(N)
    for got, want in zip(members, originals):
        assert_same_state(got, want)
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, N, input_mode="per_member")
    report = executor.verify(plan, members, executor.batched_inputs(plan, src.example_inputs))
    assert report.ok, report.to_text()
    out = executor.build(plan, members)(*executor.batched_inputs(plan, src.example_inputs))
    with torch.no_grad():
        want = originals[1](executor.batched_inputs(plan, src.example_inputs)[0][1])
    torch.testing.assert_close(out[1], want)


def test_weights_with_buffers(tmp_path):
    """resblock has BatchNorm running statistics: buffers travel with the weights."""
    originals = trained_like_members("resblock", 2)
    with torch.no_grad():
        for i, m in enumerate(originals):
            for name, b in m.named_buffers():
                if b.is_floating_point():
                    b.add_(0.5 * (i + 1))
    paths = save_weights(originals, tmp_path, ".safetensors")
    members = planner.load_source(SAMPLES_DIR / "resblock.py", weights=paths).members(2)
    for got, want in zip(members, originals):
        assert_same_state(got, want)


def test_weight_count_must_match_members(tmp_path):
    paths = save_weights(trained_like_members("mlp", 2), tmp_path, ".pt")
    src = planner.load_source(SAMPLES_DIR / "mlp.py", weights=paths)
    with pytest.raises(MemberError, match="2 weight files given but 3 members asked for; pass one weight file per member"):
        src.members(3)


def test_weights_of_another_architecture(tmp_path):
    paths = save_weights(trained_like_members("deep_mlp", 1), tmp_path, ".safetensors")
    src = planner.load_source(SAMPLES_DIR / "mlp.py", weights=paths)
    with pytest.raises(MemberError) as info:
        src.members(1)
    msg = str(info.value)
    assert msg.startswith("member0.safetensors does not fit the architecture")
    assert "missing ['fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight']" in msg
    assert "unexpected [" in msg and "save the weights of this exact model" in msg


def test_weights_with_wrong_shapes(tmp_path):
    state = trained_like_members("mlp", 1)[0].state_dict()
    state["fc1.weight"] = torch.zeros(100, 64)
    torch.save(state, tmp_path / "w.pt")
    src = planner.load_source(SAMPLES_DIR / "mlp.py", weights=[tmp_path / "w.pt"])
    with pytest.raises(MemberError, match=r"w.pt does not fit the architecture: shape mismatch fc1.weight: file \(100, 64\) vs model \(128, 64\)"):
        src.members(1)


def test_missing_weight_file_fails_at_load(tmp_path):
    with pytest.raises(planner.ModelLoadError, match="weight file .*gone.pt does not exist"):
        planner.load_source(SAMPLES_DIR / "mlp.py", weights=[tmp_path / "gone.pt"])


# --- torch.export archives ------------------------------------------------------------------

def export_archive(name: str, folder) -> tuple:
    src = planner.load_model_file(SAMPLES_DIR / f"{name}.py")
    path = folder / f"{name}.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(src.model, src.example_inputs), str(path))
    return path, src


@pytest.mark.parametrize("name", ["mlp", "shape_loop"])
def test_export_archive_with_member_weights(tmp_path, name):
    path, py_src = export_archive(name, tmp_path)
    originals = trained_like_members(name, 2)
    paths = save_weights(originals, tmp_path, ".safetensors")
    src = planner.load_source(path, weights=paths)
    assert src.name == name and src.path == path
    for a, b in zip(src.example_inputs, py_src.example_inputs):
        assert torch.equal(a, b)
    members = src.members(2)
    x = py_src.example_inputs
    with torch.no_grad():
        for got, want in zip(members, originals):
            torch.testing.assert_close(got(*x), want(*x))  # the archive's graph with the file's weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, 2, input_mode="per_member")
    report = executor.verify(plan, members, executor.batched_inputs(plan, src.example_inputs))
    assert report.ok, report.to_text()


def test_export_archive_without_weights(tmp_path):
    path, py_src = export_archive("mlp", tmp_path)
    src = planner.load_source(path)
    a, b = src.members(2)
    assert_same_state(a, b)
    assert a is not b and a is not src.model
    with torch.no_grad():
        torch.testing.assert_close(a(*src.example_inputs), py_src.model(*src.example_inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(src.model, src.example_inputs)
    assert executor.verify(planner.propose(graph, 2), [a, b], src.example_inputs).ok


def test_export_archive_with_weights_that_do_not_fit(tmp_path):
    path, _ = export_archive("mlp", tmp_path)
    paths = save_weights(trained_like_members("deep_mlp", 1), tmp_path, ".pt")
    with pytest.raises(MemberError, match="member0.pt does not fit the architecture: missing"):
        planner.load_source(path, weights=paths).members(1)


def test_cli_with_export_archive_and_weights(tmp_path, capsys):
    from stagewise.app import cli

    path, _ = export_archive("shape_loop", tmp_path)
    weights = [str(p) for p in save_weights(trained_like_members("shape_loop", 2), tmp_path, ".safetensors")]
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", str(path), "-n", "2", "--input-mode", "per_member", "--weights", *weights, "-o", str(plan)]) == 0
    assert cli.main(["run", str(plan), str(path), "--weights", *weights]) == 0
    out = capsys.readouterr().out
    assert "MATCH: batched vs loop over 2 members" in out


SWEEP_FILE = '''
import torch
from torch import nn


class Tempered(nn.Module):
    def __init__(self, temperature=1.0):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.temperature = temperature

    def forward(self, x):
        return self.fc(x) / self.temperature


def build_model():
    return Tempered().eval()


def build_members(n):
    return [Tempered(2.0 ** i).eval() for i in range(n)]


def example_inputs():
    return (torch.randn(5, 8),)
'''


def test_weight_files_load_into_the_members_build_members_makes(tmp_path):
    """Was: with weight files, build_members() was never called: every member got build_model()'s temperature, 0.81 off
    from the user's members, and verify said MATCH (its loop used the same wrong members)."""
    model_file = tmp_path / "tempered.py"
    model_file.write_text(SWEEP_FILE)
    trained = planner.load_model_file(model_file).members(N)
    with torch.no_grad():
        for i, m in enumerate(trained):
            m.fc.weight.add_(0.1 * i)
    paths = save_weights(trained, tmp_path, ".pt")
    members = planner.load_model_file(model_file, weights=paths).members(N)
    assert [m.temperature for m in members] == [1.0, 2.0, 4.0]
    x = torch.randn(5, 8)
    for m, want in zip(members, trained):
        torch.testing.assert_close(m(x), want(x))


@pytest.mark.parametrize("weights", [[], "member0.pt"])
def test_weights_that_are_no_list_of_files_are_refused(weights):
    """Was: [] (a pattern that matched nothing) gave members without any file's weights, silently; one path was read
    letter by letter."""
    from stagewise.planner.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="an empty list|is one path"):
        planner.load_model_file(SAMPLES_DIR / "mlp.py", weights=weights)


class _Unsaved(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("scratch", torch.ones(4), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scratch


def test_an_archive_with_a_non_persistent_buffer_takes_weight_files_without_it(tmp_path):
    """Was: 'missing [scratch]': the archive module's copies forgot which buffers are not saved."""
    x = torch.randn(4, 8)
    archive = tmp_path / "unsaved.pt2"
    torch.export.save(torch.export.export(_Unsaved(), (x,)), archive)
    members = [_Unsaved() for _ in range(N)]
    paths = save_weights(members, tmp_path, ".pt")
    assert "scratch" not in torch.load(paths[0])
    loaded = planner.load_export(archive, weights=paths).members(N)
    for m, want in zip(loaded, members):
        torch.testing.assert_close(m(x), want(x))


class _Quantized(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("codes", torch.zeros(4, dtype=torch.int8))

    def forward(self, x):
        return self.fc(x) + self.codes


@pytest.mark.parametrize("codes,why", [(torch.tensor([1.5, 0, 0, 0]), "truncates to integers"),
                                        (torch.tensor([300, 0, 0, 0]), r"wraps values outside \[-128, 127\]"),
                                        (torch.tensor([1, 2, 3, 4], dtype=torch.float64), None)])
def test_a_file_value_the_models_dtype_cannot_hold_is_refused(codes, why):
    """Was: loaded as torch does, silently: 300 into int8 became 44, 1.5 became 1."""
    model = _Quantized()
    state = {**model.state_dict(), "codes": codes}
    if why is None:  # integral values in range: a lossless cast
        planner.source.load_member_state(model, state, "member0.pt")
        assert model.codes.tolist() == [1, 2, 3, 4]
        return
    with pytest.raises(MemberError, match=f"values the model's dtype cannot hold: codes: file .* into model torch.int8 {why}"):
        planner.source.load_member_state(model, state, "member0.pt")


def test_a_tied_weight_saved_once_and_a_missing_batch_count_load_as_torch_fills_them():
    """Was refused as 'missing': Hugging Face's save_pretrained saves a tied weight once; BatchNorm fills in
    num_batches_tracked when a file lacks it."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.bn = torch.nn.Embedding(10, 4), torch.nn.BatchNorm1d(4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    saved = Tied()
    state = {k: v for k, v in saved.state_dict().items() if k not in ("head.weight", "bn.num_batches_tracked")}
    model = Tied()
    planner.source.load_member_state(model, state, "model.safetensors")
    assert torch.equal(model.head.weight, saved.embed.weight) and model.head.weight is model.embed.weight
    untied = {k: v for k, v in saved.state_dict().items() if k != "embed.weight"}
    planner.source.load_member_state(Tied(), untied, "model.safetensors")  # either name of the tie will do
    with pytest.raises(MemberError, match=r"missing \['bn.weight'\]"):
        planner.source.load_member_state(Tied(), {k: v for k, v in state.items() if k != "bn.weight"}, "x.pt")


def test_a_folder_for_a_weight_file_names_the_files_in_it(tmp_path):
    from stagewise.planner.errors import ModelLoadError

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"is a folder .*pass the weight file in it \(model.safetensors\)"):
        planner.source.read_state_dict(tmp_path)


SHARED_FILE = '''
import torch
from torch import nn

EMBED = nn.Embedding(10, 4)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.fc = EMBED, nn.Linear(4, 2)

    def forward(self, ids):
        return self.fc(self.embed(ids))


def build_model():
    return Head().eval()


def build_members(n):
    return [Head().eval() for _ in range(n)]


def example_inputs():
    return (torch.tensor([[1, 2, 3]]),)
'''


def test_weight_files_that_differ_in_a_tensor_build_members_shares_are_refused(tmp_path):
    """Review: file after file went into the one embedding the members share, every member left with the last's."""
    model_file = tmp_path / "shared.py"
    model_file.write_text(SHARED_FILE)
    source = planner.load_model_file(model_file)
    states = []
    for i in range(N):
        state = {k: v.clone() for k, v in source.model.state_dict().items()}
        state["embed.weight"] += i
        states.append(state)
    paths = []
    for i, state in enumerate(states):
        torch.save(state, tmp_path / f"m{i}.pt")
        paths.append(tmp_path / f"m{i}.pt")
    with pytest.raises(MemberError, match=r"members 0 and 1 hold one tensor as embed.weight \(build_members shares it"):
        planner.load_model_file(model_file, weights=paths).members(N)
    for p in paths:  # the same values for it in every file: one tensor can hold them
        torch.save(states[0], p)
    planner.load_model_file(model_file, weights=paths).members(N)


def test_weights_as_a_generator_and_unsigned_or_float8_files_load():
    """Review: Path.glob(...) crashed on len(); a uint32 position_ids file or a float8 value crashed the range check."""
    model = _Quantized()
    state = {**model.state_dict(), "codes": torch.tensor([1, 2, 3, 4], dtype=torch.uint32)}
    planner.source.load_member_state(model, state, "m.safetensors")
    state["codes"] = torch.tensor([1.0, 2.0, 3.0, 4.0]).to(torch.float8_e4m3fn)
    planner.source.load_member_state(model, state, "m.safetensors")
    assert model.codes.tolist() == [1, 2, 3, 4]
    assert planner.source._weights_list("m.py", (p for p in ["a.pt", "b.pt"])) == ["a.pt", "b.pt"]


def test_a_missing_num_batches_tracked_is_excused_only_for_batchnorm():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("num_batches_tracked", torch.tensor(7))

    with pytest.raises(MemberError, match=r"missing \['num_batches_tracked'\]"):
        planner.source.load_member_state(Counter(), {}, "m.pt")


RFF_FILE = '''
import torch
from torch import nn

class RFF(nn.Module):  # random Fourier features: a fixed random projection, kept out of checkpoints
    def __init__(self):
        super().__init__()
        self.register_buffer("B", torch.randn(2, 16) * 10.0, persistent=False)
        self.mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        z = 2 * torch.pi * x @ self.B
        return self.mlp(torch.cat([z.sin(), z.cos()], -1))

def build_model():
    return RFF().eval()

def example_inputs():
    return (torch.rand(8, 2),)
'''


def test_saved_member_weights_load_back_to_the_same_members_with_a_random_non_persistent_buffer(tmp_path):
    """Members from weight files were built unseeded: their random buffer differed from the saved members', 2.04 off."""
    path = tmp_path / "rff.py"
    path.write_text(RFF_FILE)
    src = planner.load_model_file(path)
    plan = planner.propose(planner.trace(src.model, src.example_inputs), 3)
    ens = executor.build(plan, src.members(3))
    with pytest.warns(UserWarning, match=r"buffers a state_dict does not hold \(B: registered with persistent=False\)"):
        paths = executor.save_member_weights(ens, tmp_path / "w")
    again = executor.build(plan, planner.load_model_file(path, weights=paths).members(3))
    with torch.no_grad():
        torch.testing.assert_close(again(*src.example_inputs), ens(*src.example_inputs), rtol=0, atol=0)


# --- checkpoint layouts as training code leaves them -----------------------------------------------------------------

class TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.bn = torch.nn.Embedding(20, 8), torch.nn.BatchNorm1d(8)
        self.lm_head = torch.nn.Linear(8, 20, bias=False)
        self.lm_head.weight = self.wte.weight  # nanoGPT's tie

    def forward(self, idx):
        return self.lm_head(self.bn(self.wte(idx).transpose(1, 2)).transpose(1, 2))


TIED_FILE = '''
import torch
from torch import nn

class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.bn = nn.Embedding(20, 8), nn.BatchNorm1d(8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.bn(self.wte(idx).transpose(1, 2)).transpose(1, 2))

def build_model():
    return TiedNet().eval()

def example_inputs():
    return (torch.randint(0, 20, (2, 5)),)
'''


def tied_members(n=2):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(TiedNet().eval())
    return out


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_a_wrapper_prefix_on_every_key_is_taken_off(tmp_path, prefix):
    """DistributedDataParallel's and torch.compile's state_dicts load as torch's consume_prefix_in_state_dict_if_present
    makes them (they were refused as missing/unexpected keys, without naming the prefix)."""
    (tmp_path / "tied.py").write_text(TIED_FILE)
    members = tied_members()
    paths = []
    for i, m in enumerate(members):
        paths.append(tmp_path / f"m{i}.pt")
        torch.save({prefix + k: v for k, v in m.state_dict().items()}, paths[-1])
    for got, want in zip(planner.load_model_file(tmp_path / "tied.py", weights=paths).members(2), members):
        assert_same_state(got, want)


def test_a_training_checkpoint_names_the_entry_holding_the_state_dict(tmp_path):
    (tmp_path / "tied.py").write_text(TIED_FILE)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": TiedNet().state_dict(), "optimizer": {"state": {}}, "iter_num": 5}, path)
    with pytest.raises(planner.ModelLoadError, match=r"checkpoint whose 'model' entry holds a state_dict.*\['model'\]"):
        planner.load_model_file(tmp_path / "tied.py", weights=[path])


def test_a_file_with_two_values_for_one_tied_tensor_is_refused(tmp_path):
    """load_state_dict keeps whichever comes last: the file's wte.weight was dropped without a word."""
    (tmp_path / "tied.py").write_text(TIED_FILE)
    state = {k: v.clone() for k, v in TiedNet().state_dict().items()}
    state["wte.weight"] += 1
    torch.save(state, tmp_path / "m.pt")
    with pytest.raises(MemberError, match=r"different values for wte.weight and lm_head.weight, which this model ties"):
        planner.load_model_file(tmp_path / "tied.py", weights=[tmp_path / "m.pt"]).members(1)


def test_a_file_torch_loads_through_a_load_hook_loads(tmp_path):
    """An old weight_norm checkpoint (weight_g / weight_v) into parametrizations.weight_norm, whose load hook renames
    the keys: refused as missing and unexpected keys, where torch loads it."""
    (tmp_path / "wn.py").write_text('''
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = weight_norm(nn.Linear(4, 3))

    def forward(self, x):
        return self.fc(x)

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(2, 4),)
''')
    old = torch.nn.utils.weight_norm(torch.nn.Linear(4, 3))
    paths = []
    for i in range(2):
        with torch.no_grad():
            old.weight_v.add_(i)
        paths.append(tmp_path / f"m{i}.pt")
        torch.save({"fc." + k: v.clone() for k, v in old.state_dict().items()}, paths[-1])
    members = planner.load_model_file(tmp_path / "wn.py", weights=paths).members(2)
    x = torch.randn(5, 4)
    for m, path in zip(members, paths):
        want = torch.nn.utils.weight_norm(torch.nn.Linear(4, 3))
        want.load_state_dict({k[3:]: v for k, v in torch.load(path).items()})
        with torch.no_grad():
            torch.testing.assert_close(m(x), want(x))


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("saver", ["torch.save", "safetensors.save_model"])
def test_an_archive_of_a_tied_model_loads_the_files_saved_from_it(tmp_path, strict, saver):
    """torch.export keeps one name of a tie (strict) or two Parameters on one memory (non-strict), and drops an unread
    num_batches_tracked: files of the exact model were refused as missing or unexpected keys."""
    from safetensors.torch import save_model

    members = tied_members()
    idx = torch.randint(0, 20, (2, 5))
    torch.export.save(torch.export.export(members[0], (idx,), strict=strict), str(tmp_path / "m.pt2"))
    paths = []
    for i, m in enumerate(members):
        paths.append(tmp_path / f"m{i}.{'pt' if saver == 'torch.save' else 'safetensors'}")
        torch.save(m.state_dict(), paths[-1]) if saver == "torch.save" else save_model(m, str(paths[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = planner.load_source(tmp_path / "m.pt2", weights=paths)
        plan = planner.propose(planner.trace(src.model, (idx,)), 2)
        ens = executor.build(plan, src.members(2))
    with torch.no_grad():
        torch.testing.assert_close(ens(idx), torch.stack([m(idx) for m in members]))


def test_a_module_with_extra_state_loads_saves_and_reloads(tmp_path):
    (tmp_path / "xs.py").write_text('''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def get_extra_state(self):
        return {"version": 2}

    def set_extra_state(self, state):
        self.version = state["version"]

    def forward(self, x):
        return self.fc(x)

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(2, 4),)
''')
    src = planner.load_model_file(tmp_path / "xs.py")
    members = src.members(2)
    paths = []
    for i, m in enumerate(members):
        paths.append(tmp_path / f"m{i}.pt")
        torch.save(m.state_dict(), paths[-1])
    loaded = planner.load_model_file(tmp_path / "xs.py", weights=paths).members(2)
    ens = executor.build(planner.propose(planner.trace(src.model, src.example_inputs), 2), loaded)
    saved = executor.save_member_weights(ens, tmp_path / "out")  # (a raw KeyError '_extra_state' before)
    again = planner.load_model_file(tmp_path / "xs.py", weights=saved).members(2)
    for a, b in zip(again, members):
        torch.testing.assert_close(a.fc.weight, b.fc.weight)


def test_a_model_whose_own_submodule_is_named_module_keeps_its_keys(tmp_path):
    (tmp_path / "wrap.py").write_text('''
import torch
from torch import nn

class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 3)

    def forward(self, x):
        return self.module(x)

def build_model():
    return Wrapper()

def example_inputs():
    return (torch.randn(2, 4),)
''')
    members = planner.load_model_file(tmp_path / "wrap.py").members(2)
    paths = save_weights(members, tmp_path, ".pt")
    for got, want in zip(planner.load_model_file(tmp_path / "wrap.py", weights=paths).members(2), members):
        assert_same_state(got, want)


# --- loads through the model's own load code (a review of today's loading changes) ----------------------------------

REVIEW = Path(__file__).resolve().parent / "review_models"


def _load_module(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_weights_review_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_prefix_taken_off_keeps_the_files_version_metadata(tmp_path):
    """The prefix was taken off into a plain dict, which lost _metadata: the versioned layer migrated its current
    weights as old ones (1.46 off, the batched module 1.10 off the loop)."""
    mod = _load_module(REVIEW / "versioned.py")
    saved, paths = [], []
    for i in range(2):
        torch.manual_seed(100 + i)
        m = mod.Net()
        wrapper = torch.nn.Module()
        wrapper.module = m
        paths.append(tmp_path / f"w{i}.pt")
        torch.save(wrapper.state_dict(), paths[-1])
        saved.append(m)
    for got, want in zip(planner.load_model_file(REVIEW / "versioned.py", weights=paths).members(2), saved):
        assert_same_state(got, want)


def test_a_pre_hook_changing_the_files_tensors_in_place_runs_once_per_load(tmp_path):
    """The hook ran on a probe copy and again on the member, over the same tensors, and again at the next members():
    0.64 off, then 7.6 off."""
    mod = _load_module(REVIEW / "hooked.py")
    saved, paths = [], []
    for i in range(2):
        torch.manual_seed(100 + i)
        m = mod.Net()
        state = {("a.weight_scaled" if k == "a.weight" else k): (v / 8 ** 0.5 if k == "a.weight" else v).clone()
                 for k, v in m.state_dict().items()}
        paths.append(tmp_path / f"w{i}.pt")
        torch.save(state, paths[-1])
        saved.append(m)
    src = planner.load_model_file(REVIEW / "hooked.py", weights=paths)
    for _ in range(2):
        for got, want in zip(src.members(2), saved):
            torch.testing.assert_close(got.a.weight, want.a.weight, rtol=1e-6, atol=1e-7)


def test_a_load_from_state_dict_override_reads_the_keys_as_torch_does(tmp_path):
    """A frozen BatchNorm dropping num_batches_tracked, loaded from a BatchNorm2d model's files: refused as unexpected."""
    mod = _load_module(REVIEW / "frozen_bn.py")
    paths = []
    for i in range(2):
        torch.manual_seed(i)
        trained = mod.Backbone(torch.nn.BatchNorm2d).train()
        trained(torch.randn(4, 3, 6, 6))
        paths.append(tmp_path / f"w{i}.pt")
        torch.save(trained.state_dict(), paths[-1])
    members = planner.load_model_file(REVIEW / "frozen_bn.py", weights=paths).members(2)
    torch.testing.assert_close(members[1].bn.running_mean, torch.load(paths[1])["bn.running_mean"])


def test_build_members_returning_one_object_twice_is_refused(write_model):
    path = write_model("import torch\n\ndef build_model():\n    return torch.nn.Linear(4, 2)\n\n"
                       "def build_members(n):\n    return [build_model()] * n\n\n"
                       "def example_inputs():\n    return (torch.randn(2, 4),)\n")
    with pytest.raises(MemberError, match=r"members 0 and 1 are one module object"):
        planner.load_model_file(path).members(3)
