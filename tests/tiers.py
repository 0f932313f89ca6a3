"""The test tiers, enforced: a test's marks name what it starts, and each test's cost is seen.

Marks (registered in pytest.ini, which also sets ``--strict-markers``):

- ``mpi``: starts ranks under ``mpirun`` / ``mpiexec``;
- ``slurm``: starts or uses a Slurm (``sbatch``, ``srun``, ``scontrol``, jobscripts/local-slurm);
- ``subprocess``: starts any other child process (a command, a child Python, a shell script);
- ``toy``: needs the built-in toy models from the cache (built once, minutes) or the shared
  SFT adapter trained from the toy (tests/conftest.py ``toy_adapter``), both made in child
  processes;
- ``slow``: takes over 30 s on 2 CPU cores; also an in-process test over 5 s.

``make check`` runs the tests that none of these marks: the in-process tier.

The guard: while a test runs (its setup, call and teardown, so a session fixture's work counts
for the first test that asks for it), every ``subprocess.Popen`` is classified by its program
(:func:`needed_mark`); one the test's marks do not allow fails the test on the spot, naming the
mark it needs. A test not marked ``toy`` sees ``HPC_CACHE`` pointed below a plain file, so
resolving a toy model fails at once (NotADirectoryError naming ``TOY_FORBIDDEN``) instead of
building it for minutes.

The budget: with ``--budget=warn`` or ``--budget=fail`` (``make test``), a calibration step is
timed before the tests start and each test's time (setup + call + teardown) is scaled to the
reference machine by the ratio of the calibration's time there (``tests/slow_tests.txt``) to
its time now. A test over ``LIMIT_S`` at the reference speed that is not on that list with its
reason is reported; ``fail`` also fails the run when one is over ``LIMIT_S * FAIL_MARGIN``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

MPI_LAUNCHERS = {"mpirun", "mpiexec", "mpiexec.hydra", "orterun", "prterun", "mpiexec.mpich",
                 "mpirun.mpich", "mpiexec.openmpi", "mpirun.openmpi"}
SLURM_COMMANDS = {"sbatch", "srun", "salloc", "scontrol", "sinfo", "squeue", "scancel",
                  "sacct", "slurmctld", "slurmd", "munged"}
SLURM_SCRIPTS = ("local-slurm/",)  # start.sh, stop.sh, cluster.sh
FREE = {"git"}  # a run file's provenance (hpc/runtime/runstore.py: git rev-parse HEAD)
# marks of tests that start processes by definition (the toy's build and the shared SFT adapter
# run in child processes)
STARTERS = {"mpi", "slurm", "toy"}
TOY_FORBIDDEN = "a-test-not-marked-toy-cannot-use-the-toy-cache"
LIMIT_S = 60.0  # at the reference speed; a test over it must be on SLOW_LIST
# ``--budget=fail`` fails the run only for a test over LIMIT_S * FAIL_MARGIN: the calibration
# is timed once, before the tests, and a test's own time moves by a tenth or more with what
# else runs beside it, so a test just over LIMIT_S is reported, not failed
FAIL_MARGIN = 1.25
SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
# The calibration step: a child Python that imports torch and multiplies matrices on one
# thread, the two things most tests' time goes to (their subprocesses start the same way).
CALIBRATION = ("import torch; torch.set_num_threads(1); a = torch.randn(384, 384); "
               "[a @ a for _ in range(400)]")


def needed_mark(args) -> str | None:
    """The mark a test needs to start ``args`` (Popen's first argument); None: no mark."""
    if isinstance(args, (str, bytes, os.PathLike)):
        words = os.fsdecode(args).split()
    else:
        words = [os.fsdecode(a) for a in args]
    program = os.path.basename(words[0]) if words else ""
    if program in FREE:
        return None
    if program in MPI_LAUNCHERS:
        return "mpi"
    if program in SLURM_COMMANDS or any(s in w for w in words[:2] for s in SLURM_SCRIPTS):
        return "slurm"
    return "subprocess"


def allows(marks: set, needed: str) -> bool:
    """Whether a test with ``marks`` may start what needs ``needed``: its own mark, or, for a
    plain child process, any of ``STARTERS``."""
    return needed in marks or (needed == "subprocess" and bool(marks & STARTERS))


class _Guard:
    """``subprocess.Popen``, checked against the marks of the test running now."""

    def __init__(self):
        self.marks: set | None = None  # None: between tests (collection, session teardown)
        self.nodeid = ""
        self.shared_s = 0.0  # spent in shared builds since the last report
        self.original = None

    def install(self):
        if self.original is not None:
            return
        self.original = original = subprocess.Popen.__init__
        guard = self

        def checked_init(popen, args, *rest, **kwargs):
            if guard.marks is not None:
                needed = needed_mark(args)
                if needed and not allows(guard.marks, needed):
                    shown = args if isinstance(args, str) else " ".join(map(str, list(args)[:3]))
                    pytest.fail(f"{guard.nodeid} starts `{shown}` but is not marked {needed}: "
                                f"add @pytest.mark.{needed} (tests/tiers.py)", pytrace=False)
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = checked_init


GUARD = _Guard()


def charge_shared_build(seconds: float) -> None:
    """Record that the running test spent ``seconds`` building (or waiting for) something the
    whole run shares (the SFT adapter, the toy-chat model): the budget reports that time apart,
    since which test pays it depends on the order the workers reach it."""
    GUARD.shared_s += seconds


def pytest_addoption(parser):
    parser.addoption("--budget", choices=("off", "warn", "fail"), default="off",
                     help="time each test against LIMIT_S at the reference speed: tests over "
                          "it and not on tests/slow_tests.txt are reported (warn) or fail the "
                          "run (fail); tests/tiers.py")


def pytest_configure(config):
    GUARD.install()
    if config.getoption("--budget") != "off" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Budget(config), "tiers-budget")


