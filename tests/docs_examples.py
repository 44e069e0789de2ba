"""Run the Python code blocks of one Markdown page, in order, in one namespace (the page is a tutorial).

Used by ``tests/test_docs.py``; also by hand: ``python tests/docs_examples.py docs/serving.md --tiny-dir DIR``.

Every fenced ```` ```python ```` block runs, as written, except where an HTML comment right above it (invisible on
GitHub and on the site) says otherwise:

- ``<!-- docs-test: skip REASON -->``: the block is not run (REASON is required: say what runs it instead);
- ``<!-- docs-test: replace OLD => NEW -->``: the block runs with OLD replaced by NEW (sizes a tutorial shows for a
  real run, made small for the test); one comment per replacement, and OLD must occur in the block.

With ``--tiny-dir`` the offline target (``ppow_trl.offline.smollm2_path``) is replaced by a folder holding a tiny
Llama with SmolLM2's real tokenizer and chat template, so the examples run in seconds on the code paths a user's run
takes (the real target is what ``tests/test_main_job.py`` and the slow tests load).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^```(python|py)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(skip|replace)\b(.*?)-->\s*$")


@dataclass
class Block:
    line: int                      # 1-based line of the opening fence
    code: str
    skip: str | None = None        # the reason, when skipped
    replacements: list[tuple[str, str]] = field(default_factory=list)


def python_blocks(text: str) -> list[Block]:
    """The page's Python blocks with the directives written above each; malformed directives raise ValueError."""
    lines = text.splitlines()
    blocks, pending, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        directive = DIRECTIVE.match(line.strip())
        if directive:
            pending.append((i + 1, directive.group(1), directive.group(2).strip()))
        elif FENCE.match(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"line {i + 1}: a ```python block that never closes")
            block = Block(line=i + 1, code="\n".join(lines[i + 1:end]) + "\n")
            for at, kind, arg in pending:
                if kind == "skip":
                    if not arg:
                        raise ValueError(f"line {at}: `docs-test: skip` needs a reason (what runs this code instead)")
                    block.skip = arg
                else:
                    if "=>" not in arg:
                        raise ValueError(f"line {at}: write `docs-test: replace OLD => NEW`")
                    old, new = (part.strip() for part in arg.split("=>", 1))
                    if old not in block.code:
                        raise ValueError(f"line {at}: {old!r} does not occur in the block below it")
                    block.replacements.append((old, new))
            blocks.append(block)
            pending, i = [], end
        elif line.strip() and pending:
            raise ValueError(f"line {pending[0][0]}: a docs-test directive must stand right above a ```python block")
        i += 1
    return blocks


def make_tiny_offline_target(folder: Path) -> Path:
    """A 2-layer, 64-wide Llama over SmolLM2's vocabulary, with SmolLM2's tokenizer, saved in ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ppow_trl.offline import smollm2_path

    if (folder / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _use_tiny_offline_target(folder: Path) -> None:
    """Point every reference to ``smollm2_path`` (the module's and the names imported from it) at ``folder``."""
    import ppow_trl  # noqa: F401  (imports the modules that hold a reference)
    from ppow_trl import offline

    original = offline.smollm2_path

    def tiny_smollm2_path(cache_dir=None):
        return folder

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith(("ppow_trl", "recipes")) and \
                getattr(module, "smollm2_path", None) is original:
            module.smollm2_path = tiny_smollm2_path


def run_page(page: Path, tiny_dir: Path | None = None) -> int:
    """Run the page's blocks; returns how many ran. Raises the first block's error with the page and line."""
    blocks = python_blocks(page.read_text())
    if tiny_dir is not None:
        _use_tiny_offline_target(make_tiny_offline_target(tiny_dir))
    namespace = {"__name__": "__docs_example__"}
    ran = 0
    for block in blocks:
        if block.skip:
            continue
        code = block.code
        for old, new in block.replacements:
            code = code.replace(old, new)
        try:
            exec(compile(code, f"{page}:{block.line}", "exec"), namespace)
        except Exception as error:
            raise RuntimeError(f"{page}, the block at line {block.line} failed: {error!r}") from error
        ran += 1
    return ran


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", type=Path)
    parser.add_argument("--tiny-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    ran = run_page(args.page.resolve(), args.tiny_dir)
    print(f"{args.page}: {ran} block(s) ran")


if __name__ == "__main__":
    main()
