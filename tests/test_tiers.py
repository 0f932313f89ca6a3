"""The tiers hold: a test that starts something its marks do not name fails, a test that resolves
the toy model unmarked fails at once, the marks are registered, and the budget list reads.

Each case runs a small test file in an inner pytest (pytester, in this process) with the
suite's own hooks (tests/tiers.py)."""
import os
import stat
import sys

import pytest

import tiers

pytest_plugins = ["pytester"]
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def inner(pytester):
    """An inner pytest with the suite's pytest.ini markers and tests/tiers.py hooks."""
    ini = os.path.join(os.path.dirname(HERE), "pytest.ini")
    with open(ini) as fh:
        pytester.makefile(".ini", pytest=fh.read().replace("testpaths = tests\n", ""))
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {HERE!r})\n"
                          "from tiers import pytest_addoption, pytest_configure, "
                          "pytest_runtest_makereport, pytest_runtest_protocol\n")
    return pytester


def _fake_program(pytester, name: str) -> str:
    """A program called ``name`` that exits 0, in the inner test folder."""
    path = pytester.path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("program, mark", [("mpirun", "mpi"), ("sbatch", "slurm"),
                                           ("python3", "subprocess")])
def test_an_unmarked_test_that_starts_a_process_fails_naming_its_mark(inner, program, mark):
    path = sys.executable if program == "python3" else _fake_program(inner, program)
    inner.makepyfile(test_inner=f"""
        import subprocess
        import pytest

        def test_unmarked():
            subprocess.run([{path!r}, "-c", "pass"])

        @pytest.mark.{mark}
        def test_marked():
            assert subprocess.run([{path!r}, "-c", "pass"]).returncode == 0
    """)
    result = inner.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*test_unmarked starts `{path}*` but is not marked {mark}: "
                                 f"add @pytest.mark.{mark}*"])


def test_a_session_fixture_counts_for_the_first_test_that_asks(inner):
    inner.makepyfile(test_inner=f"""
        import subprocess
        import pytest

        @pytest.fixture(scope="session")
        def built():
            subprocess.run([{sys.executable!r}, "-c", "pass"], check=True)

        def test_first(built):
            pass
    """)
    inner.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(errors=1)


def test_launcher_and_toy_marks_allow_plain_children_and_git_needs_none():
    assert tiers.needed_mark(["git", "rev-parse", "HEAD"]) is None
    assert tiers.needed_mark(["bash", "/r/jobscripts/local-slurm/cluster.sh", "up"]) == "slurm"
    assert tiers.needed_mark("/usr/bin/mpiexec -n 2 python x.py") == "mpi"
    assert tiers.needed_mark(["bash", "jobscripts/reproduce.sh"]) == "subprocess"
    for marks in ({"mpi"}, {"slurm"}, {"toy"}, {"subprocess"}):
        assert tiers.allows(marks, "subprocess")
    assert not tiers.allows({"toy", "slow"}, "mpi")
    assert not tiers.allows({"mpi"}, "slurm")


def test_an_unmarked_test_cannot_reach_the_toy_cache(inner):
    """Resolving the toy model unmarked fails in a moment (it would build it for minutes)."""
    inner.makepyfile(test_inner="""
        import pytest
        from hpc.toys.toy import cache_dir, toy_model_path

        def test_unmarked():
            toy_model_path(wait_s=0, log=lambda msg: None)

        @pytest.mark.toy
        def test_marked():
            assert "a-test-not-marked-toy" not in cache_dir()
    """)
    result = inner.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*{tiers.TOY_FORBIDDEN}*"])


def test_every_mark_in_the_suite_is_registered(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert set(tiers.STARTERS) | {"subprocess", "slow"} <= registered


def test_the_slow_list_names_a_reason_for_every_entry():
    reference, allowed = tiers.read_slow_list()
    assert reference > 0 and allowed
    assert all(pattern.startswith("tests/test_") and "::" in pattern for pattern in allowed)


def test_slow_list_lines_name_one_test_or_every_parametrisation():
    assert tiers.on_list("tests/test_a.py::test_b", "tests/test_a.py::test_b")
    assert not tiers.on_list("tests/test_a.py::test_bc", "tests/test_a.py::test_b")
    assert tiers.on_list("tests/test_a.py::test_b[srun]", "tests/test_a.py::test_b[*]")
    assert not tiers.on_list("tests/test_a.py::test_bc[srun]", "tests/test_a.py::test_b[*]")
    assert tiers.without_group("tests/test_a.py::test_b[x]@grp") == "tests/test_a.py::test_b[x]"
    assert tiers.without_group("tests/test_a.py::test_b[x@y]") == "tests/test_a.py::test_b[x@y]"


@pytest.mark.subprocess  # the calibration step is a child Python
def test_the_budget_fails_a_test_over_the_limit_that_is_not_listed(inner, monkeypatch):
    """Calibrated at the reference speed (scale 1: a loaded machine's calibration would
    scale the sleep below the limit), a 0.5 s test over a 0.2 s limit fails the budget (0.25 s
    with the margin); a 0.22 s one, within the margin, is only named."""
    monkeypatch.setattr(tiers, "LIMIT_S", 0.2)
    monkeypatch.setattr(tiers, "calibration_seconds", lambda: tiers.read_slow_list()[0])
    inner.makepyfile(test_inner="""
        import time

        def test_quick():
            pass

        def test_over():
            time.sleep(0.5)

        def test_just_over():
            time.sleep(0.22)
    """)
    result = inner.runpytest_inprocess("-p", "no:cacheprovider", "--budget=fail")
    result.assert_outcomes(passed=3)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*OVER BUDGET: test_inner.py::test_over took*",
                                 "*OVER BUDGET: test_inner.py::test_just_over took*",
                                 "*the budget check failed*"])
    assert "test_quick took" not in result.stdout.str()


@pytest.mark.subprocess  # the calibration step is a child Python
def test_a_test_within_the_margin_is_named_and_does_not_fail_the_run(inner, monkeypatch):
    monkeypatch.setattr(tiers, "LIMIT_S", 0.2)
    monkeypatch.setattr(tiers, "calibration_seconds", lambda: tiers.read_slow_list()[0])
    inner.makepyfile(test_inner="""
        import time

        def test_just_over():
            time.sleep(0.22)
    """)
    result = inner.runpytest_inprocess("-p", "no:cacheprovider", "--budget=fail")
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*OVER BUDGET: test_inner.py::test_just_over took*",
                                 "*not failed: each is within 0.25 s*"])
