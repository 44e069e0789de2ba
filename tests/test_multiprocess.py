"""PPOWTrainer with two CPU processes (gloo DDP), launched by torchrun and by `accelerate launch`.

tests/multiprocess_train.py trains a tiny drafter for 3 steps in each process and writes what it saw; the
checks here: both processes form one world of 2, end with identical (and changed) drafter weights, draw
disjoint slices of the same global batch of contexts with each group of G windows on one process, and
TRL's logged statistics are those of the union of both processes' windows.

About 15 s per launch on 2 CPU cores (start-up dominates); the accelerate-launch variant is marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "multiprocess_train.py")
CPU_2PROC = os.path.join(REPO, "recipes", "accelerate_configs", "cpu_2proc.yaml")
WORLD = 2
STEPS = 3
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], out_dir, *script_flags: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PPOW_TRL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(key, None)
    result = subprocess.run(command + [SCRIPT, str(out_dir), str(STEPS), *script_flags], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    (out_dir / "launch.log").write_text(result.stdout + "\n" + result.stderr)
    errors = "\n".join(line for line in result.stderr.splitlines() if "Error" in line or "error" in line)
    assert result.returncode == 0, (
        f"launch failed ({result.returncode}), full log in {out_dir / 'launch.log'}:\n{errors[-4000:]}\n"
        f"{result.stderr[-3000:]}"
    )
    reports = []
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.json"
        assert path.exists(), f"process {rank} wrote no report: {sorted(os.listdir(out_dir))}\n{result.stderr[-3000:]}"
        report = json.loads(path.read_text())
        report["weights"] = torch.load(out_dir / f"rank{rank}_weights.pt")
        reports.append(report)
    return reports


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


@pytest.fixture(scope="module")
def torchrun_reports(tmp_path_factory):
    return launch(torchrun(), tmp_path_factory.mktemp("torchrun"))


@pytest.fixture(scope="module")
def accelerate_reports(tmp_path_factory):
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("the accelerate CLI is not on PATH")
    command = [accelerate, "launch", "--config_file", CPU_2PROC, "--main_process_port", str(free_port())]
    return launch(command, tmp_path_factory.mktemp("accelerate"))


def check_two_process_training(reports: list[dict]) -> None:
    """One generation round per optimizer step (steps_per_generation = gradient_accumulation_steps)."""
    # One world of two processes, DDP over gloo.
    for rank, report in enumerate(reports):
        assert report["world_size"] == WORLD, report["distributed_type"]
        assert report["process_index"] == rank
        assert report["distributed_type"] == "DistributedType.MULTI_CPU"
        assert report["backend"] == "gloo"
        assert report["wrapped_model"] == "DistributedDataParallel"
        assert report["global_step"] == STEPS
        assert report["steps_per_generation"] == report["gradient_accumulation_steps"]

    # Same start, same end (bit for bit: DDP averages gradients), and training moved the weights.
    first, second = reports[0]["weights"], reports[1]["weights"]
    assert torch.equal(first["initial"], second["initial"])
    assert torch.equal(first["final"], second["final"])
    assert not torch.allclose(first["final"], first["initial"])
    assert reports[0]["final_checksum"] == reports[1]["final_checksum"] != reports[0]["initial_checksum"]
    # Each process scores its share of a refresh's sequences; the gathered scores give every process the same
    # selection probabilities, equal to scoring every sequence in one process.
    assert reports[0]["selection_probabilities"] == reports[1]["selection_probabilities"]
    assert len(reports[0]["selection_probabilities"]) >= 1
    assert reports[0]["refreshed_scores"] == reports[1]["refreshed_scores"]
    for refreshed in reports[0]["refreshed_scores"]:
        assert refreshed["all_scored"] and refreshed["max_difference"] < 1e-5, refreshed

    group = reports[0]["num_generations"]
    for step in range(STEPS):
        steps = [report["steps"][step] for report in reports]
        assert [s["round"] for s in steps] == [step] * WORLD
        # The same global draw on both processes; each takes its own contiguous slice, whole groups only.
        global_draw = steps[0]["global_draw"]
        assert all(s["global_draw"] == global_draw for s in steps)
        assert len(global_draw) == WORLD * len(steps[0]["candidates"]) // group
        local = len(global_draw) // WORLD
        for rank, s in enumerate(steps):
            candidates = s["candidates"]
            assert candidates == [c for c in global_draw[rank * local:(rank + 1) * local] for _ in range(group)]
            assert s["rollout_prompts"] == s["prompts"]
            for g in range(0, len(candidates), group):
                assert len(set(candidates[g:g + group])) == 1
                assert all(p == s["prompts"][g] for p in s["prompts"][g:g + group])
        # Different windows on the two processes (the sampling stream is seeded per process).
        assert steps[0]["window_ids"] != steps[1]["window_ids"]

        # TRL's logged statistics are over both processes' windows.
        logs = [[h for h in report["log_history"] if "reward" in h] for report in reports]
        assert len(logs[0]) == STEPS
        log = logs[0][step]
        speed = torch.tensor([x for s in steps for x in s["speed"]])
        proximity = torch.tensor([x for s in steps for x in s["proximity"]])
        accepted = torch.tensor([x for s in steps for x in s["accepted"]])
        lam = reports[0]["proximity_weight"]
        assert log["reward"] == pytest.approx((speed + lam * proximity).mean().item(), rel=1e-4, abs=1e-6)
        assert log["rewards/speed/mean"] == pytest.approx(speed.mean().item(), rel=1e-4, abs=1e-6)
        assert log["rewards/proximity/mean"] == pytest.approx(proximity.mean().item(), rel=1e-4, abs=1e-6)
        assert log["ppow/R_speed"] == pytest.approx(speed.mean().item(), rel=1e-4, abs=1e-6)
        assert log["ppow/simulated_tau"] == pytest.approx(accepted.mean().item() + 1, rel=1e-4, abs=1e-6)
        # The reward is not the same on both processes, so the check above does see both halves.
        local_means = [(torch.tensor(s["speed"]) + lam * torch.tensor(s["proximity"])).mean().item() for s in steps]
        assert local_means[0] != pytest.approx(local_means[1], rel=1e-6)
        # frac_reward_zero_std counts the groups of the global batch.
        rewards = (speed + lam * proximity).view(-1, group)
        zero_std = torch.isclose(rewards.std(dim=1), torch.zeros(())).float().mean().item()
        assert log["frac_reward_zero_std"] == pytest.approx(zero_std, abs=1e-6)
        # Both processes log the same (already reduced) numbers.
        assert logs[1][step]["reward"] == pytest.approx(log["reward"], rel=1e-6)


def test_two_processes_with_torchrun(torchrun_reports):
    check_two_process_training(torchrun_reports)


@pytest.mark.slow
def test_two_processes_with_accelerate_launch_and_the_cpu_recipe(accelerate_reports):
    check_two_process_training(accelerate_reports)


@pytest.mark.slow
def test_both_launchers_train_the_same_drafter(torchrun_reports, accelerate_reports):
    """Same seeds, same world size: the launcher does not change what is trained."""
    assert torch.equal(torchrun_reports[0]["weights"]["final"], accelerate_reports[0]["weights"]["final"])


@pytest.mark.slow
def test_two_processes_with_gradient_accumulation_and_per_token_credit(tmp_path):
    """2 micro-batches per step, fed by one generation round of 2 x 8 rows per process; per-token credit."""
    reports = launch(torchrun(), tmp_path, "--accumulate")
    assert reports[0]["gradient_accumulation_steps"] == 2
    assert len(reports[0]["steps"][0]["candidates"]) == 16
    check_two_process_training(reports)


@pytest.mark.slow
def test_two_processes_evaluate_held_out_tau_and_calibrate_alike(tmp_path):
    """Held-out evaluation with 2 processes: exact greedy tau sharded over them equals one process's computation,
    and both end with the same calibrated rule and the same logged metrics."""
    reports = launch(torchrun(), tmp_path, "--evaluate", "--measure-cost")
    # The measured cost model reaches every process whole: ratios, raw seconds and where they come from.
    costs = [report["cost_model"] for report in reports]
    assert costs[0] == costs[1] and costs[0]["raw_seconds"]["drafter_step"] > 0
    assert costs[0]["description"].startswith("measured by PPOWTrainer")
    evaluations = [report["evaluation"] for report in reports]
    assert evaluations[0]["policy"] == evaluations[1]["policy"]
    logged = [e["logged"] for e in evaluations]
    assert len(logged[0]) == 1 and logged[0] == logged[1]
    assert logged[0][0]["eval_tau"] == pytest.approx(evaluations[0]["local_tau"], rel=1e-6)
    assert [logged[0][0]["eval_window_max"], logged[0][0]["eval_window_threshold"]] == pytest.approx(
        evaluations[0]["policy"])


def test_two_processes_share_the_data_build(tmp_path):
    """Data building on 2 processes: chunk i is computed by rank i % 2, once, and both ranks end with the same
    dataset, equal to the single-process build (each chunk has its own seed)."""
    from datasets import Dataset, Features, Value

    from ppow_trl.data.cache import build_sharded_dataset

    script = os.path.join(REPO, "tests", "multiprocess_data.py")
    # ACCELERATE_USE_CPU: without CUDA, PartialState otherwise gives every torchrun process a world of 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port",
               str(free_port()), script, str(tmp_path), str(tmp_path / "cache")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = [json.loads((tmp_path / f"data_rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert loaded[0] == loaded[1]
    assert loaded[0]["rank"] == [(x // 8) % WORLD for x in range(50)]  # chunks of 8, chunk i on rank i % 2

    def process(batch):
        noise = torch.rand(len(batch))
        return [{"x": row["x"], "y": row["x"] * 2 + float(noise[i]), "rank": 0} for i, row in enumerate(batch)]

    features = Features({"x": Value("int64"), "y": Value("float64"), "rank": Value("int64")})
    alone = build_sharded_dataset(Dataset.from_dict({"x": list(range(50))}), process, features=features, kind="mp",
                                  settings={"v": 1}, cache_dir=tmp_path / "alone", batch_size=4, chunk_size=8, seed=0)
    assert alone["y"] == loaded[0]["y"]
