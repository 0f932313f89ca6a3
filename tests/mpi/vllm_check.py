"""The vLLM backend against the package's engine, in vLLM's environment (.venv-vllm's python;
tests/test_vllm.py runs it and asserts on what it writes).

``vllm_check.py OUT.json``: one LLM a group of checks, on the trained toy (fp32, CPU, 48
mixed-length prompts): greedy and keyed-sampled tokens; the base weights changed in place (a
full fine-tune's step) and decoded again; 8 and 3 ESSA members as LoRA requests; a member with a
non-finite weight refused before vLLM sees it; the model's own adapter changed in place (an
F-GRPO step) and decoded again, once as the backend does it and once with the weight push
disabled (the stale-weights check must then fail); the adapter folder gone after ``close``;
then greedy tokens on a random Llama and a random Qwen3 of head_dim 32. Counts of equal
completions, as JSON.
"""
import json
import os
import sys
import time

import torch

import hpc.engine.vllm_backend as vllm_backend
from hpc.engine.engine_backend import EngineBackend
from hpc.engine.generate import eos_ids
from hpc.engine.scheduler import Request
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import load_model
from hpc.models.sampling import Sampling
from hpc.toys.toy import toy_model_path
from engine_check import adapted_toy, mixed_prompts, random_model_of, toy_members  # this folder

MAX_NEW = 8
ROWS = 16


def equal(got: list, want: list) -> int:
    return sum(a == b for a, b in zip(got, want)) if len(got) == len(want) else -1


def greedy(model, ids: list, k: int = 0) -> list:
    return [Request(p, MAX_NEW, m, i) for i, p in enumerate(ids) for m in range(max(k, 1))]


def base_checks(ids: list) -> dict:
    model, tok = load_model(toy_model_path())
    eos, out, backend = eos_ids(model, tok), {}, vllm_backend.VLLMBackend()
    reqs = greedy(model, ids)
    want = EngineBackend().decode(model, reqs, eos, None, ROWS)
    threads = torch.get_num_threads()
    out["greedy"] = equal(backend.decode(model, reqs, eos, None, ROWS), want)
    out["threads_kept"] = torch.get_num_threads() == threads
    out["start_s"] = backend.start_seconds
    out["eos_ended"] = sum(r[-1] in eos for r in want)
    sampling = Sampling(1.5, 0.95, 11)
    sampled = [Request(p, MAX_NEW, 0, i, j) for i, p in enumerate(ids) for j in range(4)]
    want_s = EngineBackend().decode(model, sampled, eos, sampling, ROWS)
    out["sampled"] = equal(backend.decode(model, sampled, eos, sampling, ROWS), want_s)
    out["sampled_distinct"] = len({tuple(r) for r in want_s})
    part = sampled[::-1][:50]  # another batch and order: the same samples
    out["sampled_reordered"] = equal(backend.decode(model, part, eos, sampling, 7),
                                     want_s[::-1][:50])
    weight = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():  # a full fine-tune's step, in place
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    after = EngineBackend().decode(model, reqs, eos, None, ROWS)
    out["base_changed"] = len(reqs) - equal(after, want)
    out["base_after_change"] = equal(backend.decode(model, reqs, eos, None, ROWS), after)
    backend.close()
    return out


def adapter_checks(ids: list) -> dict:
    model, tok = adapted_toy()
    eos, out, backend = eos_ids(model, tok), {}, vllm_backend.VLLMBackend()
    space = SingularValueSpace.from_peft(model)
    for k in (8, 3):
        factors = space.factors_batch(toy_members(space, k))
        reqs = [Request(p, MAX_NEW, m, i) for m in range(k) for i, p in enumerate(ids)]
        want = EngineBackend().decode(model, reqs, eos, None, ROWS * k, members=factors)
        start = time.perf_counter()
        out[f"members_{k}"] = equal(backend.decode(model, reqs, eos, None, ROWS * k,
                                                   members=factors), want)
        out[f"members_{k}_s"] = time.perf_counter() - start
        out[f"members_{k}_distinct"] = len({tuple(map(tuple, want[m * len(ids):(m + 1) * len(ids)]))
                                           for m in range(k)})
    bad = {n: (a.clone(), b.clone()) for n, (a, b) in factors.items()}
    next(iter(bad.values()))[1][1, 0, 0] = float("nan")
    try:
        backend.decode(model, reqs[:3], eos, None, ROWS, members=bad)
        out["nan_member"] = "decoded"
    except Exception as err:  # UserError: one line
        out["nan_member"] = f"{type(err).__name__}: {err}"
    out["members_after_refusal"] = equal(backend.decode(model, reqs, eos, None, ROWS * k,
                                                        members=factors), want)
    for push in (True, False):
        out[f"policy_push_{'on' if push else 'off'}"] = live_policy(model, backend, ids, eos, push)
    folder = backend.tmp
    backend.close()
    out["folder_removed"] = not os.path.exists(folder)
    return out


def live_policy(model, backend, ids: list, eos: list, push: bool) -> dict:
    """Decode the model's own adapter, change its lora_B in place (an optimizer step), decode
    again; ``push`` False keeps the adapter vLLM was given before the change (the push off)."""
    reqs = greedy(model, ids)
    before = backend.decode(model, reqs, eos, None, ROWS)
    ok_before = equal(before, EngineBackend().decode(model, reqs, eos, None, ROWS))
    g = torch.Generator().manual_seed(7 + push)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    want = EngineBackend().decode(model, reqs, eos, None, ROWS)
    cls = type(backend)
    pushing = cls._policy_request
    if not push:
        cls._policy_request = lambda self, *adapter: self.policy[1]
    try:
        got = backend.decode(model, reqs, eos, None, ROWS)
    finally:
        cls._policy_request = pushing
    return {"before": ok_before, "changed": len(reqs) - equal(want, before),
            "after": equal(got, want), "rows": len(reqs)}


def architecture_checks(ids_of) -> dict:
    out = {}
    for arch in ("llama", "qwen3"):
        model, tok = random_model_of(arch)
        ids = ids_of(tok)
        reqs = greedy(model, ids)
        eos = eos_ids(model, tok)
        want = EngineBackend().decode(model, reqs, eos, None, ROWS)
        backend = vllm_backend.VLLMBackend()
        out[arch] = equal(backend.decode(model, reqs, eos, None, ROWS), want)
        out[f"{arch}_distinct"] = len({tuple(r) for r in want})
        backend.close()
    return out


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    prompts = mixed_prompts(48)
    start = time.perf_counter()
    import vllm  # noqa: F401
    result = {"prompts": len(prompts), "import_vllm_s": time.perf_counter() - start,
              "version": vllm_backend.VLLMBackend.version()}
    tok = load_model(toy_model_path())[1]
    ids = [tok(p)["input_ids"] for p in prompts]
    result.update(base_checks(ids))
    result.update(adapter_checks(ids))
    result.update(architecture_checks(lambda t: [t(p)["input_ids"] for p in prompts]))
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
