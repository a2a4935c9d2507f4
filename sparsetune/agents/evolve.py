"""`evolve`: the LLM-free proposer. Program evolution over the op programs of decode flows.

A flow's program is described by a `Genome`, a few choices in a small grammar of the flow
language: which score terms it computes from which cache fields, the query view, how the query
heads of a KV group are reduced, whether the score is weighted by the block's value norm, and
whether it carries state across steps. `source` writes a genome as a flow file (a short
`DecodeFlow` of `F.*` ops, its genome on one comment line so it can be read back). The built-in
flows quest, block_topk and h2o are genomes of this grammar (`BUILTIN_GENOMES`; the tests check
that the generated programs select what the built-in files select).

Each round `Evolve.propose` picks parents (frontier flows first, by tournament, then any known
genome) and applies one mutation:

- `reduction`: swap how a KV group's query heads are reduced (max, mean, log-sum-exp);
- `view`: change the query view (every head, the group's mean query, L2-normalized heads);
- `field`: replace a score term by another that caches a different field: the mean key
  (centroid), the channel envelope (max and min keys, Quest's bound), the envelope of |k|,
  sub-block centroids (2 or 4 per block), the raw keys (exact, but every key's bytes are read);
- `value`: weight each block's estimated attention mass by the square root of its largest value
  norm (a block's contribution to the output, not only its attention), or stop doing so;
- `state`: add or remove an exponential moving average of the estimated mass across steps
  (H2O's accumulation, with the decay as a searched param);
- `combine`: recombine two parents: the sum of their terms' attention masses (a searched weight);
- `levels`: select in two levels (`TwoLevelFlow`: 16-token pages scored by a page term, the best
  `coarse` x budget kept, then 2-token units inside them by the unit term), or back to one. A
  two-level program's unit score is one term, block-local (no mass over blocks, no value weight,
  no state), as its second level scores a list of units; `field` then swaps either level's term.

Everything comes from `random.Random(seed, round)`: the same seed and the same feedback give
the same candidates.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from sparsetune.agents.proposer import Context, NoMoreProposals, Proposal

TERMS = ("centroid", "bound", "absbound", "sub2", "sub4", "keys")
VIEWS = ("q", "qmean", "qnorm")
HEADS = ("max", "mean", "lse")
MUTATIONS = ("reduction", "view", "field", "value", "state", "combine", "levels")
PAGE_TERMS = ("centroid", "bound", "absbound", "sub2", "sub4")  # a page's score (its keys would cost as much as dense)
UNIT_TERMS = ("centroid", "bound", "absbound", "keys")  # a 2-token unit's (sub-blocks of it would be empty)
GENOME_LINE = "# genome: "
MAX_TRIES = 64  # draws for a child unlike every genome seen


@dataclass(frozen=True)
class Genome:
    terms: tuple[str, ...] = ("centroid",)  # one or two score terms
    view: str = "q"
    heads: str = "max"
    value: bool = False  # weight the mass by sqrt(max value norm of the block)
    ema: bool = False  # accumulate the mass across steps
    dense_layers: tuple[int, ...] = (0,)
    pages: tuple[str, ...] | None = None  # two levels: the page term (None: one level)

    def key(self) -> str:
        d = asdict(self)
        if self.pages is None:  # one-level genomes keep the keys (and names) they had before two levels
            del d["pages"]
        return json.dumps(d, sort_keys=True)

    def name(self) -> str:
        return "evo_" + hashlib.sha256(self.key().encode()).hexdigest()[:8]

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.key())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Genome:
        pages = d.get("pages")
        return cls(terms=tuple(d["terms"]), view=d["view"], heads=d["heads"], value=bool(d["value"]),
                   ema=bool(d["ema"]), dense_layers=tuple(d["dense_layers"]), pages=None if pages is None else tuple(pages))

    def describe(self) -> str:
        view = {"q": "every query head", "qmean": "the group's mean query", "qnorm": "L2-normalized query heads"}[self.view]
        what = " + ".join(self.terms)
        extra = (", weighted by value norm" if self.value else "") + (", accumulated across steps (EMA)" if self.ema else "")
        level = "" if self.pages is None else f"two levels: pages by {' + '.join(self.pages)}, then 2-token units by "
        return f"{level}{what} on {view}, heads reduced by {self.heads}{extra}"

    def applies(self, how: str) -> bool:
        """Whether mutation `how` can make a valid child of this genome (a two-level program's unit
        score stays one block-local term)."""
        return self.pages is None or how not in ("value", "state", "combine")


# The built-in flows' programs in this grammar (tests: the generated file selects as the built-in does).
BUILTIN_GENOMES = {
    "block_topk": Genome(("centroid",)),
    "quest": Genome(("bound",), dense_layers=(0, 1)),
    "h2o": Genome(("centroid",), ema=True),
    "block_topk_2l": Genome(("centroid",), pages=("centroid",)),
    "quest_2l": Genome(("centroid",), dense_layers=(0, 1), pages=("bound",)),
}


def genome_of(source: str) -> Genome | None:
    """The genome a generated flow file records (None: not written by `source`)."""
    for line in source.splitlines():
        if line.startswith(GENOME_LINE):
            try:
                return Genome.from_dict(json.loads(line[len(GENOME_LINE):]))
            except (ValueError, KeyError, TypeError):
                return None
    return None


# ---- writing a genome as a flow file ------------------------------------------------------------------

_FIELDS = {  # term -> the cache stage's fields: name -> expression over k ([1, block, D]) and n (tokens)
    "centroid": {"centroid": "F.mean(k, dim=1)"},
    "bound": {"kmax": "F.max(k, dim=1)", "kmin": "F.min(k, dim=1)"},
    "absbound": {"kabs": "F.max(F.abs(k), dim=1)"},
    "sub2": {f"sub2_{i}": f"F.mean(F.mul(k, F.mask_slice(k, {i} * n // 2, {i + 1} * n // 2, dim=1)), dim=1)" for i in range(2)},
    "sub4": {f"sub4_{i}": f"F.mean(F.mul(k, F.mask_slice(k, {i} * n // 4, {i + 1} * n // 4, dim=1)), dim=1)" for i in range(4)},
    "keys": {"keys": "F.scale(k)"},
}


def _term(term: str) -> tuple[str, int]:
    """A term's per-head score over the query view `qv`, and the axis its heads lie on."""
    if term == "centroid":
        return 'F.gemm(fields["centroid"], qv)', 2  # [S, 1, G]
    if term == "bound":
        return 'F.sum(F.maximum(F.mul(qv, fields["kmax"]), F.mul(qv, fields["kmin"])), dim=2)', 1  # [S, G, 1]
    if term == "absbound":
        return 'F.sum(F.mul(F.abs(qv), fields["kabs"]), dim=2)', 1  # [S, G, 1]
    if term in ("sub2", "sub4"):
        parts = [f'F.gemm(fields["{name}"], qv)' for name in _FIELDS[term]]
        expr = parts[0]
        for p in parts[1:]:
            expr = f"F.maximum({expr}, {p})"
        return expr, 2  # [S, 1, G]: the best sub-block
    if term == "keys":
        return 'F.max(F.gemm(fields["keys"], qv), dim=1)', 2  # [S, 1, G]: the exact best key
    raise ValueError(term)


