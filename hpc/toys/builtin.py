"""The built-in models as ``model.path`` names: 'toy' and 'toy-chat' become their cached folders
(built on first use) through :func:`hpc.models.loading.model_folder`, which finds them by
the import strings of ``hpc.models.folders.BUILT_IN_MODELS`` (hpc.models and hpc.data never
import the toys, which stand above both); :func:`check_cached` checks a cached build at job start."""
from __future__ import annotations

import os

from hpc.models.loading import model_folder
from hpc.toys import toy, toy_chat

CACHES = {"toy": toy.cache_dir, "toy-chat": toy_chat.cache_dir}

__all__ = ["check_cached", "model_folder"]


def check_cached(path: str) -> None:
    """At job start, before the run folder is claimed: a built-in model whose cache exists but
    is not the intended build is one line now (UserError); an absent one is built when the
    model first loads, after the job's input is checked."""
    if path in CACHES and os.path.isdir(CACHES[path]()):
        model_folder(path)
