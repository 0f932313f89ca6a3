"""Hugging Face Hub ids where a folder is expected (``model.path``, ``lora.adapter``, the source of
``hpc-data prepare``): ``org/name`` or ``org/name@revision`` (a branch, tag or commit), found in
the local Hugging Face cache by huggingface_hub's own lookup (:func:`snapshot_download` with
``local_files_only``; ``HF_HOME`` or ``HF_HUB_CACHE`` say where the cache is), never downloaded:
a job runs where the Hub may be out of reach, so a missing id is one line that names the cache
searched and the command that downloads it (on a login node).

A path that exists keeps priority over an id of the same spelling, and text that is not an id
(an absolute path, ``./x``, ``a/b/c``) stays a path for the folder checks to name. Torch-free:
huggingface_hub is imported only when an id is looked up.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hpc.runtime.errors import UserError

# org/name as the Hub spells them, then an optional @revision (branch, tag or commit hash)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


@dataclass(frozen=True)
class Source:
    """Where a model, adapter or data set named by path or by Hub id lies.

    ``given``: as the user wrote it; ``path``: the local folder or file (``given`` itself
    unless it is an id); ``revision``: the commit hash of the cached snapshot ('' for a path)."""

    given: str
    path: str
    revision: str = ""


def hub_id(text: str) -> tuple | None:
    """``(repo id, revision or None)`` if ``text`` is spelt as a Hub id, else None."""
    match = HUB_ID.fullmatch(text)
    if match is None or any(part in (".", "..") for part in match["repo"].split("/")):
        return None
    return match["repo"], match["revision"]


def download_command(repo: str, revision: str | None, repo_type: str) -> str:
    """The ``hf`` command (huggingface_hub's CLI) that puts ``repo`` into the cache."""
    flags = (f" --repo-type {repo_type}" if repo_type != "model" else "") + (
        f" --revision {revision}" if revision else "")
    return f"hf download {repo}{flags}"


def cache_folder(cache_dir: str | None = None) -> str:
    """The cache huggingface_hub reads: ``cache_dir`` if given, else its HF_HUB_CACHE (from
    HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if cache_dir:
        return cache_dir
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def local_or_cached(given: str, what: str, repo_type: str = "model",
                    cache_dir: str | None = None) -> Source:
    """The :class:`Source` of ``given``: itself where that path exists or it is no Hub id;
    else the id's snapshot folder in the local cache. UserError (one line, ``what`` first, e.g.
    "config key 'model.path'") naming the id, the cache searched and the download command when
    the cache has no snapshot of it."""
    found = hub_id(given)
    if os.path.exists(given) or found is None:
        return Source(given, given)
    repo, revision = found
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = cache_folder(cache_dir)
    try:
        folder = snapshot_download(repo, repo_type=repo_type, revision=revision,
                                   cache_dir=cache, local_files_only=True)
    except HFValidationError as err:
        raise UserError(f"{what}: {given} is neither a path nor a Hugging Face Hub id "
                        f"({str(err).splitlines()[0]})") from None
    except LocalEntryNotFoundError as err:  # IncompleteSnapshotError is one
        incomplete = "incomplete" in str(err)
        state = "an incomplete snapshot" if incomplete else "no snapshot"
        at = f" at revision {revision}" if revision else ""
        raise UserError(f"{what}: {given} is no local path, and the Hugging Face cache "
                        f"{cache} holds {state} of the {repo_type} {repo}{at}; nothing is "
                        f"downloaded here: run `{download_command(repo, revision, repo_type)}` "
                        f"on a machine that reaches the Hub (a login node), or set HF_HOME or "
                        f"HF_HUB_CACHE to the cache that holds it") from None
    return Source(given, str(folder), os.path.basename(os.path.normpath(folder)))
