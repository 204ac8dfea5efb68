"""The app's locks: the access token `stagewise ui` makes, the Host check, private uploads, trusting archives.

AppTest sessions here are opened as a browser would open them: with the token in
the address (`app_test`), without it, or with a wrong one. One test starts the real
server through app.launch.main and knocks on its WebSocket with a foreign Host.
"""
from __future__ import annotations

import io
import os
import pickle
import re
import socket
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from stagewise import planner
from stagewise.app import autosave, launch, state
from app_fakes import ROOT, TEST_TOKEN, app_test, wait_until_listening

SAMPLES = ROOT / "sample_models"


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def button(at, label: str):
    matches = [b for b in at.button if b.label == label]
    assert matches, f"no button {label!r}; buttons: {[b.label for b in at.button]}"
    return matches[0]


def upload(at, name: str, content: bytes) -> None:
    at.switch_page("views/model.py").run()
    at.file_uploader(key="model_upload").upload(name, content, "application/octet-stream")
    at.run()


def assert_does_nothing(at) -> None:
    """A refused session: the refusal shown, no model loaded, no autosave offered, no page drawn."""
    assert not at.exception, [e.value for e in at.exception]
    assert "Access refused" in texts(at.error)
    for key in ("model_ref", "history", "autosave_offer"):
        assert key not in at.session_state, f"a refused session has {key}"
    assert not at.button and not at.get("file_uploader") and not at.get("plotly_chart")


# -- the token --------------------------------------------------------------------------------


@pytest.mark.parametrize("present", [None, "", "not-the-token", TEST_TOKEN + "x"])
def test_a_session_without_the_token_does_nothing(tmp_path, monkeypatch, present):
    edited = planner.propose(planner.trace(*_mlp()), 3, model="mlp.py")
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py", present=present)
    autosave.save(edited, str(SAMPLES / "mlp.py"))  # an autosave is there, and must not be offered
    at.run()
    assert_does_nothing(at)
    assert "stagewise ui" in texts(at.error)  # says where the right address is
    at.switch_page("views/model.py").run()  # another page is refused the same way
    assert_does_nothing(at)
    assert not (tmp_path / "cache" / "stagewise").exists()  # nothing was uploaded or prepared


def test_the_token_is_kept_when_page_links_drop_it(tmp_path, monkeypatch):
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    assert not at.error and at.session_state["model_ref"].label == "mlp.py"
    at.query_params.clear()  # st.navigation's links carry no query string
    at.switch_page("views/model.py").run()
    assert not at.error and at.get("file_uploader")
    at.switch_page("views/plan.py").run()
    assert at.get("plotly_chart")


def test_no_token_configured_refuses_unless_explicitly_opted_out(tmp_path, monkeypatch):
    def tokenless(opt_out: str | None):  # `streamlit run app/main.py`, not `stagewise ui`
        at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py", present=None, token=None)
        if opt_out is not None:
            monkeypatch.setenv(launch.NO_TOKEN_ENV, opt_out)
        return at.run()

    at = tokenless(None)
    assert_does_nothing(at)
    assert launch.NO_TOKEN_ENV in texts(at.error)
    for not_one in ("true", "0", "yes", ""):  # only the exact value "1" opens it
        assert_does_nothing(tokenless(not_one))
    at = tokenless("1")
    assert not at.error and at.session_state["model_ref"].label == "mlp.py"


@pytest.mark.parametrize("header, name", [
    (None, None), ("127.0.0.1:8501", "127.0.0.1"), ("localhost", "localhost"), ("LOCALHOST.:80", "localhost"),
    ("evil.example:8501", "evil.example"), ("127.0.0.1.evil.example", "127.0.0.1.evil.example"), ("[::1", ""),
])
def test_host_names_from_host_headers(header, name):
    assert state._host_name(header) == name


# -- the server: tokened address, foreign Host refused ---------------------------------------------


