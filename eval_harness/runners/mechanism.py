"""CoVeil's per-step mechanism, measured against full fusion (the paper's "Sensitivity Analysis").

For each decoding step ``t`` of a finished generation, with ``y_t`` the token
the collaboration chose and

    p_fuse^(t) = alpha * p_L^(t) + (1 - alpha) * p_S^(t)        (probability space)
    s^(t)      = alpha * z_L^(t) + (1 - alpha) * z_S^(t)        (logit space, the release's)

computed from the *full* distributions of both models (no upload mask, no
noise, no sparse certificate):

* top-1 agreement: ``y_t == argmax_i p_fuse^(t)(i)`` (ties to the lower id, as
  the loop's greedy pick), the "original full-fusion choice";
* selected-token rank: ``rank_t = 1 + |{i : p_fuse^(t)(i) > p_fuse^(t)(y_t)}|``;
* zero upload (cloud-side): the edge uploaded no SLM value at step ``t``
  (read off the edge's ledger: what the cloud received).

At a step where the stopping rule forbade ending, end-of-generation ids are
out of the ranking, as they were out of the choice.

Neither end holds these quantities during decoding (the edge never sees the
cloud's full row when a sparse certificate decides, the cloud never sees
``p_S``), so the harness recomputes them after the item finishes: one
teacher-forced forward of each model over its prompt and the generated tokens
gives ``p_S^(t)`` and ``p_L^(t)`` at every step.  That forward runs the whole
sequence at once where decoding ran it token by token with a KV cache; the
two agree up to floating-point rounding (exactly enough in float32, less so in
bfloat16), so at an exact or near tie of the fused top two a recomputed
agreement or rank can differ from what the loop saw.  Only the harness does
this; nothing of it is sent anywhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

#: the rank bins of the paper's rank-distribution figure: (label, lowest rank, highest rank or None)
RANK_BINS: tuple[tuple[str, int, int | None], ...] = (("1", 1, 1), ("2-5", 2, 5), ("6-50", 6, 50), (">50", 51, None))
#: steps whose fused rows are formed at once (bounds the temporaries at ``rows x vocabulary`` floats)
ROW_CHUNK = 64


def step_decisions(
    slm_logits: torch.Tensor,
    llm_logits: torch.Tensor,
    chosen: Sequence[int],
    *,
    alpha: float,
    space: str = "prob",
    end_allowed: Sequence[bool] | None = None,
    stop_ids: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """The full-fusion top token and the chosen token's rank under full fusion, per step.

    Args:
        slm_logits, llm_logits: ``[T, V]`` raw logits of each model at the ``T`` steps (one vocabulary).
        chosen: the ``T`` tokens the collaboration appended.
        alpha: the cloud LLM's fusion weight.
        space: ``"prob"`` (fuse softmax probabilities) or ``"logit"`` (fuse raw logits).
        end_allowed: per step, whether an end-of-generation token could be chosen (``None``: always).
        stop_ids: the end-of-generation ids taken out of steps where ending was not allowed.

    Returns:
        ``(full_top, ranks)``: per step ``argmax`` of the fused row and ``1 + #{i: fused(i) > fused(y_t)}``.
    """
    steps = len(chosen)
    if slm_logits.shape != llm_logits.shape or slm_logits.dim() != 2 or slm_logits.shape[0] != steps:
        raise ValueError(f"need [T, V] logits of both models for T = {steps} steps, got {tuple(slm_logits.shape)} "
                         f"and {tuple(llm_logits.shape)}")
    if space not in ("prob", "logit"):
        raise ValueError(f"space must be 'prob' or 'logit', got {space!r}")
    if end_allowed is not None and len(end_allowed) != steps:
        raise ValueError(f"end_allowed holds {len(end_allowed)} flags for {steps} steps")
    device = slm_logits.device
    tokens = torch.as_tensor(list(chosen), dtype=torch.long, device=device)
    vocab = slm_logits.shape[1]
    stops = torch.as_tensor(sorted(i for i in stop_ids if 0 <= i < vocab), dtype=torch.long, device=device)
    blocked = torch.as_tensor([not allowed for allowed in end_allowed] if end_allowed is not None else [False] * steps,
                              dtype=torch.bool, device=device)
    full_top: list[int] = []
    ranks: list[int] = []
    for start in range(0, steps, ROW_CHUNK):
        rows = slice(start, min(start + ROW_CHUNK, steps))
        z_s, z_l = slm_logits[rows].float(), llm_logits[rows].float()
        if space == "prob":
            fused = alpha * torch.softmax(z_l, dim=-1) + (1.0 - alpha) * torch.softmax(z_s, dim=-1)
        else:
            fused = alpha * z_l + (1.0 - alpha) * z_s
        if stops.numel():
            block = blocked[rows].nonzero().squeeze(1)
            if block.numel():
                fused[block.unsqueeze(1), stops.unsqueeze(0)] = float("-inf")
        mine = fused.gather(1, tokens[rows].unsqueeze(1))  # [rows, 1]
        full_top += fused.argmax(dim=-1).tolist()  # the first maximum: ties to the lower id
        ranks += (1 + (fused > mine).sum(dim=-1)).tolist()
    return full_top, ranks


def rank_bin(rank: int) -> str:
    """The :data:`RANK_BINS` label holding ``rank``."""
    for label, low, high in RANK_BINS:
        if rank >= low and (high is None or rank <= high):
            return label
    raise ValueError(f"a rank is at least 1, got {rank}")


def summarise(chosen: Sequence[int], full_top: Sequence[int], ranks: Sequence[int],
              uploads: Sequence[int] | None = None) -> dict[str, Any]:
    """The row's ``"mechanism"`` field: counts over the item's steps (summed over items, they pool by step).

    ``uploads``: SLM values uploaded per step (cloud-side; ``None`` edge-side, where nothing is uploaded).
    """
    if not len(chosen) == len(full_top) == len(ranks):
        raise ValueError(f"per-step lists of one length needed, got {len(chosen)}, {len(full_top)}, {len(ranks)}")
    if uploads is not None and len(uploads) != len(chosen):
        raise ValueError(f"{len(uploads)} upload sizes for {len(chosen)} steps")
    bins = dict.fromkeys((label for label, _, _ in RANK_BINS), 0)
    for rank in ranks:
        bins[rank_bin(rank)] += 1
    steps = len(chosen)
    return {
        "steps": steps,
        "zero_upload_steps": None if uploads is None else sum(1 for n in uploads if n == 0),
        "top1_agreement_steps": sum(1 for y, top in zip(chosen, full_top) if y == top),
        "rank_sum": int(sum(ranks)),
        "rank_mean": sum(ranks) / steps if steps else None,
        "rank_bins": bins,
    }


@torch.inference_mode()
def teacher_forced_logits(model: Any, prompt: Sequence[int], tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``[T, V]`` logits a causal LM gives before each of ``tokens`` (teacher-forced: one forward, no cache).

    ``model`` is a transformers causal LM; the input is ``prompt + tokens[:-1]`` and the
    last ``T = len(tokens)`` positions' rows are kept, cut to ``vocab_size`` (padding rows dropped).
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if not tokens:
        return torch.empty((0, vocab_size))
    device = model.device
    ids = torch.tensor([[int(i) for i in prompt] + [int(i) for i in tokens[:-1]]], device=device)
    out = model(input_ids=ids, use_cache=False, logits_to_keep=len(tokens))
    return out.logits[0, :, :vocab_size]
