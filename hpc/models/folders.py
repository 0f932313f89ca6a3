"""What a model folder and an adapter folder must hold, checked without torch (a job checks its
inputs before it imports torch: :mod:`hpc.job.inputs`; the loaders check them again)."""
from __future__ import annotations

import os

from hpc.runtime.errors import UserError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# The built-in models: ``{model.path name: 'module:function' that returns its folder, built and
# cached on first use}``. The toys stand a floor above this one and are imported only when a
# job names one (:func:`hpc.models.loading.model_folder`), so a tool that reads only a model
# folder's files knows the names without building anything.
BUILT_IN_MODELS = {
    "toy": "hpc.toys.toy:toy_model_path",
    "toy-chat": "hpc.toys.toy_chat:toy_chat_model_path",
}


def check_folder(path: str, what: str, needs: list) -> None:
    """UserError unless ``path`` is a folder holding, for each ``(description, file names)`` of
    ``needs``, one of those files; the message names the first that is missing."""
    if not os.path.isdir(path):
        raise UserError(f"{what} folder not found: {path}")
    files = set(os.listdir(path))
    for description, names in needs:
        if not files.intersection(names):
            raise UserError(f"{what} folder {path} has no {description}")


def check_model_folder(path: str, what: str = "model") -> None:
    """UserError unless ``path`` holds config.json, weights and tokenizer files (``what``: the
    folder's name in the message, e.g. "reward model")."""
    check_folder(path, what, [
        ("config.json", ("config.json",)),
        (f"weights ({' or '.join(WEIGHT_FILES[::2])})", WEIGHT_FILES),
        (f"tokenizer files ({', '.join(TOKENIZER_FILES)})", TOKENIZER_FILES)])


def check_adapter_folder(path: str) -> None:
    """UserError unless ``path`` holds a peft adapter's config and weights."""
    check_folder(path, "adapter", [
        ("adapter_config.json", ("adapter_config.json",)),
        (f"adapter weights ({' or '.join(ADAPTER_WEIGHT_FILES)})", ADAPTER_WEIGHT_FILES)])
