"""Hub round trips through a fake local hub: every drafter family saved (``save_assistant`` + ``upload_folder``, or
``PPOWTrainer.push_to_hub``), loaded back by repo id (``load_assistant``), and generating through
``target.generate(assistant_model=...)`` exactly the target's own greedy text. The model card's usage snippet is cut
out of the pushed README.md and executed as written.

The fake hub (``FakeHub``) replaces only the *upload* side of ``huggingface_hub`` (``create_repo``,
``upload_folder``, ``create_commit``, ``model_info``, ``list_repo_files``): each push becomes a commit in a local
folder laid out as huggingface_hub's cache (``models--owner--name/refs/main``, ``snapshots/<sha>/``). The *download*
side is the real one (``hf_hub_download``, ``snapshot_download``, transformers' ``cached_file``) in offline mode,
which serves files from that cache and nothing else; sockets are refused, so no test touches the network.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from conftest import make_tiny_llama, make_tiny_tokenizer, tiny_word_responses
from huggingface_hub import (
    CommitInfo,
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
)
from huggingface_hub.hf_api import RepoUrl
from huggingface_hub.utils import filter_repo_objects

from ppow_trl.serving.assisted import load_assistant, load_cost_model, save_assistant
from ppow_trl.core.cost import CostModel
from ppow_trl.drafting import family_names, get_family
from ppow_trl.core.windowing import AdaptiveWindowPolicy

USER = "ppow-tester"
BUILD = {  # as tests/test_families.py builds them for the tiny 4-layer target
    "standalone": {"num_layers": 1},
    "eagle3": {"target_layer_ids": [1, 2, 4]},
    "dflash": {"mask_token_id": 6, "block_size": 5, "target_layer_ids": [0, 1, 3]},
}
PROMPTS = ["w1 w2 w3", "w7 w14 w21 w28", "w5 w10"]
NEW_TOKENS = 16


class FakeHub:
    """Repo ids -> commits in a local folder laid out as huggingface_hub's cache (module docstring)."""

    def __init__(self, cache: Path):
        self.cache = Path(cache)
        self.commits: list[tuple[str, str]] = []  # (repo_id, sha), in push order

    def _repo_id(self, repo_id: str) -> str:
        return repo_id if "/" in repo_id else f"{USER}/{repo_id}"

    def _folder(self, repo_id: str) -> Path:
        return self.cache / ("models--" + self._repo_id(repo_id).replace("/", "--"))

    def head(self, repo_id: str, revision: str = "main") -> str | None:
        ref = self._folder(repo_id) / "refs" / revision
        return ref.read_text().strip() if ref.is_file() else None

    def snapshot(self, repo_id: str, revision: str = "main") -> Path:
        sha = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else self.head(repo_id, revision)
        return self._folder(repo_id) / "snapshots" / sha

    # -- the replaced HfApi methods ---------------------------------------------------------------------------
    def create_repo(self, repo_id, *, exist_ok: bool = False, repo_type=None, **_):
        assert repo_type in (None, "model"), repo_type
        repo_id = self._repo_id(repo_id)
        folder = self._folder(repo_id)
        if folder.exists() and not exist_ok:
            raise FileExistsError(f"{repo_id} exists")
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        return RepoUrl(f"{constants.ENDPOINT}/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, commit_message=None, allow_patterns=None,
                      ignore_patterns=None, delete_patterns=None, revision=None, run_as_future=False, **_):
        assert not run_as_future and delete_patterns is None
        root = Path(folder_path)
        files = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()]
        files = filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        prefix = f"{path_in_repo.strip('/')}/" if path_in_repo else ""
        return self._commit(repo_id, {prefix + name: (root / name).read_bytes() for name in files}, set(),
                            commit_message or "Upload folder", revision)

    def create_commit(self, repo_id, operations, *, commit_message, revision=None, run_as_future=False, **_):
        assert not run_as_future
        added, deleted = {}, set()
        for operation in operations:
            if isinstance(operation, CommitOperationAdd):
                source = operation.path_or_fileobj
                added[operation.path_in_repo] = (Path(source).read_bytes() if isinstance(source, (str, Path))
                                                 else source if isinstance(source, bytes) else source.read())
            elif isinstance(operation, CommitOperationDelete):
                deleted.add(operation.path_in_repo)
            else:
                raise NotImplementedError(type(operation).__name__)
        return self._commit(repo_id, added, deleted, commit_message, revision)

    def model_info(self, repo_id, *, revision=None, **_):
        snapshot = self.snapshot(repo_id, revision or "main")
        files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
        return SimpleNamespace(id=self._repo_id(repo_id), sha=snapshot.name,
                               siblings=[SimpleNamespace(rfilename=name) for name in files])

    def list_repo_files(self, repo_id, *, revision=None, **_):
        return [sibling.rfilename for sibling in self.model_info(repo_id, revision=revision).siblings]

    def _commit(self, repo_id, added: dict[str, bytes], deleted: set[str], message: str, revision=None):
        repo_id = self._repo_id(repo_id)
        branch = revision or "main"
        folder = self._folder(repo_id)
        if not (folder / "refs").is_dir():
            raise FileNotFoundError(f"Repository {repo_id} not found: create_repo first")
        parent = self.head(repo_id, branch)
        digest = hashlib.sha1(f"{repo_id}\n{parent}\n{message}\n{len(self.commits)}".encode())
        for name in sorted(added):
            digest.update(name.encode() + hashlib.sha256(added[name]).digest())
        sha = digest.hexdigest()
        snapshot = folder / "snapshots" / sha
        if parent is not None:
            shutil.copytree(folder / "snapshots" / parent, snapshot)
        for name in deleted:
            (snapshot / name).unlink(missing_ok=True)
        for name, data in added.items():
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_bytes(data)
        (folder / "refs" / branch).write_text(sha)
        self.commits.append((repo_id, sha))
        return CommitInfo(commit_url=f"{constants.ENDPOINT}/{repo_id}/commit/{sha}", commit_message=message,
                          commit_description="", oid=sha, pr_url=None)