def _handshake(port: int, host: str) -> str:
    """The status line the server answers a WebSocket upgrade of /_stcore/stream with, sent with this Host."""
    request = (f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), 10) as s:
        s.sendall(request.encode())
        s.settimeout(10)
        return s.recv(4096).decode("latin-1").split("\r\n", 1)[0]


def test_stagewise_ui_prints_a_tokened_address_and_refuses_foreign_hosts(tmp_path):
    port = launch.free_port(0)
    code = f"from stagewise.app.launch import main; main(None, {port}, headless=True)"  # the installed package, as `stagewise ui`
    env = {**os.environ, "STAGEWISE_AUTOSAVE": str(tmp_path / "a.json"), launch.TOKEN_ENV: "inherited",
           launch.NO_TOKEN_ENV: "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        first = proc.stdout.readline().decode()
        m = re.search(rf"http://127\.0\.0\.1:{port}/\?token=([A-Za-z0-9_-]+)", first)
        assert m, first
        token = m.group(1)
        assert len(token) >= 40 and token != "inherited"  # its own fresh token, not one from the environment
        wait_until_listening(proc, port)
        assert " 101 " in _handshake(port, f"127.0.0.1:{port}")  # a session for this machine's name
        assert " 101 " in _handshake(port, f"localhost:{port}")
        refused = _handshake(port, f"evil.example:{port}")  # a DNS-rebound page sends its own name
        assert " 101 " not in refused and " 403 " in refused, refused
        server = _child_pid(proc.pid)  # the streamlit process got the token (and not the opt-out)
        server_env = dict(kv.split("=", 1) for kv in Path(f"/proc/{server}/environ").read_text().split("\0") if "=" in kv)
        assert server_env[launch.TOKEN_ENV] == token and launch.NO_TOKEN_ENV not in server_env
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _child_pid(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert children, "stagewise ui started no server process"
    return int(children[0])


def test_each_launch_makes_a_new_token_and_workers_do_not_inherit_it(monkeypatch):
    assert launch.new_token() != launch.new_token()
    assert launch.url(8501, "abc") == "http://127.0.0.1:8501/?token=abc"
    monkeypatch.setenv(launch.TOKEN_ENV, "secret")
    assert launch.TOKEN_ENV not in launch.environment()  # what app.jobs starts workers with
    cmd = launch.command(8599)
    for flag in ("--server.allowedHosts=127.0.0.1", "--server.allowedHosts=localhost", "--server.enableCORS=true",
                 "--server.enableAgentApi=false"):
        assert flag in cmd
    assert launch.missing_guards() == []  # the streamlit this project installs has every guard


# -- uploads --------------------------------------------------------------------------------------


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_uploads_go_to_a_private_directory_with_unique_names(tmp_path, monkeypatch):
    planted = Path("/tmp/stagewise_uploads")  # where uploads used to go: a planted file there is never read
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    content = (SAMPLES / "mlp.py").read_bytes()
    paths = []
    for _ in range(2):  # the same file twice: two places, neither shared
        upload(at, "../../my_mlp.py", content)
        button(at, "Load uploaded model").click().run()
        assert not at.error, texts(at.error)
        paths.append(Path(at.session_state["model_ref"].path))
    root = tmp_path / "cache" / "stagewise" / "uploads"
    assert paths[0] != paths[1] and paths[0].parent != paths[1].parent
    for p in paths:
        assert p.name == "my_mlp.py" and p.parent.parent == root and p.read_bytes() == content
        assert _mode(p.parent) == 0o700 and _mode(p) == 0o600 and p.stat().st_uid == os.getuid()
        assert planted not in p.parents
    assert _mode(root) == 0o700 and _mode(root.parent) == 0o700
    root.parent.chmod(0o775)  # others could rename `uploads` away and put their own in its place
    upload(at, "my_mlp.py", content)
    button(at, "Load uploaded model").click().run()
    assert f"upload directory {root.parent} is open to other users" in texts(at.error)


def test_save_upload_never_reuses_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "require_access", lambda: None)  # the session check is the app's, tested above
    d = tmp_path / "one_upload"
    d.mkdir(mode=0o700)
    a = state.save_upload(d, "w.pt", b"a")
    b = state.save_upload(d, "sub/w.pt", b"b")
    c = state.save_upload(d, "..", b"c")
    assert (Path(a).name, Path(b).name, Path(c).name) == ("w.pt", "w-1.pt", "upload")
    assert [Path(p).read_bytes() for p in (a, b, c)] == [b"a", b"b", b"c"]


def test_an_upload_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    at = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    before = at.session_state["model_ref"]
    root = tmp_path / "cache" / "stagewise" / "uploads"
    root.mkdir(parents=True)  # .../stagewise readable by others (0755): fine, nobody else can write there
    root.chmod(0o770)  # a group could swap a file in between saving and loading: refused
    upload(at, "mlp.py", (SAMPLES / "mlp.py").read_bytes())
    button(at, "Load uploaded model").click().run()
    assert "open to other users" in texts(at.error) and f"chmod 700 {root}" in texts(at.error)
    assert at.session_state["model_ref"] == before and not list(root.iterdir())


def test_a_failed_upload_leaves_no_files(tmp_path, monkeypatch):
    at = app_test(monkeypatch, tmp_path, SAMPLES / "mlp.py").run()
    upload(at, "broken.py", b"def build_model(:\n")
    button(at, "Load uploaded model").click().run()
    assert "syntax error" in texts(at.error)
    assert not list((tmp_path / "cache" / "stagewise" / "uploads").iterdir())


def test_autosave_restore_finds_the_uploaded_model_or_says_it_is_gone(tmp_path, monkeypatch):
    at = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    upload(at, "my_mlp.py", (SAMPLES / "mlp.py").read_bytes())
    button(at, "Load uploaded model").click().run()
    at.number_input(key="n_current").set_value(3).run()  # an edit: autosaved with the uploaded file's path
    uploaded = at.session_state["model_ref"].path
    assert autosave.load().model_path == uploaded

    again = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()  # a new browser session
    again.button(key="restore_autosave").click().run()
    assert not again.error, texts(again.error)
    assert again.session_state["model_ref"].path == uploaded and again.session_state["history"].present.n_members == 3

    import shutil

    shutil.rmtree(Path(uploaded).parent)
    gone = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    gone.button(key="restore_autosave").click().run()
    assert f"{uploaded} is gone" in texts(gone.error)
    assert gone.session_state["model_ref"].label == "transformer_block.py"


# -- .pt2 archives: trusting one is the user's explicit choice ------------------------------------


def _mlp():
    src = planner.load_source(SAMPLES / "mlp.py")
    return src.model, src.example_inputs


def _crafted_archive(marker: Path) -> bytes:
    """A real torch.export archive of the MLP whose example inputs are a pickle that creates `marker` when loaded."""
    import torch

    class CreatesMarker:
        def __reduce__(self):
            return open, (str(marker), "w")

    buf = io.BytesIO()
    torch.export.save(torch.export.export(*_mlp()), buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info.filename, pickle.dumps(CreatesMarker()) if "/data/sample_inputs/" in info.filename else data)
    return out.getvalue()


def test_a_pt2_upload_runs_no_code_unless_trusted(tmp_path, monkeypatch):
    marker = tmp_path / "code_ran"
    at = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    before = at.session_state["model_ref"]
    upload(at, "mlp.py", (SAMPLES / "mlp.py").read_bytes())
    assert not [c for c in at.checkbox if c.label.startswith("Trust")], "the trust checkbox is only for .pt2 archives"
    upload(at, "crafted.pt2", _crafted_archive(marker))
    trust = [c for c in at.checkbox if c.label == "Trust this archive (it runs code from the file)"]
    assert len(trust) == 1 and trust[0].value is False  # off by default
    button(at, "Load uploaded model").click().run()
    assert "refusing to load the archive" in texts(at.error) and "sample_inputs" in texts(at.error)
    assert not marker.exists() and at.session_state["model_ref"] == before
    trust[0].check().run()
    button(at, "Load uploaded model").click().run()
    assert marker.exists()  # ticked: the loader was told to trust it (and the pickle ran)
    assert "refusing to load" not in texts(at.error)


TRUST_LABEL = "Trust this archive (it runs code from the file)"


def _loadable_crafted_archive(marker: Path) -> bytes:
    """Like _crafted_archive, but the pickle also gives back real example inputs: trusted, the archive loads and runs."""
    import torch

    class CreatesMarkerThenInputs:
        def __reduce__(self):
            return eval, (f"(open({str(marker)!r}, 'w').close(), ((__import__('torch').zeros(32, 64),), {{}}))[1]",)

    buf, payload = io.BytesIO(), io.BytesIO()
    torch.export.save(torch.export.export(*_mlp()), buf)
    torch.save(CreatesMarkerThenInputs(), payload)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, payload.getvalue() if "/data/sample_inputs/" in info.filename else src.read(info.filename))
    return out.getvalue()


