"""Loading the cloud LLM with HF transformers: dtype choice and the GGUF conversion cache.

transformers can read a GGUF file (``from_pretrained(dir, gguf_file=name)``)
and dequantises every tensor to full precision: ~30-40 s for the embedded
270M model on 2 cores.  The first load therefore saves the dequantised model
as safetensors under ``$COVEIL_CACHE_DIR`` (default ``~/.cache/coveil``) and
later loads read that in a few seconds.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from edge_sdk.models import ModelSource, cache_root

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16), read from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def preferred_dtype(device: str) -> torch.dtype:
    """bf16 on a GPU that supports it or a CPU with native bf16 kernels, else float32.

    On CPUs without bf16 instructions torch emulates bf16 and it is slower than
    float32; with AMX, bf16 batches well (measured: batch 8 at 6.5x the tok/s
    of batch 1, against 3.0x in float32).
    """
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def dtype_device(device: str, device_map: str | None) -> str:
    """The device whose kernels decide ``dtype="auto"``: ``device``, or with a device map where its weights go.

    accelerate's ``"auto"``/``"balanced"``/``"sequential"`` maps fill the visible
    GPUs first, so a map means ``"cuda"`` when a GPU is visible (a 70B model
    spread over GPUs loads in bf16, not in the host CPU's float32).
    """
    if device_map is None:
        return device
    if device_map.startswith("cuda"):
        return device_map
    return "cuda" if device_map != "cpu" and torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return preferred_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}") from None


@functools.cache
def _cache_argument(model_type: type) -> str:
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def forward_with_cache(model: Any, cache: Any, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """``model(**inputs)`` reading and extending the KV ``cache``: its logits and the cache it returns.

    The cache goes in under the name the installed transformers takes it by: ``cache`` where the model's
    ``forward`` has it (there ``past_key_values`` is deprecated and warns), else ``past_key_values`` (the older
    releases the package's requirement admits); the same tensors either way, so the same logits bit for bit.
    """
    name = _cache_argument(type(model))
    out = model(**inputs, **{name: cache}, use_cache=True)
    return out.logits, getattr(out, name)


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the dequantised copy of ``gguf_path`` lives (keyed by path, size, mtime and transformers version)."""
    import transformers

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "hf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """Dequantise a GGUF into a safetensors checkpoint at ``target`` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s once into %s (later loads use this cache)", source.gguf_path, target)
    location, gguf_file = source.hf_location, source.hf_gguf_file
    tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(location, gguf_file=gguf_file, dtype=torch.float32)
    # save_pretrained refuses a model that still carries the GGUF quantizer, although its weights
    # are already plain dequantised tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            # another process (a second test worker, a second adapter) finished the same conversion first
            if not (target / "config.json").is_file():
                raise
            log.info("%s was converted by another process meanwhile; using it", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _transformers_location(source: ModelSource) -> str:
    """Where transformers loads ``source`` from: its directory or hub name, or a GGUF's dequantised cache (made
    on first use)."""
    if source.gguf_path is not None and source.hf_name_or_dir is None:
        location = gguf_cache_dir(source.gguf_path)
        if not (location / "config.json").is_file():
            _convert_gguf(source, location)
        return str(location)
    return source.hf_location


def load_tokenizer(source: ModelSource) -> Any:
    """``source``'s transformers tokenizer alone (no weights are loaded, unless a GGUF's cache must be made)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_transformers_location(source))


def load_causal_lm(
    source: ModelSource,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str = "cpu",
    device_map: str | None = None,
    tp_plan: str | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for ``source`` in eval mode.

    GGUF sources go through the conversion cache; HF directories and cached
    hub names load directly.  ``device_map="auto"`` (accelerate) spreads a
    large model over the visible GPUs; ``tp_plan="auto"`` shards it over the
    ranks of a ``torchrun`` launch by transformers' tensor-parallel plan (each
    rank keeps its share of every layer on its own device); otherwise the model
    is moved to ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype, dtype_device(device, device_map))
    location_str = _transformers_location(source)
    tokenizer = AutoTokenizer.from_pretrained(location_str)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if tp_plan is not None:
        kwargs["tp_plan"] = tp_plan
    model = AutoModelForCausalLM.from_pretrained(location_str, **kwargs)
    if device_map is None and tp_plan is None:
        model.to(device)
    model.eval()
    log.info("loaded %s as %s on %s", source.name, torch_dtype, device_map or device)
    return model, tokenizer
