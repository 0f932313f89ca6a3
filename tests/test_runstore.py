"""HDF5 run store: schema, padding, truncation on resume, survival of SIGKILL, and of a disk
that fills while rows are written."""
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from conftest import REPO, require
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile, RunStore

WRITER = """
import sys, time
import numpy as np
from hpc.runtime.runstore import RunStore
store = RunStore(sys.argv[1], active=True, attrs={"method": "test", "world_size": 2})
for step in range(100000):
    store.log_step(step, metrics={"reward": step * 0.5},
                   timings={"generate": np.array([0.1, 0.2]) * step}, nbytes={"fitness": 64})
    print(step, flush=True)
    time.sleep(0.01)
"""


def test_rows_padding_and_reader(tmp_path):
    path = str(tmp_path / "run.h5")
    store = RunStore(path, active=True, attrs={"method": "essa", "config": "a: 1"})
    store.log_step(0, metrics={"reward": 0.25}, timings={"gen": np.array([1.0, 2.0])},
                   nbytes={"fitness": 128})
    store.log_step(1, metrics={"reward": 0.5, "accuracy": 0.75},
                   timings={"gen": np.array([1.5, 2.5])}, nbytes={"fitness": 128})
    store.write_row("essa", 1, fitness=np.array([0.1, 0.2, 0.3]), evaluated_by=np.array([0, 0, 1]))
    store.close()
    run = RunFile(path)
    assert run.attrs["status"] == "complete" and run.attrs["method"] == "essa"
    m = run.group("metrics")
    assert m["step"].tolist() == [0, 1]
    assert m["reward"].tolist() == [0.25, 0.5]
    assert np.isnan(m["accuracy"][0]) and m["accuracy"][1] == 0.75
    assert run.group("timings")["gen"].shape == (2, 2)
    assert run.group("bytes")["fitness"].dtype == np.int64
    assert run.group("essa")["fitness"].shape == (1, 3)
    df = run.frame()
    assert list(df["reward"]) == [0.25, 0.5]
    tf = run.timings_frame()
    assert len(tf) == 4 and set(tf["rank"]) == {0, 1}


def test_inactive_rank_writes_nothing(tmp_path):
    path = str(tmp_path / "run.h5")
    store = RunStore(path, active=False)
    store.log_step(0, metrics={"x": 1.0})
    store.close()
    assert not os.path.exists(path)


def test_truncate_after_for_resume(tmp_path):
    path = str(tmp_path / "run.h5")
    store = RunStore(path, active=True)
    for step in range(5):
        store.log_step(step, metrics={"x": float(step)}, nbytes={"b": step})
    store.close("preempted")
    store = RunStore(path, active=True, resume=True)
    store.truncate_after(2)
    store.log_step(3, metrics={"x": 30.0}, nbytes={"b": 3})
    store.close()
    m = RunFile(path).group("metrics")
    assert m["step"].tolist() == [0, 1, 2, 3] and m["x"].tolist() == [0, 1, 2, 30]


