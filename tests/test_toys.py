"""The built-in toy builds: seeded work that the clock never ends, cached only when complete,
refused (one line, exit 2) when the cached build is not the intended one.

Builds here are short (at most 50 steps, one probe; the full build ends at a held-out
accuracy) so that the tests take seconds. A full build on other CPUs' arithmetic:
tests/test_toy_kernels.py."""
import json
import os
import time

import pytest
import torch

from conftest import our_lines, run_cli
from hpc.engine.generate import generate
from hpc.models.loading import load_model
from hpc.runtime.errors import UserError
from hpc.toys import cache, pinned, toy

SHORT = 50  # optimizer steps of a test build: one probe (every toy.PROBE_EVERY = 50 steps)
QUIET = dict(log=lambda msg: None)


def _weights(folder: str) -> bytes:
    with open(os.path.join(folder, cache.WEIGHTS_FILE), "rb") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def short_build(tmp_path_factory):
    """A 50-step toy build as ``hpc-toy`` makes it (a child Python under the pinned kernels)."""
    folder = str(tmp_path_factory.mktemp("toy-short") / toy.VERSION)
    toy.build_toy(folder, SHORT, **QUIET)
    return folder


@pytest.mark.slow
def test_a_slowed_machine_builds_the_same_model_bitwise(tmp_path, monkeypatch):
    """Each step sleeps and every clock read jumps 1000 s (any wall-clock budget would end
    the build after its first step): the weights are the same bytes. Both builds train in
    this process (the training the pinned child runs, on this process's kernels)."""
    reference = str(tmp_path / "reference")
    toy.train_toy(reference, SHORT, **QUIET)
    fake_now = [time.time()]

    def jumping_clock():
        fake_now[0] += 1000.0
        return fake_now[0]

    for name in ("time", "monotonic", "perf_counter"):
        monkeypatch.setattr(time, name, jumping_clock)
    real_step = torch.optim.AdamW.step
    real_sleep = time.sleep

    def slow_step(self, *args, **kwargs):
        real_sleep(0.02)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", slow_step)
    slowed = str(tmp_path / "slowed")
    toy.train_toy(slowed, SHORT, **QUIET)
    assert _weights(slowed) == _weights(reference)
    info, reference = cache.read_info(slowed), cache.read_info(reference)
    assert info["steps"] == reference["steps"] == SHORT
    assert info["weights_sha256"] == reference["weights_sha256"] == cache.weights_sha256(slowed)
    assert info["probe_accuracy"] == reference["probe_accuracy"]
    assert info["build_seconds"] >= 1000  # the clock is reported, never obeyed


@pytest.mark.subprocess
@pytest.mark.xdist_group("short_build")  # one worker builds it once
def test_the_cached_build_is_checked(short_build, tmp_path):
    short = {"version": toy.VERSION, "steps": SHORT}
    assert cache.check_built(short_build, short, "REBUILD")["steps"] == SHORT
    with pytest.raises(UserError, match=f"records version {toy.VERSION}, stop_accuracy "
                                        f"{toy.STOP_ACCURACY}, reached_stop_accuracy False; "
                                        f"the intended build is version {toy.VERSION}, "
                                        f"stop_accuracy {toy.STOP_ACCURACY}, "
                                        f"reached_stop_accuracy True; rebuild it with: REBUILD"):
        cache.check_built(short_build, toy.INTENDED, "REBUILD")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in os.listdir(short_build):
        data = open(os.path.join(short_build, name), "rb").read()
        if name == cache.WEIGHTS_FILE:
            data = data[:-1] + bytes([data[-1] ^ 1])
        (damaged / name).write_bytes(data)
    with pytest.raises(UserError, match="does not match the SHA-256"):
        cache.check_built(str(damaged), short, "REBUILD")
    (damaged / cache.INFO_FILE).write_text("[1, 2]")
    with pytest.raises(UserError, match="unreadable"):
        cache.check_built(str(damaged), short, "REBUILD")


@pytest.mark.subprocess
def test_an_interrupted_build_is_never_cached(tmp_path):
    """Ctrl-C while the pinned child trains (at its first probe line): the child is ended and
    nothing is left behind."""
    lines = []

    def interrupted(msg):
        lines.append(msg)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        toy.build_toy(str(tmp_path / toy.VERSION), SHORT, log=interrupted)
    assert lines and lines[0].startswith("toy step 50:"), lines
    assert os.listdir(tmp_path) == []


@pytest.mark.subprocess
@pytest.mark.xdist_group("short_build")  # one worker builds it once
def test_build_is_atomic_and_loadable(short_build, tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_CACHE", str(tmp_path))
    final = toy.cache_dir()
    assert final == str(tmp_path / toy.VERSION)
    threads = torch.get_num_threads()
    monkeypatch.setattr(toy, "MAX_STEPS", SHORT)  # the build as the fixture's, and its check
    monkeypatch.setattr(toy, "INTENDED", {"version": toy.VERSION, "steps": SHORT})
    assert toy.toy_model_path(**QUIET) == final
    assert torch.get_num_threads() == threads
    info = toy.toy_info(final)
    assert 0 <= info["heldout_accuracy"] <= 1 and info["parameters"] == 598656
    assert info["kernels"] == pinned.pinned_description()
    assert _weights(final) == _weights(short_build)
    model, tok = load_model(final)
    assert len(generate(model, tok, ["12+34="], 4)) == 1
    # a second builder that loses the race keeps the winner's folder and cleans up after itself
    monkeypatch.setattr(toy, "train_pinned", lambda target, out, steps, log: open(
        os.path.join(out, cache.INFO_FILE), "w").write("{}"))
    toy.build_toy(final, **QUIET)
    assert toy.toy_info(final) == info
    assert os.listdir(tmp_path) == [toy.VERSION]


@pytest.mark.parametrize("command", [["-m", "hpc.toys.toy"],
                                     ["-m", "hpc.evaluate", "model.path=toy", "task.n_eval=4"]])
@pytest.mark.subprocess
def test_a_cache_of_another_build_is_refused_in_one_line(tmp_path, command):
    """What an earlier build (a fixed step count) left where this version's cache goes."""
    folder = tmp_path / toy.VERSION
    folder.mkdir()
    (folder / cache.INFO_FILE).write_text(json.dumps({"version": "toy-model-v2", "steps": 1250}))
    proc = run_cli(command + [f"run.out={tmp_path / 'run'}"] * (len(command) > 2),
                   env={"HPC_CACHE": str(tmp_path)}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert "records version toy-model-v2" in lines[0], lines
    assert "rebuild it with: hpc-toy --rebuild" in lines[0]
    assert not (tmp_path / "run").exists()


def test_toy_data_never_trains_on_the_demo_heldout_set():
    from hpc.data.tasks import arith_task

    train, heldout, probe = toy._problem_sets()
    demo = arith_task(n_train=2000, n_eval=256, digits=2, ops="+", seed=0)
    assert [p for p, _ in heldout] == demo.eval.prompts
    assert [a for _, a in heldout] == demo.eval.answers
    train_prompts = {p for p, _ in train}
    assert not train_prompts & {p for p, _ in heldout + probe}
    assert not {p for p, _ in probe} & set(demo.eval.prompts)
    assert len(train_prompts) == len(train) == 90 * 90 - 1024