def _heads(expr: str, axis: int, how: str) -> str:
    if how == "lse":
        return f"F.log(F.sum(F.exp(F.scale({expr}, alpha=scale)), dim={axis}))"
    return f"F.{how}({expr}, dim={axis})"


def source(genome: Genome, *, parents: tuple[str, ...] = (), mutation: str = "") -> str:
    """The flow file of a genome."""
    name = genome.name()
    doc = [f'"""{name}: written by the evolve proposer ({mutation or "seed"}'
           + (f" of {', '.join(parents)}" if parents else "") + ").", "",
           f"Score: {genome.describe()}.", '"""', ""]
    fields = {f: e for t in genome.terms for f, e in _FIELDS[t].items()}
    if genome.value:
        fields["vnorm"] = "F.max(F.sum(F.mul(v, v), dim=2), dim=1)"  # [1, 1, 1]
    if genome.ema:
        fields["acc"] = "F.fill(F.max(F.max(k, dim=1), dim=2), 0.0)"  # [1, 1, 1], zero at first
    params = []
    if len(genome.terms) > 1:
        params.append('    mix = Param(1.0, low=0.1, high=10.0, log=True, doc="weight of the second term\'s mass")')
    if genome.ema:
        params.append('    decay = Param(1.0, low=0.5, high=1.0, doc="multiplier of the running mass each step (1: plain sum)")')
    if genome.dense_layers != (0,):
        params.append(f'    dense_layers = Param({genome.dense_layers!r}, kind=tuple, doc="layers that keep full attention")')
    cache, index = _stages(genome, genome.terms, fields, "")
    if genome.pages is not None:  # the first level: the page term over whole pages, the same query view and heads
        page_cache, page_index = _stages(genome, genome.pages, {f: e for t in genome.pages for f, e in _FIELDS[t].items()},
                                         "_page")
        cache, index = page_cache + [""] + page_index + [""] + cache, index
    else:
        mass = len(genome.terms) > 1 or genome.value or genome.ema  # an attention-mass estimate over blocks
        sm = "" if genome.heads == "lse" else ", scale=scale"  # log-sum-exp scores are scaled logits already
        if len(genome.terms) > 1:
            index.append(f"        score = F.add(F.softmax(s0, dim=0{sm}), F.scale(F.softmax(s1, dim=0{sm}), alpha=self.mix))")
        elif mass:
            index.append(f"        score = F.softmax(s0, dim=0{sm})")
        else:
            index.append("        score = s0")
        if genome.value:
            index.append('        score = F.mul(score, F.exp(F.scale(F.log(F.scale(fields["vnorm"], beta=1e-6)), alpha=0.5)))')
        if genome.ema:
            index += ['        score = F.add(F.scale(fields["acc"], alpha=self.decay), score)', '        F.save(fields, "acc", score)']
        index.append("        return F.topk(score)")
    cls = "Evo" + name[4:].upper()
    base = "DecodeFlow" if genome.pages is None else "TwoLevelFlow"
    head = [f"from sparsetune.flow import {base}" + (", Param" if params else ""), "from sparsetune.flow import ops as F", "",
            GENOME_LINE + genome.key(), "", "", f"class {cls}({base}):", f'    name = "{name}"',
            f'    source = "evolve: {mutation or "seed"}' + (f" of {', '.join(parents)}" if parents else "") + '"']
    return "\n".join(doc + head + params + [""] + cache + [""] + index) + "\n"


