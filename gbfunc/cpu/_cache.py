"""A private cache directory for the CPU loops' builds: a library is only loaded from a folder
that no other user can write to.

A shared library runs code as it is loaded, so a build folder someone else can write to is a
way into the process (another user of a login node plants a library of the expected name).
The cache therefore follows the platform's per-user convention (`$XDG_CACHE_HOME/gbfunc`,
`~/.cache/gbfunc`), every folder of it from `gbfunc` down is created with mode 0700, and a
folder or file is used only when it is owned by the current user and not writable by group
or others (`unsafe_reason`); the folders above the root only where no other user could
replace the root in them (`unsafe_ancestor`: owned by root or the user, and writable by
nobody else unless sticky, as `/tmp`).
"""

import os
import stat
import sys
from pathlib import Path

# Overrides the cache's root folder (the `gbfunc` folder itself), e.g. on a node-local disk.
CACHE_VARIABLE = "GBFUNC_CACHE_DIR"


def cache_root() -> Path:
    """The root of gbfunc's cache: `$GBFUNC_CACHE_DIR` (`~` expanded, relative to the current
    folder if relative), else the platform's per-user cache folder with `gbfunc` appended
    (`$XDG_CACHE_HOME` or `~/.cache` on Linux)."""
    override = os.environ.get(CACHE_VARIABLE)
    if override:  # "~/..." as written in a quoted assignment; a relative path made absolute
        return Path(override).expanduser().absolute()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gbfunc"


def private_folder(root: Path, *parts: str) -> Path:
    """`root / parts...`, each folder from `root` down created with mode 0700 where missing.

    Raises:
        PermissionError: `root`, a folder above it (`unsafe_ancestor`) or one below it
            (`unsafe_reason`) is unsafe.
    """
    folders = [root] + [root.joinpath(*parts[: i + 1]) for i in range(len(parts))]
    reason = unsafe_ancestor(root)
    if reason:
        raise PermissionError(reason)
    for i, folder in enumerate(folders):
        try:
            folder.mkdir(mode=0o700, parents=i == 0)
            folder.chmod(0o700)  # mkdir's mode is masked by the umask; only ours is changed
        except FileExistsError:
            pass
        reason = unsafe_reason(folder, directory=True)
        if reason:
            raise PermissionError(reason)
    return folders[-1]


def unsafe_reason(path: Path, *, directory: bool) -> str | None:
    """Why `path` must not be trusted, or None: it is a link, not a folder (or not a regular
    file), owned by another user, or writable by group or others."""
    info = os.lstat(path)
    kind = "folder" if directory else "file"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link, not a {kind}"
    if directory and not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if not directory and not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{path} is owned by user {info.st_uid}, not by the current user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def unsafe_ancestor(root: Path) -> str | None:
    """Why a folder above `root` (links resolved) lets another user replace `root`, or None:
    one owned by a user other than root and the current one, or writable by group or others
    without the sticky bit (which keeps others from renaming what is not theirs)."""
    if not hasattr(os, "getuid"):
        return None
    for parent in Path(os.path.realpath(root)).parents:
        try:
            info = os.stat(parent)
        except FileNotFoundError:  # made by `private_folder`, as the current user
            continue
        if info.st_uid not in (0, os.getuid()):
            return (
                f"{parent}, above the cache folder {root}, is owned by user {info.st_uid}, who "
                "could replace the folder"
            )
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and not info.st_mode & stat.S_ISVTX:
            mode = f"{stat.S_IMODE(info.st_mode):o}"
            return (
                f"{parent}, above the cache folder {root}, is writable by group or others "
                f"without the sticky bit (mode {mode}), so another user could replace the folder"
            )
    return None