FAKED = ("create_repo", "upload_folder", "create_commit", "model_info", "list_repo_files")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The fake hub, installed for one test: uploads go to it, downloads are served from it, sockets are refused."""
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(fake.cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the real download code reads the fake hub's cache only
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in FAKED:
        fake_method = getattr(fake, name)
        monkeypatch.setattr(HfApi, name, lambda _api, *args, _method=fake_method, **kwargs: _method(*args, **kwargs))
        for module in (huggingface_hub, huggingface_hub.hf_api):  # the module-level aliases of the default HfApi
            monkeypatch.setattr(module, name, fake_method, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError(f"A test tried to open a network connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return fake


@pytest.fixture(scope="module")
def tiny():
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_llama(num_layers=4, seed=0, initializer_range=0.5)
    return SimpleNamespace(tokenizer=tokenizer, target=target)


def _prompt_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def _assert_lossless(target, assistant, tokenizer, generate_kwargs: dict) -> int:
    """``target.generate(assistant_model=assistant)`` equals plain greedy decoding on every prompt; returns how many
    drafter forwards ran (the assistant was really used)."""
    calls = []
    handle = assistant.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for text in PROMPTS:
            ids = _prompt_ids(tokenizer, text)
            common = {"attention_mask": torch.ones_like(ids), "do_sample": False, "max_new_tokens": NEW_TOKENS,
                      "eos_token_id": None, "pad_token_id": tokenizer.pad_token_id}
            with torch.no_grad():
                plain = target.generate(ids, **common)
                assisted = target.generate(ids, assistant_model=assistant, **common, **generate_kwargs)
            assert torch.equal(assisted, plain), text
    finally:
        handle.remove()
    return len(calls)


def _build(name: str, tiny):
    return get_family(name).build(tiny.target, tiny.tokenizer, **BUILD.get(name, {})).eval()


# -- every family, saved with save_assistant and pushed as a folder -----------------------------------------------


@pytest.mark.parametrize("name", family_names())
def test_save_push_load_generate_is_lossless(name, tiny, hub, tmp_path):
    family, target, tokenizer = get_family(name), tiny.target, tiny.tokenizer
    policy = AdaptiveWindowPolicy(max_window=3, threshold=0.0)
    cost = CostModel(drafter_cost=0.1, verify_cost=[1.0, 1.1, 1.2, 1.3], description="made up for the test")
    folder = save_assistant(_build(name, tiny), tmp_path / "saved", policy=policy, cost_model=cost,
                            tokenizer=tokenizer)
    repo_id = f"{USER}/tiny-{name}"
    HfApi().create_repo(repo_id, exist_ok=True)
    commit = HfApi().upload_folder(repo_id=repo_id, folder_path=folder, commit_message="drafter")
    assert hub.head(repo_id) == commit.oid
    assert (hub.snapshot(repo_id) / "ppow_window_policy.json").is_file()

    for revision in ("main", commit.oid):  # a branch, and the pinned commit the model card recommends
        assistant = load_assistant(repo_id, target=target, revision=revision)
        try:
            assert type(assistant).__name__ == type(_build(name, tiny)).__name__
            forwards = _assert_lossless(target, assistant, tokenizer, family.hf_generate_kwargs)
        finally:
            family.detach(assistant)  # hooks on the shared target (EAGLE-3) go away
        if family.trainable:
            assert forwards > 0, "the drafter loaded from the hub was never called"
    assert load_cost_model(repo_id, revision=commit.oid) == cost
    if family.reads_target:
        with pytest.raises(ValueError, match="target="):
            load_assistant(repo_id)


def test_gguf_export_pushed_to_the_hub_loads_back(tiny, hub, tmp_path):
    """The standalone family's GGUF layout (``ppow_trl.interop.gguf_export``) found and loaded from a repo id."""
    from ppow_trl.drafting import detect_family, load_drafter

    family = get_family("standalone")
    drafter = _build("standalone", tiny)
    family.export(drafter, tmp_path / "gguf", format="gguf", target=tiny.target)
    HfApi().create_repo(f"{USER}/tiny-gguf")
    HfApi().upload_folder(repo_id=f"{USER}/tiny-gguf", folder_path=tmp_path / "gguf")
    assert detect_family(f"{USER}/tiny-gguf") == (family, "gguf")
    loaded = load_drafter(f"{USER}/tiny-gguf").eval()
    ids = _prompt_ids(tiny.tokenizer, PROMPTS[0])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, drafter(ids).logits, atol=1e-5, rtol=1e-5)


