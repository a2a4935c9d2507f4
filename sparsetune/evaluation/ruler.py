"""RULER-style synthetic tasks: haystacks, sizing a sample to a token budget, and the generators.

The designs follow NVIDIA/RULER (scripts/data/synthetic: niah, variable tracking, common and
frequent words extraction), rewritten to run offline with no downloads:

- RULER's Paul Graham essay haystack is replaced by seeded filler prose from a small grammar over
  the word lists in `sparsetune/data/words.txt` (`Prose`); its "noise" haystack is kept verbatim.
- Every sample is drawn from its own RNG, seeded by (seed, task, index), so sample i is the same
  whatever the number of samples, and is sized on its own: `fit` finds the amount of filler whose
  whole prompt (chat template and answer prefix included, `final_prompt_tokens`) fills the context.
  RULER sizes input + generated tokens to the context; here the prompt alone fills it, so that a
  run at `--context N` measures attention over N prompt tokens.
- RULER's answer prefixes lose their leading (and trailing) space: in a chat template the prefix
  starts the assistant's message, where a leading space is not what the model would write.
- Needles and chain lines go at depths drawn from RULER's 40 evenly spaced points in 0-100% for
  every haystack (RULER draws uniform line indexes for the noise haystack), so `meta` depths are
  comparable across tasks.
"""

from __future__ import annotations

import math
import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Callable

from sparsetune.errors import SparsetuneError
from sparsetune.evaluation.samples import Sample, Turn, final_prompt_tokens
from sparsetune.models.tokenizer import Tokenizer

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = tuple(round(100 * k / 39) for k in range(40))  # RULER: np.linspace(0, 100, 40), rounded
NEEDLE = "One of the special magic numbers for {key} is: {value}."

# ---------------------------------------------------------------------------------------------
# Words and filler prose


@dataclass(frozen=True)
class Words:
    nouns: tuple[str, ...]
    adjectives: tuple[str, ...]
    verbs: tuple[str, ...]  # base forms
    adverbs: tuple[str, ...]
    prepositions: tuple[str, ...]

    @property
    def vocabulary(self) -> tuple[str, ...]:
        """Nouns, adjectives and verbs, sorted: the cwe vocabulary (RULER: wonderwords' three lists)."""
        return tuple(sorted(self.nouns + self.adjectives + self.verbs))


@lru_cache(maxsize=1)
def words() -> Words:
    """The shipped word lists (`data/words.txt`: `[section]` lines, then whitespace-separated words)."""
    text = (resources.files("sparsetune") / "data" / "words.txt").read_text(encoding="utf-8")
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is not None:
            current.extend(line.split())
    return Words(*(tuple(sections[name]) for name in ("nouns", "adjectives", "verbs", "adverbs", "prepositions")))


def third_person(verb: str) -> str:
    """'carry' -> 'carries', 'wash' -> 'washes', 'hold' -> 'holds' (the list has only regular verbs)."""
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in ("a", "e", "i", "o", "u"):
        return verb[:-1] + "ies"
    return verb + "s"


# Slots: {n} noun, {a} adjective, {v} verb (third person), {b} verb (base form), {d} adverb,
# {D} capitalized adverb, {p} preposition. "a" becomes "an" before a vowel afterwards.
SENTENCES = (
    "The {a} {n} {v} the {n} {p} the {n}.",
    "A {n} {p} the {n} {v} a {a} {n}.",
    "The {n} is {a}, and the {n} is {a}.",
    "{D}, the {n} {v} a {n}.",
    "There is a {a} {n} {p} the {n}.",
    "If the {n} is {a}, the {n} {v} the {n} {d}.",
    "Nobody {v} the {n} before the {a} {n} {v} it.",
    "The {n} and the {n} {b} the {a} {n} together.",
    "Every {n} {p} the {a} {n} {v} a {n} {d}.",
    "Later, the {a} {n} {v} the {n} and the {n}.",
    "It is said that the {n} {v} every {a} {n}.",
    "People {b} the {n} when the {n} is {a}.",
    "The {n} {p} the {n} looks {a} today.",
    "Sometimes a {n} {v} a {a} {n}, but the {n} {v} it {d}.",
)
_SLOT = re.compile(r"\{([navbdDp])\}")
_ARTICLE = re.compile(r"\b([Aa]) (?=[aeiou])")


