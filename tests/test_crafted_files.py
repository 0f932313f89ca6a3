"""Crafted and damaged files in a run folder: every one ends as one line (exit 2) or a fallback
to the previous checkpoint, never a traceback, and no file outside the run folder changes.

Most rows call the store, checkpoint and resume functions in-process; the last tests run the
real CLI (the toy SFT job, one process and under mpirun) on a few of them.
"""
import copy
import hashlib
import os
import shutil
import struct

import h5py
import numpy as np
import pytest
from safetensors.numpy import save as save_numpy

from conftest import our_lines, run_cli, run_mpi
from essa.optimizers import Tracked, make_optimizer
from hpc.job import run_folder as run_folder_module
from hpc.runtime.checkpoint import FORMAT, list_checkpoints, load_latest, save_checkpoint
from hpc.runtime.errors import UserError
from hpc.job.loop import resume_fields
from hpc.runtime.runstore import RunFile, RunStore

DIM, POP = 8, 6


def fresh_optimizer() -> Tracked:
    return Tracked(make_optimizer("cma", DIM, POP, 0.3, seed=0))


@pytest.fixture(scope="module")
def valid_method_state():
    """ESSA's method state (Tracked CMA-ES) after two generations."""
    opt = fresh_optimizer()
    for _ in range(2):
        x = opt.ask()
        opt.tell(x, -np.sum(x ** 2, axis=1))
    return opt.state_dict()


def make_run_file(path: str) -> bytes:
    """A run file of two steps as the loop writes it; returns its bytes."""
    store = RunStore(path, True, {"method": "essa"})
    for step in (1, 2):
        store.log_step(step, metrics={"loss": 0.5 / step},
                       timings={"rollout": np.array([0.1, 0.2])}, nbytes={"fitness": 48})
    data = store.snapshot()
    store.close()
    return data


@pytest.fixture
def outside(tmp_path):
    """A folder outside the run folder with the files a crafted one points at (an HDF5 file
    with chunked datasets, a raw file, a text file); asserts afterwards that none changed."""
    folder = tmp_path / "outside"
    folder.mkdir()
    with h5py.File(folder / "other.h5", "w") as f:
        for where in (f, f.create_group("grp")):
            where.create_dataset("step", data=np.arange(1, 3), maxshape=(None,), chunks=(64,))
            where.create_dataset("data", data=np.ones(2), maxshape=(None,), chunks=(64,))
    (folder / "raw.bin").write_bytes(np.ones(2).tobytes())
    (folder / "victim.txt").write_text("must stay as it is\n")

    def digests():
        return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
                for name in sorted(os.listdir(folder))}

    before = digests()
    yield folder
    assert digests() == before, "a file outside the run folder changed"


def run_dir(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    return out


def loop_state(step, run_bytes, method_state) -> dict:
    """A checkpoint's state as :func:`hpc.job.loop.run_loop` saves it."""
    return {"step": step, "elapsed_s": 1.5 * step, "overhead_s": 0.25,
            "generated_tokens": 100 * step, "run_file": run_bytes,
            "method": copy.deepcopy(method_state)}


def accept(state, path):
    """What run_loop's ``accept`` does, with ESSA's method state on a fresh optimizer."""
    resume_fields(state, path)
    fresh_optimizer().load_state_dict(state["method"])


def plant_raw(directory, step: int, data: bytes) -> str:
    """A checkpoint file of ``data`` bytes with a matching checksum (a crafted file)."""
    path = os.path.join(str(directory), f"step-{step:08d}.safetensors")
    with open(path, "wb") as fh:
        fh.write(data)
    with open(path[:-len(".safetensors")] + ".sha256", "w") as fh:
        fh.write(hashlib.sha256(data).hexdigest())
    return path


def one_line(err: UserError, *words):
    text = str(err)
    assert "\n" not in text, text
    for word in words:
        assert word in text, text


def assert_fallback(ckpts, capsys, *words):
    """load_latest uses step 1 and warns once about the crafted step 2 (named); without step 1
    it is one UserError line."""
    capsys.readouterr()
    state = load_latest(str(ckpts), accept=accept)
    assert state["step"] == 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), warnings
    for word in ("step-00000002",) + words:
        assert word in warnings[0], warnings[0]
    for name in os.listdir(ckpts):
        if name.startswith("step-00000001"):
            os.remove(os.path.join(ckpts, name))
    with pytest.raises(UserError) as caught:
        load_latest(str(ckpts), accept=accept)
    one_line(caught.value, "step-00000002", *words)


# --- crafted checkpoint fields -------------------------------------------------------------

def _set(path: str, value):
    """A crafting: put ``value`` at the key path ``path`` ("a/b/c") of the state."""
    def craft(state):
        *parents, last = path.split("/")
        node = state
        for key in parents:
            node = node[key]
        node[last] = value
    return craft


