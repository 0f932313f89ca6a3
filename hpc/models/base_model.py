"""Which base model an adapter belongs to: recorded beside the adapter when it is saved, checked
before an adapter is loaded onto a model.

An adapter is fitted to one model's weights. Loaded onto another model of the same shapes (an
SFT adapter of Qwen2.5-7B onto Qwen2.5-7B-Instruct) it loads without a word and means nothing,
so :func:`record_base` writes ``base_model.json`` into every adapter folder this package saves
and :func:`check_base` compares it with the job's ``model.path`` before any weights load. The
identity is the content, not the path (the same model copied to another file system is the
same model): the sha256 of ``config.json`` and of a sample of the weight files (their names,
sizes and first and last MiB: the safetensors header and two ends of the tensor data, a few
reads even on a 32B model). An adapter without the file (saved by peft, TRL or another tool)
is checked by its shapes only, when it loads.
"""
from __future__ import annotations

import hashlib
import json
import os

from hpc.runtime.errors import UserError

RECORD = "base_model.json"
SAMPLE_BYTES = 2 ** 20  # bytes read from each end of a weight file
_WEIGHTS = (".safetensors", ".bin", ".index.json")


def fingerprint(folder: str) -> dict:
    """``{"config_sha256", "weights_sha256"}`` of the model in ``folder`` (see the module)."""
    with open(os.path.join(folder, "config.json"), "rb") as fh:
        config = hashlib.sha256(fh.read()).hexdigest()
    weights = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if not name.startswith(("model", "pytorch_model")) or not name.endswith(_WEIGHTS):
            continue
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        weights.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as fh:
            weights.update(fh.read(SAMPLE_BYTES))
            fh.seek(max(0, size - SAMPLE_BYTES))
            weights.update(fh.read(SAMPLE_BYTES))
    return {"config_sha256": config, "weights_sha256": weights.hexdigest()}


def record_base(adapter_dir: str, model_dir: str) -> None:
    """Write ``base_model.json`` (the model folder and its :func:`fingerprint`) into
    ``adapter_dir``; nothing when ``model_dir`` is not a model folder (a model built in
    memory)."""
    if not os.path.isfile(os.path.join(model_dir or "", "config.json")):
        return
    with open(os.path.join(adapter_dir, RECORD), "w") as fh:
        json.dump({"folder": os.path.abspath(model_dir), **fingerprint(model_dir)}, fh,
                  indent=1)


def check_base(adapter_dir: str, model_path: str, folder_of, allow_other: bool) -> None:
    """UserError, naming both models, if the adapter in ``adapter_dir`` records another base
    model than ``model.path`` = ``model_path`` (in the folder ``folder_of(model_path)`` gives,
    asked only when there is a record to compare), unless ``allow_other``
    (``lora.allow_other_base``); a record that is not ours is one line too. A model folder
    without config.json is left to the loader, which names what it lacks."""
    path = os.path.join(adapter_dir, RECORD)
    if not adapter_dir or not os.path.isfile(path):
        return
    try:
        with open(path, "rb") as fh:
            recorded = json.loads(fh.read(2 ** 16))
        folder = str(recorded["folder"])[:500]
        wanted = {k: str(recorded[k]) for k in ("config_sha256", "weights_sha256")}
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not a base-model record this program wrote; remove it to "
                        f"check the adapter by its shapes only") from None
    if allow_other:
        return
    model_dir = folder_of(model_path)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return
    found = fingerprint(model_dir)
    if found == wanted:
        return
    what = "config.json and weights" if found["config_sha256"] != wanted["config_sha256"] \
        else "weights"
    raise UserError(f"adapter {adapter_dir} was trained on the model in {folder}, and "
                    f"model.path={model_path} ({model_dir}) has other {what}; give the model it "
                    f"was trained on, or lora.allow_other_base=true to load it on this one")
