"""Run untrusted code (flows an agent wrote, flow files from elsewhere) in an isolated child process.

Shared basics: this module imports only the standard library and `sparsetune.errors`.

Every child starts through the jail (`sparsetune/jail.py`, `python -I jail.py ... SCRATCH -- CMD`),
which on Linux with user namespaces guarantees, for the child and everything it starts:

* it sees no other process (its own PID namespace and /proc): not the environment, memory,
  command line or files of this process, of the user's shell or of any other process;
* it can write only in its scratch folder and in its private /tmp and /dev/shm (everything else
  is mounted read-only; what it writes in /tmp stays in a layer of its own; /dev holds only
  harmless and GPU device nodes), and the usual credential stores under the home folder
  (`hidden_paths`: ~/.ssh, ~/.aws, ~/.netrc, ...) are covered;
* it has no network (a network namespace with a loopback that is down), reaches no Unix socket of
  the host's (a CPU-only child cannot open one at all; for a GPU child, whose CUDA driver needs
  one, every socket path bound on the host and /run are covered), has no capability and no way to
  gain one;
* every process it started is gone when the call returns (`run_limited`) or the evaluator is
  closed or killed: when the namespace's pid 1 ends, the kernel kills the rest, `setsid` ones
  included, before the jail's launcher exits.

Where the jail cannot set this up (not Linux, user namespaces disabled or restricted, /proc that
cannot be mounted, a mount that stays writable) nothing runs: `launch` raises `IsolationRefused` (a
`SparsetuneError`) saying why. There is no unisolated fallback.

Besides: a clean environment (`clean_env`: an allow-list; nothing secret-looking), OS limits
(CPU seconds, file size, no core files), an address-space cap a CPU-only child sets on itself once
its imports are done (`cap_address_space`), and a watchdog in this process that kills the whole
namespace (SIGKILL) when the wall clock or the resident memory of all its processes passes its limit.
What the child printed goes to a log file (scrubbed when it ends); what it returns is one JSON file
it writes in its scratch folder, read here without following links. `scrub` takes anything
credential-shaped out of text a child produced before it is stored or shown to an LLM.

The jail does not hide the rest of the file system from reading: a child reads what the user can
read (except the covered credential stores), which is why its text is scrubbed.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Mapping

from sparsetune.errors import SparsetuneError

JAIL = Path(__file__).with_name("jail.py")
REFUSED = 97  # the jail's exit code when it cannot isolate (jail.REFUSED)
POLL_S = 0.05
START_S = 60.0  # the most the jail may take to set up before the command runs
_AS_ENV = "SPARSETUNE_SANDBOX_AS_MB"  # set for a CPU-only child: the address space it may add after its imports
REDACTED = "[redacted]"


# ---- what a child may use --------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """What a sandboxed child may use. `memory_mb`: resident memory of every process in its
    namespace (the watchdog), and on a CPU-only child also the address space it may add after its
    imports (`cap_address_space`; CUDA cannot run under `RLIMIT_AS`). `cpu_s`: CPU seconds
    (`RLIMIT_CPU`); None: only the wall clock bounds it. `cpu_only`: no GPU visible."""

    wall_s: float = 120.0
    memory_mb: int = 4096
    cpu_s: int | None = None
    file_mb: int = 256
    cpu_only: bool = True


@dataclass
class Outcome:
    """How a sandboxed child ended: its exit code (a death by signal as 128 + the signal), why the
    watchdog killed it (None: it was not), its wall time and peak resident memory, and the JSON it
    returned (None: it wrote none)."""

    returncode: int | None
    killed: str | None
    seconds: float
    peak_mb: float
    result: dict[str, Any] | None
    log: str

    def reason(self) -> str | None:
        """One line on why the child gave no result: killed, crashed, or silent; None if it returned.
        The log's last line is scrubbed (`scrub`)."""
        if self.killed:
            return f"killed by the harness: {self.killed}"
        if self.result is not None:
            return None
        tail = [line for line in _tail(self.log).splitlines() if line.strip()]
        return f"the sandbox exited with code {self.returncode}" + (f": {scrub(tail[-1])[:300]}" if tail else "")


class SandboxError(RuntimeError):
    """A sandboxed child was killed (a limit) or died; what it was doing failed. Its message is scrubbed."""

    def __init__(self, message: str) -> None:
        super().__init__(scrub(message))


