"""`sparsetune search`: multi-objective search over flows and their parameters (issue #14; the
search space and the frontier are built, the study loop is not yet)."""
