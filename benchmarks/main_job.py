"""The main job as a new user runs it, timed: the README's command on an empty cache, its summary kept.

Runs ``accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/ppow_llama.py`` (the
offline default, ``recipes/configs/offline_smollm2.yaml``) with ``PPOW_TRL_CACHE`` pointing at a fresh, empty folder,
so that the converted model, the data and the compiled runtime are all built as on a fresh machine (``--warm``
keeps the usual cache instead), then copies the job's ``run_summary.json`` (written by the recipe: CPU, minutes,
training tokens, served rule, the served rule measured against plain decoding on the same runtime and precision)
to ``benchmarks/results/main_job.json``, with the command, the end-to-end wall-clock and the log's last lines.

    python benchmarks/main_job.py                      # ~30 min on 2 cores
    python benchmarks/main_job.py --warm --out /tmp/main_job.json -- --num_train_prompts 200   # extra recipe flags
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["accelerate", "launch", "--config_file", "recipes/accelerate_configs/cpu_2proc.yaml",
           "recipes/ppow_llama.py"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", action="store_true", help="Use the usual cache (compiled runtime, data) as it is.")
    parser.add_argument("--output-dir", default="outputs/ppow-smollm2-offline")
    parser.add_argument("--log", default="outputs/main_job.log")
    parser.add_argument("--out", default="benchmarks/results/main_job.json")
    parser.add_argument("recipe_flags", nargs="*", help="Flags passed on to the recipe (after --).")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    scratch = None
    if not args.warm:
        scratch = tempfile.mkdtemp(prefix="ppow-main-job-cache-", dir=os.environ.get("TMPDIR"))
        env["PPOW_TRL_CACHE"] = scratch
    command = COMMAND + ["--output_dir", args.output_dir] + list(args.recipe_flags)
    log = ROOT / args.log
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"Running {shlex.join(command)}" + (f" on an empty cache ({scratch})" if scratch else "") + f"; log: {log}",
          flush=True)
    start = time.time()
    with open(log, "w") as handle:
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    minutes = (time.time() - start) / 60
    if status != 0:
        sys.exit(f"The main job failed (exit {status}) after {minutes:.1f} min; see {log}.")
    summary = json.loads((ROOT / args.output_dir / "run_summary.json").read_text())
    tail = [line for line in log.read_text(errors="replace").replace("\r", "\n").splitlines()
            if line.strip() and "it/s]" not in line and "s/it]" not in line][-24:]
    result = {"command": "python benchmarks/main_job.py" + (" --warm" if args.warm else ""),
              "job": shlex.join(command), "fresh_cache": not args.warm, "wall_minutes": round(minutes, 2),
              **summary, "log_tail": tail}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{minutes:.1f} min end to end; {summary['train_tokens']:,} training tokens; served rule K = "
          f"{summary['served_rule']['max_window']}; measured {summary.get('measured', {}).get('speedup', float('nan')):.3f}x "
          f"-> {out}")
    return result


if __name__ == "__main__":
    main()
