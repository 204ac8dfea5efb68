"""examples/train_ensemble.py: its functions, called directly (never its printed text).

The reference is the example's own plain loop (N models, N torch.optim.Adam) on the same
batches: after the same steps its members must equal the stagewise ones.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's bundled digits: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_ensemble", ROOT / "examples" / "train_ensemble.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ex = _load_example()
SILENT = lambda *a: None  # noqa: E731  a progress callback that draws nothing


def test_main_with_a_tiny_config_returns_the_report(tmp_path, capsys):
    r = ex.main(["--members", "3", "--epochs", "1", "--max-steps", "3", "--batch", "16", "--seed", "1",
                 "--save", str(tmp_path / "members")], progress=SILENT)
    assert r["steps"] == 3 and r["samples"] == 3 * 3 * 16
    assert len(r["lrs"]) == 3 and r["lrs"][0] < r["lrs"][1] < r["lrs"][2]  # the log-spaced sweep
    assert len(r["member_accuracy"]) == 3 and all(0.0 <= a <= 1.0 for a in r["member_accuracy"])
    assert 0.0 <= r["ensemble_accuracy"] <= 1.0
    assert r["mean_member_accuracy"] == pytest.approx(sum(r["member_accuracy"]) / 3)
    for way in ("stagewise", "loop"):
        assert r[way]["seconds"] > 0 and r[way]["samples_per_s"] > 0
    assert r["check_steps"] == 3 and r["max_param_difference"] <= 1e-4  # the two ways trained the same members
    assert r["final_param_difference"] <= 1e-4  # after 3 steps: the same members
    assert r["member_accuracy"] == pytest.approx(r["loop_member_accuracy"])
    assert len(r["saved"]) == 3 and all(Path(p).exists() for p in r["saved"])
    assert "ensemble (mean of softmax)" in capsys.readouterr().out


def test_stagewise_and_loop_members_agree_after_the_same_steps():
    cfg = ex.Config(members=4, epochs=1, batch=32)
    x, y, _, _ = ex.load_data(cfg.seed)
    steps = ex.member_batches(cfg.members, len(x), cfg.batch, 1, cfg.seed)[:5]
    members = ex.make_members(cfg.members, cfg.seed)
    lrs = ex.member_lrs(cfg)
    ens, _ = ex.train_stagewise(members, lrs, x, y, steps, torch.device("cpu"), SILENT)
    models, _ = ex.train_loop(members, lrs, x, y, steps, torch.device("cpu"), SILENT)
    for state, model in zip(ens.member_state_dicts(), models):
        for k, p in model.named_parameters():
            err = ((state[k] - p.detach()).abs().max() / p.detach().abs().max()).item()
            assert err <= 1e-4, f"{k}: relative error {err:.1e}"
    # and training moved them: the members are not still at their initial weights
    assert any(not torch.equal(state["fc1.weight"], m.fc1.weight) for state, m in zip(ens.member_state_dicts(), members))


def test_each_member_walks_its_own_shuffle():
    steps = ex.member_batches(3, 100, 10, 2, seed=0)
    assert len(steps) == 2 * 10 and steps[0].shape == (3, 10)
    assert not torch.equal(steps[0][0], steps[0][1])
    epoch = torch.cat([s[1] for s in steps[:10]])
    assert sorted(epoch.tolist()) == list(range(100))  # one epoch sees every training image once


def test_ensemble_accuracy_is_the_argmax_of_the_mean_softmax():
    y = torch.tensor([0, 1])
    probs = torch.tensor([[[0.9, 0.1], [0.6, 0.4]],    # member 0: right, wrong
                          [[0.4, 0.6], [0.1, 0.9]]])   # member 1: wrong, right
    members, ensemble = ex.accuracies(probs, y)
    assert members == [0.5, 0.5] and ensemble == 1.0


@pytest.mark.slow
def test_the_ensemble_beats_its_average_member():
    r = ex.run(ex.Config(members=6, epochs=8), progress=SILENT)
    assert r["ensemble_accuracy"] > r["mean_member_accuracy"]
