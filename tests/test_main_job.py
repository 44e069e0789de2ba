"""The main job's exact shape, end to end: `accelerate launch` with the 2-process CPU config on empty caches.

`accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/ppow_llama.py --config
recipes/configs/smoke_smollm2.yaml`: the real offline target converted from its GGUF by the two processes at once,
data regenerated, KD, PPOW, the served rule, evaluation, save. Then, in this process, the saved drafter goes back
through `target.generate(assistant_model=...)` with its served rule and with a forced window, and greedy output
must equal plain decoding. About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_multiprocess import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_2PROC = os.path.join(REPO, "recipes", "accelerate_configs", "cpu_2proc.yaml")
SMOKE = os.path.join(REPO, "recipes", "configs", "smoke_smollm2.yaml")
TIMEOUT_S = 600

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """Run the smoke job once with empty caches in a temporary folder; its output folder and log."""
    root = tmp_path_factory.mktemp("main_job")
    env = {**os.environ, "PPOW_TRL_CACHE": str(root / "cache"), "HF_HOME": str(root / "hf"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PPOW_TRL_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(key, None)
    out = root / "out"
    port = free_port()  # not the config's fixed port: another launch may hold it
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_2PROC,
               "--main_process_port", str(port),
               os.path.join(REPO, "recipes", "ppow_llama.py"), "--config", SMOKE, "--output_dir", str(out)]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = root / "main_job.log"
    log.write_text(result.stdout + "\n" + result.stderr)
    assert result.returncode == 0, f"the main job failed ({result.returncode}); log {log}:\n{result.stderr[-5000:]}"
    return out, result.stdout, root / "cache"


def test_main_job_saves_a_drafter_and_its_served_rule(main_job):
    out, stdout, cache = main_job
    merged = out / "merged"
    for name in ("config.json", "model.safetensors", "ppow_window_policy.json", "README.md"):
        assert (merged / name).is_file() or (out / name).is_file(), f"{name} was not saved"
    assert (merged / "ppow_window_policy.json").is_file() and (merged / "model.safetensors").is_file()
    policy = json.loads((merged / "ppow_window_policy.json").read_text())
    assert "serving_rule" in policy["calibration"]
    assert policy["calibration"]["min_speedup"] == 1.02  # the smoke YAML's served_min_speedup reached the rule
    assert "served rule:" in stdout and "lossless 1/1" in stdout
    served = json.loads((out / "ppow_served_evaluation.json").read_text())  # side by side on the serving runtime
    assert served["runtime"] == "eager" and served["arms"]["eager_speculative[served rule]"]["lossless_prompts"] == "1/1"
    # the drafter served with prompt lookup: its own calibrated rule, saved, lossless side by side
    assert served["arms"]["eager_speculative[with prompt lookup]"]["lossless_prompts"] == "1/1"
    hybrid_rule = json.loads((out / "hybrid" / "ppow_window_policy.json").read_text())
    assert "serving_rule" in hybrid_rule["calibration"] and (out / "hybrid" / "drafter" / "config.json").is_file()
    assert (cache / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()  # converted once, into the new cache


def test_saved_drafter_through_the_hook_is_lossless(main_job):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppow_trl.serving.assisted import load_assistant
    from ppow_trl.drafters.standalone import attach_window_policy
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    out, _, cache = main_job
    target_folder = cache / "SmolLM2-135M-Instruct"
    target = AutoModelForCausalLM.from_pretrained(target_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_folder)
    assistant = load_assistant(out / "merged")
    served = AdaptiveWindowPolicy.from_pretrained(out / "merged")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        plain = target.generate(**inputs, **settings)
        with_served_rule = target.generate(**inputs, assistant_model=assistant, **settings)
        # The served rule may be K = 0 (plain decoding) on a machine where nothing pays: force real windows too.
        attach_window_policy(assistant, served.with_window(3, 0.0))
        drafting = target.generate(**inputs, assistant_model=assistant, **settings)
    assert torch.equal(with_served_rule, plain)
    assert torch.equal(drafting, plain)
    # the saved hybrid (prompt lookup + the trained drafter) through the same hook
    hybrid = load_assistant(out / "hybrid", target=target)
    hybrid_rule = AdaptiveWindowPolicy.from_pretrained(out / "hybrid")
    with torch.no_grad():
        with_hybrid = target.generate(**inputs, assistant_model=hybrid, **settings)
        from ppow_trl.drafting import family_of

        family_of(hybrid).attach(hybrid, target, hybrid_rule.with_window(3, 0.0))
        hybrid_drafting = target.generate(**inputs, assistant_model=hybrid, **settings)
    assert torch.equal(with_hybrid, plain) and torch.equal(hybrid_drafting, plain)
