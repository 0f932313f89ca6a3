"""``hpc-data prepare``: the public math and instruction-following sets as they are distributed,
turned into the jsonl files the file tasks read (:mod:`hpc.data.mathdata`).

The source is a file (``.parquet``, ``.jsonl``, ``.json``), a folder of them, or a Hugging Face
Hub dataset id (``org/name``, ``org/name@revision``) found in the local cache as huggingface_hub
lays it out (``datasets--org--name/snapshots/<commit>/...``; nothing is downloaded: the error
names the ``hf download ... --repo-type dataset`` command). A folder's files are grouped by
split, the first word of a file's name or of a folder above it (``train-00000-of-00002.parquet``,
``data/test/...``; other names are their own split) and written in name order to
``<FOLDER>/<split>.jsonl``; ``.json`` files count only where the folder has no parquet or
jsonl file (beside those they are metadata, such as ``dataset_infos.json``); a folder whose
files lie in several subfolders (GSM8K's ``main`` and ``socratic``) needs ``--subset``.

Each row becomes the fields the task reads, matched case-insensitively, by the task's
``convert`` (:class:`hpc.data.mathdata.FileTask`):

* gsm8k: ``question``, ``answer`` (the worked solution ending in ``#### <number>``), as GSM8K
  ships them;
* math: ``problem`` or ``question``, and the worked ``solution`` (final answer in
  ``\\boxed{}``); where the row also has a short ``answer`` (MATH-500), the solution is
  written with ``The answer is: <answer>`` after it, so that ``answer`` is the gold; a row with
  only ``answer`` holds the worked solution there (PRM800K's files);
* aime, amc: ``problem`` or ``question``, ``answer`` (a number), ``solution`` where present;
* deepscaler, minerva, olympiadbench (short-answer sets, graded by math-verify): ``problem`` or
  ``question``; the gold from ``answer`` or ``final_answer`` (a list, as OlympiadBench ships
  it, is joined with ``", "``; the ``$`` delimiters of an answer are dropped); ``solution`` (a list
  joined by blank lines) where present, and the gold's source where no answer is. The field
  names are those of agentica-org/DeepScaleR-Preview-Dataset (``problem``, ``answer``,
  ``solution``), math-ai/minervamath (``question``, ``answer``; other copies ship ``problem``
  and a ``\\boxed{}`` ``solution``) and math-ai/olympiadbench or Hothan/OlympiadBench
  (``question``, ``final_answer``); since not every copy on the Hub names them alike, each
  variant above is accepted.
* ifeval: IFEval's ``prompt`` (``instruction`` in argilla/ifeval-like-data's unfiltered
  rows), ``instruction_id_list`` and ``kwargs`` (a list of dicts, or its JSON string as
  argilla/ifeval-like-data ships it), with each instruction's None arguments dropped (google/
  IFEval's rows name every argument of every instruction); ``key`` and ``response`` (an SFT
  solution) where present. Unknown instruction ids and arguments a checker refuses end the
  command with one line naming the row (:func:`hpc.data.ifeval.ifeval_fields`). The sets:
  google/IFEval (its ``ifeval_input_data.jsonl``, the 541 evaluation prompts) and the
  IFEval-like training set argilla/ifeval-like-data (``--subset filtered``: prompts with
  IFEval's instruction ids and a response lm-eval's checkers passed).

A preset then filters each split, printing what each filter removed: the task's own
(``FileTask.preset``) or the one ``--preset`` names (:data:`PRESETS`):

* ``deepscaler`` drops duplicates, a row whose question equals an earlier one's once every run
  of whitespace is one space and the ends are stripped (the first is kept, whatever its answer),
  then rows whose prompt is longer than 1024 tokens (``--max-prompt-tokens``; 0: no limit). A
  prompt is counted as a job of the same config feeds it to the model: ``task.prompt_format``
  rendered (the chat template of ``model.path`` with its system prompt, or the text template)
  and tokenized by ``model.path``'s tokenizer with its special tokens
  (:func:`prompt_lengths`).
* ``prm800k`` (``--preset prm800k``, task ``math``): PRM800K's problems for the ESSA paper's
  split. The source is github.com/openai/prm800k's ``prm800k/math_splits`` (``problem``,
  ``solution``, ``answer``) or its labelled solutions, ``prm800k/data/phase{1,2}_{train,test}
  .jsonl``, one row a labelled solution with the problem in a nested ``question``
  (``problem``, ``ground_truth_solution``, ``ground_truth_answer``; a missing solution is
  written as the boxed answer). A file is in the train split when its name holds ``train``,
  in the test split (MATH500, the validation set) when it holds ``test``; duplicates are
  dropped and so are training problems that are also test problems. The paper's 7,900
  training and 3,600 SFT problems are then ``task.n_train=11500`` and
  ``task.sft_split=3600`` (configs/paper/essa-prm800k-*.yaml).
"""
from __future__ import annotations

