"""The compiled runtime (ppow_trl.compiled_runtime.compiled): inductor graphs per row count over a static KV cache.

Checked on a tiny Llama: the compiled forward computes the eager model's logits, rolling the static cache back
after a rejection is exact, nothing recompiles inside the served loop (a new sequence, other positions, a crop,
a longer prefill), and greedy speculative decoding on the compiled route gives the compiled plain decoding's tokens.
Compiling the tiny model's graphs takes about half a minute.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_target_and_drafters

from ppow_trl.compiled_runtime.compiled import CompiledCausalLM, CompileSettings, compile_cache_dir
from ppow_trl.serving.generation import greedy_continuation, speculative_generate
from ppow_trl.compiled_runtime.row_check import RowPlan, choose_row_plan, split_rows
from ppow_trl.serving.runtime import compile_unavailable_reason
from ppow_trl.utils import crop_cache
from ppow_trl.core.windowing import AdaptiveWindowPolicy

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(compile_unavailable_reason(torch.nn.Linear(1, 1)) is not None,
                                 reason="inductor cannot compile here (no C++ compiler)")]
MAX_ROWS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import os

    os.environ["PPOW_TRL_CACHE"] = str(tmp_path_factory.mktemp("cache"))  # an empty inductor cache of its own
    target, _, close = make_target_and_drafters(seed=0, noise=0.02)
    compiled = CompiledCausalLM(target, max_rows=MAX_ROWS, max_cache_len=96)
    compiled.warm_up(progress=False)
    return target, close, compiled


def _graphs() -> int:
    """Graphs compiled so far in this process: torch.compile's (dynamo) and AOTInductor packages built."""
    from torch._dynamo.utils import counters

    from ppow_trl.compiled_runtime import packaged

    return counters["stats"]["unique_graphs"] + packaged.BUILT


def test_compiled_forward_computes_the_eager_logits_and_rolls_back_exactly(models):
    target, _, compiled = models
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = target(ids).logits[0]
        cache = compiled.new_cache()
        compiled(input_ids=ids[:, :12], position_ids=torch.arange(12)[None], cache=cache)  # prefill: eager path
        for rows in range(1, MAX_ROWS + 1):  # verify 1..4 rows, then reject them all
            out = compiled(input_ids=ids[:, 12:12 + rows], position_ids=torch.arange(12, 12 + rows)[None], cache=cache)
            torch.testing.assert_close(out.logits[0], eager[12:12 + rows], atol=1e-4, rtol=1e-4)
            crop_cache(cache, 12)
        out = compiled(input_ids=ids[:, 12:15], position_ids=torch.arange(12, 15)[None], cache=cache)
        torch.testing.assert_close(out.logits[0], eager[12:15], atol=1e-4, rtol=1e-4)


