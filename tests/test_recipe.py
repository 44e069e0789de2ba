"""recipes/ppow_llama.py: every shipped config parses; the whole pipeline runs on tiny local models."""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama, make_tiny_tokenizer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))
import ppow_llama  # noqa: E402


@pytest.mark.parametrize("config", sorted((RECIPES / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_parse(config):
    # GPU configs ask for bf16, which this CPU machine refuses at validation: override it, check the rest.
    script, training, model = ppow_llama.make_parser().parse_args_and_config(args=["--config", str(config), "--bf16", "False"])
    assert script.target_model and training.max_window >= 1 and training.max_completion_length == training.max_window
    assert model.use_peft and model.lora_target_modules


def test_unknown_field_fails_fast_naming_it(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_windw: 4\n")
    with pytest.raises(ValueError, match="max_windw"):
        ppow_llama.make_parser().parse_args_and_config(args=["--config", str(config)])
    with pytest.raises(ValueError, match="max_window"):  # PPOWConfig's own validation names the field
        ppow_llama.make_parser().parse_args_and_config(args=["--max_window", "0"])


def write_prompts(path, count, seed):
    g = torch.Generator().manual_seed(seed)
    lines = [json.dumps({"prompt": " ".join(f"w{int(i)}" for i in torch.randint(1, 55, (4,), generator=g))})
             for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_pipeline_args(tmp_path, target_dir) -> list[str]:
    """The recipe's arguments for a short standalone run on a tiny target saved in ``target_dir``."""
    return [
        "--target_model", str(target_dir), "--drafter_layers", "1",
        "--train_prompts", str(write_prompts(tmp_path / "train.jsonl", 10, 0)), "--num_train_prompts", "10",
        "--max_new_tokens", "8", "--kd_steps", "2",
        "--eval_prompts", str(write_prompts(tmp_path / "eval.jsonl", 2, 1)), "--num_eval_prompts", "2",
        "--eval_max_new_tokens", "6", "--merge_adapter", "True", "--cache_dir", str(tmp_path / "cache"),
        "--output_dir", str(tmp_path / "out"), "--max_window", "3", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_steps", "2", "--report_to", "none", "--save_strategy", "no",
        "--drafter_cost", "0.3", "--verify_cost", "1.0", "1.4", "1.6", "1.8",
        "--use_peft", "True", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj",
    ]


def test_pipeline_runs_on_tiny_models(tmp_path, monkeypatch):
    target_dir = tmp_path / "target"
    make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5).save_pretrained(target_dir)
    make_tiny_tokenizer().save_pretrained(target_dir)
    serving_prompts = write_prompts(tmp_path / "serving.jsonl", 5, 2)
    args = tiny_pipeline_args(tmp_path, target_dir) + ["--draft_vocab_size", "40", "--serving_calibration_prompts",
                                                       str(serving_prompts), "--num_serving_calibration_prompts", "3"]
    script, training, model = ppow_llama.make_parser().parse_args_and_config(args=args)
    calibrated = []  # the responses each served rule is calibrated on
    real_contexts = ppow_llama.held_out_contexts
    monkeypatch.setattr(ppow_llama, "held_out_contexts",
                        lambda prompt_ids, *a: calibrated.append(len(prompt_ids)) or real_contexts(prompt_ids, *a))
    trainer = ppow_llama.main(script, training, model)
    out = tmp_path / "out"
    # both served rules (the drafter's and the hybrid's) on the 3 serving-domain responses, not the 2 held-out ones
    assert calibrated == [3, 3]
    evaluation = json.loads((out / "ppow_served_evaluation.json").read_text())
    assert evaluation["calibrated_on"].startswith(f"the target's responses to 3 {serving_prompts} prompts")
    for name in ("adapter_config.json", "ppow_window_policy.json", "ppow_cost_model.json", "README.md"):
        assert (out / name).exists(), name
    card = (out / "README.md").read_text()
    assert "fast_adaptive" in card and "tau" in card and "trust_remote_code=True" in card
    assert "LoRA adapter" in card and "merge_and_unload" in card  # an adapter folder says how to use it
    assert trainer.state.global_step == 2
    # the served rule was decided on the merged drafter with costs measured here, not the training costs given
    for folder in (out, out / "merged"):
        saved_cost = json.loads((folder / "ppow_cost_model.json").read_text())
        assert "served drafter" in saved_cost["description"] and saved_cost["drafter_cost"] != 0.3
        saved_policy = json.loads((folder / "ppow_window_policy.json").read_text())
        assert saved_policy["calibration"]["serving_rule"] in card
        assert (saved_policy["max_window"] == 0) == (saved_policy["calibration"]["best_speculative_speedup"] <= 1.0)
    # the merged standalone drafter loads as an assistant and stays lossless
    from ppow_trl.serving.assisted import load_assistant

    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5)
    assistant = load_assistant(out / "merged")
    ids = torch.tensor([[2, 4, 9, 10, 3, 2, 5]])
    assert torch.equal(target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=8),
                       target.generate(ids, do_sample=False, max_new_tokens=8))


def test_missing_target_and_incompatible_drafter_fail_naming_the_field(tmp_path):
    parser = ppow_llama.make_parser()
    base = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--num_generations", "4",
            "--per_device_train_batch_size", "8"]
    script, training, model = parser.parse_args_and_config(args=base + ["--target_model", str(tmp_path / "nowhere")])
    with pytest.raises(OSError, match="--target_model"):
        ppow_llama.main(script, training, model)

    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    make_tiny_llama(num_layers=2, seed=0).save_pretrained(target_dir)
    make_tiny_tokenizer().save_pretrained(target_dir)
    make_tiny_llama(num_layers=1, seed=1, vocab_size=68).save_pretrained(drafter_dir)
    make_tiny_tokenizer(extra_words=4).save_pretrained(drafter_dir)  # another tokenizer
    args = base + ["--target_model", str(target_dir), "--drafter_model", str(drafter_dir), "--draft_vocab_size", "0",
                   "--train_prompts", str(write_prompts(tmp_path / "train.jsonl", 4, 0)), "--num_train_prompts", "4",
                   "--max_new_tokens", "4", "--cache_dir", str(tmp_path / "cache")]
    script, training, model = parser.parse_args_and_config(args=args)
    with pytest.raises(ValueError, match="--drafter_model"):
        ppow_llama.main(script, training, model)


def test_eagle3_pipeline_runs_on_tiny_models(tmp_path):
    """drafter_type: eagle3 end to end: cached features, KD with TTT, PPOW with LoRA on the head, calibration,
    evaluation, the merged head saved as an assistant (HF route through the target hooks) and exported in
    SpecForge's layout (re-imported with identical logits)."""
    target_dir = tmp_path / "target"
    make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5).save_pretrained(target_dir)
    make_tiny_tokenizer().save_pretrained(target_dir)
    args = [
        "--target_model", str(target_dir), "--drafter_type", "eagle3", "--eagle3_layer_ids", "0", "1", "2",
        "--ttt_steps", "2", "--export_format", "specforge", "--draft_vocab_size", "40",
        "--train_prompts", str(write_prompts(tmp_path / "train.jsonl", 10, 0)), "--num_train_prompts", "10",
        "--max_new_tokens", "8", "--kd_steps", "2",
        "--eval_prompts", str(write_prompts(tmp_path / "eval.jsonl", 2, 1)), "--num_eval_prompts", "2",
        "--eval_max_new_tokens", "6", "--merge_adapter", "True", "--cache_dir", str(tmp_path / "cache"),
        "--output_dir", str(tmp_path / "out"), "--max_window", "3", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_steps", "2", "--report_to", "none", "--save_strategy", "no",
        "--acceptance", "greedy", "--reward_source", "cache",  # the shipped configs' rewards, on a family reading features
        "--drafter_cost", "0.3", "--verify_cost", "1.0", "1.4", "1.6", "1.8",
        "--use_peft", "True", "--lora_r", "4", "--lora_target_modules", "fc", "q_proj", "v_proj",
    ]
    script, training, model = ppow_llama.make_parser().parse_args_and_config(args=args)
    trainer = ppow_llama.main(script, training, model)
    out = tmp_path / "out"
    assert trainer.state.global_step == 2 and (out / "README.md").exists()
    assert "EAGLE-3 head" in (out / "README.md").read_text()
    from ppow_trl.serving.assisted import load_assistant
    from ppow_trl.drafters.eagle3 import import_eagle3, target_features

    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5)
    assistant = load_assistant(out / "merged", target=target)
    ids = torch.tensor([[2, 4, 9, 10, 3, 2, 5]])
    assert torch.equal(target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=8),
                       target.generate(ids, do_sample=False, max_new_tokens=8))
    exported = import_eagle3(out / "eagle3-specforge", target=target)
    features = target_features(target, ids, layer_ids=[0, 1, 2])
    torch.testing.assert_close(exported(input_ids=ids[:, 1:], target_hidden_states=features[:, :-1]).logits,
                               assistant(input_ids=ids[:, 1:], target_hidden_states=features[:, :-1]).logits)


