"""Model cards for PPOW drafters: what was trained against what, how, and the measured tau and speedup."""

from __future__ import annotations

from pathlib import Path

from ..core.cost import CostModel
from ..core.windowing import AdaptiveWindowPolicy

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
`custom_generate/generate.py`, a verbatim copy of `ppow_trl/core/custom_generate/generate.py` (it imports torch and
transformers' stopping criteria; when transformers' assisted loop calls the drafter it reads the window policy,
adds a stopping criterion and calls the model's own `generate`; no network, no file writes, no subprocess), and
for a reduced-vocabulary drafter `modeling_ppow_drafter.py`, a copy of `ppow_trl/drafter.py` without its
Auto-class registration (it defines the config and model classes: the target architecture's body plus a head
over the draft vocabulary). Read both files at the revision you pin."""

TARGET_SETUP = """from transformers import AutoTokenizer
from ppow_trl.serving.assisted import load_assistant
from ppow_trl.models import load_target

revision = "main"  # better: the commit hash you checked (see below)
target = load_target("{target}"{quantization})  # the target this drafter was trained for{quantization_note}
tokenizer = AutoTokenizer.from_pretrained(target.name_or_path)
messages = [{{"role": "user", "content": "Name three colours."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)"""
"""The first lines of every card's snippet: the target, its tokenizer and a prompt, so that the snippet runs as written
(``load_target`` takes a Hub id, a local folder or ppow_trl's offline alias, as the recipe's ``target_model``). The
target is loaded with the quantization the drafter was trained against (``args.target_quantization``), since the
rule and the costs saved with the drafter are that target's."""

GENERATE = """out = target.generate(**inputs, assistant_model=assistant, do_sample=False, max_new_tokens=64{generate_kwargs})
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""

STANDALONE_USAGE = """With ppow_trl installed (`pip install ppow_trl`), no remote code is run: `load_assistant` loads
the weights and installs ppow_trl's own copy of the window hook{reads_target}.

```python
{setup}
assistant = load_assistant("{repo}", revision=revision{target_kwarg})  # applies the adaptive window rule
{generate}
```

{without_ppow_trl}

{revision_note}{remote_code_note}"""

REMOTE_CODE_ROUTE = """Without ppow_trl, opt into the repo's code (`target` and `inputs`: your target and prompt, as above):

```python
from transformers import AutoModelForCausalLM
assistant = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True, revision=revision)
out = target.generate(**inputs, assistant_model=assistant, do_sample=False)
```

Both apply the adaptive window inside transformers' assisted generation (batch size 1). Without ppow_trl and
without `trust_remote_code=True`, transformers drafts a fixed K tokens."""

TARGET_READER_ROUTE = """This drafter computes from the target (its hidden states or its own modules), so it is loaded with
`target=` and needs ppow_trl: `load_assistant` installs the hooks that hand it the target's features and apply the
adaptive window inside transformers' assisted generation (batch size 1). `ppow_trl.drafting.get_family("{family}")
.detach(assistant)` removes the hooks from the target."""

MERGE_SNIPPET = """from peft import PeftModel
from ppow_trl.serving.assisted import save_assistant
from ppow_trl.core.windowing import AdaptiveWindowPolicy
from ppow_trl.core.cost import CostModel{family_import}
# base_drafter: the drafter this adapter was trained on (see "Drafter" above), built as in training: the same model or
# truncation and the same draft vocabulary. The adapter holds only the LoRA weights, so it cannot rebuild it.
if "base_drafter" not in globals():
    raise NameError("Build base_drafter first: the drafter this adapter was trained on, exactly as in training.")
drafter = PeftModel.from_pretrained(base_drafter, "{repo}", revision=revision).merge_and_unload()
policy = AdaptiveWindowPolicy.from_pretrained("{repo}", revision=revision)
cost_model = {cost_model}
save_assistant(drafter, "merged", policy=policy, cost_model=cost_model, tokenizer=tokenizer)
assistant = load_assistant("merged", target=target)
{generate}"""

ADAPTER_USAGE = """This folder holds a LoRA adapter. Merge it into its drafter once, and save the merged drafter with
its window rule (the recipe's `--merge_adapter True` does this into `merged/`). The lines below need `base_drafter`,
the drafter the adapter was trained on, built as in training:

```python
{setup}
{merge}
```

{merge_notes}

{revision_note}{remote_code_note}"""

ADAPTER_WITH_MERGED_USAGE = """This repo holds a LoRA adapter (its top-level files) and, in `merged/`, the drafter with the adapter
merged in and its window rule (the recipe's `--merge_adapter True`). With ppow_trl installed, no remote code is run:

```python
from huggingface_hub import snapshot_download
{setup}
folder = snapshot_download("{repo}", revision=revision, allow_patterns=["merged/*"])
assistant = load_assistant(f"{{folder}}/merged"{target_kwarg})  # the merged drafter, with its adaptive window rule
{generate}
```

To merge the adapter yourself (continuing the lines above):

```python
{merge}
```

{merge_notes}

{revision_note}{remote_code_note}"""

MERGE_NOTES = """`AdaptiveWindowPolicy.from_pretrained` and `CostModel.from_pretrained` take a local folder or a Hub repo id
(`revision=`, `token=`, `cache_dir=` are passed to `huggingface_hub.hf_hub_download`). `load_assistant` runs no
code from the folder: it installs ppow_trl's own window hook (adaptive window inside transformers' assisted
generation, batch size 1).{remote_code_merged}"""

REMOTE_CODE_MERGED = """ Where ppow_trl is not installed, `AutoModelForCausalLM.from_pretrained("merged",
trust_remote_code=True)` applies the same rule from the merged folder's `custom_generate/generate.py`."""


def _family(family, args, adapter: bool):
    """The drafter family the card describes: ``family`` (a name or a ``DrafterFamily``), else the one saved in the
    trainer's output folder (``merged/`` for an adapter), else ``None`` (unknown: the standalone routes are shown)."""
    from ..drafting import DrafterFamily, detect_family, get_family

    if isinstance(family, DrafterFamily):
        return family
    if family is not None:
        return get_family(family)
    folder = getattr(args, "output_dir", None)
    if not folder:
        return None
    folder = Path(folder) / "merged" if adapter else Path(folder)
    if not (folder / "config.json").is_file():
        return None
    try:
        return detect_family(folder)[0]
    except ValueError:
        return None


def _generate_kwargs(family) -> str:
    """``, speculation_type="dflash"``-style arguments of the family's route in transformers (none for most)."""
    import json

    kwargs = family.hf_generate_kwargs if family is not None else {}
    return "".join(f", {key}={json.dumps(value)}" for key, value in kwargs.items())


def render_usage(repo: str, target: str, *, adapter: bool, family=None, merged: bool = False,
                 cost_model_saved: bool = True, quantization: str | None = None) -> str:
    """The card's "Use" section: Python that runs as written (the target loaded by ``load_target(target)``, the drafter
    by ``load_assistant(repo, ...)``), then the other routes. ``family``: the drafter's ``DrafterFamily`` (``None``:
    unknown, the standalone routes). ``merged``: an adapter repo that also holds the merged drafter in ``merged/``.
    ``quantization``: the target's quantization in training (``"4bit"``, ``"8bit"``), with which the snippet loads it."""
    reads_target = family is not None and (family.reads_target or family.runs_on_target)
    remote_code = family is None or (family.writes_hook_file and not reads_target)
    notes = {"revision_note": REVISION_NOTE.format(repo=repo),
             "remote_code_note": "\n\n" + REMOTE_CODE_NOTE if remote_code else ""}
    setup = TARGET_SETUP.format(
        target=target, quantization=f', quantization="{quantization}"' if quantization else "",
        quantization_note=f" ({quantization}, as in training)" if quantization else "")
    target_kwarg = ", target=target" if reads_target else ""
    generate = GENERATE.format(generate_kwargs=_generate_kwargs(family))
    if not adapter:
        without = (REMOTE_CODE_ROUTE.format(repo=repo) if remote_code
                   else TARGET_READER_ROUTE.format(family=family.name))
        return STANDALONE_USAGE.format(
            setup=setup, repo=repo, target_kwarg=target_kwarg, generate=generate, without_ppow_trl=without,
            reads_target=" (with `target=`: and the hooks that hand the drafter the target's features)" if reads_target
            else "", **notes)
    # An adapter: the merged drafter's family may be unknown here, so the merge lines ask the drafter for its route.
    merge_generate = generate if family is not None else GENERATE.format(
        generate_kwargs=", **family_of(assistant).hf_generate_kwargs")
    merge = MERGE_SNIPPET.format(
        repo=repo, generate=merge_generate,
        family_import="" if family is not None else "\nfrom ppow_trl.drafting import family_of",
        cost_model=f'CostModel.from_pretrained("{repo}", revision=revision)' if cost_model_saved
        else "None  # no cost model was saved with this adapter")
    merge_notes = MERGE_NOTES.format(remote_code_merged=REMOTE_CODE_MERGED if remote_code else "")
    if merged:
        return ADAPTER_WITH_MERGED_USAGE.format(setup=setup, repo=repo, target_kwarg=target_kwarg, generate=generate,
                                                merge=merge, merge_notes=merge_notes, **notes)
    return ADAPTER_USAGE.format(setup=setup, merge=merge, merge_notes=merge_notes, **notes)


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
    family=None,
) -> str:
    """The README.md of a drafter folder, with YAML front matter the Hub reads.

    ``family`` (a name or a ``DrafterFamily``) picks the usage snippet's route (``target=`` for drafters that read the
    target, the family's ``target.generate`` arguments, whether the remote-code route exists); when not given it is
    detected from the drafter saved in ``args.output_dir`` (``merged/`` for an adapter), else the standalone routes
    are shown."""
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
    family = _family(family, args, adapter)
    output_dir = getattr(args, "output_dir", None)
    merged = bool(adapter and output_dir and (Path(output_dir) / "merged" / "config.json").is_file())
    usage = render_usage(repo, target, adapter=adapter, family=family, merged=merged,
                         cost_model_saved=cost_model is not None,
                         quantization=getattr(args, "target_quantization", None))
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
