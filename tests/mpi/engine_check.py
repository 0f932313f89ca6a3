"""Run under mpirun: the decoding engine on each rank's share, and sampled evaluation.

``engine_check.py OUT.json [--members]``: with ``--members`` every rank first checks that the
engine's greedy completions equal the HF reference (``member_completions``) for k = 1, 3 and 8
members of an ESSA space on its share of mixed-length prompts (an AssertionError fails the
run). Then all ranks evaluate the toy model on 24 held-out problems (4 samples each, temperature
1.5) through :func:`hpc.evaluate.evaluate`; rank 0 writes accuracy and the pass@k curve.
"""
import json
import sys

import numpy as np
import torch

from hpc.engine.generate import member_completions
from hpc.models.adapter_space import SingularValueSpace
from hpc.engine.engine_backend import EngineBackend
from hpc.engine.generate import eos_ids
from hpc.engine.scheduler import Request
from hpc.models.loading import attach_lora, load_model, randomize_lora_b
from hpc.toys.toy import tiny_model, toy_model_path

MAX_NEW = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def mixed_prompts(n: int) -> list:
    """``n`` addition prompts with 1- to 3-digit operands (several token lengths)."""
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, 10 ** rng.integers(1, 4, (2, n)))
    return [f"{x}+{y}=" for x, y in zip(a, b)]


def adapted_toy():
    """The trained toy with a small random LoRA (rank 4) on every linear of its layers."""
    model, tok = load_model(toy_model_path())
    peft = attach_lora(model, 4, 8.0, TARGETS)
    randomize_lora_b(peft, 0.02, torch.Generator().manual_seed(3))
    return peft, tok


def toy_members(space, k: int) -> np.ndarray:
    """``k`` ESSA members (k, dim): offsets of 30% of each searched singular value."""
    rng = np.random.default_rng(k)
    return rng.normal(0.0, 0.3, (k, space.dim)) * space.singular_values()


def random_model_of(arch: str, **config):
    """A random 2-layer model of ``arch`` (hidden 64, 2 heads of 32, 1 KV head) whose every
    weight, norms included, is N(0, 0.3^2) (biases N(0, 0.05^2)): completions then differ between prompts (at the
    default initialisation a tied model repeats one token), and the q/k norms' weights are not
    ones, so leaving them out would show."""
    model, tok = tiny_model(hidden=64, heads=2, kv_heads=1, seed=1, arch=arch)
    if config:
        for key, value in config.items():
            setattr(model.config, key, value)
        model = type(model)(model.config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if name.endswith("bias") else 0.3))
    return model, tok


def engine_member_texts(model, tok, factors: dict, prompts: list, k: int, rows: int) -> list:
    """Each member's greedy texts (k lists), all members' rows interleaved in one engine run."""
    requests = [Request(tok(p)["input_ids"], MAX_NEW, m, i) for i, p in enumerate(prompts)
                for m in range(k)]
    out = tok.batch_decode(EngineBackend().decode(model, requests, eos_ids(model, tok), None,
                                                  rows, members=factors),
                           skip_special_tokens=True)
    return [[out[i * k + m] for i in range(len(prompts))] for m in range(k)]


def check_members(world) -> None:
    model, tok = adapted_toy()
    space = SingularValueSpace.from_peft(model)
    prompts = np.array_split(np.array(mixed_prompts(24), dtype=object),
                             world.size)[world.rank].tolist()
    for k in (1, 3, 8):
        factors = space.factors_batch(toy_members(space, k))
        ref = member_completions(model, tok, factors, prompts, MAX_NEW, 16, backend="hf")
        got = engine_member_texts(model, tok, factors, prompts, k, rows=12)
        assert got == ref, f"rank {world.rank}, k = {k}: engine differs from HF generate"


def main(out_path: str, members: bool) -> None:
    from hpc.data.tasks import arith_task
    from hpc.evaluate import evaluate
    from hpc.job.config import EvalConfig
    from hpc.runtime.world import get_world

    world = get_world()
    torch.set_num_threads(1)
    if members:
        check_members(world)
    model, tok = load_model(toy_model_path())
    task = arith_task(n_train=10, n_eval=24, digits=2, ops="+-", seed=5)
    cfg = EvalConfig(n_samples=4, temperature=1.5, batch_size=5)
    result = evaluate(model, tok, task, task.eval, cfg, MAX_NEW, world, EngineBackend(), seed=9)
    if world.is_root:
        with open(out_path, "w") as fh:
            json.dump({"accuracy": result.accuracy, "pass_at_k": result.pass_at_k.tolist(),
                       "avg_at_n": result.avg_at_n}, fh)


if __name__ == "__main__":
    main(sys.argv[1], "--members" in sys.argv[2:])