def test_nothing_recompiles_in_the_served_loop(models):
    _, close, compiled = models
    before = _graphs()
    policy = AdaptiveWindowPolicy(MAX_ROWS - 1, 0.0)
    for seed in range(3):  # new sequences, other lengths and positions, crops after rejections
        prompt = torch.randint(8, 64, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            speculative_generate(compiled, close, prompt, policy=policy, max_new_tokens=20, eos_token_id=[])
            greedy_continuation(compiled, prompt[0].tolist(), 10, 64)
    assert _graphs() == before
    with pytest.raises(RuntimeError, match="No compiled graph"):  # a shape that was not warmed up is refused
        compiled._call_compiled(torch.zeros((1, MAX_ROWS + 1), dtype=torch.long),
                                torch.arange(MAX_ROWS + 1)[None], compiled.new_cache())
    assert _graphs() == before



def test_a_model_that_cannot_be_packaged_is_compiled_by_torch_compile(monkeypatch, caplog, tmp_path):
    """Where a package cannot be built (a model ``torch.export`` cannot take), one warning line, then torch.compile's
    graphs (``packaged=False`` gives the same), with a recompile after the warm-up an error. Instantiating any new PreTrainedModel class registers it in transformers'
    output-capturing registry, which the traced forward reads: without the guard filter every later call failed its
    guards (an error under fail_on_recompile), so loading a second model after serving_runtime broke serving."""
    from transformers import PretrainedConfig, PreTrainedModel

    class LateConfig(PretrainedConfig):
        model_type = "ppow_test_late"

    class LateModel(PreTrainedModel):
        config_class = LateConfig
        _can_record_outputs = {"hidden_states": torch.nn.Linear}

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(2, 2)
            self.post_init()

    import ppow_trl.compiled_runtime.compiled as compiled_module

    def cannot_export(*args, **kwargs):
        raise RuntimeError("export failed\nlong traceback")

    monkeypatch.setattr(compiled_module, "build_packages", cannot_export)
    monkeypatch.setenv("PPOW_TRL_CACHE", str(tmp_path))
    target, _, _ = make_target_and_drafters(seed=3)
    compiled = CompiledCausalLM(target, max_rows=2, max_cache_len=32)
    with caplog.at_level("WARNING"):
        compiled.warm_up(progress=False)
    assert "AOTInductor packaging failed (RuntimeError: export failed)" in caplog.text
    assert "long traceback" not in caplog.text
    assert not compiled.packaged and compiled.packages_built == 0
    assert "torch.compile (packaging failed)" in compiled.label() and "packaged" in compiled.settings.label()
    ids = torch.randint(8, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = greedy_continuation(compiled, ids[0].tolist(), 6, 64)
        assert _rows_differing_from_one_row_at_a_time(compiled, ids, prefix=4) == [0]
        LateModel(LateConfig())
        graphs = _graphs()
        assert greedy_continuation(compiled, ids[0].tolist(), 6, 64) == before  # would raise "Detected recompile"
    assert _graphs() == graphs
    with pytest.raises(RuntimeError, match="recompile"):
        compiled._call_compiled(torch.zeros((1, 3), dtype=torch.long), torch.arange(3)[None], compiled.new_cache())


def test_speculative_on_the_compiled_route_is_the_compiled_plain_text(models):
    target, close, compiled = models
    policy = AdaptiveWindowPolicy(MAX_ROWS - 1, 0.0)
    agree_with_eager = 0
    for seed in range(4):
        prompt = torch.randint(8, 64, (1, 6), generator=torch.Generator().manual_seed(10 + seed))
        with torch.no_grad():
            plain = greedy_continuation(compiled, prompt[0].tolist(), 24, 64)
            result = speculative_generate(compiled, close, prompt, policy=policy, max_new_tokens=24, eos_token_id=[])
            eager = greedy_continuation(target, prompt[0].tolist(), 24, 64)
        assert result.new_tokens == plain
        assert result.tau > 1.0  # the close drafter's windows were accepted: verification did run several rows
        agree_with_eager += plain == eager
    assert agree_with_eager >= 3  # other kernels than eager: a near tie may flip, rarely


def _plain_and_speculative(served, seed: int):
    """A random 6-token prompt; greedy plain (K = 0) and speculative (K = max, h = 0) decoding of 24 tokens on it."""
    prompt = torch.randint(8, 64, (1, 6), generator=torch.Generator().manual_seed(20 + seed))
    with torch.no_grad():
        plain = speculative_generate(served.target, served.drafter, prompt, policy=AdaptiveWindowPolicy(0),
                                     max_new_tokens=24, eos_token_id=[])
        fast = speculative_generate(served.target, served.drafter, prompt,
                                    policy=AdaptiveWindowPolicy(MAX_ROWS - 1, 0.0), max_new_tokens=24, eos_token_id=[])
    return prompt, plain, fast


def _rows_differing_from_one_row_at_a_time(compiled, ids, prefix: int) -> list[int]:
    """For each row count L = 2..max_rows: how many rows of one L-row call differ (in any bit) from the same positions
    scored one row at a time (decode steps) over the same cache."""
    with torch.no_grad():
        cache = compiled.new_cache()
        compiled(input_ids=ids[:, :prefix], cache=cache)
        one_at_a_time = [compiled(input_ids=ids[:, i:i + 1], cache=cache).logits[0, -1]
                         for i in range(prefix, prefix + compiled.max_rows)]
        differing = []
        for rows in range(2, compiled.max_rows + 1):
            crop_cache(cache, prefix)
            out = compiled(input_ids=ids[:, prefix:prefix + rows], cache=cache).logits[0]
            differing.append(sum(not torch.equal(out[r], one_at_a_time[r]) for r in range(rows)))
    return differing


def test_compiled_verify_rows_are_bitwise_the_decode_steps(models):
    """The default settings (``row_independent``): every row of a verify pass is bitwise the decode step's row, so
    greedy speculative decoding gives plain decoding's tokens by construction. (With PyTorch's own attention, a small
    random Llama's fp32 rows differed by 1e-4.)"""
    _, _, compiled = models
    assert "row-independent" in compiled.settings.label()
    assert compiled.row_plan == RowPlan()  # the warm-up's check found every graph's rows equal to the decode step's
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(5))
    assert _rows_differing_from_one_row_at_a_time(compiled, ids, prefix=17) == [0] * (MAX_ROWS - 1)


def _three_row_graph_off_in_its_last_bits(compiled, monkeypatch) -> list[int]:
    """A machine where inductor picks another kernel for one row count (the AMX int8 GEMM from 5 rows on), simulated
    by a 3-row graph whose logits are off in the last bits; the graphs run are recorded in the list returned."""
    real_call = compiled._call_compiled
    rows_called = []

    def call(input_ids, position_ids, cache):
        rows_called.append(input_ids.shape[1])
        out = real_call(input_ids, position_ids, cache)
        if input_ids.shape[1] == 3:
            out.logits = out.logits + 1e-3 * torch.rand(out.logits.shape, generator=torch.Generator().manual_seed(0))
        return out

    monkeypatch.setattr(compiled, "_call_compiled", call)
    return rows_called


def _speculation_equals_plain_decoding(compiled, close) -> None:
    from types import SimpleNamespace

    for seed in range(3):
        _, plain, fast = _plain_and_speculative(SimpleNamespace(target=compiled, drafter=close), seed)
        assert fast.tau > 1.0 and fast.new_tokens == plain.new_tokens


def _verify_at_the_cache_end_equals_decode_steps(compiled, rows_called) -> None:
    """A 3-row call at the cache's last positions, where no padding fits, still equals decode steps there (the 3-row
    graph, off in its last bits, is never run)."""
    ids = torch.randint(0, 64, (1, compiled.max_cache_len), generator=torch.Generator().manual_seed(9))
    prefix = compiled.max_cache_len - 3  # a 3-row call fits, its padding to MAX_ROWS does not
    with torch.no_grad():
        cache = compiled.new_cache()
        compiled(input_ids=ids[:, :prefix], cache=cache)
        steps = [compiled(input_ids=ids[:, i:i + 1], cache=cache).logits[0, -1] for i in range(prefix, prefix + 3)]
        crop_cache(cache, prefix)
        rows_called.clear()
        verified = compiled(input_ids=ids[:, prefix:prefix + 3], cache=cache).logits[0]
    assert all(torch.equal(verified[r], steps[r]) for r in range(3)) and 3 not in rows_called


@pytest.mark.parametrize("largest_graph_step", ["slower", "no slower"])
def test_where_a_graph_computes_other_bits_calls_avoid_it_and_speculation_stays_lossless(models, monkeypatch, caplog,
                                                                                         largest_graph_step):
    """The warm-up's check finds the 3-row graph. Where the largest graph's one-token step is slower than decoding's
    own (measured; given here), 3-row calls are split over graphs that agree (2 + 1) and a one-token step keeps its own
    graph; where it is no slower, every call runs the largest graph. Either way greedy speculative decoding gives plain
    decoding's tokens, at the cache's end too."""
    target, close, compiled = models
    rows_called = _three_row_graph_off_in_its_last_bits(compiled, monkeypatch)
    decode = compiled._graph_rows(1)
    largest = 2.0 if largest_graph_step == "slower" else 1.0
    try:
        with caplog.at_level("WARNING"):
            plan = choose_row_plan(compiled, lambda graphs: {g: largest if g == MAX_ROWS else 1.0 for g in graphs})
        assert "still differ" not in caplog.text and "3-row graph of" in caplog.text
        rows_called.clear()
        _speculation_equals_plain_decoding(compiled, close)
        if largest_graph_step == "slower":
            assert plan == RowPlan(graphs=(1, 2, 4)) and "split over the 1/2/4-row graphs" in caplog.text
            assert "3-row calls split" in compiled.label()
            assert 3 not in rows_called and {decode, 4} <= set(rows_called)  # K = 3 verifies: own graph; steps too
        else:
            assert plan == RowPlan(uniform=True) and f"every call now runs the {MAX_ROWS}-row graph" in caplog.text
            assert f"every call on the {MAX_ROWS}-row graph" in compiled.label()
            assert set(rows_called) == {MAX_ROWS}  # one-token steps and verify passes alike
        _verify_at_the_cache_end_equals_decode_steps(compiled, rows_called)
    finally:
        compiled.row_plan = RowPlan()
        compiled.new_cache()


def test_where_every_verify_graph_differs_calls_are_scored_one_row_at_a_time(models, monkeypatch, caplog):
    """Every graph of 2+ rows off in its last bits: no graph but the decode step's agrees, so every call is scored one
    row at a time (a verify pass is then decode steps by construction, and the cost model sees that it cannot pay),
    and the warning says so."""
    target, close, compiled = models
    real_call, chosen = compiled._call_compiled, compiled.decode_rows

    def call(input_ids, position_ids, cache):
        out = real_call(input_ids, position_ids, cache)
        if input_ids.shape[1] > 1:
            out.logits = out.logits + 1e-3
        return out

    monkeypatch.setattr(compiled, "_call_compiled", call)
    compiled.decode_rows = 1  # a one-token step on its own graph (the padded 2-row graph is off here)
    try:
        with caplog.at_level("WARNING"):
            # the largest graph's step slower than the decode step's: no uniform plan (which would hold here)
            plan = choose_row_plan(compiled, lambda graphs: {g: 2.0 if g == MAX_ROWS else 1.0 for g in graphs})
        assert plan == RowPlan(graphs=(1,)) and "one row at a time" in caplog.text and "still differ" not in caplog.text
        _speculation_equals_plain_decoding(compiled, close)
    finally:
        compiled.row_plan, compiled.decode_rows = RowPlan(), chosen
        compiled.new_cache()


def test_split_rows_takes_the_largest_agreeing_graphs_first():
    assert split_rows(5, (1, 2, 4)) == [4, 1]
    assert split_rows(3, (1, 2, 4)) == [2, 1]
    assert split_rows(4, (1,)) == [1, 1, 1, 1]
    assert split_rows(7, (1, 3)) == [3, 3, 1]
    assert all(sum(split_rows(n, (1, 2, 5))) == n for n in range(1, 12))


def test_a_one_token_step_on_the_padded_2_row_graph_is_bitwise_its_own_and_leaves_one_position(models):
    """``decode_rows=2`` runs a one-token step on the 2-row graph with a padding row (faster on some CPUs): the same
    logits bit for bit, the cache one position longer (the padding row's cropped away), and the step's own graph at the
    cache's last position, where no padding row fits."""
    _, _, compiled = models
    assert compiled.decode_rows in (1, 2)  # measured at the warm-up
    chosen = compiled.decode_rows
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(7))
    steps = {}
    try:
        for rows in (1, 2):
            compiled.decode_rows = rows
            cache = compiled.new_cache()
            with torch.no_grad():
                compiled(input_ids=ids[:, :12], cache=cache)
                logits = []
                for t in range(12, 30):
                    logits.append(compiled(input_ids=ids[:, t:t + 1], cache=cache).logits[0, -1])
                    assert int(cache.get_seq_length()) == t + 1
            steps[rows] = torch.stack(logits)
        assert torch.equal(steps[1], steps[2])
        compiled.decode_rows = 2
        cache = compiled.new_cache()
        with torch.no_grad():  # up to the last position: 95 tokens, then one step with no room for the padding row
            compiled(input_ids=torch.zeros((1, compiled.max_cache_len - 1), dtype=torch.long), cache=cache)
            out = compiled(input_ids=ids[:, :1], cache=cache)
        assert out.logits.shape[1] == 1 and int(cache.get_seq_length()) == compiled.max_cache_len
    finally:
        compiled.decode_rows = chosen
        compiled.new_cache()
    with pytest.raises(ValueError, match="decode_rows"):
        CompiledCausalLM(torch.nn.Linear(1, 1), max_rows=1, decode_rows=2)