class Prose:
    """An endless, seeded stream of grammatical filler sentences (RULER's essay haystack, offline).

    `take(n)` returns the first n sentences, so asking for more filler only appends: the sizing
    search compares prompts that differ only in how much filler they carry.
    """

    def __init__(self, seed: int) -> None:
        rng, w = random.Random(seed), words()
        self._rng = rng
        self._sentences: list[str] = []
        self._pick: dict[str, Callable[[], str]] = {
            "n": lambda: rng.choice(w.nouns),
            "a": lambda: rng.choice(w.adjectives),
            "v": lambda: third_person(rng.choice(w.verbs)),
            "b": lambda: rng.choice(w.verbs),
            "d": lambda: rng.choice(w.adverbs),
            "D": lambda: rng.choice(w.adverbs).capitalize(),
            "p": lambda: rng.choice(w.prepositions),
        }

    def take(self, n: int) -> list[str]:
        while len(self._sentences) < n:
            self._sentences.append(self._sentence())
        return self._sentences[:n]

    def _sentence(self) -> str:
        sentence = _SLOT.sub(lambda m: self._pick[m.group(1)](), self._rng.choice(SENTENCES))
        return _ARTICLE.sub(lambda m: m.group(1) + "n ", sentence)


# ---------------------------------------------------------------------------------------------
# Random parts shared by the generators


def sample_rng(seed: int, task: str, index: int) -> random.Random:
    """One RNG per sample: sample i depends only on (seed, task, i), not on how many are drawn."""
    return random.Random(f"{seed}:{task}:{index}")


def random_keys(rng: random.Random, n: int) -> list[str]:
    """n distinct adjective-noun keys (RULER's needle keys). No list word occurs inside another,
    so no key is a substring of another key."""
    w, keys = words(), []
    while len(keys) < n:
        key = f"{rng.choice(w.adjectives)}-{rng.choice(w.nouns)}"
        if key not in keys:
            keys.append(key)
    return keys


def random_numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    """n distinct numbers of exactly `digits` digits, as strings."""
    out: list[str] = []
    while len(out) < n:
        value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if value not in out:
            out.append(value)
    return out


def random_depths(rng: random.Random, n: int) -> list[int]:
    """n distinct depths (percent) from RULER's 40-point grid, ascending."""
    return sorted(rng.sample(DEPTHS, n))


def insert_at_depths(units: list[str], items: list[str], depths: list[int]) -> list[str]:
    """`items` placed between the haystack units at the given depths (ascending), in order."""
    out = list(units)
    positions = [len(units) * d // 100 for d in depths]
    for pos, item in reversed(list(zip(positions, items))):  # from the back: earlier positions stay valid
        out.insert(pos, item)
    return out


# ---------------------------------------------------------------------------------------------
# Sizing

_CLOSE = 0.01  # stop once the prompt is within 1% under the context


def too_small(task: str, context: int, need: int) -> SparsetuneError:
    """`need`: this sample's prompt with the least filler (others may differ by a few tokens)."""
    return SparsetuneError(f"--context {context} is too small for {task}: it needs at least {need} tokens; "
                           f"raise --context")


def fit(
    tokenizer: Tokenizer,
    context: int,
    task: str,
    build: Callable[[int], Sample],
    minimum: int = 1,
    maximum: int | None = None,
) -> Sample:
    """The sample `build(units)` with (nearly) the most filler units whose final prompt fits `context`.

    RULER binary-searches the haystack size; tokenizing is the cost, so this search interpolates
    instead: tokens grow about linearly in units, so one probe gives the rate and one or two
    interpolation steps land within 1% below the context (bisection takes over if it stalls).
    `build` must be a pure function of `units`. A context that cannot hold `minimum` units is a
    user error naming the context the task needs.
    """

    def size(units: int) -> tuple[Sample, int]:
        sample = build(units)
        return sample, final_prompt_tokens(tokenizer, sample)

    best, t_lo = size(minimum)
    if t_lo > context:
        raise too_small(task, context, t_lo)
    base = t_lo
    lo, hi, t_hi = minimum, None, 0
    width = 0
    for _ in range(64):
        if context - t_lo <= context * _CLOSE or (hi is not None and hi - lo <= 1):
            return best
        if maximum is not None and lo >= maximum:
            return best
        if hi is None:  # no upper bracket yet: extrapolate from the average rate so far
            rate = (t_lo - base) / (lo - minimum) if lo > minimum else 0.0
            step = (context - t_lo) / rate if rate > 0 else max(16, lo - minimum)
            n = lo + max(1, int(step))
            if maximum is not None:
                n = min(n, maximum)
        else:
            stalled = width > 0 and hi - lo > width // 2
            width = hi - lo
            if stalled:
                n = (lo + hi) // 2
            else:
                n = lo + round((context - t_lo) * (hi - lo) / max(1, t_hi - t_lo))
            n = min(max(n, lo + 1), hi - 1)
        sample, t = size(n)
        if t <= context:
            best, lo, t_lo = sample, n, t
        else:
            hi, t_hi = n, t
    raise RuntimeError(f"sizing {task} to {context} tokens did not converge")


# ---------------------------------------------------------------------------------------------
# NIAH


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # "noise" (RULER's repeated sentences) or "prose" (filler prose for RULER's essays)
    keys: int
    values: int  # values per key
    queries: int  # keys asked for


NIAH: dict[str, NiahConfig] = {
    "niah_single": NiahConfig("noise", 1, 1, 1),
    "niah_multikey": NiahConfig("prose", 4, 1, 1),
    "niah_multivalue": NiahConfig("prose", 1, 4, 1),
    "niah_multiquery": NiahConfig("prose", 4, 1, 4),
}


def niah_prompt(query: str, text: str, plural: bool) -> tuple[str, str]:
    """RULER's niah template and answer prefix, singular when one value is asked for (as RULER rewrites it)."""
    if plural:
        intro = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the numbers afterwards."
        )
        question = f"What are all the special magic numbers for {query} mentioned in the provided text?"
        prefix = f"The special magic numbers for {query} mentioned in the provided text are"
    else:
        intro = (
            "A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards."
        )
        question = f"What is the special magic number for {query} mentioned in the provided text?"
        prefix = f"The special magic number for {query} mentioned in the provided text is"
    return f"{intro}\n{text}\n{question}", prefix


