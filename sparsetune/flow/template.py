"""The starting file `sparsetune flows new NAME` writes: a short commented decode flow that checks."""

from __future__ import annotations

from pathlib import Path

from sparsetune.errors import SparsetuneError

TEMPLATE = '''"""{title}: one line on the rule this flow implements, and where it comes from.

Cache stage: what is kept per KV block. Indexer: how blocks are scored each decode step.
Check it with `sparsetune flows check {file}`; run it with `--flow {file}`.
"""

from sparsetune.flow import DecodeFlow, Param
from sparsetune.flow import ops as F


class {cls}(DecodeFlow):
    name = "{name}"
    source = "cite the paper or code"
    # Hyperparameters are typed, with defaults and search ranges. Inherited: block_size, budget,
    # budget_ratio, sink_blocks, local_blocks, dense_layers.
    temperature = Param(1.0, low=0.01, high=10.0, log=True, doc="softmax temperature over blocks")

    def cache(self, k, v):
        # k, v: one block of one KV head, [1, block_size, head_dim]. Each field: [1, r, c].
        return {{"centroid": F.mean(k, dim=1)}}

    def index(self, q, fields):
        # q: the KV head's query group, [1, group, head_dim]; fields: [S, r, c] over the S blocks.
        s = F.gemm(fields["centroid"], q)  # [S, 1, group]
        s = F.softmax(s, dim=0, scale=1.0 / self.temperature)  # over blocks
        return F.topk(F.max(s, dim=2))  # score [S, 1, 1]; the budget decides k
'''


def write_template(name: str, out: Path | None = None) -> Path:
    """Write the starting file of flow `name` to `out` (default ./NAME.py; never over a file)."""
    from sparsetune.records import new_file

    if not name.isidentifier():
        raise SparsetuneError(f"flow name {name!r} must be a Python identifier (letters, digits, _)")
    path = new_file(out or Path(f"{name}.py"))
    cls = "".join(p.capitalize() for p in name.split("_")) or "MyFlow"
    try:
        path.write_text(TEMPLATE.format(title=name.replace("_", " ").capitalize(), name=name, cls=cls, file=path))
    except OSError as e:
        raise SparsetuneError(f"cannot write {path}: {e.strerror}; pass --out in a writable folder") from None
    return path
