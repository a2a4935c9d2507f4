"""The SGLang plugin: `register()` adds the attention backend `sparsetune` to SGLang.

SGLang (0.5.11+) calls every callable of the `sglang.srt.plugins` entry-point group in each of its
processes (launcher, HTTP server, scheduler, workers), several times per host, so `register` is
idempotent and cheap: it imports SGLang's registry and argument choices only, and the backend
(`sparsetune.export.sglang.backend`, which imports torch and the flow compiler) only when SGLang
builds it. On an SGLang outside `bundle.SUPPORTED` it registers nothing and says so in one line: the
backend contract moved within 0.5.x (research note §0) and a backend written against another
version would fail inside the scheduler, far from the cause.

The bundle the backend serves is given by path in `SPARSETUNE_BUNDLE` (`launch_sglang.sh` of a
bundle sets it; SGLang's child processes inherit it). For a reuse bundle there, `register` also adds
the request hooks (`segments.HOOKS`: how a request marks segments) to SGLang's hook registry, which
`load_plugins` applies next; they act only on requests that carry parts. The scheduler's hooks are
the backend's to register, in the process that builds it.
"""

from __future__ import annotations

import sys

from sparsetune.export.bundle import BACKEND, sglang_problem


def register() -> None:
    """Add the `sparsetune` attention backend to SGLang's registry and CLI choices (idempotent)."""
    problem = sglang_problem()
    if problem:
        print(f"sparsetune: backend not registered: {problem}", file=sys.stderr)
        return
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(_create)
    if _serves_reuse():
        from sparsetune.export.sglang.segments import HOOKS, add_hooks

        add_hooks(HOOKS)


def _serves_reuse() -> bool:
    """Whether `SPARSETUNE_BUNDLE` names a reuse bundle (its manifest's schema; read, not checked: the
    backend checks the bundle when SGLang builds it)."""
    import json
    import os
    from pathlib import Path

    from sparsetune.export.bundle import BUNDLE_ENV, MANIFEST, REUSE_SCHEMA

    path = os.environ.get(BUNDLE_ENV)
    try:
        return bool(path) and json.loads((Path(path) / MANIFEST).read_text()).get("schema") == REUSE_SCHEMA
    except (OSError, ValueError, AttributeError):
        return False


def _create(runner):
    from sparsetune.export.sglang.backend import SparsetuneBackend

    return SparsetuneBackend(runner)
