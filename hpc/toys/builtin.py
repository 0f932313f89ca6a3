"""The built-in models as ``model.path`` names: 'toy' and 'toy-chat' become their cached folders
(built on first use), through :data:`hpc.models.loading.BUILT_IN_MODELS`, which importing this
module fills. The job start (:mod:`hpc.job.lifecycle`) and the tools that take ``model.path``
import it; hpc.models and hpc.data never import the toys (they stand above both)."""
from __future__ import annotations

import os

from hpc.models.loading import BUILT_IN_MODELS, model_folder
from hpc.toys import toy, toy_chat

BUILT_IN_MODELS.update({"toy": toy.toy_model_path, "toy-chat": toy_chat.toy_chat_model_path})
CACHES = {"toy": toy.cache_dir, "toy-chat": toy_chat.cache_dir}

__all__ = ["check_cached", "model_folder"]


def check_cached(path: str) -> None:
    """At job start, before the run folder is claimed: a built-in model whose cache exists but
    is not the intended build is one line now (UserError); an absent one is built when the
    model first loads, after the job's input is checked."""
    if path in CACHES and os.path.isdir(CACHES[path]()):
        model_folder(path)
