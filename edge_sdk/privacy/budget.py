"""When a step may send only what the cloud could produce alone: the exposure budget and the epsilon budget.

:class:`ExposureBudget` reads public numbers and counts the cloud can keep itself (:func:`is_steered`), and the
accountant's epsilon (:class:`~edge_sdk.privacy.accountant.PrivacyAccountant`), never the private context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge_sdk.protocol.signals import CloudUpload, SyncedToken

if TYPE_CHECKING:
    from edge_sdk.privacy.accountant import PrivacyAccountant
    from edge_sdk.protocol.wire import CloudDistribution


def is_steered(signal: CloudUpload | SyncedToken, dist: CloudDistribution) -> bool:
    """Whether the private context steered this step's signal, as the cloud itself can tell.

    Cloud-side: anything was uploaded.  Edge-side: the token is not the
    cloud's own top token.  The exposure budget counts only these steps, so
    when it switches depends on nothing the cloud has not already seen
    (counting private words instead made the switch an oracle: a cloud
    pushing a probe word learned whether it was one of them).
    """
    if isinstance(signal, CloudUpload):
        return len(signal) > 0
    return signal.token_id != dist.top_id()


class ExposureBudget:
    """When a step may send only a signal the cloud could produce alone.

    ``share`` (``DecodeSettings.exposure_budget``): at most
    ``floor(share * max_steps)`` steps may be steered by the private context;
    beside it the accountant's epsilon budget (``max_epsilon``).  Both read
    public numbers and counts the cloud can keep itself, never the private
    context.
    """

    def __init__(self, share: float | None, accountant: PrivacyAccountant) -> None:
        self.share = share
        self.accountant = accountant
        self.steered_steps = 0

    def withholds(self, step: int, max_steps: int) -> bool:
        # one more steered step must keep the share within the budget: at most floor(share * max_steps)
        over_share = self.share is not None and self.steered_steps + 1 > self.share * max_steps
        return self.accountant.withholds(step) or over_share  # public numbers and the release count only

    def record_release(self, step: int, signal: CloudUpload | SyncedToken, dist: CloudDistribution) -> None:
        """A signal decided from the private context: the accountant's event (recorded when decided, since a send
        that broke may still have reached the cloud)."""
        self.accountant.record(step, steered=is_steered(signal, dist))

    def count_steered(self, signal: CloudUpload | SyncedToken, dist: CloudDistribution) -> bool:
        """Count an acknowledged step if the cloud can tell the private context steered it; whether it did."""
        steered = is_steered(signal, dist)
        self.steered_steps += steered
        return steered
