"""Run a command isolated from the rest of the host: Linux namespaces, nothing but the standard library.

    python -I jail.py [--status-fd N] [--rlimit NAME=SOFT[:HARD]]... [--hide PATH]... [--tmpfs-mb N]
                      [--unix-sockets] SCRATCH -- CMD [ARG...]

A plain script (it imports nothing of sparsetune, so `python -I` can run it by its path): the
launcher of `sparsetune.sandbox`, which runs code an agent wrote and untrusted flow files. What the
command (and everything it starts) gets:

* **No other process.** A new PID namespace whose pid 1 is the command, with a fresh /proc of that
  namespace: no process outside it is visible (no /proc/<pid>/environ, mem, cmdline of the parent,
  the user's shell or anything else), none can be signalled or traced. When pid 1 exits, or is
  killed, the kernel kills every process of the namespace, `setsid` ones included, before the
  launcher sees it gone: nothing the command started outlives it.
* **No privilege.** A new user namespace mapping the caller's own uid and gid to themselves (no
  other id, setgroups denied); every capability dropped (bounding, ambient, effective, permitted,
  inheritable), `no_new_privs`, and the secure bits locked, so it cannot mount, unmount (uncover
  the host's /proc under the fresh one), or gain anything by exec. A seccomp filter refuses
  io_uring and the kernel keyring calls (the session keyring is inherited) and, unless
  `--unix-sockets` (CUDA's driver needs one), AF_UNIX sockets.
* **No writes outside SCRATCH.** / is made private, SCRATCH is bind-mounted onto itself and stays
  writable, and every other mount is remounted read-only (the flags a user namespace locks kept:
  nosuid, nodev, noexec, atime); /sys and its cgroup mounts too (when the caller is root, its uid
  inside is host root, and root-owned sysfs files are writable by their mode bits alone). A mount
  that cannot be made read-only is a failure, except a pseudo file system (sysfs, cgroup, devpts,
  mqueue, ...) when the caller is not root. /dev is a fresh read-only tmpfs holding only null,
  zero, full, random, urandom, tty and the GPU nodes (nvidia*, dri, kfd), bound from the host's
  (a root caller's child could otherwise open /dev/vda for writing: device nodes ignore a
  read-only mount); /dev/shm is a fresh private tmpfs and /tmp the host's under a private
  writable layer (overlayfs over a tmpfs; an empty tmpfs where overlayfs is missing): the command
  reads what is there and what it writes or deletes stays in the jail (`--tmpfs-mb`: the most
  each may hold; SCRATCH, if under /tmp, is bound back in at its path). /run (and a real
  /var/run) is an empty read-only tmpfs, and every Unix socket bound in the host's network
  namespace (/proc/net/unix, read before leaving it) is covered by /dev/null: no host daemon's
  socket (docker, a database, dbus, tmux, an ssh or gpg agent) can be connected to by path.
  /proc's top-level entries other than the processes' folders (/proc/sys, sysrq-trigger, irq,
  driver, ...) are read-only. HOME is SCRATCH/.home and TMPDIR SCRATCH/.tmp. Each `--hide PATH`
  is covered (a folder by an empty read-only tmpfs, a file by /dev/null): the caller passes the
  usual credential stores. Reading the rest of the file system is not prevented: the command
  reads what the user can read.
* **No network.** A new network namespace: one loopback interface, down (abstract Unix sockets
  are per network namespace too). Also new IPC, UTS and cgroup namespaces.
* **Limits**: each `--rlimit` is set before the command runs (core, fsize, cpu, as, nofile,
  nproc; only ever lowered); PR_SET_PDEATHSIG kills pid 1 (so the namespace) if the launcher dies.

The launcher process itself unshares, writes the id maps, forks pid 1, waits for it and exits with
its status (a death by signal as 128 + the signal). Pid 1 sets everything up, checks the result
(every mount it can see is read-only but SCRATCH, /tmp's layer, /dev/shm and /proc's process folders; it
is pid 1 of its own /proc; it has no capability), writes `ok` on `--status-fd` (close-on-exec, so
the command can neither write nor forge it) and execs the command. A jail cannot start inside
another (its /proc cannot be mounted there): a command in the jail that needs one is refused.

If any step fails (user namespaces disabled or restricted, /proc cannot be mounted, a writable
mount remains, not Linux), the command does not run: the jail prints one line
`sparsetune-jail: cannot isolate: <why>` on stderr, writes `cannot isolate: <why>` on
`--status-fd`, and exits with code 97 (`REFUSED`).

Tested on x86_64 Linux 6.18 as root, on CPU and, with `--unix-sockets`, with CUDA (an H200: torch,
a Triton kernel, a CUDA graph, nvidia-smi).
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import stat
import struct
import sys

REFUSED = 97
PREFIX = "sparsetune-jail: "

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 22, 2, 47, 4
# noroot, no_setuid_fixup, no_cap_ambient_raise, each locked; keep_caps off and locked
SECUREBITS = 0b11101111
# per-mount flags a remount in a user namespace must keep (the kernel locks them)
LOCKED_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
# file systems without files of anyone's to protect: a caller that is not root may leave them writable
PSEUDO = {"sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "securityfs", "debugfs", "tracefs", "pstore",
          "bpf", "configfs", "fusectl", "hugetlbfs", "binfmt_misc", "efivarfs", "selinuxfs", "autofs",
          "rpc_pipefs", "nsfs"}
DEVICES = re.compile(r"(null|zero|full|random|urandom|tty|nvidia.*|dri|kfd)")
TMP_LAYER = "/dev/.tmp-layer"  # the tmpfs that holds what the command writes in /tmp
RLIMITS = {"core": "RLIMIT_CORE", "fsize": "RLIMIT_FSIZE", "cpu": "RLIMIT_CPU", "as": "RLIMIT_AS",
           "nofile": "RLIMIT_NOFILE", "nproc": "RLIMIT_NPROC"}

# seccomp: (audit arch, x32 bit or 0, socket, socketpair, syscalls refused outright)
_SYSCALLS = {
    "x86_64": (0xC000003E, 0x40000000, 41, 53, (425, 426, 427, 248, 249, 250)),  # io_uring x3, add_key, request_key, keyctl
    "aarch64": (0xC00000B7, 0, 198, 199, (425, 426, 427, 217, 218, 219)),
}
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}


class Refused(Exception):
    """A step of the isolation failed: the command must not run."""


_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise Refused(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or source or ''} on {target}")


def _prctl(option: int, arg: int = 0, what: str = "prctl") -> None:
    _check(libc().prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                        ctypes.c_ulong(0)), what)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ---- the mount table ---------------------------------------------------------------------------------

def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mounts() -> list[dict]:
    """This mount namespace's mounts (/proc/self/mountinfo), in order: id, parent, mount point,
    per-mount options, file system type."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields = left.split()
            out.append({"id": int(fields[0]), "parent": int(fields[1]), "point": _unescape(fields[4]),
                        "options": fields[5].split(","), "fstype": right.split()[0]})
    return out


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def visible(table: list[dict]) -> list[dict]:
    """The mounts a path can reach: not covered by a mount on their root, on a folder above them in
    their parent, or under a mount that is."""
    by_id = {m["id"]: m for m in table}
    children: dict[int, list[dict]] = {}
    for m in table:
        children.setdefault(m["parent"], []).append(m)
    memo: dict[int, bool] = {}

    def hidden(m: dict) -> bool:
        if m["id"] in memo:
            return memo[m["id"]]
        memo[m["id"]] = False  # a cycle (the root's parent is outside the namespace)
        covered = any(c["point"] == m["point"] for c in children.get(m["id"], []) if c is not m)
        parent = by_id.get(m["parent"])
        shadowed = parent is not None and any(
            s is not m and s["point"] != m["point"] and _under(m["point"], s["point"])
            for s in children.get(parent["id"], []))
        memo[m["id"]] = result = covered or shadowed or (parent is not None and parent is not m and hidden(parent))
        return result

    return [m for m in table if not hidden(m)]