def test_dflash_pipeline_runs_on_tiny_models(tmp_path):
    """drafter_type: dflash end to end: cached features, KD on anchored blocks, PPOW with LoRA (plain PEFT wrapper),
    calibration, evaluation, the merged drafter saved in transformers' layout (native route, lossless) and exported
    in z-lab's layout (re-imported with identical block outputs)."""
    target_dir = tmp_path / "target"
    make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5).save_pretrained(target_dir)
    make_tiny_tokenizer().save_pretrained(target_dir)
    args = [
        "--target_model", str(target_dir), "--drafter_type", "dflash", "--dflash_block_size", "4",
        "--dflash_layers", "1", "--dflash_mask_token_id", "6", "--export_format", "zlab", "--draft_vocab_size", "0",
        "--train_prompts", str(write_prompts(tmp_path / "train.jsonl", 10, 0)), "--num_train_prompts", "10",
        "--max_new_tokens", "8", "--kd_steps", "2",
        "--eval_prompts", str(write_prompts(tmp_path / "eval.jsonl", 2, 1)), "--num_eval_prompts", "2",
        "--eval_max_new_tokens", "6", "--merge_adapter", "True", "--cache_dir", str(tmp_path / "cache"),
        "--output_dir", str(tmp_path / "out"), "--max_window", "3", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_steps", "2", "--report_to", "none", "--save_strategy", "no",
        "--drafter_cost", "0.3", "--verify_cost", "1.0", "1.4", "1.6", "1.8",
        "--use_peft", "True", "--lora_r", "4", "--lora_target_modules", "fc", "q_proj", "v_proj",
    ]
    script, training, model = ppow_llama.make_parser().parse_args_and_config(args=args)
    trainer = ppow_llama.main(script, training, model)
    out = tmp_path / "out"
    assert trainer.state.global_step == 2 and "DFlash block drafter" in (out / "README.md").read_text()
    from transformers import AutoModel

    from ppow_trl.serving.assisted import load_assistant
    from ppow_trl.drafters.dflash import anchored_block_hidden, import_dflash

    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5)
    assistant = load_assistant(out / "merged", target=target)
    ids = torch.tensor([[2, 4, 9, 10, 3, 2, 5]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=8)
    assert torch.equal(target.generate(ids, assistant_model=assistant, speculation_type="dflash", do_sample=False,
                                       max_new_tokens=8), plain)
    exported = import_dflash(out / "dflash-zlab", target=target)
    stock = AutoModel.from_pretrained(out / "merged")
    from ppow_trl.drafters.eagle3 import target_features

    features = target_features(target, ids, layer_ids=[i + 1 for i in stock.config.target_layer_ids])
    anchors = torch.tensor([[3, 5]])
    with torch.no_grad():
        torch.testing.assert_close(
            anchored_block_hidden(exported, target.get_input_embeddings(), features, ids[:, [3, 5]], anchors),
            anchored_block_hidden(stock, target.get_input_embeddings(), features, ids[:, [3, 5]], anchors))


# ------------------------------------------------------------------------------------- bad input, as a user types it


def test_missing_config_fails_at_once_naming_the_file_and_the_shipped_configs(tmp_path):
    """`--config missing.yaml`: one line naming the file and the configs to pick from, no traceback, no model."""
    import subprocess

    run = subprocess.run([sys.executable, str(RECIPES / "ppow_llama.py"), "--config", "missing.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "missing.yaml" in last and "no such file" in last and "offline_smollm2.yaml" in last, run.stderr
    assert not run.stdout

    message = ppow_llama.config_error(["--max_steps", "2", "--config", str(tmp_path / "missing.yaml")])
    assert str(tmp_path / "missing.yaml") in message and "\n" not in message
    assert all(config.name in message for config in (RECIPES / "configs").glob("*.yaml"))
    assert "--config" in ppow_llama.config_error(["--config"])  # no path after it
    assert ppow_llama.config_error(["--config", str(ppow_llama.DEFAULT_CONFIG)]) is None
    assert ppow_llama.config_error(["--max_steps", "2"]) is None


def test_flags_without_a_config_change_the_offline_default():
    """`recipes/ppow_llama.py --max_steps 3` is the offline default with 3 steps, not bare PPOWConfig defaults."""
    argv = ppow_llama.with_default_config(["--max_steps", "3"])
    assert argv[:2] == ["--config", str(ppow_llama.DEFAULT_CONFIG)]
    _, training, _ = ppow_llama.make_parser().parse_args_and_config(args=argv)
    assert training.max_steps == 3 and training.runtime == "compiled"  # the flag over the default's YAML
    assert ppow_llama.with_default_config([]) == ["--config", str(ppow_llama.DEFAULT_CONFIG)]
    for argv in (["--config", "mine.yaml", "--max_steps", "3"], ["--config=mine.yaml"], ["--help"]):
        assert ppow_llama.with_default_config(argv) == argv


@pytest.mark.parametrize("flags, field", [
    (["--learning_rate", "-1"], "learning_rate"),
    (["--learning_rate", "0"], "learning_rate"),
    (["--max_steps", "0"], "max_steps"),
    (["--max_steps", "-3"], "max_steps"),
    (["--num_train_epochs", "0"], "num_train_epochs"),
    (["--num_generations", "0"], "num_generations"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size"),
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps"),
    (["--num_iterations", "0"], "num_iterations"),
    (["--weight_decay", "-0.1"], "weight_decay"),
    (["--max_grad_norm", "-1"], "max_grad_norm"),
    (["--beta", "-0.1"], "beta"),
    (["--epsilon", "0"], "epsilon"),
    (["--served_min_speedup", "0.9"], "served_min_speedup"),
])
def test_bad_training_numbers_fail_at_parse_time_naming_the_field(tmp_path, flags, field):
    args = ["--output_dir", str(tmp_path / "out"), "--report_to", "none"] + flags
    with pytest.raises(ValueError, match=rf"Invalid PPOWConfig:(.|\n)*- {field} .*got"):
        ppow_llama.make_parser().parse_args_and_config(args=args)


def test_negative_learning_rate_stops_the_script_before_any_data(tmp_path, monkeypatch, capsys):
    """The script's own entry point: a clear error and exit code 2 from the arguments alone (nothing is loaded)."""
    import runpy

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # what the entry point sets on a CPU machine, undone after
    monkeypatch.setattr(sys, "argv", ["ppow_llama.py", "--learning_rate", "-1", "--output_dir", str(tmp_path / "o")])
    import ppow_trl.models  # the entry point's fresh namespace imports load_target from here

    monkeypatch.setattr(ppow_trl.models, "load_target", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(RECIPES / "ppow_llama.py"), run_name="__main__")
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "learning_rate must be > 0, got -1.0" in error and "Traceback" not in error
    assert not (tmp_path / "o").exists()


def test_gguf_export_of_a_reduced_head_fails_at_parse_time(tmp_path):
    args = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--export_format", "gguf"]
    with pytest.raises(ValueError, match="export_format 'gguf' writes a full-vocabulary head: train with --draft_vocab_size 0"):
        ppow_llama.make_parser().parse_args_and_config(args=args)
    args += ["--draft_vocab_size", "0"]
    script, _, _ = ppow_llama.make_parser().parse_args_and_config(args=args)
    assert script.export_format == "gguf"


def test_gguf_export_carries_the_served_rule_for_llama_cpp(tmp_path):
    """--export_format gguf on a full-vocabulary standalone drafter: the .gguf file, and the served window rule next to
    it (what ``ppow_trl.interop.llama_cpp_draft.LlamaCppDrafter`` reads)."""
    from conftest import CHAT_TEMPLATE
    from test_gguf_export import make_bpe_tokenizer

    from ppow_trl.interop.gguf_export import load_gguf_drafter

    tokenizer = make_bpe_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    target_dir = tmp_path / "target"
    make_tiny_llama(vocab_size=len(tokenizer), num_layers=2, seed=0, initializer_range=0.5).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    args = tiny_pipeline_args(tmp_path, target_dir) + ["--draft_vocab_size", "0", "--export_format", "gguf"]
    script, training, model = ppow_llama.make_parser().parse_args_and_config(args=args)
    ppow_llama.main(script, training, model)
    folder = tmp_path / "out" / "standalone-gguf"
    assert sorted(p.name for p in folder.iterdir()) == ["drafter-f32.gguf", "ppow_window_policy.json"]
    assert json.loads((folder / "ppow_window_policy.json").read_text()) == json.loads(
        (tmp_path / "out" / "ppow_window_policy.json").read_text())
    assert load_gguf_drafter(folder / "drafter-f32.gguf").config.num_hidden_layers == 1


def test_serving_calibration_prompts_leave_out_the_evaluated_and_trained_ones(tmp_path):
    source = write_prompts(tmp_path / "domain.jsonl", 12, 3)
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(row) for row in rows[:2]) + "\n")
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows[2:5]) + "\n")
    args = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--serving_calibration_prompts", str(source),
            "--eval_prompts", str(tmp_path / "eval.jsonl"), "--num_eval_prompts", "2"]
    trained = ppow_llama.load_prompts(str(tmp_path / "train.jsonl"))
    used = {row["prompt"] for row in rows[:5]}
    for count in (5, 7):
        script, training, _ = ppow_llama.make_parser().parse_args_and_config(
            args=args + ["--num_serving_calibration_prompts", str(count)])
        chosen = ppow_llama.serving_calibration_prompts(script, training.seed, trained=trained)
        texts = [row["messages"][-1]["content"] for row in chosen]
        assert len(texts) == len(set(texts)) == count and not set(texts) & used
        again = ppow_llama.serving_calibration_prompts(script, training.seed, trained=trained)
        assert [row["messages"] for row in again] == [row["messages"] for row in chosen]  # seeded
    # 12 prompts, 5 used: asking for 8 fails before any work, saying what to do
    script, training, _ = ppow_llama.make_parser().parse_args_and_config(args=args + ["--num_serving_calibration_prompts", "8"])
    with pytest.raises(ValueError, match="has 7 prompts that the evaluation and training do not use, fewer than "
                                         "num_serving_calibration_prompts = 8: ask for fewer"):
        ppow_llama.serving_calibration_prompts(script, training.seed, trained=trained)
    with pytest.raises(ValueError, match="num_serving_calibration_prompts must be >= 1"):
        ppow_llama.make_parser().parse_args_and_config(args=args + ["--num_serving_calibration_prompts", "0"])


