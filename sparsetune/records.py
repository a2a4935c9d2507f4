"""Run records: `runs/<timestamp>-<what>-<model>/` directories, environment facts, atomic JSON writes,
new output files, and the resumable run (config.json read back; one JSON line per finished unit of
work, read back up to a line a hard kill cut off): eval's samples and bench serve's requests."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from sparsetune.errors import SparsetuneError

DEFAULT_RUNS_DIR = Path("runs")
_PACKAGES = ("sparsetune", "torch", "triton", "transformers", "tokenizers", "numpy", "gguf")


def slug(text: str) -> str:
    """A flow path or model path as a short directory-name part (`flows/x.py` → `x`)."""
    name = Path(text).stem if text.endswith(".py") or "/" in text else text
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "run"


def new_run_dir(out: Path | str | None, *parts: str) -> Path:
    """Create `out/<YYYYmmdd-HHMMSS>-<part>-<part>...`; a numeric suffix keeps same-second runs apart."""
    root = Path(out) if out is not None else DEFAULT_RUNS_DIR
    stem = "-".join([time.strftime("%Y%m%d-%H%M%S")] + [slug(p) for p in parts])
    for i in range(1000):
        path = root / (stem if i == 0 else f"{stem}-{i}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise SparsetuneError(f"cannot create a run folder under {root}: {e.strerror}; pick a writable --out") from None
    raise SparsetuneError(f"cannot create a run folder under {root}: 1000 of this second's names are taken")


def new_file(path: Path) -> Path:
    """`path` for a file the user asked a command to write (`--out`): refused if it exists or its
    directory does not (nothing of theirs is overwritten, nothing is created where they did not mean)."""
    if path.exists():
        raise SparsetuneError(f"{path} exists; pick another --out")
    if not path.parent.is_dir():
        raise SparsetuneError(f"--out {path}: the directory {path.parent} does not exist; create it first "
                              f"(mkdir -p {path.parent}) or pick another --out")
    return path


def private_dir(path: Path) -> Path:
    """A folder only this user can use (caches of generated code and traced flows): created 0700
    with its parents; refused when it is a link, not a folder, or another user's; others' access
    bits on it are cleared."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        raise SparsetuneError(f"cannot create the cache folder {path}: {e.strerror}; set XDG_CACHE_HOME to a "
                              "writable folder") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SparsetuneError(f"the cache folder {path} is a link, not a folder, or another user's; remove it "
                              "(or set XDG_CACHE_HOME elsewhere)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/sparsetune` (default ~/.cache/sparsetune)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparsetune"


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename), so an interrupted run never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def file_sha256(path: Path | str) -> str:
    """The sha256 (hex) of a file's bytes: a flow source's content hash in run records and bundles."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def package_version(pkg: str) -> str | None:
    """An installed distribution's version, or None."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def env_info(device: Any = None) -> dict[str, Any]:
    """Package versions, Python, host and device facts for `env.json`."""
    versions = {pkg: package_version(pkg) for pkg in _PACKAGES}
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "packages": versions,
        "device": None if device is None else str(device),
        "gpu": None,
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
            idx = torch.device(device).index if device is not None and torch.device(device).index is not None else 0
            props = torch.cuda.get_device_properties(idx)
            info["gpu"] = {"name": props.name, "memory_bytes": props.total_memory, "cuda": torch.version.cuda,
                           "capability": f"{props.major}.{props.minor}"}
    except Exception:  # env facts are best-effort; a run must not fail on them
        pass
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return info


# ---- a resumable run: config.json, then one JSON line per finished unit of work --------------------

def read_run_config(run_dir: Path, command: str) -> Any:
    """The parsed config.json of a run folder to resume (what is in it is the caller's to check), or
    one error naming what is wrong (`command`: what makes such folders, for the fix)."""
    what = f"pass a run directory made by {command}"
    if not run_dir.is_dir():
        raise SparsetuneError(f"--resume {run_dir}: no such directory; {what}")
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise SparsetuneError(f"--resume {run_dir}: no config.json there; {what}")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise SparsetuneError(f"--resume {run_dir}: cannot read config.json ({e.strerror}); {what}") from None
    except ValueError as e:  # not UTF-8, not JSON
        raise SparsetuneError(f"--resume {run_dir}: config.json is not JSON ({e}); {what}") from None
    return raw


def read_lines(path: Path) -> list[dict[str, Any]]:
    """A run's records, one JSON object a line (none: no file). A line cut off by a hard kill ends
    them: the work it recorded is done again."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def keep_lines(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite a run's records with only those `keep` accepts (and none after a cut line), at once:
    a crash leaves the old file or the new one."""
    if not path.is_file():
        return
    records = read_lines(path)
    kept = [r for r in records if keep(r)]
    if len(kept) != len(path.read_text(encoding="utf-8").splitlines()):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        tmp.replace(path)
