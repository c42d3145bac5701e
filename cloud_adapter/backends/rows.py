"""A decode step's row as the session reads it: the top ids and values in the session's space, never a V-sized array.

A backend ends every forward with :func:`summarize_rows` over the batch's logits ``z`` [B, V] where they lie (the
GPU for the slot engine), and hands each session a :class:`StepRow`:

* ``ids``: the ``top_n`` ids of the row by decreasing value, ties to the lower id (the order of
  :func:`edge_sdk.fusion.top_k_ids`, which the edge and DecodeLeak use);
* ``values``: the row's value at those ids in the session's space, ``p(i) = softmax(z)(i)`` (probability space) or
  ``z(i)`` (logit space);
* ``probs``: ``p(i)`` at those ids (a logit-space row's tail certificate is a probability);
* whether every logit is finite;
* the whole row of values, only on request (:meth:`StepRow.full_values`): a dense row, a cloud-side pick, a full
  row the edge asks for.  It is the very array the top values were read from, so what the cloud sends and what
  it picks from agree bit for bit, near-ties included.

Two implementations of one rule: on the CPU each row goes through the edge's own numpy functions
(:func:`edge_sdk.fusion.softmax`, :func:`~edge_sdk.fusion.top_k_ids`: the bytes the adapter always sent); on a GPU
the batch is reduced on the device, ``p = exp(z - log sum_j exp z(j))`` and an exact top-n by 64-bit keys (value bits, then
the complement of the id), and one copy brings ``B * (3n + 1)`` numbers to the host instead of ``B * V``.
``tests/cloud_adapter/test_slot_engine.py`` holds the device rule to the numpy one, ties and signed zeros included.

The greedy cloud-side pick (:class:`GreedyPick`: an upload fused with the row by :func:`edge_sdk.fusion.cloud_scores`
at temperature 0, then ``argmax``, ties to the lower id) is read the same way: off the kept row where it lies
(:meth:`StepRow.greedy_cloud_pick`, :func:`greedy_picks`), on the device for a device row, so a cloud-side step
copies one id to the host instead of the row.  It runs over the whole kept row, not only its top ids: ``a * z``
rounds in float32, and two values a rounding apart can fuse to a tie that the lower id, wherever it ranks, wins.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_sdk.fusion import FusionSpace, cloud_alpha, cloud_scores, softmax, top_k_ids


@dataclass(frozen=True)
class RowSpec:
    """What a session reads of each of its rows: its fusion space and how many top ids (``top_n``).

    ``top_n`` covers both the ids the session sends (its ``top_m``) and the ``K`` its exposure set is read off;
    ``dense`` sessions (``top_m`` = the vocabulary) read the whole row every step.
    """

    space: FusionSpace = "prob"
    top_n: int = 1
    dense: bool = False

    def __post_init__(self) -> None:
        if self.top_n < 1:
            raise ValueError(f"top_n must be at least 1, got {self.top_n}")


@dataclass(eq=False)
class StepRow:
    """One sequence's next-token row, as a backend summarised it (see the module docstring).

    ``_values_row`` and ``_logits_row`` hold the whole row where it lies (a numpy array, or a tensor on the model's device), read
    only by :meth:`full_values` and :meth:`logits`.
    """

    spec: RowSpec
    ids: np.ndarray
    values: np.ndarray
    probs: np.ndarray
    finite: bool
    _values_row: Any
    _logits_row: Any

    @property
    def vocab_size(self) -> int:
        return int(self._logits_row.shape[-1])

    @property
    def kept_values(self) -> Any:
        """The whole row in the session's space where it lies: a numpy array, or a tensor on the model's device."""
        return self._values_row

    def full_values(self) -> np.ndarray:
        """The whole row in the session's space, float32 [V]: the array ``values`` were read from."""
        return _host(self._values_row)

    def logits(self) -> np.ndarray:
        """The raw logits ``z`` [V] (float32), for a row kept to serve a resumed stream again."""
        return _host(self._logits_row)

    def greedy_cloud_pick(self, pick: GreedyPick) -> int:
        """``pick``'s token on this row (:func:`greedy_picks`)."""
        return greedy_picks([self], [pick])[0]


@dataclass(frozen=True)
class GreedyPick:
    """A greedy cloud-side pick: ``argmax s`` (ties to the lower id) of :func:`edge_sdk.fusion.cloud_scores` at
    temperature 0, ``s(i) = a * row(i) + (1 - a) * m(i) * u(i)`` with the ``stop_ids`` lowered out of the choice.

    An empty upload is the cloud's run-ahead draft (its pick from the row alone)."""

    upload_ids: np.ndarray
    upload_values: np.ndarray
    alpha: float
    space: FusionSpace
    stop_ids: np.ndarray

    @classmethod
    def draft(cls, alpha: float, space: FusionSpace) -> GreedyPick:
        """The draft rule: an empty upload, no id lowered."""
        return cls(np.empty(0, np.int64), np.empty(0, np.float32), alpha, space, np.empty(0, np.int64))


def greedy_picks(rows: Sequence[StepRow], picks: Sequence[GreedyPick]) -> list[int]:
    """Each row's pick: numpy rows by :func:`~edge_sdk.fusion.cloud_scores` itself, device rows
    (:func:`fused_scores_on_device`) together with one copy of their ids to the host."""
    tokens: list[int | None] = [None] * len(rows)
    on_device = []
    for b, (row, pick) in enumerate(zip(rows, picks, strict=True)):
        if isinstance(row.kept_values, np.ndarray):
            scores, _ = cloud_scores(row.kept_values, pick.upload_ids, pick.upload_values, pick.alpha,
                                     space=pick.space, temperature=0.0, stop_ids=pick.stop_ids)
            tokens[b] = int(np.argmax(scores))
        else:
            on_device.append(b)
    if on_device:
        import torch

        device = rows[on_device[0]].kept_values.device
        # a CUDA side stream: a session's pick, made while the worker's next forward is queued, does not wait for
        # it (the kept rows were complete when their step's summary came to the host)
        with torch.cuda.stream(_pick_stream(device.index)) if device.type == "cuda" else contextlib.nullcontext():
            scores = torch.stack([fused_scores_on_device(rows[b].kept_values, picks[b]) for b in on_device])
            top = top_ids_on_device(scores, 1)[:, 0].cpu().tolist()  # the one host sync
        for b, token in zip(on_device, top):
            tokens[b] = int(token)
    return [int(t) for t in tokens]  # type: ignore[arg-type]


@functools.cache
def _pick_stream(device_index: int | None) -> Any:
    """The CUDA stream greedy picks run on, one per device."""
    import torch

    return torch.cuda.Stream(device_index)


def fused_scores_on_device(values: Any, pick: GreedyPick) -> Any:
    """:func:`~edge_sdk.fusion.cloud_scores` at temperature 0 in torch, on ``values``' device, float for float.

    ``s = float32(a) * row``; ``s[ids] += float32(1 - a) * u`` (the addend computed in numpy as
    :func:`~edge_sdk.fusion.fuse_upload` computes it; ids are unique); the stop ids set to float32's minimum
    (logit space) or to the float32 just below ``min(0, min s)`` (probabilities), as
    :func:`~edge_sdk.fusion.lowered_stop` does.  Each is one rounded float32 operation, as in numpy.
    """
    import torch

    alpha = cloud_alpha(pick.alpha, len(pick.upload_ids))
    device = values.device
    scores = values.float() * torch.tensor(np.float32(alpha), device=device)
    if len(pick.upload_ids):
        addend = np.float32(1.0 - alpha) * np.asarray(pick.upload_values, dtype=np.float32)
        ids = torch.from_numpy(np.asarray(pick.upload_ids, np.int64)).to(device)
        scores[ids] += torch.from_numpy(addend).to(device)
    stop_ids = np.asarray(pick.stop_ids, np.int64)
    stop_ids = stop_ids[stop_ids < scores.shape[0]]
    if stop_ids.size:
        stop = torch.from_numpy(stop_ids).to(device)
        if pick.space == "logit":  # raw fused logits (greedy)
            scores[stop] = torch.finfo(torch.float32).min
        else:
            low = torch.minimum(scores.min(), torch.zeros((), device=device))
            scores[stop] = torch.nextafter(low, torch.tensor(-np.inf, device=device))
    return scores


def _host(row: Any) -> np.ndarray:
    if isinstance(row, np.ndarray):
        return row
    return row.detach().to("cpu").numpy()


def summarize_rows(logits: Any, specs: Sequence[RowSpec], *, on_device: bool = False) -> list[StepRow]:
    """Each row of ``logits`` [B, V] (a float32 numpy array, or a torch tensor) read as ``specs[b]`` asks.

    A tensor off the CPU (or any tensor, ``on_device``) is reduced on its device (:func:`_summarize_on_device`);
    anything else row by row in numpy (:func:`summarize_row`).
    """
    if len(specs) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows but {len(specs)} specs")
    if not isinstance(logits, np.ndarray):
        if logits.device.type != "cpu" or on_device:
            return _summarize_on_device(logits, specs)
        logits = logits.detach().float().numpy()
    return [summarize_row(logits[b], spec) for b, spec in enumerate(specs)]


def summarize_row(logits: np.ndarray, spec: RowSpec) -> StepRow:
    """One row on the host: ``p = softmax(z)`` and ``TopK`` exactly as the edge computes them."""
    z = np.asarray(logits, dtype=np.float32)
    finite = bool(np.isfinite(z.sum(dtype=np.float32)))  # finite logits cannot overflow a float32 sum
    p = softmax(z) if finite else np.full_like(z, np.nan)
    values = z if spec.space == "logit" else p
    ids = top_k_ids(values, min(spec.top_n, z.shape[0])) if finite else np.empty(0, np.int64)
    return StepRow(spec, ids, values[ids], p[ids], finite, values, z)


#: the low 32 bits of a device key hold the complement of the id, so equal values rank the lower id first
_ID_BITS = 32


def ordered_float_keys(values: Any) -> Any:
    """int64 keys [B, V] whose order is the order of ``values`` (float32), ties broken to the lower id.

    A float32's bits read as a signed int order non-negative floats; for negative ones the order of the
    magnitude bits ``m`` is reversed, so ``k = b`` for ``b >= 0`` and ``k = -m`` otherwise (``-0.0`` and ``0.0``
    both give 0, as they compare equal).  ``key = k * 2^32 + (V - 1 - id)``: ``|k| < 2^31`` keeps it in int64.
    """
    import torch

    bits = values.contiguous().view(torch.int32).to(torch.int64)
    magnitude = bits & 0x7FFFFFFF
    k = torch.where(bits >= 0, bits, -magnitude)
    vocab = values.shape[-1]
    id_complement = (vocab - 1) - torch.arange(vocab, device=values.device, dtype=torch.int64)
    return (k << _ID_BITS) + id_complement


def top_ids_on_device(values: Any, n: int) -> Any:
    """``TopK`` of each row of ``values`` [B, V] on its device: ids [B, n] by decreasing value, ties to the
    lower id (exact: every key is distinct)."""
    keys = ordered_float_keys(values)
    top = keys.topk(n, dim=-1, sorted=True).values
    return (values.shape[-1] - 1) - (top & ((1 << _ID_BITS) - 1))


def _summarize_on_device(logits: Any, specs: Sequence[RowSpec]) -> list[StepRow]:
    """:func:`summarize_rows` with the reductions on the logits' device and one copy to the host."""
    import torch

    z = logits.float()
    finite = torch.isfinite(z).all(dim=-1)
    top = z.amax(dim=-1, keepdim=True)
    log_z = top + torch.log(torch.exp(z - top).sum(dim=-1, keepdim=True))
    p = torch.exp(z - log_z)
    logit_rows = torch.tensor([spec.space == "logit" for spec in specs], device=z.device)
    values = torch.where(logit_rows[:, None], z, p)
    n = min(max(spec.top_n for spec in specs), z.shape[-1])
    ids = top_ids_on_device(values, n)
    packed = torch.cat([
        ids.to(torch.float64), values.gather(-1, ids).to(torch.float64), p.gather(-1, ids).to(torch.float64),
        finite[:, None].to(torch.float64),
    ], dim=-1).cpu().numpy()  # the step's one copy to the host
    rows = []
    for b, spec in enumerate(specs):
        k = min(spec.top_n, z.shape[-1])
        host = packed[b]
        ok = bool(host[3 * n])
        rows.append(StepRow(
            spec, host[:k].astype(np.int64) if ok else np.empty(0, np.int64),
            host[n : n + k].astype(np.float32), host[2 * n : 2 * n + k].astype(np.float32),
            ok, values[b], z[b],
        ))
    return rows
