"""``hpc-data prepare``: the public math sets as they are distributed, turned into the jsonl files
the file tasks read (:mod:`hpc.data.mathdata`).

The source is a file (``.parquet``, ``.jsonl``, ``.json``), a folder of them, or a Hugging Face
Hub dataset id (``org/name``, ``org/name@revision``) found in the local cache as huggingface_hub
lays it out (``datasets--org--name/snapshots/<commit>/...``; nothing is downloaded: the error
names the ``hf download ... --repo-type dataset`` command). A folder's files are grouped by
split, the first word of a file's name or of a folder above it (``train-00000-of-00002.parquet``,
``data/test/...``; other names are their own split) and written in name order to
``<FOLDER>/<split>.jsonl``; ``.json`` files count only where the folder has no parquet or
jsonl file (beside those they are metadata, such as ``dataset_infos.json``); a folder whose
files lie in several subfolders (GSM8K's ``main`` and ``socratic``) needs ``--subset``.

Each row becomes the fields the task reads, matched case-insensitively:

* gsm8k: ``question``, ``answer`` (the worked solution ending in ``#### <number>``), as GSM8K
  ships them;
* math: ``problem`` or ``question``, and the worked ``solution`` (final answer in
  ``\\boxed{}``); where the row also has a short ``answer`` (MATH-500), the solution is
  written with ``The answer is: <answer>`` after it, so that ``answer`` is the gold; a row with
  only ``answer`` holds the worked solution there (PRM800K's files);
* aime, amc: ``problem`` or ``question``, ``answer`` (a number), ``solution`` where present.
"""
from __future__ import annotations

import json
import math
import os
import re

from hpc.data.mathdata import read_jsonl
from hpc.models.hub import local_or_cached
from hpc.runtime.atomic import write_bytes
from hpc.runtime.errors import UserError

SUFFIXES = (".parquet", ".jsonl", ".json")
SPLITS = ("train", "test", "validation", "valid", "dev")
_WORD = re.compile(r"[-_.]")


def _value(value):
    """A parquet or JSON value as plain JSON: numpy scalars as Python numbers, NaN as None."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, AttributeError):  # an array: left for the field check to name
            return value
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


def _pick(row: dict, names: tuple, where: str):
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    raise UserError(f"{where}: no field {' or '.join(map(repr, names))} (its fields: "
                    f"{', '.join(sorted(row))[:200]})")


def task_row(task: str, row: dict, where: str) -> dict:
    """``row`` (keys lower-cased) as the fields task ``task`` reads (see the module)."""
    question = _pick(row, ("question", "problem"), where)
    if task == "gsm8k":
        return {"question": question, "answer": _pick(row, ("answer",), where)}
    if task == "math":
        if row.get("solution") not in (None, ""):
            solution, gold = row["solution"], row.get("answer")
            if gold not in (None, "") and "The answer is:" not in str(solution):
                solution = f"{str(solution).rstrip()}\nThe answer is: {gold}"
            return {"question": question, "solution": solution}
        return {"question": question, "solution": _pick(row, ("answer",), where)}
    out = {"question": question, "answer": _pick(row, ("answer",), where)}
    if row.get("solution") not in (None, ""):
        out["solution"] = row["solution"]
    return out


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


def prepare(source: str, out_dir: str, task: str, subset: str | None = None) -> list:
    """Write ``<out_dir>/<split>.jsonl`` for task ``task`` from ``source`` (a file, a folder or
    a Hub dataset id in the local cache); returns ``[(file written, rows, files read)]``."""
    path = local_or_cached(source, "hpc-data prepare", repo_type="dataset").path
    if os.path.isfile(path):
        splits = {split_of(os.path.basename(path)): [path]}
    elif os.path.isdir(path):
        splits = data_files(path, subset)
    else:
        raise UserError(f"hpc-data prepare: {source} is no file, folder or Hub dataset id")
    converted = {}
    for split, files in splits.items():
        rows = []
        for file in files:
            rows += [task_row(task, row, f"{file} row {i}")
                     for i, row in enumerate(read_rows(file), 1)]
        converted[split] = (rows, files)
    written = []
    for split, (rows, files) in sorted(converted.items()):
        target = os.path.join(out_dir, f"{split}.jsonl")
        write_bytes(target, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                    for r in rows).encode("utf-8"))
        written.append((target, len(rows), files))
    return written