def _forbidden_cache(config) -> str:
    """``HPC_CACHE`` for a test not marked toy: a path below a plain file, where no folder can
    be made (not even by root)."""
    blocker = os.path.join(str(config._tmp_path_factory.getbasetemp()), TOY_FORBIDDEN)
    if not os.path.exists(blocker):
        with open(blocker, "w") as fh:
            fh.write("mark the test @pytest.mark.toy (tests/tiers.py)\n")
    return os.path.join(blocker, "cache")


def pytest_collection_modifyitems(items):
    """Long tests first, so that the workers do not end on one while the others wait: the
    modules that hold a test of the slow list, then those with a slow test, then the rest, and
    in each module its listed, then slow tests first. A module's tests stay together (its
    fixtures are set up once), and every worker sorts alike, as xdist requires."""
    _, allowed = read_slow_list()

    def rank(item) -> int:
        if any(on_list(without_group(item.nodeid), pattern) for pattern in allowed):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    modules: dict = {}
    for item in items:
        modules[item.module] = min(modules.get(item.module, 2), rank(item))
    order = {module: i for i, module in enumerate(modules)}
    items.sort(key=lambda item: (modules[item.module], order[item.module], rank(item)))


USER_CACHE = os.environ.get("HPC_CACHE")  # what the toy-marked tests see


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marks = {m.name for m in item.iter_markers()}
    saved_env, saved_guard = os.environ.get("HPC_CACHE"), (GUARD.marks, GUARD.nodeid)
    cache = USER_CACHE if "toy" in marks else _forbidden_cache(item.config)
    _set_cache(cache)
    GUARD.marks, GUARD.nodeid = marks, item.nodeid
    try:
        yield
    finally:  # as before the test (an inner pytest's test runs inside an outer one)
        GUARD.marks, GUARD.nodeid = saved_guard
        _set_cache(saved_env)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if GUARD.shared_s:
        report.user_properties.append(("shared_build_s", GUARD.shared_s))
        GUARD.shared_s = 0.0


def _set_cache(value: str | None) -> None:
    if value is None:
        os.environ.pop("HPC_CACHE", None)
    else:
        os.environ["HPC_CACHE"] = value


