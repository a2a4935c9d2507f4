"""The `rag` workload: retrieved documents as reusable segments, then a question (issue #5).

Each sample is `RAG_DOCS` retrieved documents of filler prose; one of them hides the needle ("One
of the special magic numbers for {key} is: {value}.") at a random depth. The prompt is an
instruction, the documents (each a reusable segment in namespace `rag`, introduced by a plain
"Document i:" line) in a shuffled order, and the question for the key; the answer is its 7-digit
number. (With a needle in every document, the 135M default model mostly answers a distractor's
number even with full attention, which leaves nothing for a reuse flow to keep.)

Two-stage protocol (SparseX §5, appendix): the evaluation first stores every document on its own
(a cache-building request per document, computed at position 0), then measures the request, in
which the documents sit at other positions and reach the model through the segment cache.
"""

from __future__ import annotations

from sparsetune.evaluation.ruler import NEEDLE, Prose, fit, insert_at_depths, random_keys, random_numbers, sample_rng
from sparsetune.evaluation.samples import Sample, Turn
from sparsetune.models.tokenizer import Tokenizer

RAG_DOCS = 6
RAG_NAMESPACE = "rag"
RAG_INTRO = ("Answer the question using the documents below. A special magic number is hidden in one "
             "of them. Make sure to memorize it. I will quiz you about the number afterwards.\n\n")


def rag_sample(tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    rng = sample_rng(seed, "rag", index)
    key, value = random_keys(rng, 1)[0], random_numbers(rng, 1, 7)[0]
    depth = rng.randrange(0, 101)
    asked = rng.randrange(RAG_DOCS)
    order = list(range(RAG_DOCS))
    rng.shuffle(order)  # the measured request's order; each document was cached alone
    prose = [Prose(rng.getrandbits(64)) for _ in range(RAG_DOCS)]
    question = f"Question: What is the special magic number for {key} mentioned in the documents?"
    prefix = f"The special magic number for {key} mentioned in the documents is"

    def build(units: int) -> Sample:
        # `units` filler sentences in all, dealt round the documents (fine steps for the sizing search).
        counts = [units // RAG_DOCS + (j < units % RAG_DOCS) for j in range(RAG_DOCS)]
        docs = [" ".join(p.take(c)) for p, c in zip(prose, counts)]
        docs[asked] = " ".join(insert_at_depths(prose[asked].take(counts[asked]), [NEEDLE.format(key=key, value=value)], [depth]))
        parts: list[dict] = [{"text": RAG_INTRO}]
        for pos, j in enumerate(order):
            parts.append({"text": f"Document {pos + 1}:\n"})
            parts.append({"text": docs[j] + "\n\n", "reuse": True, "namespace": RAG_NAMESPACE})
        parts.append({"text": question})
        user = "".join(p["text"] for p in parts)
        meta = {"units": units, "asked": asked, "depth": depth, "position": order.index(asked), "docs": RAG_DOCS}
        return Sample("rag", index, (Turn(user, (value,), prefix),), segments=tuple(parts), meta=meta)

    return fit(tokenizer, context, "rag", build, minimum=RAG_DOCS)
