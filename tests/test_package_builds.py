"""How the compiled runtime builds its packages (ppow_trl.compiled_runtime.packaged,
ppow_trl.compiled_runtime.inductor_settings) and keeps them on disk (ppow_trl.compiled_runtime.package_store): how many
at once, the template memo that compiling runs under, the worker processes' import, and the disk the store may take.
Nothing here compiles; the builds themselves are checked in test_compiled.py."""

from __future__ import annotations

import types

import pytest
import torch

import ppow_trl.compiled_runtime.package_store as store
import ppow_trl.compiled_runtime.packaged as packaged
from ppow_trl.compiled_runtime.inductor_settings import CompileSettings, compile_context

GB = 2**30


def test_compile_context_parses_each_template_once_and_restores_inductors_parser():
    from torch._inductor.codegen.common import KernelTemplate

    original = KernelTemplate.__dict__["_template_from_string"]
    source = "{{ kernel }} x {{ n | indent_except_first(1) }}"
    with compile_context(CompileSettings()):
        first = KernelTemplate._template_from_string(source)
        with compile_context(CompileSettings()):
            assert KernelTemplate._template_from_string(source) is first
        assert first.render(kernel="k", n="a\nb") == "k x a\n    b"  # inductor's own filter, as before
        assert KernelTemplate._template_from_string(source + " ") is not first
    assert KernelTemplate.__dict__["_template_from_string"] is original
    assert KernelTemplate._template_from_string(source) is not KernelTemplate._template_from_string(source)
    with pytest.raises(RuntimeError), compile_context(CompileSettings()):
        raise RuntimeError("a failed compile")
    assert KernelTemplate.__dict__["_template_from_string"] is original


@pytest.fixture
def machine(monkeypatch):
    """A machine of ``cores`` cores and ``available`` bytes of free memory, no cgroup limits, torch at ``threads``."""
    def set_machine(cores: int, available: int, threads: int = 1, cgroup: dict | None = None):
        monkeypatch.delenv("PPOW_TRL_BUILD_WORKERS", raising=False)
        monkeypatch.setattr(packaged.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        import psutil

        monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
        monkeypatch.setattr(packaged, "_cgroup_value", lambda name: (cgroup or {}).get(name))
        monkeypatch.setattr(packaged.torch, "get_num_threads", lambda: threads)

    return set_machine


def test_build_workers_one_more_than_the_cores_bounded_by_jobs_and_memory(machine):
    model = GB // 2
    machine(cores=2, available=20 * GB)
    assert packaged.build_workers(5, model) == 3  # 2 cores at one thread, plus one
    assert packaged.build_workers(2, model) == 2  # never more than the packages to build
    machine(cores=2, available=20 * GB, threads=2)
    assert packaged.build_workers(5, model) == 2
    machine(cores=16, available=20 * GB)
    assert packaged.build_workers(5, model) == 5
    machine(cores=16, available=9 * GB)
    assert packaged.build_workers(5, model) == 2  # 8 x 0.5 GB per worker
    machine(cores=16, available=1 * GB)
    assert packaged.build_workers(5, model) == 1
    # a container: its CPU quota and memory limit, which affinity and psutil do not see
    machine(cores=16, available=64 * GB, cgroup={"cpu.max": ["200000", "100000"], "memory.max": [str(40 * GB)],
                                                  "memory.current": [str(30 * GB)]})
    assert packaged.build_workers(5, model) == 2  # 10 GB left in the container: 2 workers of 4 GB
    machine(cores=16, available=64 * GB, cgroup={"cpu.max": ["150000", "100000"], "memory.max": ["max"]})
    assert packaged.build_workers(5, model) == 3  # 1.5 CPUs round up to 2, plus one


def test_build_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv("PPOW_TRL_BUILD_WORKERS", "2")
    assert packaged.build_workers(5, GB) == 2 and packaged.build_workers(1, GB) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("PPOW_TRL_BUILD_WORKERS", bad)
        with pytest.raises(ValueError, match="PPOW_TRL_BUILD_WORKERS must be a whole number"):
            packaged.build_workers(5, GB)


def test_stale_build_files_are_removed_only_when_old(tmp_path):
    import os
    import time

    old, fresh, package = (tmp_path / "rows1-of2.abc.exported.pt2", tmp_path / "rows2-of2.def.partial.pt2",
                           tmp_path / "rows1-of2-cache32.pt2")
    for path in (old, fresh, package):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 2 * 24 * 3600,) * 2)
    os.utime(package, (time.time() - 2 * 24 * 3600,) * 2)
    store.remove_stale_build_files(tmp_path)
    assert not old.exists() and fresh.exists() and package.exists()