def _stages(genome: Genome, terms: tuple[str, ...], fields: dict[str, str], level: str) -> tuple[list[str], list[str]]:
    """The cache stage and the indexer's lines up to its per-term scores `s0`, `s1` of one level
    (`level`: "" or "_page"); a two-level program's indexers end here in `return F.topk(s0)`."""
    uses_k = any(re.search(r"\bn\b", e) for e in fields.values())  # sub-block bounds need the block's length
    cache = [f"    def cache{level}(self, k, v):"] + (["        n = k.shape[1]"] if uses_k else [])
    cache += ["        return {"] + [f'            "{f}": {e},' for f, e in fields.items()] + ["        }"]
    views = {"q": "q", "qmean": "F.mean(q, dim=1)", "qnorm": "F.div(q, F.l2norm(q, dim=2))"}
    index = [f"    def index{level}(self, q, fields):", "        scale = q.shape[2] ** -0.5", f"        qv = {views[genome.view]}"]
    for i, t in enumerate(terms):
        expr, axis = _term(t)
        index.append(f"        s{i} = {_heads(expr, axis, genome.heads)}  # [S, 1, 1]")
    if genome.pages is not None:
        index.append("        return F.topk(s0)")
    return cache, index


# ---- mutation -------------------------------------------------------------------------------------------

