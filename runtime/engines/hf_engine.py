"""The transformers rollout engine: the `RolloutEngine` interface over `hf_decode.DecodeCore`, for machines without
vLLM.

The model sits on the plan's `engines.device` in `engines.dtype`. Requests from all callers share one continuous
batch of up to `engines.max_num_seqs` sequences (a KV-cache slot each; more wait for a free slot), whatever their
temperature and top-p. A generation thread runs the core chunk by chunk (up to 16 decode steps between host syncs);
new requests join between chunks; on CUDA each decode step is a replayed CUDA graph unless `engines.enforce_eager`.
The actor's event loop keeps accepting requests, pauses and weight updates meanwhile.
A VLM run's requests carry their images (expanded placeholders in the prompt ids, as the trainer sees them); the
engine encodes them with the model's processor and prefills with the vision tower's features (`hf_vision`).

Logprobs follow the plan's `logprobs_mode` like vLLM's: `processed_logprobs` = log-softmax of logits / T after the
top-p cut (the distribution sampled from), `raw_logprobs` = log-softmax of the unprocessed logits. Score centering's
top-k (`top_logprobs` = k) is the k largest entries of that same log-softmax.

Pause/resume: the generation thread passes a gate between chunks, so `pause` returns once the current chunk has
finished (a chunk ends early, within two decode steps, when a pause, a weight load or a score waits at the gate);
requests in flight keep their slots and continue on `resume`, with the weights loaded meanwhile (in place: the CUDA
graphs read the same parameter storage). Unlike the vLLM engine, their KV cache is not recomputed: the
tokens generated before the update keep their old-weight KV (the usual partial-rollout approximation).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from runtime.agents.types import GenerateOutput
from runtime.engines.hf_decode import DecodeCore, Request
from runtime.engines.weights import tied_embeddings

if TYPE_CHECKING:
    from runtime.weight_sync import JoinMessage
    from schemas.plan import EnginesPlan


class StepGate:
    """One forward pass at a time (a generation chunk or a `score`), and none while someone holds the gate closed.
    A `score` goes before the next generation chunk: the generation thread re-enters the moment it leaves, so a
    plain condition let the post-sync probe wait behind chunk after chunk (0.6 s a step on one H200, issue 29)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._closed = 0
        self._busy = False
        self._scores_waiting = 0

    def enter(self, score: bool = False) -> None:  # before a forward pass
        with self._cond:
            self._scores_waiting += score
            try:
                self._cond.wait_for(lambda: self._closed == 0 and not self._busy
                                    and (score or self._scores_waiting == 0))
            finally:
                self._scores_waiting -= score
            self._busy = True

    def leave(self) -> None:  # after a forward pass
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def wanted(self) -> bool:
        """Someone waits to close the gate or to score: the running chunk should end (read without the lock: a
        stale answer costs at most one more decode step)."""
        return self._closed > 0 or self._scores_waiting > 0

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
    def forward(self, score: bool = False):
        self.enter(score)
        try:
            yield
        finally:
            self.leave()


