"""Where pdserve keeps generated models, and how directories there are written safely."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class CacheUnwritable(RuntimeError):
    """The cache directory cannot be created or written."""


def cache_dir() -> Path:
    """``$PDSERVE_CACHE``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve`` (not created)."""
    explicit = os.environ.get("PDSERVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pdserve"


def models_cache_dir() -> Path:
    """The folder holding converted and generated model directories (not created)."""
    return cache_dir() / "models"


def _temp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``final``; rename it to ``final`` on success.

    Readers therefore see either no ``final`` or a complete one; on any error (Ctrl-C included)
    the temporary directory is removed. ``final`` may exist only as an empty directory.
    """
    final = Path(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"{final} already exists and is not an empty directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(final), dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the result is an ordinary shared directory
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_once(final: Path, build: Callable[[Path], object]) -> Path:
    """Return ``final``, first calling ``build(final)`` if it does not exist yet.

    ``build`` must create ``final`` atomically (see :func:`atomic_directory`). An inter-process
    lock makes a racing second process wait for the first instead of building a second copy.
    """
    final = Path(final)
    if final.is_dir():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # The lock file stays behind on purpose: deleting it would let a third process lock a new
        # inode while a second one still holds the old.
        lock = open(final.parent / f".{final.name}.lock", "a")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise CacheUnwritable(
            f"cannot write {final.name} into the cache {final.parent}: {e.strerror} "
            "(set PDSERVE_CACHE to a writable directory)"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if final.is_dir():  # another process built it while this one waited for the lock
            return final
        # Holding the lock, any temporary directory of this target was left by a killed process.
        for stale in final.parent.glob(_temp_prefix(final) + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        build(final)
    return final
