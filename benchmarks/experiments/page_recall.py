"""How much of dense attention each page score keeps: a CPU diagnostic on the embedded model.

    python benchmarks/experiments/page_recall.py --context 8000 --tasks niah_multikey,vt --samples 2

HF transformers runs the model (float32) with an attention function that records, at every decode
step of a greedy generation, each layer's query, the keys of the whole context and the dense
attention probabilities. For every sparse layer (1-29) and KV head, each page score below keeps
`--ratio` of the context (1 sink page and the last 2 pages forced, as the flows' defaults); two
figures, averaged over steps, layers and KV heads:
  mass: the share of the dense attention mass outside the forced pages that the kept pages hold
        (mean over the group's query heads);
  hit:  how often the token with the most of that mass is kept.
Scores: mean key (block top-k), Quest's bound, mean key + w |q| radius (the `sphere` flow, flows/sphere.py),
and two oracles (a page's best logit; its exact mass). BENCHMARKS.md "Page scores against dense
attention" has the figures and what the accuracy runs said of them.
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from sparsetune.evaluation.samples import prompt_ids
from sparsetune.evaluation.tasks import build_samples
from sparsetune.models.resolve import hf_dir, resolve_model

RECORD: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []


def recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    if query.shape[2] > 1:  # prefill: not recorded
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    else:
        p = ((query @ k.transpose(-1, -2)) * scaling).softmax(-1)
        out = p @ v
        RECORD.append((module.layer_idx, query[0, :, 0].clone(), key[0].clone(), p[0, :, 0].clone()))
    return out.transpose(1, 2).contiguous(), None


def page_scores(how: str, q: torch.Tensor, kp: torch.Tensor, valid: torch.Tensor, p: torch.Tensor, w: float):
    """[Hkv, pages] scores; q [Hkv, G, D], kp [Hkv, pages, P, D], valid [pages, P], p [Hkv, G, pages, P]."""
    n = valid.sum(-1).clamp(min=1).float()
    c = kp.sum(2) / n[None, :, None]
    if how == "mean":
        s = torch.einsum("hpd,hgd->hgp", c, q)
    elif how == "sphere":
        r = ((kp - c[:, :, None]).norm(dim=-1) * valid).amax(-1)
        s = torch.einsum("hpd,hgd->hgp", c, q) + w * q.norm(dim=-1)[:, :, None] * r[:, None]
    elif how == "quest":
        big = torch.finfo(kp.dtype).max
        hi = torch.where(valid[None, :, :, None], kp, -big).amax(2)
        lo = torch.where(valid[None, :, :, None], kp, big).amin(2)
        s = torch.maximum(q[:, :, None] * hi[:, None], q[:, :, None] * lo[:, None]).sum(-1)
    elif how == "oracle_logit":
        s = torch.einsum("hpkd,hgd->hgpk", kp, q).masked_fill(~valid, -1e30).amax(-1)
    else:  # oracle_mass
        return p.sum(-1).mean(1)
    return s.amax(1)


def pick_tokens(how: str, page: int, w: float, q, k, p, count: int, within=None) -> torch.Tensor:
    """[Hkv, n] the tokens of the `count` best pages of `page` tokens by score `how` (the first page
    and the last 2 forced, as the flows' sink and local defaults); `within`: [Hkv, n] tokens a page
    must lie in to be scored (a two-level flow's second level: its units inside the kept pages)."""
    hkv, n, d = k.shape
    group = q.shape[0] // hkv
    pages = math.ceil(n / page)
    pad = pages * page - n
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(hkv, pages, page, d)
    valid = torch.nn.functional.pad(torch.ones(n), (0, pad)).view(pages, page).bool()
    pg = torch.nn.functional.pad(p.view(hkv, group, n), (0, pad)).view(hkv, group, pages, page)
    s = page_scores(how, q.view(hkv, group, d), kp, valid, pg, w)
    if within is not None:
        s = s.masked_fill(~torch.nn.functional.pad(within, (0, pad)).view(hkv, pages, page)[:, :, 0], float("-inf"))
    forced = torch.zeros(pages, dtype=torch.bool)
    forced[:1] = True
    forced[max(0, pages - 2):] = True
    s[:, forced] = float("inf")
    pick = torch.zeros_like(s, dtype=torch.bool)
    pick.scatter_(1, s.topk(min(pages, count), dim=-1).indices, True)
    return pick[:, :, None].expand(hkv, pages, page).reshape(hkv, -1)[:, :n]


def kept(how: str, page: int, w: float, q, k, p, ratio: float, two_level: tuple[str, int, float] | None = None) -> tuple[float, float]:
    """(mass, hit) of one page score; `two_level` (the units' score, their size, coarse): pages keep
    coarse x the budget, then units inside them keep the budget (block_topk_2l's and quest_2l's rule)."""
    hkv, n, _ = k.shape
    group = q.shape[0] // hkv
    if two_level is None:
        tok = pick_tokens(how, page, w, q, k, p, math.ceil(ratio * n / page))
    else:
        unit_how, unit, coarse = two_level
        pages = pick_tokens(how, page, w, q, k, p, math.ceil(coarse * ratio * n / page))
        tok = pick_tokens(unit_how, unit, 0.0, q, k, p, math.ceil(ratio * n / unit), within=pages)
    last = page if two_level is None else two_level[1]  # the selection's own forced units: sink 1, local 2
    free = torch.zeros(n, dtype=torch.bool)
    free[:last] = True
    free[max(0, math.ceil(n / last) - 2) * last:] = True
    mass = p.view(hkv, group, n).masked_fill(free, 0.0)
    share = (mass * tok[:, None]).sum(-1) / mass.sum(-1).clamp(min=1e-12)
    hit = tok.gather(1, mass.argmax(-1)).float()
    return share.mean().item(), hit.mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.125)
    ap.add_argument("--tasks", default="niah_multikey,niah_multivalue,niah_multiquery,niah_single,vt,fwe,cwe")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=777)
    ap.add_argument("--steps", type=int, default=10, help="decode steps recorded a prompt")
    ap.add_argument("--only", default="", help="score names starting with these (comma-separated), e.g. mean2,2l_")
    args = ap.parse_args()
    AttentionInterface.register("recording", recording_attention)
    model = AutoModelForCausalLM.from_pretrained(hf_dir("smollm2-135m"), dtype=torch.float32,
                                                 attn_implementation="recording").eval()
    tok = resolve_model("smollm2-135m").load_tokenizer()
    scores = [(f"mean{pg}", pg, "mean", 0.0) for pg in (2, 4, 8, 16)] + [(f"quest{pg}", pg, "quest", 0.0) for pg in (4, 16)]
    scores += [(f"sphere{pg}_w{w}", pg, "sphere", w) for pg in (4, 8, 16) for w in (0.25, 0.5)]
    scores += [("oracle_logit4", 4, "oracle_logit", 0.0), ("oracle_mass4", 4, "oracle_mass", 0.0)]
    scores = [(name, page, how, w, None) for name, page, how, w in scores]
    # two levels: 16-token pages by the page score, then 2-token units by their mean key (coarse 2, 3)
    scores += [(f"2l_{how}16{'_w' + str(w) if w else ''}_c{c}", 16, how, w, ("mean", 2, c))
               for how, w in (("mean", 0.0), ("quest", 0.0), ("sphere", 0.25), ("sphere", 0.5), ("sphere", 1.0),
                              ("oracle_mass", 0.0)) for c in (2.0, 3.0)]
    if args.only:
        scores = [x for x in scores if any(x[0].startswith(o) for o in args.only.split(","))]
    total = {name: [] for name, *_ in scores}
    for task in args.tasks.split(","):
        for sample in build_samples(task, tok, args.context, args.samples, args.seed):
            RECORD.clear()
            with torch.no_grad():
                model.generate(torch.tensor([prompt_ids(tok, sample)]), max_new_tokens=args.steps, do_sample=False)
            for layer, q, k, p in RECORD:
                if layer > 0:  # layer 0 is dense in every flow's defaults
                    for name, page, how, w, two in scores:
                        total[name].append(kept(how, page, w, q, k, p, args.ratio, two))
            print(task, sample.index, "done", flush=True)
    print(f"{'score':<16} {'mass':>7} {'hit':>7}")
    for name, v in total.items():
        print(f"{name:<16} {sum(a for a, _ in v) / len(v):7.4f} {sum(b for _, b in v) / len(v):7.4f}")


if __name__ == "__main__":
    main()
