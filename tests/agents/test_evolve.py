"""The evolve proposer: its grammar holds the built-in flows' programs (the generated files select
what quest, block_topk, h2o and the two-level quest_2l and block_topk_2l select), it is
reproducible from its seed, and most of what it proposes passes the harness."""

from __future__ import annotations

import pytest
import torch

from sparsetune.agents.evolve import BUILTIN_GENOMES, MUTATIONS, Evolve, Genome, genome_of, source
from sparsetune.agents.harness import Candidate, validate
from sparsetune.agents.proposer import Context
from sparsetune.loader import get_flow_class, load_file


def decode_outputs(cls: type, steps: int = 3, head_dim: int = 64, group: int = 3) -> list[torch.Tensor]:
    """Attention outputs of a flow at 40% of the context on random paged KV (float64), `steps`
    decode steps on the same cache (state flows carry theirs across)."""
    from sparsetune.engine.attention import AttentionMetadata
    from sparsetune.engine.kv_cache import KVCache
    from sparsetune.flow.attention import FlowAttention

    flow = cls.from_strings({"budget_ratio": "0.4", "select_layers": "", "sink_blocks": "0", "local_blocks": "1"})
    bs, hkv = flow.block_size, 2
    lens = [9 * bs + 3, 6 * bs, 12 * bs + 1]
    nblk = [-(-n // bs) for n in lens]
    g = torch.Generator().manual_seed(7)
    kv = KVCache(1, sum(nblk) + 2, hkv, bs, head_dim, torch.float64, "cpu")
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, dtype=torch.float64))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, dtype=torch.float64))
    tables, start = [], 0
    for n in nblk:
        tables.append(list(range(start, start + n)))
        start += n
    width = max(nblk)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    attn = FlowAttention(flow, head_dim**-0.5)
    for i, n in enumerate(lens):  # the cache stage (a two-level flow's both levels) over what a prefill wrote
        attn.rebuild_fields(0, kv, bt[i], n)
    meta = AttentionMetadata(False, torch.tensor([n - 1 for n in lens]), torch.zeros(len(lens), dtype=torch.long), bt,
                             torch.tensor(lens, dtype=torch.int32), lens, list(range(len(lens) + 1)), [0, 1, 2])
    outs = []
    for _ in range(steps):
        q = torch.randn(len(lens), hkv * group, head_dim, generator=g, dtype=torch.float64)
        outs.append(attn.decode(0, q, kv, meta))
    return outs


@pytest.mark.parametrize("name", sorted(BUILTIN_GENOMES))
def test_builtin_genomes_select_as_the_builtin_files(tmp_path, name):
    path = tmp_path / f"{name}_evolved.py"
    path.write_text(source(BUILTIN_GENOMES[name]))
    generated, builtin = load_file(path), get_flow_class(name)
    assert generated.param_specs()["dense_layers"].default == builtin.param_specs()["dense_layers"].default
    for a, b in zip(decode_outputs(generated), decode_outputs(builtin)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # and it is not vacuous: another program selects otherwise
    other = tmp_path / "other.py"
    other.write_text(source(Genome(("absbound",), view="qmean")))
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(decode_outputs(load_file(other)), decode_outputs(builtin)))


def test_genome_round_trips_through_the_file():
    g = Genome(("bound", "sub2"), view="qnorm", heads="lse", value=True, ema=True, dense_layers=(0, 1))
    assert genome_of(source(g)) == g
    two = Genome(("keys",), view="qmean", heads="lse", pages=("sub4",))
    assert genome_of(source(two)) == two
    assert genome_of("class X: pass") is None
    # a one-level genome's name is what it was before the grammar had two levels (resumed studies)
    assert Genome(("centroid",)).name() == "evo_" + __import__("hashlib").sha256(
        b'{"dense_layers": [0], "ema": false, "heads": "max", "terms": ["centroid"], "value": false, "view": "q"}'
    ).hexdigest()[:8]


def test_two_level_children_keep_a_block_local_unit_score():
    """`levels` makes a two-level child (one unit term a 2-token unit can hold, no mass, value or
    state), and back; `field` swaps either level's term; value, state and combine do not apply to
    a two-level program; every such child is a flow the two-level runtime accepts."""
    import random

    from sparsetune.agents.evolve import PAGE_TERMS, UNIT_TERMS, mutate

    rng = random.Random(0)
    parent = Genome(("sub4", "bound"), value=True, ema=True)
    two = mutate(rng, parent, None, "levels")
    assert two.pages[0] in PAGE_TERMS and two.terms == ("centroid",) and not (two.value or two.ema)
    assert mutate(rng, two, None, "levels") == Genome(("centroid",))
    assert not any(two.applies(h) for h in ("value", "state", "combine")) and all(parent.applies(h) for h in MUTATIONS)
    seen = set()
    for _ in range(30):
        child = mutate(rng, two, None, "field")
        assert child.pages is not None and child.terms[0] in UNIT_TERMS and child.pages[0] in PAGE_TERMS
        seen.add((child.terms, child.pages))
    assert len(seen) > 4


@pytest.mark.parametrize("genome", [Genome(("keys",), view="qnorm", pages=("sub2",)),
                                    Genome(("bound",), heads="lse", pages=("absbound",))])
def test_two_level_programs_run_in_two_levels(tmp_path, genome):
    """A two-level program's file passes the source check, is a TwoLevelFlow whose first level is
    its page stages (their own fields), and decodes (float64)."""
    from sparsetune.flow.shapes import field_dims
    from sparsetune.flow.source_check import file_problems

    path = tmp_path / "two.py"
    path.write_text(source(genome))
    assert file_problems(path) == []
    flow = load_file(path).from_strings({})
    assert flow.coarse == 2.0 and flow.unit == 2 and flow.page_flow().level == "_page"
    assert set(field_dims(flow.page_flow(), 64)).isdisjoint({"keys"}) and set(field_dims(flow, 64)) != set(
        field_dims(flow.page_flow(), 64))
    assert all(torch.isfinite(o).all() for o in decode_outputs(type(flow), steps=1))


FRONTIER = [{"flow": "quest"}, {"flow": "block_topk"}]


def rounds(seed: int, n: int) -> list[str]:
    evo, cands = Evolve(seed), []
    for r in range(n):
        p = evo.propose(Context(r, "", FRONTIER, list(cands)))
        cands.append(Candidate(f"{r:04d}", genome_of(p.source).name(), p.proposer, p.source, p.parents))
    return [c.source for c in cands]


def test_reproducible_from_its_seed():
    a, b, c = rounds(0, 20), rounds(0, 20), rounds(1, 20)
    assert a == b
    assert a != c
    assert len(set(a)) == 20  # never the same program twice
    used = {line.split("evolve: ")[1].split(" of ")[0] for s in a for line in s.splitlines() if "source = \"evolve" in line}
    assert used == set(MUTATIONS)  # twenty rounds use every mutation


@pytest.mark.slow
def test_twenty_rounds_mostly_pass_the_harness(tmp_path):
    evo, cands = Evolve(0), []
    for r in range(20):
        p = evo.propose(Context(r, "", FRONTIER, list(cands)))
        name = genome_of(p.source).name()
        cands.append(validate(Candidate(f"{r:04d}", name, p.proposer, p.source, p.parents, p.rationale), tmp_path))
    verdicts = [(c.name, c.verdict, c.reason) for c in cands]
    assert sum(c.verdict == "accepted" for c in cands) >= 10, verdicts
