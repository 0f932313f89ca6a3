"""Run folders and checkpoints under real mpirun: no code from a checkpoint, one job per folder,
no silent fresh start on a mistyped --resume."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import MPI_ENV, REPO, mpirun_path, our_lines, placeholder_adapter, require, run_mpi
from hpc.runtime.checkpoint import list_checkpoints, load_latest, save_checkpoint
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile
from test_faults import _rows, essa_args


class RunsCode:
    """Unpickling this creates the folder ``marker``: what a planted checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant_pickle(path, marker):
    """A checkpoint of the earlier (torch.save) format whose loading runs code, with its hash."""
    torch.save({"generation": 1, "optimizer": RunsCode(str(marker))}, path)
    digest = subprocess.run(["sha256sum", path], capture_output=True, text=True).stdout.split()[0]
    with open(str(path)[:-len(os.path.splitext(str(path))[1])] + ".sha256", "w") as fh:
        fh.write(digest)


def one_error_line(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(toy_adapter, tmp_path_factory):
    """A finished 1-generation ESSA run on 2 ranks, with its checkpoint (each test copies it)."""
    out = tmp_path_factory.mktemp("essa-1") / "run"
    proc = run_mpi(2, essa_args(toy_adapter, out, 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("finished_run")  # one worker runs it once
def test_a_planted_pickle_checkpoint_runs_no_code(finished_run, toy_adapter, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    ckpts = out / "checkpoints"
    for path in list_checkpoints(str(ckpts)):
        os.remove(path)
    marker = tmp_path / "code-ran"
    plant_pickle(ckpts / "step-00000001.pt", marker)
    proc = run_mpi(2, essa_args(toy_adapter, out, 2) + ["--resume"])
    one_error_line(proc, "earlier version", "cannot resume")
    assert not marker.exists()
    assert RunFile(str(out / "essa.h5")).group("essa")["step"].tolist() == [1]


@pytest.mark.subprocess
def test_a_pickle_under_the_new_name_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    plant_pickle(tmp_path / "step-00000001.safetensors", marker)
    with pytest.raises(UserError, match="not one this program wrote"):
        load_latest(str(tmp_path))
    assert not marker.exists()


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("finished_run")  # one worker runs it once
def test_a_checkpoint_with_missing_keys_is_one_line(finished_run, toy_adapter, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    ckpts = str(out / "checkpoints")
    for path in list_checkpoints(ckpts):
        os.remove(path)
    save_checkpoint(ckpts, 1, {"step": 1, "elapsed_s": 0.0})  # no "method" state in it
    proc = run_mpi(2, essa_args(toy_adapter, out, 2) + ["--resume"])
    one_error_line(proc, "has no entry 'method'")


# A job's entry point in a child Python that reports, as it exits, whether torch was imported.
BEFORE_TORCH = ("import sys\nfrom essa.__main__ import main\n"
                "try:\n    main(sys.argv[1:])\nexcept SystemExit as stop:\n"
                "    print('TORCH', 'torch' in sys.modules, stop.code, flush=True)\n"
                "    raise\n")


@pytest.mark.mpi
def test_resume_of_a_missing_run_is_an_error(tmp_path):
    """One line, before torch is imported (hpc.job.run_folder.check_run_folder)."""
    adapter = placeholder_adapter(tmp_path / "adapter")
    out = tmp_path / "typo"
    args = ["-c", BEFORE_TORCH] + essa_args(adapter, out, 1)[2:] + ["--resume"]
    proc = run_mpi(2, args)
    one_error_line(proc, "--resume", "no run folder")
    assert before_torch(proc)
    assert not out.exists()
    out.mkdir()
    proc = run_mpi(2, args)
    one_error_line(proc, "--resume", "holds no essa run")
    assert before_torch(proc)
    assert os.listdir(out) == []


def before_torch(proc, ranks=2) -> bool:
    """Whether every one of the ``ranks`` ranks reported that it exited 2 before importing
    torch (each leaves by itself: the launcher kills none of them)."""
    reports = [line for line in proc.stdout.splitlines() if line.startswith("TORCH ")]
    return reports == ["TORCH False 2"] * ranks


# Around each rank, a shell that writes the rank's exit code to RANK_CODES/rank-<rank> as the
# rank ends. The shell ignores SIGTERM, as a job's ranks do once they leave, so a rank the
# launcher ends (mpirun SIGKILLs the others 0.5 s after a rank exits non-zero) leaves no file.
EXIT_CODE_SHELL = ('trap "" TERM; "$@"; code=$?; '
                   'echo $code > "$RANK_CODES/rank-$OMPI_COMM_WORLD_RANK"; exit $code')


def run_mpi_exit_codes(n: int, args: list, codes) -> tuple:
    """``python args...`` on ``n`` ranks under the real mpirun, each inside EXIT_CODE_SHELL:
    (CompletedProcess, {rank: exit code} of the ranks that ended by themselves)."""
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    codes.mkdir()
    proc = subprocess.run([mpirun, "-n", str(n), "--oversubscribe", "sh", "-c",
                           EXIT_CODE_SHELL, "sh", sys.executable] + list(args),
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, **MPI_ENV, RANK_CODES=str(codes)))
    return proc, {int(p.name.split("-")[1]): int(p.read_text()) for p in codes.iterdir()}


def _entries(folder) -> dict:
    """{name: kind} of everything under ``folder``."""
    kinds = {}
    for path in sorted(folder.rglob("*")):
        kinds[str(path.relative_to(folder))] = ("link" if path.is_symlink() else "folder"
                                                if path.is_dir() else "file" if
                                                path.is_file() else "special")
    return kinds


# The run-folder mistakes answered before torch is imported (hpc.job.run_folder), and a config
# value out of range (answered before them): (plant in the run folder, words of the line).
PRE_TORCH_REFUSALS = {
    "checkpoints a file": (lambda out: (out / "checkpoints").write_text(""),
                           ("checkpoints is not a folder",)),
    ".lock a folder": (lambda out: (out / ".lock").mkdir(), (".lock is not a plain file",)),
    ".lock a FIFO": (lambda out: os.mkfifo(out / ".lock"), (".lock is not a plain file",)),
    "run file a folder": (lambda out: (out / "fgrpo.h5").mkdir(),
                          ("fgrpo.h5 is not a plain file",)),
    "resume of an empty folder": (lambda out: None, ("--resume", "holds no fgrpo run")),
    "config value out of range": (lambda out: None, ("fgrpo.sampling.num_generations",)),
}


@pytest.mark.parametrize("case", list(PRE_TORCH_REFUSALS))
@pytest.mark.mpi
def test_a_refusal_before_torch_exits_2_on_every_rank(tmp_path, case):
    """docs/faults.md: a user error ends every rank with exit 2. Found before torch is
    imported, before the ranks had started MPI, rank 0 printed its line and left, and mpirun
    killed rank 1 (which waited for that line) 0.5 s later: rank 1 recorded no exit code.
    Now the ranks agree (hpc.runtime.cli.agree_on_inputs): each rank's own exit code is 2,
    the line is printed once, by rank 0, and the run folder is as it was (no run file)."""
    plant, words = PRE_TORCH_REFUSALS[case]
    out = tmp_path / "run"
    out.mkdir()
    plant(out)
    before = _entries(out)
    extra = {"resume of an empty folder": ["--resume"],
             "config value out of range": ["fgrpo.sampling.num_generations=1000000000"]}
    proc, codes = run_mpi_exit_codes(
        2, ["-m", "fgrpo", f"lora.adapter={placeholder_adapter(tmp_path / 'adapter')}",
            "run.progress=false", f"run.out={out}", *extra.get(case, [])], tmp_path / "codes")
    assert codes == {0: 2, 1: 2}, (codes, proc.stderr[-3000:])
    line = one_error_line(proc, *words)
    assert line.startswith("error: "), line  # rank 0's, not a rank's own
    assert _entries(out) == before
    assert not (out / "fgrpo.h5").is_file()


@pytest.mark.mpi
def test_a_refusal_after_the_start_exits_2_on_every_rank(tmp_path):
    """A mistake found once the ranks have started MPI and imported torch (model.quantize=int4
    on a CPU, agreed in hpc.job.lifecycle.on_all_ranks): each rank's own exit code is 2 as
    well, one line from rank 0, no run folder."""
    out = tmp_path / "run"
    proc, codes = run_mpi_exit_codes(
        2, ["-m", "fgrpo", "model.path=toy", "model.device=cpu", "model.quantize=int4",
            "run.progress=false", f"run.out={out}"], tmp_path / "codes")
    assert codes == {0: 2, 1: 2}, (codes, proc.stderr[-3000:])
    line = one_error_line(proc, "model.quantize")
    assert line.startswith("error: "), line
    assert not out.exists()


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_a_second_job_on_the_same_folder_stops_before_touching_it(toy_adapter, tmp_path):
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    out = tmp_path / "run"
    h5 = str(out / "essa.h5")
    first = subprocess.Popen([mpirun, "-n", "2", "--oversubscribe", sys.executable] +
                             essa_args(toy_adapter, out, 500), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **MPI_ENV), cwd=REPO)
    deadline = time.time() + 300
    while _rows(h5, "essa") < 1 and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    second = run_mpi(2, essa_args(toy_adapter, out, 500))
    assert first.poll() is None, "the first job ended before the second was refused"
    one_error_line(second, "is in use by another job", '"pid"')
    first.send_signal(signal.SIGUSR1)  # mpirun forwards it: checkpoint and stop
    _, err = first.communicate(timeout=300)
    assert first.returncode == 3, err[-3000:]
    run = RunFile(h5)
    assert run.attrs["status"] == "preempted"
    steps = run.group("essa")["step"].tolist()
    assert steps == list(range(1, len(steps) + 1))
    # The lock went with its holder: the next job may use the folder.
    resumed = run_mpi(2, essa_args(toy_adapter, out, len(steps) + 1) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def _run_file(folder, method, status, mtime):
    from hpc.runtime.runstore import RunStore

    folder.mkdir(parents=True)
    store = RunStore(str(folder / f"{method}.h5"), True, {"method": method})
    store.close(status)
    os.utime(folder / f"{method}.h5", (mtime, mtime))


def test_resume_without_a_folder_takes_the_newest_unfinished_run(tmp_path):
    """run.out's default names a new folder per job outside Slurm ({jobid} is the start
    time), so --resume with it finds the newest unfinished run of the method it names:
    complete runs, other methods' runs and a run whose job still holds its lock are passed
    over."""
    import fcntl

    from hpc.job.run_folder import newest_unfinished

    runs = tmp_path / "runs"
    _run_file(runs / "essa-1", "essa", "preempted", 1_000)
    _run_file(runs / "essa-2", "essa", "running", 2_000)  # killed: never closed
    _run_file(runs / "essa-3", "essa", "complete", 3_000)
    _run_file(runs / "fgrpo-4", "fgrpo", "preempted", 4_000)
    (runs / "essa-0" / "checkpoints").mkdir(parents=True)  # no run file yet, a checkpoint
    os.utime(runs / "essa-0" / "checkpoints", (500, 500))
    template = f"{runs}/{{method}}-{{jobid}}"
    assert newest_unfinished(template, "essa") == str(runs / "essa-2")
    with open(runs / "essa-2" / ".lock", "w") as held:  # a job runs there
        fcntl.flock(held, fcntl.LOCK_EX)
        assert newest_unfinished(template, "essa") == str(runs / "essa-1")
    assert newest_unfinished(template, "fgrpo") == str(runs / "fgrpo-4")
    with pytest.raises(UserError, match=r"no unfinished sft run in .*/runs/sft-\*"):
        newest_unfinished(template, "sft")


@pytest.mark.subprocess
def test_resume_with_no_unfinished_run_is_one_line(tmp_path):
    from conftest import run_cli

    proc = run_cli(["-m", "essa", f"lora.adapter={placeholder_adapter(tmp_path / 'a')}",
                    "run.progress=false",
                    f"run.out={tmp_path}/runs/{{method}}-{{jobid}}", "--resume"], timeout=120)
    one_error_line(proc, "--resume", "no unfinished essa run")
    assert not (tmp_path / "runs").exists()
