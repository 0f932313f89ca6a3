"""User mistakes end a job with one line and exit code 2 on every rank; never a traceback."""
import functools
import os
import reprlib
import signal
import sys
import time

EXIT_USER_ERROR = 2
ABORT_GRACE_S = 1.0  # seconds for the launcher to forward the error line before MPI_Abort


class UserError(Exception):
    """A problem with the user's input (config, paths, data, model). Reported as one line.

    ``same_on_all_ranks`` is True when every rank detects it identically (config validation,
    shared files); then only rank 0 prints it. Otherwise each rank prints it with its rank, and
    ``abort_peers`` (default: True then) ends the other ranks, which would otherwise wait for
    this one in their next collective; :func:`hpc.job.lifecycle.on_all_ranks` clears it, because there
    every rank stops by agreement.
    """

    def __init__(self, message: str, same_on_all_ranks: bool = True):
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks
        self.abort_peers = not same_on_all_ranks


class PeerFailed(SystemExit):
    """Another rank reported a user error; this rank exits 2 without printing."""

    def __init__(self):
        super().__init__(EXIT_USER_ERROR)


SHOWN_CHARS = 80  # the most characters of a bad value an error line shows


class _Bounded(reprlib.Repr):
    """reprlib's bounded repr, whose integers too are cut before they are formatted (a
    10^5-digit integer's full repr is 10^5 characters, and past 4,300 digits a ValueError)."""

    def repr_int(self, x, level):
        if x.bit_length() > 256:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHOWN = _Bounded()
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = SHOWN_CHARS
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 6
_SHOWN.maxlevel = 3


def shown(value) -> str:
    """``value``'s repr for an error line, at most about SHOWN_CHARS characters, cut before it is
    formatted: a YAML alias bomb (a list of a billion items sharing nine objects) or a 64 KiB
    string costs what its first items cost, never its full repr."""
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS + 3 else text[:SHOWN_CHARS] + "..."


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name where it has none): how a
    library's error is quoted in a one-line UserError."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
PEER_GRACE_S = 3.0  # seconds a rank > 0 waits before leaving on an error rank 0 prints


def _rank_from_env() -> int:
    for var in _RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _launched() -> bool:
    """Whether this process is a rank started by mpirun or srun."""
    return any(var in os.environ for var in _RANK_VARS)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_launcher() -> None:
    """In a rank started by mpirun or srun, on Linux: have the kernel SIGKILL this process when
    its parent (mpirun, or srun's slurmstepd) dies. A launcher that is itself killed with
    SIGKILL (the kernel's out-of-memory killer, a timeout's ``kill -9``) cannot end its ranks:
    they ran on, orphaned, until a collective's deadline (``run.collective_timeout_s``) or, in
    work without collectives, for ever. (A rank that dies is the launcher's to handle: mpirun
    and ``srun --kill-on-bad-exit`` end the others at once.) Called first thing in a job."""
    if not _launched() or not sys.platform.startswith("linux"):
        return
    import ctypes  # Linux only, and only in a launched rank

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0):
        return  # not permitted here: the launcher's own kill and the deadlines remain
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def report_user_error(err: UserError) -> None:
    """Print ``err`` as one line on stderr (rank 0 only unless the error is rank-local)."""
    rank = _rank_from_env()
    if err.same_on_all_ranks:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
    else:
        print(f"error (rank {rank}): {err}", file=sys.stderr, flush=True)


def _abort_peers() -> None:
    """A rank-local error mid-run: the other ranks are busy in the job and would wait for this
    one (and MPI_Finalize would wait for them), so end the whole job with exit code 2. The
    pause first lets mpirun/srun forward the error line, which the abort would otherwise race
    (how often it did without: README, "Faults")."""
    if "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI  # already loaded (checked above): importing it here starts nothing

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(EXIT_USER_ERROR)


def _exit_through_sigterm(code: int) -> None:
    """Exit with ``code``, ignoring SIGTERM from here on.

    Ranks that agreed to stop (user error 2, preempted 3) leave at slightly different moments,
    and ``srun --kill-on-bad-exit`` SIGTERMs the rest as soon as the first is gone. Python's
    own SIGTERM handler is removed while the interpreter shuts down (after MPI_Finalize), so a
    late rank would die of the signal and the step report 143 instead of ``code``. A rank
    with torch loaded whose MPI is finalized leaves at once (:func:`_leave_now`)."""
    _ignore_sigterm()
    if "torch" in sys.modules and _mpi_finalized():
        _leave_now(code)
    sys.exit(code)


def _mpi_finalized() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI  # already loaded (checked above)

    return MPI.Is_finalized()


def _open_hdf5_files() -> int:
    if "h5py" not in sys.modules:
        return 0
    import h5py  # already loaded (checked above)

    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