class HfEngine:
    def __init__(self, engines: EnginesPlan, index: int, model_path: str):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        t0 = time.perf_counter()
        self.index = index
        torch.manual_seed(engines.seeds[index])
        self.device = torch.device(engines.device)
        vlm = engines.max_images_per_prompt > 0  # a VLM run (data.max_images_per_prompt)
        auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM  # a VLM's parameter names, as trained
        self.model = auto.from_pretrained(model_path, dtype=getattr(torch, engines.dtype)).eval()
        self.model.to(self.device)
        self.vision = None
        if vlm:
            from runtime import vlm as vlm_inputs
            from runtime.engines.hf_vision import VisionPrefill

            self.vision = VisionPrefill(self.model, vlm_inputs.load_processor(model_path))
        self.tied = tied_embeddings(model_path)
        gen = self.model.generation_config
        eos = gen.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad_id = gen.pad_token_id if gen.pad_token_id is not None else min(eos_ids, default=0)
        self._gate = StepGate()
        self.core = DecodeCore(self.model, slots=engines.max_num_seqs, max_model_len=engines.max_model_len,
                               eos_ids=eos_ids, pad_id=pad_id, raw_logprobs=engines.logprobs_mode == "raw_logprobs",
                               cuda_graphs=not engines.enforce_eager, record_routing=engines.routed_experts,
                               vision=self.vision, yield_to=self._gate.wanted)
        self._paused = False
        self._wake = threading.Event()
        self._stopped = False
        self._generator: threading.Thread | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hf-engine-{index}")
        self._version = 0
        self.init_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ interface
    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       session_id: str, logprobs: bool, images: list | None = None,
                       top_logprobs: int = 0, min_tokens: int = 0) -> GenerateOutput:
        if images and self.vision is None:
            raise ValueError(f"hf engine {self.index}: a request with images, but the plan has no image inputs")
        mm = self.vision.encode(images) if images else None  # on the actor's thread, beside generation
        if self._generator is None:
            self._generator = threading.Thread(target=self._generate_forever, name=f"hf-engine-{self.index}-generate", daemon=True)
            self._generator.start()
        future = asyncio.get_running_loop().create_future()
        self.core.submit(Request(list(prompt_ids), max_tokens, temperature, top_p, handle=future,
                                 min_tokens=min_tokens, top_k=top_logprobs, mm=mm))
        self._wake.set()
        r = await future
        top_ids, top_lps = r.top_arrays()
        return GenerateOutput(token_ids=r.token_ids, logprobs=r.logprobs if logprobs else [],
                              finish_reason=r.finish_reason, routed_experts=r.routed_experts(),
                              top_ids=top_ids, top_logprobs=top_lps,
                              policy_versions=r.versions)

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

    async def join_weight_sync(self, join: JoinMessage) -> None:
        """Join the trainer's weight-sync group as rank `rank_offset` (blocks until every member has joined)."""
        from runtime import weight_sync

        self._sync = join
        self._sync_metas = join.tensor_metas()
        self._sync_group = await asyncio.to_thread(
            weight_sync.join_group, join.method, join.master_address, join.master_port, join.rank_offset,
            join.world_size, join.timeout_s)

    async def receive_weights(self, version: int) -> dict[str, Any]:
        """One sync: receive the streamed buckets and copy each into the model as it arrives."""
        stats = await asyncio.to_thread(self._receive)
        self._version = self.core.version = version  # tokens sampled from the next chunk on carry it
        return stats

    async def weights_version(self) -> int:
        return self._version

    async def init_seconds(self) -> float:
        return self.init_s

    async def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ generation thread
    def _generate_forever(self) -> None:
        while not self._stopped:
            if not self.core.busy():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                with self._gate.forward():
                    finished = self.core.run_chunk()
            except Exception as exc:  # the requests in flight fail, the engine keeps serving
                for r in self.core.abort_all():
                    r.handle.get_loop().call_soon_threadsafe(_settle, r.handle, None, exc)
                continue
            for r in finished:
                r.handle.get_loop().call_soon_threadsafe(_settle, r.handle, r, None)

    def _score(self, token_ids: list[int]) -> list[float]:
        with self._gate.forward(score=True):
            return self.core.score(token_ids)

    @torch.no_grad()
    def _receive(self) -> dict[str, Any]:
        from runtime import weight_sync

        params = dict(self.model.named_parameters())  # a tied lm_head is the embedding: listed (and loaded) once
        check = self._sync.check_unassigned  # train.check_weight_update_equal: report what was not assigned
        names = {m.name for m in self._sync_metas}
        missing = [n for n in params if n not in names]
        if missing and not check:
            raise ValueError(f"hf engine {self.index}: the trainer does not send {missing[:5]}")
        assigned: set[str] = set()

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                if name not in params:
                    raise ValueError(f"hf engine {self.index}: no parameter {name!r} to load")
                params[name].copy_(tensor)
                assigned.add(name)

        self._gate.close()  # waits for the forward pass in progress; generation resumes after the load
        try:
            stats = weight_sync.receive(self._sync_group, self._sync_metas, self._sync.bucket_bytes,
                                        next(iter(params.values())).device, load, {})
        finally:
            self._gate.open()
        if check:
            return {**stats.as_dict(), "unassigned": sorted(set(params) - assigned)}
        return stats.as_dict()


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if not future.done():  # the caller may have given up (cancelled)
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
