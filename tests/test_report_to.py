"""run.report_to: TensorBoard and W&B (offline) receive the run file's scalars, rank 0 only; a
missing extra is one line before torch; a resumed run's logs show what its run file holds."""
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
import zlib

import h5py
import numpy as np
import pytest

from conftest import REPO, run_mpi
from hpc.job.config import JobConfig, RunConfig
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError
from hpc.runtime.report_to import TensorBoard, check_report_to, scalars
from hpc.runtime.runstore import RunStore, committed_rows


def run_file_scalars(path) -> dict:
    """``{(group/name, step): value}`` of every 0-d value of every committed row of a run
    file: what the reporters are to receive."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Group) and "step" in obj:
                n = committed_rows(obj)
                steps = obj["step"][:n]
                for key in obj:
                    if key != "step" and obj[key].ndim == 1:
                        for step, value in zip(steps, obj[key][:n]):
                            out[(f"{name}/{key}", int(step))] = value.item()
        f.visititems(visit)
    return out


def tensorboard_scalars(folder) -> dict:
    """``{(tag, step): value}`` as TensorBoard reads the event files of ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"]
            for e in events.Scalars(tag)}


def wandb_records(path) -> list:
    """The records of a W&B transaction log (``run-<id>.wandb``), parsed with W&B's own
    protobuf ``Record``. The file is the LevelDB log format behind a 7-byte W&B header:
    32 KiB blocks of chunks, each ``crc32 (4, LE; of the type byte and the data), length
    (2, LE), type (1: full, 2: first, 3: middle, 4: last)`` and its data; a block's last
    < 7 bytes are padding. Every chunk's checksum is verified."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, header, pos, parts, records = 32768, 7, 7, [], []
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        crc = int.from_bytes(data[pos:pos + 4], "little")
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero fill: the writer's end
            break
        chunk = data[pos + header:pos + header + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"chunk at {pos}"
        pos += header + length
        parts.append(chunk)
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def wandb_scalars(run_dir) -> dict:
    """``{(key, step): value}`` of the history rows of the W&B offline run in ``run_dir``."""
    (log,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = {}
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            step = row.pop("step")
            out.update({(key, step): value for key, value in row.items()
                        if not key.startswith("_")})
    return out


def same(a, b) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_report_to_is_a_list_of_known_targets():
    cfg = load_config(JobConfig, None, ["run.report_to=tensorboard,wandb"])
    assert cfg.run.report_to == ["tensorboard", "wandb"]
    assert RunConfig().report_to == ["none"]
    with pytest.raises(UserError, match="'mlflow' is not one of"):
        load_config(JobConfig, None, ["run.report_to=tensorboard,mlflow"])
    with pytest.raises(UserError, match="'none' cannot go with wandb"):
        check_report_to(["none", "wandb"])


def test_a_missing_extra_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    check_report_to(["tensorboard"])
    with pytest.raises(UserError) as err:
        check_report_to(["tensorboard", "wandb"])
    assert "pip install 'essa-hpc[wandb]'" in str(err.value)


@pytest.mark.subprocess
def test_a_job_names_a_missing_extra_before_torch(tmp_path):
    probe = ("import importlib.util, sys\nreal = importlib.util.find_spec\n"
             "importlib.util.find_spec = lambda n, *a: None if n == 'wandb' else real(n, *a)\n"
             "from sft.__main__ import main as sft\n"
             "try:\n    sft(sys.argv[1:])\nexcept SystemExit as stop:\n"
             "    print('TORCH', 'torch' in sys.modules, stop.code)\n")
    proc = subprocess.run([sys.executable, "-c", probe, "run.report_to=wandb",
                           f"run.out={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.strip() == "TORCH False 2", (proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.report_to" in lines[0] and "essa-hpc[wandb]" in lines[0]
    assert not (tmp_path / "run").exists()


def test_scalars_are_the_0d_numbers_of_a_row():
    row = scalars({"loss": np.float64(0.5), "n": np.int64(3), "ok": True,
                   "per_rank": np.zeros(2), "name": "x"})
    assert row == {"loss": 0.5, "n": 3, "ok": 1}


class Recorder:
    def __init__(self):
        self.rows, self.closed = [], None

    def add(self, group, step, values):
        self.rows.append((group, step, values))

    def flush(self):
        pass

    def close(self, status):
        self.closed = status


def test_the_store_reports_each_row_as_stored_and_replays_in_step_order(tmp_path):
    path = str(tmp_path / "run.h5")
    store = RunStore(path, True, {})
    store.reporters = [seen := Recorder()]
    store.log_step(1, metrics={"loss": 1.0, "extra": 2.0}, timings={"generate": np.ones(2)})
    store.log_step(2, metrics={"loss": 0.5})  # 'extra' missing: stored as NaN
    store.write_row("heldout", 2, accuracy=0.25)
    assert seen.rows[0] == ("metrics", 1, {"loss": 1.0, "extra": 2.0})
    group, step, values = seen.rows[1]
    assert (group, step, values["loss"]) == ("metrics", 2, 0.5) and math.isnan(values["extra"])
    assert seen.rows[2:] == [("heldout", 2, {"accuracy": 0.25})]  # no per-rank timings
    store.close("preempted")
    assert seen.closed == "preempted" and store.reporters == []
    again = RunStore(path, True, {}, resume=True)
    again.reporters = [replayed := Recorder()]
    again.truncate_after(1)
    again.replay()
    assert [(g, s) for g, s, _ in replayed.rows] == [("metrics", 1)]
    assert replayed.rows[0][2] == {"loss": 1.0, "extra": 2.0}
    again.close()


def test_a_resumed_tensorboard_shows_what_the_run_file_holds(tmp_path):
    """The killed job logged steps 1-3 and an evaluation at 3; the checkpoint was at step 2, so
    the run file keeps steps 1-2: the resumed job's TensorBoard must not show the lost rows."""
    path = str(tmp_path / "run.h5")
    store = RunStore(path, True, {})
    store.reporters = [TensorBoard(str(tmp_path), None)]
    for step in (1, 2, 3):
        store.log_step(step, metrics={"loss": 1.0 / step})
    store.write_row("eval", 3, accuracy=0.5)
    store.close("preempted")
    store = RunStore(path, True, {}, resume=True)
    store.reporters = [TensorBoard(str(tmp_path), 2)]
    store.truncate_after(2)
    store.replay()
    store.log_step(3, metrics={"loss": 0.3})
    store.close()
    expected = run_file_scalars(path)
    assert set(expected) == {("metrics/loss", s) for s in (1, 2, 3)}
    found = tensorboard_scalars(tmp_path / "tensorboard")
    assert found == {key: np.float32(value) for key, value in expected.items()}


