"""Model cards for PPOW drafters: what was trained against what, how, and the measured tau and speedup."""

from __future__ import annotations

from pathlib import Path

from .cost import CostModel
from .windowing import AdaptiveWindowPolicy

PROTOCOL = (
    "Batch size 1. tau = tokens generated / target verification forwards (bonus token included, EAGLE's "
    "convention). Speedup = tokens/s of the method / tokens/s of the target alone, measured in the same run "
    "prompt by prompt (interleaved, after warm-up); median and [p25, p75] over prompts. Greedy outputs are "
    "checked to equal the target's own greedy output token for token."
)

HYPERPARAMETERS = (
    "max_window", "window_threshold", "num_generations", "temperature", "acceptance", "speed_reward",
    "proximity_weight", "proximity_divergence", "selection_beta", "selection_uniform_share", "per_token_credit",
    "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "seed",
    "target_quantization",
)


REVISION_NOTE = """Pin `revision=` to the commit hash of this repo that you checked (the repo's "Files and versions" tab
or `huggingface_hub.HfApi().model_info("{repo}").sha`): a branch such as `main` can change after you read it."""

REMOTE_CODE_NOTE = """What `trust_remote_code=True` executes (with your privileges), at the revision fetched:
`custom_generate/generate.py`, a verbatim copy of `ppow_trl/custom_generate/generate.py` (it imports torch and
transformers' stopping criteria; when transformers' assisted loop calls the drafter it reads the window policy,
adds a stopping criterion and calls the model's own `generate`; no network, no file writes, no subprocess), and
for a reduced-vocabulary drafter `modeling_ppow_drafter.py`, a copy of `ppow_trl/drafter.py` without its
Auto-class registration (it defines the config and model classes: the target architecture's body plus a head
over the draft vocabulary). Read both files at the revision you pin."""

STANDALONE_USAGE = """With ppow_trl installed (`pip install ppow_trl`), no remote code is run: `load_assistant` loads
the weights and installs ppow_trl's own copy of the window hook.

```python
from ppow_trl.assisted import load_assistant
revision = "main"  # better: the commit hash you checked (see below)
assistant = load_assistant("{repo}", revision=revision)  # applies the adaptive window rule
out = target.generate(**inputs, assistant_model=assistant, do_sample=False)
```

Without ppow_trl, opt into the repo's code:

```python
from transformers import AutoModelForCausalLM
assistant = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True, revision=revision)
out = target.generate(**inputs, assistant_model=assistant, do_sample=False)
```

Both apply the adaptive window inside transformers' assisted generation (batch size 1). Without ppow_trl and
without `trust_remote_code=True`, transformers drafts a fixed K tokens.

{revision_note}

{remote_code_note}"""

ADAPTER_USAGE = """This folder holds a LoRA adapter. Merge it into its drafter once, and save the merged drafter with
its window rule (the recipe's `--merge_adapter True` does this into `merged/`):

```python
from peft import PeftModel
from ppow_trl.assisted import save_assistant, load_assistant
from ppow_trl.windowing import AdaptiveWindowPolicy
from ppow_trl.cost import CostModel
revision = "main"  # better: the commit hash you checked (see below)
drafter = PeftModel.from_pretrained(base_drafter, "{repo}", revision=revision).merge_and_unload()
policy = AdaptiveWindowPolicy.from_pretrained("{repo}", revision=revision)
cost_model = CostModel.from_pretrained("{repo}", revision=revision)
save_assistant(drafter, "merged", policy=policy, cost_model=cost_model, tokenizer=tokenizer)
out = target.generate(**inputs, assistant_model=load_assistant("merged"), do_sample=False)
```

`AdaptiveWindowPolicy.from_pretrained` and `CostModel.from_pretrained` take a local folder or a Hub repo id
(`revision=`, `token=`, `cache_dir=` are passed to `huggingface_hub.hf_hub_download`). `load_assistant` runs no
code from the folder: it installs ppow_trl's own window hook (adaptive window inside transformers' assisted
generation, batch size 1). Where ppow_trl is not installed, `AutoModelForCausalLM.from_pretrained("merged",
trust_remote_code=True)` applies the same rule from the merged folder's `custom_generate/generate.py`.

{revision_note}

{remote_code_note}"""


def evaluation_table(summary: list[dict]) -> str:
    """Markdown table of a benchmark summary (rows of ``ppow_trl.bench.summarize_records``)."""
    lines = [
        "| mode | method | tau | speedup median [p25, p75] | tokens/s | lossless |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary:
        lines.append(
            f"| {row['mode']} | {row['label']} | {row['tau']:.2f} | {row['speedup_median']:.2f} "
            f"[{row['speedup_p25']:.2f}, {row['speedup_p75']:.2f}] | {row['tokens_per_second_median']:.1f} | "
            f"{row.get('lossless_prompts', '-')} |"
        )
    return "\n".join(lines)


def render_model_card(
    *,
    model_name: str,
    target: str,
    drafter: str,
    data: str,
    args,
    policy: AdaptiveWindowPolicy,
    cost_model: CostModel | None,
    evaluation: list[dict] | None = None,
    evaluation_setup: str = "",
    hub_model_id: str | None = None,
    adapter: bool = False,
) -> str:
    """The README.md of a drafter folder, with YAML front matter the Hub reads."""
    repo = hub_model_id or model_name
    hyper = "\n".join(f"| {name} | {getattr(args, name)} |" for name in HYPERPARAMETERS if hasattr(args, name))
    cost = (
        f"t_d/t_t = {cost_model.drafter_cost:.3f}; t_v(L)/t_t for L = 0..{len(cost_model.verify_cost) - 1}: "
        + ", ".join(f"{c:.2f}" for c in cost_model.verify_cost)
        + (f" ({cost_model.description})" if cost_model.description else "")
        if cost_model
        else "not measured"
    )
    serving = (policy.calibration or {}).get("serving_rule")
    serving = f"\n- Served rule, chosen on the saved drafter with this machine's measured costs: {serving}" if serving else ""
    notes = {"revision_note": REVISION_NOTE.format(repo=repo), "remote_code_note": REMOTE_CODE_NOTE}
    usage = (ADAPTER_USAGE if adapter else STANDALONE_USAGE).format(repo=repo, **notes)
    results = (
        f"{evaluation_setup}\n\n{evaluation_table(evaluation)}" if evaluation else "No evaluation was run with this save."
    )
    return f"""---
library_name: transformers
tags:
- ppow
- speculative-decoding
- trl
- draft-model
---

# {model_name}

A speculative-decoding drafter for `{target}`, trained with PPOW (window-level RL rewards with the target
as verifier; arXiv 2605.14978) using ppow_trl on top of TRL's GRPOTrainer.

- Target (verifier): `{target}`
- Drafter: {drafter}
- Training data: {data}
- Window rule (calibrated on held-out contexts after training): draft while the running product of drafter confidences stays >= h = {policy.threshold}, up to
  K = {policy.max_window} tokens (K = 0: no speculation); confidence = max softmax(logits / T_c), T_c = {policy.confidence_temperature}
  (saved in `ppow_window_policy.json`).{serving}
- Cost model: {cost}

## Use

{usage}

## Evaluation

{PROTOCOL}

{results}

## Training hyperparameters

| parameter | value |
|---|---|
{hyper}
"""


def write_model_card(folder: str | Path, card: str) -> Path:
    path = Path(folder) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(card)
    return path
