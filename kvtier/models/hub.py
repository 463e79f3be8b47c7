"""Hugging Face Hub ids (`org/name[@revision]`) resolved to a local snapshot directory.

The local cache comes first, so a cached model loads with no network at all. A download happens only
when the network is allowed (invariant 8: a Hub id is the user asking), fetches only what kvtier reads
(config, tokenizer, safetensors) and shows huggingface_hub's own progress bars. Every failure is one
line that says what to run, and no call waits on the network for more than a short timeout.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.models.config import ModelConfig
from kvtier.models.errors import ModelLoadError

# What kvtier reads from a repo: configs and tokenizer files (json, sentencepiece, tiktoken, merges/vocab
# text, chat templates) and safetensors weights. Mistral repos also ship `consolidated.safetensors`, a
# second copy of the weights in another layout; Llama repos keep their original checkpoint in original/.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
IGNORE_PATTERNS = ["consolidated*", "original/*"]

# org/name, then an optional @revision (a branch, tag or commit). Names follow the Hub's own rules
# (letters, digits, '-', '_', '.'), so a path with more than one '/' is never taken for an id.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None  # None: the repo's default branch

    @staticmethod
    def parse(name: str) -> HubId | None:
        m = _HUB_ID.match(name)
        return HubId(m["repo"], m["rev"]) if m else None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def download_command(self) -> str:
        return f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubSettings:
    cache_dir: Path
    offline: bool  # HF_HUB_OFFLINE: never touch the network
    timeout_s: float = 5.0  # per network call: a blocked network fails in seconds, not minutes

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> HubSettings:
        """Read at call time: huggingface_hub reads its variables once, at import, which would miss a
        HF_HOME or HF_HUB_OFFLINE set later in the same process (tests, notebooks)."""
        from huggingface_hub import constants

        if env.get("HF_HUB_CACHE"):
            cache = Path(env["HF_HUB_CACHE"])
        elif env.get("HF_HOME"):
            cache = Path(env["HF_HOME"]) / "hub"
        else:
            cache = Path(constants.HF_HUB_CACHE)
        flag = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
        return HubSettings(cache.expanduser(), flag.strip().lower() in _TRUE or constants.HF_HUB_OFFLINE)


def _usable(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _fix(hub: HubId, settings: HubSettings) -> str:
    return (f"run `{hub.download_command()}` on a machine with network access, "
            f"or set HF_HOME (or HF_HUB_CACHE) to a cache that holds it (looked in {settings.cache_dir})")


def snapshot(hub: HubId, settings: HubSettings | None = None) -> Path:
    """The local snapshot directory of `hub`: from the cache, else downloaded; ModelLoadError otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    settings = settings or HubSettings.from_env()
    try:
        path = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=settings.cache_dir,
                                      local_files_only=True, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS))
        if _usable(path):
            return path
    except LocalEntryNotFoundError:  # not cached, or cached only in part
        pass
    except HFValidationError as e:
        raise ModelLoadError(f"{hub} is neither a local path nor a valid Hugging Face Hub id ({_first_line(e)})") from e
    if settings.offline:
        raise ModelLoadError(f"model {hub} is not a local path, nor in the Hugging Face cache, and HF_HUB_OFFLINE is set: "
                             + _fix(hub, settings))
    return _download(hub, settings)


def _download(hub: HubId, settings: HubSettings) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        # A quick look first: it fails fast on no network, a gated or missing repo, and tells whether
        # there are safetensors weights at all before anything large is fetched.
        info = HfApi().model_info(hub.repo_id, revision=hub.revision, timeout=settings.timeout_s)
        files = [s.rfilename for s in info.siblings or []]
        if files and not any(f.endswith(".safetensors") for f in files):
            raise ModelLoadError(f"{hub} has no safetensors weights (kvtier does not read PyTorch .bin files)")
        # The revision as asked, not the resolved commit: only then does the cache record the ref, so the
        # next (offline) run finds it.
        path = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=settings.cache_dir,
                                      allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                      etag_timeout=settings.timeout_s))
    except ModelLoadError:
        raise
    except GatedRepoError as e:
        raise ModelLoadError(f"{hub} is gated: accept its terms on https://huggingface.co/{hub.repo_id}, "
                             "log in with `hf auth login` (or set HF_TOKEN), then run again") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelLoadError(f"{hub} is not on the Hugging Face Hub (or is private: set HF_TOKEN); "
                             "check the name, or give a local path") from e
    except Exception as e:  # no network, a proxy, a timeout, the Hub down: all mean the same to the user
        raise ModelLoadError(f"cannot download {hub} ({type(e).__name__}: {_first_line(e)}): "
                             + _fix(hub, settings)) from e
    if not _usable(path):
        raise ModelLoadError(f"{hub} downloaded to {path} but has no config.json or *.safetensors weights")
    return path


@dataclass(frozen=True)
class CachedHubModel:
    repo_id: str
    path: Path  # the snapshot `main` points at, else the newest
    config: ModelConfig


def cached_models(settings: HubSettings | None = None) -> list[CachedHubModel]:
    """Models in the local Hugging Face cache that kvtier can run; [] when there is no cache."""
    from huggingface_hub import scan_cache_dir

    settings = settings or HubSettings.from_env()
    try:
        info = scan_cache_dir(settings.cache_dir)
    except Exception:  # no cache directory, or one huggingface_hub cannot read: nothing to list
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        for rev in revisions:
            path = Path(rev.snapshot_path)
            if not _usable(path):
                continue
            try:
                cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
            except Exception:  # an architecture kvtier does not run, or an unreadable config: not listed
                continue
            found.append(CachedHubModel(repo.repo_id, path, cfg))
            break
    return found