def _package_set(root, name: str, size: int, age_s: float):
    import os
    import time

    folder = root / "inductor" / "key" / "packages" / name
    folder.mkdir(parents=True)
    (folder / "rows1-of2-cache32.pt2").write_bytes(b"x" * size)
    os.utime(folder, (time.time() - age_s,) * 2)
    return folder


@pytest.fixture
def disk(monkeypatch, tmp_path):
    """A package store under ``tmp_path`` on a disk of ``capacity`` bytes: what the store holds is what is used, so
    removing a set frees its bytes."""
    import shutil

    monkeypatch.setenv("PPOW_TRL_CACHE", str(tmp_path))

    def set_capacity(capacity: int):
        def usage(path):
            used = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
            return shutil._ntuple_diskusage(capacity, used, capacity - used)

        monkeypatch.setattr(store.shutil, "disk_usage", usage)
    return set_capacity


def test_make_room_removes_least_recently_used_sets_over_the_budget(monkeypatch, tmp_path, disk):
    disk(capacity=100 * GB)
    hour = 3600
    oldest, old, recent, in_use = (_package_set(tmp_path, name, 400, age) for name, age in
                                   (("oldest", 30 * hour), ("old", 20 * hour), ("recent", 10 * hour), ("in-use", 60)))
    building = tmp_path / "inductor" / "key" / "packages" / "building"
    monkeypatch.setenv(store.STORE_ENV, str(1100 / 1e9))  # 1100 bytes
    # 4 sets of 400 bytes, 300 to keep: the two least recently used go (1900 -> 1500 -> 1100 <= 1100); the bytes a
    # build needs only while it runs (peak) count against the disk, not the budget
    assert store.make_room(building, keep=300, peak=10**6) == [oldest, old]
    assert recent.exists() and in_use.exists() and building.exists()
    # a budget below what is in use now: everything unused goes; the set stamped a minute ago stays, and so does a
    # set that an old stamp but a build's temporary file show in use
    import os
    import time

    (recent / "rows2-of2-cache32.0a1b.exported.pt2").write_bytes(b"x")
    os.utime(recent, (time.time() - 10 * hour,) * 2)  # an old stamp: only the file says a build runs
    monkeypatch.setenv(store.STORE_ENV, "0")
    assert store.make_room(building, keep=300, peak=300) == []
    assert in_use.exists() and recent.exists()
    # a temporary file a day old was left by a killed build: no longer in use
    os.utime(recent / "rows2-of2-cache32.0a1b.exported.pt2", (time.time() - 25 * hour,) * 2)
    os.utime(recent, (time.time() - 10 * hour,) * 2)
    assert store.make_room(building, keep=300, peak=300) == [recent]
    before = in_use.stat().st_mtime
    store.mark_used(in_use)
    assert in_use.stat().st_mtime > before
    assert store.package_sets(building) == sorted([building, in_use])


def test_make_room_frees_the_disk_or_says_what_to_do_before_removing_anything(tmp_path, disk):
    hour = 3600
    unused = _package_set(tmp_path, "unused", 3 * 10**6, 5 * hour)
    building = tmp_path / "inductor" / "key" / "packages" / "building"
    margin = store.DISK_MARGIN_BYTES
    disk(capacity=margin + 5 * 10**6)  # 2 MB free beyond the margin, 3 MB more in the unused set
    assert store.make_room(building, keep=10**6, peak=2 * 10**6) == []  # room enough: nothing removed
    with pytest.raises(store.NotEnoughDisk, match="free disk space, set PPOW_TRL_CACHE to a larger disk, or serve "
                                                  "with runtime: eager"):
        store.make_room(building, keep=10**6, peak=6 * 10**6)  # 5 MB at most: nothing is removed for nothing
    assert unused.exists()
    assert store.make_room(building, keep=10**6, peak=4 * 10**6) == [unused]  # removing it makes room


