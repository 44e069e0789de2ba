"""How the compiled runtime builds its packages (ppow_trl.serving.packaged, ppow_trl.serving.inductor_settings):
how many at once, and the template memo that compiling runs under. Nothing here compiles; the builds themselves are
checked in test_compiled.py."""

from __future__ import annotations

import types

import pytest
import torch

import ppow_trl.serving.packaged as packaged
from ppow_trl.serving.inductor_settings import CompileSettings, compile_context

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
    packaged.remove_stale_build_files(tmp_path)
    assert not old.exists() and fresh.exists() and package.exists()