class IsolationRefused(SparsetuneError):
    """The jail cannot isolate a child on this host: nothing ran."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"the sandbox cannot isolate agent code on this host: {why}. sparsetune refuses to run "
                         "agent-written candidates (or any untrusted code) unisolated; it needs Linux with user "
                         "namespaces enabled (sysctl user.max_user_namespaces > 0; on Ubuntu 23.10 and later "
                         "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile allowing them)")


# ---- secrets ----------------------------------------------------------------------------------------

# names of variables that hold credentials ("PAT" only as a word: PATH is not one)
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|SIGNATURE|"
                          r"(?:^|_)PATS?(?:_|$)|(?:^|_)DSN(?:_|$)", re.IGNORECASE)
_NOT_SECRET = {"PWD", "OLDPWD"}
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?:[^\s:/@]*:[^\s]*@|[^\s:/@]{16,}@)")
_SHAPES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S), REDACTED),
    (re.compile(r"\bsk-(?:ant-)?[A-Za-z0-9_\-]{16,}"), REDACTED),  # Anthropic, OpenAI
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"), REDACTED),  # GitHub
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),  # AWS access key ids
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{8,}"), REDACTED),  # Slack
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{4,}(?:\.[A-Za-z0-9_\-]*)?"), REDACTED),  # JWT
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}"), REDACTED),  # Hugging Face
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{35}"), REDACTED),  # Google API keys
    (re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=\-]{8,}"), r"\1\2" + REDACTED),
    (_URL_USERINFO, r"\g<scheme>" + REDACTED + "@"),  # scheme://user:password@host
    (re.compile(r"(?i)\b(password|passwd|secret|api[_-]?key|access[_-]?token)([\"']?\s*[:=]\s*[\"']?)[^\s\"'&,;]{4,}"),
     r"\1\2" + REDACTED),
]


def _secret_name(name: str) -> bool:
    return name not in _NOT_SECRET and bool(_SECRET_NAME.search(name))


def _shaped(text: str) -> str:
    for pattern, repl in _SHAPES:
        text = pattern.sub(repl, text)
    return text


def _env_secrets() -> list[str]:
    """Values in this process's environment that must never appear in a child's text: those of
    secret-looking variables, and the passwords of URLs with one (at least 8 characters each)."""
    found = set()
    for name, value in os.environ.items():
        if _secret_name(name):
            found.add(value)
        for m in re.finditer(r"://[^\s:/@]*:([^\s]*)@", value):
            found.add(m[1])
    return sorted((v for v in found if len(v) >= 8), key=len, reverse=True)


def scrub(text: Any) -> Any:
    """`text` with every credential in it replaced by "[redacted]": the values of this process's
    secret-looking environment variables (`_env_secrets`), and credential-shaped strings (API keys
    `sk-...`/`sk-ant-...`, GitHub `ghp_`/`github_pat_` tokens, AWS `AKIA...` ids, Slack `xox?-`
    tokens, JWTs `eyJ...`, Hugging Face `hf_...`, Google `AIza...`, private-key blocks, the user
    info of `scheme://user:password@host`, `Bearer <token>`, `password=...`). Lists and dicts are
    scrubbed value by value; anything else comes back as it was."""
    if isinstance(text, str):
        for value in _env_secrets():
            text = text.replace(value, REDACTED)
        return _shaped(text)
    if isinstance(text, list):
        return [scrub(v) for v in text]
    if isinstance(text, tuple):
        return tuple(scrub(v) for v in text)
    if isinstance(text, dict):
        return {k: scrub(v) for k, v in text.items()}
    return text


# ---- the environment --------------------------------------------------------------------------------

# What a child's environment keeps of this process's (everything else is dropped): the locale and
# search path, the Python settings that change how the code runs (not PYTHONSTARTUP/BREAKPOINT),
# thread counts, the GPU and kernel settings (CUDA_*, TRITON_*, TORCH_*, ...: e.g. TRITON_INTERPRET),
# where models are read from (HF_HOME, HF_HUB_CACHE, SPARSETUNE_MODELS) and offline switches, and
# sparsetune's own settings. Of those, a name that looks like a credential, a value shaped like one,
# and a cache or output folder (read-only in the jail; HOME and TMPDIR, in the scratch folder, take
# their place) are dropped too.
ALLOWED_ENV = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "USER", "LOGNAME", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONIOENCODING",
    "PYTHONUTF8", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "PYTHONSAFEPATH",
    "OMP_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "TOKENIZERS_PARALLELISM",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_VERBOSITY",
})
ALLOWED_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TRITON_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "MKL_",
                        "OPENBLAS_", "OMP_", "KMP_", "GOMP_", "SPARSETUNE_")
_PLACES_TO_WRITE = re.compile(r"CACHE|^TRITON_(HOME|DUMP_DIR|OVERRIDE_DIR)$|^TORCH_(HOME|EXTENSIONS_DIR)$")


def _allowed(name: str, value: str) -> bool:
    if name not in ALLOWED_ENV and not name.startswith(ALLOWED_ENV_PREFIXES):
        return False
    return not _secret_name(name) and not _PLACES_TO_WRITE.search(name) and _shaped(value) == value


# Set in every child's environment: code that runs in it is already in the sandbox, so a flow file
# runs there as Python (`loader.load_file`), not traced in a jail of its own (jails do not nest).
TRUST_ENV = "SPARSETUNE_TRUST_FLOW_CODE"  # 1: the user trusts flow files (--trust-flow-code): they run as Python
INSIDE_ENV = "SPARSETUNE_SANDBOXED"


def inside() -> bool:
    """Whether this process is a sandboxed child (or one it started)."""
    return os.environ.get(INSIDE_ENV) == "1"


def clean_env(limits: Limits, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: this process's, kept to `ALLOWED_ENV` (above), plus `extra` (the
    caller's own settings, taken as given) and the limits' (`limits.cpu_only`: no GPU visible, the
    address-space cap's size, two malloc arenas)."""
    env = {k: v for k, v in os.environ.items() if _allowed(k, v)}
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    env[INSIDE_ENV] = "1"
    if limits.cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env[_AS_ENV] = str(limits.memory_mb)
        # glibc reserves 64 MB of address space per malloc arena, up to 8 per core: on a many-core host
        # the threads of torch alone would pass RLIMIT_AS ("cannot allocate memory for thread-local data")
        env["MALLOC_ARENA_MAX"] = "2"
    return env


