"""Which model tq-chat runs: a local folder, a Hugging Face repo id, or a short alias; and fetching it.

Everything that touches the network is here, and every failure of it becomes `ModelUnavailable` with a
message a user can act on (tq-chat prints it and exits with code 2, never a traceback). Downloads go through
huggingface_hub into its usual cache (~/.cache/huggingface/hub, or $HF_HOME), so mlx-lm and other tools reuse
them.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Short names -> 4-bit MLX community conversions (matched case-insensitively).
ALIASES = {
    "Qwen3.5-35B-A3B": "mlx-community/Qwen3.5-35B-A3B-4bit",
    "Qwen3.5-397B-A17B": "mlx-community/Qwen3.5-397B-A17B-4bit",
    "Qwen3-Next-80B-A3B": "mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit",
    "Qwen2.5-32B": "mlx-community/Qwen2.5-32B-Instruct-4bit",
    "Qwen2.5-3B": "mlx-community/Qwen2.5-3B-Instruct-4bit",
    "Llama-3.2-3B": "mlx-community/Llama-3.2-3B-Instruct-4bit",
}

# The files mlx-lm needs (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS).
try:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS as ALLOW_PATTERNS
except ImportError:  # pragma: no cover - older mlx-lm
    ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jsonl", "*.jinja"]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelUnavailable(Exception):
    """The model cannot be found or fetched; str() is the message for the user."""


@dataclass
class ModelSource:
    """A resolved MODEL argument."""

    spec: str  # what the user typed
    repo_id: str | None = None  # Hugging Face repo, when it came from one
    path: Path | None = None  # local folder with config.json and weights (None: still to download)

    @property
    def name(self) -> str:
        if self.repo_id:
            return self.repo_id.split("/")[-1]
        return self.path.name if self.path else self.spec

    @property
    def needs_download(self) -> bool:
        return self.path is None


def resolve(spec: str) -> ModelSource:
    """Turn MODEL into a ModelSource: an existing folder, an alias, or a repo id (found in the local
    Hugging Face cache when it was downloaded before). Raises ModelUnavailable for anything else."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelUnavailable(f"{spec} is a folder but not a model: it has no config.json")
        return ModelSource(spec, path=path.absolute())  # not resolve(): keep the name the user gave a link
    if path.is_file():
        kind = "a GGUF file (tq-chat runs MLX model folders; the demo model is converted for you)" \
            if path.suffix.lower() == ".gguf" else "a file"
        raise ModelUnavailable(f"{spec} is {kind}, not a model: give a model folder (config.json and "
                               f"*.safetensors), a Hugging Face repo id (owner/name), or one of the short names")
    if spec.startswith((".", "/", "~")) or spec.endswith(("/", "\\")):
        raise ModelUnavailable(f"no such model folder: {spec}")
    lowered = {k.lower(): v for k, v in ALIASES.items()}
    repo = lowered.get(spec.lower())
    if repo is None:
        if not _REPO_ID.fullmatch(spec):
            raise ModelUnavailable(
                f"unknown model {spec!r}: give a local model folder, a Hugging Face repo id (owner/name), "
                f"or one of the short names: {', '.join(ALIASES)}"
            )
        repo = spec
    return ModelSource(spec, repo_id=repo, path=cached_snapshot(repo))


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a repo already downloaded in full, None otherwise (never uses the network)."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or an incomplete snapshot
        return None
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    return None


def _offline_message(repo_id: str, error: BaseException) -> str:
    from huggingface_hub import constants

    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"{repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be fetched from "
        f"the Hub: {reason[:300]}\n"
        f"Connect to the internet once so tq-chat can download it, or pass a local model folder."
    )


def check_hub(repo_id: str, timeout: float = 5.0) -> None:
    """Fail fast, with a clear message, when the Hub cannot be reached (instead of huggingface_hub's retries)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ModelUnavailable(_offline_message(repo_id, RuntimeError("HF_HUB_OFFLINE is set")))
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the proxy resolves the host; let huggingface_hub try
    url = urllib.parse.urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise ModelUnavailable(_offline_message(repo_id, OSError(f"cannot connect to {host}: {e}"))) from None


@contextlib.contextmanager
def _quiet_hub():
    # huggingface_hub logs every retry as a warning; the app reports one clear message instead.
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def remote_info(repo_id: str) -> tuple[dict, int]:
    """(config.json, total bytes of the safetensors files) of a repo on the Hub, without downloading weights."""
    from huggingface_hub import hf_hub_download, snapshot_download

    check_hub(repo_id)
    try:
        with _quiet_hub():
            config = json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text())
            files = snapshot_download(repo_id, allow_patterns=["*.safetensors"], dry_run=True)
    except Exception as e:  # network, auth, missing repo: all end as one clear message
        raise ModelUnavailable(_offline_message(repo_id, e)) from None
    return config, sum(f.file_size or 0 for f in files)


ProgressCallback = Callable[[float, float | None], None]  # (bytes done, bytes total)


def progress_tqdm(callback: ProgressCallback) -> type:
    """A tqdm class for huggingface_hub that reports byte progress to `callback` instead of the terminal
    (the file-count bar is left out)."""
    from tqdm.std import tqdm

    class AppTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["file"] = io.StringIO()  # never draw on the terminal: the app owns it
            kwargs["mininterval"] = 0.1
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None):
            if self.unit == "B":
                callback(self.n, self.total or None)
            return True

    return AppTqdm


def download(source: ModelSource, progress: ProgressCallback | None = None) -> Path:
    """Fetch the model's files into the Hugging Face cache (progress reported to `progress`); sets and
    returns source.path."""
    from huggingface_hub import snapshot_download

    if source.path is not None:
        return source.path
    kwargs = {"tqdm_class": progress_tqdm(progress)} if progress else {}
    check_hub(source.repo_id)
    try:
        with _quiet_hub():
            path = Path(snapshot_download(source.repo_id, allow_patterns=ALLOW_PATTERNS, **kwargs))
    except Exception as e:
        raise ModelUnavailable(_offline_message(source.repo_id, e)) from None
    source.path = path
    return path
