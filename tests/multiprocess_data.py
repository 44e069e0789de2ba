"""Run by tests/test_multiprocess.py under torchrun: every rank builds the same sharded cache together.

Each output row records which rank computed it; every rank then writes the dataset it loaded to
``<out>/data_rank{rank}.json``.
"""

import json
import sys

import torch
from accelerate import PartialState
from datasets import Dataset, Features, Value

from ppow_trl.data.cache import build_sharded_dataset

out, cache = sys.argv[1], sys.argv[2]
state = PartialState(cpu=True)  # without CUDA: else each process sees a world of 1
inputs = Dataset.from_dict({"x": list(range(50))})
features = Features({"x": Value("int64"), "y": Value("float64"), "rank": Value("int64")})


def process(batch):
    noise = torch.rand(len(batch))  # seeded per chunk: the same whichever rank computes it
    return [{"x": row["x"], "y": row["x"] * 2 + float(noise[i]), "rank": state.process_index}
            for i, row in enumerate(batch)]


data = build_sharded_dataset(inputs, process, features=features, kind="mp", settings={"v": 1}, cache_dir=cache,
                             batch_size=4, chunk_size=8, seed=0)
with open(f"{out}/data_rank{state.process_index}.json", "w") as f:
    json.dump(data.to_dict(), f)
