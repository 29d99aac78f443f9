"""Which LoRA adapter each version is, and the samples generated with another one.

When a run publishes adapters alone (``model.lora.publish: adapter``), an engine that
failed to apply one would generate with the base model, or an older adapter, and tag the
tokens with the new version all the same: training on them looks like staleness, and is
wrong. So the learner announces each version's adapter digest before the version can be
fetched (``AdapterPublished``), every replica reports the digest of the adapter its
engine held for each version its samples' tokens carry (``Trajectories.adapter_digests``),
and a sample is accepted only when each of its versions' digests is the announced one.
Version 0 is the base model (``BASE_DIGEST``) in every run.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from asyncrl.core.messages import BASE_DIGEST
from asyncrl.core.trajectory import Sample, is_model_token

KEEP_VERSIONS = 64
"""Announced versions remembered: far more than any staleness bound lets a sample span."""


class AdapterLedger:
    """The digests the learner announced, by version (the newest ``KEEP_VERSIONS``)."""

    def __init__(self) -> None:
        self.published: dict[int, str] = {0: BASE_DIGEST}

    def announce(self, version: int, digest: str) -> None:
        """Record ``version``'s digest. A version announced again (a learner resumed from an
        earlier checkpoint retrains it) takes the new digest: the old one's samples go."""
        self.published[version] = digest
        while len(self.published) > KEEP_VERSIONS:
            del self.published[min(self.published)]

    def mismatch(self, sample: Sample, served: Mapping[int, str]) -> str | None:
        """Why ``sample`` was not generated with the announced adapters, None when it was:
        the first version of its model tokens whose reported digest is missing, unknown
        here, or another."""
        versions = sample.token_versions[is_model_token(sample.token_versions)]
        for version in np.unique(versions).tolist():
            expected = self.published.get(version)
            got = served.get(version)
            if expected is None:
                return f"v{version}: no adapter announced for it"
            if got != expected:
                return f"v{version}: served adapter {got or 'not reported'}, published {expected}"
        return None
