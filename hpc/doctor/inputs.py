"""A job's inputs on every node: the model folder (present, and the same config.json, tokenizer
files and weight sizes as rank 0's: sha256 of the small files, sizes of the weights, which
hashing would read for minutes), the memory plan's verdict for this rank count
(:func:`hpc.plan.registry.job_plan`, the call every job makes at start), the data
files (read row by row, as a job's input check does) and the space the run's checkpoints take.
"""
from __future__ import annotations

import hashlib
import os

import psutil

from hpc.data.mathdata import check_task_files
from hpc.doctor.findings import Finding
from hpc.engine.shape import ModelShape
from hpc.models.folders import TOKENIZER_FILES, WEIGHT_FILES, check_model_folder
from hpc.plan.registry import job_plan
from hpc.models.folders import BUILT_IN_MODELS
from hpc.runtime.errors import UserError

HASHED = ("config.json", "tokenizer_config.json", "special_tokens_map.json",
          "added_tokens.json", "merges.txt", "chat_template.jinja", *TOKENIZER_FILES)
COPY_FIX = "copy the same model folder to every node, or keep it on a shared file system"
BUILDERS = {"toy": "hpc-toy", "toy-chat": "hpc-toy-chat"}
STATE_BYTES = 12  # a trainable parameter in a checkpoint: fp32 value and two AdamW moments
EXPORT_BYTES = 4  # ... in the exported adapter or model (fp32 at most)
SFT_KEEP = 3  # checkpoints a method without a keep_checkpoints key keeps (hpc.job.loop)


def model_folder_here(path: str) -> tuple:
    """(folder, findings): the folder ``model.path`` names on this rank; a built-in model's
    cached folder, never built here (a job would build it on every node that lacks it)."""
    if path not in BUILT_IN_MODELS:
        try:
            check_model_folder(path)
        except UserError as err:
            return path, [Finding("model folder", str(err), COPY_FIX)]
        return path, []
    from hpc.toys.builtin import CACHES, check_cached  # the toys import torch and transformers

    folder = CACHES[path]()
    if not os.path.isdir(folder):
        return folder, [Finding("model folder", f"the built-in model {path} is not built at "
                                                f"{folder}", f"build it once with "
                                f"{BUILDERS[path]}, with HPC_CACHE on a file system every "
                                f"node sees")]
    try:
        check_cached(path)
    except UserError as err:
        return folder, [Finding("model folder", str(err), "")]
    return folder, []


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(folder: str) -> dict:
    """{file name: sha256} of the folder's config and tokenizer files, {file name: bytes} of
    its weight files (shards included)."""
    names = sorted(os.listdir(folder))
    weights = [n for n in names if n in WEIGHT_FILES or n.endswith((".safetensors", ".bin"))]
    return {"sha256": {n: _sha256(os.path.join(folder, n)) for n in names if n in HASHED},
            "bytes": {n: os.path.getsize(os.path.join(folder, n)) for n in weights}}


def check_same_model(mine: dict, rank0: dict) -> list:
    """This rank's fingerprint against rank 0's: the files that differ or are missing."""
    differ = sorted(n for kind in ("sha256", "bytes")
                    for n in set(mine[kind]) | set(rank0[kind])
                    if mine[kind].get(n) != rank0[kind].get(n))
    if not differ:
        return []
    return [Finding("model folder", f"differs from rank 0's in {', '.join(differ)}", COPY_FIX)]


def model_text(path: str, folder: str, prints: dict) -> str:
    """The model line of the summary, from rank 0's fingerprint."""
    config = prints["sha256"].get("config.json", "")
    size = sum(prints["bytes"].values())
    where = folder if folder == path else f"{path} ({folder})"
    return (f"{where}: config.json sha256 {config[:12]}, {len(prints['sha256']) - 1} "
            f"tokenizer file(s) hashed, weights {size / 2**20:.1f} MiB")


def plan_verdicts(method_cfgs: dict, world, device_type: str) -> list:
    """Each method's job config on this rank count (:meth:`JobConfig.validate_world`) and its
    memory plan (:func:`job_plan`, which the jobs enforce on CUDA only)."""
    findings = []
    for method, cfg in method_cfgs.items():
        try:
            cfg.validate_world(world)
            job_plan(cfg, method, world.size, device_type)
        except UserError as err:
            findings.append(Finding(f"{method} on {world.size} ranks", str(err), ""))
    return findings


def host_memory_for_load(method_cfgs: dict, world, device_type: str) -> list:
    """On each node (its local rank 0): the host memory the load takes there, its ranks times
    the most any method's plan says a rank holds while it loads (:func:`job_plan`'s
    ``host_load``), against the memory available on the node now."""
    if world.local_rank != 0:
        return []
    per_rank = 0
    for method, cfg in method_cfgs.items():
        try:
            per_rank = max(per_rank, job_plan(cfg, method, world.size, device_type).host_load)
        except UserError:
            pass  # the plan's own verdict is reported by plan_verdicts
    need, available = per_rank * world.local_size, psutil.virtual_memory().available
    if need <= available:
        return []
    return [Finding("host memory for the load", f"{world.local_size} ranks x "
                    f"{per_rank / 2**30:.2f} GiB = {need / 2**30:.2f} GiB while the model loads, "
                    f"{available / 2**30:.2f} GiB available",
                    "fewer ranks per node, or model.load=streamed (one tensor a rank)")]


def check_data(cfg) -> list:
    """The task's data files, every row, as a job's input check reads them."""
    try:
        check_task_files(cfg)
    except UserError as err:
        return [Finding("data files", str(err), "the data files must be readable at the same "
                                                "path on every node")]
    return []


def data_text(cfg) -> str:
    files = [p for p in (cfg.task.train_path, cfg.task.eval_path) if p]
    if not files:
        return f"task {cfg.task.name} is generated (no files)"
    return f"{', '.join(files)} read on every rank"


def checkpoint_need(cfg, method_cfgs: dict, folder: str) -> tuple:
    """(bytes, how they add up) the run root should have free: ``run.min_free_mb``, or more
    where the model's shape is known: for each method, its kept checkpoints and the one being
    written (``<method>.keep_checkpoints`` + 1) at STATE_BYTES per trainable parameter (LoRA's,
    or every parameter with ``<method>.full_finetune``) and the export at EXPORT_BYTES. An upper
    bound: ESSA's checkpoint holds its search state, not AdamW moments."""
    need, why = int(cfg.run.min_free_mb * 2**20), f"run.min_free_mb={cfg.run.min_free_mb:g}"
    try:
        shape = ModelShape.from_folder(folder)
    except (UserError, OSError, ValueError):
        return need, why
    for method, method_cfg in method_cfgs.items():
        section = getattr(method_cfg, method)
        keep = getattr(section, "keep_checkpoints", SFT_KEEP)
        trainable = (shape.parameters() if getattr(section, "full_finetune", False)
                     else shape.lora_parameters(cfg.lora.rank, cfg.lora.targets))
        total = (keep + 1) * trainable * STATE_BYTES + trainable * EXPORT_BYTES
        if total > need:
            need, why = total, (f"{method}: {keep + 1} checkpoints of {trainable:,} trainable "
                                f"parameters at {STATE_BYTES} B and the export")
    return need, why