def join_keys(keys: list[str]) -> str:
    """'a', 'a and b', 'a, b, and c' (RULER's query list)."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def niah_sample(task: str, tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    """Needle in a haystack, after RULER's niah.py (`NIAH` holds each variant's shape).

    niah_single is RULER's niah_single_1 (noise haystack, one needle). niah_multikey,
    niah_multivalue and niah_multiquery are RULER's essay variants (multikey_1, multivalue,
    multiquery) on filler prose instead of Paul Graham essays. Needles ("One of the special magic
    numbers for {key} is: {value}.", keys adjective-noun, values 7-digit) go between haystack
    lines or sentences at distinct depths of the 40-point grid, in shuffled order. The answers are
    the values of the queried keys, which appear verbatim in the prompt.
    """
    cfg = NIAH[task]
    rng = sample_rng(seed, task, index)
    keys = random_keys(rng, cfg.keys)
    values = random_numbers(rng, cfg.keys * cfg.values, 7)
    by_key = {k: values[j * cfg.values : (j + 1) * cfg.values] for j, k in enumerate(keys)}
    needles = [(k, v) for k in keys for v in by_key[k]]
    rng.shuffle(needles)
    depths = random_depths(rng, len(needles))
    queried = rng.sample(keys, cfg.queries)
    answers = tuple(v for k in queried for v in by_key[k])
    prose = Prose(rng.getrandbits(64)) if cfg.haystack == "prose" else None
    sentences = [NEEDLE.format(key=k, value=v) for k, v in needles]
    meta_needles = [{"key": k, "value": v, "depth": d} for (k, v), d in zip(needles, depths)]

    def build(units: int) -> Sample:
        if prose is None:
            text = "\n".join(insert_at_depths([NOISE] * units, sentences, depths))
        else:
            text = " ".join(insert_at_depths(prose.take(units), sentences, depths))
        user, prefix = niah_prompt(join_keys(queried), text, plural=len(answers) > 1)
        meta = {"haystack": cfg.haystack, "units": units, "needles": meta_needles, "query": queried}
        if len(needles) == 1:
            meta["depth"] = depths[0]
        return Sample(task, index, (Turn(user, answers, prefix),), meta=meta)

    return fit(tokenizer, context, task, build)


# ---------------------------------------------------------------------------------------------
# Variable tracking

VT_HOPS = 4


def vt_prompt(text: str, value: str, names: int) -> tuple[str, str]:
    """RULER's variable-tracking template and answer prefix."""
    user = (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        f"{text}\nQuestion: Find all variables that are assigned the value {value} in the text above."
    )
    prefix = (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{names} variables are assigned the value {value}, they are:"
    )
    return user, prefix


def random_chain(rng: random.Random, hops: int, name_length: int, value: str) -> tuple[list[str], list[str]]:
    """Variable names and the chain's lines: 'VAR A = 12345', 'VAR B = VAR A', ..."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, lines


def vt_example_units(context: int) -> int:
    """Noise lines of the in-context example: RULER makes it ~500 tokens (16 lines); smaller for short contexts."""
    return min(16, max(2, context // 512))


def vt_sample(tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    """Variable tracking, after RULER's variable_tracking.py (one chain of 4 hops, noise haystack).

    The chain 'VAR ABCDE = 12345', 'VAR FGHIJ = VAR ABCDE', ... (5-letter names, 5-digit value)
    goes into the noise haystack in order, at depths of the 40-point grid (RULER: uniform random
    lines). One solved example comes first, with 3-letter names and its own value, as RULER's; its
    haystack has `vt_example_units` lines (RULER sizes it to 500 tokens, which would crowd out the
    task at 1K contexts). The answers are the 5 variable names.
    """
    task = "vt"
    rng = sample_rng(seed, task, index)
    value, example_value = random_numbers(rng, 2, 5)
    names, lines = random_chain(rng, VT_HOPS, 5, value)
    depths = random_depths(rng, len(lines))
    example_names, example_lines = random_chain(rng, VT_HOPS, 3, example_value)
    example_depths = random_depths(rng, len(example_lines))
    example_text = "\n".join(insert_at_depths([NOISE] * vt_example_units(context), example_lines, example_depths))
    example_user, example_prefix = vt_prompt(example_text, example_value, len(example_names))
    example = f"{example_user} {example_prefix} {' '.join(example_names)}\n"

    def build(units: int) -> Sample:
        text = "\n".join(insert_at_depths([NOISE] * units, lines, depths))
        user, prefix = vt_prompt(text, value, len(names))
        meta = {"haystack": "noise", "units": units, "depths": depths, "value": value}
        return Sample(task, index, (Turn(example + user, tuple(names), prefix),), meta=meta)

    return fit(tokenizer, context, task, build)


# ---------------------------------------------------------------------------------------------
# Common words extraction

CWE_COMMON = 10
CWE_LONG = 4096  # RULER's switch between the short-context and long-context repeats


@dataclass(frozen=True)
class CweShape:
    common: int  # repeats of each common word
    uncommon: int  # repeats of each other word
    example_words: int
    example_common: int
    example_uncommon: int


CWE_SHORT = CweShape(6, 1, 20, 3, 1)
CWE_LONG_SHAPE = CweShape(30, 3, 40, 10, 3)


def cwe_shapes(context: int) -> tuple[CweShape, ...]:
    """RULER's repeats: below 4K, 6/1 with a 20-word 3/1 example; from 4K on, 30/3 with a 40-word 10/3 one.

    From 4K on the short shape is the fallback for tokenizers too verbose for the long one's
    fixed part (300 common-word entries and the example): the byte tokenizer of speed-only runs.
    """
    return (CWE_SHORT,) if context < CWE_LONG else (CWE_LONG_SHAPE, CWE_SHORT)


def cwe_prompt(listing: str) -> tuple[str, str]:
    """RULER's common-words template and answer prefix."""
    user = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        f"Memorize the ones that appear most often.\n{listing}\n"
        f"Question: What are the {CWE_COMMON} most common words in the above list?"
    )
    return user, f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"


