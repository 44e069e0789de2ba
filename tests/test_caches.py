"""`python -m ppow_trl.caches`: what the caches hold, which entries are stale and why, and freeing them."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from ppow_trl import caches
from ppow_trl.data.cache import CACHE_FORMAT_VERSION
from ppow_trl.compiled_runtime.inductor_settings import KEY_FILE
from ppow_trl.compiled_runtime.packaged import BUILD_FILE, code_versions
from ppow_trl.utils import cpu_flags


def _folder(path, files: dict[str, bytes | str]):
    path.mkdir(parents=True)
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "cache"
    manifest = lambda version: json.dumps({"kind": "topk", "format": version, "settings": {}})  # noqa: E731
    _folder(root / "topk" / "topk-current", {"manifest.json": manifest(CACHE_FORMAT_VERSION), "shard-00000/a": b"x" * 100})
    _folder(root / "topk" / "topk-old", {"manifest.json": manifest(CACHE_FORMAT_VERSION - 1), "shard-00000/a": b"x" * 50})
    _folder(root / "teacher-forced" / "teacher-forced-abc.tmp-12-ff", {"shard-00000/a": b"x" * 10})
    key = {"torch": torch.__version__, "cpu": sorted(cpu_flags()), "threads": 1, "settings": {}}
    _folder(root / "inductor" / "now", {KEY_FILE: json.dumps(key), "fxgraph/k": b"k" * 30})
    _folder(root / "inductor" / "now" / "packages" / "set-current",
            {BUILD_FILE: json.dumps(code_versions()), "rows1.pt2": b"p" * 200})
    _folder(root / "inductor" / "now" / "packages" / "set-old-code",
            {BUILD_FILE: json.dumps({**code_versions(), "transformers": "4.0.0"}), "rows1.pt2": b"p" * 300})
    _folder(root / "inductor" / "now" / "packages" / "set-unrecorded", {"rows1.pt2": b"p" * 5})
    _folder(root / "inductor" / "old-torch", {KEY_FILE: json.dumps({**key, "torch": "1.0.0"}), "k": b"k" * 20})
    _folder(root / "inductor" / "old-torch" / "packages" / "set", {BUILD_FILE: json.dumps(code_versions()), "r": b"p"})
    _folder(root / "datasets" / "sharegpt-1", {"data.arrow": b"d" * 7})
    _folder(root / "SmolLM2-135M-Instruct", {"model.safetensors": b"m" * 9})
    return root


def test_scan_says_what_is_stale_and_why(cache):
    entries = {str(entry.path.relative_to(cache)): entry for entry in caches.scan_caches(cache)}
    status = {name: entry.status for name, entry in entries.items()}
    assert status == {
        "topk/topk-current": "current", "topk/topk-old": "stale",
        "teacher-forced/teacher-forced-abc.tmp-12-ff": "stale",
        "inductor/now": "current", "inductor/now/packages/set-current": "current",
        "inductor/now/packages/set-old-code": "stale", "inductor/now/packages/set-unrecorded": "unverified",
        "inductor/old-torch": "stale", "inductor/old-torch/packages/set": "stale",
        "datasets/sharegpt-1": "current", "SmolLM2-135M-Instruct": "current"}
    assert "cache format" in entries["topk/topk-old"].reason
    assert "transformers" in entries["inductor/now/packages/set-old-code"].reason
    assert "torch 1.0.0" in entries["inductor/old-torch"].reason
    assert entries["inductor/now"].size == len(json.dumps({"torch": torch.__version__, "cpu": sorted(cpu_flags()),
                                                            "threads": 1, "settings": {}})) + 30  # packages apart
    assert entries["inductor/now/packages/set-current"].size > 200


def test_delete_stale_frees_exactly_the_stale_entries(cache):
    entries = caches.scan_caches(cache)
    chosen = caches.select(entries, stale=True)
    freed = caches.delete_entries(chosen)
    assert freed == sum(entry.size for entry in chosen) > 0
    left = {str(entry.path.relative_to(cache)) for entry in caches.scan_caches(cache)}
    assert "topk/topk-current" in left and "inductor/now/packages/set-current" in left
    assert not {"topk/topk-old", "inductor/now/packages/set-old-code", "inductor/old-torch/packages/set"} & left
    assert not (cache / "inductor" / "old-torch" / "k").exists()
    assert all(entry.status != "stale" for entry in caches.scan_caches(cache))


def test_delete_by_age_reads_the_newest_use_inside_a_folder(cache):
    old = time.time() - 30 * 86400
    for item in [cache / "datasets" / "sharegpt-1", *(cache / "datasets" / "sharegpt-1").rglob("*")]:
        os.utime(item, (old, old))
    chosen = caches.select(caches.scan_caches(cache), unused_days=14)
    assert [str(entry.path.relative_to(cache)) for entry in chosen] == ["datasets/sharegpt-1"]
    os.utime(cache / "datasets" / "sharegpt-1" / "data.arrow")  # read today: in use
    assert caches.select(caches.scan_caches(cache), unused_days=14) == []


def test_cli(cache, capsys):
    assert caches.main(["--root", str(cache), "scan"]) == 0
    out = capsys.readouterr().out
    assert "stale" in out and "delete --stale" in out
    with pytest.raises(SystemExit):
        caches.main(["--root", str(cache), "delete"])  # says what to pass
    assert caches.main(["--root", str(cache), "delete", "--stale", "--dry-run"]) == 0
    assert (cache / "topk" / "topk-old").exists()
    assert caches.main(["--root", str(cache), "delete", "--stale", "--yes"]) == 0
    assert not (cache / "topk" / "topk-old").exists() and (cache / "topk" / "topk-current").exists()
