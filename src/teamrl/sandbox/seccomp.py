"""The seccomp filter every sandbox runs under: what graded code may not ask of the kernel.

bubblewrap takes the filter (``--seccomp FD``) and installs it just before it starts the driver;
every process of the sandbox inherits it. It is built once with libseccomp (through ``pyseccomp``).
The system calls it refuses, and why:

- **New user namespaces** (``unshare`` and ``clone`` with ``CLONE_NEWUSER`` fail with EPERM). A new
  user namespace makes its creator root inside it, with every capability over the namespaces it
  creates next (mounts, network, more users): a large kernel surface that no graded program needs.
  In user mode bubblewrap's ``--disable-userns`` forbids it already (bubblewrap 0.8 and later); in
  root mode the sandbox has no user namespace of its own (see :attr:`Bubblewrap.privileged
  <teamrl.sandbox.bubblewrap.Bubblewrap.privileged>`), so only this filter can. ``clone3``, whose
  flags live in memory a filter cannot read, fails with ENOSYS, on which the C library falls back to
  ``clone`` (threads, ``fork`` and ``subprocess`` keep working).
- **Kernel keyrings** (``add_key``, ``keyctl``, ``request_key`` fail with EPERM). Keys belong to a
  uid, not to a process: a key put in the user keyring outlives the program and its sandbox for as
  long as the kernel runs. In root mode every sandbox has a fresh uid, each with its own key quota
  (by default 200 keys and 20 000 bytes of payload, plus the kernel's memory for them), so over a
  training run the leftovers would grow without bound. The sandbox also inherits the trainer's
  session keyring and, possessing it, could read the keys in it; and ``request_key`` can make the
  kernel run ``/sbin/request-key`` as root on the host.
- **Kernel interfaces no graded program needs** (``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``io_uring_setup`` fail with EPERM): each is a large piece of kernel code reachable without
  privilege where the host's sysctls allow it, and between them the source of many local privilege
  escalations. Without ``io_uring_setup`` the other io_uring calls have no ring to act on.
- **Widening its own CPU affinity** (``sched_setaffinity`` fails with EPERM): where no cpu cgroup
  caps a sandbox's CPU share, the sandbox is pinned to its cores by affinity
  (:mod:`teamrl.sandbox.cgroups`), which any process could otherwise undo for itself.

Not listed because the kernel refuses them anyway: mounts, module loading, ``kexec``, reboot, swap
and the like need capabilities the sandbox does not have (in root mode it keeps CAP_SETUID and
CAP_SETGID only until the driver switches to an unprivileged uid), and System V IPC objects and
POSIX message queues live in the sandbox's own IPC namespace, which the kernel frees with it.
System calls of another architecture than the host's (e.g. the 32-bit ABI on x86-64) kill the
process, so none of the above can be reached by another number.
"""

from __future__ import annotations

import errno
import functools
import os

CLONE_NEWUSER = 0x10000000


class SeccompUnavailableError(RuntimeError):
    """libseccomp (or its Python binding) is missing."""


# Refused with EPERM, as where the kernel or its sysctls forbid them (see the module docstring).
DENIED = ("add_key", "keyctl", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
          "sched_setaffinity")


@functools.cache
def syscall_filter() -> bytes:
    """The filter as a BPF program bubblewrap can load.

    Raises:
        SeccompUnavailableError: ``pyseccomp`` or the ``libseccomp`` shared library is missing.
    """
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as error:  # pyseccomp raises OSError when libseccomp.so is missing
        raise SeccompUnavailableError(
            f"cannot build the sandbox's seccomp filter ({type(error).__name__}: {error}); install "
            f"libseccomp (Debian/Ubuntu: `apt-get install libseccomp2`) and `pip install pyseccomp`") from None
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    new_user = seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
    rules.add_rule(seccomp.ERRNO(errno.EPERM), "unshare", new_user)
    rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", new_user)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for name in DENIED:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    read_end, write_end = os.pipe()
    try:
        with os.fdopen(write_end, "wb") as pipe:
            rules.export_bpf(pipe)
        return _read_all(read_end)
    finally:
        os.close(read_end)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def filter_descriptor(program: bytes) -> int:
    """A fresh descriptor, positioned at the start, of an in-memory file holding ``program`` (bubblewrap
    reads the filter from a descriptor). The caller closes it."""
    fd = os.memfd_create("teamrl-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
