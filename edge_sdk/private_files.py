"""Files that hold private data (private contexts, evidence spans, reconstructions, decoded answers, the activity log).

Each is created (or narrowed, when it exists) to mode 0600, and every folder made for it is created 0700, so
another user of the machine reads none of it whatever the umask. A folder that already exists (the working
directory, a shared ``runs/``) is left as it is: the files in it are what is protected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

FILE_MODE = 0o600
DIR_MODE = 0o700

_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "r+": os.O_RDWR | os.O_CREAT}


def private_dir(path: str | Path) -> Path:
    """``path`` as a folder: each missing level created 0700 (existing ones left alone)."""
    path = Path(path)
    missing = []
    for level in (path, *path.parents):
        if level.exists():
            break
        missing.append(level)
    for level in reversed(missing):
        try:
            level.mkdir(mode=DIR_MODE)
        except FileExistsError:  # made meanwhile by another process
            continue
        level.chmod(DIR_MODE)  # mkdir's mode is masked by the umask
    return path


def open_private(path: str | Path, mode: str = "w", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for a private file: ``w``, ``a``, ``r+`` (text) or with ``b``; the file is created
    0600, or narrowed to 0600 if it was there, and its folder made by :func:`private_dir`."""
    path = Path(path)
    private_dir(path.parent)
    flags = _FLAGS[mode.replace("b", "")]
    descriptor = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(descriptor, FILE_MODE)
        return os.fdopen(descriptor, mode, **kwargs)
    except BaseException:
        os.close(descriptor)
        raise


def write_private_text(path: str | Path, text: str) -> None:
    """``path`` holds ``text`` (UTF-8), a private file (:func:`open_private`)."""
    with open_private(path, "w", encoding="utf-8") as out:
        out.write(text)


def make_private(path: str | Path) -> None:
    """Narrow a file another library wrote (a figure) to 0600."""
    Path(path).chmod(FILE_MODE)
