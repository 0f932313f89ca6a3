"""The built-in toy model: a ~0.6M-parameter Qwen2 with a character tokenizer, half-taught
2-digit addition, so that LoRA SFT, ESSA and F-GRPO have headroom to show progress on CPU.

Built once (2-3 CPU minutes) and cached in ``$HPC_CACHE/toy-model-v3`` (default
``<repo>/.cache/toy-model-v3``) as a standard Hugging Face folder: ``config.json``,
``model.safetensors``, tokenizer files and ``toy_info.json`` (version, steps, accuracy,
kernels, weights hash, seconds; see :mod:`hpc.toys.cache`).

The toy learns addition abruptly: its held-out accuracy climbs from under 15% to over 80%
within about a hundred steps, and where that climb starts depends on the rounding of the CPU's
arithmetic (seen: step 750 on one CPU, 1,250 on another, for the same seeded steps). So a build
ends at what the model has learnt, not at a step count: at the first step whose greedy accuracy
on the demo's held-out problems reaches ``STOP_ACCURACY`` (checked every ``CHECK_EVERY``
steps, then every step once within ``CLOSE`` of it). Every CPU's build then starts the demo
from the same accuracy, within the step's granularity (under a point). The build also trains
under pinned kernels (:mod:`hpc.toys.pinned`), so the CPUs that round alike (the kernels a
caller would choose do not matter) build the same bytes.

Training data: all 2-digit ``a+b=`` problems except the first 1024 distinct problems of the
``arith`` stream with seed 0, so the demo task's held-out set (``task.seed=0``, ``n_eval`` up
to 1024) is never trained on. Of those reserved problems, 0..255 are the demo held-out set
(the reported accuracy, and the one the build stops on) and 512..767 the probe, logged every
``PROBE_EVERY`` steps. The clock never ends a build.
"""
from __future__ import annotations

import os
import random
import shutil
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from hpc.data.tasks import ARITH_TEMPLATE, _arith_problem
from hpc.engine.generate import generate
from hpc.runtime.errors import user_errors_exit
from hpc.toys import TOY_VERSION
from hpc.toys.cache import (INFO_FILE, build_into, cached_folder, check_built, read_info,
                            save_model_folder, train_steps)
from hpc.toys.pinned import kernels_pinned, pinned_description, train_pinned

VERSION = TOY_VERSION
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARACTERS = "0123456789+-*= abcdefghijklmnopqrstuvwxyz.,:?!()\n"
REBUILD = "hpc-toy --rebuild"

DATA_SEED = 1234  # toy training order/init; the demo task uses seed 0 for its problems
N_RESERVED = 1024  # first distinct problems of the seed-0 arith stream, never trained on
STOP_ACCURACY = 0.40  # a build ends at the first step whose held-out greedy accuracy reaches it
CHECK_EVERY = 10  # steps between held-out checks while far from STOP_ACCURACY...
CLOSE = 0.15  # ...and every step once within this of it (the climb: < 1 point a step)
MAX_STEPS = 4000  # a build that has not reached STOP_ACCURACY by then fails (none seen past 1,300)
BATCH = 64
LR = 1e-3
PROBE_EVERY = 50
WAIT_S = 2400.0  # how long a local rank > 0 waits for local rank 0's build


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character of ``CHARACTERS`` plus specials.

    Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the characters in order. No BOS is added;
    ``padding_side`` is ``left`` (generation).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def qwen2_config(vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2, intermediate: int | None = None) -> Qwen2Config:
    """A small Qwen2 config (tied embeddings, 64 positions) for the character tokenizer."""
    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=intermediate or 2 * hidden, max_position_embeddings=64,
                       tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                       bos_token_id=None)


def architecture_config(arch: str, vocab_size: int, hidden: int = 128, layers: int = 4,
                        heads: int = 4, kv_heads: int = 2, intermediate: int | None = None):
    """A small config of architecture ``arch`` (``qwen2``, ``llama``, ``mistral``, ``qwen3``)
    for the character tokenizer, each with what sets its family apart: Qwen2 tied with q/k/v
    biases (:func:`qwen2_config`); Llama 3.x untied with ``llama3`` RoPE scaling; Mistral
    untied, no biases, its 4096-token sliding window (wider than any row); Qwen3 with q/k
    norms and ``head_dim`` h / a (its default is 128)."""
    if arch == "qwen2":
        return qwen2_config(vocab_size, hidden, layers, heads, kv_heads, intermediate)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=intermediate or 2 * hidden, max_position_embeddings=64,
                  pad_token_id=0, eos_token_id=1, bos_token_id=None)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=hidden // heads, tie_word_embeddings=True)
    raise ValueError(f"no toy config for architecture {arch!r}")


