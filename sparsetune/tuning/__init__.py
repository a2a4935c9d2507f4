"""The search's parts (`sparsetune search`; run one with `sparsetune.search(...)`, `sparsetune.api.search`):
the space of a flow's params, studies and their storage, trials, the confirmed frontier and its report."""
