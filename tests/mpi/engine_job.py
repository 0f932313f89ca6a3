"""Run alone or under mpirun: an ESSA job on the toy with its decoding engine watched.

``engine_job.py OUT_PREFIX MODE [essa key=value ...]``; each rank writes
``OUT_PREFIX.<rank>.json``:

* ``memory``: the start evaluation, then the first generation, as :func:`run_loop` runs them;
  the engine's slots, max_len, k, KV-cache bytes and :func:`engine_memory` at the end of the
  evaluation (before :meth:`hpc.engine.engine_backend.EngineBackend.end_phase`), after it ({} once
  released) and after the generation.
* ``perturb-<R>``: the whole job with every engine's decode steps "replayed" by
  :class:`CheckedStep` on any device (so the self-check runs on CPU), rank R's replay perturbed;
  at the end, this rank's ``decoder.graph_failure`` and whether its engine still replays.
"""
import contextlib
import dataclasses
import json
import sys

from essa.method import METHOD
from essa.trainer import ESSA
from hpc.engine.graphs import GraphedDecode
from hpc.job.lifecycle import finish, start_job
from hpc.job.loop import run_loop
from hpc.runtime.runstore import RunStore
from hpc.runtime.timing import PhaseTimer


class CheckedStep(GraphedDecode):
    """A "captured" decode step that is the eager step, its logits plus ``offset`` (0: an exact
    capture, which the self-check passes; 1: a broken one, which it catches)."""

    offset = 0.0

    def capture(self, rows: int, ctx: int):
        engine = self.engine

        def replay():
            engine.decode_step(rows, ctx)
            engine.logits[:rows] += self.offset

        return replay


class PerturbedStep(CheckedStep):
    offset = 1.0


def engine_state(decoder) -> dict:
    """The decoder's engine ({} when it has none)."""
    engine = decoder.engine
    if engine is None:
        return {}
    return {"slots": engine.slots, "max_len": engine.cache.max_len, "k": engine.k,
            "kv_bytes": engine.cache.nbytes, "memory": engine.memory(),
            "replays": engine.graphs is not None}


@contextlib.contextmanager
def ends_of_evaluations(decoder):
    """Within the block, :func:`engine_state` at the end of each evaluation, before
    ``decoder.end_phase`` releases its engine, appended to the list yielded."""
    seen, end_phase = [], decoder.end_phase

    def watched(*args):
        seen.append(engine_state(decoder))
        return end_phase(*args)

    decoder.end_phase = watched
    try:
        yield seen
    finally:
        del decoder.end_phase


def main():
    prefix, mode, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    job = start_job(METHOD, argv)
    method = ESSA(job)
    report = {}
    if mode == "memory":
        method.store = RunStore(f"{job.out_dir}/essa.h5", job.world.is_root, {})
        method.timer = PhaseTimer(list(method.phases))
        with ends_of_evaluations(job.decoder) as seen:
            method.evaluate(sampled=True)
        report["end_of_start_eval"] = seen[0]
        report["after_start_eval"] = engine_state(job.decoder)
        method.step(0)
        report["after_generation"] = engine_state(job.decoder)
        method.store.close()
    else:
        bad_rank = int(mode.split("-")[1])
        replay = PerturbedStep if job.world.rank == bad_rank else CheckedStep
        job.decoder.config = dataclasses.replace(job.decoder.config, replay=replay)
        with ends_of_evaluations(job.decoder) as seen:
            summary = run_loop(job, method)
        finish(job, summary, "sft start", "essa mean")
        report.update(failure=job.decoder.graph_failure, end=seen[-1])
    with open(f"{prefix}.{job.world.rank}.json", "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main()
