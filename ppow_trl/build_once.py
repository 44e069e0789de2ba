"""Build-once folders: an expensive cache that every process of a job asks for, built by one process per machine.

The offline target converted from its GGUF is the example: `accelerate launch` starts two processes on an empty
cache, both ask for the same folder at the same moment, and it must be built once, completely, whoever asks first.

`build_once(folder, build, required=...)`:

1. **Complete folders are used as they are.** A folder is complete when every ``required`` file is in it and the
   marker ``.ppow-complete`` is too. The marker is written last, inside the temporary folder, before the rename.
2. **One builder per machine.** Under torch.distributed with several processes, the local main process of each
   machine (``LOCAL_RANK`` 0) builds; the others wait for its folder (`MAIN_PROCESS_GRACE_SECONDS`), then take
   the lock, which they get once the builder is done, and find the folder complete. Every caller also takes a
   file lock around the build, so separate processes (no torch.distributed, several jobs sharing one cache) take
   turns: the first builds, the others find the folder complete. This is not a collective: a process may call it
   alone (rank 0 only), and when the local main process never asks or dies, another process builds instead of
   waiting at a barrier forever.
3. **Atomic.** The builder writes into a temporary folder private to its process, checks that every required file
   is there, writes the marker and renames the folder into place. A folder at its final name is never half-written.
4. **Recovers from killed runs.** The lock is `filelock.FileLock`, an ``flock`` lock on Linux and macOS: the kernel
   releases it when its holder dies, so a killed run leaves only a lock file that the next caller takes (on a file
   system without ``flock``, filelock falls back to a lock file that a killed holder leaves behind: delete it).
   A folder at the final name without a matching marker (a run killed midway under an older version, a folder
   emptied by hand, other inputs: see ``key``) and the temporary folders of killed builders are removed, with a
   warning, and the folder is built again.

`build(tmp)` must write everything into ``tmp`` itself and must not depend on the process's rank: transformers >= 5.25
writes ``save_pretrained`` weights only on torch.distributed rank 0 (`ppow_trl.offline` writes its weights with
safetensors for that reason), and the local main process of a second machine is not rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = ".ppow-complete"
# How long a caller waits for another process's lock before saying so (it keeps waiting: builds can be slow).
LOCK_REPORT_SECONDS = 30.0
# How long the other processes of a torch.distributed group let their local main process start the build.
MAIN_PROCESS_GRACE_SECONDS = 20.0


def is_complete(folder: str | Path, required: Iterable[str] = (), key: str | None = None) -> bool:
    """Whether ``folder`` holds a finished build: every ``required`` file, and its completion marker, which names
    ``key`` when one is given (a folder built from other inputs, or by another version, is not complete)."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in required):
        return False
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return key is None or marker.get("key") == key


def build_once(folder: str | Path, build: Callable[[Path], None], *, required: Iterable[str] = (),
               key: str | None = None, what: str | None = None) -> Path:
    """Return ``folder``, built by ``build(tmp)`` on one process per machine if it is not complete (module docstring).

    Args:
        folder: the final folder; its parent is created.
        build: writes the folder's content into the temporary folder it is given (which exists and is empty).
        required: file names (relative to the folder) that a complete build has; checked before the rename.
        key: what the content depends on (input fingerprint, format version), kept in the marker; a folder whose
            marker names another key is built again.
        what: a few words for messages (default: the folder's name).

    Raises:
        RuntimeError: the build finished without a required file (nothing is published; the message names them).
    """
    folder, required, what = Path(folder), tuple(required), what or Path(folder).name
    if is_complete(folder, required, key):
        return folder
    if _distributed_group_size() > 1 and not _is_local_main_process():
        # Leave the build to this machine's local main process: wait for its folder. A barrier would hang when the
        # main process never asks (a caller on rank 0 only) or dies; after the grace period we go through the lock
        # ourselves, which waits while the main process builds and finds its folder complete afterwards.
        deadline = time.monotonic() + MAIN_PROCESS_GRACE_SECONDS
        while time.monotonic() < deadline:
            if is_complete(folder, required, key):
                return folder
            time.sleep(0.2)
    return _build_locked(folder, build, required, key, what)


def _build_locked(folder: Path, build: Callable[[Path], None], required: tuple[str, ...], key: str | None,
                  what: str) -> Path:
    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=LOCK_REPORT_SECONDS)
    except Timeout:
        logger.warning("%s: waiting for another process that builds %s (lock %s).", what, folder, lock.lock_file)
        lock.acquire()
    try:
        if is_complete(folder, required, key):  # built by the process that held the lock before us
            return folder
        _remove_leftovers(folder, required, what)
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
        try:
            started = time.perf_counter()
            build(tmp)
            missing = _missing(tmp, required, marker=False)
            if missing:
                raise RuntimeError(f"{what}: the build finished without {', '.join(missing)} in {tmp}; "
                                   "nothing was published.")
            (tmp / MARKER).write_text(json.dumps({"what": what, "key": key, "required": list(required),
                                                  "seconds": round(time.perf_counter() - started, 1)}))
            os.rename(tmp, folder)  # atomic within one file system: the final name only ever holds a finished build
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder
    finally:
        lock.release()


def _remove_leftovers(folder: Path, required: tuple[str, ...], what: str) -> None:
    """Under the lock: drop an incomplete or outdated folder at the final name and the temporary folders of killed
    builders."""
    if folder.exists():
        missing = _missing(folder, required)
        why = (f"missing {', '.join(missing)}: written by an older ppow_trl or a run killed midway" if missing
               else "built from other inputs or by another version")
        logger.warning("%s: %s is incomplete or outdated (%s); rebuilding it.", what, folder, why)
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    for leftover in folder.parent.glob(f"{folder.name}.tmp-*"):
        # Every builder holds the lock while its temporary folder exists, so these belong to dead processes.
        logger.warning("%s: removing %s, left by a build that did not finish.", what, leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _missing(folder: Path, required: Iterable[str], marker: bool = True) -> list[str]:
    names = list(required) + ([MARKER] if marker else [])
    return [name for name in names if not (folder / name).is_file()]


def _distributed_group_size() -> int:
    """The world size of an initialised torch.distributed default group, else 1."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _is_local_main_process() -> bool:
    """``LOCAL_RANK`` 0 (torchrun, accelerate launch); the global rank 0 when no launcher set it."""
    import torch.distributed as dist

    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) == 0 if local_rank is not None else dist.get_rank() == 0