import json
import math
import os
import re

from hpc.data.mathdata import Preset, file_task, read_jsonl
from hpc.models.hub import local_or_cached
from hpc.runtime.atomic import write_bytes
from hpc.runtime.errors import UserError

SUFFIXES = (".parquet", ".jsonl", ".json")
SPLITS = ("train", "test", "validation", "valid", "dev")
_WORD = re.compile(r"[-_.]")

# the presets --preset names, in place of the task's own (FileTask.preset)
PRESETS = {"prm800k": Preset(dedup=True, task="math", word_splits=True,
                             drop_test_from_train=True)}


def _value(value):
    """A parquet or JSON value as plain JSON, nested values too: numpy arrays as lists (one
    of a single item too: IFEval's one-keyword lists), numpy scalars as Python numbers, NaN
    as None."""
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0:
        return [_value(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def read_rows(path: str) -> list:
    """The rows of one data file as dicts (keys lower-cased); UserError naming the file."""
    if path.endswith(".parquet"):
        import pandas

        try:
            records = pandas.read_parquet(path).to_dict("records")
        except Exception as err:  # noqa: BLE001 - pyarrow's errors: the file is not parquet
            raise UserError(f"cannot read the parquet file {path}: "
                            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                            ) from None
    elif path.endswith(".json") and _first_char(path) == "[":
        try:
            with open(path, encoding="utf-8-sig") as fh:
                records = json.load(fh)
        except (OSError, ValueError) as err:
            raise UserError(f"cannot read the JSON file {path}: {err}") from None
        if not all(isinstance(r, dict) for r in records):
            raise UserError(f"{path}: expected a JSON list of objects, one per row")
    else:
        records = [row for _, row in read_jsonl(path)]
    return [{str(k).lower(): _value(v) for k, v in r.items()} for r in records]


def _first_char(path: str) -> str:
    with open(path, encoding="utf-8-sig") as fh:
        return fh.read(4096).lstrip()[:1]


def task_row(task: str, row: dict, where: str) -> dict:
    """``row`` (keys lower-cased) as the fields task ``task`` reads (its ``convert``; the
    module docstring)."""
    return file_task(task).convert(row, where)


def preset_of(task: str, preset: str | None) -> Preset:
    """The preset :data:`PRESETS` names ``preset``, or task ``task``'s own where None;
    UserError for a name it does not know or a preset of another task."""
    if preset is None:
        return file_task(task).preset
    if preset not in PRESETS:
        raise UserError(f"hpc-data prepare: --preset {preset}: no such preset (presets: "
                        f"{', '.join(sorted(PRESETS))})")
    if PRESETS[preset].task not in ("", task):
        raise UserError(f"hpc-data prepare: --preset {preset} is for "
                        f"task.name={PRESETS[preset].task}, not {task}")
    return PRESETS[preset]


def split_of(relative: str) -> str:
    """The split of a data file at ``relative`` (its path below the source folder)."""
    parts = relative.split(os.sep)
    for part in [parts[-1]] + parts[-2::-1]:
        word = _WORD.split(part, 1)[0].lower()
        if word in SPLITS:
            return word
    return _WORD.split(parts[-1], 1)[0]


def data_files(root: str, subset: str | None) -> dict:
    """``{split: [file, ...]}`` of the folder ``root`` (``subset``: the subfolder to read)."""
    if subset:
        root = os.path.join(root, subset)
        if not os.path.isdir(root):
            raise UserError(f"hpc-data prepare: --subset {subset}: no folder {root}")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files)
                  if f.endswith(SUFFIXES) and not f.startswith(".")]
    if any(not f.endswith(".json") for f in found):  # .json beside them: metadata
        found = [f for f in found if not f.endswith(".json")]
    if not found:
        raise UserError(f"hpc-data prepare: {root} holds no {', '.join(SUFFIXES)} file")
    subsets = sorted({f.split(os.sep)[0] for f in found
                      if os.sep in f and f.split(os.sep)[0].lower() not in SPLITS})
    if len(subsets) > 1 and all(os.sep in f for f in found):
        raise UserError(f"hpc-data prepare: {root} holds the subsets {', '.join(subsets)}; "
                        f"choose one with --subset (for GSM8K: --subset main)")
    splits: dict = {}
    for relative in found:
        splits.setdefault(split_of(relative), []).append(os.path.join(root, relative))
    return splits


