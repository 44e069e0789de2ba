"""The reference that must match the code: configuration tables, logged metrics, the example model card, the
CHANGELOG's moved modules, and the files every package has.

``tools/render_reference.py`` generates ``docs/configuration.md``, ``docs/logged-metrics.md``,
``docs/model-card.md`` and the CHANGELOG's moved-modules block; these tests regenerate them in memory and compare, and
check what the generator takes on trust: that each field's default is on the page, that the docstrings state the defaults the code has, and
that every metric key in the trainers' code is in ``ppow_trl.training.logged_metrics`` (and the TRL ones in TRL).
No model is loaded.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import yaml

from ppow_trl import KDConfig, PPOWConfig
from ppow_trl.training import logged_metrics

sys.path.insert(0, str(Path(__file__).parent))
from docs_examples import python_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRAINING = ROOT / "ppow_trl" / "training"
GENERATED_PAGES = ("docs/configuration.md", "docs/logged-metrics.md", "docs/model-card.md")


@pytest.fixture(scope="module")
def render_reference():
    spec = importlib.util.spec_from_file_location("render_reference_under_test", ROOT / "tools" / "render_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config_classes(render_reference):
    """Each documented dataclass with the base its page section names (``None``: every field is its own)."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    recipe_arguments = render_reference.load_recipe().PPOWScriptArguments
    return [(PPOWConfig, GRPOConfig), (KDConfig, TrainingArguments), (recipe_arguments, None)]