def test_store_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv(store.STORE_ENV, raising=False)
    assert store.store_budget_bytes() == int(store.DEFAULT_STORE_GB * 1e9)
    monkeypatch.setenv(store.STORE_ENV, "2.5")
    assert store.store_budget_bytes() == int(2.5e9)
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(store.STORE_ENV, bad)
        with pytest.raises(ValueError, match="PPOW_TRL_PACKAGE_STORE_GB"):
            store.store_budget_bytes()
    from conftest import make_tiny_llama

    from ppow_trl.compiled_runtime.compiled import CompiledCausalLM

    with pytest.raises(ValueError, match="PPOW_TRL_PACKAGE_STORE_GB"):  # before any compiling, not a fallback
        CompiledCausalLM(make_tiny_llama(), max_rows=2, max_cache_len=32)


def test_build_bytes_counts_packages_and_the_builds_in_progress():
    # SmolLM2 fp32's 5 packages, 3 at once: 5 x 1.08 GB kept + 3 builds of 1.6 GB in progress
    assert store.package_bytes(540, packages=5) == 540 * 2 * 5
    assert store.build_bytes(540, packages=5, workers=3) == 540 * (2 * 5 + 3 * 3)
    assert store.build_bytes(540, packages=1, workers=3) == 540 * (2 + 3)


def test_a_full_disk_is_recognised_through_the_errors_it_caused():
    import errno

    assert store.disk_full(store.NotEnoughDisk("x"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as error:
            raise RuntimeError("the C++ compiler failed") from error
    except RuntimeError as error:
        assert store.disk_full(error)
    assert not store.disk_full(RuntimeError("export failed")) and not store.disk_full(OSError(errno.EACCES, "x"))


def test_aotinductors_build_folders_are_removed_only_when_no_build_runs(tmp_path):
    import zipfile

    package = tmp_path / "rows1-of2-cache32.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("rows1.partial/data/aotinductor/model/cabc.wrapper.so", b"so")
        archive.writestr("rows1.partial/data/aotinductor/model/cdef.kernel.cpp", b"cpp")
    cache = tmp_path / "inductor-cache"
    for folder, name in (("build", "cabc.wrapper.so"), ("other", "cxyz.wrapper.so"), ("kernels", "cdef.kernel.cpp")):
        (cache / folder).mkdir(parents=True)
        (cache / folder / name).write_bytes(b"x")
    # another build (of the same architecture, which writes into the same folder) is running: nothing goes
    with store.building(cache):
        assert store.remove_build_outputs([package], cache) is False
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["build", "kernels", "other"]
    assert store.remove_build_outputs([package], cache) is True
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["kernels", "other"]


def test_a_disk_that_cannot_hold_the_packages_serves_eagerly_before_compiling(monkeypatch, tmp_path, disk, caplog):
    from conftest import make_tiny_llama

    from ppow_trl.serving.runtime import serving_runtime

    disk(capacity=GB // 2)
    compiled = []
    monkeypatch.setattr(packaged, "export_step", lambda *a, **k: compiled.append(a))
    with caplog.at_level("WARNING"):
        served = serving_runtime(make_tiny_llama(), None, max_window=2, max_cache_len=32, progress=False)
    assert served.name == "eager" and "NotEnoughDisk" in served.fallback and "runtime: eager" in served.fallback
    assert not compiled and "Compiled runtime unavailable (NotEnoughDisk" in caplog.text


def test_a_build_worker_imports_the_serving_processes_packaged_module(tmp_path):
    """A build worker's command imports ``packaged`` by the module's own name, from the folder the serving process puts
    first on its import path (no FutureWarning of an old path), and stops when that file is not the serving process's
    ``packaged.py``: here the expected file is another one, so the worker exits before compiling, naming both."""
    import subprocess
    import sys
    from pathlib import Path

    assert "from ppow_trl.compiled_runtime.packaged import _build_in_worker" in packaged._WORKER
    here = Path(packaged.__file__).resolve()
    package_parent = str(here.parents[2])  # as _build_each computes it
    done = subprocess.run([sys.executable, "-c", packaged._WORKER, package_parent, "step.pt2", "rows1.pt2", "{}", "1",
                           "/elsewhere/packaged.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    assert f"This worker imported {here}, the serving process /elsewhere/packaged.py" in done.stderr
    assert "FutureWarning" not in done.stderr
