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

from edge_sdk.backends.base import SLMBackend
from edge_sdk.policies.base import (
    FUSION_MODES,
    CloudUpload,
    FusionMode,
    Observation,
    Policy,
    SyncedToken,
    UnsupportedModeError,
)
from edge_sdk.policies.cogenesis import CoGenesis
from edge_sdk.policies.coveil import CoVeil, coveil_select, coveil_upload
from edge_sdk.policies.custext import CusText, EmbeddingNeighbours, TokenClusters, load_token_embeddings
from edge_sdk.policies.dp_fusion import DPFusion
from edge_sdk.policies.dp_logit import DPLogit
from edge_sdk.policies.invisible_ink import InvisibleInk
from edge_sdk.policies.ldp_sampler import LDPSampler
from edge_sdk.policies.undefended import Undefended
from edge_sdk.registry import Registry

#: every registered defence, by its ``name``
POLICIES: Registry[type[Policy]] = Registry("policy")


def register_policy(cls: type[Policy], *, force: bool = False) -> type[Policy]:
    """Add a policy class under ``cls.name`` (usable as a class decorator)."""
    return POLICIES.register(cls.name, cls, force=force)  # type: ignore[return-value]


def available_policies(mode: FusionMode | None = None) -> list[str]:
    """Registered policy names, optionally only those that define ``mode``."""
    return [name for name in POLICIES.names() if mode is None or mode in POLICIES.get(name).modes]


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name`` (:class:`~edge_sdk.registry.UnknownNameError` with suggestions otherwise)."""
    return POLICIES.get(name)


def make_policy(name: str, backend: SLMBackend | None = None, **params: Any) -> Policy:
    """Instantiate a registered policy by name with its parameters.

    With ``backend`` the policy builds itself from the edge model
    (:meth:`Policy.from_backend`), e.g. CusText's embedding neighbours.
    """
    cls = policy_class(name)
    return cls(**params) if backend is None else cls.from_backend(backend, **params)


for _cls in (Undefended, CoVeil, CoGenesis, DPLogit, DPFusion, CusText, LDPSampler, InvisibleInk):
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
    "POLICIES",
    "LDPSampler",
    "Observation",
    "Policy",
    "SyncedToken",
    "TokenClusters",
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