ES = "method/optimizer/es"
FIELD_CRAFTS = {
    "step as a string": (_set("step", "2"), "'step'"),
    "negative step": (_set("step", -1), "'step'"),
    "step 2^70": (_set("step", 2 ** 70), "'step'"),
    "step as a float": (_set("step", 2.0), "'step'"),
    "elapsed as a string": (_set("elapsed_s", "3.0"), "'elapsed_s'"),
    "elapsed NaN": (_set("elapsed_s", float("nan")), "'elapsed_s'"),
    "overhead negative": (_set("overhead_s", -1.0), "'overhead_s'"),
    "tokens as a string": (_set("generated_tokens", "200"), "'generated_tokens'"),
    "tokens infinite": (_set("generated_tokens", float("inf")), "'generated_tokens'"),
    "run file as a string": (_set("run_file", "essa.h5"), "'run_file'"),
    "run file not HDF5": (_set("run_file", b"not an HDF5 file"), "'run_file'"),
    "no method state": (lambda s: s.pop("method"), "'method'"),
    "rng keys of the wrong shape": (_set("method/optimizer/rng_keys",
                                         np.zeros(3, np.uint32)), "'rng_keys'"),
    "rng position out of range": (_set("method/optimizer/rng_pos", 10 ** 6), "'rng_pos'"),
    "best_x of the wrong shape": (_set("method/best_x", np.zeros(3)), "'best_x'"),
    "best fitness a string": (_set("method/best_fitness", "high"), "'best_fitness'"),
    "best fitness +inf": (_set("method/best_fitness", float("inf")), "'best_fitness'"),
    "best_x NaN": (_set("method/best_x", np.full(DIM, np.nan)), "'best_x'"),
    "CMA mean of the wrong shape": (_set(f"{ES}/values/mean", np.zeros(DIM + 1)), "'mean'"),
    "CMA sigma a string": (_set(f"{ES}/values/sigma", "large"), "'sigma'"),
    "CMA unknown path": (_set(f"{ES}/values/no_such_thing", 1.0), "'no_such_thing'"),
    "CMA unknown nested path": (_set(f"{ES}/values/sm.no_such_thing", 1.0),
                                "'sm.no_such_thing'"),
    "CMA method overwritten": (_set(f"{ES}/values/tell", 1.0), "'tell'"),
    "CMA dunder name": (_set(f"{ES}/values/__class__", "x"), "'__class__'"),
    "CMA nested dunder": (_set(f"{ES}/values/sm.__dict__", 1.0), "'sm.__dict__'"),
    "CMA alias tell -> ask": (_set(f"{ES}/aliases/tell", "ask"), "'tell'"),
    "CMA alias of another shape": (_set(f"{ES}/aliases/mean", "sm.C"), "'mean'"),
    "CMA object of another class": (_set(f"{ES}/objects/sm", "CMAOptions"), "'sm'"),
    "CMA object at a new path": (_set(f"{ES}/objects/sm.extra", "CMAOptions"), "'sm.extra'"),
    "CMA range at a new path": (_set(f"{ES}/ranges/tell", [0, 1, 1]), "'tell'"),
    "CMA state not a dict": (_set(ES, [1, 2]), "CMA-ES checkpoint"),
}


@pytest.mark.parametrize("name", list(FIELD_CRAFTS))
def test_a_crafted_checkpoint_field_falls_back_or_is_one_line(name, tmp_path, capsys, outside,
                                                             valid_method_state):
    craft, word = FIELD_CRAFTS[name]
    ckpts = run_dir(tmp_path) / "checkpoints"
    run_bytes = make_run_file(str(tmp_path / "make.h5"))
    save_checkpoint(str(ckpts), 1, loop_state(1, run_bytes, valid_method_state))
    bad = loop_state(2, run_bytes, valid_method_state)
    craft(bad)
    save_checkpoint(str(ckpts), 2, bad)
    assert_fallback(ckpts, capsys, word)


def _deep_skeleton() -> bytes:
    return save_numpy({"t0": np.zeros(1)}, metadata={
        "format": FORMAT, "skeleton": "[" * 5000 + "]" * 5000})


def _deep_header() -> bytes:
    header = (b'{"__metadata__":{"format":"' + FORMAT.encode() + b'"},"x":' +
              b"[" * 200000 + b"]" * 200000 + b"}")
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize("make", [_deep_skeleton, _deep_header], ids=["skeleton", "header"])
def test_deeply_nested_json_is_refused_without_recursion(make, tmp_path, capsys, outside,
                                                         valid_method_state):
    ckpts = run_dir(tmp_path) / "checkpoints"
    run_bytes = make_run_file(str(tmp_path / "make.h5"))
    save_checkpoint(str(ckpts), 1, loop_state(1, run_bytes, valid_method_state))
    plant_raw(ckpts, 2, make())
    assert_fallback(ckpts, capsys, "not one this program wrote", "levels deep")


def test_an_untouched_checkpoint_restores_the_strategy_bitwise(tmp_path, valid_method_state):
    """The checks accept what the program wrote: the restored CMA-ES asks the same members."""
    ckpts = run_dir(tmp_path) / "checkpoints"
    save_checkpoint(str(ckpts), 1, loop_state(1, None, valid_method_state))
    restored = fresh_optimizer()
    restored.load_state_dict(load_latest(str(ckpts), accept=accept)["method"])
    original = fresh_optimizer()
    original.load_state_dict(copy.deepcopy(valid_method_state))
    assert np.array_equal(restored.ask(), original.ask())


# --- crafted run files ---------------------------------------------------------------------

def _external_dataset(f, outside):
    del f["metrics/loss"]
    f["metrics/loss"] = h5py.ExternalLink(str(outside / "other.h5"), "/data")


def _external_group(f, outside):
    del f["metrics"]
    f["metrics"] = h5py.ExternalLink(str(outside / "other.h5"), "/grp")


def _soft_link(f, outside):
    f["metrics/alias"] = h5py.SoftLink("/metrics/loss")


def _virtual(f, outside):
    layout = h5py.VirtualLayout(shape=(2,), dtype="f8")
    layout[:] = h5py.VirtualSource(str(outside / "other.h5"), "data", shape=(2,))
    f["metrics"].create_virtual_dataset("virtual", layout, fillvalue=np.nan)


def _external_storage(f, outside):
    f["metrics"].create_dataset("raw", shape=(2,), dtype="f8",
                                external=[(str(outside / "raw.bin"), 0, 16)])


def _replace(name, **kwargs):
    def craft(f, outside):
        del f[name]
        f.create_dataset(name, **kwargs)
    return craft