def test_teacher_forced_and_mixed_data_fail_fast_on_what_they_cannot_do(tmp_path):
    parse = lambda *flags: ppow_llama.make_parser().parse_args_and_config(args=list(flags))  # noqa: E731
    with pytest.raises(ValueError, match="train_prompts: sharegpt"):
        parse("--train_data", "mixed", "--train_prompts", "mtbench")
    with pytest.raises(ValueError, match="train_data must be one of"):
        parse("--train_data", "fixed")
    with pytest.raises(ValueError, match="regenerated_fraction"):
        parse("--train_data", "mixed", "--regenerated_fraction", "1.0")
    with pytest.raises(ValueError, match="precision"):
        parse("--kd_precision", "fp16")
    script, training, _ = parse("--config", str(RECIPES / "configs" / "offline_smollm2.yaml"),
                                "--reward_source", "cache")
    with pytest.raises(ValueError, match="reward_source: target"):  # cached greedy rewards need the target's own text
        ppow_llama.check_arguments(script, training)
    script, training, _ = parse("--config", str(RECIPES / "configs" / "offline_smollm2.yaml"))
    ppow_llama.check_arguments(script, training)  # the shipped default is consistent


def test_split_by_prompt_length_gives_the_shortest_prompts_to_the_target():
    lengths = [50, 10, 40, 20, 90, 30, 80, 60, 70, 15]
    answered, held, forced = ppow_llama.split_by_prompt_length(lengths, regenerated=5, calibration=2)
    assert sorted(answered + held) == [1, 2, 3, 5, 9]  # the 5 shortest: 10, 40, 20, 30, 15
    assert len(held) == 2 and forced == [0, 4, 6, 7, 8]
    assert sorted(answered + held + forced) == list(range(10))