CAUSAL_LM = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM, "mistral": MistralForCausalLM,
             "qwen3": Qwen3ForCausalLM}


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache_dir() -> str:
    """Where the toy model lives: ``$HPC_CACHE/<VERSION>`` or ``<repo>/.cache/<VERSION>``."""
    root = os.environ.get("HPC_CACHE") or os.path.join(
        _REPO, ".cache")
    return os.path.join(root, VERSION)


def _problem_sets() -> tuple[list, list, list]:
    """(train, demo held-out, probe) lists of ``(prompt, answer)`` for 2-digit addition."""
    rng, reserved, seen = random.Random(0), [], set()
    while len(reserved) < N_RESERVED:  # the arith task's stream for seed 0 (see hpc.data.tasks)
        question, answer = _arith_problem(rng, 2, "+")
        if question not in seen:
            seen.add(question)
            reserved.append((ARITH_TEMPLATE.format(question=question), answer))
    train = [(ARITH_TEMPLATE.format(question=f"{a}+{b}"), str(a + b))
             for a in range(10, 100) for b in range(10, 100) if f"{a}+{b}" not in seen]
    return train, reserved[:256], reserved[512:768]


def _encode(tokenizer, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch: input ids (B, T) right-padded and labels (B, T), -100 except on
    the answer and its eos (prompt and padding masked out)."""
    rows = [(tokenizer.encode(p), tokenizer.encode(a) + [tokenizer.eos_token_id])
            for p, a in pairs]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
    return ids, labels


def greedy_accuracy(model, tokenizer, pairs) -> float:
    """Fraction of ``(prompt, answer)`` pairs whose greedy completion equals the answer."""
    outs = generate(model, tokenizer, [p for p, _ in pairs], max_new_tokens=4, batch_size=256,
                    backend="hf")  # the path the cached toy was built with
    return sum(o.strip() == a for o, (_, a) in zip(outs, pairs)) / len(pairs)


def train_toy(out_dir: str, max_steps: int = MAX_STEPS, log=print, threads: int = 2) -> dict:
    """Train the toy model until its held-out greedy accuracy reaches ``STOP_ACCURACY`` (or for
    ``max_steps`` optimizer steps) and save it (model, tokenizer, ``toy_info.json``) into
    ``out_dir``. Returns the info dict. A build of the full ``MAX_STEPS`` that never reaches
    ``STOP_ACCURACY`` is a RuntimeError (nothing is saved).

    The same weights bitwise for a fixed torch build, CPU arithmetic and ``max_steps``, however
    long the steps take (the clock is only reported). ``threads``: torch's threads while it
    trains; every build the package makes (hpc-toy, the pinned builds) runs on the default 2.
    """
    start, before = time.monotonic(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokenizer = build_tokenizer()
        train, heldout, probe = _problem_sets()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(DATA_SEED)
            model = Qwen2ForCausalLM(qwen2_config(len(tokenizer)))
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
            order = torch.Generator().manual_seed(DATA_SEED)
            all_ids, all_labels = _encode(tokenizer, train)
            heldout_acc = [0.0]  # the last held-out check

            def train_step() -> float:
                model.train()
                idx = torch.randint(len(train), (BATCH,), generator=order)
                loss = model(input_ids=all_ids[idx], labels=all_labels[idx]).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                return loss.item()

            def reached(step: int) -> bool:
                if step % CHECK_EVERY and heldout_acc[0] < STOP_ACCURACY - CLOSE:
                    return False
                heldout_acc[0] = greedy_accuracy(model, tokenizer, heldout)
                return heldout_acc[0] >= STOP_ACCURACY

            steps, probe_acc = train_steps(
                train_step, lambda: greedy_accuracy(model, tokenizer, probe), max_steps,
                PROBE_EVERY, lambda msg: log("toy " + msg), stop=reached)
        stopped = heldout_acc[0] >= STOP_ACCURACY
        if not stopped and max_steps >= MAX_STEPS:
            raise RuntimeError(f"the toy build did not reach {STOP_ACCURACY:.0%} held-out "
                               f"greedy accuracy in {max_steps} steps (it reached "
                               f"{heldout_acc[0]:.1%})")
        log(f"toy step {steps}: held-out greedy accuracy {heldout_acc[0]:.3f}"
            + (f" reached {STOP_ACCURACY}: the build ends" if stopped else ""))
        info = {"version": VERSION, "parameters": sum(p.numel() for p in model.parameters()),
                "steps": steps, "max_steps": max_steps, "stop_accuracy": STOP_ACCURACY,
                "reached_stop_accuracy": stopped, "batch": BATCH, "lr": LR,
                "probe_accuracy": greedy_accuracy(model, tokenizer, probe),
                "heldout_accuracy": greedy_accuracy(model, tokenizer, heldout),
                "heldout": "arith 2-digit '+', seed 0, first 256 problems (demo eval set)",
                "train_problems": len(train), "seed": DATA_SEED,
                "kernels": pinned_description() if kernels_pinned() else "native",
                "build_seconds": round(time.monotonic() - start, 1)}
        save_model_folder(out_dir, model, tokenizer, info)
        return info
    finally:
        torch.set_num_threads(before)


# what a cached build must record to be used
INTENDED = {"version": VERSION, "stop_accuracy": STOP_ACCURACY, "reached_stop_accuracy": True}


def build_toy(final: str, max_steps: int = MAX_STEPS, log=print) -> None:
    """Train the toy model into ``final`` under the pinned kernels (:mod:`hpc.toys.pinned`;
    atomic: :func:`hpc.toys.cache.build_into`)."""
    build_into(final, lambda tmp: train_pinned("hpc.toys.toy:train_toy", tmp, max_steps, log))


def toy_model_path(wait_s: float = WAIT_S, log=print) -> str:
    """Folder of the cached toy model, building it (2-3 CPU minutes) if absent; UserError
    (one line: rebuild with ``hpc-toy --rebuild``) if the cached one is not the intended
    build."""
    final = cached_folder(cache_dir(), lambda final: build_toy(final, MAX_STEPS, log),
                          "the toy model", wait_s, log)
    check_built(final, INTENDED, REBUILD)
    return final


def toy_info(path: str | None = None) -> dict:
    """The ``toy_info.json`` of a built toy model folder (default: the cached one)."""
    return read_info(path or toy_model_path())


def tiny_model(hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               seed: int = 0, save_dir: str | None = None, arch: str = "qwen2"):
    """A randomly initialised small causal LM of architecture ``arch``
    (:func:`architecture_config`; default Qwen2) and the toy character tokenizer (tests).

    Built in well under a second; ``save_dir`` saves both (loadable by
    :func:`hpc.models.loading.load_model`). Returns ``(model, tokenizer)`` with the model in
    eval mode on CPU, float32.
    """
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = architecture_config(arch, len(tokenizer), hidden, layers, heads, kv_heads)
        model = CAUSAL_LM[arch](config)
    model.eval()
    if save_dir:
        model.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
    return model, tokenizer


@user_errors_exit
def show(rebuild: bool = False) -> None:
    """Build the toy model if needed (``rebuild``: delete the cached one first); print its folder,
    held-out accuracy, and whether it was built now or loaded from the cache.
    ``hpc-toy`` (:data:`hpc.toys.commands.toy`) parses the command line."""
    if rebuild:
        shutil.rmtree(cache_dir(), ignore_errors=True)
    cached = os.path.isfile(os.path.join(cache_dir(), INFO_FILE))
    path = toy_model_path()
    info = toy_info(path)
    how = (f"loaded from the cache (built once, in {info['build_seconds']} s)" if cached else
           f"built in {info['build_seconds']} s and cached")
    print(f"{path}\nheld-out greedy accuracy {info['heldout_accuracy']:.3f} "
          f"({info['parameters']} parameters, {info['steps']} steps); {how}")


if __name__ == "__main__":
    from hpc.toys.commands import toy

    toy()
