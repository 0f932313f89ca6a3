"""HDF5 run store: schema, padding, truncation on resume, and survival of SIGKILL."""
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

from conftest import REPO, require
from hpc.runstore import RunFile, RunStore

WRITER = """
import sys, time
import numpy as np
from hpc.runstore import RunStore
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