def test_an_int8_target_serves_compiled_and_speculative_equals_plain_at_int8(models, caplog):
    """``serving_runtime(..., precision="int8")``: the converted target's graphs on the compiled runtime (no
    recompile while serving), every verified row bitwise the decode step's, so greedy speculative decoding equals
    plain decoding on that int8 target token for token and serving_runtime does not warn; the int8 target choosing
    the fp32 model's token at most positions of its text (quantizing may flip a token where two are close). (With a
    bf16 stream and PyTorch's attention the int8 rows differed by up to 5.)"""
    from ppow_trl.compiled_runtime.precision import precision_of
    from ppow_trl.serving.runtime import serving_runtime

    target, close, _ = models
    with caplog.at_level("WARNING"):
        served = serving_runtime(target, close, runtime="compiled", max_window=MAX_ROWS - 1, max_cache_len=96,
                                 precision="int8", progress=False)
    assert served.name == "compiled" and served.precision == "int8" and precision_of(served.verifier) == "int8"
    assert "not lossless" not in caplog.text
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(5))
    assert _rows_differing_from_one_row_at_a_time(served.target, ids, prefix=17) == [0] * (MAX_ROWS - 1)
    graphs, same_as_fp32 = _graphs(), []
    for seed in range(3):
        prompt, plain, fast = _plain_and_speculative(served, seed)
        assert fast.tau > 1.0 and fast.new_tokens == plain.new_tokens
        # the fp32 model's choice at each position of the int8 text (teacher-forced: one flip does not derail the
        # rest of the comparison)
        with torch.no_grad():
            text = torch.cat([prompt, torch.tensor([plain.new_tokens])], dim=1)
            fp32_choice = target(text).logits[0, prompt.shape[1] - 1:-1].argmax(-1)
        same_as_fp32.append(float((fp32_choice == torch.tensor(plain.new_tokens)).float().mean()))
    assert _graphs() == graphs  # nothing compiled while serving
    assert sum(same_as_fp32) / 3 > 0.8, same_as_fp32