def test_mixed_data_teacher_forces_the_long_prompts_and_regenerates_the_short(tmp_path, monkeypatch):
    from datasets import Dataset

    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5, vocab_size=64)
    tokenizer = make_tiny_tokenizer()
    words = lambda i, n: " ".join(f"w{(i * 5 + j) % 56}" for j in range(n))  # noqa: E731
    tiny = Dataset.from_list([{"id": f"c{i}", "messages": [{"role": "user", "content": words(i, 1 + i)}],
                               "answer": words(i + 1, 4)} for i in range(10)])  # prompt i holds i + 1 words
    monkeypatch.setattr(ppow_llama, "load_sharegpt_conversations", lambda *a, **k: tiny)
    script, _, _ = ppow_llama.make_parser().parse_args_and_config(args=[
        "--train_data", "mixed", "--num_train_prompts", "10", "--regenerated_fraction", "0.4",
        "--calibration_fraction", "0.2", "--max_new_tokens", "5", "--max_answer_tokens", "3",
        "--calibration_max_new_tokens", "4", "--regeneration_batch_size", "3", "--kd_steps", "1"])
    train, calibration = ppow_llama.training_data(target, tokenizer, tiny.remove_columns("answer"), script, 0,
                                                  tmp_path / "cache")
    answers = dict(zip(tiny["id"], tiny["answer"]))
    forced = [row for row in train if row["id"] in {f"c{i}" for i in range(6, 10)}]
    assert len(forced) == 4  # the 4 longest prompts: their dataset answers, cut to 3 tokens
    for row in forced:
        assert row["response_ids"] == tokenizer(answers[row["id"]], add_special_tokens=False)["input_ids"][:3]
    answered = [row for row in train if row not in forced]
    assert sorted([row["id"] for row in answered] + list(calibration["id"])) == [f"c{i}" for i in range(6)]
    assert len(calibration) == 2 and len(answered) == 4
    for row in answered:  # the target's greedy answers, labels aligned with them
        assert len(row["topk_ids"]) == len(row["response_ids"]) <= 5
        assert [ids[0] for ids in row["topk_ids"]] == row["response_ids"]
    assert all(len(r) <= 4 for r in calibration["response_ids"])


