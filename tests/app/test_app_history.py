"""Undo/redo history and autosave files (no streamlit)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from app_fakes import residual_plan
from hypothesis import given, strategies as st

from stagewise.app import autosave
from stagewise.app.history import MAX_ENTRIES, History
from stagewise.planner.errors import PlanFileError


def _variant(i: int):
    return replace(residual_plan(), n_members=i + 1)


def test_undo_redo_reset():
    h = History.start(_variant(0))
    h.push("a", _variant(1))
    h.push("b", _variant(2))
    assert h.undo().n_members == 2 and h.undo().n_members == 1 and h.undo().n_members == 1
    assert not h.can_undo and h.can_redo
    assert h.redo().n_members == 2
    h.push("c", _variant(5))  # drops the redo of "b"
    assert not h.can_redo and h.labels() == ["proposed", "a", "c"]
    assert h.reset().n_members == 1 and h.undo().n_members == 6


@given(st.lists(st.sampled_from(["push", "undo", "redo", "reset"]), max_size=60))
def test_random_sequences_keep_cursor_valid(ops):
    h = History.start(_variant(0))
    model = [0]  # reference: list of values and cursor
    cur = 0
    for i, op in enumerate(ops):
        if op == "push":
            del model[cur + 1:]
            model.append(i + 1)
            cur = len(model) - 1
            h.push(op, _variant(i + 1))
        elif op == "undo":
            cur = max(0, cur - 1)
            h.undo()
        elif op == "redo":
            cur = min(len(model) - 1, cur + 1)
            h.redo()
        else:
            del model[cur + 1:]
            model.append(0)
            cur = len(model) - 1
            h.reset()
        assert h.present.n_members == model[cur] + 1


def test_history_is_capped_but_keeps_base():
    h = History.start(_variant(0))
    for i in range(MAX_ENTRIES + 20):
        h.push(str(i), _variant(i + 1))
    assert len(h.entries) == MAX_ENTRIES and h.base.n_members == 1 and h.present.n_members == MAX_ENTRIES + 21


def test_autosave_roundtrip_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv(autosave.ENV_VAR, str(tmp_path / "auto.json"))
    assert autosave.load() is None
    plan = residual_plan()
    autosave.save(plan, "m.py", ("w0.pt",))
    rec = autosave.load()
    assert rec.plan == plan and rec.model_path == "m.py" and rec.weights == ("w0.pt",)
    assert "3 stages" in rec.describe()
    (tmp_path / "auto.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="damaged"):
        autosave.load()
    autosave.discard()
    assert autosave.load() is None


def test_autosave_keeps_archive_trust_only_with_the_trusted_digest(tmp_path, monkeypatch):
    import hashlib
    import json

    monkeypatch.setenv(autosave.ENV_VAR, str(tmp_path / "auto.json"))
    archive = tmp_path / "m.pt2"
    archive.write_bytes(b"the archive's bytes" * 1000)
    digest = autosave.archive_sha256(archive)
    assert digest == hashlib.sha256(archive.read_bytes()).hexdigest()  # the full hash of the bytes, read now

    plan = residual_plan()
    autosave.save(plan, str(archive), trust_archive=True, archive_sha256=digest)
    rec = autosave.load()
    assert rec.trust_archive is True and rec.archive_sha256 == digest and rec.model_path == str(archive)

    autosave.save(plan, str(archive), trust_archive=True)  # no digest: nothing to check a restore against
    assert autosave.load().trust_archive is False
    autosave.save(plan, str(archive), archive_sha256=digest)  # a digest alone trusts nothing
    assert (autosave.load().trust_archive, autosave.load().archive_sha256) == (False, "")

    older = json.loads((tmp_path / "auto.json").read_text())  # autosaves written before trust was stored
    for key in ("trust_archive", "archive_sha256"):
        older.pop(key)
    (tmp_path / "auto.json").write_text(json.dumps(older))
    assert (autosave.load().trust_archive, autosave.load().archive_sha256) == (False, "")
    older["trust_archive"] = "true"  # only a JSON true counts
    (tmp_path / "auto.json").write_text(json.dumps(older))
    assert autosave.load().trust_archive is False
