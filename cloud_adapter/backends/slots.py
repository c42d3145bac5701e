"""The slot engine: every session's KV cache preallocated in place, rolled back by a length, read without copies.

:class:`SlotLLM` serves the same calls as :class:`~cloud_adapter.llm.TransformersLLM` (``open``, ``open_many``,
``step``, ``truncate``), so :class:`~cloud_adapter.runners.StepBatcher` batches it unchanged, but:

* **KV in place.**  Each layer's keys and values live in one tensor ``[S, H_kv, T, D]`` allocated at start: slot
  ``s`` holds one session, position ``t`` its ``t``-th token.  A forward writes each new token's K/V at its
  position; nothing is concatenated, gathered or padded, and a session leaving frees its slot for the next.
* **Rollback by length.**  A draft the edge did not confirm is dropped by setting the slot's length: positions
  past it are masked out and overwritten by the next forward.  O(1), no copy (``TransformersLLM`` clones the
  kept KV into a batch of its own).
* **Attention without repeated KV heads.**  The model's own layers run (embeddings, norms, RoPE, MLP, the head:
  any architecture transformers implements with its attention interface), but attention is
  :func:`slot_attention`: SDPA over the slots' K/V views with grouped-query heads (``enable_gqa``) and a mask
  of each row's causal (and sliding-window) span, never ``repeat_kv``.
* **Rows summarised where they are computed** (:func:`~cloud_adapter.backends.rows.summarize_rows`): a GPU step
  copies the top ids and values of each row to the host, not ``[B, V]`` logits.
* **Tensor parallel.**  A model loaded with ``tp_plan="auto"`` under ``torchrun`` holds on each rank its share of
  every layer's heads (transformers' plan: column-parallel q/k/v and gate/up, row-parallel o and down, each
  followed by an all-reduce); each rank's slot cache holds its ``H_kv / N`` KV heads.  Rank 0 runs the engine
  and, before each forward, broadcasts what the forward reads (slots, lengths, tokens); the other ranks run
  :meth:`SlotLLM.follow`, replaying the same forward, so the collectives line up.
* **Admission by bytes.**  The slots are sized from the memory free at start (``kv_fraction`` of it, at most
  ``max_slots``); a prompt that cannot fit a slot is ``INVALID_ARGUMENT``, a session beyond the slots
  ``RESOURCE_EXHAUSTED``, both with the numbers.  A model with any weight off the device (``device_map``
  offload to cpu, meta or disk) is refused at start, naming the parameter.  A CUDA out-of-memory error in one
  prefill fails that session only.

A step's batch is the contiguous range of slots between its lowest and highest stepping slot: slots in that
range that do not step ride along as rows whose K/V are not written and whose logits are dropped (free on a GPU,
where a decode step costs its weight reads), unless they are most of the range; then the stepping rows' K/V are
read through an index (one copy of theirs).

Padding a batch or stepping a session alone changes a row's floating-point reductions (as in every batched
engine): on the CPU in float32 rows agree with ``TransformersLLM``'s to about 1e-5 and greedy tokens match
(``tests/cloud_adapter/test_slot_engine.py``).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cloud_adapter.backends.rows import RowSpec, summarize_rows
from cloud_adapter.llm import CloudSequence, TransformersLLM
from cloud_adapter.runners import ModelFailure
from edge_sdk.protocol.status import CloudError

#: the attention implementation name the slot engine registers with transformers
ATTENTION_NAME = "coveil_slots"
#: a stepping range whose rows step less than this share reads the stepping slots' K/V through an index instead
MIN_RANGE_SHARE = 0.5


def _tensor_parallel_ranks(model: Any) -> tuple[int, int]:
    """``(world size, rank)`` when ``model`` is sharded over the ranks of a process group (its weights are
    DTensors), else ``(1, 0)``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def _least_over_ranks(value: int, tp_size: int, device: torch.device) -> int:
    """The smallest ``value`` any rank holds (every rank's slot cache has the same slots)."""
    if tp_size == 1:
        return value
    import torch.distributed as dist

    box = torch.tensor([value], device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def _architecture_problem(config: Any) -> str | None:
    """Why the slot engine cannot run this model (``None`` when it can)."""
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping (SDPA has no soft cap)"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if not getattr(config, "num_hidden_layers", None):
        return "no num_hidden_layers in its config"
    return None


def _text_config(model: Any) -> Any:
    """The decoder's configuration (a multimodal model's text part)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def supports(llm: TransformersLLM) -> str | None:
    """Why ``llm`` cannot be served by the slot engine, or ``None`` when it can."""
    return _architecture_problem(_text_config(llm.model))


def check_weights_placed(model: Any, device: torch.device) -> None:
    """``ValueError`` naming the first parameter or buffer not on ``device`` (an offloaded or meta weight).

    ``device_map="auto"`` silently puts what does not fit on the CPU or disk, where every step would copy it
    back: the engine refuses to start instead.
    """
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
            raise ValueError(
                f"weight {name} lies on {tensor.device}, not {device}: the slot engine serves a model whose every "
                f"weight is on its device (use --tp or more GPUs, a smaller --dtype, or --backend transformers)"
            )
    for name, where in (getattr(model, "hf_device_map", None) or {}).items():
        if str(where) in ("cpu", "disk", "meta"):
            raise ValueError(f"layer {name or '(model)'} is mapped to {where}: the slot engine refuses offloaded weights")


@dataclass
class _StepView:
    """What one forward's attention calls read (set around the forward by :meth:`SlotLLM._forward`).

    ``slots``: the batch's slot ids [B] (``None`` with ``lo``/``hi``: the contiguous range ``lo:hi``);
    ``starts`` [B]: each row's position of its first query token; ``written``: the rows whose K/V are stored
    (``None``: every row; rows riding along in a range are not); ``kv_len``: the positions attended over.
    Everything is decided on the host before the forward, so no layer waits for the device.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lo: int
    hi: int
    slots: torch.Tensor | None
    starts: torch.Tensor
    written: torch.Tensor | None
    kv_len: int


def is_sticky_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error that leaves the context unusable (not an out-of-memory error)."""
    text = str(exc)
    return "CUDA error" in text or "CUBLAS_STATUS" in text or "device-side assert" in text


_CURRENT: contextvars.ContextVar[_StepView | None] = contextvars.ContextVar("coveil_slot_step", default=None)


def slot_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the slot cache.

    ``query`` [B, H, q, D], ``key``/``value`` [B, H_kv, q, D] (after the layer's norms and RoPE) are the batch's
    new tokens at positions ``starts[b] + i``.  They are written into the layer's slot tensors, then

        out_b = softmax(scaling * Q_b K_b^T + M_b) V_b,    M_b[i, j] = 0 if j <= starts[b] + i
                                                             and starts[b] + i - j < window, else -inf

    over positions ``j < kv_len`` of each row's slot, with each query head reading KV head ``h // (H / H_kv)``.
    Returns ``[B, q, H, D]`` as transformers' interfaces do.
    """
    view = _CURRENT.get()
    if view is None:
        raise RuntimeError("slot_attention ran outside a SlotLLM forward")
    layer = module.layer_idx
    cache_k, cache_v = view.keys[layer], view.values[layer]
    q_len = query.shape[2]
    positions = view.starts[:, None] + torch.arange(q_len, device=query.device)  # [B, q]
    rows = view.slots if view.slots is not None else torch.arange(view.lo, view.hi, device=query.device)
    new_k, new_v, write_rows, write_pos = key, value, rows, positions
    if view.written is not None:
        written = view.written
        new_k, new_v, write_rows, write_pos = key[written], value[written], rows[written], positions[written]
    # cache[slot, :, pos] = new[b, :, i] for every written row b and query i
    slot_index = write_rows[:, None].expand_as(write_pos)
    cache_k[slot_index, :, write_pos] = new_k.transpose(1, 2).to(cache_k.dtype)
    cache_v[slot_index, :, write_pos] = new_v.transpose(1, 2).to(cache_v.dtype)
    if view.slots is None:
        keys, values = cache_k[view.lo : view.hi, :, : view.kv_len], cache_v[view.lo : view.hi, :, : view.kv_len]
    else:
        # cut to kv_len before the gather, so it copies the positions attended over, not whole slots
        keys = cache_k[:, :, : view.kv_len].index_select(0, view.slots)
        values = cache_v[:, :, : view.kv_len].index_select(0, view.slots)
    j = torch.arange(view.kv_len, device=query.device)
    allowed = j[None, None, :] <= positions[:, :, None]  # [B, q, T]
    if sliding_window is not None:
        allowed &= positions[:, :, None] - j[None, None, :] < sliding_window
    groups = query.shape[1] // keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), attn_mask=allowed[:, None], scale=scaling,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, slot_attention)


@dataclass(eq=False)
class Slot:
    """A session's place in the slot cache: its index and the tokens it holds."""

    index: int
    length: int = 0
    spec: RowSpec | None = None


class SlotLLM:
    """A :class:`TransformersLLM`'s model served over a preallocated slot KV cache (see the module docstring).

    Args:
        llm: the loaded model and tokenizer; its model is taken over (its attention becomes
            :func:`slot_attention`), so serve it through this object only.
        max_slots: the most sessions at once; ``None``: as many as the KV budget holds.
        max_len: tokens one slot holds (prompt and generated); ``None``: the model's
            ``max_position_embeddings``, at most 4,096.
        kv_fraction: the share of the device memory free at start the KV cache may take (CUDA); on the CPU
            ``kv_bytes`` bounds it instead.
        kv_bytes: the KV cache's size in bytes on the CPU (default 1 GiB).
        prefill_chunk: prompt tokens per prefill forward (a long prompt runs as several).
        device_rows: summarise rows with torch on the CPU too (as on a GPU: the rows and greedy picks
            stay tensors, one copy of their top values comes out); by default a CPU row is summarised in numpy,
            the bytes the transformers backend sends.

    Like ``TransformersLLM``, not thread-safe: one thread (the batcher's worker) calls it, except
    :meth:`release`, which any session's thread may call.
    """

    #: it summarises each row where it computes it (``open_many`` takes the sessions' specs)
    summarizes_rows = True

    def __init__(
        self,
        llm: TransformersLLM,
        *,
        max_slots: int | None = None,
        max_len: int | None = None,
        kv_fraction: float = 0.9,
        kv_bytes: int = 1 << 30,
        prefill_chunk: int = 512,
        device_rows: bool = False,
    ) -> None:
        problem = supports(llm)
        if problem is not None:
            raise ValueError(f"the slot engine cannot serve {llm.name}: {problem}; use --backend transformers")
        if not 0 < kv_fraction <= 1:
            raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.llm = llm
        self.model = llm.model
        self.device = llm.device
        check_weights_placed(self.model, self.device)
        config = _text_config(self.model)
        self.layers = int(config.num_hidden_layers)
        self.tp_size, self.rank = _tensor_parallel_ranks(self.model)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        if kv_heads % self.tp_size:
            raise ValueError(f"{kv_heads} KV heads do not split over {self.tp_size} ranks: choose a --tp dividing them")
        self.kv_heads = kv_heads // self.tp_size  # this rank's share
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.kv_dtype = self.model.dtype
        positions = int(getattr(config, "max_position_embeddings", 4096) or 4096)
        self.max_len = int(max_len if max_len is not None else min(positions, 4096))
        if self.max_len < 2:
            raise ValueError(f"max_len must be at least 2, got {self.max_len}")
        per_slot = self.kv_bytes_per_token * self.max_len
        budget = self._kv_budget(kv_fraction, kv_bytes)
        fits = _least_over_ranks(budget // per_slot, self.tp_size, self.device)
        if fits < 1:
            raise ValueError(
                f"no room for one slot: {self.max_len} tokens x {self.kv_bytes_per_token} B of KV per token = "
                f"{per_slot / 2**20:.0f} MiB, with {budget / 2**20:.0f} MiB for the KV cache: lower --max-len"
            )
        self.slots = int(min(fits, max_slots)) if max_slots is not None else int(fits)
        if self.slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        shape = (self.slots, self.kv_heads, self.max_len, self.head_dim)
        self._keys = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.layers)]
        self._values = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.layers)]
        self._free = list(range(self.slots))  # kept sorted: sessions take the lowest, so live slots stay compact
        self._free_lock = threading.Lock()
        self.prefill_chunk = prefill_chunk
        self.device_rows = device_rows or self.device.type != "cpu"
        _register_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        # the TransformersLLM attributes sessions and the engine read (tokenizer, vocabulary, ends)
        self.name, self.vocab_size, self.eos_token_ids = llm.name, llm.vocab_size, llm.eos_token_ids
        self.dtype = llm.dtype

    # -- tensor parallel -----------------------------------------------------------------------------
    def follow(self) -> None:
        """On a rank other than 0: replay rank 0's forwards until it calls :meth:`stop_followers`."""
        if self.rank == 0:
            raise RuntimeError("rank 0 runs the engine; only the other ranks follow it")
        while True:
            descriptor = self._exchange(None)
            if descriptor is None:
                return
            indices, starts, tokens = descriptor
            try:
                self._forward([Slot(index, length) for index, length in zip(indices, starts)], tokens)
            except Exception:  # noqa: BLE001 - rank 0 met the same error in the same forward and reports it
                continue

    def stop_followers(self) -> None:
        """On rank 0 (tensor parallel): let the other ranks' :meth:`follow` return."""
        if self.tp_size > 1 and self.rank == 0:
            self._exchange(None, stop=True)

    def _exchange(self, descriptor: Any, *, stop: bool = False) -> Any:
        """Rank 0 sends ``descriptor`` (``None`` with ``stop``) to every rank; each rank returns what rank 0 sent."""
        import torch.distributed as dist

        box = [None if stop else descriptor]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """``2 * layers * H_kv * D * bytes``: what one token of one session holds in the cache."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.kv_dtype).bits // 8

    def _kv_budget(self, kv_fraction: float, kv_bytes: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * kv_fraction)
        return int(kv_bytes)

    @property
    def free_slots(self) -> int:
        with self._free_lock:
            return len(self._free)

    def _give_back(self, index: int) -> None:
        with self._free_lock:
            self._free.append(index)
            self._free.sort()

    # -- sessions ------------------------------------------------------------------------------------
    def _take_slot(self, prompt_len: int) -> Slot:
        if prompt_len < 1:
            raise ValueError("the prompt must hold at least one token")
        if prompt_len >= self.max_len:
            raise CloudError(
                "INVALID_ARGUMENT", f"the prompt holds {prompt_len} tokens; a session's slot holds {self.max_len} "
                f"(prompt and generated tokens): shorten the prompt"
            )
        with self._free_lock:
            if not self._free:
                raise CloudError(
                    "RESOURCE_EXHAUSTED", f"all {self.slots} KV slots are taken ({self.max_len} tokens x "
                    f"{self.kv_bytes_per_token} B each): retry when a session ends"
                )
            return Slot(self._free.pop(0))

    def release(self, seq: CloudSequence) -> None:
        """Give ``seq``'s slot back (its KV is overwritten by the next session to take it)."""
        slot = seq.cache
        if isinstance(slot, Slot) and slot.index >= 0:
            index, slot.index = slot.index, -1
            self._give_back(index)

    @torch.inference_mode()
    def opening(self, prompt_ids: Sequence[int], spec: RowSpec | None = None,
                ) -> Generator[None, None, CloudSequence]:
        """Prefill ``prompt_ids`` into a free slot, one forward of ``prefill_chunk`` tokens per resumption.

        A generator: it takes the slot and runs the first chunk at the first ``next``, pauses after each chunk
        but the last, and returns the sequence (``StopIteration.value``) once the prompt's last chunk has run.
        Between two resumptions the caller may run other forwards (the batcher runs a step batch there, so a
        long prompt does not stall the sessions decoding): a slot being filled rides along a step's range with
        its K/V unwritten.  Closed before its end (``close()``), it gives its slot back.
        """
        ids = [int(i) for i in prompt_ids]
        slot = self._take_slot(len(ids))
        slot.spec = spec
        try:
            logits = None
            for start in range(0, len(ids), self.prefill_chunk):
                if start:
                    yield
                chunk = ids[start : start + self.prefill_chunk]
                logits = self._guarded_forward([slot], [chunk])
                slot.length = start + len(chunk)
        except torch.OutOfMemoryError:
            self._give_back(slot.index)
            raise CloudError(
                "RESOURCE_EXHAUSTED", f"the device ran out of memory prefilling {len(ids)} tokens "
                f"({self.prefill_chunk} a forward): retry, or lower --prefill-chunk"
            ) from None
        except BaseException:  # GeneratorExit included: a prefill abandoned midway frees its slot
            self._give_back(slot.index)
            raise
        seq = CloudSequence(ids=ids, cache=slot, next_logits=None)
        self._deliver([seq], logits)
        return seq

    def open(self, prompt_ids: Sequence[int], spec: RowSpec | None = None) -> CloudSequence:
        """Prefill ``prompt_ids`` into a free slot, ``prefill_chunk`` tokens a forward, all at once."""
        chunks = self.opening(prompt_ids, spec)
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                return done.value

    def open_many(self, prompts: Sequence[Sequence[int]], specs: Sequence[RowSpec | None] | None = None,
                  ) -> list[CloudSequence]:
        """One :meth:`open` each, each chunked (the batcher interleaves steps between chunks through
        :meth:`opening` instead)."""
        specs = specs if specs is not None else [None] * len(prompts)
        return [self.open(prompt, spec) for prompt, spec in zip(prompts, specs, strict=True)]

    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[CloudSequence, int]]) -> None:
        """Append one token to each sequence and refresh its row (one batched forward)."""
        if not batch:
            return
        seqs = [seq for seq, _ in batch]
        slots = [self._slot(seq) for seq in seqs]
        if len({s.index for s in slots}) != len(slots):
            raise ValueError("a sequence appears twice in one step")
        for slot in slots:
            if slot.length + 1 > self.max_len:
                raise CloudError("RESOURCE_EXHAUSTED", f"the session filled its slot's {self.max_len} tokens")
        logits = self._guarded_forward(slots, [[int(t)] for _, t in batch])
        for seq, slot, (_, token) in zip(seqs, slots, batch):
            slot.length += 1
            seq.ids.append(int(token))
        self._deliver(seqs, logits)

    def truncate(self, seq: CloudSequence, length: int) -> None:
        """Keep ``seq``'s first ``length`` tokens: its slot's length is set back, nothing is copied.

        ``seq.next_row`` is stale until the next ``step``, whose row is the one a sequence that never held the
        dropped tokens gets (their positions are masked and then overwritten).
        """
        if not 1 <= length <= len(seq.ids):
            raise ValueError(f"cannot keep {length} of the sequence's {len(seq.ids)} tokens")
        self._slot(seq).length = length
        del seq.ids[length:]
        seq.next_logits, seq.next_row = None, None

    def _slot(self, seq: CloudSequence) -> Slot:
        slot = seq.cache
        if not isinstance(slot, Slot) or slot.index < 0:
            raise ValueError("the sequence holds no live slot of this engine (released, or from another model)")
        return slot

    # -- the forward ---------------------------------------------------------------------------------
    def _guarded_forward(self, slots: Sequence[Slot], tokens: list[list[int]]) -> torch.Tensor:
        """:meth:`_forward`, turning a device error that is not an out-of-memory into a
        :class:`~cloud_adapter.runners.ModelFailure`.

        After such an error (an illegal address, a lost device) the CUDA context is unusable for every later
        call, so the worker must stop and health report NOT_SERVING rather than fail each session in turn.
        """
        if self.tp_size > 1:  # the other ranks replay this forward
            self._exchange(([s.index for s in slots], [s.length for s in slots], tokens))
        try:
            return self._forward(slots, tokens)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            if is_sticky_device_error(exc):
                raise ModelFailure(f"the device failed: {exc}") from exc
            raise

    def _forward(self, slots: Sequence[Slot], tokens: list[list[int]]) -> torch.Tensor:
        """One forward of ``tokens`` [B][q] at each slot's current length; the last position's logits [B, V].

        Every index the layers read is built on the host first (one copy each to the device), so the forward
        itself never waits for the device."""
        q_len = len(tokens[0])
        indices = [s.index for s in slots]
        lo, hi = min(indices), max(indices) + 1
        starts = [s.length for s in slots]
        if len(slots) >= MIN_RANGE_SHARE * (hi - lo):  # the range lo:hi (row r: slot lo + r), riders not written
            order = [i - lo for i in indices]  # each batch entry's row
            row_tokens, row_starts = [[0] * q_len for _ in range(hi - lo)], [0] * (hi - lo)
            for b, r in enumerate(order):
                row_tokens[r], row_starts[r] = tokens[b], starts[b]
            input_ids = torch.tensor(row_tokens, device=self.device)
            written = None if len(slots) == hi - lo else torch.tensor(sorted(order), device=self.device)
            view = _StepView(self._keys, self._values, lo, hi, None,
                             torch.tensor(row_starts, device=self.device), written, max(starts) + q_len)
        else:  # few rows of a wide range: read theirs through an index
            input_ids = torch.tensor(tokens, device=self.device)
            view = _StepView(self._keys, self._values, lo, hi, torch.tensor(indices, device=self.device),
                             torch.tensor(starts, device=self.device), None, max(starts) + q_len)
            order = list(range(len(slots)))
        positions = view.starts[:, None] + torch.arange(q_len, device=self.device)
        token = _CURRENT.set(view)
        try:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1)
        finally:
            _CURRENT.reset(token)
        logits = out.logits[:, -1, : self.vocab_size]
        return logits[torch.tensor(order, device=self.device)] if order != list(range(logits.shape[0])) else logits

    def _deliver(self, seqs: Sequence[CloudSequence], logits: torch.Tensor) -> None:
        """Each sequence's next row: summarised on the device by its slot's spec, and, on the CPU, the logits."""
        specs = [seq.cache.spec for seq in seqs]
        summarised = None
        if all(spec is not None for spec in specs):
            summarised = summarize_rows(logits, specs, on_device=self.device_rows)
        host = logits.float().numpy() if not self.device_rows else None
        for b, seq in enumerate(seqs):
            seq.next_row = summarised[b] if summarised is not None else None
            seq.next_logits = host[b] if host is not None else None
            if seq.next_row is None and seq.next_logits is None:  # no spec on a GPU: the whole row, on request
                seq.next_logits = logits[b].float().cpu().numpy()

