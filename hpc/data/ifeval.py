"""The ``ifeval`` task (:data:`IFEVAL`): its rows and reward, IFEval's instruction checkers as
lm-eval maintains them.

A row (``hpc-data prepare`` writes them from google/IFEval or an IFEval-like set) is IFEval's:
``prompt``, ``instruction_id_list`` and ``kwargs`` (one dict per instruction; a JSON string of
the list is read too), optional ``response`` (an SFT solution, as argilla/ifeval-like-data ships).
The gold is the JSON of the three; the reward of a completion is the share of its instructions
followed, by IFEval's strict or loose test (``task.ifeval_check``), so a completion that follows
all of them scores 1.0 and pass@k is IFEval's prompt-level accuracy.

The checkers are lm-eval's (the extra ``ifeval``: ``lm-eval[ifeval]``, which brings langdetect,
immutabledict and nltk): ``lm_eval/tasks/ifeval/instructions*.py`` and its ``utils.py``, whose
``test_instruction_following_strict`` and ``_loose`` the reward calls, not a rewrite of them.
Importing them as ``lm_eval.tasks.ifeval`` the usual way first runs ``lm_eval/tasks/__init__``,
the harness's task manager, which imports datasets and the harness's task machinery (1.6 s
more on every rank on 2 CPU cores); so the folder is registered alone as the package
``lm_eval.tasks.ifeval`` and its modules are imported from it under their own names
(:func:`checkers`). pip installs the harness's own dependencies with it (datasets, evaluate,
scikit-learn and more: an extra cannot leave a package's requirements out); none is imported.

NLTK data: two instructions (:data:`NEEDS_PUNKT`) split text with NLTK's ``punkt_tab``
tokenizer data, which nltk does not ship. lm-eval's ``instructions_util`` downloads it at import
when it is missing; a job downloads nothing, so the import runs with ``nltk.download`` a no-op
(and its print silenced), and a task whose problems use those instructions is refused at load
(:func:`require_nltk_data`, one line, exit 2) when NLTK cannot find the data: fetch it once on a
machine with network, ``python -m nltk.downloader -d DIR punkt_tab``, and set ``NLTK_DATA=DIR``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import sys

from hpc.data.mathdata import FileTask, row_field
from hpc.runtime.errors import UserError

IFEVAL_TEMPLATE = "{question}\n"
# the instructions whose checkers read NLTK's punkt_tab data: count_sentences and word_tokenize
NEEDS_PUNKT = ("length_constraints:number_sentences", "change_case:capital_word_frequency")
PUNKT = "tokenizers/punkt_tab/english/"


@functools.lru_cache(maxsize=1)
def checkers():
    """lm-eval's ``lm_eval.tasks.ifeval.utils`` (its registry and checkers imported with it);
    UserError naming the extra when lm-eval is not installed."""
    spec = importlib.util.find_spec("lm_eval")
    folder = spec and os.path.join(os.path.dirname(spec.origin), "tasks", "ifeval")
    if not folder or not os.path.isfile(os.path.join(folder, "instructions_registry.py")):
        raise UserError("task.name=ifeval needs lm-eval's IFEval checkers: pip install "
                        "'essa-hpc[ifeval]' (or 'lm-eval[ifeval]')")
    name = "lm_eval.tasks.ifeval"
    if name not in sys.modules:
        package = importlib.machinery.ModuleSpec(name, None, is_package=True)
        package.submodule_search_locations = [folder]
        sys.modules[name] = importlib.util.module_from_spec(package)
    from unittest import mock

    import langdetect
    import nltk

    with mock.patch.object(nltk, "download", lambda *a, **k: False), \
            contextlib.redirect_stdout(io.StringIO()):
        utils = importlib.import_module(f"{name}.utils")
    langdetect.DetectorFactory.seed = 0  # language:response_language: the same on every rank
    return utils


def nltk_data_found() -> bool:
    """Whether NLTK finds the ``punkt_tab`` English data (NLTK_DATA or its default folders)."""
    import nltk

    try:
        nltk.data.find(PUNKT)
    except LookupError:
        return False
    return True


def require_nltk_data(instruction_ids: set, where: str) -> None:
    """UserError (one line) when ``instruction_ids`` (those of ``where``'s problems) hold one of
    :data:`NEEDS_PUNKT` and NLTK cannot find ``punkt_tab``."""
    needing = sorted(set(instruction_ids) & set(NEEDS_PUNKT))
    if needing and not nltk_data_found():
        raise UserError(f"{where}: the IFEval instructions {', '.join(needing)} need NLTK's "
                        f"punkt_tab data, which NLTK does not find (NLTK_DATA="
                        f"{os.environ.get('NLTK_DATA', '')!r}); on a machine with network run "
                        f"'python -m nltk.downloader -d DIR punkt_tab', then export NLTK_DATA=DIR")


def _kwargs(value, count: int, where: str) -> list:
    """A row's ``kwargs``: one dict per instruction, None values dropped (IFEval's files hold
    every argument name of every instruction, most None)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"{where}: 'kwargs' is not JSON") from None
    if not isinstance(value, (list, tuple)) or len(value) != count or not all(
            isinstance(k, dict) for k in value):
        raise UserError(f"{where}: 'kwargs' must be a list of {count} objects, one per "
                        f"instruction")
    return [{k: v for k, v in k_.items() if v is not None} for k_ in value]