def _locked(options: list[str]) -> int:
    return sum(flag for name, flag in LOCKED_FLAGS.items() if name in options)


# ---- pid 1: the set-up -------------------------------------------------------------------------------

def _make_read_only(scratch: str, root: bool) -> None:
    for m in mounts():
        point = m["point"]
        if _under(point, "/proc") or _under(point, scratch) or "ro" in m["options"]:
            continue
        try:
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked(m["options"]))
        except Refused as e:
            if not os.path.exists(point):  # under a mount point made unreachable meanwhile
                continue
            if m["fstype"] in PSEUDO and not root:
                continue
            raise Refused(f"cannot make {point} ({m['fstype']}) read-only: {e}") from None


def _fresh_dev(dev_flags: int, size: str) -> None:
    """/dev: a read-only tmpfs with the host's harmless and GPU nodes bound in, a private /dev/shm."""
    keep = []
    for name in sorted(os.listdir("/dev")):
        if DEVICES.fullmatch(name):
            path = f"/dev/{name}"
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) or stat.S_ISDIR(st.st_mode):
                keep.append((name, os.open(path, os.O_PATH | os.O_CLOEXEC), stat.S_ISDIR(st.st_mode)))
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")
    for name, fd, is_dir in keep:
        target = f"/dev/{name}"
        if is_dir:
            os.mkdir(target)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (MS_REC if is_dir else 0))
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | dev_flags)
        os.close(fd)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"/dev/{name}")
    os.mkdir("/dev/shm")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777{size}")
    os.mkdir(TMP_LAYER)
    _mount("tmpfs", TMP_LAYER, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=755{size}")
    os.mkdir(f"{TMP_LAYER}/upper", 0o755)
    os.chmod(f"{TMP_LAYER}/upper", 0o1777)
    os.mkdir(f"{TMP_LAYER}/work", 0o700)
    _mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")


def _private_tmp(scratch: str, size: str) -> None:
    """/tmp: the host's (read-only) under a private writable layer (overlayfs, its upper layer the
    tmpfs `TMP_LAYER`): what is there reads as before, what the command writes or deletes stays in
    the jail. An empty tmpfs where overlayfs is not available. SCRATCH, if under /tmp, is bound
    back in at its path."""
    keep = os.open(scratch, os.O_PATH | os.O_CLOEXEC) if _under(scratch, "/tmp") else None
    try:
        _mount("overlay", "/tmp", "overlay", MS_NOSUID | MS_NODEV,
               f"lowerdir=/tmp,upperdir={TMP_LAYER}/upper,workdir={TMP_LAYER}/work")
    except Refused:
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777{size}")
    if keep is not None:
        os.makedirs(scratch, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{keep}", scratch, None, MS_BIND | MS_REC)
        os.close(keep)


def listening_sockets() -> list[str]:
    """The paths of the Unix sockets bound in this network namespace (/proc/net/unix): read before
    the jail leaves it, to cover them (a socket on a read-only mount still connects)."""
    out = []
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and fields[7].startswith("/"):
                    out.append(fields[7].rstrip("\n"))
    except OSError:
        pass
    return sorted(set(out))


def _hide(path: str) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=000")
    elif stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        _mount("/dev/null", path, None, MS_BIND)
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _bpf_filter(arch: str, unix_sockets: bool = False) -> bytes:
    """The seccomp program (module docstring): native arch only, no x32, none of the refused calls,
    no AF_UNIX socket(pair) unless `unix_sockets`; everything else allowed."""
    audit, x32, sock, pair, refused = _SYSCALLS[arch]
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
    ALLOW, DENY = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM
    prog: list = [(LD, 0, 0, 4), (JEQ, 0, "deny", audit), (LD, 0, 0, 0)]
    if x32:
        prog.append((JGE, "deny", 0, x32))
    prog += [(JEQ, "deny", 0, nr) for nr in refused]
    if not unix_sockets:
        prog += [(JEQ, "unix", 0, sock), (JEQ, "unix", 0, pair)]
    prog.append((RET, 0, 0, ALLOW))
    labels = {"unix": len(prog)}
    prog += [(LD, 0, 0, 16), (JEQ, "deny", 0, 1), (RET, 0, 0, ALLOW)]  # args[0] (low word) == AF_UNIX
    labels["deny"] = len(prog)
    prog.append((RET, 0, 0, DENY))
    out = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out


def _seccomp(arch: str, unix_sockets: bool = False) -> None:
    code = _bpf_filter(arch, unix_sockets)
    buf = ctypes.create_string_buffer(code, len(code))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(code) // 8, ctypes.addressof(buf))
    _check(libc().prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                        ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp filter")


def _drop_privileges(arch: str, unix_sockets: bool = False) -> None:
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
    _prctl(PR_SET_SECUREBITS, SECUREBITS, "securebits")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap, f"drop capability {cap} from the bounding set")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear ambient capabilities")
    _seccomp(arch, unix_sockets)
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two (effective, permitted, inheritable) words: all zero
    _check(libc().syscall(ctypes.c_long(_SYS_CAPSET[arch]), header, data), "clear capabilities")


def _verify(scratch: str, writable: set[str], root: bool) -> None:
    if os.getpid() != 1 or os.readlink("/proc/self") != "1":
        raise Refused("the command would not be pid 1 of its own /proc")
    for m in visible(mounts()):
        if "ro" in m["options"] or m["point"] in writable or (m["fstype"] in PSEUDO and not root):
            continue
        raise Refused(f"a writable mount remains: {m['point']} ({m['fstype']})")
    with open("/proc/self/status") as f:
        caps = {k: int(v, 16) for k, v in (line.split(":", 1) for line in f) if k in ("CapEff", "CapPrm", "CapBnd")}
    if any(caps.values()):
        raise Refused(f"capabilities remain: {caps}")


def _cover(path: str, scratch: str, data: str, read_only: bool) -> None:
    """A fresh tmpfs on `path` (what was there is out of reach); SCRATCH, if it was under `path`,
    bound back in at its own path (still writable)."""
    keep = os.open(scratch, os.O_PATH | os.O_CLOEXEC) if _under(scratch, path) else None
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, data)
    if keep is not None:
        os.makedirs(scratch, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{keep}", scratch, None, MS_BIND | MS_REC)
        os.close(keep)
    if read_only:
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, data)


def _fresh_proc() -> None:
    """A proc of the new PID namespace. Its top-level entries but the processes' own folders are
    bound read-only (/proc/sys, sysrq-trigger, irq, driver, ...: a root caller's child could write
    what their mode bits let root write); the processes' folders stay writable (CUDA writes there)."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in sorted(os.listdir("/proc")):
        path = f"/proc/{name}"
        if name.isdigit() or os.path.islink(path):
            continue
        _mount(path, path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def setup(scratch: str, hide: list[str], arch: str, tmpfs_mb: int | None = None,
          unix_sockets: bool = False, sockets: list[str] = ()) -> dict[str, str]:
    """Pid 1's side (module docstring); returns the command's HOME and TMPDIR."""
    root = os.getuid() == 0
    size = f",size={tmpfs_mb}m" if tmpfs_mb else ""
    cwd = os.getcwd()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(scratch, scratch, None, MS_BIND | MS_REC)
    table = {m["point"]: m for m in visible(mounts())}
    dev_flags = _locked(table.get("/dev", {"options": []})["options"])
    _make_read_only(scratch, root)
    _fresh_dev(dev_flags, size)
    writable = {scratch, "/dev/shm", "/tmp", TMP_LAYER, "/proc"}
    _private_tmp(scratch, size)
    for run in ("/run", "/var/run"):  # the host's daemons' sockets and runtime files
        if os.path.isdir(run) and not os.path.islink(run):
            _cover(run, scratch, "mode=755,size=64k", read_only=True)
    for path in [*hide, *sockets]:
        if not _under(path, scratch) and not any(_under(w, path) for w in writable - {"/tmp"}):
            _hide(path)
    _fresh_proc()
    name = b"sparsetune-sandbox"
    libc().sethostname(name, len(name))
    try:
        os.chdir(cwd)  # the path again, through the new mounts
    except OSError:
        os.chdir(scratch)
    _drop_privileges(arch, unix_sockets)
    _verify(scratch, writable, root)
    dirs = {"HOME": os.path.join(scratch, ".home"), "TMPDIR": os.path.join(scratch, ".tmp")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    return dirs


# ---- the launcher ------------------------------------------------------------------------------------

def _refuse(why: str, status_fd: int | None) -> int:
    print(f"{PREFIX}cannot isolate: {why}", file=sys.stderr, flush=True)
    if status_fd is not None:
        try:
            os.write(status_fd, f"cannot isolate: {why}\n".encode())
        except OSError:
            pass
    return REFUSED


def _parse(argv: list[str]) -> tuple[dict, str, list[str]]:
    opts: dict = {"status_fd": None, "rlimits": [], "hide": [], "tmpfs_mb": None, "unix_sockets": False}
    i = 0
    while i < len(argv) and argv[i].startswith("--") and argv[i] != "--":
        name = argv[i]
        if name == "--unix-sockets":
            opts["unix_sockets"] = True
            i += 1
            continue
        if i + 1 >= len(argv):
            raise SystemExit(f"{PREFIX}{name} needs a value")
        value = argv[i + 1]
        if name == "--status-fd":
            opts["status_fd"] = int(value)
        elif name == "--rlimit":
            opts["rlimits"].append(value)
        elif name == "--hide":
            opts["hide"].append(value)
        elif name == "--tmpfs-mb":
            opts["tmpfs_mb"] = int(value)
        else:
            raise SystemExit(f"{PREFIX}unknown option {name}")
        i += 2
    rest = argv[i:]
    if len(rest) < 3 or rest[1] != "--":
        raise SystemExit(f"usage: python -I {sys.argv[0]} [--status-fd N] [--rlimit NAME=SOFT[:HARD]]... "
                         "[--hide PATH]... [--tmpfs-mb N] [--unix-sockets] SCRATCH -- CMD [ARG...]")
    return opts, rest[0], rest[2:]


def _set_rlimits(specs: list[str]) -> None:
    import resource

    for spec in specs:  # only ever lowered: a jail inside a jail cannot raise what the outer one set
        name, _, value = spec.partition("=")
        soft, _, hard = value.partition(":")
        which = getattr(resource, RLIMITS[name])
        _, now = resource.getrlimit(which)
        cap = (lambda v: v) if now == resource.RLIM_INFINITY else (lambda v: min(v, now))
        resource.setrlimit(which, (cap(int(soft)), cap(int(hard or soft))))


def _open_fds() -> list[int]:
    """This process's open file descriptors (read while /proc is still the host's: see `main`)."""
    return sorted(int(n) for n in os.listdir("/proc/self/fd"))


def _close_fds(fds: list[int], keep: set[int]) -> None:
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _status(pid_status: int) -> int:
    if os.WIFSIGNALED(pid_status):
        return 128 + os.WTERMSIG(pid_status)
    return os.WEXITSTATUS(pid_status)


def main(argv: list[str]) -> int:
    opts, scratch, cmd = _parse(argv)
    status_fd = opts["status_fd"]
    if status_fd is not None:
        os.set_inheritable(status_fd, False)  # the command never holds it
    if not sys.platform.startswith("linux"):
        return _refuse(f"{sys.platform} is not Linux: the sandbox needs Linux namespaces", status_fd)
    arch = os.uname().machine
    if arch not in _SYSCALLS:
        return _refuse(f"no seccomp filter for the {arch} architecture (x86_64, aarch64)", status_fd)
    scratch = os.path.realpath(scratch)
    if not os.path.isdir(scratch) or scratch == "/" or any(_under(scratch, p) for p in ("/proc", "/sys", "/dev")):
        return _refuse(f"{scratch}: not a folder the command may write", status_fd)
    uid, gid = os.getuid(), os.getgid()
    sockets = listening_sockets()  # the host network namespace's, before leaving it
    try:
        _set_rlimits(opts["rlimits"])
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        _check(libc().unshare(ctypes.c_int(flags)), "unshare (user, mount, pid, net, ipc, uts, cgroup namespaces)")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    except (Refused, OSError, ValueError, KeyError) as e:
        hint = ("; user namespaces are disabled or restricted here (sysctl user.max_user_namespaces, "
                "kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns)"
                if "unshare" in str(e) or "_map" in str(e) or "setgroups" in str(e) else "")
        return _refuse(f"{e}{hint}", status_fd)
    alive_r, alive_w = os.pipe()  # pid 1 sees this launcher die (pipe closed) before it sets anything up
    # Listed before the fork: pid 1 mounts its namespace's fresh /proc over the mount namespace this
    # launcher shares, where /proc/self no longer names the launcher (it is outside that PID
    # namespace), so listing it after the fork raced pid 1 (FileNotFoundError: '/proc/self/fd').
    fds = _open_fds()
    pid = os.fork()
    if pid == 0:  # pid 1 of the new namespace
        try:
            os.close(alive_w)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "parent-death signal")
            if select.select([alive_r], [], [], 0)[0]:  # closed: the launcher is gone already
                os._exit(REFUSED)
            hide = [os.path.realpath(p) for p in opts["hide"]]
            env = {**os.environ, **setup(scratch, hide, arch, opts["tmpfs_mb"], opts["unix_sockets"], sockets)}
        except (Refused, OSError) as e:
            os._exit(_refuse(str(e), status_fd))
        except BaseException as e:  # noqa: BLE001 - anything unexpected is a refusal, never a run unisolated
            os._exit(_refuse(f"{type(e).__name__}: {e}", status_fd))
        if status_fd is not None:
            os.write(status_fd, b"ok\n")
        try:
            os.execvpe(cmd[0], cmd, env)
        except OSError as e:
            print(f"{PREFIX}cannot run {cmd[0]}: {e.strerror}", file=sys.stderr, flush=True)
            os._exit(127)
    _close_fds(fds, {2, alive_w})  # the command's pipes and the status pipe are the command's alone now
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return _status(status)
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
