"""The SGLang backend's contract tests (`tests/export/sglang/`), run against SGLang itself.

Each supported SGLang (0.5.16, 0.5.23) pins exact versions of torch, transformers and more that this venv does not have,
and on CPU its CUDA kernels do not install; but its attention backends, pools and batch objects
import with a handful of pure-Python packages. So they are installed with `--no-deps` into a site
folder of their own (once per machine and version: `~/.cache/sparsetune/`, or
`SPARSETUNE_SGLANG_SITE_0_5_16` / `_0_5_23`), and
the contract tests run in a child process with that folder first on its path: this venv's torch,
SGLang's transformers. Where the package index cannot be reached the test skips, except in CI.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
# Per supported SGLang: it and what `import` of its backends, pools, batch, server args and plugin
# loader needs beyond this project's dependencies (research note §6.2; versions its wheel accepts).
# torchvision 0.28 is torch 2.13's (constraints.txt); transformers, tokenizers and huggingface-hub
# are the ones each SGLang registers its model configs against (0.5.23's own pins). This venv's torch
# (2.13) stands in for the torch each pins (2.11 / 2.14.1): the contract is SGLang's Python objects.
_CHAIN = """torchvision==0.28.0 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1
aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 attrs==26.1.0
yarl==1.25.1 propcache==0.5.4 pyzmq==27.3.0 httpx==0.28.1 httpcore==1.0.9 dill==0.4.1 msgspec==0.22.0
apache-tvm-ffi==0.1.11 loguru==0.7.3""".split()
PINS = {
    "0.5.16": """sglang==0.5.16 transformers==5.12.1 tokenizers==0.22.2 huggingface_hub==1.33.0 openai==3.57.0
partial_json_parser==0.2.1.1.post7 xgrammar==0.2.8 sentencepiece==0.2.3 einops==0.8.2
compressed-tensors==0.20.0""".split() + _CHAIN,
    "0.5.23": """sglang==0.5.23 transformers==5.19.0 tokenizers==0.23.2 huggingface_hub==1.33.0 sentencepiece==0.2.1
compressed-tensors==0.18.0 openai==2.8.0 distro==1.9.0 partial_json_parser==0.2.1.1.post7 einops==0.8.2""".split() + _CHAIN,
}


def sglang_site(version: str) -> Path:
    """The site folder with SGLang `version` and its import chain, installed on first use."""
    pins = PINS[version]
    digest = hashlib.sha256(" ".join(pins).encode()).hexdigest()[:12]
    given = os.environ.get(f"SPARSETUNE_SGLANG_SITE_{version.replace('.', '_')}")
    site = Path(given or Path.home() / ".cache" / "sparsetune" / f"sglang-site-{digest}")
    if (site / "sglang").is_dir():
        return site
    tmp = site.with_name(site.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(tmp), *pins],
                          capture_output=True, text=True, timeout=1500)
    if done.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        if os.environ.get("CI"):
            pytest.fail(f"could not install SGLang's test site: {why}")
        pytest.skip(f"SGLang's test site could not be installed (no package index?): {why}")
    tmp.rename(site)
    return site


@pytest.mark.parametrize("version", sorted(PINS))
def test_the_backend_contract_on_sglang_itself(version):
    site = sglang_site(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "SPARSETUNE_SGLANG_EXPECT": version}
    env.pop("SPARSETUNE_BUNDLE", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "sglang")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
