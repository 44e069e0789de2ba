"""Build-once folders (ppow_trl.build_once) and the offline target's conversion under real torch.distributed.

The main job is `accelerate launch` with 2 processes on an empty cache: both ask for the converted target at once.
transformers >= 5.25 writes ``save_pretrained`` weights only on torch.distributed rank 0, so when rank 1 won the old
file lock it published a folder without weights and the job failed. These tests run 2 gloo processes on the
loopback with a tiny GGUF in place of SmolLM2's (same conversion code, seconds instead of a minute): rank 0 first,
rank 1 first, rank 1 as the converting process (the local main of a second machine), a half-written folder, a
conversion killed midway; plus the single-process rules (marker, required files, leftovers).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from test_gguf_export import make_bpe_tokenizer
from test_multiprocess import free_port

import multiprocess_build_once as workers
from ppow_trl import build_once as bo
from ppow_trl import offline
from ppow_trl.interop.gguf_export import export_gguf

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Llama with a byte-level BPE vocabulary as an f32 GGUF, and its last-token logits on the probe text."""
    folder = tmp_path_factory.mktemp("gguf")
    tokenizer = make_bpe_tokenizer()
    model = make_tiny_llama(vocab_size=len(tokenizer), num_layers=2, seed=3, initializer_range=0.5)
    path = export_gguf(model, folder / "tiny.gguf", tokenizer)
    ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    return path, ids[0].tolist(), logits


def run_ranks(gguf, folder, out, *, delays=(0.0, 0.0), local_ranks=(0, 1)) -> list[dict]:
    """Two gloo processes asking for ``folder`` (rank r waits delays[r] first); their results, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=workers.rank_worker, args=(rank, 2, port, str(gguf), str(folder),
                                                                    list(local_ranks), list(delays), str(out)))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(TIMEOUT_S)
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0, 0], f"a rank failed: exit codes {[p.exitcode for p in processes]}"
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(2)]


def conversions(out) -> int:
    log = out / "conversions.log"
    return len(log.read_text().split()) if log.exists() else 0


def check_converted(results, folder, tiny_gguf):
    """Both ranks got the complete folder, and the model in it is the GGUF's model (same logits)."""
    _, ids, logits = tiny_gguf
    for result in results:
        assert result["folder"] == str(folder)
        assert {"config.json", "model.safetensors", "tokenizer_config.json", bo.MARKER} <= set(result["files"])
        assert result["ids"] == ids
        torch.testing.assert_close(torch.tensor(result["logits"]), logits, atol=1e-4, rtol=1e-4)
    assert not list(folder.parent.glob(f"{folder.name}.tmp-*"))


@pytest.mark.parametrize("first", [0, 1], ids=["rank0_first", "rank1_first"])
def test_two_ranks_on_an_empty_cache_convert_once(tiny_gguf, tmp_path, first):
    delays = [2.0, 2.0]
    delays[first] = 0.0
    folder = tmp_path / "cache" / "smol"
    results = run_ranks(tiny_gguf[0], folder, tmp_path / "out", delays=delays)
    check_converted(results, folder, tiny_gguf)
    assert conversions(tmp_path / "out") == 1


def test_rank1_as_the_converting_process_writes_the_weights(tiny_gguf, tmp_path):
    """Rank 1 is its machine's local main (the second machine of a job, LOCAL_RANK 0): it converts. transformers
    >= 5.25's save_pretrained would write no weights there; the conversion must not depend on the rank."""
    folder = tmp_path / "cache" / "smol"
    results = run_ranks(tiny_gguf[0], folder, tmp_path / "out", local_ranks=(1, 0), delays=(1.0, 0.0))
    check_converted(results, folder, tiny_gguf)
    assert conversions(tmp_path / "out") == 1


def test_a_half_written_folder_is_rebuilt(tiny_gguf, tmp_path):
    """What transformers 5.25 left when rank 1 won the old lock: tokenizer files only, published at the final name."""
    folder = tmp_path / "cache" / "smol"
    folder.mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    results = run_ranks(tiny_gguf[0], folder, tmp_path / "out", delays=(0.5, 0.0))
    check_converted(results, folder, tiny_gguf)
    assert conversions(tmp_path / "out") == 1


