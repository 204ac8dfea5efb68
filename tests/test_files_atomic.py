"""planner.files: atomic writes of files the user keeps (plans, the autosave), under concurrency and failure."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from stagewise.app import autosave
from stagewise.planner import InputMode, InputSpec, Plan, PlanFileError, Stage
from stagewise.planner import files
from stagewise.planner.files import temp_beside, writable_problem, write_atomic


def plan_for(writer: int, i: int) -> Plan:
    """A plan whose text differs per writer and save (and in length, so a torn write shows)."""
    nodes = tuple(f"n{writer}_{k}" for k in range(1 + (i % 7)))
    return Plan(fingerprint=f"{writer:02d}{i:04d}", tracer="fx", n_members=1 + writer, inputs=(InputSpec("x", InputMode.SHARED),),
                stages=(Stage("s0", nodes),), model=f"writer {writer} save {i}")


def test_concurrent_saves_to_one_path_never_fail_or_tear(tmp_path):
    path = tmp_path / "plan.json"
    plan_for(0, 0).save(path)
    writers, saves = 8, 100
    errors: list[BaseException] = []
    bad_reads: list[str] = []
    reads = 0
    done = threading.Event()

    def write(w: int) -> None:
        try:
            for i in range(saves):
                plan_for(w, i).save(path)
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    def read() -> None:
        nonlocal reads
        while not done.is_set():
            text = path.read_bytes()
            reads += 1
            try:
                plan = Plan.loads(text, source="reader")
            except PlanFileError as e:
                bad_reads.append(f"{len(text)} bytes: {e}")
                continue
            if plan.dumps().encode() != text:
                bad_reads.append("text differs from the plan it parses to")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    assert errors == []
    assert bad_reads == []
    assert reads > 0
    final = Plan.load(path)
    assert final.model == f"writer {final.n_members - 1} save {saves - 1}"  # some writer's last save, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temp file left behind


def test_concurrent_autosaves_do_not_collide(tmp_path):
    path = tmp_path / "auto.json"
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            for i in range(30):
                autosave.save(plan_for(w, i), f"m{w}.py", path=path)
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    record = autosave.load(path)
    assert record.model_path == f"m{record.plan.n_members - 1}.py"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    old = plan_for(1, 1)
    old.save(path)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", disk_full)
    with pytest.raises(PlanFileError, match="cannot write plan file .*plan.json: No space left on device"):
        plan_for(2, 2).save(path)
    with pytest.raises(OSError):
        autosave.save(plan_for(2, 2), "m.py", path=tmp_path / "auto.json")
    assert Plan.load(path) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_an_interrupted_write_leaves_no_temp(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "x.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_new_files_get_the_umask_mode_and_old_files_keep_theirs(tmp_path):
    path = write_atomic(tmp_path / "new.json", "{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~files._umask()  # not mkstemp's 0600
    os.chmod(path, 0o640)
    write_atomic(path, "{ }")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_text() == "{ }"


def test_temp_beside_refuses_to_publish_nothing(tmp_path):
    target = tmp_path / "trace.json.gz"
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with temp_beside(target) as tmp:
            assert tmp.parent == tmp_path and tmp.name.endswith(".json.gz")
    assert list(tmp_path.iterdir()) == []
    with temp_beside(target) as tmp:
        tmp.write_bytes(b"data")
    assert target.read_bytes() == b"data" and [p.name for p in tmp_path.iterdir()] == ["trace.json.gz"]


def test_writable_problem(tmp_path, monkeypatch):
    assert writable_problem(tmp_path / "p.json") is None
    assert writable_problem(tmp_path) == "it is a folder"
    assert writable_problem(tmp_path / "nofolder" / "p.json") == f"the folder {tmp_path / 'nofolder'} does not exist"
    assert list(tmp_path.iterdir()) == []  # the check leaves nothing behind

    def denied(**kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkstemp", denied)  # a read-only folder (root ignores real modes)
    assert writable_problem(tmp_path / "p.json") == f"the folder {tmp_path} is not writable (Permission denied)"


def test_a_symbolic_link_is_followed_and_stays_a_link(tmp_path):
    from stagewise.planner.files import write_atomic

    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real.name)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
