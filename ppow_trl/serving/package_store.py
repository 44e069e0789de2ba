"""Where the compiled runtime's packages live on disk, and how much of the disk they may take.

Layout: ``<compile cache>/packages/<settings key>-<weights digest>/rows<q>-of<K+1>-cache<len>.pt2``, one folder (a
*package set*) per weight set and settings (``ppow_trl.serving.packaged``).

Why the store is bounded: a package embeds its weights, pre-packed for the GEMM kernels, at about twice the weights'
bytes (SmolLM2-135M fp32: 1.08 GB a package, 5.4 GB for the 5 row counts of K = 4), and every new weight set (each
trained drafter, each training run's cost model) gets a set of its own. Unbounded, a few days of main-job runs and
benchmarks filled a shared disk, and the next test run failed with "No space left on device". So:

- ``make_room`` runs before a build: it removes the least recently used *other* package sets while the store would
  exceed ``$PPOW_TRL_PACKAGE_STORE_GB`` (default 20) or the disk would keep less than 1 GB free, and raises
  ``NotEnoughDisk`` (a clear message, before any compiling) when the disk still lacks room. The set being built is
  never removed, so a budget below one set's size only means that no older set is kept.
- ``mark_used`` stamps a set when a process loads it (its folder's modification time), so that "least recently used"
  means used, not built. A set stamped in the last ``IN_USE_S`` seconds is never removed: another process may be
  loading it.
- ``remove_build_outputs`` deletes what AOTInductor leaves in inductor's cache folder once a package is written (the
  wrapper library with the weights in it, and its C++ sources): as many bytes as the package again, never read.
- ``remove_stale_build_files`` deletes temporary files that killed builds left.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import time
import zipfile
from pathlib import Path

from ..utils import cache_root

logger = logging.getLogger(__name__)

STORE_ENV = "PPOW_TRL_PACKAGE_STORE_GB"
DEFAULT_STORE_GB = 20.0
DISK_MARGIN_BYTES = 1 << 30  # left free for everything else on the disk
IN_USE_S = 600.0
PACKAGE_BYTES_PER_WEIGHT_BYTE = 2  # measured: SmolLM2 fp32 0.54 GB -> 1.08 GB a package; its 2-layer drafter 0.107 -> 0.215
BUILD_BYTES_PER_WEIGHT_BYTE = 3  # during a build, besides its package: the exported step (1x) and AOTInductor's build (2x)


class NotEnoughDisk(OSError):
    """The disk cannot hold the packages to build, even after removing unused ones."""


def package_path(folder: Path, digest: str, rows: int, max_rows: int, max_cache_len: int) -> Path:
    """``folder/packages/<digest>/rows<q>-of<K+1>-cache<len>.pt2``: one graph of one model."""
    return Path(folder) / "packages" / digest / f"rows{rows}-of{max_rows}-cache{max_cache_len}.pt2"


def store_budget_bytes() -> int:
    """``$PPOW_TRL_PACKAGE_STORE_GB`` (default ``DEFAULT_STORE_GB``) in bytes: what the package sets other than the one
    being built may keep on disk."""
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


def build_bytes(weight_bytes: int, packages: int, workers: int) -> int:
    """Disk a build needs at its peak: ``2 x weights`` per package written, plus ``3 x weights`` per build in
    progress (``PACKAGE_BYTES_PER_WEIGHT_BYTE``, ``BUILD_BYTES_PER_WEIGHT_BYTE``)."""
    return weight_bytes * (PACKAGE_BYTES_PER_WEIGHT_BYTE * packages + BUILD_BYTES_PER_WEIGHT_BYTE * min(workers, packages))


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


def make_room(package_set: Path, needed: int) -> list[Path]:
    """Before building ``needed`` bytes of packages into ``package_set``: remove the least recently used other sets
    while ``store + needed > budget`` or ``free - needed < 1 GB``; the sets removed. Raises ``NotEnoughDisk`` when the
    disk still cannot hold ``needed`` bytes (module docstring)."""
    package_set = Path(package_set)
    package_set.mkdir(parents=True, exist_ok=True)
    budget = store_budget_bytes()
    now = time.time()
    others = []
    for folder in package_sets(package_set):
        if folder.resolve() == package_set.resolve():
            continue
        with contextlib.suppress(OSError):
            others.append((folder.stat().st_mtime, folder, _bytes(folder)))
    others.sort()  # least recently used first
    stored = sum(size for _, _, size in others) + _bytes(package_set)
    removed = []
    for used, folder, size in others:
        if stored + needed <= budget and shutil.disk_usage(package_set).free - needed >= DISK_MARGIN_BYTES:
            break
        if now - used < IN_USE_S:  # another process may be loading it
            continue
        shutil.rmtree(folder, ignore_errors=True)
        stored -= size
        removed.append(folder)
    if removed:
        logger.info("Removed %d unused package set(s) (%.1f GB) to keep the package store under %.0f GB (%s).",
                    len(removed), sum(size for _, f, size in others if f in removed) / 1e9, budget / 1e9, STORE_ENV)
    free = shutil.disk_usage(package_set).free
    if free - needed < DISK_MARGIN_BYTES:
        raise NotEnoughDisk(
            f"about {(needed + DISK_MARGIN_BYTES) / 1e9:.1f} GB free needed to build the compiled runtime's packages, "
            f"{free / 1e9:.1f} GB free: free disk space, set PPOW_TRL_CACHE to a larger disk, or serve with runtime: "
            f"eager (packages in {package_set.parent})")
    return removed


def remove_build_outputs(package: Path, inductor_cache: Path) -> None:
    """Delete AOTInductor's build of ``package`` from ``inductor_cache``: the folder holding the wrapper library that
    the package contains (``<key>.wrapper.so``, with the weights in it) and its C++ sources. Packaging copies them
    into the package; nothing reads them again."""
    with zipfile.ZipFile(package) as archive:
        libraries = {Path(name).name for name in archive.namelist() if name.endswith(".wrapper.so")}
    for library in libraries:
        for built in Path(inductor_cache).glob(f"*/{library}"):
            shutil.rmtree(built.parent, ignore_errors=True)


def remove_stale_build_files(folder: Path, older_than_s: float = 24 * 3600) -> None:
    """Delete the temporary files of builds that were killed (``*.exported.pt2``, ``*.partial.pt2``) in ``folder``,
    once they are older than any build takes (another process may be building into the same folder now)."""
    now = time.time()
    for stale in itertools.chain(Path(folder).glob("*.exported.pt2"), Path(folder).glob("*.partial.pt2")):
        with contextlib.suppress(OSError):
            if now - stale.stat().st_mtime > older_than_s:
                stale.unlink()