def ifeval_fields(row: dict, where: str) -> dict:
    """``prompt``, ``instruction_id_list`` and ``kwargs`` of an IFEval row (keys as
    :func:`hpc.data.prepare.read_rows` gives them), checked: known instruction ids, kwargs that
    their checkers take. UserError naming ``where``."""
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"{where}: no string field 'prompt'")
    ids = row.get("instruction_id_list")
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, str) for i in ids):
        raise UserError(f"{where}: 'instruction_id_list' must be a list of instruction ids")
    kwargs = _kwargs(row.get("kwargs"), len(ids), where)
    registry = checkers().instructions_registry.INSTRUCTION_DICT
    for instruction, arguments in zip(ids, kwargs):
        if instruction not in registry:
            raise UserError(f"{where}: {instruction!r} is not an IFEval instruction id")
        try:
            registry[instruction](instruction).build_description(
                **{k: v for k, v in arguments.items() if v})
        except Exception as err:  # noqa: BLE001 - a checker's own complaint about its arguments
            raise UserError(f"{where}: {instruction} does not take the arguments {arguments} "
                            f"({type(err).__name__}: {err})") from None
    return {"prompt": prompt, "instruction_id_list": list(ids), "kwargs": kwargs}


def ifeval_row(row: dict, path: str, number: int):
    """(question, template, gold, SFT solution) of a jsonl row of the ifeval task; the gold is
    the JSON of :func:`ifeval_fields`, the solution the row's ``response`` if any."""
    fields = ifeval_fields(row, f"{path} line {number}")
    response = row.get("response")
    solution = f" {response.strip()}" if isinstance(response, str) and response.strip() else ""
    return fields["prompt"], IFEVAL_TEMPLATE, json.dumps(fields, sort_keys=True), solution


@functools.lru_cache(maxsize=4096)
def _example(gold: str):
    fields = json.loads(gold)
    return checkers().InputExample(key=0, **fields)


def _followed(test, example, completion: str) -> list:
    """Each instruction followed or not; a checker that raises on this completion counts as
    not followed (the others still count)."""
    try:
        return test(example, completion).follow_instruction_list
    except Exception:  # noqa: BLE001 - a reward never raises on a completion
        followed = []
        for i, instruction in enumerate(example.instruction_id_list):
            one = checkers().InputExample(key=0, instruction_id_list=[instruction],
                                          prompt=example.prompt, kwargs=[example.kwargs[i]])
            try:
                followed += test(one, completion).follow_instruction_list
            except Exception:  # noqa: BLE001
                followed.append(False)
        return followed


def ifeval_reward(completion: str, gold: str, check: str = "strict") -> float:
    """The share of the instructions of ``gold`` (:func:`ifeval_row`'s JSON) that ``completion``
    follows, by IFEval's ``strict`` or ``loose`` test (lm-eval's)."""
    utils = checkers()
    test = (utils.test_instruction_following_strict if check == "strict"
            else utils.test_instruction_following_loose)
    followed = _followed(test, _example(gold), str(completion))
    return sum(followed) / len(followed) if followed else 0.0


def ifeval_prepared_row(row: dict, where: str) -> dict:
    """An IFEval row as ``hpc-data prepare`` writes it: ``key`` where present, the checked
    fields of :func:`ifeval_fields` (the prompt from ``prompt`` or, in argilla/ifeval-like-data's
    unfiltered rows, ``instruction``) and ``response`` where present."""
    prompt = row_field(row, ("prompt", "instruction"), where)
    out = {"key": row["key"]} if row.get("key") is not None else {}
    out.update(ifeval_fields({**row, "prompt": prompt}, where))
    if row.get("response") not in (None, ""):
        out["response"] = row["response"]
    return out


class IfevalTask(FileTask):
    """The ifeval file task: its reward follows ``task.ifeval_check``, and its problems are
    refused at load where their instructions need NLTK data that NLTK does not find."""

    def job_reward(self, cfg, splits: tuple):
        """IFEval's ``cfg.ifeval_check`` test; UserError (one line) where ``splits`` hold an
        instruction that needs NLTK's punkt_tab data and NLTK does not find it."""
        paths = ", ".join(filter(None, (cfg.train_path, cfg.eval_path)))
        require_nltk_data({i for split in splits for gold in split.answers
                           for i in json.loads(gold)["instruction_id_list"]},
                          f"task.name=ifeval ({paths})")
        return functools.partial(ifeval_reward, check=cfg.ifeval_check)


IFEVAL = IfevalTask(ifeval_row, ifeval_reward, IFEVAL_TEMPLATE, ifeval_prepared_row,
                    graded=False)
