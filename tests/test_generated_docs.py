"""Generated numbers only: docs/benchmarks.md, its archive and the README's results table come from
benchmarks/results/*.json.

``tools/render_numbers.py`` regenerates them; these tests regenerate in memory and compare (so a result committed
without regenerating, or a figure edited by hand, fails), check on tiny synthetic results that only the README's block
between its markers is replaced, that every speedup is against plain decoding at the row's own runtime and precision
(a table mixing references is refused), and that the summary shows the newest run while the archive keeps the rest.
No network, no model: the study sections only read JSON.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "tools" / "render_numbers.py"
SUMMARY_MAX_LINES = 400


@pytest.fixture(scope="module")
def render_numbers():
    spec = importlib.util.spec_from_file_location("render_numbers_under_test", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_pages_and_readme_table_are_up_to_date(render_numbers):
    message = render_numbers.check(ROOT)
    assert message is None, message


def test_every_result_file_has_its_section(render_numbers):
    pages = [(ROOT / "docs" / name).read_text() for name in ("benchmarks.md", "benchmarks-archive.md")]
    assert all("## Other results" not in page for page in pages), \
        "a JSON under benchmarks/results/ has no entry in tools/renderers/benchmarks.toml"
    assert f"## {render_numbers.COMPILED_SERVING_HEADING}\n" in pages[0]
    assert all("](../" not in page and "![" not in page for page in pages)  # the site serves nothing outside docs/


def test_the_summary_page_is_short_and_the_archive_is_in_the_site(render_numbers):
    summary = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(summary.splitlines()) <= SUMMARY_MAX_LINES, "docs/benchmarks.md is a summary: move runs to the archive"
    assert "(benchmarks-archive.md" in summary
    assert re.search(r"^\s+- [^:]+: benchmarks-archive\.md$", (ROOT / "mkdocs.yml").read_text(), re.M), \
        "docs/benchmarks-archive.md is not in mkdocs.yml's nav"


def test_every_readme_row_is_compared_with_plain_decoding_at_its_own_runtime_and_precision(render_numbers):
    """On the committed results: an int8 row's speedup is its ratio to int8 plain decoding, not to fp32's."""
    block = (ROOT / "README.md").read_text().split(render_numbers.README_BEGIN)[1].split(render_numbers.README_END)[0]
    source = re.search(r"from benchmarks/results/(\S+\.json)", block).group(1)
    data = json.loads((ROOT / "benchmarks" / "results" / source).read_text())
    checked = 0
    for run in data["runs"].values():
        for name, arm in run["arms"].items():
            if "speculative" in name and ":" not in name and "speedup_vs_reference" in arm:
                reference, speedup, _ = render_numbers.serving.own_speedup(name, arm)
                assert render_numbers.serving.footing(reference) == render_numbers.serving.footing(name)
                assert f"{arm['speedup_vs_reference']:.2f}x [" in block and speedup == arm["speedup_vs_reference"]
                checked += 1
    assert checked and "no GPU figures exist yet" in block and "SmolLM2-135M-Instruct" in block


def _arm(speedup: float, eager: float, tau: float, lossless: str, reference: str) -> dict:
    return {"prompts": 3, "ms_per_token_median": 30.0 / speedup, "ms_per_token_ci95": [20.0, 40.0], "tau": tau,
            "lossless_prompts": lossless, "agrees_with_eager_prompts": "3/3", "new_tokens": 96, "reference": reference,
            "speedup_vs_reference": speedup, "speedup_vs_reference_ci95": [speedup - 0.1, speedup + 0.1],
            "speedup_vs_hf_generate_eager": eager, "speedup_vs_hf_generate_eager_ci95": [eager - 0.2, eager + 0.2]}


def _arms(int8_reference: str = "compiled_plain[int8]") -> dict:
    return {"hf_generate_eager": _arm(1.0, 1.0, 1.0, "reference", "hf_generate_eager"),
            "compiled_plain[fp32]": _arm(1.0, 2.0, 1.0, "reference", "compiled_plain[fp32]"),
            "compiled_speculative[prompt_lookup]": _arm(1.25, 2.5, 1.375, "3/3", "compiled_plain[fp32]"),
            "compiled_plain[int8]": _arm(1.0, 3.0, 1.0, "reference", "compiled_plain[int8]"),
            "compiled_speculative[ppow@int8]": _arm(0.97, 2.91, 1.04, "3/3", int8_reference)}


def _synthetic_results(root: Path, arms: dict | None = None, name: str = "compiled_serving.json",
                       threads: int = 1, cpu: str = "Test CPU") -> None:
    arms = arms or _arms()
    key = f"threads{threads}"
    data = {"command": f"python benchmarks/compiled_serving.py --mtbench 3 --code 3 --threads {threads}",
            "meta": {key: {"cpu": {"model": cpu, "avx512f": True, "amx": False, "cores": 4}, "torch": "9.9.9",
                           "threads": threads, "max_new_tokens": 32}},
            "runs": {f"{key}/mtbench": {"prompts": 3, "skipped_too_long": 0, "arms": arms},
                     f"{key}/code": {"prompts": 3, "skipped_too_long": 1, "arms": arms}}}
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / name).write_text(json.dumps(data))


def _readme_block(render_numbers, root: Path) -> str:
    text = (root / "README.md").read_text()
    return text.split(render_numbers.README_BEGIN)[1].split(render_numbers.README_END)[0]


def test_the_readme_block_is_replaced_between_the_markers_and_nothing_else(render_numbers, tmp_path):
    _synthetic_results(tmp_path)
    begin, end = render_numbers.README_BEGIN, render_numbers.README_END
    head = "# Project\n\nProse that stays as it is, 1.23x included.\n\n"
    tail = "\n\n## Next section\n\nMore prose.\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"{head}{begin}\nan old table\n{end}{tail}")
    assert {p.as_posix() for p in render_numbers.stale(tmp_path)} == {
        "README.md", "docs/benchmarks.md", "docs/benchmarks-archive.md"}

    render_numbers.write(tmp_path)
    text = readme.read_text()
    assert text.startswith(head + begin + "\n") and text.endswith("\n" + end + tail)
    block = text[len(head + begin):-len(end + tail)]
    assert "an old table" not in block
    assert "1.25x [1.15, 1.35]" in block and "2.50x / 2.50x" in block and "1.38" in block  # from the JSON
    assert "Test CPU" in block and "AVX-512 yes" in block and "AMX no" in block and "1 thread" in block
    assert "3 MT-bench and 3 code prompts" in block and "no GPU figures exist yet" in block
    assert "(docs/benchmarks.md#compiled-serving)" in block
    assert len(block.strip("\n").splitlines()) <= 15
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "## Compiled serving\n" in page and "Compiled serving at 1 thread" not in page  # one run: no run heading
    assert render_numbers.check(tmp_path) is None and render_numbers.write(tmp_path) == []  # idempotent

    readme.write_text(text.replace("1.25x", "1.26x", 1))  # a figure edited by hand
    message = render_numbers.check(tmp_path)
    assert message and "README.md" in message and "python tools/render_numbers.py" in message
    run = subprocess.run([sys.executable, str(GENERATOR), "--check", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "README.md" in run.stderr and "python tools/render_numbers.py" in run.stderr


def test_int8_rows_are_compared_with_int8_plain_decoding_in_the_readme(render_numbers, tmp_path):
    _synthetic_results(tmp_path)
    (tmp_path / "README.md").write_text(f"{render_numbers.README_BEGIN}\n{render_numbers.README_END}\n")
    render_numbers.write(tmp_path)
    rows = {line.split("`")[1]: line for line in _readme_block(render_numbers, tmp_path).splitlines()
            if line.startswith("| ") and "`" in line}
    int8 = rows["compiled_speculative[ppow@int8]"]
    assert "compiled int8" in int8 and "0.97x [0.87, 1.07]" in int8  # its own plain decoding's ratio, not 3.0 * 0.97
    assert "compiled fp32" in rows["compiled_speculative[prompt_lookup]"]
    assert "the trained drafter alone" in int8 and "prompt lookup" in rows["compiled_speculative[prompt_lookup]"]
    order = list(rows)  # each plain row before the rows compared with it; fp32 first
    assert order.index("compiled_plain[fp32]") < order.index("compiled_speculative[prompt_lookup]") \
        < order.index("compiled_plain[int8]") < order.index("compiled_speculative[ppow@int8]")


@pytest.mark.parametrize("arms", [
    _arms(int8_reference="compiled_plain[fp32]"),  # an int8 row against fp32 plain decoding
    {**_arms(), "compiled_speculative[ppow@int8]": {
        k: v for k, v in _arm(1.52, 2.91, 1.04, "3/3", "").items() if not k.startswith(("reference", "speedup_vs_r"))}
     | {"speedup_vs_compiled_plain[fp32]": 1.52}},  # only a ratio to fp32 plain decoding stored
    {**_arms(), "llama_cpp_speculative[q8_0]": _arm(1.09, 2.2, 1.2, "1/3", "compiled_plain[fp32]")},
])
def test_a_table_whose_rows_mix_references_is_refused(render_numbers, tmp_path, arms):
    _synthetic_results(tmp_path, arms)
    (tmp_path / "README.md").write_text(f"{render_numbers.README_BEGIN}\n{render_numbers.README_END}\n")
    with pytest.raises(render_numbers.MixedReferenceError, match=r"own runtime and precision"):
        render_numbers.render_all(tmp_path)
    assert not (tmp_path / "docs").exists()  # nothing written


def test_the_summary_shows_the_newest_run_and_the_archive_the_others(render_numbers, tmp_path):
    _synthetic_results(tmp_path, name="compiled_serving.json", threads=1, cpu="Old CPU")  # listed in the catalog
    _synthetic_results(tmp_path, name="compiled_serving_new_machine.json", threads=2, cpu="New CPU")  # not listed
    (tmp_path / "README.md").write_text(f"{render_numbers.README_BEGIN}\n{render_numbers.README_END}\n")
    render_numbers.write(tmp_path)
    summary = (tmp_path / "docs" / "benchmarks.md").read_text()
    archive = (tmp_path / "docs" / "benchmarks-archive.md").read_text()
    assert "New CPU" in summary and "Old CPU" not in summary
    assert "### Compiled serving at 1 thread\n" in archive and "New CPU" not in archive
    assert "(benchmarks-archive.md#compiled-serving)" in summary and "(benchmarks.md#compiled-serving-at-2" in archive
    assert "New CPU" in _readme_block(render_numbers, tmp_path)  # the README's table comes from the newest run

    (tmp_path / "docs" / "benchmarks-archive.md").write_text(archive.replace("Old CPU", "Older CPU"))
    assert [p.as_posix() for p in render_numbers.stale(tmp_path)] == ["docs/benchmarks-archive.md"]


@pytest.mark.parametrize("readme", [
    "# Project\n\nno markers at all\n",
    "# Project\n\n<!-- results:begin -->\nno end marker\n",
    "# Project\n\nno begin marker\n<!-- results:end -->\n",
    "# Project\n\n<!-- results:end -->\nreversed\n<!-- results:begin -->\n",
    "<!-- results:begin -->\n<!-- results:end -->\n<!-- results:begin -->\n<!-- results:end -->\n",
])
def test_a_missing_or_broken_marker_is_a_clear_error(render_numbers, tmp_path, readme):
    _synthetic_results(tmp_path)
    (tmp_path / "README.md").write_text(readme)
    with pytest.raises(render_numbers.MarkerError, match=r"README\.md: .*results:(begin|end)"):
        render_numbers.render_all(tmp_path)
    assert (tmp_path / "README.md").read_text() == readme  # nothing written


def test_local_folders_of_the_machine_a_run_used_are_not_printed(render_numbers):
    text = "--drafter /work/drafter_prev_run/merged and /tmp/pytest-1/x and benchmarks/results/a.json"
    assert render_numbers.without_local_paths(text) == \
        "--drafter <local folder>/merged and <local folder>/x and benchmarks/results/a.json"