def without_group(nodeid: str) -> str:
    """``nodeid`` without the ``@GROUP`` that ``--dist loadgroup`` appends for xdist_group."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") and at > nodeid.rfind("::") else nodeid


def on_list(nodeid: str, pattern: str) -> bool:
    """Whether a slow-list line names ``nodeid``: the node id itself, or ``NAME[*]`` for every
    parametrisation of NAME."""
    if pattern.endswith("[*]"):
        return nodeid.startswith(pattern[:-2])
    return nodeid == pattern


def read_slow_list(path: str = SLOW_LIST) -> tuple[float, dict]:
    """(the calibration's seconds on the reference machine, {node id pattern: why})."""
    reference, allowed = None, {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line.startswith("# calibration_s:"):
                reference = float(line.split(":", 1)[1].split()[0])
            elif line and not line.startswith("#"):
                pattern, _, why = line.partition("  # ")
                assert why.strip(), f"{path}: {pattern} needs its reason after '  # '"
                allowed[pattern.strip()] = why.strip()
    assert reference, f"{path} needs a '# calibration_s: SECONDS' line"
    return reference, allowed


def calibration_seconds(repeats: int = 2) -> float:
    """The best of ``repeats`` timings of the calibration step, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", CALIBRATION], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        best = min(best, time.perf_counter() - start)
    return best


class Budget:
    """Each test's time at the reference speed against ``LIMIT_S`` and the slow list (the
    controller's view: every worker's reports reach it)."""

    def __init__(self, config):
        self.fail = config.getoption("--budget") == "fail"
        self.reference, self.allowed = read_slow_list()
        self.now = calibration_seconds()
        self.scale = self.reference / self.now  # > 1: this machine is faster than the reference
        self.seconds: dict = {}  # per test, shared builds aside
        self.shared_s = 0.0

    def pytest_runtest_logreport(self, report):
        shared = sum(v for k, v in report.user_properties if k == "shared_build_s")
        self.shared_s += shared
        nodeid = without_group(report.nodeid)
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration - shared

    def over(self) -> list:
        """[(node id, seconds here, seconds at the reference speed)] over LIMIT_S, unlisted."""
        return sorted(((nodeid, s, s * self.scale) for nodeid, s in self.seconds.items()
                       if s * self.scale > LIMIT_S and not self.listed(nodeid)),
                      key=lambda row: -row[1])

    def failing(self) -> list:
        """The rows of :meth:`over` past ``LIMIT_S * FAIL_MARGIN``: what fails the run."""
        return [row for row in self.over() if row[2] > LIMIT_S * FAIL_MARGIN]

    def listed(self, nodeid: str) -> bool:
        return any(on_list(nodeid, pattern) for pattern in self.allowed)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtestloop(self, session):
        yield
        if self.fail and self.failing():
            session.testsfailed += 1

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        terminalreporter.section("time budget (tests/tiers.py)")
        write(f"calibration step {self.now:.2f} s here, {self.reference:.2f} s on the reference "
              f"machine: times below are scaled by {self.scale:.2f}; limit {LIMIT_S:.0f} s")
        listed = sorted(((s * self.scale, n) for n, s in self.seconds.items() if self.listed(n)),
                        reverse=True)
        write(f"{len(listed)} tests on tests/slow_tests.txt ran, "
              f"{sum(s for s, _ in listed):.0f} s at the reference speed in all; shared builds "
              f"(the SFT adapter, the toy-chat model) {self.shared_s:.0f} s here, apart")
        over = self.over()
        for nodeid, here, there in over:
            write(f"OVER BUDGET: {nodeid} took {here:.1f} s ({there:.1f} s at the reference "
                  f"speed) and is not on tests/slow_tests.txt", red=True)
        if not over:
            write(f"every other test is within {LIMIT_S:.0f} s at the reference speed")
        elif self.fail and self.failing():
            write(f"the budget check failed (a test over {LIMIT_S * FAIL_MARGIN:g} s at the "
                  f"reference speed): speed the test up, or add it to tests/slow_tests.txt with "
                  f"its reason", red=True)
        else:
            write(f"not failed: each is within {LIMIT_S * FAIL_MARGIN:g} s at the reference "
                  f"speed, the margin for a test's time moving with what runs beside it; "
                  f"speed it up, or add it to tests/slow_tests.txt with its reason")