def test_a_conversion_killed_midway_leaves_no_stale_lock_and_is_redone(tiny_gguf, tmp_path):
    folder = tmp_path / "cache" / "smol"
    started = tmp_path / "started"
    context = multiprocessing.get_context("spawn")
    victim = context.Process(target=workers.killed_worker, args=(str(tiny_gguf[0]), str(folder), str(started)))
    victim.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not started.exists() and victim.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), "the victim never started its conversion"
    os.kill(victim.pid, signal.SIGKILL)  # no cleanup runs: the lock file and a half temporary folder stay
    victim.join(30)
    assert list(folder.parent.glob("smol.tmp-*")) and Path(str(folder) + ".lock").exists() and not folder.exists()

    results = run_ranks(tiny_gguf[0], folder, tmp_path / "out")  # a lock that outlived its holder: a time-out
    check_converted(results, folder, tiny_gguf)
    assert conversions(tmp_path / "out") == 1


# -- single process ----------------------------------------------------------------------------------------------


def test_complete_folder_is_used_without_building(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_text("x")
    (folder / bo.MARKER).write_text("{}")
    assert bo.build_once(folder, lambda tmp: pytest.fail("built again"), required=["a.txt"]) == folder


def test_build_is_published_only_when_complete(tmp_path):
    folder = tmp_path / "f"

    def forgets_a_file(tmp):
        (tmp / "a.txt").write_text("x")

    with pytest.raises(RuntimeError, match="without b.txt"):
        bo.build_once(folder, forgets_a_file, required=["a.txt", "b.txt"], what="thing")
    assert not folder.exists() and not list(tmp_path.glob("f.tmp-*"))

    def fails(tmp):
        (tmp / "a.txt").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bo.build_once(folder, fails, required=["a.txt"])
    assert not folder.exists() and not list(tmp_path.glob("f.tmp-*"))

    def writes_all(tmp):
        for name in ("a.txt", "b.txt"):
            (tmp / name).write_text(name)

    assert bo.build_once(folder, writes_all, required=["a.txt", "b.txt"]) == folder
    assert bo.is_complete(folder, ["a.txt", "b.txt"]) and (folder / "b.txt").read_text() == "b.txt"


def test_a_marker_with_another_key_is_rebuilt(tmp_path):
    folder = tmp_path / "f"
    bo.build_once(folder, lambda tmp: (tmp / "a.txt").write_text("v1"), required=["a.txt"], key="input-1")
    bo.build_once(folder, lambda tmp: pytest.fail("built again"), required=["a.txt"], key="input-1")
    bo.build_once(folder, lambda tmp: (tmp / "a.txt").write_text("v2"), required=["a.txt"], key="input-2")
    assert (folder / "a.txt").read_text() == "v2" and bo.is_complete(folder, ["a.txt"], key="input-2")
    assert not bo.is_complete(folder, ["a.txt"], key="input-1")


def test_folder_without_marker_and_dead_temporaries_are_replaced_with_a_warning(tmp_path, caplog):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_text("old")  # all files, but no marker: never known to be finished
    (tmp_path / "f.tmp-1-dead").mkdir()
    with caplog.at_level("WARNING", logger="ppow_trl.build_once"):
        bo.build_once(folder, lambda tmp: (tmp / "a.txt").write_text("new"), required=["a.txt"], what="thing")
    assert (folder / "a.txt").read_text() == "new" and not (tmp_path / "f.tmp-1-dead").exists()
    assert "incomplete" in caplog.text and "did not finish" in caplog.text


def test_offline_conversion_writes_a_loadable_folder_in_one_process(tiny_gguf, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(offline, "smollm2_gguf_path", lambda: tiny_gguf[0])
    folder = offline.smollm2_path(tmp_path / "smol")
    assert offline._converted(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tiny_gguf[1]])).logits[0, -1]
    torch.testing.assert_close(logits, tiny_gguf[2], atol=1e-4, rtol=1e-4)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # the tensors save_pretrained writes (a tied head stored once, as the embedding)
    from safetensors import safe_open

    model.save_pretrained(tmp_path / "saved")
    with safe_open(folder / "model.safetensors", "pt") as ours, safe_open(tmp_path / "saved" / "model.safetensors",
                                                                           "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys()) and "model.embed_tokens.weight" in set(ours.keys())
