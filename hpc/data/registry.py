"""The tasks ``task.name`` names: a plain-dict registry of where each task's loader lives.

A task is one file plus one line in :data:`TASKS`. The file defines the task's *loader*, a
callable ``load(task_cfg) -> hpc.data.split.Task`` that builds its problems (prompts, gold
answers, SFT solutions, bare questions; both splits) and its reward from the job's ``task``
section (:class:`hpc.data.config.TaskConfig`). A task read from jsonl files is a
:class:`hpc.data.mathdata.FileTask`: a loader that also says how ``hpc-data prepare`` converts a
public set's rows, filters them and how ``hpc-data check`` grades them.

The registry holds import strings, so naming a task imports nothing: this module loads without
torch, and ``task.name``'s choices are this dict, read when a value is checked (a task
registered from outside the package is added before the job reads its config, docs/data.md).
"""
from __future__ import annotations

from hpc.runtime.errors import UserError
from hpc.runtime.methods import load_ref

# task.name -> "module:loader"
TASKS = {
    "arith": "hpc.data.tasks:load_arith",
    "wordprob": "hpc.data.tasks:load_wordprob",
    "gsm8k": "hpc.data.mathdata:GSM8K",
    "math": "hpc.data.mathdata:MATH",
    "aime": "hpc.data.mathdata:AIME",
    "amc": "hpc.data.mathdata:AMC",
    "deepscaler": "hpc.data.mathdata:DEEPSCALER",
    "minerva": "hpc.data.mathdata:MINERVA",
    "olympiadbench": "hpc.data.mathdata:OLYMPIADBENCH",
    "ifeval": "hpc.data.ifeval:IFEVAL",
}


def task_loader(name: str):
    """The loader of task ``name`` (its :data:`TASKS` entry imported); UserError naming the
    tasks when there is none."""
    if name not in TASKS:
        raise UserError(f"config key 'task.name': {name!r} is not a task ({', '.join(TASKS)})")
    return load_ref(TASKS[name])
