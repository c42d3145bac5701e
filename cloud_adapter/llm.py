"""The cloud LLM on HF transformers: per-sequence state, one batched forward per decode step.

Continuous batching in the style of TGI's concatenate/filter.  Every sequence's
KV cache lives in a row of a :class:`KVBatch`: a left-padded batch cache shared
by the sequences that last stepped (or were opened) together.

* A step whose sequences are exactly the rows of one ``KVBatch`` (the steady
  state of a server whose sessions all keep up) runs one plain batched decode on
  that cache: nothing is copied besides what ``DynamicCache`` itself does.
* Any other membership (a session joined, left or lagged a step) first gathers
  the sequences' rows into a new ``KVBatch`` (one copy of their KV, right-aligned
  with zero left padding); sequences that did not step keep their rows in the
  old batch (no copy) until at most half of its rows are live, then those move
  to a compact batch, so stale rows never pin more memory than the live KV.

Padding never changes results: the forward gets ``attention_mask`` [B, T+1]
(0 on pads) and ``position_ids`` [B, 1] = each sequence's true length, so RoPE
and the causal/sliding-window masks see the same token distances as an
unpadded single-sequence run.  Sliding-window layers (Gemma-3) keep their
window: a row's real tokens always sit at the right end of the padded layout,
so the last ``window - 1`` padded positions hold each row's last real tokens.
"""

from __future__ import annotations

import itertools
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cloud_adapter.hf_loading import forward_with_cache, load_causal_lm
from cloud_adapter.backends.rows import StepRow
from edge_sdk.models import ModelSource, embedded_model, tokenizer_vocab_size, vocab_fingerprint


@dataclass(eq=False)
class CloudSequence:
    """One session's public sequence on the cloud: its ids, KV cache and next-token logits.

    ``cache`` is a :class:`KVSlot` (its row in a shared batch cache) for sequences made by
    :class:`TransformersLLM`; treat it as opaque (``cache.to_dynamic_cache(model.config)`` gives a
    standalone copy).  ``next_logits`` is a float32 row [V] over the tokenizer's vocabulary, or ``None`` where
    the backend never brings whole rows to the host (the slot engine).  ``next_row`` is that row as the backend
    summarised it for the session (:class:`~cloud_adapter.backends.rows.StepRow`), or ``None`` when the session
    reads ``next_logits`` itself; every forward replaces both.
    """

    ids: list[int]
    cache: Any
    next_logits: np.ndarray | None
    next_row: StepRow | None = None

    def __len__(self) -> int:
        return len(self.ids)


class KVBatch:
    """A left-padded batch KV cache for ``B`` sequences of different true lengths.

    Attributes:
        cache: a ``DynamicCache`` whose layer ``l`` holds keys/values [B, H_kv, S_l, D]: ``S_l = T``
            for full-attention layers, ``min(T, window - 1)`` for sliding-window layers.  Row ``b``'s
            tokens are right-aligned; its first ``T - lengths[b]`` padded positions are pads (zeros,
            masked out).
        lengths: the true lengths [B] (python ints).
        length: ``T = max(lengths)``, the padded length (what the cache layers count).
        pads: ``T - lengths`` as a long tensor [B] on the input device.
        owners: per row, a weak reference to the :class:`KVSlot` bound to it; a row whose slot died
            (sequence dropped) or moved to another batch is stale.
    """

    __slots__ = ("cache", "lengths", "length", "pads", "any_pad", "owners")

    def __init__(self, cache: Any, lengths: list[int], device: torch.device) -> None:
        self.cache = cache
        self.lengths = lengths
        self.length = max(lengths)
        self.pads = torch.tensor([self.length - n for n in lengths], dtype=torch.long, device=device)
        self.any_pad = any(n != self.length for n in lengths)
        self.owners: list[weakref.ref[KVSlot] | None] = [None] * len(lengths)

    @property
    def size(self) -> int:
        """B, the number of rows (stale ones included)."""
        return len(self.lengths)

    def bind(self, slots: Sequence[KVSlot]) -> None:
        """Point ``slots[r]`` at row ``r`` of this batch (in place: whoever holds a slot follows it)."""
        for row, slot in enumerate(slots):
            slot.batch, slot.row = self, row
            self.owners[row] = weakref.ref(slot)

    def live_slots(self) -> list[KVSlot]:
        """The slots still bound to a row of this batch, in row order."""
        live = []
        for row, ref in enumerate(self.owners):
            slot = ref() if ref is not None else None
            if slot is not None and slot.batch is self and slot.row == row:
                live.append(slot)
        return live

    def attention_mask(self, extra: int) -> torch.Tensor | None:
        """[B, T + extra] long mask, 0 on pads; ``None`` when no row is padded."""
        if not self.any_pad:
            return None
        cols = torch.arange(self.length + extra, device=self.pads.device)
        return (cols.unsqueeze(0) >= self.pads.unsqueeze(1)).long()

    def advance(self, n: int = 1) -> None:
        """Every row grew by ``n`` tokens (after a forward over all rows)."""
        self.lengths = [k + n for k in self.lengths]
        self.length += n