def cap_address_space() -> None:
    """In a CPU-only child, once its imports are done: cap its address space (`RLIMIT_AS`, soft and
    hard, so it cannot be raised again) at what it maps now plus its `memory_mb`. Set before the
    imports instead, the cap would have to guess what torch maps: a CUDA build of torch maps
    several GB of libraries even with no GPU visible, and a fixed cap set from a CPU build failed
    one check in 38 on a GPU host ("cannot allocate memory for thread-local data")."""
    extra_mb = os.environ.get(_AS_ENV)
    if not extra_mb:
        return
    import resource

    with open("/proc/self/status") as f:
        mapped_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    cap = (mapped_kb << 10) + (int(extra_mb) << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


# ---- the jail ---------------------------------------------------------------------------------------

# Under the home folder(s): what holds credentials (keys, tokens, shell histories), covered in the jail.
CREDENTIAL_STORES = (
    ".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gh", ".config/gcloud", ".config/hub",
    ".config/git/credentials", ".config/anthropic", ".config/openai", ".netrc", ".git-credentials", ".pgpass",
    ".pypirc", ".npmrc", ".yarnrc", ".yarnrc.yml", ".gem/credentials", ".cargo/credentials",
    ".cargo/credentials.toml", ".m2/settings.xml", ".gradle/gradle.properties", ".terraform.d", ".vault-token",
    ".claude", ".claude.json", ".codex", ".anthropic", ".openai", ".huggingface", ".cache/huggingface/token",
    ".cache/huggingface/stored_tokens", ".local/share/keyrings", ".password-store", ".bash_history",
    ".zsh_history", ".python_history", ".psql_history", ".mysql_history", ".sqlite_history", ".node_repl_history",
    ".lesshst", ".viminfo",
)
ROOT_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/etc/sudoers",
                "/etc/sudoers.d")  # readable by a child of root (its uid is root's)


