"""``model.path`` names for the built-in models: 'toy' and 'toy-chat' become their cached
folders (built on first use); any other path is a model folder and stays as it is."""
from __future__ import annotations

from hpc.toys.toy import toy_model_path
from hpc.toys.toy_chat import toy_chat_model_path

BUILT_IN = {"toy": toy_model_path, "toy-chat": toy_chat_model_path}


def model_folder(path: str) -> str:
    """The folder for ``model.path``: a built-in model's cached folder (built if absent;
    UserError if the cached build is not the intended one), else ``path`` itself."""
    return BUILT_IN[path]() if path in BUILT_IN else path
