"""Start the Streamlit app on 127.0.0.1 (what `stagewise ui [MODEL]` and `make run` call)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import webbrowser
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
REPO_ROOT = APP_DIR.parent
MAIN = APP_DIR / "main.py"
MODEL_ENV = "STAGEWISE_MODEL"  # the model the app opens on (absolute path)

# Security-relevant settings, passed as flags so they hold whatever the working
# directory's or the user's own .streamlit/config.toml says.
SERVER_FLAGS = (
    "--server.address=127.0.0.1",
    "--browser.serverAddress=127.0.0.1",
    "--browser.gatherUsageStats=false",
    "--server.enableXsrfProtection=true",
    "--server.maxUploadSize=512",
)


DEFAULT_PORT = 8501


def command(port: int | None = None, headless: bool = True) -> list[str]:
    """The `streamlit run` command line for the app.

    Always headless as far as streamlit is concerned: a non-headless first run
    stops at an e-mail prompt on the terminal. `main` opens the browser itself.
    """
    cmd = [sys.executable, "-m", "streamlit", "run", str(MAIN), *SERVER_FLAGS, "--server.headless=true"]
    if port is not None:
        cmd.append(f"--server.port={int(port)}")
    return cmd


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


def environment(model_path: str | os.PathLike | None = None) -> dict[str, str]:
    """os.environ plus the model to open and the repository on PYTHONPATH (the app imports planner/executor)."""
    env = dict(os.environ)
    if model_path is not None:
        p = Path(model_path).expanduser().resolve()
        if not p.is_file():
            from planner.errors import ModelLoadError

            raise ModelLoadError(f"model file {model_path} does not exist; pass a .py model file or a .pt2 archive")
        env[MODEL_ENV] = str(p)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    return env


def main(model_path: str | os.PathLike | None = None, port: int | None = None, headless: bool = False) -> int:
    """Run the app until interrupted; returns streamlit's exit code.

    Args:
        model_path: a .py model file or .pt2 archive to open on (default: a bundled sample).
        port: TCP port on 127.0.0.1 (default: streamlit's 8501, or the next free one).
        headless: do not open a browser window (one is opened once the server answers, when a browser exists).
    """
    env = environment(model_path)
    port = int(port) if port is not None else free_port()
    url = f"http://127.0.0.1:{port}/"
    print(f"stagewise ui: serving on {url} (localhost only; uploaded model files run as code). Ctrl-C stops it.")
    if not headless:
        threading.Thread(target=_open_browser_when_up, args=(url, port), daemon=True).start()
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
