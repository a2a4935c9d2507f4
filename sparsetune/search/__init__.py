"""`sparsetune search`: multi-objective search over flows and their parameters (issue #14; the
search space is built, the study loop is not yet)."""
