"""Hostile tests of the agent sandbox (issue #40, items 4 and 5): a child run through `run_limited`
behaves like a candidate that tries to get out. It must not read the environment of its parent or of
any other process of the user, write outside its scratch folder, reach the network or a local
socket, leave a process behind (forked, `setsid`, after a normal exit or a kill), or hide memory in
a `setsid` grandchild; what it prints is scrubbed before it is recorded or shown to an LLM; and a
host where it cannot be isolated refuses to run it.

The children are plain `python -c` scripts: the sandbox must hold against any code, not only code
that passed the flow-file checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sparsetune.agents.sandbox import Limits, clean_env, run_limited
from sparsetune.errors import SparsetuneError

REPO = Path(__file__).resolve().parents[2]
SECRET_NAME = "SPARSETUNE_TEST_SECRET_KEY"
ANTHROPIC = "sk-ant-api03-" + "Q7x" * 30


def child(tmp_path: Path, code: str, *args: str, limits: Limits = Limits(wall_s=60), name: str = "probe"):
    """Run `code` (argv: the result file, then `args`) with `tmp_path/scratch` its scratch folder."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    out = scratch / f"{name}.json"
    return run_limited([sys.executable, "-c", code, str(out), *map(str, args)], limits, tmp_path / f"{name}.log", out)