@pytest.mark.mpi
def test_tensorboard_and_wandb_read_back_equal_to_the_run_file(tiny_models, tmp_path):
    """An SFT job on 2 ranks with both reporters: one event file and one offline W&B run (rank
    0's), holding every scalar of the run file at its step (TensorBoard: as float32)."""
    model = tiny_models["small"][0]
    out = tmp_path / "run"
    proc = run_mpi(2, ["-m", "sft", f"model.path={model}", "task.n_train=64",
                       "task.n_eval=8", "eval.n_samples=2", "eval.every=1", "sft.steps=3",
                       "sft.batch_size=8", "run.progress=false", f"run.out={out}",
                       "run.report_to=tensorboard,wandb"],
                   env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = run_file_scalars(out / "sft.h5")
    assert {key for key, _ in expected} >= {"metrics/loss", "heldout/accuracy",
                                            "eval/accuracy", "segments/world_size"}
    assert len(glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))) == 1
    board = tensorboard_scalars(out / "tensorboard")
    assert set(board) == set(expected)
    assert all(same(board[k], np.float32(v)) for k, v in expected.items()), board
    (run_dir,) = glob.glob(str(out / "wandb" / "offline-run-*"))
    logged = wandb_scalars(run_dir)
    assert set(logged) == set(expected)
    assert all(same(logged[k], v) for k, v in expected.items()), logged
    assert f"run.report_to=wandb: offline run in {run_dir}" in proc.stdout