def prompt_lengths(questions: list, task: str, cfg) -> tuple:
    """(tokens of each question's prompt, how they were counted) as a job of config ``cfg``
    feeds the prompt to the model: ``cfg.task.prompt_format`` rendered (chat formats: the chat
    template of ``cfg.model.path`` with the format's system prompt or ``task.system_prompt``;
    text formats: the format's or task ``task``'s template) and tokenized by the tokenizer of
    ``cfg.model.path`` with its special tokens, as the decoder gets it. UserError (one line)
    when that tokenizer cannot be read."""
    from hpc.data.prompts import PROMPT_FORMATS, chat_messages  # torch: only when counting
    from hpc.models.chat import chat_tokenizer
    from hpc.models.loading import load_tokenizer, model_folder

    name = cfg.task.prompt_format
    fmt = PROMPT_FORMATS[name]
    how = f"task.prompt_format={name}, model.path={cfg.model.path}'s tokenizer"
    try:
        path = local_or_cached(cfg.model.path, "config key 'model.path'").path
        if fmt.chat:
            tokenizer = chat_tokenizer(path, name)
            system = cfg.task.system_prompt or fmt.system
            texts = [tokenizer.apply_chat_template(chat_messages(str(q), system),
                                                   tokenize=False, add_generation_prompt=True)
                     for q in questions]
        else:
            tokenizer = load_tokenizer(model_folder(path))
            template = fmt.template or file_task(task).template
            texts = [template.format(question=q) for q in questions]
    except UserError as err:
        raise UserError(f"hpc-data prepare: the prompt-length filter counts tokens with "
                        f"model.path's tokenizer ({err}); name the job's model (model.path= or "
                        f"its config) or give --max-prompt-tokens 0") from None
    return [len(ids) for ids in tokenizer(texts)["input_ids"]] if texts else [], how


def _question_key(row: dict) -> str:
    return " ".join(str(row["question"]).split())


def drop_duplicates(rows: list, seen: set | None = None) -> list:
    """``rows`` without those whose question repeats an earlier one's once whitespace runs are
    one space and the ends stripped (the first of each kept), nor one in ``seen`` (such
    keys)."""
    seen, kept = set(seen or ()), []
    for row in rows:
        key = _question_key(row)
        if key not in seen:
            seen.add(key)
            kept.append(row)
    return kept


