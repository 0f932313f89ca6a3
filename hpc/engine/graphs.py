"""CUDA graphs of the engine's decode step, and their self-check.

The first time a decode shape is captured, a few steps replayed from the graph are compared
with the same steps run eagerly (:func:`compare_steps`); on a mismatch the engine decodes
eagerly from then on and records why (``DecodeEngine.graph_failure``); its owner
(:class:`hpc.engine.engine_backend.EngineBackend`) then builds no graphed engine again, and the job switches
graphs off on every rank and records it (:func:`hpc.job.loop.share_graph_check`).
"""
from __future__ import annotations

import torch

GRAPH_CHECK_STEPS = 3  # steps of a newly captured shape compared with eager ones
GRAPH_CHECK_TOLERANCE = 1 / 64  # |graph - eager| logits, relative to max(1, max |eager|):
#   four bfloat16 ulps (2**-8 each) of the largest logit


class GraphedDecode:
    """CUDA graphs of :meth:`hpc.engine.runner.DecodeEngine.decode_step`, one per (rows, ctx)
    bucket, captured on
    first use (after one warm-up call on a side stream) in one shared memory pool, and checked
    against the eager step (:func:`compare_steps`) before the first replay.

    A subclass may override :meth:`capture` (what "replaying" a shape runs); the test of the
    self-check replaces it by a perturbed eager step, which runs on any device."""

    def __init__(self, engine):
        self.engine, self.replays, self.pool = engine, {}, None
        self.failure = ""  # why a shape's self-check failed ('' while none did)

    def capture(self, rows: int, ctx: int):
        """Capture ``decode_step(rows, ctx)``; returns the function that replays it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.engine.decode_step(rows, ctx)  # warm-up: allocations, library handles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.engine.decode_step(rows, ctx)
        self.pool = graph.pool()
        return graph.replay

    def run(self, rows: int, ctx: int) -> bool:
        """Replay the step of shape (rows, ctx), capturing and checking it on first use.
        False when the check failed (nothing replayed; :attr:`failure` says why)."""
        replay = self.replays.get((rows, ctx))
        if replay is None:
            replay = self.capture(rows, ctx)
            failure = compare_steps(self.engine, replay, rows, ctx)
            if failure:
                self.failure = f"decode shape (rows {rows}, context {ctx}): {failure}"
                return False
            self.replays[(rows, ctx)] = replay
        replay()
        return True


def compare_steps(engine, replay, rows: int, ctx: int,
                  steps: int = GRAPH_CHECK_STEPS) -> str:
    """Run ``steps`` decode steps of shape (rows, ctx) eagerly and through ``replay`` from the
    engine's current inputs; each next step feeds the eager step's greedy tokens at the same
    cache positions. Returns '' when every step's logits agree within GRAPH_CHECK_TOLERANCE *
    max(1, max |eager logit|) and the greedy tokens are equal wherever the eager step's top two
    logits are further apart than that, else what differed. The engine's input tokens are
    restored; the cache positions written are the rows' current ones, which the next real step
    writes again."""
    saved = engine.tokens[:rows].clone()
    try:
        for i in range(steps):
            engine.decode_step(rows, ctx)
            eager = engine.logits[:rows].clone()
            replay()
            graph = engine.logits[:rows]
            tol = GRAPH_CHECK_TOLERANCE * max(1.0, float(eager.abs().max()))
            diff = float((graph - eager).abs().max())
            if not diff <= tol:  # NaN fails too
                return (f"step {i + 1} of {steps}: logits differ by up to {diff:.3g}, more than "
                        f"the tolerance {tol:.3g}")
            top2 = eager.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > tol
            flips = int(((graph.argmax(-1) != eager.argmax(-1)) & clear).sum())
            if flips:
                return f"step {i + 1} of {steps}: greedy tokens differ in {flips} of {rows} rows"
            engine.tokens[:rows] = eager.argmax(-1)
    finally:
        engine.tokens[:rows] = saved
    return ""