def alive(marker: str) -> list[int]:
    """Host pids of live (not zombie) processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            found.append(int(entry))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ---- item 4: the environment and memory of other processes -------------------------------------

READ_ENVIRON = r"""
import json, os, sys
out, name, *pids = sys.argv[1:]
needle = (name + "=").encode()
found, readable = [], []
for pid in pids + [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        continue
    readable.append(pid)
    if needle in data:
        found.append(pid)
mem = "unreadable"
try:
    with open(f"/proc/{pids[0]}/mem", "rb") as f:
        mem = "opened"
except OSError:
    pass
json.dump({"found": found, "readable": readable, "mem": mem, "pid": os.getpid(), "own": name in os.environ},
          open(out, "w"))
"""


def test_the_child_reads_no_environment_of_the_parent_or_any_other_process(tmp_path, monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv(SECRET_NAME, secret)
    # another process of the user holding the secret (a shell, an editor): not the child's parent
    shell = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env={**os.environ})
    try:
        res = child(tmp_path, READ_ENVIRON, SECRET_NAME, os.getpid(), shell.pid)
    finally:
        shell.kill()
        shell.wait()
    assert res.result is not None, res.reason()
    assert res.result["found"] == [], res.result  # not in /proc/<parent>/environ, nor any other's
    assert not res.result["own"]
    assert str(os.getpid()) not in res.result["readable"] or res.result["pid"] == 1  # its own /proc: another namespace
    assert res.result["mem"] == "unreadable" or res.result["pid"] == 1


def test_clean_env_keeps_no_credential(monkeypatch):
    for name, value in {"GITHUB_PAT": "ghp_" + "a" * 36, "DATABASE_URL": "postgresql://u:pw@h/db",
                        "ANTHROPIC_API_KEY": ANTHROPIC, "OPENAI_API_KEY": "sk-proj-" + "b" * 40,
                        "HF_TOKEN": "hf_" + "c" * 34, "AWS_SECRET_ACCESS_KEY": "d" * 40, "PGPASSWORD": "pw",
                        "SSH_AUTH_SOCK": "/tmp/ssh-x/agent.1", "SPARSETUNE_STORAGE": "postgresql://u:pw@h/db",
                        "SPARSETUNE_API_TOKEN": "t" * 20, "REDIS_URL": "redis://:pw@h:6379",
                        "SPARSETUNE_PLAIN": "kept", "OMP_NUM_THREADS": "3"}.items():
        monkeypatch.setenv(name, value)
    env = clean_env(Limits())
    assert not {"GITHUB_PAT", "DATABASE_URL", "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "HF_TOKEN",
                "AWS_SECRET_ACCESS_KEY", "PGPASSWORD", "SSH_AUTH_SOCK", "SPARSETUNE_STORAGE",
                "SPARSETUNE_API_TOKEN", "REDIS_URL"} & set(env), sorted(env)
    assert not any("pw@" in v or "sk-" in v for v in env.values())
    assert env["SPARSETUNE_PLAIN"] == "kept" and env["OMP_NUM_THREADS"] == "3"


# ---- item 5: nothing outlives a call ---------------------------------------------------------------

SPAWN = r"""
import json, os, subprocess, sys, time
out, marker, late, mode, delay = sys.argv[1:6]
scratch = os.path.dirname(out)
def started(i):
    return os.path.join(scratch, f"started-{i}")
sleeper = lambda i: [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(120)",
                     started(i), marker]
writer = [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(float(sys.argv[3])); "
          "open(sys.argv[2], 'w').write('late')", started(2), late, delay, marker]
kids = [subprocess.Popen(sleeper(0)), subprocess.Popen(sleeper(1), start_new_session=True),
        subprocess.Popen(writer, start_new_session=True)]
if os.fork() == 0:  # a forked grandchild in the child's own process group
    os.execv(sys.executable, sleeper(3))
t0 = time.time()
while not all(os.path.exists(started(i)) for i in range(4)) and time.time() - t0 < 30:
    time.sleep(0.05)
json.dump({"started": all(os.path.exists(started(i)) for i in range(4))}, open(out, "w"))
if mode == "hang":
    time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_no_descendant_outlives_the_call(tmp_path, mode):
    marker = f"sparsetune-test-marker-{uuid.uuid4().hex}"
    late = tmp_path / "scratch" / "late.txt"
    limits = Limits(wall_s=60 if mode == "exit" else 6)
    delay = 3 if mode == "exit" else 9  # the setsid writer writes after the call would have returned
    try:
        res = child(tmp_path, SPAWN, marker, late, mode, delay, limits=limits)
        left = alive(marker)  # at once: nothing to wait for
        if mode == "exit":
            assert res.killed is None and res.result == {"started": True}, res.reason()
        else:
            assert res.killed == "over its wall-clock limit of 6 s"
            assert json.loads((tmp_path / "scratch" / "probe.json").read_text()) == {"started": True}
        assert left == [], f"{len(left)} descendants alive after the call returned"
        time.sleep(delay + 1 - min(res.seconds, delay))
        assert not late.exists(), "a setsid grandchild wrote after the call returned"
    finally:
        kill_all(alive(marker))


HOG = r"""
import json, subprocess, sys, time
out, marker = sys.argv[1:3]
hog = "b = bytearray(700 << 20)\nimport time\ntime.sleep(60)"
subprocess.Popen([sys.executable, "-c", hog, marker], start_new_session=True)
time.sleep(40)
"""


def test_memory_in_a_setsid_grandchild_counts(tmp_path):
    marker = f"sparsetune-test-marker-{uuid.uuid4().hex}"
    try:
        res = child(tmp_path, HOG, marker, limits=Limits(wall_s=30, memory_mb=400))
        assert res.killed is not None and "over its memory limit of 400 MB" in res.killed, res.killed
        assert alive(marker) == []
    finally:
        kill_all(alive(marker))


# ---- writes and the network ----------------------------------------------------------------------

WRITE = r"""
import json, sys
out, *targets = sys.argv[1:]
res = {}
for t in targets:
    try:
        with open(t, "w") as f:
            f.write("x")
        res[t] = "wrote"
    except OSError as e:
        res[t] = type(e).__name__
json.dump(res, open(out, "w"))
"""


def test_the_child_writes_only_in_its_scratch_folder(tmp_path):
    tag = uuid.uuid4().hex
    inside = tmp_path / "scratch" / "inside.txt"
    sibling = tmp_path / "outside"
    sibling.mkdir()
    targets = [inside, sibling / "x.txt", REPO / f".sandbox-probe-{tag}", Path.home() / f".sandbox-probe-{tag}",
               Path("/dev/shm") / f"sparsetune-probe-{tag}"]
    try:
        res = child(tmp_path, WRITE, *targets)
        assert res.result is not None, res.reason()
        assert res.result[str(inside)] == "wrote" and inside.read_text() == "x"
        for t in targets[1:]:
            assert not t.exists(), f"the child wrote {t}"
            # under /tmp and /dev/shm a write lands in the child's private layer (gone with it); elsewhere it fails
            if not any(Path(p) in t.parents for p in ("/tmp", "/dev/shm")):
                assert res.result[str(t)] != "wrote", (t, res.result[str(t)])
    finally:
        for t in targets[1:]:
            t.unlink(missing_ok=True)


CONNECT = r"""
import json, socket, sys
out, port, path = sys.argv[1:]
res = {}
for name, family, addr in (("tcp", socket.AF_INET, ("127.0.0.1", int(port))), ("unix", socket.AF_UNIX, path)):
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(addr)
        res[name] = "connected"
    except OSError as e:
        res[name] = type(e).__name__
json.dump(res, open(out, "w"))
"""


@pytest.mark.parametrize("cpu_only", [True, False])  # a GPU child may open Unix sockets (CUDA does): none reaches the host's
def test_no_network_and_no_local_socket(tmp_path, cpu_only):
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.setblocking(False)
    path = tmp_path / "s.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(path))
    unix.listen()
    unix.setblocking(False)
    try:
        res = child(tmp_path, CONNECT, tcp.getsockname()[1], path, limits=Limits(wall_s=60, cpu_only=cpu_only))
        assert res.result is not None, res.reason()
        assert res.result == {"tcp": res.result["tcp"], "unix": res.result["unix"]}
        assert "connected" not in res.result.values(), res.result
        for s in (tcp, unix):
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        tcp.close()
        unix.close()


# ---- what a child says is scrubbed ---------------------------------------------------------------

def test_scrub_redacts_environment_secrets_and_credential_shapes(monkeypatch):
    from sparsetune.sandbox import scrub

    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv(SECRET_NAME, secret)
    monkeypatch.setenv("DATABASE_URL", "postgresql://alice:pw-9f8e7d6c@db.example/prod")
    shapes = {
        "the env value": f"read {secret} from the parent",
        "anthropic": f"key {ANTHROPIC} here",
        "openai": "key sk-proj-" + "Zz9" * 15,
        "github": "token ghp_" + "A1b2" * 9,
        "github fine-grained": "github_pat_11ABCDEFG0_" + "x" * 40,
        "aws": "id AKIAIOSFODNN7EXAMPLE",
        "slack": "xoxb-123456789012-abcdefABCDEF",
        "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlLXBhcnQ",
        "url": "connect to postgresql://bob:hunter2hunter2@10.0.0.1:5432/db failed",
        "the env url's password alone": "password pw-9f8e7d6c was wrong",
        "bearer": "Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345",
    }
    for what, text in shapes.items():
        out = scrub(text)
        assert "[redacted]" in out, (what, out)
    assert secret not in scrub(shapes["the env value"])
    assert "hunter2" not in scrub(shapes["url"]) and "@10.0.0.1:5432/db" in scrub(shapes["url"])
    assert "pw-9f8e7d6c" not in scrub(shapes["the env url's password alone"])
    plain = "cand.py:12: F.topk needs a score of shape [S, 1, 1], got [4, 1, 4]; see https://example.com/x"
    assert scrub(plain) == plain
    assert scrub({"a": [f"x {secret}"], "n": 3}) == {"a": ["x [redacted]"], "n": 3}


LEAK = r"""
import sys
print("the parent's key is", sys.argv[2], "and", sys.argv[3])
raise SystemExit(1)
"""


def test_a_rejection_quoting_a_secret_is_redacted_in_the_record_and_the_prompt(tmp_path, monkeypatch):
    from sparsetune.agents.harness import Candidate, Stage, load_candidates
    from sparsetune.agents.llm import _candidate_lines

    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv(SECRET_NAME, secret)
    # a child that got hold of secrets (say, from a file): its last line is the reason
    res = child(tmp_path, LEAK, secret, ANTHROPIC)
    why = res.reason()
    assert why.startswith("the sandbox exited with code 1: the parent's key is")
    assert secret not in why and ANTHROPIC not in why and "[redacted]" in why
    log = Path(res.log).read_text()
    assert secret not in log and ANTHROPIC not in log  # the log kept with the candidate, too

    leak = f"ValueError: {secret} / {ANTHROPIC} / postgresql://u:pw-12345678@db/x"
    cand = Candidate("0001", "cand", "test", "class X: pass\n", rationale=f"because {ANTHROPIC}",
                     stages=[Stage("static", True, None, 0.0), Stage("check", False, leak, 1.0, {"tail": [leak]})])
    cand.save(tmp_path / "candidates")
    record = (tmp_path / "candidates" / "0001" / "candidate.json").read_text()
    prompt = "\n".join(_candidate_lines(cand, []))
    for text in (record, prompt):
        assert secret not in text and ANTHROPIC not in text and "pw-12345678" not in text, text
        assert "[redacted]" in text
    assert json.loads(record)["reason"].startswith("ValueError: [redacted] / [redacted] / postgresql://[redacted]@db/x")
    [loaded] = load_candidates(tmp_path / "candidates")
    assert loaded.source == "class X: pass\n"  # the source is the proposer's, kept byte for byte


# ---- a host that cannot isolate refuses -----------------------------------------------------------

NO_USERNS = ["unshare", "--user", "--map-root-user", "sh", "-c",
             'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]


def _no_userns_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*NO_USERNS, "true"], capture_output=True).returncode == 0


