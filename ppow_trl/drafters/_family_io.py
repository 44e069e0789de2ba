"""Small helpers the family packages share for reading folders and Hub repos (family-neutral)."""

from __future__ import annotations

import json
from pathlib import Path

from ..utils import load_json


def read_config(folder_or_repo, **hub_kwargs) -> dict | None:
    """The ``config.json`` of a local folder or Hub repo id, or ``None`` where there is none (or no access)."""
    try:
        return load_json(folder_or_repo, "config.json", "", **hub_kwargs)
    except (FileNotFoundError, OSError, ValueError, json.JSONDecodeError):
        return None


def local_folder(folder_or_repo, **hub_kwargs) -> Path:
    """A local folder holding the repo's files: the folder itself, or a Hub snapshot (``snapshot_download``) for
    layouts that are read file by file."""
    if Path(str(folder_or_repo)).is_dir():
        return Path(str(folder_or_repo))
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(folder_or_repo), **hub_kwargs))
