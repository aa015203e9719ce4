"""Atomic writes of files and folders, so an interrupted run never leaves a half-written file or
a half-replaced folder under the final name.

A file is written to a temp file in the same folder, fsynced, then renamed over the target
(several files: every temp file first, then the renames: `atomic_write_all`). A folder is built
in full in a hidden sibling, then swapped in with two renames (see `replace_folder`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` and atomically move the result to `path` (parents created)."""
    atomic_write_all({path: write})


def atomic_write_all(writes: dict[Path, Callable[[str], None]]) -> None:
    """All or nothing: for each (path, write), `write(tmp_path)` into a temp file beside `path`
    (parents created), fsynced, with the mode of the file it replaces (new files: 0666 less the
    umask); only when every write succeeded are the temp files renamed over their paths. Raises
    what a write raises (OSError, ...) after removing the temp files; no path has changed then."""
    tmps = {}
    try:
        for path, write in writes.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmps[path] = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            write(tmps[path])
            # mkstemp (and safetensors) make 0600: give the replaced file's mode, or the usual one
            os.chmod(tmps[path], stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_umask())
            with open(tmps[path], "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    for path, tmp in tmps.items():
        os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def publish_folder(folder: Path, build: Callable[[Path], None], *, done: Callable[[Path], bool]) -> None:
    """Make the new folder `folder` by `build(staging)` into an absent path in a hidden temporary sibling, then
    one rename: an interrupted build leaves nothing under the final name (its sibling is removed). When the rename
    fails because a concurrent build finished first (`done(folder)`: e.g. another rank's), that one is kept."""
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}.", dir=folder.parent) as tmp:
        staging = Path(tmp) / folder.name
        build(staging)
        try:
            os.rename(staging, folder)
        except OSError:
            if not done(folder):
                raise


def replace_folder(folder: Path, write: Callable[[Path], None], *, replaces: Callable[[str], bool]) -> None:
    """Make `folder` hold what `write(tmp)` writes into an empty folder, plus every entry of the
    existing `folder` that `write` did not write and `replaces(name)` does not claim.

    `write` fills a fresh hidden sibling `.NAME.tmp-XXXX`; the entries to keep are hard-linked (copied where
    linking fails) into it; then the old folder is renamed to `.NAME.old-XXXX`, the new one to `folder`, and the
    old one removed. An interruption before the first rename leaves the old folder untouched (and a `.NAME.tmp-*`
    sibling to delete); between the two renames the old folder is whole at `.NAME.old-*` and `folder` is absent. A
    symlinked `folder` is replaced at its target. Raises NotADirectoryError when `folder` is a file."""
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} exists and is not a folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(folder, "tmp")
    tmp.mkdir()
    try:
        write(tmp)
        if folder.is_dir():
            _carry_over(folder, tmp, replaces)
            shutil.copymode(folder, tmp)
        _fsync_dir(tmp)
        swap_in(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_in(new: Path, folder: Path) -> None:
    """Rename the folder `new` to `folder`, replacing a folder there by two renames (`replace_folder`)."""
    try:
        cwd = Path.cwd()
    except FileNotFoundError:
        cwd = None
    if not folder.exists():
        os.rename(new, folder)
    else:
        old = sibling(folder, "old")
        os.rename(folder, old)
        try:
            os.rename(new, folder)
        except BaseException:
            os.rename(old, folder)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(folder.parent)
    if cwd is not None and cwd.is_relative_to(folder) and cwd.is_dir():
        os.chdir(cwd)  # the process's cwd was inside the replaced folder: move into the new one


def _carry_over(old: Path, new: Path, replaces: Callable[[str], bool]) -> None:
    for entry in os.scandir(old):
        dst = new / entry.name
        if replaces(entry.name) or os.path.lexists(dst):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        elif entry.is_dir():
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sibling(path: Path, tag: str) -> Path:
    """An unused hidden name beside `path`: `.NAME.TAG-XXXXXXXX`."""
    while True:
        candidate = path.with_name(f".{path.name}.{tag}-{secrets.token_hex(4)}")
        if not os.path.lexists(candidate):
            return candidate


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