# -- the trainer's push and its model card ------------------------------------------------------------------------


def _python_blocks(card: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)


def _push_target(tiny, hub, tmp_path) -> str:
    """The tiny target and its tokenizer on the fake hub, so that the card's snippet loads it by repo id."""
    repo_id = f"{USER}/tiny-target"
    tiny.target.save_pretrained(tmp_path / "target")
    tiny.tokenizer.save_pretrained(tmp_path / "target")
    HfApi().create_repo(repo_id, exist_ok=True)
    HfApi().upload_folder(repo_id=repo_id, folder_path=tmp_path / "target")
    return repo_id


def _trainer(tiny, drafter, output_dir: Path, repo_id: str, peft_config=None):
    from ppow_trl import PPOWConfig, PPOWTrainer

    args = PPOWConfig(output_dir=str(output_dir), max_window=3, window_threshold=0.0, num_generations=2,
                      per_device_train_batch_size=2, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                      disable_tqdm=True, push_to_hub=True, hub_model_id=repo_id)
    data = tiny_word_responses(tiny.target, tiny.tokenizer, count=4)
    return PPOWTrainer(model=drafter, target_model=tiny.target, args=args, train_dataset=data,
                       processing_class=tiny.tokenizer, peft_config=peft_config)


def _assert_snippet_output_is_lossless(namespace: dict) -> None:
    """The snippet's ``out`` equals plain greedy decoding of its ``inputs`` by its ``target``."""
    inputs, out = namespace["inputs"], namespace["out"]
    with torch.no_grad():
        reference = namespace["target"].generate(**inputs, do_sample=False,
                                                 max_new_tokens=out.shape[1] - inputs["input_ids"].shape[1])
    assert torch.equal(out, reference)


