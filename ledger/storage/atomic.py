"""File-level writes that readers can trust: atomic (temp file, fsync, os.replace, the folder
fsynced), locked (``PATH.lock`` beside the symlink's target), mode-preserving, and tidy after a
killed writer. Knows nothing of ledgers: ``ledger.storage.store`` writes ledgers through it, the site its
pages."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import tempfile
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from ledger.core.errors import Issue, LedgerError

LOCK_TIMEOUT_S = 60.0


def _file_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def real_path(path: str | os.PathLike) -> Path:
    """The file a path names, through symlinks: writing replaces the target, not the link, and
    writers that use the link and the target take the same lock."""
    return Path(os.path.realpath(os.fspath(path)))


def _os_error(path: str | os.PathLike, exc: OSError) -> LedgerError:
    why = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        why += " (the old file is left as it was)"
    return LedgerError(Issue(str(path), "", f"cannot write: {why}"))


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def remove_stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """Remove temp files that writers of ``path`` left when they were killed mid-write (their
    process is gone). Each temp file's name carries its writer's pid."""
    path = real_path(path)
    removed = []
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f"{glob.escape(_temp_prefix(path))}*.tmp"):
            pid = tmp.name[len(_temp_prefix(path)):].split(".", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    tmp.unlink()
                    removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file so that readers see either the old or the new content, never a mix. A
    symlink is followed (its target is replaced); an OS error (read-only folder, full disk, a
    folder in the way) is one LedgerError line, and the old file is left as it was."""
    shown_path = path
    path = real_path(path)
    try:
        if path.is_dir():
            raise LedgerError(Issue(str(shown_path), "", "is a directory, not a file"))
        if path.exists() and not path.stat().st_mode & 0o222:
            # A rename replaces a file whatever its mode: a file its owner made read-only is kept.
            raise LedgerError(Issue(str(shown_path), "", f"is read-only (mode {path.stat().st_mode & 0o777:04o}): not "
                                    "replaced; make it writable (chmod u+w) to write to it"))
        path.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode("utf-8")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp")
    except OSError as exc:
        raise _os_error(shown_path, exc) from None
    except UnicodeEncodeError as exc:
        raise LedgerError(Issue(str(shown_path), "", f"cannot write: {exc.reason} in the text")) from None
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp makes 0600; keep the file's mode, else the umask's
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _os_error(shown_path, exc) from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@contextlib.contextmanager
def locked(path: str | os.PathLike, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the ledger's lock file (``PATH.lock``, beside the symlink's target) for a
    read-modify-write cycle; temp files of killed writers are cleared once it is held."""
    target = real_path(path)
    lock = FileLock(f"{target}.lock", timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise LedgerError(Issue(str(path), "", f"could not lock {target}.lock within {timeout:.0f} s")) from None
    except OSError as exc:
        raise LedgerError(Issue(str(path), "", f"cannot lock {target}.lock: {exc.strerror or exc}")) from None
    try:
        remove_stale_temp_files(target)
        yield
    finally:
        lock.release()