def _leave_now(code: int) -> None:
    """End a rank of an agreed exit without the interpreter's shut-down. With torch loaded
    that shut-down takes about 1 s here (2 cores), and mpirun (Open MPI 5) SIGKILLs the
    other ranks 0.5 s after the first leaves non-zero: a rank slower by 0.5 s lost its exit
    code (once in a CI run of 1,486 tests). Before torch is imported the shut-down is quick
    and stays: there, leaving at once lost a line the rank printed just before (2 launches
    in 20), which the launcher no longer forwarded. The exit handlers still run (W&B, the
    process group) and the streams are flushed; only where no HDF5 file is open (a run file
    is closed before any agreed exit), so none is left unflushed. The ranks' lines were
    printed before their barrier and MPI_Finalize, 0.25 s and more before this."""
    import atexit

    atexit._run_exitfuncs()  # CPython's: what sys.exit would run first
    if _open_hdf5_files():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _ignore_sigterm() -> None:
    """Ignore SIGTERM in a launched rank (see :func:`_exit_through_sigterm`); a caller
    in-process (a test) keeps its handler, and so do the children it starts later."""
    if _launched():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _mpi_started() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI  # already loaded (checked above)

    return MPI.Is_initialized()


def exit_user_error(err: UserError) -> None:
    """End this rank for ``err``: its one line (see :func:`report_user_error`), then exit 2."""
    report_user_error(err)
    if err.abort_peers:
        _abort_peers()
    elif err.same_on_all_ranks and _rank_from_env() != 0 and not _mpi_started():
        # Rank 0 prints the line. Found before the ranks could agree (a tool's mistake before
        # MPI starts; a job's ranks agree first: hpc.runtime.cli.agree_on_inputs), rank 0 may
        # still be importing: leaving first would make the launcher kill it before it prints.
        _ignore_sigterm()
        time.sleep(PEER_GRACE_S)
    else:
        _finalize_together()  # every rank leaves with 2 (the error is every rank's, or agreed)
    _exit_through_sigterm(EXIT_USER_ERROR)


def exit_agreed(err: UserError | None, barrier) -> None:
    """End this rank for a user error every rank has agreed on (``err``: this rank's; None:
    another rank's, :class:`PeerFailed`): its one line where it is this rank's to print (see
    :func:`report_user_error`), then ``barrier()``, so that no rank leaves before the line is
    out, then exit 2. The ranks leave together, each with its own exit code 2, before the
    launcher could kill a slower one as the first is gone."""
    if err is not None:
        report_user_error(err)
    barrier()
    _finalize_together()
    _exit_through_sigterm(EXIT_USER_ERROR)


FINALIZE_PAUSE_S = 0.25  # after MPI_Finalize, before a rank of an agreed exit leaves


def _finalize_together() -> None:
    """End MPI, then pause before leaving (a rank of an agreed exit, code 2 or 3). mpirun (Open MPI 5) ends a job as soon as one rank
    exits non-zero, and a rank still inside MPI_Finalize then never completes it ("PMIX ERROR:
    PMIX_ERR_UNREACH") and is killed 0.5 s later, without an exit code of its own. 2 ranks
    that leave a barrier together with exit 2, 30 launches each on 2 busy cores: leaving at
    once after MPI_Finalize lost a rank's exit code in 8, leaving through mpi4py's MPI_Finalize
    at exit in 3, pausing 0.25 s after MPI_Finalize in none. Only in a launched rank: a
    caller in-process (a test) keeps its MPI."""
    if not _launched() or not _mpi_started():
        return
    from mpi4py import MPI  # already loaded (checked above)

    if not MPI.Is_finalized():
        MPI.Finalize()
    time.sleep(FINALIZE_PAUSE_S)


def launched() -> bool:
    """Whether this process is a rank started by mpirun or srun."""
    return _launched()


def user_errors_exit(main):
    """Decorate a console entry point: a UserError becomes one line and exit code 2; any
    agreed non-zero exit (2, 3) survives the launcher's SIGTERM to the slower ranks."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
            _ignore_stop_signals()
            return result
        except UserError as err:
            exit_user_error(err)
        except SystemExit as done:
            if done.code not in (None, 0):  # an agreed exit (2, 3): every rank leaves with it
                _finalize_together()
                _exit_through_sigterm(done.code)
            _ignore_stop_signals()
            raise

    return wrapper


def _ignore_stop_signals() -> None:
    """After a job completed (its final ``run:`` line printed), a stop signal (SIGUSR1,
    SIGTERM) has nothing left to stop: ignore it, where the job's own recorder
    (:class:`hpc.runtime.preempt.StopSignals`) had it, which Python removes while the
    interpreter shuts down, so a late signal ended the job with 138 or 143 instead of 0."""
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if type(getattr(handler, "__self__", None)).__name__ == "StopSignals":
            signal.signal(sig, signal.SIG_IGN)