def _fletcher(f):
    """The step column with a Fletcher-32 checksum, its stored bytes then changed."""
    del f["metrics/step"]
    ds = f["metrics"].create_dataset("step", data=np.array([1, 2]), maxshape=(None,),
                                     chunks=(64,), fletcher32=True)
    f.flush()
    offset = ds.id.get_chunk_info(0).byte_offset
    filename = f.filename
    f.close()
    with open(filename, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff")


def _hard_link_cycle(f, outside):
    f["metrics/loop"] = f["metrics"]


RUN_FILE_CRAFTS = {
    "external link to a chunked dataset": (_external_dataset, "external link"),
    "external link as a group": (_external_group, "external link"),
    "soft link": (_soft_link, "SoftLink"),
    "virtual dataset": (_virtual, "virtual dataset"),
    "dataset stored in another file": (_external_storage, "stored in another file"),
    "2-D step": (_replace("metrics/step", data=np.ones((2, 2), np.int64),
                          maxshape=(None, 2), chunks=(64, 2)), "/metrics/step"),
    "step of strings": (_replace("metrics/step", data=np.array([b"1", b"2"]),
                                 maxshape=(None,), chunks=(64,)), "/metrics/step"),
    "step 2^50": (_replace("metrics/step", data=np.array([1, 2 ** 50]), maxshape=(None,),
                           chunks=(64,)), "/metrics/step"),
    "column of strings": (_replace("metrics/loss", data=np.array([b"a", b"b"]),
                                   maxshape=(None,), chunks=(64,)), "/metrics/loss"),
    "column of fixed length": (_replace("metrics/loss", data=np.ones(2)), "/metrics/loss"),
    "hard link cycle": (_hard_link_cycle, "nested"),
    "huge sparse step": (_replace("metrics/step", shape=(2 ** 37,), dtype="i8",
                                  maxshape=(None,), chunks=(64,)), "rows never written"),
    "huge sparse column": (_replace("metrics/loss", shape=(2, 2 ** 27), dtype="f8",
                                    maxshape=(None, 2 ** 27), chunks=(1, 2 ** 17)),
                           "rows never written"),
    "Fletcher checksum failure": (lambda f, outside: _fletcher(f), "damaged"),
}


def crafted_run_file(tmp_path, outside, name) -> tuple:
    """(path, bytes) of a valid run file crafted by RUN_FILE_CRAFTS[name]."""
    path = run_dir(tmp_path) / "essa.h5"
    make_run_file(str(path))
    f = h5py.File(path, "a")
    try:
        RUN_FILE_CRAFTS[name][0](f, outside)
    finally:
        f.close()  # a no-op where the crafting closed it to edit the bytes
    return str(path), path.read_bytes()


@pytest.mark.parametrize("name", list(RUN_FILE_CRAFTS))
def test_a_crafted_run_file_is_refused(name, tmp_path, outside):
    """Resumed without a checkpoint copy: one line naming the file and the object."""
    path, _ = crafted_run_file(tmp_path, outside, name)
    with pytest.raises(UserError) as caught:
        store = RunStore(path, True, {"status": "x"}, resume=True)
        store.log_step(3, metrics={"loss": 1.0}, timings={"rollout": np.zeros(2)})
    one_line(caught.value, path, RUN_FILE_CRAFTS[name][1])


@pytest.mark.parametrize("name", ["external link to a chunked dataset", "soft link",
                                  "virtual dataset", "2-D step"])
def test_a_crafted_run_file_copy_in_a_checkpoint_falls_back(name, tmp_path, capsys, outside,
                                                            valid_method_state):
    _, crafted = crafted_run_file(tmp_path, outside, name)
    ckpts = run_dir(tmp_path) / "checkpoints"
    save_checkpoint(str(ckpts), 1, loop_state(1, make_run_file(str(tmp_path / "ok.h5")),
                                              valid_method_state))
    save_checkpoint(str(ckpts), 2, loop_state(2, crafted, valid_method_state))
    assert_fallback(ckpts, capsys, RUN_FILE_CRAFTS[name][1])


# --- links planted at the names the job writes ---------------------------------------------

def test_links_at_checkpoint_names(tmp_path, capsys, outside, valid_method_state):
    ckpts = run_dir(tmp_path) / "checkpoints"
    victim = outside / "victim.txt"
    state = loop_state(1, None, valid_method_state)
    save_checkpoint(str(ckpts), 1, state)
    # The temporary names of earlier versions: not used any more, never followed.
    for name in ("step-00000002.safetensors.tmp", "step-00000002.sha256.tmp"):
        os.symlink(victim, ckpts / name)
    save_checkpoint(str(ckpts), 2, dict(state, step=2))
    assert sorted(p for p in os.listdir(ckpts) if not p.endswith(".tmp")) == [
        "step-00000001.safetensors", "step-00000001.sha256",
        "step-00000002.safetensors", "step-00000002.sha256"]
    # A link at a final name is refused when writing...
    for name in ("step-00000003.safetensors", "step-00000004.sha256"):
        os.symlink(victim, ckpts / name)
        step = int(name[5:13])
        with pytest.raises(UserError) as caught:
            save_checkpoint(str(ckpts), step, dict(state, step=step))
        one_line(caught.value, name, "symbolic link")
        assert os.path.islink(ckpts / name)
        os.remove(ckpts / name)
    # ... and when reading: step 2 made a link to a copy of itself elsewhere -> step 1.
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(ckpts / "step-00000002.safetensors", elsewhere)
    os.remove(ckpts / "step-00000002.safetensors")
    os.symlink(elsewhere, ckpts / "step-00000002.safetensors")
    assert_fallback(ckpts, capsys, "symbolic link")


def test_a_linked_checkpoint_folder_is_refused(tmp_path, outside, valid_method_state):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(outside, out / "checkpoints")
    for use in (lambda: save_checkpoint(str(out / "checkpoints"), 1, {"step": 1}),
                lambda: load_latest(str(out / "checkpoints"))):
        with pytest.raises(UserError) as caught:
            use()
        one_line(caught.value, "checkpoints", "symbolic link")


def test_links_at_run_file_names(tmp_path, outside):
    out = run_dir(tmp_path)
    victim = str(outside / "victim.txt")
    # <method>.h5.tmp (the old temporary name) is never followed; the file is created.
    os.symlink(victim, out / "essa.h5.tmp")
    RunStore(str(out / "essa.h5"), True, {}).close()
    assert RunFile(str(out / "essa.h5")).attrs["status"] == "complete"
    # A link at the run file itself: refused, new run or resumed, with or without a copy.
    os.remove(out / "essa.h5")
    os.symlink(outside / "other.h5", out / "essa.h5")
    for resume, backup in ((False, None), (True, None), (True, b"any")):
        with pytest.raises(UserError) as caught:
            RunStore(str(out / "essa.h5"), True, {}, resume=resume, backup=backup)
        one_line(caught.value, "essa.h5", "symbolic link")
    # A hard link to a file elsewhere (same file system): refused too.
    os.remove(out / "essa.h5")
    os.link(outside / "other.h5", out / "essa.h5")
    with pytest.raises(UserError) as caught:
        RunStore(str(out / "essa.h5"), True, {}, resume=True)
    one_line(caught.value, "essa.h5", "link")


def test_links_at_lock_and_write_test(tmp_path, outside):
    out = run_dir(tmp_path)
    os.symlink(outside / "victim.txt", out / ".write-test")
    run_folder_module.check_writable(str(out), 0)  # a unique name of its own: the link is left
    assert os.path.islink(out / ".write-test")
    plants = {"symbolic link": lambda lock: os.symlink(outside / "victim.txt", lock),
              "hard link": lambda lock: os.link(outside / "victim.txt", lock),
              "special file": os.mkfifo}  # a FIFO would block a plain open()
    for what, plant in plants.items():
        plant(out / ".lock")
        with pytest.raises(UserError) as caught:
            run_folder_module.lock_run_folder(str(out), "job-1")
        one_line(caught.value, ".lock", what)
        os.remove(out / ".lock")


# --- the same through the real CLI ---------------------------------------------------------

def sft_args(out, steps, *extra):
    return ["-m", "sft", "model.path=toy", "task.n_train=200", "task.n_eval=16",
            "sft.batch_size=8", f"sft.steps={steps}", "eval.every=0", "eval.n_samples=2",
            "run.progress=false", "run.checkpoint_every=1", f"run.out={out}", *extra]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A finished 2-step toy SFT run (checkpoints 1 and 2), one process."""
    out = tmp_path_factory.mktemp("sft") / "run"
    proc = run_cli(sft_args(out, 2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_run(sft_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(sft_run, out, symlinks=True)
    return out


def assert_one_error_line(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in our_lines(proc.stderr) if line.startswith("error")]
    assert len(errors) == 1, our_lines(proc.stderr)
    for word in words:
        assert word in errors[0], errors[0]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("sft_run")  # one worker runs it once
def test_cli_external_link_in_the_run_file_is_refused_under_mpirun(sft_run, tmp_path, outside):
    out = copy_run(sft_run, tmp_path)
    shutil.rmtree(out / "checkpoints")  # no copy to restore: the run file itself is opened
    with h5py.File(out / "sft.h5", "a") as f:
        name = next(k for k in f["metrics"] if k != "step")
        del f["metrics"][name]
        f["metrics"][name] = h5py.ExternalLink(str(outside / "other.h5"), "/data")
    proc = run_mpi(2, sft_args(out, 3, "--resume"))
    assert_one_error_line(proc, "sft.h5", "external link")


@pytest.mark.toy
@pytest.mark.xdist_group("sft_run")  # one worker runs it once
def test_cli_crafted_newest_checkpoint_falls_back(sft_run, tmp_path, outside):
    out = copy_run(sft_run, tmp_path)
    ckpts = str(out / "checkpoints")
    state = load_latest(ckpts)
    save_checkpoint(ckpts, 2, dict(state, step="2"))
    for name in (".write-test", "sft.h5.tmp", "checkpoints/step-00000003.safetensors.tmp",
                 "checkpoints/step-00000003.sha256.tmp"):
        os.symlink(outside / "victim.txt", out / name)
    proc = run_cli(sft_args(out, 3, "--resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    warnings = [line for line in our_lines(proc.stderr) if line.startswith("warning")]
    assert len(warnings) == 1 and "step-00000002" in warnings[0] and "'step'" in warnings[0], \
        warnings
    assert RunFile(str(out / "sft.h5")).group("metrics")["step"].tolist() == [1, 2, 3]
    assert [os.path.basename(p) for p in list_checkpoints(ckpts)][-1] == \
        "step-00000003.safetensors"


@pytest.mark.toy
@pytest.mark.xdist_group("sft_run")  # one worker runs it once
def test_cli_link_at_the_lock_is_one_line(sft_run, tmp_path, outside):
    out = copy_run(sft_run, tmp_path)
    os.remove(out / ".lock")
    os.symlink(outside / "victim.txt", out / ".lock")
    proc = run_cli(sft_args(out, 3, "--resume"))
    assert_one_error_line(proc, ".lock", "symbolic link")
    assert RunFile(str(out / "sft.h5")).attrs["status"] == "complete"


# Sharded (DCP) checkpoints, in one process: a damaged, missing or linked file is a reason
# to fall back (verify_sharded), a crafted manifest or metadata one line (never code run).

def one_process_world():
    from mpi4py import MPI

    from hpc.runtime.world import World
    return World(comm=MPI.COMM_SELF, rank=0, size=1, local_rank=0, local_size=1,
                 hostname="here")


def sharded_template():
    import torch
    return {"model": {"w": torch.arange(12.0).reshape(4, 3)},
            "optimizer": {"state": {"w": {"step": torch.tensor(2.0),
                                          "exp_avg": torch.full((4, 3), 0.5)}},
                          "param_groups": [{"lr": 1e-3, "params": ["w"]}]}}


@pytest.fixture
def sharded(tmp_path):
    """(checkpoint folder, manifest) of a sharded checkpoint of step 3 written by 1 rank."""
    import warnings

    from hpc.runtime.distckpt import save_sharded
    ckpt = str(tmp_path / "checkpoints")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is ... a single process"
        manifest = save_sharded(ckpt, one_process_world(), 3, sharded_template())
    return ckpt, manifest


def _folder(ckpt, manifest):
    return os.path.join(ckpt, "sharded", manifest["folder"])


def _flip_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _sharded_crafts():
    def damaged(folder, outside):
        _flip_byte(os.path.join(folder, "__0_0.distcp"))

    def truncated(folder, outside):
        path = os.path.join(folder, "__0_0.distcp")
        os.truncate(path, os.path.getsize(path) // 2)

    def missing(folder, outside):
        os.remove(os.path.join(folder, ".metadata"))

    def linked(folder, outside):
        path = os.path.join(folder, "__0_0.distcp")
        shutil.copy(path, outside.parent / "copy.distcp")
        os.remove(path)
        os.symlink(outside.parent / "copy.distcp", path)

    def folder_gone(folder, outside):
        shutil.rmtree(folder)

    return {"damaged": (damaged, "checksum mismatch"),
            "truncated": (truncated, "checksum mismatch"),
            "missing file": (missing, ".metadata"),
            "file is a link": (linked, "symbolic link"),
            "folder missing": (folder_gone, "no folder")}


SHARDED_CRAFTS = _sharded_crafts()


@pytest.mark.parametrize("name", list(SHARDED_CRAFTS))
def test_a_damaged_sharded_checkpoint_is_a_reason_to_fall_back(name, sharded, outside):
    from hpc.runtime.distckpt import verify_sharded
    ckpt, manifest = sharded
    assert verify_sharded(ckpt, one_process_world(), manifest) is None
    craft, words = SHARDED_CRAFTS[name]
    craft(_folder(ckpt, manifest), outside)
    reason = verify_sharded(ckpt, one_process_world(), manifest)
    assert reason is not None and words in reason and "\n" not in reason, reason


def _rehash(ckpt, manifest, name):
    """The manifest a crafter who rewrote ``name`` would also write (its new sha256)."""
    path = os.path.join(_folder(ckpt, manifest), name)
    files = dict(manifest["files"], **{name: hashlib.sha256(open(path, "rb").read()
                                                             ).hexdigest()})
    return dict(manifest, files=files)


class _RunsCode:
    """Unpickled, it would create the file ``marker`` (proof that a pickle ran code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _metadata_running_code(ckpt, manifest, outside):
    import pickle
    with open(os.path.join(_folder(ckpt, manifest), ".metadata"), "wb") as fh:
        pickle.dump(_RunsCode(str(outside / "ran")), fh)
    return "io.open"


def _metadata_pointing_outside(ckpt, manifest, outside):
    import pickle
    path = os.path.join(_folder(ckpt, manifest), ".metadata")
    with open(path, "rb") as fh:
        metadata = pickle.load(fh)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../outside/raw.bin"
    with open(path, "wb") as fh:
        pickle.dump(metadata, fh)
    return "points at"


class _Getattr:
    """Unpickled, ``getattr(owner, name)``: how early Python 3.11 releases pickle an Enum
    member, here aimed at what is not one."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


def _metadata_getattr_of_no_member(ckpt, manifest, outside):
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    with open(os.path.join(_folder(ckpt, manifest), ".metadata"), "wb") as fh:
        pickle.dump([_Getattr(torch.Size, "__new__"), _Getattr(_MEM_FORMAT_ENCODING,
                                                               "__class__")], fh)
    return "names no member of an allowed Enum"


@pytest.mark.parametrize("craft", [_metadata_running_code, _metadata_pointing_outside,
                                   _metadata_getattr_of_no_member],
                         ids=["code", "outside path", "getattr of no Enum member"])
def test_crafted_sharded_metadata_is_one_line_and_runs_nothing(craft, sharded, outside):
    from hpc.runtime.distckpt import load_sharded
    ckpt, manifest = sharded
    words = craft(ckpt, manifest, outside)
    manifest = _rehash(ckpt, manifest, ".metadata")
    with pytest.raises(UserError) as caught:
        load_sharded(ckpt, manifest, sharded_template(), 3)
    one_line(caught.value, words, "does not fit")
    assert not (outside / "ran").exists()


def test_a_sharded_checkpoint_of_other_shapes_is_one_line(sharded):
    import torch

    from hpc.runtime.distckpt import load_sharded
    ckpt, manifest = sharded
    template = sharded_template()
    template["model"]["w"] = torch.zeros(5, 3)
    with pytest.raises(UserError) as caught:
        load_sharded(ckpt, manifest, template, 3)
    one_line(caught.value, "does not fit", "written by 1 ranks")


def test_an_untouched_sharded_checkpoint_loads_exactly(sharded):
    import torch

    from hpc.runtime.distckpt import load_sharded
    ckpt, manifest = sharded
    template = sharded_template()
    template["model"]["w"].zero_()
    template["optimizer"]["state"]["w"]["exp_avg"].zero_()
    load_sharded(ckpt, manifest, template, 3)
    want = sharded_template()
    assert torch.equal(template["model"]["w"], want["model"]["w"])
    assert torch.equal(template["optimizer"]["state"]["w"]["exp_avg"],
                       want["optimizer"]["state"]["w"]["exp_avg"])


MANIFEST_CRAFTS = {
    "not a dict": ([1, 2], "'sharded'"),
    "extra key": ({"folder": "step-00000003", "ranks": 1, "files": {".metadata": "0" * 64},
                   "code": "x"}, "'sharded'"),
    "other step": ({"folder": "step-00000002", "ranks": 1, "files": {".metadata": "0" * 64}},
                   "'sharded.folder'"),
    "path in folder": ({"folder": "../../x", "ranks": 1, "files": {".metadata": "0" * 64}},
                       "'sharded.folder'"),
    "negative ranks": ({"folder": "step-00000003", "ranks": -1,
                        "files": {".metadata": "0" * 64}}, "'sharded.ranks'"),
    "file outside": ({"folder": "step-00000003", "ranks": 1,
                      "files": {".metadata": "0" * 64, "../raw.bin": "0" * 64}},
                     "'sharded.files'"),
    "bad checksum": ({"folder": "step-00000003", "ranks": 1, "files": {".metadata": "zz"}},
                     "'sharded.files'"),
    "no metadata": ({"folder": "step-00000003", "ranks": 1,
                     "files": {"__0_0.distcp": "0" * 64}}, "'sharded.files'"),
}


@pytest.mark.parametrize("name", list(MANIFEST_CRAFTS))
def test_a_crafted_sharded_manifest_is_one_line(name):
    from hpc.runtime.distckpt import check_manifest
    value, words = MANIFEST_CRAFTS[name]
    with pytest.raises(UserError) as caught:
        check_manifest(value, "checkpoint x", 3)
    one_line(caught.value, words)


def test_retention_removes_unfinished_and_pruned_sharded_folders(sharded, tmp_path):
    from hpc.runtime.distckpt import prune_sharded, save_sharded
    ckpt, manifest = sharded
    root = os.path.join(ckpt, "sharded")
    os.makedirs(os.path.join(root, ".step-00000004.tmp-abc"))  # a kill while writing
    save_checkpoint(ckpt, 3, {"step": 3, "sharded": manifest}, keep=1)
    prune_sharded(ckpt)
    assert os.listdir(root) == ["step-00000003"]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        later = save_sharded(ckpt, one_process_world(), 5, sharded_template())
    assert sorted(os.listdir(root)) == ["step-00000003", "step-00000005"]  # not committed
    save_checkpoint(ckpt, 5, {"step": 5, "sharded": later}, keep=1)
    prune_sharded(ckpt)
    assert os.listdir(root) == ["step-00000005"]


# --- values read back: NaN, -1, wrong kinds (issue 29) --------------------------------------

def _state_values(state):
    """(path, number or array) of every numeric CMA-ES state value."""
    for path, value in state["optimizer"]["es"]["values"].items():
        if isinstance(value, (bool, np.bool_, str)) or value is None:
            continue
        if isinstance(value, (int, float, np.integer, np.floating)) or (
                isinstance(value, np.ndarray) and value.dtype.kind in "iuf" and value.size):
            yield path, value


def _poisoned(value, fill):
    if isinstance(value, np.ndarray):
        if fill != fill and value.dtype.kind != "f":
            return None
        out = value.copy()
        out.reshape(-1)[0] = fill
        return out
    return fill if fill != fill else type(value)(fill)


def test_every_cma_state_value_nan_or_minus_one_is_refused_or_runs_on(valid_method_state):
    """NaN and -1 in each CMA-ES state value: refused as one line naming it, or (a value that
    may be -1, e.g. a coordinate of the mean) three more generations with a finite mean and
    step size; never an exception from pycma, never a hang (10 s alarm)."""
    import signal

    def hang(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, hang)
    outcomes, bad = {}, []
    try:
        for path, value in _state_values(valid_method_state):
            for tag, fill in (("nan", float("nan")), ("-1", -1)):
                poisoned = _poisoned(value, fill)
                if poisoned is None:
                    continue
                state = copy.deepcopy(valid_method_state)
                state["optimizer"]["es"]["values"][path] = poisoned
                opt = fresh_optimizer()
                signal.alarm(10)
                try:
                    opt.load_state_dict(state)
                    for _ in range(3):
                        x = opt.ask()
                        opt.tell(x, -np.sum(x ** 2, axis=1))
                    ok = np.isfinite(opt.mean).all() and np.isfinite(opt.sigma)
                    outcomes[path, tag] = "ran" if ok else "ran non-finite"
                except UserError as err:
                    one_line(err, repr(path))
                    outcomes[path, tag] = "refused"
                except BaseException as err:  # noqa: B036 - what the test looks for
                    outcomes[path, tag] = f"{type(err).__name__}: {err}"[:200]
                finally:
                    signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    bad = {k: v for k, v in outcomes.items() if v not in ("refused", "ran")}
    assert not bad, bad
    assert len(outcomes) > 200
    for path in ("sigma", "sm.C", "sm.D", "countiter", "countevals", "sp.cc", "sp.weights.mueff",
                 "sm.dimension", "sigma_vec.scaling", "mean", "pc"):
        assert outcomes[path, "nan"] == "refused", path
    for path in ("sigma", "countiter", "countevals", "sp.popsize", "sm.dimension", "sp.cc"):
        assert outcomes[path, "-1"] == "refused", path


def _optimizer_state():
    """TrainedWeights (F-GRPO's AdamW over fp32 masters) after one step: (weights, state)."""
    import torch

    from hpc.models.parallelize import TrainedWeights

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    weights = TrainedWeights(params, 1e-3, 0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    weights.step(1.0)
    return weights, weights.state_dict()


def _nan_at(tensor):
    tensor.view(-1)[0] = float("nan")


ADAM_CRAFTS = {
    "exp_avg of the wrong shape": (lambda s: s["optimizer"]["state"][0].__setitem__(
        "exp_avg", __import__("torch").zeros(4, 3)), "exp_avg"),
    "negative step": (lambda s: s["optimizer"]["state"][0].__setitem__(
        "step", __import__("torch").tensor(-1.0)), "step"),
    "betas a string": (lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", "ab"),
                       "betas"),
    "params as ints": (lambda s: s.__setitem__("params", [1, 2]), "params"),
    "group params as floats": (lambda s: s["optimizer"]["param_groups"][0].__setitem__(
        "params", [0.5, 1]), "params"),
    "NaN in exp_avg_sq": (lambda s: _nan_at(s["optimizer"]["state"][1]["exp_avg_sq"]),
                          "exp_avg_sq"),
    "NaN learning rate": (lambda s: s["optimizer"]["param_groups"][0].__setitem__(
        "lr", float("nan")), "lr"),
    "learning rate 1e30": (lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", 1e30),
                           "lr"),
    "NaN parameter": (lambda s: _nan_at(s["params"][0]), "params[0]"),
    "infinite moment": (lambda s: s["optimizer"]["state"][0]["exp_avg"].view(-1).__setitem__(
        0, float("inf")), "exp_avg"),
    # accepted before: load_state_dict casts a moment to its parameter's dtype, another model
    "bfloat16 exp_avg": (lambda s: s["optimizer"]["state"][0].__setitem__(
        "exp_avg", s["optimizer"]["state"][0]["exp_avg"].bfloat16()),
                         "'optimizer.state[0].exp_avg' is torch.bfloat16, where the job keeps "
                         "torch.float32"),
    "float16 exp_avg_sq": (lambda s: s["optimizer"]["state"][1].__setitem__(
        "exp_avg_sq", s["optimizer"]["state"][1]["exp_avg_sq"].half()), "exp_avg_sq"),
    "bfloat16 step": (lambda s: s["optimizer"]["state"][0].__setitem__(
        "step", s["optimizer"]["state"][0]["step"].bfloat16()), "keeps float32"),
    "float64 parameter": (lambda s: s["params"].__setitem__(1, s["params"][1].double()),
                          "'params[1]' is torch.float64"),
}


@pytest.mark.parametrize("name", list(ADAM_CRAFTS))
def test_a_crafted_optimizer_state_is_one_line(name, tmp_path, capsys):
    """F-GRPO's weights and AdamW state through a real checkpoint file: refused as one line
    naming the field, so load_latest falls back to the previous checkpoint."""
    weights, state = _optimizer_state()
    craft, word = ADAM_CRAFTS[name]
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(str(ckpts), 1, {"method": copy.deepcopy(state)})
    bad = copy.deepcopy(state)
    craft(bad)
    save_checkpoint(str(ckpts), 2, {"method": bad})
    capsys.readouterr()
    loaded = load_latest(str(ckpts), accept=lambda s, _: weights.load_state_dict(s["method"]))
    assert loaded is not None
    warning = capsys.readouterr().err
    assert "step-00000002" in warning and word in warning, warning
    os.remove(ckpts / "step-00000001.safetensors")
    with pytest.raises(UserError) as caught:
        load_latest(str(ckpts), accept=lambda s, _: weights.load_state_dict(s["method"]))
    one_line(caught.value, word)


def _skeleton_file(skeleton: str, tensors: dict) -> bytes:
    return save_numpy(tensors, metadata={"format": FORMAT, "skeleton": skeleton})


SKELETON_CRAFTS = {
    "tensor name as a list": ('{"type": "tensor", "tensor": ["t0"]}', {"t0": np.zeros(2)},
                              "missing tensor"),
    "list items an int": ('{"type": "list", "items": 5}', {"t0": np.zeros(2)}, "items"),
    "dict items ints": ('{"type": "dict", "items": [1, 2]}', {"t0": np.zeros(2)},
                        "malformed dict entry"),
    "empty numpy scalar": ('{"type": "dict", "items": [["x", {"type": "numpy_scalar", '
                           '"tensor": "t0"}]]}', {"t0": np.zeros(0)}, "numpy scalar"),
    "15M-item list": ('{"type": "list", "items": [' + ",".join(["[]"] * 15_000_000) + ']}',
                      {"t0": np.zeros(2)}, "JSON values"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("15M")
                                  else n for n in SKELETON_CRAFTS])
def test_a_crafted_skeleton_falls_back(name, tmp_path, capsys, valid_method_state):
    skeleton, tensors, words = SKELETON_CRAFTS[name]
    ckpts = run_dir(tmp_path) / "checkpoints"
    run_bytes = make_run_file(str(tmp_path / "make.h5"))
    save_checkpoint(str(ckpts), 1, loop_state(1, run_bytes, valid_method_state))
    plant_raw(ckpts, 2, _skeleton_file(skeleton, tensors))
    assert_fallback(ckpts, capsys, words)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_16_or_8_bit_array_in_the_essa_state_falls_back(dtype, tmp_path, capsys,
                                                          valid_method_state):
    """A tensor of a dtype numpy lacks where the ESSA state holds a numpy array."""
    import torch
    from safetensors.torch import load as load_tensors, save as save_tensors

    ckpts = run_dir(tmp_path) / "checkpoints"
    run_bytes = make_run_file(str(tmp_path / "make.h5"))
    save_checkpoint(str(ckpts), 1, loop_state(1, run_bytes, valid_method_state))
    good = save_checkpoint(str(ckpts), 2, loop_state(2, run_bytes, valid_method_state))
    with open(good, "rb") as fh:
        data = fh.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    import json
    metadata = json.loads(data[8:8 + header_len])["__metadata__"]
    tensors = load_tensors(data)
    name = next(iter(tensors))
    tensors[name] = tensors[name].to(getattr(torch, dtype))
    plant_raw(ckpts, 2, save_tensors(tensors, metadata=metadata))
    assert_fallback(ckpts, capsys, dtype)


def test_all_zero_rng_keys_are_refused_not_a_hang(tmp_path, capsys, valid_method_state):
    ckpts = run_dir(tmp_path) / "checkpoints"
    save_checkpoint(str(ckpts), 1, loop_state(1, None, valid_method_state))
    bad = loop_state(2, None, valid_method_state)
    bad["method"]["optimizer"]["rng_keys"] = np.zeros(624, np.uint32)
    save_checkpoint(str(ckpts), 2, bad)
    assert_fallback(ckpts, capsys, "'rng_keys'", "all zeros")


def test_a_hard_linked_checkpoint_falls_back(tmp_path, capsys, valid_method_state):
    ckpts = run_dir(tmp_path) / "checkpoints"
    save_checkpoint(str(ckpts), 1, loop_state(1, None, valid_method_state))
    path = save_checkpoint(str(ckpts), 2, loop_state(2, None, valid_method_state))
    os.link(path, tmp_path / "elsewhere.safetensors")
    assert_fallback(ckpts, capsys, "hard link")


def test_checkpoints_as_a_file_is_one_line(tmp_path):
    from hpc.runtime.readback import run_folder_entries

    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")
    with pytest.raises(UserError) as caught:
        load_latest(str(out / "checkpoints"))
    one_line(caught.value, "checkpoints", "not a folder")
    with pytest.raises(UserError) as caught:
        run_folder_entries(str(out), "essa")
    one_line(caught.value, "checkpoints", "not a folder")


def test_a_failed_checkpoint_write_says_what_is_left(tmp_path, valid_method_state):
    """checkpoints/ replaced by a file mid-run said "earlier checkpoints are intact" when none
    was left; a write that fails beside earlier checkpoints names the newest left."""
    ckpts = run_dir(tmp_path) / "checkpoints"
    save_checkpoint(str(ckpts), 1, loop_state(1, None, valid_method_state))
    shutil.rmtree(ckpts)
    ckpts.write_text("not a folder")
    with pytest.raises(UserError) as caught:
        save_checkpoint(str(ckpts), 2, loop_state(2, None, valid_method_state))
    one_line(caught.value, "no longer a folder", "no checkpoint of this run is left")
    assert "intact" not in str(caught.value)
    ckpts.unlink()
    save_checkpoint(str(ckpts), 1, loop_state(1, None, valid_method_state))
    os.mkdir(ckpts / "step-00000002.safetensors")  # the name the next write needs is taken
    with pytest.raises(UserError) as caught:
        save_checkpoint(str(ckpts), 2, loop_state(2, None, valid_method_state))
    one_line(caught.value, "1 earlier checkpoint(s) are left", "step-00000001.safetensors")


def test_lock_as_a_folder_is_one_line(tmp_path):
    from hpc.runtime.readback import run_folder_entries

    out = tmp_path / "run"
    (out / ".lock").mkdir(parents=True)
    with pytest.raises(UserError) as caught:
        run_folder_entries(str(out), "sft")
    one_line(caught.value, ".lock", "not a plain file")
    with pytest.raises(UserError) as caught:
        run_folder_module.lock_run_folder(str(out), "1")
    one_line(caught.value, ".lock", "folder")


def _fingerprint(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("sft_run")  # one worker runs it once
def test_cli_run_out_a_symbolic_link_to_another_run_is_one_line(sft_run, tmp_path, resume):
    """run.out naming a link to another run folder, on 2 ranks: one line, nothing written."""
    other = copy_run(sft_run, tmp_path)
    before = _fingerprint(other)
    link = tmp_path / "link"
    os.symlink(other, link)
    proc = run_mpi(2, sft_args(link, 3, *(["--resume"] if resume else [])))
    assert_one_error_line(proc, str(link), "symbolic link")
    assert _fingerprint(other) == before


@pytest.mark.toy
@pytest.mark.xdist_group("sft_run")  # one worker runs it once
def test_cli_essa_in_a_finished_sft_folder_is_one_line(sft_run, tmp_path):
    """Another method's run folder: refused, not pruned (checkpoint retention used to delete
    the other run's checkpoints and the job exited 0)."""
    out = copy_run(sft_run, tmp_path)
    before = _fingerprint(out)
    proc = run_cli(["-m", "essa", "model.path=toy", f"lora.adapter={out / 'adapter'}",
                    "task.n_train=200", "task.n_eval=16", "essa.population=4",
                    "essa.minibatch=8", "essa.generations=2", "eval.every=0",
                    "eval.n_samples=2", "run.progress=false", "run.checkpoint_every=1",
                    f"run.out={out}"])
    assert_one_error_line(proc, "holds a sft run", "another folder")
    after = _fingerprint(out)
    assert {k: v for k, v in after.items() if k != ".lock"} == \
        {k: v for k, v in before.items() if k != ".lock"}


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("sft_run")  # one worker runs it once
def test_cli_checkpoints_as_a_file_on_resume_is_one_line_on_2_ranks(sft_run, tmp_path):
    out = copy_run(sft_run, tmp_path)
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").write_text("")
    proc = run_mpi(2, sft_args(out, 3, "--resume"))
    assert_one_error_line(proc, "checkpoints", "not a folder")


@pytest.mark.parametrize("key,value", [("mean", np.nan), ("adam_m", np.inf), ("adam_v", -1.0)])
def test_openai_es_moments_nan_or_negative_are_one_line(key, value):
    opt = make_optimizer("openai-es", DIM, POP, 0.1, seed=0)
    x = opt.ask()
    opt.tell(x, -np.sum(x ** 2, axis=1))
    state = opt.state_dict()
    state[key] = state[key].copy()
    state[key][0] = value
    with pytest.raises(UserError) as caught:
        make_optimizer("openai-es", DIM, POP, 0.1, seed=0).load_state_dict(state)
    one_line(caught.value, f"'{key}'")


PAD = 250 * 2 ** 20  # a checkpoint's JSON at the size limit (readback.MAX_JSON_BYTES, 256 MiB)
EXTRA_LIMIT = 2 * 2 ** 30  # what reading one may take on top of the process, file included
_READ_UNDER_A_LIMIT = r"""
import resource, sys
from hpc.runtime.checkpoint import load_latest
def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
before = vm("VmRSS:")
resource.setrlimit(resource.RLIMIT_AS, (vm("VmSize:") + int(sys.argv[2]),) * 2)
state = load_latest(sys.argv[1])
extra = vm("VmHWM:") - before  # (ru_maxrss would count the parent's pages from the fork)
print(f"step {state['step']} extra {extra}")
"""


def _padded_header(checkpoint: bytes) -> bytes:
    """``checkpoint`` with PAD spaces (JSON whitespace) at the end of its safetensors header."""
    (n,) = struct.unpack("<Q", checkpoint[:8])
    header = checkpoint[8:8 + n] + b" " * PAD
    return struct.pack("<Q", len(header)) + header + checkpoint[8 + n:]


def _padded_skeleton(checkpoint: bytes, pad: int = PAD) -> bytes:
    """``checkpoint`` with ``pad`` spaces inside its skeleton's JSON (a string of ``pad`` bytes
    in the header), written as safetensors writes a header (which refuses one over 100 MB)."""
    import json as json_module

    (n,) = struct.unpack("<Q", checkpoint[:8])
    header = json_module.loads(checkpoint[8:8 + n])
    header["__metadata__"]["skeleton"] += " " * pad
    text = json_module.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + checkpoint[8 + n:]


def _skeleton_90_mib(checkpoint: bytes) -> bytes:
    return _padded_skeleton(checkpoint, 90 * 2 ** 20)


@pytest.mark.parametrize("craft, words", [
    (_padded_header, "not a readable safetensors file"),  # safetensors' own 100 MB limit
    (_padded_skeleton, "not a readable safetensors file"),
    (_skeleton_90_mib, None),  # a valid checkpoint, 90 MiB of it whitespace: read
    (lambda _: _skeleton_file(SKELETON_CRAFTS["15M-item list"][0], {"t0": np.zeros(2)}),
     "JSON values"),
], ids=["header", "skeleton", "skeleton-90-MiB", "15M-item-list"])
@pytest.mark.subprocess
def test_json_at_the_size_limit_is_read_in_bounded_memory(tmp_path, valid_method_state, craft,
                                                         words):
    """A header padded with 200 MiB, a skeleton with 90 MiB and a 15M-item list ended in
    MemoryError (the regex that blanked JSON strings took ~120 bytes a byte): each is read
    (step 2 holds step 1's state, padded) or refused (a warning, then step 1) under a 2 GiB
    limit on the process's address space, and peaks below it."""
    import subprocess
    import sys

    ckpts = run_dir(tmp_path) / "checkpoints"
    run_bytes = make_run_file(str(tmp_path / "make.h5"))
    save_checkpoint(str(ckpts), 1, loop_state(1, run_bytes, valid_method_state))
    first = (ckpts / "step-00000001.safetensors").read_bytes()
    plant_raw(ckpts, 2, craft(first))
    proc = subprocess.run([sys.executable, "-c", _READ_UNDER_A_LIMIT, str(ckpts),
                           str(EXTRA_LIMIT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    done, extra = proc.stdout.split()[1], int(proc.stdout.split()[3])
    assert done == "1", proc.stdout + proc.stderr[-1000:]
    assert extra < EXTRA_LIMIT, extra
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    if words:
        assert len(warnings) == 1 and "step-00000002" in warnings[0] and words in warnings[0], \
            warnings
    else:
        assert warnings == [], warnings
    print(f"{craft.__name__}: extra peak {extra / 2 ** 20:.0f} MiB")
