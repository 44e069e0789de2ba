"""What ppow_trl keeps on disk, what is stale, and freeing it: ``python -m ppow_trl.caches scan | delete``.

In the manner of ``huggingface-cli scan-cache`` / ``delete-cache``. Everything lives under ``cache_root()``
(``$PPOW_TRL_CACHE``, else ``$HF_HOME/ppow_trl``, else ``~/.cache/ppow_trl``):

- ``data``: the resumable data caches (``<kind>-<fingerprint>/`` with a ``manifest.json`` and ``shard-*`` folders:
  regenerated responses, top-k labels, teacher-forced labels, target features), under ``responses/``, ``topk/``,
  ``teacher-forced/``, ``features/`` and any other folder holding such caches;
- ``compiled``: the compiled runtime, one inductor cache per key (``inductor/<key>/``, with its ``key.json``) and in
  it one package set per weight set (``packages/<set>/``, with its ``build.json``);
- ``models``, ``datasets``, ``wheels``: the converted offline model, the parsed prompt files, built wheels.

An entry is **stale** when nothing this installation runs can use it again, and the reason is given:
a data cache of another cache format (``CACHE_FORMAT_VERSION``), an inductor cache keyed on another torch build or
CPU, a package set traced from other code (torch, transformers, or the runtime's own step and attention), a folder
a killed run left half-written (temporary names). Entries whose origin is not recorded (built before these records
existed) are ``unverified``: ``delete --unused-days N`` frees them by age. Data caches of other inputs or settings
are not stale (another config uses them); they go by age too.

    python -m ppow_trl.caches scan                       # what is there, sizes, last use, stale or not
    python -m ppow_trl.caches delete --stale             # free what nothing can use again (asks first; --yes)
    python -m ppow_trl.caches delete --unused-days 14    # and what was not used for two weeks
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .utils import cache_root

DATA_KINDS = ("responses", "topk", "teacher-forced", "features")
TEMPORARY_MARKERS = (".tmp-", ".tmp.")  # the private names of a save or build in progress (``data.cache``, build_once)


@dataclass
class CacheEntry:
    """One deletable folder of the cache: its group, path, bytes, last use (newest modification time inside, or the
    folder's own stamp), and ``status``: ``current``, ``stale`` or ``unverified``, with ``reason``."""

    group: str
    path: Path
    size: int
    last_used: float
    status: str = "current"
    reason: str = ""

    def as_dict(self) -> dict:
        return {"group": self.group, "path": str(self.path), "bytes": self.size, "last_used": self.last_used,
                "status": self.status, "reason": self.reason}


def _size_and_last_use(folder: Path) -> tuple[int, float]:
    size, newest = 0, folder.stat().st_mtime
    for item in folder.rglob("*"):
        try:
            stat = item.stat()
        except OSError:
            continue
        newest = max(newest, stat.st_mtime)
        size += stat.st_size if item.is_file() else 0
    return size, newest


def _entry(group: str, folder: Path, status: str = "current", reason: str = "") -> CacheEntry:
    size, last = _size_and_last_use(folder)
    if any(marker in folder.name for marker in TEMPORARY_MARKERS):
        status, reason = "stale", "left half-written by a killed run (temporary name)"
    return CacheEntry(group, folder, size, last, status, reason)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _data_entry(folder: Path) -> CacheEntry:
    from .data.cache import CACHE_FORMAT_VERSION

    manifest = _read_json(folder / "manifest.json")
    if manifest is None:
        return _entry("data", folder, "stale", "no manifest: not a finished cache")
    if manifest.get("format") != CACHE_FORMAT_VERSION:
        return _entry("data", folder, "stale",
                      f"cache format {manifest.get('format')} (this version reads {CACHE_FORMAT_VERSION})")
    return _entry("data", folder)


def _inductor_entries(folder: Path) -> list[CacheEntry]:
    """The inductor cache ``folder`` (less its packages) and each of its package sets."""
    import torch

    from .compiled_runtime.inductor_settings import KEY_FILE
    from .compiled_runtime.packaged import BUILD_FILE, code_versions
    from .utils import cpu_flags

    key = _read_json(folder / KEY_FILE)
    if key is None:
        status, reason = "unverified", "no key.json (built before ppow_trl recorded keys)"
    elif key.get("torch") != torch.__version__:
        status, reason = "stale", f"compiled by torch {key.get('torch')} (installed: {torch.__version__})"
    elif sorted(key.get("cpu", [])) != sorted(cpu_flags()):
        status, reason = "stale", "compiled for another CPU's instruction sets"
    else:
        status, reason = "current", ""
    entries = []
    current_code = code_versions()
    packages = folder / "packages"
    for package_set in sorted(packages.glob("*")) if packages.is_dir() else []:
        if not package_set.is_dir():
            continue
        built = _read_json(package_set / BUILD_FILE)
        if status == "stale":
            set_status, set_reason = status, reason
        elif built is None:
            set_status, set_reason = "unverified", "no build.json (built before ppow_trl recorded builds)"
        else:
            changed = sorted(name for name, value in current_code.items() if built.get(name) != value)
            set_status, set_reason = ("stale", "traced from other code: " + ", ".join(changed)) if changed else (
                "current", "")
        entries.append(_entry("compiled", package_set, set_status, set_reason))
    # the inductor cache itself (kernels, autotuning results), without the package sets counted above
    size, last = 0, folder.stat().st_mtime
    for item in folder.iterdir():
        if item.name == "packages":
            continue
        part_size, part_last = _size_and_last_use(item) if item.is_dir() else (item.stat().st_size, item.stat().st_mtime)
        size, last = size + part_size, max(last, part_last)
    entries.append(CacheEntry("compiled", folder, size, last, status, reason))
    return entries


def scan_caches(root: str | Path | None = None) -> list[CacheEntry]:
    """Every entry of the cache under ``root`` (default ``cache_root()``), largest first."""
    root = Path(root) if root is not None else cache_root()
    entries: list[CacheEntry] = []
    if not root.is_dir():
        return entries
    for item in sorted(root.iterdir()):
        if item.name == "inductor" and item.is_dir():
            for folder in sorted(p for p in item.iterdir() if p.is_dir()):
                entries += _inductor_entries(folder)
        elif item.is_dir() and any((child / "manifest.json").exists() or child.name.startswith(
                tuple(f"{kind}-" for kind in DATA_KINDS)) for child in item.iterdir() if child.is_dir()):
            entries += [_data_entry(child) for child in sorted(item.iterdir()) if child.is_dir()]
        elif item.is_dir() and item.name in ("datasets", "wheels"):
            entries += [_entry(item.name, child) for child in sorted(item.iterdir()) if child.is_dir()]
        elif item.is_dir():
            entries.append(_entry("models", item))
    return sorted(entries, key=lambda entry: -entry.size)


def select(entries: list[CacheEntry], *, stale: bool = False, unused_days: float | None = None,
           now: float | None = None) -> list[CacheEntry]:
    """The entries ``delete`` frees: the stale ones (``stale``) and those unused for ``unused_days`` days."""
    now = time.time() if now is None else now
    return [entry for entry in entries
            if (stale and entry.status == "stale")
            or (unused_days is not None and now - entry.last_used >= unused_days * 86400)]


def delete_entries(entries: list[CacheEntry]) -> int:
    """Remove every entry's folder (an inductor cache keeps the package sets not selected); returns the bytes freed."""
    freed = 0
    for entry in entries:
        if not entry.path.exists():
            continue
        if entry.group == "compiled" and (entry.path / "packages").is_dir():
            # an inductor cache: its kernels and autotuning, not the package sets (they are entries of their own)
            for item in entry.path.iterdir():
                if item.name != "packages":
                    shutil.rmtree(item, ignore_errors=True) if item.is_dir() else item.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
        freed += entry.size
    return freed


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1000
    return f"{size:.1f} GB"


def format_entries(entries: list[CacheEntry], root: Path, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"{'GROUP':9s} {'SIZE':>9s} {'LAST USED':>10s} {'STATUS':10s} PATH (reason)"]
    for entry in entries:
        days = (now - entry.last_used) / 86400
        used = "today" if days < 1 else f"{days:.0f} days ago"
        try:
            shown = entry.path.relative_to(root)
        except ValueError:
            shown = entry.path
        lines.append(f"{entry.group:9s} {_human(entry.size):>9s} {used:>10s} {entry.status:10s} {shown}"
                     + (f" ({entry.reason})" if entry.reason else ""))
    total = sum(entry.size for entry in entries)
    stale = sum(entry.size for entry in entries if entry.status == "stale")
    lines.append(f"{len(entries)} entries, {_human(total)} under {root}; {_human(stale)} stale "
                 "(`python -m ppow_trl.caches delete --stale` frees it).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppow_trl.caches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="The cache folder (default: ppow_trl's cache root).")
    commands = parser.add_subparsers(dest="command", required=True)
    scan = commands.add_parser("scan", help="List what the caches hold.")
    scan.add_argument("--json", action="store_true", help="Print the entries as JSON.")
    delete = commands.add_parser("delete", help="Free stale or unused entries.")
    delete.add_argument("--stale", action="store_true", help="Entries nothing can use again.")
    delete.add_argument("--unused-days", type=float, help="Entries not used for this many days.")
    delete.add_argument("--yes", action="store_true", help="Do not ask before deleting.")
    delete.add_argument("--dry-run", action="store_true", help="Only say what would be freed.")
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else cache_root()
    entries = scan_caches(root)
    if args.command == "scan":
        print(json.dumps([entry.as_dict() for entry in entries], indent=1) if args.json
              else format_entries(entries, root))
        return 0
    if not args.stale and args.unused_days is None:
        parser.error("delete needs --stale and/or --unused-days N (see `scan` for what each would free).")
    if args.unused_days is not None and args.unused_days < 0:
        parser.error(f"--unused-days must be >= 0, got {args.unused_days}.")
    chosen = select(entries, stale=args.stale, unused_days=args.unused_days)
    if not chosen:
        print("Nothing to delete.")
        return 0
    print(format_entries(chosen, root))
    if args.dry_run:
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            print("Not deleting without a terminal to confirm: pass --yes.", file=sys.stderr)
            return 1
        if input(f"Delete these {len(chosen)} entries? [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing deleted.")
            return 0
    print(f"Freed {_human(delete_entries(chosen))}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