def test_compile_cache_is_keyed_by_settings_and_machine(tmp_path):
    a = compile_cache_dir(CompileSettings(), tmp_path)
    assert a == compile_cache_dir(CompileSettings(), tmp_path)
    assert a != compile_cache_dir(CompileSettings(max_autotune=False), tmp_path)
    assert a != compile_cache_dir(CompileSettings(row_independent=False), tmp_path)
    assert a != compile_cache_dir(CompileSettings(packaged=False), tmp_path)
    assert a.parent == tmp_path / "inductor"


SECOND_PROCESS = """
import json, sys, time, torch
sys.path[:0] = [{tests!r}, {repo!r}]  # this checkout's ppow_trl, whatever the working folder holds
from conftest import make_target_and_drafters
from ppow_trl.compiled_runtime.compiled import CompiledCausalLM
from torch._inductor.runtime.cache_dir_utils import cache_dir
cache_dir()  # what an earlier compile or import does: inductor writes its /tmp default into the environment
torch.set_num_threads(1)
target, _, _ = make_target_and_drafters(seed=0, noise=0.02)
compiled = CompiledCausalLM(target, max_rows=2, max_cache_len=32)
seconds = compiled.warm_up(progress=False)
ids = torch.arange(8, 14)[None]
with torch.no_grad():
    cache = compiled.new_cache()
    compiled(input_ids=ids[:, :4], cache=cache)
    logits = [compiled(input_ids=ids[:, i:i + 1], cache=cache).logits[0, -1].tolist() for i in range(4, 6)]
print(json.dumps({{"built": compiled.packages_built, "workers": compiled.build_workers, "seconds": seconds,
                  "logits": logits}}))
"""