@dataclass(eq=False)
class KVSlot:
    """A sequence's KV cache: row ``row`` of the shared :class:`KVBatch` ``batch``.

    Re-batching moves the slot (rebinds ``batch``/``row`` in place).  One slot belongs to one
    sequence: a shallow copy of a :class:`CloudSequence` sharing it cannot step independently.
    """

    batch: KVBatch
    row: int

    @property
    def length(self) -> int:
        """The sequence's true length (tokens held for it)."""
        return self.batch.lengths[self.row]

    def to_dynamic_cache(self, config: Any) -> Any:
        """A standalone batch-1 ``DynamicCache(config=config)`` with this row's KV, unpadded (a copy).

        ``config`` is the model config, so that sliding-window layers keep counting true positions.
        """
        from transformers import DynamicCache

        n = self.length
        cache = DynamicCache(config=config)
        for target, layer in zip(cache.layers, self.batch.cache.layers):
            held = layer.keys.shape[-2]
            keep = min(n, held)
            k = layer.keys[self.row : self.row + 1, :, held - keep :].clone()  # [1, H_kv, keep, D]
            v = layer.values[self.row : self.row + 1, :, held - keep :].clone()
            _fill_layer(target, k, v, n)
        return cache


def _fill_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor, total_length: int) -> None:
    """Put ``keys``/``values`` [B, H_kv, S, D] into an empty cache layer that has seen ``total_length`` positions."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):  # DynamicSlidingWindowLayer counts positions, not held entries
        layer.cumulative_length = total_length


def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_pieces(tokenizer: Any, token_strings: Sequence[str]) -> list[bytes]:
    """The bytes each entry of ``token_strings`` adds to a text under the fast ``tokenizer``'s decoder
    (:meth:`TransformersLLM.token_pieces`); ``TypeError`` for a decoder step it does not know."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {"type": "Fuse"}
    steps = spec["decoders"] if spec["type"] == "Sequence" else [spec]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    byte_level = _byte_level_decoding()
    pieces = []
    for token_id, token in enumerate(token_strings):
        if token_id in special:
            pieces.append(token.encode("utf-8"))
            continue
        piece: bytes | str = token
        for step in steps:
            kind = step["type"]
            if isinstance(piece, bytes) or kind in ("Fuse", "Strip"):
                continue
            if kind == "Replace":
                piece = piece.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":
                piece = piece.replace(step.get("replacement", "\u2581"), " ")
            elif kind == "ByteFallback":
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    piece = bytes([int(piece[3:5], 16)])
            elif kind == "ByteLevel":
                piece = bytes(byte_level[char] for char in piece)
            else:
                raise TypeError(f"the tokenizer's decoder step {kind!r} is not read into token bytes")
        pieces.append(piece if isinstance(piece, bytes) else piece.encode("utf-8"))
    return pieces


