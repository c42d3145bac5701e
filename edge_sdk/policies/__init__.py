"""Decoding-time defences, one small class each, behind one registry.

>>> from edge_sdk.policies import make_policy
>>> make_policy("coveil", lam=2.0).describe()
'coveil(lam=2.0, k=50)'

Each policy class wraps pure numpy functions (``coveil_upload``,
``coveil_select``, the baselines' mechanisms) that the SDK, the cloud adapter
and the harness all share.
"""

from __future__ import annotations

from typing import Any

from edge_sdk.policies.base import (
    FUSION_MODES,
    CloudUpload,
    FusionMode,
    Observation,
    Policy,
    SyncedToken,
    UnsupportedModeError,
)
from edge_sdk.policies.baselines import (
    CoGenesis,
    CusText,
    DPFusion,
    DPLogit,
    EmbeddingNeighbours,
    InvisibleInk,
    LDPSampler,
    load_token_embeddings,
)
from edge_sdk.policies.coveil import CoVeil, coveil_select, coveil_upload
from edge_sdk.policies.undefended import Undefended

_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy], *, force: bool = False) -> type[Policy]:
    """Add a policy class under ``cls.name`` (usable as a class decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls and not force:
        raise ValueError(f"a policy named {cls.name!r} is already registered ({_REGISTRY[cls.name].__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies(mode: FusionMode | None = None) -> list[str]:
    """Registered policy names, optionally only those that define ``mode``."""
    return sorted(name for name, cls in _REGISTRY.items() if mode is None or mode in cls.modes)


def policy_class(name: str) -> type[Policy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None


def make_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy by name with its parameters."""
    return policy_class(name)(**params)


for _cls in (Undefended, CoVeil):
    register_policy(_cls)

for _cls in (CoGenesis, DPLogit, DPFusion, CusText, LDPSampler, InvisibleInk):
    register_policy(_cls)

__all__ = [
    "FUSION_MODES",
    "CloudUpload",
    "CoGenesis",
    "CoVeil",
    "CusText",
    "DPFusion",
    "DPLogit",
    "EmbeddingNeighbours",
    "FusionMode",
    "InvisibleInk",
    "LDPSampler",
    "Observation",
    "Policy",
    "SyncedToken",
    "Undefended",
    "UnsupportedModeError",
    "available_policies",
    "coveil_select",
    "coveil_upload",
    "load_token_embeddings",
    "make_policy",
    "policy_class",
    "register_policy",
]
