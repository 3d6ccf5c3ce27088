"""The transformers rollout engine: the `RolloutEngine` interface over `model.generate`, for machines without vLLM.

Requests that arrive together are batched (left padding) when they share temperature and top-p; each batch runs in
one worker thread so the actor's event loop keeps accepting requests, pauses and weight updates. A batch generates
up to the largest `max_tokens` of its requests and each row is cut at its own limit or first EOS.

Logprobs follow the plan's `logprobs_mode` like vLLM's: `processed_logprobs` from generate's `scores` (after the
temperature and top-p warpers, i.e. the distribution sampled from), `raw_logprobs` from its `logits`.

Pause/resume: the generation thread passes a gate between decode steps (a `StoppingCriteria` that never stops), so
`pause` returns once the current forward pass has finished; requests in flight wait inside generate and continue on
`resume`, with the weights loaded meanwhile. Unlike the vLLM engine, their KV cache is not recomputed: the tokens
generated before the update keep their old-weight KV (the usual partial-rollout approximation).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from runtime.agents.types import GenerateOutput
from runtime.engines.weights import tied_embeddings

if TYPE_CHECKING:
    from schemas.plan import EnginesPlan

MAX_BATCH = 64
"""Requests per `generate` call; more wait for the next batch (bounds padding waste and activation memory)."""


class _StepGate:
    """Lets the generation thread run a forward pass only while no one holds the gate closed."""

    def __init__(self):
        self._cond = threading.Condition()
        self._closed = 0
        self._busy = False

    def enter(self) -> None:  # generation thread, before a forward pass
        with self._cond:
            self._cond.wait_for(lambda: self._closed == 0)
            self._busy = True

    def leave(self) -> None:  # generation thread, after a forward pass
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def close(self) -> None:
        """Block new forward passes and wait for the running one to finish."""
        with self._cond:
            self._closed += 1
            self._cond.wait_for(lambda: not self._busy)

    def open(self) -> None:
        with self._cond:
            self._closed -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def forward(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()


class _GateBetweenSteps:
    """A transformers stopping criterion that stops nothing: it releases and re-takes the gate after each step."""

    def __init__(self, gate: _StepGate):
        self.gate = gate

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.gate.leave()
        self.gate.enter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    logprobs: bool
    future: asyncio.Future = field(repr=False)

    @property
    def key(self) -> tuple[float, float]:
        return (self.temperature, self.top_p)


class HfEngine:
    def __init__(self, engines: EnginesPlan, index: int, model_path: str):
        from transformers import AutoModelForCausalLM, StoppingCriteriaList

        t0 = time.perf_counter()
        self.index = index
        torch.manual_seed(engines.seeds[index])
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, engines.dtype)).eval()
        self.tied = tied_embeddings(model_path)
        gen = self.model.generation_config
        eos = gen.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else min(self.eos_ids, default=0)
        self.raw_logprobs = engines.logprobs_mode == "raw_logprobs"
        self.max_model_len = engines.max_model_len
        self._gate = _StepGate()
        self._stopping = StoppingCriteriaList([_GateBetweenSteps(self._gate)])
        self._paused = False
        self._pending: list[_Request] = []
        self._has_work: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hf-engine-{index}")
        self._version = 0
        self.init_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ interface
    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       session_id: str, logprobs: bool) -> GenerateOutput:
        if self._server is None or self._server.done():
            self._has_work = asyncio.Event()
            self._server = asyncio.get_running_loop().create_task(self._serve())
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), max_tokens, temperature, top_p, logprobs, future))
        self._has_work.set()
        return await future

    async def score(self, token_ids: list[int]) -> list[float]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._score, list(token_ids))

    async def pause(self) -> None:
        if not self._paused:
            self._paused = True
            await asyncio.to_thread(self._gate.close)

    async def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._gate.open()

    async def join_weight_sync(self, init: dict[str, Any]) -> None:
        """Join the trainer's weight-sync group as rank `rank_offset` (blocks until every member has joined)."""
        from runtime import weight_sync

        self._sync = init
        self._sync_metas = [weight_sync.TensorMeta(n, d, tuple(s)) for n, d, s in init["metas"]]
        self._sync_group = await asyncio.to_thread(
            weight_sync.join_group, init["backend"], init["master_address"], init["master_port"],
            init["rank_offset"], init["world_size"], init["timeout_s"])

    async def receive_weights(self, version: int) -> dict[str, float]:
        """One sync: receive the streamed buckets and copy each into the model as it arrives."""
        stats = await asyncio.to_thread(self._receive)
        self._version = version
        return stats

    async def weights_version(self) -> int:
        return self._version

    async def init_seconds(self) -> float:
        return self.init_s

    async def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ batching
    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._has_work.wait()
            await asyncio.sleep(0)  # let requests sent in the same burst join this batch
            key = self._pending[0].key
            batch = [r for r in self._pending if r.key == key][:MAX_BATCH]
            self._pending = [r for r in self._pending if not any(r is b for b in batch)]
            if not self._pending:
                self._has_work.clear()
            try:
                outputs = await loop.run_in_executor(self._thread, self._generate_batch, batch)
            except Exception as exc:  # the requests fail, the engine keeps serving
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, out in zip(batch, outputs, strict=True):
                if not r.future.done():
                    r.future.set_result(out)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[_Request]) -> list[GenerateOutput]:
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[row, width - len(r.prompt_ids):] = 1
        temperature, top_p = batch[0].key
        # top_k=0: no top-k cut (transformers defaults to 50; vLLM and the trainer use the full vocabulary).
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
            dict(do_sample=False)
        with self._gate.forward():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention, max_new_tokens=max(r.max_tokens for r in batch),
                eos_token_id=sorted(self.eos_ids) or None, pad_token_id=self.pad_id,
                stopping_criteria=self._stopping, return_dict_in_generate=True,
                output_scores=not self.raw_logprobs, output_logits=self.raw_logprobs, **sampling,
            )
        new_tokens = out.sequences[:, width:]
        steps = out.logits if self.raw_logprobs else out.scores
        need_lp = any(r.logprobs for r in batch)
        if need_lp:  # (B, steps) logprob of each generated token
            lp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in steps], dim=1)
            lp = lp.gather(-1, new_tokens[:, : lp.shape[1]].unsqueeze(-1)).squeeze(-1)
        results = []
        for row, r in enumerate(batch):
            ids = new_tokens[row, : r.max_tokens].tolist()
            finish = "length"
            for i, tok in enumerate(ids):
                if tok in self.eos_ids:
                    ids, finish = ids[: i + 1], "stop"
                    break
            lps = lp[row, : len(ids)].tolist() if r.logprobs else []
            results.append(GenerateOutput(token_ids=ids, logprobs=lps, finish_reason=finish))
        return results

    @torch.inference_mode()
    def _score(self, token_ids: list[int]) -> list[float]:
        ids = torch.tensor([token_ids])
        with self._gate.forward():
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()

    @torch.no_grad()
    def _receive(self) -> dict[str, float]:
        from runtime import weight_sync

        params = dict(self.model.named_parameters())  # a tied lm_head is the embedding: listed (and loaded) once
        names = {m.name for m in self._sync_metas}
        missing = [n for n in params if n not in names]
        if missing:
            raise ValueError(f"hf engine {self.index}: the trainer does not send {missing[:5]}")

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                if name not in params:
                    raise ValueError(f"hf engine {self.index}: no parameter {name!r} to load")
                params[name].copy_(tensor)

        self._gate.close()  # waits for the forward pass in progress; generation resumes after the load
        try:
            stats = weight_sync.receive(self._sync_group, self._sync_metas, self._sync["bucket_bytes"],
                                        next(iter(params.values())).device, load, {})
        finally:
            self._gate.open()
        return stats.as_dict()
