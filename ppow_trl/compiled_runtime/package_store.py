"""Where the compiled runtime's packages live on disk, and how much of the disk they may take.

Layout: ``<compile cache>/packages/<settings key>-<weights digest>/rows<q>-of<K+1>-cache<len>.pt2``, one folder (a
*package set*) per weight set and settings (``ppow_trl.compiled_runtime.packaged``).

Why the store is bounded: a package embeds its weights, pre-packed for the GEMM kernels, at about twice the weights'
bytes (SmolLM2-135M fp32: 1.08 GB a package, 5.4 GB for the 5 row counts of K = 4), and every new weight set (each
trained drafter, each training run's cost model) gets a set of its own. Unbounded, a few days of main-job runs and
benchmarks filled a shared disk, and the next test run failed with "No space left on device". So:

- ``make_room`` runs before a build: it removes the least recently used *other* sets while the store (with the
  packages about to be written) would exceed ``$PPOW_TRL_PACKAGE_STORE_GB`` (default 20) or the disk would keep less
  than 1 GB free during the build. If removing every unused set could not free enough disk, it removes nothing and
  raises ``NotEnoughDisk`` (a clear message, before any compiling). The set being built is never removed, so a budget
  below one set's size only means that no older set is kept.
- A set is in use, and never removed, while a process loads or builds it: ``mark_used`` stamps it (its folder's
  modification time) when a build starts and before a load, and a set stamped in the last ``IN_USE_S`` seconds, or
  holding a build's temporary files, is skipped. "Least recently used" thus means used, not built.
- ``remove_build_outputs`` deletes what AOTInductor leaves in inductor's cache folder once packages are written (the
  wrapper library with the weights in it, and its C++ sources): as many bytes as the package again, never read.
  AOTInductor names that folder after the graph's code, not its weights, so two builds of one architecture share it:
  every build holds ``building()`` (a shared lock), and the folders are removed only when no build holds it.
- ``remove_stale_build_files`` deletes temporary files that killed builds left.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import shutil
import time
import zipfile
from pathlib import Path

from ..utils import cache_root

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

logger = logging.getLogger(__name__)

STORE_ENV = "PPOW_TRL_PACKAGE_STORE_GB"
DEFAULT_STORE_GB = 20.0
DISK_MARGIN_BYTES = 1 << 30  # left free for everything else on the disk
IN_USE_S = 600.0
STALE_BUILD_FILE_S = 24 * 3600.0  # a build's temporary file this old was left by a killed build
# Measured: SmolLM2 fp32 0.54 GB of weights -> 1.08 GB a package; its 2-layer drafter 0.107 -> 0.215 GB.
PACKAGE_BYTES_PER_WEIGHT_BYTE = 2
# During a build, besides its package: the exported step (1x) and AOTInductor's build folder (2x).
BUILD_BYTES_PER_WEIGHT_BYTE = 3
BUILD_LOCK = "package-builds.lock"


class NotEnoughDisk(OSError):
    """The disk cannot hold the packages to build, even after removing unused ones."""


def package_path(folder: Path, digest: str, rows: int, max_rows: int, max_cache_len: int) -> Path:
    """``folder/packages/<digest>/rows<q>-of<K+1>-cache<len>.pt2``: one graph of one model."""
    return Path(folder) / "packages" / digest / f"rows{rows}-of{max_rows}-cache{max_cache_len}.pt2"


def store_budget_bytes() -> int:
    """``$PPOW_TRL_PACKAGE_STORE_GB`` (default ``DEFAULT_STORE_GB``) in bytes: what the store may keep, the packages
    about to be built included (older sets are removed to stay under it; the set being built never is)."""
    value = os.environ.get(STORE_ENV, "").strip()
    if not value:
        return int(DEFAULT_STORE_GB * 1e9)
    try:
        gigabytes = float(value)
    except ValueError:
        gigabytes = -1.0
    if not gigabytes >= 0:  # also rejects nan
        raise ValueError(f"{STORE_ENV}={value!r}: give the gigabytes the compiled runtime's packages may keep on disk, "
                         f"a number >= 0 (unset: {DEFAULT_STORE_GB:g}).")
    return int(gigabytes * 1e9)


def package_bytes(weight_bytes: int, packages: int) -> int:
    """Disk that ``packages`` new packages keep: ``2 x weights`` each (``PACKAGE_BYTES_PER_WEIGHT_BYTE``)."""
    return weight_bytes * PACKAGE_BYTES_PER_WEIGHT_BYTE * packages


def build_bytes(weight_bytes: int, packages: int, workers: int) -> int:
    """Disk a build needs at its peak: the packages it keeps (``package_bytes``) plus ``3 x weights`` per build in
    progress (``BUILD_BYTES_PER_WEIGHT_BYTE``)."""
    return package_bytes(weight_bytes, packages) + weight_bytes * BUILD_BYTES_PER_WEIGHT_BYTE * min(workers, packages)


def mark_used(package_set: Path) -> None:
    """Stamp ``package_set`` (a folder of packages) as used now: ``make_room`` removes the least recently used first."""
    with contextlib.suppress(OSError):
        os.utime(package_set)


def package_sets(package_set: Path) -> list[Path]:
    """Every package set of the store that ``package_set`` belongs to: its siblings, and the sets of every settings key
    under ``cache_root()/inductor`` (a folder chosen with ``TORCHINDUCTOR_CACHE_DIR`` has only its own)."""
    found = set(Path(package_set).parent.glob("*"))
    found |= set((cache_root() / "inductor").glob("*/packages/*"))
    return sorted(folder for folder in found if folder.is_dir())


def _bytes(folder: Path) -> int:
    total = 0
    for file in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += file.stat().st_size if file.is_file() else 0
    return total


def _in_use(folder: Path, now: float) -> bool:
    """Stamped in the last ``IN_USE_S`` seconds, or holding a build's temporary files (a build in progress; files
    left by a killed build go after a day, ``remove_stale_build_files``)."""
    if now - folder.stat().st_mtime < IN_USE_S:
        return True
    return any(now - file.stat().st_mtime < STALE_BUILD_FILE_S for file in _build_files(folder))


def make_room(package_set: Path, keep: int, peak: int) -> list[Path]:
    """Before building into ``package_set`` packages that keep ``keep`` bytes and need ``peak`` bytes of disk while
    they build: remove the least recently used other sets not in use while ``store + keep > budget`` or
    ``free - peak < 1 GB``; the sets removed. Raises ``NotEnoughDisk``, removing nothing, when removing every unused
    set could not give ``peak`` bytes and 1 GB to spare (module docstring)."""
    package_set = Path(package_set)
    package_set.mkdir(parents=True, exist_ok=True)
    budget = store_budget_bytes()
    now = time.time()
    others = []  # (last used, folder, bytes) of the sets that may go
    stored = _bytes(package_set)
    for folder in package_sets(package_set):
        if folder.resolve() == package_set.resolve():
            continue
        with contextlib.suppress(OSError):
            size = _bytes(folder)
            stored += size
            if not _in_use(folder, now):
                others.append((folder.stat().st_mtime, folder, size))
    free = shutil.disk_usage(package_set).free
    if free + sum(size for _, _, size in others) - peak < DISK_MARGIN_BYTES:
        raise NotEnoughDisk(
            f"about {(peak + DISK_MARGIN_BYTES) / 1e9:.1f} GB free needed to build the compiled runtime's packages, "
            f"{free / 1e9:.1f} GB free: free disk space, set PPOW_TRL_CACHE to a larger disk, or serve with runtime: "
            f"eager (packages in {package_set.parent})")
    others.sort()  # least recently used first
    removed, freed = [], 0
    for _, folder, size in others:
        if stored + keep <= budget and shutil.disk_usage(package_set).free - peak >= DISK_MARGIN_BYTES:
            break
        shutil.rmtree(folder, ignore_errors=True)
        stored -= size
        freed += size
        removed.append(folder)
    if removed:
        logger.info("Removed %d unused package set(s) (%.1f GB) to keep the package store under %.0f GB (%s) and the "
                    "disk from filling.", len(removed), freed / 1e9, budget / 1e9, STORE_ENV)
    return removed


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is the disk running full."""
    while error is not None:
        if isinstance(error, NotEnoughDisk) or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def building(inductor_cache: Path):
    """Held (a shared ``flock`` on ``<inductor cache>/package-builds.lock``, released when the file closes) while a
    package builds in ``inductor_cache``: ``remove_build_outputs`` removes nothing while any process holds it. Without
    ``flock`` (Windows) nothing is locked, and ``remove_build_outputs`` keeps the folders."""
    Path(inductor_cache).mkdir(parents=True, exist_ok=True)
    with open(Path(inductor_cache) / BUILD_LOCK, "a+") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield


def remove_build_outputs(packages: list[Path], inductor_cache: Path) -> bool:
    """Delete AOTInductor's builds of ``packages`` from ``inductor_cache`` (the folders holding the wrapper libraries
    the packages contain, ``<key>.wrapper.so``, with the weights in them, and their C++ sources), unless a build is in
    progress there (``building``): another build of the same architecture writes into the same folders. Whether they
    were removed. Packaging copied them into the packages; nothing reads them again."""
    if fcntl is None:  # no way to know that no build runs: a leftover only costs disk
        return False
    with open(Path(inductor_cache) / BUILD_LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
        except BlockingIOError:
            return False
        for package in packages:
            with zipfile.ZipFile(package) as archive:
                libraries = {Path(name).name for name in archive.namelist() if name.endswith(".wrapper.so")}
            for library in libraries:
                for built in Path(inductor_cache).glob(f"*/{library}"):
                    shutil.rmtree(built.parent, ignore_errors=True)
    return True


def _build_files(folder: Path):
    """The temporary files of builds in ``folder``: exported steps and packages being written."""
    return itertools.chain(Path(folder).glob("*.exported.pt2"), Path(folder).glob("*.partial.pt2"))


def remove_stale_build_files(folder: Path, older_than_s: float = STALE_BUILD_FILE_S) -> None:
    """Delete the temporary files of builds that were killed (``*.exported.pt2``, ``*.partial.pt2``) in ``folder``,
    once they are older than any build takes (another process may be building into the same folder now)."""
    now = time.time()
    for stale in _build_files(folder):
        with contextlib.suppress(OSError):
            if now - stale.stat().st_mtime > older_than_s:
                stale.unlink()
