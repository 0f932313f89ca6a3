"""Continuous batching over an engine's slots: which request decodes in which slot, when
waiting requests are admitted, and when live rows move down so steps cover fewer rows.

A row that emits eos or reaches its ``max_new`` frees its slot at once and waiting requests are
admitted, so a completion costs its own length, not its batch's longest. Per step the host
reads back only the new tokens (rows,) to see which rows ended.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc.engine.memory import PREFILL_TOKENS, bucket
from hpc.models.sampling import Sampling, pick_tokens

ADMIT_SHARE = 8  # with live rows, admit once 1/ADMIT_SHARE of the slots are free


@dataclass
class Request:
    """One completion to decode: prompt token ids, its own new-token limit, member index (0
    when k <= 1) and sampling key (prompt index, sample index)."""

    prompt: list
    max_new: int
    member: int = 0
    prompt_index: int = 0
    sample_index: int = 0


class Scheduler:
    """Continuous batching over an engine's slots (one
    :meth:`hpc.engine.runner.DecodeEngine.run` call)."""

    def __init__(self, engine, requests: list, eos_ids: list,
                 sampling: Sampling | None):
        self.e, self.requests, self.sampling = engine, requests, sampling
        self.eos = set(eos_ids)
        if any(not r.prompt or r.max_new < 1 for r in requests):
            raise ValueError("every request needs at least one prompt token and max_new >= 1")
        too_long = [len(r.prompt) + r.max_new for r in requests if
                    len(r.prompt) + r.max_new > engine.cache.max_len]
        if too_long:
            raise ValueError(f"a request needs {max(too_long)} positions, the engine holds "
                             f"{engine.cache.max_len}")
        self.waiting = list(range(len(requests)))[::-1]  # pop() takes the next request
        self.slot_of: dict = {}  # request -> slot
        self.req_of: dict = {}  # slot -> request
        self.out = [[] for _ in requests]
        long = dict(dtype=torch.int64, device=engine.device)
        self.key_prompt = torch.zeros(engine.slots, **long)
        self.key_sample = torch.zeros(engine.slots, **long)
        self.length = [0] * engine.slots  # a live slot's next cache position + 1
        self.live = torch.zeros(engine.slots, **long)  # 1 for a live slot

    def run(self) -> list:
        e = self.e
        while self.waiting or self.req_of:
            free = e.slots - len(self.req_of)
            if self.waiting and (not self.req_of or free >= max(1, e.slots // ADMIT_SHARE)):
                self._admit()
                continue
            if not self.waiting:
                self._compact()
            rows = bucket(max(self.req_of) + 1, e.slots)
            ctx = bucket(max(self.length[s] for s in self.req_of), e.cache.max_len)
            logits = e.step(rows, ctx)
            new = self._pick(logits, torch.arange(rows, device=e.device))
            e.tokens[:rows] = new
            e.positions[:rows] += self.live[:rows]  # free rows stay at position 0
            self._take(list(range(rows)), new.tolist())
        return self.out

    def _pick(self, logits, slots):
        if self.sampling is None or self.sampling.temperature == 0:
            return logits.argmax(dim=-1)
        req = [self.req_of.get(int(s)) for s in slots.tolist()]
        done = torch.tensor([len(self.out[r]) if r is not None else 0 for r in req],
                            device=logits.device)
        return pick_tokens(logits, self.sampling, self.key_prompt[slots],
                           self.key_sample[slots], done)

    def _take(self, slots: list, tokens: list) -> None:
        """Append each live slot's new token; free the slots whose request ended."""
        for s, t in zip(slots, tokens):
            r = self.req_of.get(s)
            if r is None:
                continue
            self.out[r].append(t)
            self.length[s] += 1
            if t in self.eos or len(self.out[r]) >= self.requests[r].max_new:
                del self.req_of[s], self.slot_of[r]
                self.length[s] = 0
                self.live[s] = 0
                self.e.positions[s] = 0

    def _admit(self) -> None:
        """Prefill waiting requests into the lowest free slots (chunks of PREFILL_TOKENS)."""
        e = self.e
        free = [s for s in range(e.slots) if s not in self.req_of]
        batch = []
        while self.waiting and len(batch) < len(free):
            width = max([len(self.requests[r].prompt) for r in batch] +
                        [len(self.requests[self.waiting[-1]].prompt)])
            if batch and width * (len(batch) + 1) > PREFILL_TOKENS:
                break
            batch.append(self.waiting.pop())
        slots = free[:len(batch)]
        width = max(len(self.requests[r].prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, r in enumerate(batch):
            ids[i, :len(self.requests[r].prompt)] = torch.tensor(self.requests[r].prompt)
        lengths = torch.tensor([len(self.requests[r].prompt) for r in batch])
        dev = dict(device=e.device)
        slot_t = torch.tensor(slots, **dev)
        e.members[slot_t] = torch.tensor([self.requests[r].member for r in batch], **dev)
        self.key_prompt[slot_t] = torch.tensor([self.requests[r].prompt_index for r in batch],
                                               **dev)
        self.key_sample[slot_t] = torch.tensor([self.requests[r].sample_index for r in batch],
                                               **dev)
        for s, r in zip(slots, batch):
            self.req_of[s], self.slot_of[r] = r, s
            self.length[s] = len(self.requests[r].prompt)
        self.live[slot_t] = 1
        logits = e.prefill(ids.to(e.device), lengths.to(e.device), slot_t, e.members[slot_t])
        new = self._pick(logits, slot_t)
        e.tokens[slot_t] = new
        e.positions[slot_t] = lengths.to(e.device)
        self._take(slots, new.tolist())

    def _compact(self) -> None:
        """With nothing waiting: move the live rows above ``bucket(live)`` into free lower
        slots, so decode steps cover fewer rows."""
        e = self.e
        live = len(self.req_of)
        target = bucket(live, e.slots)
        high = sorted(s for s in self.req_of if s >= target)
        if not high:
            return
        low = [s for s in range(target) if s not in self.req_of][:len(high)]
        src, dst = torch.tensor(high, device=e.device), torch.tensor(low, device=e.device)
        e.cache.move(src, dst, max(self.length[s] for s in high))
        for t in (e.tokens, e.positions, e.members, self.key_prompt, self.key_sample, self.live):
            t[dst] = t[src]
        for s, d in zip(high, low):
            r = self.req_of.pop(s)
            self.req_of[d], self.slot_of[r] = r, d
            self.length[d], self.length[s] = self.length[s], 0
        # rows beyond the live ones still run in a bucket: keep their cache writes in range
        e.positions[src] = 0
        self.live[src] = 0
