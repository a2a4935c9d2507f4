"""Whether requests fit an engine: one rule, refused in the caller's words.

`batch` requests of `context` prompt tokens plus `new_tokens` generated ones fit when the model has
the positions, the engine's context holds them (its KV pool may cap it below the model's) and the
pool has the blocks. That is the engine's own rule: a request of P + M tokens runs to its end when
P + M <= `max_model_len`, in `BlockManager.blocks_for(P + M)` blocks. Checked before a run, so a case that
cannot run is refused with the fix instead of being preempted (and timed recomputing).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsetune.errors import SparsetuneError


@dataclass(frozen=True)
class FitWords:
    """The refusals as `str.format` templates; fields: model, positions (the model's), limit (the
    engine's context), context, new, need (context + new), room (positions - new), batch, blocks
    (needed), pool (the pool's blocks)."""

    positions: str  # need > the model's positions
    context: str  # need > the engine's context (its KV pool holds less than the model's positions)
    blocks: str  # the batch needs more blocks than the pool has
    cap: str | None = None  # need > the engine's context where --max-model-len set it (None: as `context`)


_EVAL_CONTEXT = ("--context plus generation is {need} tokens but the engine holds {limit} per request; "
                 "lower --context or --max-new-tokens")
EVAL = FitWords(  # eval's options (--context, --max-new-tokens, --batch)
    positions=_EVAL_CONTEXT,
    context=_EVAL_CONTEXT,
    blocks=("{batch} requests of {need} tokens need {blocks} KV blocks but the pool has {pool}; "
            "lower --batch or raise --kv-memory"),
)
# A task file's sample, used as written (--context does not resize it): its prompt is the fix.
_SAMPLE_FIX = "shorten its prompt (a task file's samples are used as written: --context does not resize them)"
SAMPLE = FitWords(
    positions=("its prompt of {context} tokens plus up to {new} generated exceed {model}'s {positions} positions; "
               + _SAMPLE_FIX + " or lower --max-new-tokens"),
    context=("its prompt of {context} tokens plus up to {new} generated exceed the {limit} tokens the KV pool holds "
             "per request; raise --kv-memory, or " + _SAMPLE_FIX),
    blocks=("{batch} requests of {need} tokens need {blocks} KV blocks but the pool has {pool}; "
            "lower --batch or raise --kv-memory"),
)
GENERATE = FitWords(  # one prompt and at least one new token (generation stops at the context's end)
    positions=("the prompt has {context} tokens but the context holds {positions} ({model}'s positions, for the "
               "prompt plus one new token); shorten the prompt"),
    context=("the prompt has {context} tokens but the context holds {limit} (what the KV pool holds per request, "
             "for the prompt plus one new token); raise --kv-memory or shorten the prompt"),
    blocks="the prompt needs {blocks} KV blocks but the pool has {pool}; raise --kv-memory or shorten the prompt",
    cap=("--max-model-len {limit} is too small for the {context}-token prompt (the prompt plus one new token); "
         "raise --max-model-len to {need} or more, or shorten the prompt"),
)
PROFILE = FitWords(  # `sparsetune profile`'s options (--context, --batch; the decode steps it adds)
    positions=("--context {context} is too long for {model}: it holds {positions} positions and the profile "
               "decodes {new} more tokens; use --context {room} or less"),
    context=("--context {context} plus {new} decode tokens exceeds the engine's context ({limit} tokens); "
             "raise --kv-memory or lower --context"),
    blocks=("--batch {batch} x --context {context} needs {blocks} KV blocks but the pool has {pool}; "
            "raise --kv-memory or lower --batch/--context"),
)

SERVE = FitWords(  # `sparsetune bench serve`'s options (one request of the longest lengths must fit)
    positions="--input-len {context} plus --output-len {new} exceeds {model}'s {positions} positions",
    context=("--input-len {context} plus --output-len {new} exceeds the engine's context ({limit} tokens); "
             "raise --kv-memory or lower the lengths"),
    blocks="one request of {need} tokens needs {blocks} KV blocks but the pool has {pool}; raise --kv-memory or lower the lengths",
)


def check_positions(model: str, positions: int, context: int, new_tokens: int, words: FitWords = EVAL,
                    limit: int | None = None) -> None:
    """The model's `positions` hold `context` + `new_tokens` (checkable before an engine exists;
    `limit`: the engine's context, where one exists)."""
    if context + new_tokens > positions:
        raise SparsetuneError(words.positions.format(
            model=model, positions=positions, limit=positions if limit is None else limit, context=context,
            new=new_tokens, need=context + new_tokens, room=positions - new_tokens))


def check_fits(engine, batch: int, context: int, new_tokens: int, words: FitWords = EVAL) -> None:
    """`batch` requests of `context` + `new_tokens` tokens fit `engine` (an `Engine`): the model's
    positions, the engine's context and its KV pool; else a `SparsetuneError` in `words`."""
    need, limit = context + new_tokens, engine.max_model_len
    check_positions(engine.resolved.name, engine.model_config.max_position_embeddings, context, new_tokens, words,
                    limit)
    if need > limit:
        capped = words.cap is not None and limit == engine.config.max_model_len  # the user's cap, not the pool
        raise SparsetuneError((words.cap if capped else words.context).format(
            limit=limit, context=context, new=new_tokens, need=need))
    blocks, pool = batch * engine.block_manager.blocks_for(need), engine.block_manager.num_blocks
    if blocks > pool:
        raise SparsetuneError(words.blocks.format(batch=batch, context=context, need=need, blocks=blocks, pool=pool))