def _load_trusted(at, content: bytes) -> None:
    upload(at, "crafted.pt2", content)
    [c for c in at.checkbox if c.label == TRUST_LABEL][0].check().run()
    button(at, "Load uploaded model").click().run()
    assert not at.error, texts(at.error)


def test_profile_page_verifies_a_trusted_archive_in_the_worker(tmp_path, monkeypatch):
    marker = tmp_path / "code_ran"
    at = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    _load_trusted(at, _loadable_crafted_archive(marker))
    marker.unlink()
    at.switch_page("views/profile.py").run()
    button(at, "Verify vs loop").click().run()
    deadline = time.time() + 180
    while at.session_state["job"] is not None and time.time() < deadline:
        time.sleep(1)
        at.run()
        if "job" not in at.session_state:
            break
    assert "refusing to load" not in texts(at.error) and "verify_result" in at.session_state, texts(at.error)
    assert "MATCH" in texts(at.success)
    assert marker.exists()  # the worker process loaded it trusted, as the user chose


def test_an_autosaved_trusted_archive_is_trusted_again_only_while_its_bytes_are_unchanged(tmp_path, monkeypatch):
    import hashlib

    marker = tmp_path / "code_ran_a"
    at = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    _load_trusted(at, _loadable_crafted_archive(marker))
    ref = at.session_state["model_ref"]
    digest = hashlib.sha256(Path(ref.path).read_bytes()).hexdigest()
    assert ref.trust_archive and ref.trusted_sha256 == digest
    rec = autosave.load()
    assert (rec.model_path, rec.trust_archive, rec.archive_sha256) == (ref.path, True, digest)

    again = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()  # a reload: a new session
    again.button(key="restore_autosave").click().run()
    assert not again.error and not again.warning, texts(again.error) + texts(again.warning)
    restored = again.session_state["model_ref"]
    assert (restored.path, restored.trust_archive, restored.trusted_sha256) == (ref.path, True, digest)
    assert autosave.load().archive_sha256 == digest  # saved again after the restore, still pinned to those bytes

    # The file is swapped for one running other code, with the same size and modification time, so
    # only hashing its bytes afresh (not a digest remembered per size and mtime) sees the change.
    other = tmp_path / "code_ran_b"
    info = os.stat(ref.path)
    swapped = _loadable_crafted_archive(other)
    assert len(swapped) == info.st_size and hashlib.sha256(swapped).hexdigest() != digest
    Path(ref.path).write_bytes(swapped)
    os.utime(ref.path, ns=(info.st_atime_ns, info.st_mtime_ns))
    changed = app_test(monkeypatch, tmp_path, SAMPLES / "transformer_block.py").run()
    changed.button(key="restore_autosave").click().run()
    assert "was trusted when it was saved, but the file has changed since" in texts(changed.warning)
    assert "refusing to load the archive" in texts(changed.error)  # opened untrusted: refused, nothing ran
    assert not other.exists()
    assert changed.session_state["model_ref"].label == "transformer_block.py"  # the open model is kept
