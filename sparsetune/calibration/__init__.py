"""Offline profilers that run a whole engine over calibration text and write per-model files
(`sparsetune.models.artifacts` reads them): channel calibration (DoubleSparse) and head profiles (RedKnot)."""
