"""The SGLang plugin: `register()` adds the attention backend `sparsetune` to SGLang.

SGLang (0.5.11+) calls every callable of the `sglang.srt.plugins` entry-point group in each of its
processes (launcher, HTTP server, scheduler, workers), several times per host, so `register` is
idempotent and cheap: it imports SGLang's registry and argument choices only, and the backend
(`sparsetune.export.sglang.backend`, which imports torch and the flow compiler) only when SGLang
builds it. On an SGLang outside `SUPPORTED` it registers nothing and says so in one line: the
backend contract moved within 0.5.x (research note §0) and a backend written against another
version would fail inside the scheduler, far from the cause.

The bundle the backend serves is given by path in `SPARSETUNE_BUNDLE` (`launch_sglang.sh` of a
bundle sets it; SGLang's child processes inherit it).
"""

from __future__ import annotations

import sys

from sparsetune.export.sglang import BUNDLE_ENV, NAME

__all__ = ["BUNDLE_ENV", "NAME", "SUPPORTED", "register", "version_problem"]
# Written against 0.5.16; 0.5.13 is the first with the out-of-graph / in-graph metadata hooks and
# pools on the backend rather than the batch.
SUPPORTED = ((0, 5, 13), (0, 5, 16))


def version_tuple(version: str) -> tuple[int, ...]:
    """(0, 5, 16) of "0.5.16" or "0.5.16.post1"; non-numeric parts end it."""
    parts = []
    for p in version.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def supported(version: str) -> bool:
    return SUPPORTED[0] <= version_tuple(version)[:3] <= SUPPORTED[1]


def version_problem(version: str | None) -> str | None:
    """Why this SGLang cannot host the backend (None: it can)."""
    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    if version is None:
        return f"SGLang is not installed: pip install 'sglang>={lo},<={hi}' (or sparsetune[sglang])"
    if not supported(version):
        return f"SGLang {version} is not supported by sparsetune's backend (supported: {lo} to {hi}): pip install sglang=={hi}"
    return None


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def register() -> None:
    """Add the `sparsetune` attention backend to SGLang's registry and CLI choices (idempotent)."""
    problem = version_problem(installed_version())
    if problem:
        print(f"sparsetune: backend not registered: {problem}", file=sys.stderr)
        return
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(_create)


def _create(runner):
    from sparsetune.export.sglang.backend import SparsetuneBackend

    return SparsetuneBackend(runner)
