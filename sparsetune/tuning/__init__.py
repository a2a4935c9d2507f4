"""The search's parts (`sparsetune search`; run one with `sparsetune.search(...)`, `sparsetune.api.search`):
the space of a flow's params, studies and their storage, the workers sharing them, the allocation and
budget, a trial's cascade, confirmation of the frontier and its report; `run` wires them together."""