@pytest.mark.subprocess
def test_sigkill_leaves_readable_file(tmp_path):
    path = str(tmp_path / "killed.h5")
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE,
                            text=True, env=env)
    last = -1
    deadline = time.time() + 60
    while last < 20 and time.time() < deadline:
        last = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last >= 20
    with h5py.File(path, "r") as f:
        steps = f["metrics/step"][:]
        assert f.attrs["status"] == "running"
    # every step printed (hence flushed) before the kill is in the file, in order
    assert steps[: last + 1].tolist() == list(range(last + 1))
    run = RunFile(path)
    assert run.group("timings")["generate"].shape[1] == 2
    h5dump = shutil.which("h5dump")
    require(h5dump is not None, "h5dump (Debian package hdf5-tools)")
    out = subprocess.run([h5dump, "-d", "/metrics/step", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"({last})" in out.stdout or f", {last}" in out.stdout or f" {last}\n" in out.stdout


FILLER = """
import sys
import numpy as np
from hpc.runtime.errors import user_errors_exit
from hpc.runtime.runstore import RunStore


@user_errors_exit
def main(path, seed, copy_path):
    # rows of random widths, new groups and long attributes until the disk is full; the
    # file's bytes after step 3 go to copy_path (on another disk), as into a checkpoint
    rng = np.random.default_rng(seed)
    store = RunStore(path, active=True, attrs={"config": "x" * int(rng.integers(10, 5000))})
    width = int(rng.integers(1, 1000))
    for step in range(1, 100000):
        store.log_step(step, metrics={"reward": 0.5}, timings={"generate": np.ones(2)})
        store.write_row("essa", step, fitness=rng.random(width))
        if rng.random() < 0.05:
            store.write_row(f"extra{step}", step, x=rng.random(int(rng.integers(1, 500))))
        if rng.random() < 0.05:
            store.set_attrs(**{f"note{step}": "z" * int(rng.integers(1, 3000))})
        if step == 3:
            with open(copy_path, "wb") as fh:
                fh.write(store.snapshot())


main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
"""


@pytest.mark.subprocess
def test_disk_full_while_writing_rows_then_resume(tmp_path, capsys):
    """A run file on a 2 MiB tmpfs that a 1 MiB file half fills: each seed's writer ends with
    one line and exit 2 when the disk is full (whatever HDF5 was writing), no traceback. After
    the space is freed, a resume with the step-3 copy gets a readable file with steps 1..3,
    whether the failed write left the file damaged (then it is restored) or not."""
    from conftest import our_lines

    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    require(mounted, "mounting a tmpfs (root)")
    env = dict(os.environ, PYTHONPATH=REPO)
    restored = 0
    try:
        for seed in range(4, 10):
            path, copy_path = str(disk / "run.h5"), str(tmp_path / f"copy-{seed}.h5")
            (disk / "filler").write_bytes(b"\0" * 2 ** 20)
            proc = subprocess.run([sys.executable, "-c", FILLER, path, str(seed), copy_path],
                                  capture_output=True, text=True, env=env, timeout=120)
            assert proc.returncode == 2, proc.stderr[-2000:]
            lines = our_lines(proc.stderr)
            assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
            assert lines[0].startswith(f"error (rank 0): cannot write the run file {path}: "
                                       f"No space left on device; free space, then rerun")
            (disk / "filler").unlink()
            with open(copy_path, "rb") as fh:
                store = RunStore(path, active=True, resume=True, backup=fh.read())
            restored += "restored from the checkpoint" in capsys.readouterr().err
            store.truncate_after(3)
            store.close()
            assert RunFile(path).group("metrics")["step"].tolist() == [1, 2, 3]
            os.remove(path)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    assert restored >= 1  # seeds 6 and 7 leave a damaged file (h5py 3.16, HDF5 2.0)


def _run_with_copy(path: str) -> bytes:
    store = RunStore(path, active=True, attrs={"method": "essa"})
    for step in range(1, 4):
        store.log_step(step, metrics={"x": float(step)})
    copy = store.snapshot()
    store.log_step(4, metrics={"x": 4.0})
    store.close("preempted")
    return copy


def test_resume_restores_a_damaged_run_file_from_the_checkpoint_copy(tmp_path, capsys):
    path = str(tmp_path / "run.h5")
    copy = _run_with_copy(path)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
    store = RunStore(path, active=True, resume=True, backup=copy)
    store.truncate_after(3)
    store.log_step(4, metrics={"x": 40.0})
    store.close()
    assert capsys.readouterr().err == (f"warning: the run file {path} was damaged; restored "
                                       f"from the checkpoint\n")
    run = RunFile(path)
    assert run.group("metrics")["x"].tolist() == [1.0, 2.0, 3.0, 40.0]
    assert run.attrs["method"] == "essa" and run.attrs["status"] == "complete"


def test_resume_restores_a_missing_run_file_and_refuses_a_damaged_one_without_copy(tmp_path,
                                                                                   capsys):
    path = str(tmp_path / "run.h5")
    copy = _run_with_copy(path)
    RunStore(path, active=True, resume=True, backup=copy).close()  # readable: the copy, quietly
    assert RunFile(path).group("metrics")["step"].tolist() == [1, 2, 3]
    os.remove(path)
    RunStore(path, active=True, resume=True, backup=copy).close()
    assert RunFile(path).group("metrics")["step"].tolist() == [1, 2, 3]
    assert capsys.readouterr().err == (f"warning: the run file {path} was missing; restored "
                                       f"from the checkpoint\n")
    with open(path, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(UserError, match="run.h5 is damaged and there is no copy of it in a "
                                        "checkpoint; move it away"):
        RunStore(path, active=True, resume=True)
    os.remove(path)
    RunStore(path, active=True, resume=True).close()  # no file, no copy: a new file
    assert RunFile(path).group("metrics") == {}


def test_truncate_after_stops_at_the_first_later_step(tmp_path):
    """A row a failed write left with the fill value (step 0) after a later step is dropped
    with it."""
    path = str(tmp_path / "run.h5")
    store = RunStore(path, active=True)
    for step in (1, 2, 3):
        store.log_step(step, metrics={"x": float(step)})
    store.file["metrics/step"].resize(4, axis=0)  # a 4th row whose step was never written: 0
    store.truncate_after(2)
    store.close()
    assert RunFile(path).group("metrics")["step"].tolist() == [1, 2]


def test_a_row_written_but_not_committed_is_not_read(tmp_path):
    """Readers stop at the committed length: a row whose datasets are on disk in part (here:
    flushed before the commit, as a reader may catch the writer) is not read."""
    path = str(tmp_path / "run.h5")
    store = RunStore(path, active=True, attrs={"method": "essa"})
    store.log_step(1, metrics={"reward": 0.5, "loss": 1.0})
    store.write_row("metrics", 2, flush=False, reward=0.75)  # "loss" padded, not committed
    store.file.flush()
    seen = str(tmp_path / "seen.h5")  # what another process reads now (HDF5 opens a file once
    shutil.copy(path, seen)           # a process)
    run = RunFile(seen)
    assert run.group("metrics")["step"].tolist() == [1]
    assert run.group("metrics")["reward"].tolist() == [0.5]
    store.log_step(3, metrics={"reward": 1.0})
    shutil.copy(path, seen)
    assert RunFile(seen).group("metrics")["step"].tolist() == [1, 2, 3]
    store.close()


READ_WHILE_WRITING = """
import sys
import numpy as np
from hpc.runtime.runstore import RunStore
store = RunStore(sys.argv[1], active=True, attrs={"method": "test", "world_size": 2})
for step in range(1, 100000):
    store.log_step(step, metrics={f"m{k}": step for k in range(12)},
                   timings={"generate": np.full(2, step)}, nbytes={"fitness": step})
    print(step, flush=True)
"""


@pytest.mark.subprocess
def test_readers_during_a_run_see_whole_rows(tmp_path):
    """h5py readers (RunFile, as hpc-report reads) while a writer appends rows as fast as it
    can: every read that succeeds holds whole rows only (every column as long as ``step``,
    every value of row i equal to its step); a read may fail (no SWMR), never be torn."""
    path = str(tmp_path / "live.h5")
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", READ_WHILE_WRITING, path],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert int(proc.stdout.readline()) == 1
        reads, torn = 0, []
        deadline = time.time() + 120
        while reads < 300 and time.time() < deadline:
            try:
                run = RunFile(path)
            except (OSError, KeyError, RuntimeError, ValueError):
                continue
            reads += 1
            for name in ("metrics", "timings", "bytes"):
                group = run.group(name)
                if not group:
                    continue
                steps = group["step"]
                for column, values in group.items():
                    rows = values.reshape(len(values), -1)
                    if len(values) != len(steps) or not (rows == steps[:, None]).all():
                        torn.append((reads, name, column, len(steps), len(values)))
    finally:
        proc.kill()
        proc.wait()
    assert reads >= 100
    assert not torn, torn[:5]
