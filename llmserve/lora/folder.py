"""An adapter folder opened once, its files opened relative to it, and the allowed roots checked
on what was opened (not on a name that may point elsewhere by the time it is read).

With `roots`, the folder must be given by its resolved path (symlinks and '..' resolved, as the
server's check saw it), what the open reached must be that very folder, inside a root, and each
file opened in it must lie inside a root too (a Hugging Face cache's files are links to its
blobs, in the same root). A symlink swapped in after the check makes the open reach another
folder, and the load is refused. Every failure is the one unusable-path error.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from llmserve.lora.errors import unusable_path


def inside_roots(real: str, roots: Sequence[str]) -> bool:
    """Whether the resolved path `real` is one of the resolved `roots` or inside one."""
    return any(os.path.commonpath([real, root]) == root for root in roots)


def opened_path(fd: int) -> str:
    """Where an open file or folder is now, by the kernel's account (Linux's /proc)."""
    return os.readlink(f"/proc/self/fd/{fd}")


class AdapterFolder:
    def __init__(self, path: str, roots: Sequence[str] = ()) -> None:
        self.path = path
        self.roots = tuple(roots)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise unusable_path(f"{path!r} cannot be opened as a folder: {exc.strerror}") from None
        if self.roots:
            real = opened_path(self.fd)
            if real != os.path.normpath(path) or not inside_roots(real, self.roots):
                self.close()
                raise unusable_path(f"{path!r} led to {real!r}: not that folder, or outside --lora-roots")

    def __enter__(self) -> AdapterFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def open_file(self, name: str) -> int | None:
        """A regular file of the folder, open for reading (the caller closes it); None if absent."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise unusable_path(f"{name} in {self.path!r} cannot be opened: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode) or (self.roots and not inside_roots(opened_path(fd), self.roots)):
            os.close(fd)
            raise unusable_path(f"{name} in {self.path!r} is not a regular file inside --lora-roots")
        return fd

    def has(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd)
            return True
        except OSError:
            return False

    @staticmethod
    def read_bytes(fd: int) -> bytes:
        """The whole file `fd` (left open)."""
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def fd_path(fd: int) -> str:
        """A name that opens the same file as `fd` (for readers that take a path)."""
        return f"/proc/self/fd/{fd}"