def _contains(folder: str, path: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def hidden_paths() -> list[str]:
    """What the jail covers (`--hide`): the credential stores under the home folder (`HOME` and the
    user's entry in the password database), `$HF_HOME/token`, the secrets container runtimes mount,
    the user's runtime folder (agent sockets) and, for root, the system's own secrets; those that
    exist and hold nothing this Python needs (its prefix, its import path)."""
    import pwd

    homes = {os.environ.get("HOME") or ""}
    try:
        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        pass
    paths = [os.path.join(h, p) for h in sorted(homes - {"", "/"}) for p in CREDENTIAL_STORES]
    if os.environ.get("HF_HOME"):
        paths += [os.path.join(os.environ["HF_HOME"], "token"), os.path.join(os.environ["HF_HOME"], "stored_tokens")]
    paths += ["/run/secrets", "/var/run/secrets", f"/run/user/{os.getuid()}"]
    if os.getuid() == 0:
        paths += list(ROOT_SECRETS)
    needed = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.executable, *sys.path) if p]
    out = []
    for p in paths:
        real = os.path.realpath(p)
        if os.path.lexists(p) and not any(_contains(real, n) for n in needed) and real not in out:
            out.append(real)
    return out


def jail_command(cmd: list[str], scratch: Path, limits: Limits, status_fd: int) -> list[str]:
    """The command line that runs `cmd` in the jail: its rlimits (no core files, `file_mb`, `cpu_s`),
    its private /tmp and /dev/shm at most `memory_mb` each (the watchdog counts what they hold),
    the paths to cover (`hidden_paths`); a child that may use the GPU may open Unix sockets."""
    rlimits = ["core=0", f"fsize={limits.file_mb << 20}"]
    if limits.cpu_s is not None:
        rlimits.append(f"cpu={limits.cpu_s}:{limits.cpu_s + 5}")
    args = [sys.executable, "-I", "-S", str(JAIL), "--status-fd", str(status_fd), "--tmpfs-mb", str(limits.memory_mb)]
    if not limits.cpu_only:
        args.append("--unix-sockets")  # CUDA's driver opens one when it starts (the paths it could reach are covered)
    for r in rlimits:
        args += ["--rlimit", r]
    for p in hidden_paths():
        args += ["--hide", p]
    return [*args, str(scratch), "--", *cmd]


def _pid_ns(pid: int | str, which: str = "pid") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{which}")
    except OSError:
        return None


def namespace_pids(ns: str) -> list[int]:
    """Every process (host pids) of the PID namespace `ns` (`pid:[inode]`)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _pid_ns(entry.name) == ns:
            out.append(int(entry.name))
    return out


def rss_mb(pids: list[int]) -> float:
    """Resident memory of these processes (from /proc), MB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