needs_unshare = pytest.mark.skipif(not _no_userns_available(),
                                   reason="needs unshare(1) and a user namespace whose max_user_namespaces can be 0")


@needs_unshare
def test_the_jail_refuses_in_one_line_where_user_namespaces_are_off(tmp_path):
    """For real: the jail runs in a user namespace that may create no user namespace."""
    ran = tmp_path / "ran"
    proc = subprocess.run([*NO_USERNS, sys.executable, "-I", str(REPO / "sparsetune" / "jail.py"), str(tmp_path), "--",
                           "touch", str(ran)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 97, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsetune-jail: cannot isolate: unshare"), proc.stderr
    assert not ran.exists()


@needs_unshare
def test_run_limited_refuses_where_the_jail_cannot_isolate(tmp_path, monkeypatch):
    module = sys.modules[run_limited.__module__]
    real = getattr(module, "jail_command", None)
    monkeypatch.setattr(module, "jail_command", lambda *a, **k: [*NO_USERNS, *real(*a, **k)], raising=False)
    ran = tmp_path / "scratch" / "ran"
    with pytest.raises(SparsetuneError, match=r"the sandbox cannot isolate agent code on this host: unshare .*"
                                              r"refuses to run agent-written candidates .* unisolated"):
        child(tmp_path, "import pathlib, sys; pathlib.Path(sys.argv[2]).touch()", ran)
    assert not ran.exists()
    monkeypatch.setattr(module, "_ISOLATES", False, raising=False)
    with pytest.raises(SparsetuneError, match="cannot isolate"):  # what `search --agent` checks before it starts
        module.check_isolation()


def test_a_child_cannot_forge_the_refusal(tmp_path):
    """The refusal comes on the jail's own pipe: a child printing the jail's line and exiting 97 is a
    child that failed, not a host that cannot isolate."""
    res = child(tmp_path, "import sys; print('sparsetune-jail: cannot isolate: forged', file=sys.stderr); sys.exit(97)")
    assert res.result is None and res.reason() == "the sandbox exited with code 97: sparsetune-jail: cannot isolate: forged"


# ---- what the evaluator's child leaves for this process ------------------------------------------

def test_collect_copies_folders_and_files_only_and_rewrites_paths(tmp_path):
    from sparsetune.sandbox import collect, relocate

    src = tmp_path / "scratch" / "out" / "1"
    run = src / "20250101-000000-quest-smollm2"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"run_dir": str(run), "x": 1}))
    (run / "records.jsonl").write_text("{}\n")
    (run / "passwd").symlink_to("/etc/passwd")
    os.mkfifo(run / "fifo")
    (tmp_path / "dest" / run.name).mkdir(parents=True)  # taken: the copy gets a suffix
    moved = collect(src, tmp_path / "dest")
    new = tmp_path / "dest" / f"{run.name}-1"
    assert moved == {str(run): str(new)}
    assert sorted(p.name for p in new.iterdir()) == ["records.jsonl", "results.json"]
    assert json.loads((new / "results.json").read_text())["run_dir"] == str(new)
    assert relocate({"accuracy": {"run_dir": str(run)}, "n": 2}, moved) == {"accuracy": {"run_dir": str(new)}, "n": 2}
    assert not src.exists()


def test_the_launcher_never_races_pid_1_for_its_proc(tmp_path):
    """Pid 1 mounts its namespace's fresh /proc over the mount namespace it shares with the launcher,
    where /proc/self no longer names the launcher (it is outside that PID namespace): the launcher
    lists its file descriptors before the fork. Twenty quick runs all succeed (listing them after the
    fork failed about one run in five here, FileNotFoundError: '/proc/self/fd')."""
    for _ in range(20):
        proc = subprocess.run([sys.executable, "-I", str(REPO / "sparsetune" / "jail.py"), str(tmp_path), "--", "/bin/true"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
