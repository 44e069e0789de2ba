"""Workers for tests/test_build_once.py: real torch.distributed (gloo) processes asking for the offline target.

Each worker joins a gloo group of 2 on the loopback, points ppow_trl.offline at a tiny GGUF instead of SmolLM2's,
counts its conversions in a log file, waits its given delay (so that a chosen rank asks first), asks for the
converted folder, loads model and tokenizer from it and writes what it got to ``result-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def convert_counted(log: Path, real_convert):
    def convert(gguf, out):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        real_convert(gguf, out)
    return convert


def rank_worker(rank: int, world: int, port: int, gguf: str, folder: str, local_ranks: list[int],
                delays: list[float], out: str) -> None:
    os.environ["LOCAL_RANK"] = str(local_ranks[rank])
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppow_trl import offline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        offline.smollm2_gguf_path = lambda: Path(gguf)
        offline._convert = convert_counted(Path(out) / "conversions.log", offline._convert)
        time.sleep(delays[rank])
        path = offline.smollm2_path(folder)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        Path(out, f"result-{rank}.json").write_text(json.dumps(
            {"folder": str(path), "files": sorted(p.name for p in Path(path).iterdir()),
             "logits": logits.tolist(), "ids": ids[0].tolist()}))
    finally:
        dist.destroy_process_group()


def killed_worker(gguf: str, folder: str, started_path: str) -> None:
    """Converts with a builder that writes part of the folder, says so, then hangs until it is killed."""
    from ppow_trl import offline

    def half_then_hang(gguf_file, out):
        (out / "config.json").write_text("{}")
        Path(started_path).write_text(str(os.getpid()))
        time.sleep(600)

    offline.smollm2_gguf_path = lambda: Path(gguf)
    offline._convert = half_then_hang
    offline.smollm2_path(folder)