def filter_rows(rows: list, task: str, cfg, max_prompt_tokens: int | None,
                preset: str | None = None, test_rows: list = ()) -> tuple:
    """(rows kept, report lines): preset ``preset`` (None: task ``task``'s) applied to one
    split's ``rows``; ``max_prompt_tokens``: None for the preset's, 0 for no limit; a limit
    needs the job config ``cfg`` (:func:`prompt_lengths`); ``test_rows``: the test split's
    rows, for a preset that drops training problems that are also test problems (only the
    train split's call passes them)."""
    preset = preset_of(task, preset)
    limit = preset.max_prompt_tokens if max_prompt_tokens is None else max_prompt_tokens
    lines = []
    if preset.dedup:
        kept = drop_duplicates(rows)
        lines.append(f"duplicates removed: {len(rows) - len(kept)} of {len(rows)} rows (the same "
                     f"question once whitespace is collapsed; the first kept)")
        rows = kept
    if preset.drop_test_from_train and test_rows:
        kept = drop_duplicates(rows, {_question_key(r) for r in test_rows})
        lines.append(f"test problems removed: {len(rows) - len(kept)} of {len(rows)} rows "
                     f"(the same question as a test split's once whitespace is collapsed)")
        rows = kept
    if limit:
        lengths, how = prompt_lengths([r["question"] for r in rows], task, cfg)
        kept = [r for r, n in zip(rows, lengths) if n <= limit]
        lines.append(f"prompts over {limit} tokens removed: {len(rows) - len(kept)} of "
                     f"{len(rows)} rows ({how})")
        rows = kept
    return rows, lines


def word_split(path: str) -> str:
    """A ``word_splits`` preset's split of a data file: train or test where its name (or a
    folder's above it) holds the word, else :func:`split_of`'s."""
    for word in ("train", "test"):
        if word in path.lower():
            return word
    return split_of(path)


def prepare(source: str, out_dir: str, task: str, subset: str | None = None, cfg=None,
            max_prompt_tokens: int | None = None, preset: str | None = None) -> list:
    """Write ``<out_dir>/<split>.jsonl`` for task ``task`` from ``source`` (a file, a folder or
    a Hub dataset id in the local cache), each split filtered by preset ``preset`` (None: the
    task's; :func:`filter_rows`; ``cfg``: the job config whose model and prompt format count
    prompt tokens); returns ``[(file written, rows, files read, filter report lines)]``."""
    chosen = preset_of(task, preset)
    path = local_or_cached(source, "hpc-data prepare", repo_type="dataset").path
    if os.path.isfile(path):
        splits = {split_of(os.path.basename(path)): [path]}
    elif os.path.isdir(path):
        splits = data_files(path, subset)
    else:
        raise UserError(f"hpc-data prepare: {source} is no file, folder or Hub dataset id")
    if chosen.word_splits:
        regrouped: dict = {}
        for files in splits.values():
            for file in files:
                regrouped.setdefault(word_split(os.path.relpath(file, path) if os.path.isdir(path)
                                                 else os.path.basename(file)),
                                     []).append(file)
        splits = {split: sorted(files) for split, files in regrouped.items()}
    converted = {}
    for split, files in splits.items():
        rows = []
        for file in files:
            rows += [task_row(task, row, f"{file} row {i}")
                     for i, row in enumerate(read_rows(file), 1)]
        converted[split] = (rows, files)
    test_rows = converted.get("test", ([], []))[0]
    filtered = {split: filter_rows(rows, task, cfg, max_prompt_tokens, preset,
                                   test_rows if split == "train" else ()) + (files,)
                for split, (rows, files) in converted.items()}
    written = []
    for split, (rows, lines, files) in sorted(filtered.items()):
        target = os.path.join(out_dir, f"{split}.jsonl")
        write_bytes(target, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                    for r in rows).encode("utf-8"))
        written.append((target, len(rows), files, lines))
    return written
