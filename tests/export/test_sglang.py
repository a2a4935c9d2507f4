"""The SGLang backend's contract tests (`tests/export/sglang/`), run against SGLang itself, each
version with the torch it pins.

Each supported SGLang (0.5.16, 0.5.23) pins exact versions of torch (2.11.0 / 2.14.1), transformers and
more that this venv does not have, and on CPU its CUDA kernels do not install; but its attention
backends, pools and batch objects import with a handful of pure-Python packages. So, once per
machine and version (`~/.cache/sparsetune/`):
- an environment with the torch that version pins: a venv holding that torch and its torchvision,
  with this interpreter's packages after its own (so sparsetune's dependencies are this venv's), installed from the package index with their dependencies (the index's Linux
  torch is a CUDA build; its libraries load on a CPU-only machine);
- a site folder with SGLang and its import chain, installed with `--no-deps`;
and the contract tests run in a child process of that environment's Python with the site folder
first on its path, which checks that the torch and SGLang it runs are the pinned ones.
`SPARSETUNE_SGLANG_SITE_0_5_16` / `_0_5_23` and `SPARSETUNE_SGLANG_PYTHON_0_5_16` / `_0_5_23` point at
ready ones. Where the package index cannot be reached the test skips, except in CI.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
# Per supported SGLang: it and what `import` of its backends, pools, batch, server args, plugin
# loader, tokenizer manager and OpenAI routes needs beyond this project's dependencies (research note §6.2; versions its wheel accepts).
# transformers, tokenizers and huggingface-hub are the ones each SGLang registers its model configs
# against (0.5.23's own pins); torch and torchvision come with the version's environment (TORCH).
# kernels: the version both SGLangs pin (kernels<0.15,>=0.14.1). Left to this venv's, the one newer
# transformers require (0.19.1, from transformers 5.25), SGLang 0.5.16's transformers 5.12.1 fails at
# import ("Either a revision or a version must be specified", kernels' LayerRepository).
_CHAIN = """orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1
aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 attrs==26.1.0
yarl==1.25.1 propcache==0.5.4 pyzmq==27.3.0 httpx==0.28.1 httpcore==1.0.9 dill==0.4.1 msgspec==0.22.0
apache-tvm-ffi==0.1.11 loguru==0.7.3 fastapi==0.165.0 uvicorn==0.54.0 uvloop==0.23.0 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0""".split()
# The torch each SGLang pins (its wheel's Requires-Dist), and the torchvision built for that torch.
TORCH = {"0.5.16": ["torch==2.11.0", "torchvision==0.26.0"], "0.5.23": ["torch==2.14.1", "torchvision==0.29.1"]}
PINS = {
    "0.5.16": """sglang==0.5.16 transformers==5.12.1 tokenizers==0.22.2 huggingface_hub==1.33.0 openai==3.57.0
partial_json_parser==0.2.1.1.post7 xgrammar==0.2.8 sentencepiece==0.2.3 einops==0.8.2
compressed-tensors==0.20.0 kernels==0.14.1""".split() + _CHAIN,
    "0.5.23": """sglang==0.5.23 transformers==5.19.0 tokenizers==0.23.2 huggingface_hub==1.33.0 sentencepiece==0.2.1
compressed-tensors==0.18.0 openai==2.8.0 distro==1.9.0 partial_json_parser==0.2.1.1.post7 einops==0.8.2
xgrammar==0.2.8 kernels==0.14.1""".split() + _CHAIN,
}


CACHE = Path.home() / ".cache" / "sparsetune"


def _given(kind: str, version: str, usable) -> Path | None:
    """A ready site folder or Python named by `SPARSETUNE_SGLANG_<KIND>_<version>`, checked (`usable`)."""
    name = f"SPARSETUNE_SGLANG_{kind}_{version.replace('.', '_')}"
    given = os.environ.get(name)
    if not given:
        return None
    if not usable(Path(given)):
        pytest.fail(f"{name}={given}: not a usable {kind.lower()} for SGLang {version}; unset it to build one")
    return Path(given)


def _installed(what: str, version: str, target: Path, build) -> Path:
    """`target`, built by `build(tmp)` into a folder of its own first (a failed or interrupted build
    leaves nothing behind; two runs building at once each use their own, and the first to finish
    wins); a pip failure skips the test (fails it in CI)."""
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=f"{target.name}.partial-"))
    done = build(tmp)
    if done.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        if os.environ.get("CI"):
            pytest.fail(f"could not install {what} for SGLang {version}: {why}")
        pytest.skip(f"{what} for SGLang {version} could not be installed (no package index?): {why}")
    try:
        tmp.rename(target)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _digest(parts: list[str]) -> str:
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:12]


def sglang_site(version: str) -> Path:
    """The site folder with SGLang `version` and its import chain, installed on first use."""
    given = _given("SITE", version, lambda p: (p / "sglang").is_dir())
    if given:
        return given
    pins = PINS[version]

    def build(tmp: Path):
        return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                               str(tmp), *pins], capture_output=True, text=True, timeout=1500)

    return _installed("the test site", version, CACHE / f"sglang-site-{_digest(pins)}", build)


def torch_python(version: str) -> Path:
    """The Python of an environment with the torch SGLang `version` pins, made on first use: a venv
    whose own site-packages (the pinned torch) come first and this interpreter's after them (a `.pth`
    file adds them, so this works from a venv too, where `--system-site-packages` would give the
    base interpreter's instead)."""
    given = _given("PYTHON", version, lambda p: p.is_file())
    if given:
        return given
    pins = TORCH[version]
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]

    def build(tmp: Path):
        made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], capture_output=True, text=True,
                              timeout=300)
        if made.returncode:
            return made
        own = subprocess.run([str(tmp / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, timeout=60)
        if own.returncode:
            return own
        Path(own.stdout.strip(), "_sparsetune_parent.pth").write_text(
            "import site; list(map(site.addsitedir, " + repr(parents) + "))\n")
        return subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                               "--disable-pip-version-check", *pins], capture_output=True, text=True, timeout=1500)

    # keyed by the pins and by this interpreter (its version and packages' place)
    target = CACHE / f"sglang-torch-{_digest(pins + [sys.version, sys.prefix, *parents])}"
    return _installed(f"the pinned torch ({pins[0]})", version, target, build) / "bin" / "python"


@pytest.mark.parametrize("version", sorted(PINS))
def test_the_backend_contract_on_sglang_itself(version):
    site, python = sglang_site(version), torch_python(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "SPARSETUNE_SGLANG_EXPECT": version,
           "SPARSETUNE_TORCH_EXPECT": TORCH[version][0].split("==")[1]}
    env.pop("SPARSETUNE_BUNDLE", None)
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "sglang")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
