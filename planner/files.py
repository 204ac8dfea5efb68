"""Writing files the user keeps (plans, the autosave, traces) so that no reader ever sees half of one.

Imports nothing of ours, so every layer can use it; failures are plain OSErrors
that the caller turns into its own one-line StagewiseError.

Each write goes to a temp file with a unique name in the destination's folder
(so concurrent writers never share one), is fsynced, then moved over the
destination with os.replace (atomic on POSIX and Windows). A failed write
removes its temp file.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) in one step; returns the path.

    Raises:
        OSError when the folder is missing or not writable, or the disk is full;
        the destination is then unchanged and no temp file is left behind.
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with temp_beside(path, must_fill=False) as tmp:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    return path


@contextlib.contextmanager
def temp_beside(path: str | os.PathLike, *, must_fill: bool = True) -> Iterator[Path]:
    """A fresh temp file name beside `path` for a writer that wants a file name.

    When the block ends without an exception the temp file is moved onto `path`;
    when it raises, or (with `must_fill`) leaves it empty or missing, the temp file
    is removed and `path` is untouched; the empty case raises FileNotFoundError, so
    nobody reports a file that was never written. The temp name ends like `path` (".json.gz" stays
    ".json.gz"), for writers that choose a format by suffix. A symbolic link is followed: its target is replaced
    (beside the target), and the link stays a link.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp-{path.name}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if must_fill and (not tmp.is_file() or tmp.stat().st_size == 0):
            raise FileNotFoundError(f"nothing was written to {path}")
        os.chmod(tmp, mode_for(path))  # mkstemp makes 0600; give the file the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def writable_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be written (a short phrase), or None when it can; creates nothing that stays.

    Checked by making (and removing) a temp file in its folder, the same way
    write_atomic writes, so permissions, read-only disks and missing folders show.
    """
    path = Path(path)
    if path.is_dir():
        return "it is a folder"
    if path.exists() and (not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222):
        return "it is read-only (an atomic replace would go past that; make it writable first)"  # root: by its mode bits
    folder = path.parent
    if not folder.is_dir():
        return f"the folder {folder} does not exist"
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".check")
    except OSError as e:
        return f"the folder {folder} is not writable ({e.strerror})"
    os.close(fd)
    os.unlink(name)
    return None


def mode_for(path: Path) -> int:
    """The destination's current mode, or what a new file gets under the process umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask without changing it (os.umask can only set it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:  # no /proc (macOS, Windows): assume the usual umask
        return 0o022
    return 0o022


def fsync_folder(folder: Path) -> None:
    """Make the rename itself durable; best effort, since some systems cannot open a folder."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # e.g. a folder we may write but not read: the data itself is already fsynced
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder; the file is already fsynced
            os.fsync(fd)
    finally:
        os.close(fd)