def mutate(rng: random.Random, parent: Genome, other: Genome | None, how: str) -> Genome:
    """One mutation of `parent` (`other`: the second parent of `combine`)."""
    if how == "reduction":
        return replace(parent, heads=rng.choice([h for h in HEADS if h != parent.heads]))
    if how == "view":
        return replace(parent, view=rng.choice([v for v in VIEWS if v != parent.view]))
    if how == "field" and parent.pages is not None:  # either level's term
        if rng.random() < 0.5:
            return replace(parent, pages=(rng.choice([t for t in PAGE_TERMS if t not in parent.pages]),))
        return replace(parent, terms=(rng.choice([t for t in UNIT_TERMS if t not in parent.terms]),))
    if how == "field":
        i = rng.randrange(len(parent.terms))
        new = rng.choice([t for t in TERMS if t not in parent.terms])
        return replace(parent, terms=parent.terms[:i] + (new,) + parent.terms[i + 1:])
    if how == "levels" and parent.pages is not None:
        return replace(parent, pages=None)
    if how == "levels":  # its first term at the units (one a unit can hold), a page term drawn
        unit = parent.terms[0] if parent.terms[0] in UNIT_TERMS else "centroid"
        return replace(parent, terms=(unit,), value=False, ema=False, pages=(rng.choice(PAGE_TERMS),))
    if how == "value":
        return replace(parent, value=not parent.value)
    if how == "state":
        return replace(parent, ema=not parent.ema)
    if how == "combine":
        theirs = [t for t in (other.terms if other else TERMS) if t != parent.terms[0]] or [t for t in TERMS if t != parent.terms[0]]
        return replace(parent, terms=(parent.terms[0], rng.choice(theirs)))
    raise ValueError(how)


class Evolve:
    """The LLM-free proposer (module docstring). `population`: flow name -> genome (built-ins and
    candidates so far); `frontier`: the flow names on the search's frontier, best first."""

    name = "evolve"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.population: dict[str, Genome] = dict(BUILTIN_GENOMES)
        self.seen: set[str] = {g.key() for g in self.population.values()}

    def learn(self, name: str, source_text: str) -> None:
        """Add a proposed flow (accepted or not: it is not proposed again) to what the proposer knows."""
        g = genome_of(source_text)
        if g is not None:
            self.seen.add(g.key())
            self.population.setdefault(name, g)

    def _parent(self, rng: random.Random, frontier: list[str]) -> str:
        known = [f for f in frontier if f in self.population]
        if known and rng.random() < 0.7:  # tournament of two among the frontier's flows: the better wins
            a, b = rng.choice(known), rng.choice(known)
            return a if known.index(a) <= known.index(b) else b
        return rng.choice(sorted(self.population))

    def propose(self, ctx: Context) -> Proposal:
        """The candidate of round `ctx.round` (deterministic in the seed, the round and the context):
        parents from the frontier's flows (best first) and the flows that passed the harness."""
        for c in ctx.candidates:
            self.learn(c.name, c.source)
        rng = random.Random(f"{self.seed}:{ctx.round}")
        accepted = ctx.accepted
        usable = {n for n in self.population if n in BUILTIN_GENOMES or n in accepted}
        frontier = list(dict.fromkeys(r["flow"] for r in ctx.frontier))
        for _ in range(MAX_TRIES):
            how = rng.choice(MUTATIONS)
            p1 = self._parent(rng, [f for f in frontier if f in usable])
            if p1 not in usable:
                p1 = rng.choice(sorted(usable))
            if not self.population[p1].applies(how):
                continue
            p2 = rng.choice(sorted(usable - {p1})) if how == "combine" and len(usable) > 1 else None
            child = mutate(rng, self.population[p1], self.population.get(p2) if p2 else None, how)
            if child.key() in self.seen:
                continue
            parents = [p for p in (p1, p2) if p]
            self.learn(child.name(), source(child, parents=tuple(parents), mutation=how))
            return Proposal(source(child, parents=tuple(parents), mutation=how), self.name, parents,
                            rationale=f"{how} of {' and '.join(parents)}: {child.describe()}")
        raise NoMoreProposals("evolve: every mutation of the population has been proposed")
