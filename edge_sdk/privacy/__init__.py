"""What the cloud may learn from a generation, and what it cost: one module per question.

* :mod:`~edge_sdk.privacy.analysis`: the DP math, no state (calibrations, conversions, compositions; the
  baselines' epsilon units), as Opacus's ``accountants/analysis``;
* :mod:`~edge_sdk.privacy.accountant`: the epsilon account of one generation (:class:`ReleaseEvent` per
  releasing step, composed by :class:`PrivacyAccountant`), as Opacus's accountants;
* :mod:`~edge_sdk.privacy.budget`: when a step may send only what the cloud could produce alone (the exposure
  share and the epsilon budget);
* :mod:`~edge_sdk.privacy.ledger`: the per-generation record of what was sent (:class:`PrivacyLedger`);
* :mod:`~edge_sdk.privacy.meter`: DecodeLeak's content tokens and the exposure the cloud observed
  (:class:`LeakageMeter`, :class:`ExposureTrace`);
* :mod:`~edge_sdk.privacy.masking`: ``never_upload``, the ids the SLM says nothing about.

Nothing is imported here: each module loads only when used (dp-accounting only for a DP policy's account).
"""
