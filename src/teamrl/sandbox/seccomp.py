"""The seccomp filter every sandbox runs under: graded code cannot create user namespaces.

A new user namespace makes its creator root inside it, with every capability over the namespaces it
creates next (mounts, network, more users): a large kernel surface that no graded program needs. In
user mode bubblewrap's ``--disable-userns`` forbids it already (bubblewrap 0.8 and later); in root
mode the sandbox has no user namespace of its own (see :attr:`Bubblewrap.privileged
<teamrl.sandbox.bubblewrap.Bubblewrap.privileged>`), so only a seccomp filter can. The filter is
built once with libseccomp (through ``pyseccomp``) and handed to bubblewrap (``--seccomp FD``), which
installs it just before it starts the driver; every process of the sandbox inherits it.

The rules: ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` in their flags fail with EPERM;
``clone3``, whose flags live in memory a filter cannot read, fails with ENOSYS, on which the C
library falls back to ``clone`` (threads, ``fork`` and ``subprocess`` keep working). System calls of
another architecture than the host's (e.g. the 32-bit ABI on x86-64) kill the process.
"""

from __future__ import annotations

import errno
import functools
import os

CLONE_NEWUSER = 0x10000000


class SeccompUnavailableError(RuntimeError):
    """libseccomp (or its Python binding) is missing."""


@functools.cache
def no_user_namespaces_filter() -> bytes:
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
