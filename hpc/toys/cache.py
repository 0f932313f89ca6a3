"""What the built-in toy models share: a fixed, seeded amount of training, the cached folder
that holds a finished build, and the check that a cached build is the intended one.

A build is a seeded sequence of optimizer steps with a fixed probe schedule, ended by a step
count or by what the model has learnt, never by the clock: the same torch build, CPU
arithmetic and thread count give the same weights bitwise, however busy the machine is. The
wall clock is only reported (``build_seconds``). A folder is cached only when its build ran
to its end (written in a temporary sibling, ``INFO_FILE`` last, then renamed), and a cached
folder is used only when its ``INFO_FILE`` records the intended build (version and how it
ends) and, when recorded, the SHA-256 of its weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

from hpc.runtime.atomic import replaced_dir
from hpc.runtime.errors import UserError
from hpc.runtime.world import _LOCAL_RANK_VARS

INFO_FILE = "toy_info.json"
WEIGHTS_FILE = "model.safetensors"


def train_steps(train_step, probe, steps: int, probe_every: int, log,
                stop=lambda step: False) -> tuple[int, float]:
    """Call ``train_step()`` (one optimizer step; returns its loss) up to ``steps`` times,
    ``probe()`` (held-out probe accuracy, only logged) after every ``probe_every``-th step,
    and ``stop(step)`` after every step: training ends after the first step it is true for.
    Nothing here reads the clock. Returns (steps run, last probe accuracy: 0.0 if none ran)."""
    probe_acc = 0.0
    for step in range(1, steps + 1):
        loss = train_step()
        if step % probe_every == 0:
            probe_acc = probe()
            log(f"step {step}: loss {loss:.3f}, probe accuracy {probe_acc:.3f}")
        if stop(step):
            return step, probe_acc
    return steps, probe_acc


def weights_sha256(folder: str) -> str:
    """Hex SHA-256 of ``folder/model.safetensors``."""
    digest = hashlib.sha256()
    with open(os.path.join(folder, WEIGHTS_FILE), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_model_folder(out_dir: str, model, tokenizer, info: dict) -> None:
    """Write a built model folder: weights, tokenizer, then ``INFO_FILE`` (``info`` plus the
    weights' SHA-256) last, whose presence marks the folder complete."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, INFO_FILE), "w") as fh:
        json.dump(dict(info, weights_sha256=weights_sha256(out_dir)), fh, indent=1)


def read_info(folder: str) -> dict:
    """The ``INFO_FILE`` of a built folder."""
    with open(os.path.join(folder, INFO_FILE)) as fh:
        return json.load(fh)


def build_words(folder: str) -> str:
    """A built folder's build in words, ``"<version> sha256:<weights>"``: what a run file
    (``model_build``) and a results file (``toy_build``) record of the model they ran."""
    info = read_info(folder)
    return f"{info['version']} sha256:{info.get('weights_sha256', 'unrecorded')}"


def check_built(folder: str, expected: dict, rebuild: str) -> dict:
    """``folder``'s info if it records the ``expected`` values (e.g. ``{"version": ...,
    "steps": ...}``) and its weights match the recorded SHA-256 (folders from before the hash
    was recorded have none). Otherwise UserError, one line that names the folder, what differs
    and the ``rebuild`` command."""
    try:
        info = read_info(folder)
        found = {key: info.get(key) for key in expected}
        if found != expected:
            problem = f"it records {_words(found)}; the intended build is {_words(expected)}"
        elif "weights_sha256" in info and weights_sha256(folder) != info["weights_sha256"]:
            problem = f"its {WEIGHTS_FILE} does not match the SHA-256 its {INFO_FILE} records"
        else:
            return info
    except (OSError, ValueError, AttributeError) as err:
        problem = f"its {INFO_FILE} or weights are unreadable ({type(err).__name__})"
    raise UserError(f"the cached model in {folder} is not the intended build: {problem}; "
                    f"rebuild it with: {rebuild}")


def _words(values: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in values.items())


def _local_rank() -> int:
    return next((int(os.environ[v]) for v in _LOCAL_RANK_VARS if v in os.environ), 0)


def build_into(final: str, train) -> None:
    """Run ``train(tmp)`` in a temporary sibling folder, then rename it to ``final`` (atomic).
    If another process finished first, its folder is kept and this build is discarded. A build
    that raises or is killed leaves ``final`` as it was."""
    try:
        with replaced_dir(final, keep_existing=True) as tmp:
            train(tmp)
    except OSError:  # another process renamed its build into place between check and rename
        if not os.path.isfile(os.path.join(final, INFO_FILE)):
            raise


def cached_folder(final: str, build, what: str, wait_s: float, log=print) -> str:
    """``final``, after ``build(final)`` if it holds no complete build yet.

    Local rank 0 of a node builds; other local ranks wait up to ``wait_s`` seconds for the
    folder to appear (then build it themselves, which is safe, if it still has not).
    """
    info_file = os.path.join(final, INFO_FILE)  # written last, inside the renamed folder
    if not os.path.isfile(info_file) and _local_rank() != 0:
        deadline = time.monotonic() + wait_s
        while not os.path.isfile(info_file) and time.monotonic() < deadline:
            time.sleep(1.0)
    if not os.path.isfile(info_file):
        log(f"building {what} in {final} (once)")
        build(final)
    return final