def test_mixed_data_for_an_eagle3_head_carries_its_features(tmp_path):
    """train_data: mixed with an EAGLE-3 head: the teacher-forced rows keep the target's hidden states from their
    labelling forward (no second pass over them), the target's answers get theirs computed, and every row's features
    equal an unpadded forward's over its own prompt + response (brute force)."""
    from ppow_trl.data import load_prompts

    target = make_tiny_llama(num_layers=2, seed=0)
    tokenizer = make_tiny_tokenizer()
    args = ["--train_data", "mixed", "--regenerated_fraction", "0.3", "--calibration_fraction", "0.2",
            "--num_train_prompts", "10", "--max_answer_tokens", "6", "--max_new_tokens", "4",
            "--calibration_max_new_tokens", "4", "--regeneration_batch_size", "4", "--regeneration_precision", "fp32",
            "--label_precision", "fp32", "--drafter_type", "eagle3", "--eagle3_layer_ids", "0", "2", "--kd_steps", "1",
            "--output_dir", str(tmp_path / "out"), "--reward_source", "target", "--report_to", "none"]
    script, training, _ = ppow_llama.make_parser().parse_args_and_config(args=args)
    layers = ppow_llama.planned_feature_layers(script, target)
    assert layers == [0, 2]
    prompts = load_prompts("sharegpt", num_samples=10, seed=0)
    train, calibration = ppow_llama.training_data(target, tokenizer, prompts, script, 0, tmp_path / "cache",
                                                  feature_layer_ids=layers)
    assert len(train) > 2 and "target_features" not in calibration.column_names
    assert list((tmp_path / "cache").glob("features/*"))  # the target's answers: their own pass
    for row in train:
        sequence = torch.tensor([list(row["prompt_ids"]) + list(row["response_ids"])])
        with torch.no_grad():
            states = target(sequence, output_hidden_states=True).hidden_states
        expected = torch.cat([states[i][0] for i in layers], dim=-1).half().float()
        torch.testing.assert_close(torch.as_tensor(row["target_features"]).float(), expected, atol=2e-3, rtol=2e-3)