@pytest.mark.parametrize("name", [n for n in family_names() if get_family(n).trainable])
def test_trainer_push_to_hub_and_the_model_cards_snippet_runs_as_written(name, tiny, hub, tmp_path):
    target_repo = _push_target(tiny, hub, tmp_path)
    repo_id = f"{USER}/ppow-tiny-{name}"
    family = get_family(name)
    trainer = _trainer(tiny, _build(name, tiny), tmp_path / "out", repo_id)
    trainer.model_card_info = {"target": target_repo}  # what the recipe records (script_args.target_model)
    trainer.push_to_hub()
    snapshot = hub.snapshot(repo_id)
    card = (snapshot / "README.md").read_text()
    assert repo_id in card and (snapshot / "ppow_window_policy.json").is_file()
    blocks = _python_blocks(card)
    namespace = {}
    exec(compile(blocks[0], "<model card snippet>", "exec"), namespace)  # noqa: S102 -- nothing defined beforehand
    try:
        _assert_snippet_output_is_lossless(namespace)  # lossless, as the card promises
    finally:
        family.detach(namespace["assistant"])
    assert ("trust_remote_code=True" in card) == (not family.reads_target)
    assert len(blocks) == (2 if "trust_remote_code=True" in card else 1)


def test_the_cards_remote_code_route_runs_from_the_hub(tiny, hub, tmp_path, monkeypatch):
    """The card's second snippet (without ppow_trl: the repo's own ``custom_generate/``), continuing the first."""
    import transformers.dynamic_module_utils

    modules = tmp_path / "modules"  # transformers copies remote code here, not into ~/.cache
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(modules))
    monkeypatch.syspath_prepend(str(modules))
    target_repo = _push_target(tiny, hub, tmp_path)
    repo_id = f"{USER}/ppow-tiny-remote"
    trainer = _trainer(tiny, _build("standalone", tiny), tmp_path / "out", repo_id)
    trainer.model_card_info = {"target": target_repo}
    trainer.push_to_hub()
    first, second = _python_blocks((hub.snapshot(repo_id) / "README.md").read_text())
    namespace = {}
    exec(compile(first, "<model card snippet>", "exec"), namespace)  # noqa: S102
    exec(compile(second, "<model card snippet 2>", "exec"), namespace)  # noqa: S102
    hook = namespace["assistant"].__dict__.get("generate")  # the repo's custom_generate/, installed by transformers
    assert isinstance(hook, functools.partial) and "custom_generate" in hook.func.__module__
    _assert_snippet_output_is_lossless(namespace)


def test_adapter_cards_snippets_run_as_written(tiny, hub, tmp_path, monkeypatch):
    """What the recipe pushes (``use_peft``): an adapter folder, then (``merge_adapter``) with ``merged/`` inside. The
    first card's snippet merges the adapter downloaded from the hub into ``base_drafter`` (the one name it needs from
    the user); the second's loads the merged drafter from the repo's ``merged/``."""
    import copy

    from peft import LoraConfig

    monkeypatch.chdir(tmp_path)  # the merge snippet saves into ./merged
    target_repo = _push_target(tiny, hub, tmp_path)
    repo_id = f"{USER}/ppow-tiny-lora"
    trainer = _trainer(tiny, _build("standalone", tiny), tmp_path / "out", repo_id,
                       peft_config=LoraConfig(target_modules=["q_proj", "v_proj"], r=2, task_type="CAUSAL_LM"))
    trainer.model_card_info = {"target": target_repo}
    trainer.push_to_hub()
    card = (hub.snapshot(repo_id) / "README.md").read_text()
    assert "LoRA adapter" in card and "merged/" in card and (hub.snapshot(repo_id) / "adapter_config.json").is_file()
    namespace = {"base_drafter": _build("standalone", tiny)}
    exec(compile(_python_blocks(card)[0], "<adapter card snippet>", "exec"), namespace)  # noqa: S102
    _assert_snippet_output_is_lossless(namespace)
    assert (tmp_path / "merged" / "ppow_window_policy.json").is_file()

    merged = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).merge_and_unload()
    save_assistant(merged, tmp_path / "out" / "merged", policy=trainer.window_policy, tokenizer=tiny.tokenizer)
    trainer.push_to_hub()
    card = (hub.snapshot(repo_id) / "README.md").read_text()
    assert (hub.snapshot(repo_id) / "merged" / "config.json").is_file()
    namespace = {}
    exec(compile(_python_blocks(card)[0], "<merged card snippet>", "exec"), namespace)  # noqa: S102
    assert (Path(namespace["folder"]) / "merged" / "ppow_window_policy.json").is_file()
    _assert_snippet_output_is_lossless(namespace)
