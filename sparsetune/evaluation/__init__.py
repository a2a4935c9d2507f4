"""Evaluation: offline tasks, scoring, accuracy / fidelity / speed runs and their run records."""
