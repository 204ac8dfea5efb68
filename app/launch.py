"""Start the Streamlit app on 127.0.0.1 (what `stagewise ui [MODEL]` and `make run` call).

Access, as Jupyter does it: `main` makes a random token, hands it to the
Streamlit process in its environment (a web page cannot read that), and prints
and opens `http://127.0.0.1:PORT/?token=...`. The app (app.state.access_ui) does
nothing in a browser session that did not present it.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import webbrowser
from pathlib import Path
from typing import Sequence

APP_DIR = Path(__file__).resolve().parent
REPO_ROOT = APP_DIR.parent
MAIN = APP_DIR / "main.py"
MODEL_ENV = "STAGEWISE_MODEL"  # the model the app opens on (absolute path)
OPEN_ENV = "STAGEWISE_OPEN_MODULES"  # leaf modules it opens on that model (JSON list; `stagewise ui --open`)
TOKEN_ENV = "STAGEWISE_UI_TOKEN"  # the access token a browser session must present as ?token=
# Opt-out for running app/main.py without `stagewise ui` and without a token (`streamlit run`, demos):
# only the value "1" counts; without it a token-less app refuses every session.
NO_TOKEN_ENV = "STAGEWISE_UI_NO_TOKEN"
LOCAL_HOSTS = ("127.0.0.1", "localhost")  # the Host headers the server accepts (DNS rebinding)

# Security-relevant settings, passed as flags so they hold whatever the working
# directory's or the user's own .streamlit/config.toml says.
SERVER_FLAGS = (
    "--server.address=127.0.0.1",
    "--browser.serverAddress=127.0.0.1",
    "--browser.gatherUsageStats=false",
    "--server.enableXsrfProtection=true",
    "--server.maxUploadSize=512",
    "--server.enableCORS=true",
)
# DNS rebinding: a page on evil.example whose name re-resolves to 127.0.0.1 is same-origin with
# the app. Streamlit (1.67, starlette server) checks server.allowedHosts on the WebSocket every
# session runs over, so a browser that sends another Host gets no session at all. Plain HTTP
# routes (the static page, /_stcore/health) still answer any Host: they serve nothing private,
# and an upload needs a session. The app checks the session's Host header itself too, and the
# access token (TOKEN_ENV) is the lock that holds either way. The agent API (HTTP sessions
# without a browser) stays off whatever a user's config says.
GUARD_FLAGS = (*(f"--server.allowedHosts={h}" for h in LOCAL_HOSTS), "--server.enableAgentApi=false")


DEFAULT_PORT = 8501


def command(port: int | None = None, headless: bool = True) -> list[str]:
    """The `streamlit run` command line for the app.

    Always headless as far as streamlit is concerned: a non-headless first run
    stops at an e-mail prompt on the terminal. `main` opens the browser itself.
    """
    cmd = [sys.executable, "-m", "streamlit", "run", str(MAIN), *SERVER_FLAGS, "--server.headless=true"]
    cmd += [f for f in GUARD_FLAGS if _streamlit_has(f)]
    if port is not None:
        cmd.append(f"--server.port={int(port)}")
    return cmd


def _streamlit_has(flag: str) -> bool:
    """Whether the installed streamlit knows this `--section.option=...` (older ones lack the guards)."""
    from streamlit import config

    section, option = flag[2:].split("=", 1)[0].split(".", 1)
    return option in config.get_options_for_section(section)


def missing_guards() -> list[str]:
    """The guard options this streamlit lacks (`main` warns about them; the token still holds)."""
    return [f.split("=", 1)[0][2:] for f in dict.fromkeys(GUARD_FLAGS) if not _streamlit_has(f)]


def free_port(preferred: int = DEFAULT_PORT) -> int:
    """`preferred` if nothing listens on it on 127.0.0.1, else a free port the OS picks."""
    for candidate in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def _open_browser_when_up(url: str, port: int, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            webbrowser.open(url)
            return
        except OSError:
            time.sleep(0.3)


def new_token() -> str:
    """A fresh access token for one `stagewise ui` run (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def url(port: int, token: str | None) -> str:
    """The address to open: the app on 127.0.0.1 with its access token."""
    return f"http://127.0.0.1:{int(port)}/" + (f"?token={token}" if token else "")


def environment(model_path: str | os.PathLike | None = None, open_modules: Sequence[str] = ()) -> dict[str, str]:
    """os.environ plus the model to open (and its leaf modules to open) and the repository on PYTHONPATH.

    The access token is left out (workers started from the app get this environment too);
    `main` adds the token of its own run to the server's environment only.
    """
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if model_path is not None:
        p = Path(model_path).expanduser().resolve()
        if not p.is_file():
            from stagewise.planner.errors import ModelLoadError

            raise ModelLoadError(f"model file {model_path} does not exist; pass a .py model file or a .pt2 archive")
        env[MODEL_ENV] = str(p)
    if open_modules:
        env[OPEN_ENV] = json.dumps(list(open_modules))
    return env


def main(model_path: str | os.PathLike | None = None, port: int | None = None, headless: bool = False,
         open_modules: Sequence[str] = ()) -> int:
    """Run the app until interrupted; returns streamlit's exit code.

    Args:
        model_path: a .py model file or .pt2 archive to open on (default: a bundled sample).
        port: TCP port on 127.0.0.1 (default: streamlit's 8501, or the next free one).
        headless: do not open a browser window (one is opened once the server answers, when a browser exists).
        open_modules: leaf modules to open on that model (planner.trace's open_modules).
    """
    token = new_token()
    env = {**environment(model_path, open_modules), TOKEN_ENV: token}
    env.pop(NO_TOKEN_ENV, None)  # `stagewise ui` always asks for its token
    port = int(port) if port is not None else free_port()
    address = url(port, token)
    print(f"stagewise ui: open {address}\n  (localhost only; the token in the address is the key to this app: "
          "uploaded model files run as code, so do not share it). Ctrl-C stops it.", flush=True)
    for option in missing_guards():
        print(f"stagewise ui: warning: this streamlit has no {option} option, so that guard is off; "
              "`pip install -U streamlit` turns it on", flush=True)
    if not headless:
        threading.Thread(target=_open_browser_when_up, args=(address, port), daemon=True).start()
    proc = subprocess.Popen(command(port), env=env)
    # the server is our child: stopping `stagewise ui` (Ctrl-C or SIGTERM) must stop it too, never orphan it
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main(*(sys.argv[1:2] or [None])))