def numbered(items: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


def cwe_listing(distinct: list[str], common: int, uncommon: int, seed: int) -> str:
    """The numbered list: the first CWE_COMMON words `common` times each, the rest `uncommon` times, shuffled."""
    items = distinct[:CWE_COMMON] * common + distinct[CWE_COMMON:] * uncommon
    random.Random(seed).shuffle(items)
    return numbered(items)


def cwe_pool(kind: str, seed: int, context: int, shape: CweShape) -> list[str]:
    """A per-sample word order: the shipped vocabulary ("words") or adjective-noun pairs ("pairs").

    RULER switches to a larger English word list when its lists run short; the pairs play that
    part. Each distinct word takes `uncommon` entries of at least 3 tokens, so a context holds at
    most context / (3 * uncommon) of them: that many pairs are drawn.
    """
    rng = random.Random(seed)
    if kind == "words":
        vocabulary = words().vocabulary
        return rng.sample(vocabulary, len(vocabulary))
    w = words()
    need = shape.example_words + CWE_COMMON + context // (3 * shape.uncommon)
    picks = rng.sample(range(len(w.adjectives) * len(w.nouns)), min(need, len(w.adjectives) * len(w.nouns)))
    return [f"{w.adjectives[p // len(w.nouns)]}-{w.nouns[p % len(w.nouns)]}" for p in picks]


def cwe_sample(tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    """Common words extraction, after RULER's common_words_extraction.py.

    A numbered list in which 10 common words each appear 30 times and every other word 3 times
    (6 and 1 below 4K contexts, `cwe_shapes`), after one solved example (40 words at 10/3; 20 at
    3/1 below 4K). Words come from the shipped nouns, adjectives and verbs (RULER: wonderwords'
    lists); when the context needs more distinct words than those, all words are adjective-noun
    pairs (`cwe_pool`). The example's words and the task's are disjoint (RULER draws them
    independently). The answers are the 10 common words.
    """
    rng = sample_rng(seed, "cwe", index)
    seeds = (rng.getrandbits(64), rng.getrandbits(64), rng.getrandbits(64))
    *preferred, last = cwe_shapes(context)
    for shape in preferred:
        try:
            return cwe_fit(tokenizer, context, index, shape, seeds)
        except SparsetuneError:
            pass  # too small for this shape's fixed part: try the next one
    return cwe_fit(tokenizer, context, index, last, seeds)


def cwe_fit(
    tokenizer: Tokenizer, context: int, index: int, shape: CweShape, seeds: tuple[int, int, int]
) -> Sample:
    """The cwe sample of one shape, sized; from the vocabulary, else (if it runs out) from pairs."""
    pool_seed, example_seed, list_seed = seeds

    def attempt(kind: str) -> tuple[Sample, bool]:
        """The sized sample drawing words from `kind`, and whether that vocabulary was long enough."""
        pool = cwe_pool(kind, pool_seed, context, shape)
        example_words, task_words = pool[: shape.example_words], pool[shape.example_words :]
        example_user, example_prefix = cwe_prompt(
            cwe_listing(example_words, shape.example_common, shape.example_uncommon, example_seed)
        )
        example = f"{example_user} {example_prefix} {numbered(example_words[:CWE_COMMON])}\n"
        answers = tuple(task_words[:CWE_COMMON])

        def build(units: int) -> Sample:
            user, prefix = cwe_prompt(cwe_listing(task_words[:units], shape.common, shape.uncommon, list_seed))
            meta = {"words": units, "repeats": [shape.common, shape.uncommon], "vocabulary": kind}
            return Sample("cwe", index, (Turn(example + user, answers, prefix),), meta=meta)

        sample = fit(tokenizer, context, "cwe", build, minimum=2 * CWE_COMMON, maximum=len(task_words))
        return sample, sample.meta["words"] < len(task_words)

    sample, enough = attempt("words")
    return sample if enough else attempt("pairs")[0]


# ---------------------------------------------------------------------------------------------
# Frequent words extraction

FWE_ALPHA = 2.0
FWE_ZETA = math.pi**2 / 6  # zeta(2): RULER normalizes the Zipf counts by scipy's zeta(alpha)
FWE_MIN_WORDS = 100  # the smallest text whose ranks 2-5 have distinct counts


def fwe_counts(total: int, vocabulary: int) -> list[int]:
    """Occurrences of the rank-k coded word in a text of about `total` words (RULER: total * k^-a / zeta(a))."""
    return [int(total * k**-FWE_ALPHA / FWE_ZETA) for k in range(1, vocabulary + 1)]


def fwe_prompt(text: str) -> tuple[str, str]:
    """RULER's frequent-words template and answer prefix."""
    user = (
        "Read the following coded text and track the frequency of each coded word. "
        f"Find the three most frequently appeared coded words. {text}\n"
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    )
    return user, "Answer: According to the coded text above, the three most frequently appeared words are:"


def fwe_sample(tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    """Frequent words extraction, after RULER's freq_words_extraction.py.

    Coded words are random 6-letter lowercase strings, a vocabulary of context // 50 of them; the
    rank-k word appears total * k^-2 / zeta(2) times (Zipf, alpha 2), shuffled. The top-ranked word
    is "..." (noise, as in RULER), so the answers are the words ranked 2 to 4.
    """
    task = "fwe"
    rng = sample_rng(seed, task, index)
    size = max(10, context // 50)
    vocabulary: list[str] = []
    while len(vocabulary) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocabulary:
            vocabulary.append(word)
    vocabulary[0] = "..."
    shuffle_seed = rng.getrandbits(64)
    answers = tuple(vocabulary[1:4])

    def build(units: int) -> Sample:
        counts = fwe_counts(units, size)
        items = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(items)
        user, prefix = fwe_prompt(" ".join(items))
        meta = {"words": len(items), "counts": counts[1:4]}
        return Sample(task, index, (Turn(user, answers, prefix),), meta=meta)

    return fit(tokenizer, context, task, build, minimum=FWE_MIN_WORDS)
