"""A job's inputs, checked before it imports torch (in about a second, on every rank alike):
``run.report_to``'s packages, the task's data files row by row, ``model.path`` (a built-in
model's name, or a folder with config.json, weights and tokenizer files) and ``lora.adapter``
(a peft adapter's folder). A mistake in any ends the job here, instead of after the imports, the toy build, the task and the
weights load, and before the run folder exists. :func:`hpc.runtime.cli.job_command` runs it."""
from __future__ import annotations

from hpc.data.mathdata import check_task_files
from hpc.models.folders import check_adapter_folder, check_model_folder
from hpc.runtime.config import BUILT_IN_MODEL_NAMES
from hpc.runtime.report_to import check_report_to


def check_inputs(cfg) -> None:
    """UserError (one line) for the first of ``cfg``'s inputs that a job could not use."""
    check_report_to(cfg.run.report_to)
    check_task_files(cfg)
    if cfg.model.path not in BUILT_IN_MODEL_NAMES:
        check_model_folder(cfg.model.path)
    adapter = getattr(getattr(cfg, "lora", None), "adapter", "")
    if adapter:
        check_adapter_folder(adapter)