class Jailed:
    """A command running in the jail: `proc` is the jail's launcher (this process's child), `pid1`
    the command (pid 1 of the namespace `ns`; host pids)."""

    def __init__(self, proc: subprocess.Popen, pid1: int | None, ns: str | None) -> None:
        self.proc, self.pid1, self.ns = proc, pid1, ns
        self.userns = _pid_ns(pid1, "user") if pid1 is not None else None

    def pids(self) -> list[int]:
        return [self.proc.pid, *(namespace_pids(self.ns) if self.ns else [])]

    def rss_mb(self) -> float:
        """Resident memory of every process of the namespace (and the launcher), and what its private
        /tmp and /dev/shm hold (memory too: tmpfs), MB."""
        total = rss_mb(self.pids())
        if self.pid1 is not None and self.proc.poll() is None:
            for folder in ("tmp", "dev/shm"):
                try:
                    st = os.statvfs(f"/proc/{self.pid1}/root/{folder}")
                except OSError:
                    continue
                if st.f_fsid != os.statvfs(f"/{folder}").f_fsid:  # the jail's own tmpfs, not the host's folder
                    total += (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20
        return total

    def memory_breach(self, limit_mb: float) -> tuple[float, str | None]:
        """Resident memory, and why it is over `limit_mb` (None: it is not)."""
        rss = self.rss_mb()
        return rss, f"over its memory limit of {limit_mb} MB ({rss:.0f} MB resident)" if rss > limit_mb else None

    def _ours(self, pid: int) -> bool:
        return self.ns is not None and _pid_ns(pid) == self.ns and _pid_ns(pid, "user") == self.userns

    def kill(self, wait_s: float = 30.0) -> None:
        """SIGKILL pid 1: the kernel kills every process of the namespace, and the launcher exits once
        they are all gone; wait for it (past `wait_s`, it is killed too). A launcher that did not exit
        on its own (killed from outside) leaves pid 1 to its parent-death signal: what is left of
        the namespace is killed here until none is."""
        if self.proc.poll() is None:
            if self.pid1 is not None and self._ours(self.pid1):
                try:
                    os.kill(self.pid1, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self.proc.wait()
        if self.proc.returncode >= 0 or self.ns is None:
            return  # the launcher saw pid 1 end: the kernel had emptied the namespace by then
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (left := [p for p in namespace_pids(self.ns) if self._ours(p)]):
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)


def _read_status(fd: int, timeout: float) -> str | None:
    """What the jail wrote on its status pipe until it closed (the command's exec, or the jail's
    exit); None if it did not within `timeout`."""
    data, deadline = b"", time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return data.decode(errors="replace")
            data += chunk


def _find_pid1(launcher: int) -> int | None:
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        kids = []
        for entry in os.scandir("/proc"):
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    if entry.name.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == launcher:
                        kids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return kids[0] if kids else None


def launch(cmd: list[str], limits: Limits, scratch: Path, out: IO | int, *, stdin: IO | int | None = subprocess.DEVNULL,
           cwd: Path | str | None = None, env: Mapping[str, str] | None = None, pass_fds: tuple[int, ...] = (),
           log: Path | None = None) -> Jailed:
    """Start `cmd` in the jail with `scratch` its one writable folder; its stdout and stderr go to
    `out`. Returns once the command runs (isolated); raises `IsolationRefused` when it cannot be.
    `env`: the command's whole environment (default: `clean_env(limits)`)."""
    global _ISOLATES
    if not sys.platform.startswith("linux"):
        raise IsolationRefused(f"{sys.platform} is not Linux: the sandbox needs Linux namespaces")
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    env = clean_env(limits) if env is None else env
    status_r, status_w = os.pipe()
    try:
        proc = subprocess.Popen(jail_command(cmd, scratch.resolve(), limits, status_w), stdin=stdin, stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd, env=dict(env),
                                pass_fds=(status_w, *pass_fds), start_new_session=True)
    finally:
        os.close(status_w)
    try:
        status = _read_status(status_r, START_S)
    finally:
        os.close(status_r)
    if status is not None and status.startswith("ok"):
        _ISOLATES = True
        pid1 = _find_pid1(proc.pid)
        ns = _pid_ns(pid1) if pid1 is not None else None
        return Jailed(proc, pid1, ns if ns != _pid_ns("self") else None)
    if status is None:
        Jailed(proc, None, None).kill()
        raise IsolationRefused(f"the jail did not start the command within {START_S:g} s")
    code = proc.wait()
    if status.startswith("cannot isolate:"):
        raise IsolationRefused(status.removeprefix("cannot isolate:").strip())
    tail = [line for line in (_tail(str(log)) if log else "").splitlines() if line.strip()]
    raise IsolationRefused(f"the jail failed (exit code {code})" + (f": {scrub(tail[-1])[:300]}" if tail else ""))


_ISOLATES: bool = False  # the jail has started a command in this process's life


def check_isolation() -> None:
    """Raise `IsolationRefused` (saying why) unless the jail can isolate a child on this host: a
    command that needs the sandbox checks this before it starts anything (cheap: an empty Python in
    the jail, about 0.1 s, once per process)."""
    global _ISOLATES
    if _ISOLATES:
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparsetune-jail-check-") as tmp:
        box = launch([sys.executable, "-S", "-c", ""], Limits(wall_s=30), Path(tmp), subprocess.DEVNULL)
        box.proc.wait()
        box.kill()
    _ISOLATES = True


# ---- files a child wrote ----------------------------------------------------------------------------

def read_result(path: Path, max_mb: int = 64) -> dict[str, Any] | None:
    """The JSON object a child wrote at `path` (in its scratch folder): read only if it is a regular
    file (a link is not followed) of at most `max_mb`; None otherwise, or if it is not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_mb << 20:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def _remove(path: Path) -> None:
    """Remove what a child left at `path` (a file, a link or a folder), never following a link."""
    import shutil

    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: links inside are removed, not followed
    else:
        path.unlink(missing_ok=True)


def collect(src: Path, dest: Path, max_mb: int = 1024) -> dict[str, str]:
    """Copy what a child wrote under `src` (in its scratch folder) to `dest` (outside it), then remove
    `src`: folders and regular files only (links, pipes, devices are left out; nothing is followed),
    copied, not moved (a moved folder stays writable to a child holding it open). A top-level entry
    whose name `dest` already has gets a suffix (`-1`, ...). Paths under `src` inside the copied JSON
    files (`.json`, `.jsonl`) are rewritten to their new place. Returns old path → new path for
    the top-level entries."""
    moved: dict[str, str] = {}
    try:
        root = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return moved
    budget = [max_mb << 20]
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(root)):
            target, i = dest / name, 0
            while os.path.lexists(target):
                i += 1
                target = dest / f"{name}-{i}"
            if _copy_entry(root, name, target, budget):
                moved[str(src / name)] = str(target)
        for new in moved.values():
            _rewrite_paths(Path(new), moved)
    finally:
        os.close(root)
        _remove(src)
    return moved


def _copy_entry(dir_fd: int, name: str, target: Path, budget: list[int]) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = os.open(name, flags | os.O_DIRECTORY, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            target.mkdir()
            for child in sorted(os.listdir(fd)):
                _copy_entry(fd, child, target / child, budget)
        finally:
            os.close(fd)
        return True
    if not stat.S_ISREG(st.st_mode):
        return False
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        with open(target, "xb") as out:
            while budget[0] > 0 and (chunk := os.read(fd, min(1 << 20, budget[0]))):
                budget[0] -= len(chunk)
                out.write(chunk)
    finally:
        os.close(fd)
    return True


def _rewrite_paths(path: Path, moved: dict[str, str]) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    pairs = [(json.dumps(old)[1:-1], json.dumps(new)[1:-1]) for old, new in moved.items()]
    for f in files:
        if f.suffix not in (".json", ".jsonl"):
            continue
        text = f.read_text(errors="replace")
        new = text
        for old, rep in pairs:
            new = new.replace(old, rep)
        if new != text:
            f.write_text(new)


def relocate(data: Any, moved: dict[str, str]) -> Any:
    """`data` (a child's answer) with the paths `collect` moved rewritten to their new place."""
    if isinstance(data, str):
        for old, new in moved.items():
            if _contains(old, data):
                return new + data[len(old):]
        return data
    if isinstance(data, list):
        return [relocate(v, moved) for v in data]
    if isinstance(data, dict):
        return {k: relocate(v, moved) for k, v in data.items()}
    return data


def scrub_file(path: Path, max_mb: int = 64) -> None:
    """Rewrite a log a child wrote (once it has ended) with `scrub` applied; a link is not followed,
    a file past `max_mb` is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_mb << 20:
            return
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read().decode(errors="replace")
    finally:
        os.close(fd)
    clean = scrub(text)
    if clean != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.scrub")
        tmp.write_text(clean)
        os.replace(tmp, path)


# ---- one-shot runs ----------------------------------------------------------------------------------

def run_limited(cmd: list[str], limits: Limits, log: Path, result: Path, cwd: Path | None = None,
                scratch: Path | None = None, env: Mapping[str, str] | None = None) -> Outcome:
    """Run `cmd` under `limits` in the jail (module docstring), with `scratch` (default: `result`'s
    folder) its one writable folder; it returns by writing a JSON object to `result` (in `scratch`).
    `env`: settings of the caller's added to the clean environment. Every process it started is gone
    when this returns. Raises `IsolationRefused` where it cannot be isolated (nothing ran)."""
    scratch = Path(scratch) if scratch is not None else Path(result).parent
    if not _contains(str(scratch.absolute()), str(Path(result).absolute())):
        raise ValueError(f"{result} is not in the scratch folder {scratch}: the child could not write it")
    log.parent.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    _remove(Path(result))
    t0 = time.monotonic()
    killed, peak = None, 0.0
    with open(log, "wb") as out:
        box = launch(cmd, limits, scratch, out, cwd=cwd, env=clean_env(limits, env), log=log)
        try:
            while box.proc.poll() is None:
                elapsed = time.monotonic() - t0
                rss, over = box.memory_breach(limits.memory_mb)
                peak = max(peak, rss)
                killed = f"over its wall-clock limit of {limits.wall_s:g} s" if elapsed > limits.wall_s else over
                if killed:
                    break
                try:
                    box.proc.wait(timeout=POLL_S)  # returns as soon as it ends
                except subprocess.TimeoutExpired:
                    pass
        finally:  # killed, or this process interrupted: nothing of the namespace outlives the call
            box.kill()
    scrub_file(log)
    data = None if killed else read_result(Path(result), max(limits.file_mb, 1))
    return Outcome(box.proc.returncode, killed, round(time.monotonic() - t0, 3), round(peak, 1), data, str(log))


def _tail(path: str, size: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