def _section(page: str, heading: str) -> str:
    """The text of ``page`` under ``## heading``, up to the next ``## ``."""
    return page.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_generated_files_are_up_to_date():
    # In a fresh interpreter, as `make reference` runs it: inside the full suite, in a worker that had run other
    # tests first, the in-process render of docs/configuration.md once differed from a clean one (some test leaves
    # global state behind; not yet found), which is not what a user's `--check` sees.
    import subprocess

    run = subprocess.run([sys.executable, "tools/render_reference.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_declared_field_is_on_the_page_with_its_default(render_reference, config_classes):
    page = (ROOT / "docs" / "configuration.md").read_text()
    sections = {PPOWConfig: "PPOWConfig", KDConfig: "KDConfig"}
    for cls, _ in config_classes:
        section = _section(page, sections.get(cls, "Recipe arguments"))
        for item in render_reference.declared_fields(cls):
            row = next((line for line in section.splitlines() if line.startswith(f"| `{item.name}` |")), None)
            assert row is not None, f"{cls.__name__}.{item.name} has no row on docs/configuration.md"
            default = render_reference.default_value(item)
            assert f"| {render_reference.format_default(item)} |" in row, (cls.__name__, item.name, default, row)


def test_fields_left_off_the_page_keep_the_base_default(render_reference, config_classes):
    """The page says the other fields are the base class's, meaning and default: a default changed anywhere but in
    a declared field (which gets a row) would make that untrue."""
    for cls, base in config_classes:
        if base is None:
            continue
        declared = {item.name for item in render_reference.declared_fields(cls)}
        base_defaults = {item.name: render_reference.default_value(item) for item in dataclasses.fields(base)}
        for item in dataclasses.fields(cls):
            if item.name not in declared:
                assert render_reference.default_value(item) == base_defaults[item.name], (cls.__name__, item.name)


def test_the_docstrings_document_every_new_field_with_the_code_default(render_reference, config_classes):
    for cls, base in config_classes:
        documented = render_reference.documented_parameters(cls)
        inherited = {item.name for item in dataclasses.fields(base)} if base else set()
        fields = {item.name: item for item in dataclasses.fields(cls)}
        for item in render_reference.declared_fields(cls):
            if item.name in inherited:
                assert item.metadata.get("help"), f"{cls.__name__}.{item.name} changes a default without a help"
            else:
                assert item.name in documented, f"{cls.__name__}.{item.name} is missing from the docstring"
        for name, entry in documented.items():
            assert name in fields, f"{cls.__name__}'s docstring documents {name}, which is no field"
            default = render_reference.default_value(fields[name])
            if entry.stated_default is None:
                assert default is None, f"{cls.__name__}.{name}: the docstring states no default, the code {default!r}"
            else:
                stated = ast.literal_eval(entry.stated_default)
                assert stated == default, f"{cls.__name__}.{name}: docstring says {stated!r}, code {default!r}"


def test_the_docstring_parser_reads_groups_defaults_and_descriptions(render_reference):
    @dataclasses.dataclass
    class Example:
        """Intro.

        Parameters:
            > First group

            size (`int`, *optional*, defaults to `3`):
                How many,
                on two lines.
            name (`str`, *optional*):
                A name.
        """

        size: int = 3
        name: str | None = None

    documented = render_reference.documented_parameters(Example)
    assert documented["size"] == render_reference.DocumentedParameter("First group", "3", "How many, on two lines.")
    assert documented["name"].stated_default is None and documented["name"].group == "First group"
    assert render_reference.format_type(dataclasses.fields(Example)[1]) == "`str` or `None`"
    assert render_reference.cell("a | b `x | y`") == r"a \| b `x | y`"


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_every_metric_key_in_the_trainers_is_in_the_registry():
    """The ``ppow/*`` and ``kd/*`` keys the training code writes are the registry's, both ways; the evaluation keys
    come from the registry itself (``PPOW_EVAL``, ``TAU``)."""
    in_code = set()
    for path in sorted(TRAINING.glob("*.py")):
        if path.name != "logged_metrics.py":
            in_code |= {value for value in _string_constants(path) if re.fullmatch(r"(ppow|kd)/\w+", value)}
    registry = {metric.key for metric in (*logged_metrics.PPOW_TRAIN, *logged_metrics.KD_TRAIN)
                if metric.key.startswith(("ppow/", "kd/"))}
    assert in_code == registry
    trainer = (TRAINING / "ppow_trainer.py").read_text()
    assert "keys(PPOW_EVAL)" in trainer and "{TAU}" in (TRAINING / "kd_trainer.py").read_text()


def test_the_keys_credited_to_grpo_are_ones_trl_logs():
    import trl.trainer.grpo_trainer as grpo

    from ppow_trl.training import ppow_trainer

    source = inspect.getsource(grpo)
    reward_functions = {ppow_trainer.speed.__name__, ppow_trainer.proximity.__name__}
    assert "reward_funcs=[speed, proximity]" in inspect.getsource(ppow_trainer.PPOWTrainer.__init__)
    for metric in logged_metrics.GRPO_TRAIN:
        parts = metric.key.split("/")
        if parts[0] == "rewards":
            assert parts[1] in reward_functions and f'f"rewards/{{reward_func_name}}/{parts[2]}"' in source
        else:
            assert f'["{metric.key}"]' in source, f"TRL's GRPOTrainer no longer logs {metric.key}"


def test_the_on_policy_entries_are_the_registry_ones():
    tree = ast.parse((TRAINING / "on_policy.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    returned = [node.value for node in ast.walk(functions["on_policy_loss"]) if isinstance(node, ast.Return)]
    stats = {key.value for value in returned for element in getattr(value, "elts", [])
             if isinstance(element, ast.Dict) for key in element.keys if isinstance(key, ast.Constant)}
    appended = {key.value for node in ast.walk(functions["train_on_policy"])
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "log.append"
                for argument in node.args if isinstance(argument, ast.Dict)
                for key in argument.keys if isinstance(key, ast.Constant)}
    assert {"kl", "tv"} <= stats and {"step", "loss"} <= appended
    assert set(logged_metrics.keys(logged_metrics.ON_POLICY_STEP)) == (stats | appended) - {"step"}


def test_the_generated_pages_are_in_the_site_and_run_no_code():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in GENERATED_PAGES:
        assert page.removeprefix("docs/") in nav, f"{page} is not in mkdocs.yml's nav"
        assert python_blocks((ROOT / page).read_text()) == [], f"{page}'s Python blocks would run as docs examples"


def test_the_package_files_exist_and_agree():
    metadata = configparser.ConfigParser()
    metadata.read(ROOT / "setup.cfg")
    assert metadata["metadata"]["license"] == "Apache-2.0"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and len(license_text.splitlines()) > 190
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "Apache-2.0"
    assert metadata["metadata"]["version"].startswith(citation["version"])
    (paper,) = citation["references"]
    assert paper["url"] == "https://arxiv.org/abs/2605.14978" and paper["title"].startswith("PPOW")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {citation['version']}" in changelog