class TransformersLLM:
    """A causal LM served from transformers.

    Args:
        model: a :class:`ModelSource`; ``None`` = the embedded Gemma-3 270M.
        dtype: ``"auto"`` (bf16 where the hardware has native bf16 kernels, else
            float32), ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"`` when ``device_map`` is not set.
        device_map: passed to ``from_pretrained`` (``"auto"`` shards a large model over GPUs).
        tp_plan: ``"auto"``: shard every layer over the ranks of a ``torchrun`` launch (tensor parallel, served
            by the slot engine: :class:`~cloud_adapter.backends.slots.SlotLLM`).

    Not thread-safe: call ``open``/``open_many``/``step`` from one thread (the server's decode loop).
    """

    def __init__(
        self,
        model: ModelSource | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str = "cpu",
        device_map: str | None = None,
        tp_plan: str | None = None,
    ) -> None:
        self.source = model or embedded_model()
        hf_model, tokenizer = load_causal_lm(self.source, dtype=dtype, device=device, device_map=device_map,
                                             tp_plan=tp_plan)
        self._setup(hf_model, tokenizer, self.source.name)

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any, name: str = "custom") -> TransformersLLM:
        """Wrap an already loaded ``(model, tokenizer)`` pair (tests, custom loading)."""
        self = cls.__new__(cls)
        self.source = ModelSource(name=name)
        self._setup(model.eval(), tokenizer, name)
        return self

    def _setup(self, model: Any, tokenizer: Any, name: str) -> None:
        self.name = name
        self.model, self.tokenizer = model, tokenizer
        self.dtype = self.model.dtype
        self.device = self.model.device
        self._token_strings = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        # the shared tokenizer ids; output rows past them (padding) are dropped from every row
        self.vocab_size = tokenizer_vocab_size(self._token_strings)
        del self._token_strings[self.vocab_size :]
        outputs = getattr(self.model.config, "vocab_size", None) or self.vocab_size
        if outputs < self.vocab_size:
            raise ValueError(
                f"model {name!r} has {outputs} output rows but its tokenizer defines {self.vocab_size} tokens"
            )
        eos = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        self._fingerprint: bytes | None = None
        self._pieces: list[bytes] | None = None  # token_pieces(), built on first use
        self._batchable: bool | None = None  # decided on the first prefill (cache layer types)

    # -- tokenizer ---------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        bos = self.tokenizer.bos_token_id
        return ([bos] if add_bos and bos is not None else []) + list(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_strings(self) -> list[bytes]:
        """Every tokenizer entry's raw string ("▁the", "Ġthe"), in id order."""
        return [str(token).encode("utf-8") for token in self._token_strings]

    def token_pieces(self) -> list[bytes]:
        """Every id's bytes as it adds them to a text, in id order (``▁The`` → ``b" The"``, ``<0x0A>`` → ``b"\\n"``,
        a byte-level ``Ġthe`` → ``b" the"``; a special token as its name): what a grammar over the vocabulary
        matches (:mod:`edge_sdk.grammar`), read off the fast tokenizer's decoder (``Replace``, ``ByteFallback``,
        ``ByteLevel``, ``Metaspace``; ``Fuse`` and ``Strip`` act on whole texts, not on one id's bytes)."""
        if self._pieces is None:
            self._pieces = token_pieces(self.tokenizer, self._token_strings)
        return list(self._pieces)

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Special added tokens and the tokenizer's named specials ("<eos>", "<unused0>"): never text."""
        added = {i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        return frozenset(i for i in (added | set(self.tokenizer.all_special_ids)) if i < self.vocab_size)

    def token_embeddings(self) -> np.ndarray:
        """The input-embedding matrix's first ``vocab_size`` rows ``[vocab_size, d]``, as float32 on the CPU."""
        weight = self.model.get_input_embeddings().weight
        return weight[: self.vocab_size].detach().to("cpu", torch.float32).numpy()

    def vocab_fingerprint(self) -> bytes:
        if self._fingerprint is None:
            self._fingerprint = vocab_fingerprint(self._token_strings)
        return self._fingerprint

    # -- helpers -----------------------------------------------------------------------------------
    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _logit_rows(self, logits: torch.Tensor) -> np.ndarray:
        """logits [B, 1, V'] -> float32 numpy [B, V] (one conversion, one transfer)."""
        return logits[:, -1, : self.vocab_size].float().contiguous().cpu().numpy()

    def _check_batchable(self, cache: Any) -> bool:
        """Whether every cache layer is a plain dynamic (full or sliding-window) layer we can re-pad."""
        if self._batchable is None:
            from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

            layers = getattr(cache, "layers", None)
            self._batchable = bool(layers) and all(
                type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)
                and layer.is_initialized
                and layer.keys is not None
                and layer.keys.dim() == 4
                for layer in layers
            )
        return self._batchable

    def _slot(self, seq: CloudSequence) -> KVSlot:
        """``seq.cache`` as a :class:`KVSlot` (a bare ``Cache`` from elsewhere becomes a batch of one)."""
        cache = seq.cache
        if isinstance(cache, KVSlot):
            return cache
        seq.cache = self._solo(cache, len(seq.ids))
        return seq.cache

    def _solo(self, cache: Any, length: int) -> KVSlot:
        """A fresh slot owning ``cache`` (batch of one, ``length`` tokens, no padding)."""
        batch = KVBatch(cache, [length], self.device)
        slot = KVSlot(batch, 0)
        batch.bind([slot])
        return slot

    #: rows are read by the session off ``next_logits`` (the slot engine summarises them itself)
    summarizes_rows = False

    def release(self, seq: CloudSequence) -> None:
        """Nothing to give back: a sequence's rows in a batch cache go stale and are compacted away."""

    # -- prefill -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def open(self, prompt_ids: Sequence[int]) -> CloudSequence:
        """Prefill ``prompt_ids`` (length L >= 1) once into a fresh KV cache (a batch of one)."""
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        logits, cache = forward_with_cache(
            self.model,
            self._new_cache(),
            input_ids=torch.tensor([ids], device=self.device),  # [1, L]
            logits_to_keep=1,
        )
        self._check_batchable(cache)
        slot = self._solo(cache, len(ids))
        return CloudSequence(ids=ids, cache=slot, next_logits=self._logit_rows(logits)[0])

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """The logits after each of ``prompt_ids`` but the last, float32 [L - 1, V]: row ``i`` predicts token
        ``i + 1`` (one forward over the prompt, no cache kept; echo with logprobs scores a public prompt so)."""
        ids = [int(i) for i in prompt_ids]
        if len(ids) < 2:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        logits = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False).logits
        return logits[0, :-1, : self.vocab_size].float().contiguous().cpu().numpy()

    @torch.inference_mode()
    def open_many(self, prompts: Sequence[Sequence[int]]) -> list[CloudSequence]:
        """Prefill several prompts in one left-padded forward ([B, max L] tokens).

        The returned sequences share one :class:`KVBatch`, so a following ``step`` over exactly
        these sequences needs no re-batching.  Costs ``B * max(L)`` tokens: prefer similar lengths.
        """
        prompt_ids = [[int(i) for i in p] for p in prompts]
        if any(not p for p in prompt_ids):
            raise ValueError("every prompt must hold at least one token")
        if len(prompt_ids) <= 1 or self._batchable is False:
            return [self.open(p) for p in prompt_ids]
        lengths = [len(p) for p in prompt_ids]
        total = max(lengths)
        pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        input_ids = torch.tensor([[pad_id] * (total - n) + p for n, p in zip(lengths, prompt_ids)], device=self.device)
        pads = torch.tensor([total - n for n in lengths], device=self.device).unsqueeze(1)  # [B, 1]
        cols = torch.arange(total, device=self.device).unsqueeze(0)  # [1, T]
        logits, cache = forward_with_cache(
            self.model,
            self._new_cache(),
            input_ids=input_ids,  # [B, T]
            attention_mask=(cols >= pads).long(),  # [B, T], 0 on the left pads
            position_ids=(cols - pads).clamp(min=0),  # [B, T], true positions
            logits_to_keep=1,
        )
        if not self._check_batchable(cache):  # a cache we cannot re-pad: one prefill each
            return [self.open(p) for p in prompt_ids]
        # Pad queries attend to nothing, so their K/V may be NaN.  Zero them: a masked-out NaN would
        # still poison the weighted sum of a later step (0 * NaN = NaN).
        for layer in cache.layers:
            held = layer.keys.shape[-2]
            for row, n in enumerate(lengths):
                if held > n:
                    layer.keys[row, :, : held - n] = 0
                    layer.values[row, :, : held - n] = 0
        batch = KVBatch(cache, lengths, self.device)
        slots = [KVSlot(batch, r) for r in range(len(lengths))]
        batch.bind(slots)
        rows = self._logit_rows(logits)  # [B, V]
        return [
            CloudSequence(ids=p, cache=slot, next_logits=rows[r])
            for r, (p, slot) in enumerate(zip(prompt_ids, slots))
        ]

    # -- decoding ----------------------------------------------------------------------------------
    def _gather(self, slots: list[KVSlot], *, copy: bool = False) -> KVBatch:
        """The rows of ``slots`` as a new right-aligned :class:`KVBatch` (row ``r`` = ``slots[r]``; not bound).

        ``slots`` must be ordered so rows from one source batch are adjacent and ascending (then each
        source is one slice copy per layer).  From a single source and without ``copy``, contiguous
        rows stay views: fine before a forward, whose ``update`` concatenates into fresh tensors.
        """
        lengths = [s.length for s in slots]
        total = max(lengths)
        runs = [(src, [s.row for s in grp]) for src, grp in itertools.groupby(slots, key=lambda s: s.batch)]
        cache = self._new_cache()
        for idx, layer in enumerate(cache.layers):
            window = getattr(layer, "sliding_window", None)
            held = total if window is None else min(total, window - 1)
            parts = []  # per source: keys, values [k, H_kv, n, D], the last n <= held positions
            for src, rows in runs:
                src_layer = src.cache.layers[idx]
                src_held = src_layer.keys.shape[-2]
                n = min(held, src_held)
                keys, values = src_layer.keys[:, :, src_held - n :], src_layer.values[:, :, src_held - n :]
                if rows != list(range(rows[0], rows[0] + len(rows))) or copy:
                    index = torch.tensor(rows, device=keys.device)
                    keys, values = keys.index_select(0, index), values.index_select(0, index)
                elif len(rows) != src.size:
                    keys, values = keys[rows[0] : rows[0] + len(rows)], values[rows[0] : rows[0] + len(rows)]
                parts.append((keys, values))
            if len(parts) == 1:  # one source: it is at least as long as any of its rows, n == held
                keys, values = parts[0]
            else:
                k0, v0 = parts[0]
                keys = k0.new_zeros((len(slots), k0.shape[1], held, k0.shape[3]))
                values = v0.new_zeros((len(slots), v0.shape[1], held, v0.shape[3]))
                start = 0
                for k, v in parts:
                    stop, n = start + k.shape[0], k.shape[2]
                    keys[start:stop, :, held - n :] = k
                    values[start:stop, :, held - n :] = v
                    start = stop
            _fill_layer(layer, keys, values, total)
        return KVBatch(cache, lengths, self.device)

    def _batch_for(self, slots: list[KVSlot]) -> KVBatch:
        """The batch to step ``slots`` on, re-batching (and rebinding the slots) on a membership change."""
        first = slots[0].batch
        if len(slots) == first.size and all(s.batch is first for s in slots):
            return first  # steady state: exactly the rows of one batch, no copy
        sources: dict[int, KVBatch] = {}
        for s in slots:
            sources.setdefault(id(s.batch), s.batch)
        order = list(sources)
        ordered = sorted(slots, key=lambda s: (order.index(id(s.batch)), s.row))
        batch = self._gather(ordered)
        batch.bind(ordered)
        # Rows left behind stay where they are (no copy) until at most half a source is live; then
        # the live ones move to a compact batch, so stale rows never hold more than the live KV.
        for src in sources.values():
            live = src.live_slots()
            if live and 2 * len(live) <= src.size:
                self._gather(live, copy=True).bind(live)
        return batch

    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[CloudSequence, int]]) -> None:
        """Append one token to each sequence and refresh its ``next_logits`` (one batched forward).

        Each sequence may appear once.  Sequences not in ``batch`` are untouched.  ``next_logits``
        rows of one step are views of one [B, V] float32 array.
        """
        if not batch:
            return
        seqs = [seq for seq, _ in batch]
        tokens = [int(t) for _, t in batch]
        slots = [self._slot(seq) for seq in seqs]
        if len({id(s) for s in slots}) != len(slots):
            raise ValueError("a sequence (or its KV cache) appears twice in one step")
        if not self._check_batchable(slots[0].batch.cache):
            self._step_each(seqs, slots, tokens)
            return
        kv = self._batch_for(slots)
        row_tokens = [0] * kv.size
        for slot, t in zip(slots, tokens):
            row_tokens[slot.row] = t
        logits, kv.cache = forward_with_cache(
            self.model,
            kv.cache,
            input_ids=torch.tensor(row_tokens, device=self.device).unsqueeze(1),  # [B, 1]
            attention_mask=kv.attention_mask(1),  # [B, T+1], or None without padding
            position_ids=(kv.length - kv.pads).unsqueeze(1),  # [B, 1]: each row's true length
            logits_to_keep=1,
        )
        kv.advance(1)
        rows = self._logit_rows(logits)  # [B, V]
        for seq, slot, t in zip(seqs, slots, tokens):
            seq.ids.append(t)
            seq.next_logits, seq.next_row = rows[slot.row], None

    @torch.inference_mode()
    def truncate(self, seq: CloudSequence, length: int) -> None:
        """Drop ``seq``'s tokens past the first ``length`` (a run-ahead draft the edge did not confirm).

        The kept KV moves to a batch of its own (its row in the old batch goes stale and is freed when that
        batch is next compacted), bit for bit what the kept tokens' forwards wrote, so the next ``step`` gives
        the logits a sequence that never held the dropped tokens gets.  A sliding-window layer holds only its
        last ``window - 1`` positions: where the kept tokens' window is no longer held (or the cache cannot be
        re-padded) the kept ids are prefilled again.  ``seq.next_logits`` is stale until the next ``step``.
        """
        if not 1 <= length <= len(seq.ids):
            raise ValueError(f"cannot keep {length} of the sequence's {len(seq.ids)} tokens")
        drop = len(seq.ids) - length
        if drop == 0:
            return
        slot = self._slot(seq)
        source = slot.batch
        kept = self._kept_layers(slot, drop) if self._check_batchable(source.cache) else None
        if kept is None:  # the window moved past what is held: recompute the kept prefix
            fresh = self.open(seq.ids[:length])
            seq.cache, seq.next_logits, seq.next_row = fresh.cache, fresh.next_logits, None
        else:
            cache = self._new_cache()
            for layer, (keys, values) in zip(cache.layers, kept):
                _fill_layer(layer, keys, values, length)
            batch = KVBatch(cache, [length], self.device)
            batch.bind([slot])
        del seq.ids[length:]

    def _kept_layers(self, slot: KVSlot, drop: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, copies of ``slot``'s keys/values without its last ``drop`` tokens (``None`` where a
        sliding-window layer no longer holds a kept position its window needs)."""
        n, row = slot.length, slot.row
        length = n - drop
        kept = []
        for layer in slot.batch.cache.layers:
            held = layer.keys.shape[-2]
            mine = min(n, held)  # this row's tokens are the last `mine` held positions
            window = getattr(layer, "sliding_window", None)
            need = length if window is None else min(length, window - 1)
            if mine - drop < need:
                return None
            stop = held - drop
            keys = layer.keys[row : row + 1, :, stop - need : stop].clone()  # [1, H_kv, need, D]
            values = layer.values[row : row + 1, :, stop - need : stop].clone()
            kept.append((keys, values))
        return kept

    def _step_each(self, seqs: list[CloudSequence], slots: list[KVSlot], tokens: list[int]) -> None:
        """Fallback for caches we cannot re-pad: one forward per sequence (each a batch of one)."""
        for seq, slot, t in zip(seqs, slots, tokens):
            kv = slot.batch
            logits, kv.cache = forward_with_cache(
                self.model, kv.cache, input_ids=torch.tensor([[t]], device=self.device), logits_to_keep=1
            )
            kv.advance(1)
            seq.ids.append(t)
            seq.next_logits, seq.next_row = self._logit_rows(logits)[0], None


class TransformersSLM:
    """A transformers model as an edge :class:`~edge_sdk.backends.base.SLMBackend` (one sequence).

    For full-precision reference runs and tests: the same model code as the
    cloud, driven through the edge's narrow interface.  ``prefill`` opens a
    fresh KV cache, so its result depends on the prompt alone.
    """

    def __init__(self, llm: TransformersLLM) -> None:
        self.llm = llm
        self.name = llm.name
        self.vocab_size = llm.vocab_size
        self.eos_token_ids = llm.eos_token_ids
        self._seq: CloudSequence | None = None

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return self.llm.tokenize(text, add_bos=add_bos)

    def detokenize(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids)

    def token_strings(self) -> list[bytes]:
        return self.llm.token_strings()

    def token_embeddings(self) -> np.ndarray:
        """The model's input-embedding matrix ``[vocab_size, d]`` (float32): CusText's neighbours read it."""
        return self.llm.token_embeddings()

    def vocab_fingerprint(self) -> bytes:
        return self.llm.vocab_fingerprint()

    def prefill(self, ids: list[int]) -> np.ndarray:
        self._seq = self.llm.open(ids)
        return self._seq.next_logits.copy()

    def append(self, token_id: int) -> np.ndarray:
        if self._seq is None:
            raise RuntimeError("append before prefill: the sequence is empty")
        self.llm.step([(self._seq, int(token_id))])
        return self._seq.next_logits.copy()
