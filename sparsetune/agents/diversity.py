"""How different the accepted flows are, measured as Vortex measures its agents' flows (§14):
from each program's syntax tree, (1) its cache definitions, (2) the ops it uses and (3) its op
call patterns; the distance of two programs is the mean of the Jaccard distances of the three
sets, and a set of programs' diversity is the mean over its pairs.

- cache definitions: each field's expression in `cache`, as its op structure (`max(k)`: names of
  the ops and the stage's arguments, constants and field names dropped);
- ops: every `F.<op>` the class calls;
- call patterns: each (op, op of an argument) pair, e.g. `topk<-max`.
"""

from __future__ import annotations

import ast
from itertools import combinations
from typing import Any


def _op(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        return node.func.attr if node.func.value.id == "F" else None
    return None


def _shape(node: ast.AST) -> str:
    op = _op(node)
    if op is not None:
        return f"{op}({','.join(_shape(a) for a in node.args)})"
    if isinstance(node, ast.Name):
        return node.id
    return "_"


def features(source: str) -> dict[str, set[str]]:
    """The three sets of a flow file (empty ones for a file that does not parse)."""
    from sparsetune.flow.source_check import FlowSource

    out: dict[str, set[str]] = {"cache": set(), "ops": set(), "calls": set()}
    parsed = FlowSource.of_text(source)  # the one reader of flow files
    if parsed is None:
        return out
    for node in ast.walk(parsed.tree):
        op = _op(node)
        if op is not None:
            out["ops"].add(op)
            for arg in node.args:
                inner = _op(arg)
                if inner is not None:
                    out["calls"].add(f"{op}<-{inner}")
        if isinstance(node, ast.FunctionDef) and node.name == "cache":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                    out["cache"].update(_shape(v) for v in ret.value.values)
    return out


def _jaccard(a: set[str], b: set[str]) -> float:
    union = a | b
    return 0.0 if not union else 1 - len(a & b) / len(union)


def distance(a: dict[str, set[str]], b: dict[str, set[str]]) -> float:
    return sum(_jaccard(a[k], b[k]) for k in ("cache", "ops", "calls")) / 3


def diversity(sources: list[str]) -> dict[str, Any]:
    """Mean, min and max pairwise distance of the programs (None with fewer than two)."""
    feats = [features(s) for s in sources]
    d = [distance(a, b) for a, b in combinations(feats, 2)]
    if not d:
        return {"programs": len(sources), "pairs": 0, "mean_distance": None, "min_distance": None, "max_distance": None}
    return {"programs": len(sources), "pairs": len(d), "mean_distance": round(sum(d) / len(d), 4),
            "min_distance": round(min(d), 4), "max_distance": round(max(d), 4)}