def test_a_second_process_loads_the_packages_from_disk(tmp_path):
    """The first process builds one AOTInductor package per row count under the cache root (not inductor's /tmp
    default, which inductor writes into the environment), two at once in worker processes; a second process builds
    nothing, loads them and computes the same logits bitwise, and so does a process that built them one by one in
    itself (the workers compile with the same settings and thread count). The first one runs in a folder holding
    another ``ppow_trl``, which its workers must not import (``python -c`` puts the working folder first)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = SECOND_PROCESS.format(tests=str(Path(__file__).parent), repo=str(Path(__file__).parents[1]))
    decoy = tmp_path / "checkout" / "ppow_trl"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('another ppow_trl, imported from the working folder')\n")

    def run(cache: Path, workers: int, cwd: Path | None = None) -> dict:
        env = {**os.environ, "PPOW_TRL_CACHE": str(cache), "OMP_NUM_THREADS": "1",
               "PPOW_TRL_BUILD_WORKERS": str(workers)}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        env.pop("PPOW_TRL_INDUCTOR_CACHE_SET", None)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                              cwd=cwd)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "packaging failed" not in done.stderr, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(tmp_path / "a", workers=2, cwd=decoy.parent), run(tmp_path / "a", workers=2)
    one_by_one = run(tmp_path / "b", workers=1)
    assert len(list((tmp_path / "a" / "inductor").glob("*/packages/*/rows*.pt2"))) == 2
    assert not list(tmp_path.glob("**/*.partial*")) and not list(tmp_path.glob("**/*.exported*"))
    # AOTInductor's builds (the wrapper library with the weights, as large as the package) are not kept beside them
    assert list(tmp_path.glob("a/inductor/*/packages/*/rows*.pt2")) and not list(tmp_path.glob("**/*.wrapper.so"))
    assert (cold["built"], cold["workers"]) == (2, 2) and warm["built"] == 0
    assert (one_by_one["built"], one_by_one["workers"]) == (2, 1)
    assert warm["logits"] == cold["logits"] == one_by_one["logits"]
    assert warm["seconds"] < cold["seconds"] / 3


def test_a_failed_worker_build_is_redone_in_the_serving_process(monkeypatch, tmp_path, caplog):
    """A worker process that fails (out of memory, another environment) costs a warning, not the packages: the
    runtime builds the rest one at a time in its own process, leaves no temporary files, and serves packages."""
    import ppow_trl.compiled_runtime.packaged as packaged

    monkeypatch.setattr(packaged, "_WORKER", "import sys; sys.exit('worker killed')")
    monkeypatch.setenv("PPOW_TRL_CACHE", str(tmp_path))
    monkeypatch.setenv("PPOW_TRL_BUILD_WORKERS", "2")
    target, _, _ = make_target_and_drafters(seed=5)
    compiled = CompiledCausalLM(target, max_rows=2, max_cache_len=32)
    with caplog.at_level("WARNING"):
        compiled.warm_up(progress=False)
    assert "Building packages in 2 worker processes failed (RuntimeError: Building the package for" in caplog.text
    assert "worker killed" in caplog.text and "packaging failed" not in caplog.text
    assert compiled.packaged and compiled.packages_built == 2 and compiled.build_workers == 1
    assert len(list(tmp_path.glob("inductor/*/packages/*/rows*-cache32.pt2"))) == 2
    assert not list(tmp_path.glob("**/*.exported*")) and not list(tmp_path.glob("**/*.partial*"))


def test_a_package_is_keyed_by_the_weights_it_embeds():
    """Packages embed the frozen weights: a model with other weights (a trained drafter) must not load them."""
    from ppow_trl.compiled_runtime.packaged import weights_digest

    target, _, close = make_target_and_drafters(seed=0, noise=0.02)
    again, _, _ = make_target_and_drafters(seed=0, noise=0.02)
    assert weights_digest(target) == weights_digest(again)
    assert weights_digest(target) != weights_digest(close)
    with torch.no_grad():
        again.model.norm.weight[0] += 1e-6
    assert weights_digest(target) != weights_digest(again)


def test_a_drafter_saved_and_loaded_again_keeps_its_package_key(tmp_path):
    """The main job builds its trained drafter's packages, then saves it; ``load_drafter`` on that folder must find
    them, not build them again (the saved config gains metadata: where it came from, architectures, auto_map)."""
    from ppow_trl import save_assistant
    from ppow_trl.drafting import load_drafter
    from ppow_trl.models import make_drafter
    from ppow_trl.compiled_runtime.packaged import weights_digest

    target, _, close = make_target_and_drafters(seed=0, noise=0.02)
    for drafter in (close, make_drafter(close, num_layers=1, draft_vocab_ids=list(range(3, 48)))):
        folder = save_assistant(drafter, tmp_path / type(drafter).__name__, policy=AdaptiveWindowPolicy(2, 0.0))
        loaded = load_drafter(folder, target=target)
        assert weights_digest(loaded) == weights_digest(drafter)
        with torch.no_grad():
            next(loaded.parameters()).view(-1)[0] += 1e-3
        assert weights_digest(loaded) != weights_digest(drafter)  # the weights still count


def test_serving_runtime_compiles_target_and_standalone_drafter_and_times_them(models):
    from ppow_trl.serving.runtime import serving_runtime
    from ppow_trl.serving.rule import calibrate_for_serving

    target, close, _ = models
    runtime = serving_runtime(target, close, runtime="compiled", max_window=MAX_ROWS - 1, max_cache_len=96,
                              progress=False)
    assert runtime.name == "compiled" and runtime.fallback is None
    assert isinstance(runtime.target, CompiledCausalLM) and isinstance(runtime.drafter, CompiledCausalLM)
    # only the verifier's rows are checked against its decode steps: a drafter's only change what it proposes
    assert runtime.target.verifies and not runtime.drafter.verifies
    contexts = [torch.randint(8, 64, (12,), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    policy, cost_model, _ = calibrate_for_serving(target, close, contexts, max_window=MAX_ROWS - 1, cost_repeats=3,
                                                  runtime=runtime)
    assert cost_model.runtime == "compiled" and "compiled (inductor" in cost_model.description
    assert "compiled runtime" in policy.calibration["serving_rule"]
    prompt = torch.randint(8, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = greedy_continuation(runtime.target, prompt[0].tolist(), 16, 64)
    served = speculative_generate(runtime.target, runtime.drafter, prompt, policy=AdaptiveWindowPolicy(MAX_ROWS - 1, 0.0),
                                  max_new_tokens=16, eos_token_id=[])
    assert served.new_tokens == plain


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_a_drafter_reading_the_targets_hidden_states_serves_on_the_compiled_graphs(models, family):
    """EAGLE-3 and DFlash on the compiled route: the target's graphs return the hidden states the drafter reads next
    to the logits (the eager model's, up to the kernels' rounding), so the served loop runs the target eagerly only
    for the prompt's prefill; nothing compiles in it, and greedy speculative decoding gives the compiled plain
    tokens."""
    from ppow_trl.drafting import family_of
    from ppow_trl.features import forward_at, select_features
    from ppow_trl.serving.runtime import serving_runtime

    target, _, _ = models
    torch.manual_seed(0)
    if family == "eagle3":
        from ppow_trl.drafters.eagle3 import Eagle3DrafterForCausalLM

        head = Eagle3DrafterForCausalLM.from_target(target, target_layer_ids=[0, 1, 2]).eval()
    else:
        from ppow_trl.drafters.dflash import dflash_from_target

        head = dflash_from_target(target, mask_token_id=6, block_size=MAX_ROWS, target_layer_ids=[0, 1],
                                  num_hidden_layers=1, seed=1).eval()
    layers = family_of(head).target_layer_ids(head)
    runtime = serving_runtime(target, head, runtime="compiled", max_window=MAX_ROWS - 1, max_cache_len=96,
                              progress=False)
    assert runtime.name == "compiled" and runtime.fallback is None
    compiled = runtime.target
    assert compiled.feature_layers == layers and runtime.drafter is head  # the drafter itself serves eagerly

    ids = torch.randint(8, 64, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = select_features(target(ids, output_hidden_states=True).hidden_states, layers)[0]
        out, features = forward_at(compiled, ids[0, :12].tolist(), None, 0, layers)  # prefill: eager, with features
        torch.testing.assert_close(features[0], eager[:12], atol=1e-4, rtol=1e-4)  # over a static cache
        for rows in range(1, MAX_ROWS + 1):  # every graph returns its rows' features
            out, features = forward_at(compiled, ids[0, 12:12 + rows].tolist(), out.cache, 12, layers)
            assert features.shape == (1, rows, len(layers) * target.config.hidden_size)
            torch.testing.assert_close(features[0], eager[12:12 + rows], atol=1e-4, rtol=1e-4)
            crop_cache(out.cache, 12)

    eager_calls = []
    original = compiled._eager

    def counted(*args, **kwargs):
        eager_calls.append(kwargs["input_ids"].shape[1])
        return original(*args, **kwargs)

    compiled._eager = counted
    before = _graphs()
    try:
        for seed in range(3):
            prompt = torch.randint(8, 64, (1, 6 + seed), generator=torch.Generator().manual_seed(30 + seed))
            with torch.no_grad():
                result = speculative_generate(compiled, head, prompt, policy=AdaptiveWindowPolicy(MAX_ROWS - 1, 0.0),
                                              max_new_tokens=20, eos_token_id=[])
                plain = greedy_continuation(compiled, prompt[0].tolist(), 20, 64)
            assert result.new_tokens == plain
            assert max(result.drafted_per_round) == MAX_ROWS - 1  # verify passes of several rows ran
    finally:
        del compiled._eager
    assert _graphs() == before
    # one eager target call per sequence: the prompt's prefill (6, 7, 8 tokens: 5, 6, 7 cached); plain decoding's
    # greedy_continuation prefills too
    assert sorted(eager_calls) == sorted([5, 6, 7] + [6, 7, 8])
    plain_runtime = models[2]  # built without feature_layers: right features, from the eager model, said once
    with torch.no_grad(), pytest.warns(UserWarning, match="runs the eager model"):
        _, features = forward_at(plain_runtime, ids[0, :12].tolist(), None, 0, layers)
    torch.testing.assert_close(features[0], eager[:12], atol=1e-4, rtol=1e-4)


def test_feature_graphs_on_torch_compile(monkeypatch, tmp_path):
    """The feature graphs without packages (``packaged=False``, or after packaging failed): torch.compile traces the
    forward with ``output_hidden_states``, whose capturing hooks transformers installs at the first call that asks
    for them (eagerly, before any trace); the features are the eager model's and nothing recompiles after the
    warm-up."""
    from ppow_trl.features import forward_at, select_features

    monkeypatch.setenv("PPOW_TRL_CACHE", str(tmp_path))
    target, _, _ = make_target_and_drafters(seed=4)
    layers = [0, 2]
    compiled = CompiledCausalLM(target, max_rows=2, max_cache_len=32, settings=CompileSettings(packaged=False),
                                feature_layers=layers)
    compiled.warm_up(progress=False)
    assert not compiled.packaged
    ids = torch.randint(8, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        eager = select_features(target(ids, output_hidden_states=True).hidden_states, layers)[0]
        graphs = _graphs()
        out, _ = forward_at(compiled, ids[0, :6].tolist(), None, 0, layers)
        for rows in (1, 2):
            out, features = forward_at(compiled, ids[0, 6:6 + rows].tolist(), out.cache, 6, layers)
            torch.testing.assert_close(features[0], eager[6:6 + rows], atol=1e-4, rtol=1e-4)
            crop_cache(out.cache, 6)
    assert _graphs() == graphs
