"""How the cloud model's forwards run, by name: ``transformers`` and ``slots`` (``coveil-cloud serve --backend``).

* ``transformers`` (:class:`~cloud_adapter.llm.TransformersLLM`): transformers' own caches, batched and re-padded
  on every change of membership; any architecture transformers loads, and the rows sessions read are whole
  numpy rows.  The CPU default, the oracle of the tests.
* ``slots`` (:class:`~cloud_adapter.backends.slots.SlotLLM`): preallocated per-session KV written in place,
  rollback by length, grouped-query attention without repeated heads, rows summarised on the device, admission
  by the bytes of KV the device holds.  The CUDA default.

Both run behind :class:`~cloud_adapter.runners.StepBatcher` (one worker thread, continuous batching), and both
hand sessions :class:`~cloud_adapter.backends.rows.StepRow` s, so nothing above the runner knows which one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.cli_flags import positive_float, positive_int
from edge_sdk.registry import Registry


@dataclass(frozen=True)
class BackendSettings:
    """What ``coveil-cloud serve`` passes to a backend (the slot engine's sizes; the transformers one takes none).

    ``max_slots``: the most sessions at once (``None``: as many as the KV budget holds); ``max_len``: tokens one
    session holds, prompt and generated (``None``: the model's positions, at most 4,096); ``kv_fraction``: the
    share of free device memory the KV cache takes; ``prefill_chunk``: prompt tokens per prefill forward.
    """

    max_slots: int | None = field(default=None, metadata={
        "type": positive_int, "metavar": "N",
        "help": "slots backend: the most sessions at once; unset = as many as the KV budget holds"})
    max_len: int | None = field(default=None, metadata={
        "type": positive_int, "metavar": "TOKENS",
        "help": "slots backend: tokens one session holds, prompt and generated; unset = the model's positions, "
                "at most 4096"})
    kv_fraction: float = field(default=0.9, metadata={
        "type": positive_float, "metavar": "SHARE",
        "help": "slots backend: the share of the GPU memory free after loading that the KV cache takes"})
    prefill_chunk: int = field(default=512, metadata={
        "type": positive_int, "metavar": "TOKENS", "help": "slots backend: prompt tokens per prefill forward"})


#: name -> a function of (the loaded TransformersLLM, BackendSettings) giving the model StepBatcher runs
BACKENDS: Registry[Callable[[Any, BackendSettings], Any]] = Registry("backend")


@BACKENDS.register("transformers")
def _transformers(llm: Any, settings: BackendSettings) -> Any:
    return llm


@BACKENDS.register("slots")
def _slots(llm: Any, settings: BackendSettings) -> Any:
    from cloud_adapter.backends.slots import SlotLLM

    return SlotLLM(llm, max_slots=settings.max_slots, max_len=settings.max_len, kv_fraction=settings.kv_fraction,
                   prefill_chunk=settings.prefill_chunk)


def default_backend(llm: Any) -> str:
    """``slots`` for a model on a GPU that the slot engine can run, else ``transformers``."""
    from cloud_adapter.backends.slots import supports

    return "slots" if llm.device.type == "cuda" and supports(llm) is None else "transformers"


def build_backend(name: str, llm: Any, settings: BackendSettings | None = None) -> Any:
    """The model a :class:`~cloud_adapter.runners.StepBatcher` runs for backend ``name`` (``"auto"``:
    :func:`default_backend`)."""
    chosen = default_backend(llm) if name == "auto" else name
    return BACKENDS.get(chosen)(llm, settings or BackendSettings())
