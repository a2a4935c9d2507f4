"""Diversity as Vortex measures it: Jaccard distances over cache definitions, ops and op call
patterns read from the syntax tree, averaged over pairs."""

from __future__ import annotations

import pytest

from helpers import candidate_flow
from sparsetune.agents.diversity import distance, diversity, features

CENTROID = candidate_flow()  # cache mean(k); index topk(max(gemm))
ENVELOPE = candidate_flow('return F.topk(F.max(F.sum(F.maximum(F.mul(q, fields["hi"]), F.mul(q, fields["lo"])), dim=2), dim=1))',
                          cache='return {"hi": F.max(k, dim=1), "lo": F.min(k, dim=1)}')


def test_features_of_a_program():
    assert features(CENTROID) == {"cache": {"mean(k)"}, "ops": {"mean", "gemm", "max", "topk"},
                                  "calls": {"topk<-max", "max<-gemm"}}
    assert features("def broken(:") == {"cache": set(), "ops": set(), "calls": set()}


def test_distance_is_the_mean_of_three_jaccard_distances():
    a, b = features(CENTROID), features(ENVELOPE)
    # by hand: cache {mean(k)} vs {max(k), min(k)}: 1; ops {mean, gemm, max, topk} vs {max, min, sum, maximum,
    # mul, topk}: 1 - 2/8; calls {topk<-max, max<-gemm} vs {topk<-max, max<-sum, sum<-maximum, maximum<-mul}: 1 - 1/5
    assert distance(a, b) == pytest.approx((1 + 6 / 8 + 4 / 5) / 3)
    assert distance(a, a) == 0.0
    d = diversity([CENTROID, ENVELOPE, CENTROID])
    assert d["pairs"] == 3 and d["min_distance"] == 0.0
    assert d["mean_distance"] == pytest.approx(round(2 * (1 + 6 / 8 + 4 / 5) / 9, 4))
    assert diversity([CENTROID])["mean_distance"] is None
