"""CoVeil edge SDK: private cloud-edge collaborative decoding on the device.

>>> from edge_sdk import EdgeClient, CoVeil, LlamaCppSLM, Credentials

Importing this package is light: numpy only.  Each name below is imported
from its module when first used (as transformers does), so llama.cpp loads
with :class:`LlamaCppSLM` and gRPC with the first remote session.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "EdgeClient": "edge_sdk.client",
    "Credentials": "edge_sdk.client",
    "GenerationResult": "edge_sdk.client",
    "LlamaCppSLM": "edge_sdk.backends.llama_cpp",
    "SLMBackend": "edge_sdk.backends.base",
    "CoVeil": "edge_sdk.policies",
    "Undefended": "edge_sdk.policies",
    "Policy": "edge_sdk.policies",
    "make_policy": "edge_sdk.policies",
    "available_policies": "edge_sdk.policies",
    "PrivacyLedger": "edge_sdk.privacy.ledger",
    "CloudError": "edge_sdk.protocol.status",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # the lazy exports, re-exported (``X as X``) for type checkers
    from edge_sdk.backends.base import SLMBackend as SLMBackend
    from edge_sdk.backends.llama_cpp import LlamaCppSLM as LlamaCppSLM
    from edge_sdk.client import Credentials as Credentials
    from edge_sdk.client import EdgeClient as EdgeClient
    from edge_sdk.client import GenerationResult as GenerationResult
    from edge_sdk.privacy.ledger import PrivacyLedger as PrivacyLedger
    from edge_sdk.policies import CoVeil as CoVeil
    from edge_sdk.policies import Policy as Policy
    from edge_sdk.policies import Undefended as Undefended
    from edge_sdk.policies import available_policies as available_policies
    from edge_sdk.policies import make_policy as make_policy
    from edge_sdk.protocol.status import CloudError as CloudError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'edge_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
