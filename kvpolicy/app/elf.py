"""The dynamic section of an ELF shared object: the libraries it NEEDS and where the loader looks.

What ``readelf -d`` prints for ``NEEDED``, ``SONAME``, ``RPATH`` and ``RUNPATH``, read the way the
dynamic loader reads them: the ``PT_DYNAMIC`` program header gives the entries, and the string
table's address (``DT_STRTAB``) is mapped to a file offset through the ``PT_LOAD`` segments. Pure
Python (no binutils on a GPU host is needed); 32- and 64-bit, either byte order.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PT_LOAD = 1
PT_DYNAMIC = 2
DT_NULL = 0
DT_NEEDED = 1
DT_STRTAB = 5
DT_STRSZ = 10
DT_SONAME = 14
DT_RPATH = 15
DT_RUNPATH = 29


class ElfError(ValueError):
    """The bytes are not an ELF object, or its dynamic section is malformed or cut short."""


@dataclass(frozen=True)
class DynamicSection:
    """What an ELF object asks of the dynamic loader."""

    needed: tuple[str, ...]
    """``DT_NEEDED`` names, in the file's order (the order the loader loads them)."""
    soname: str | None
    """``DT_SONAME``: the name other objects NEED this one by."""
    rpath: tuple[str, ...]
    """``DT_RPATH`` directories, unexpanded (``$ORIGIN`` kept); searched before ``LD_LIBRARY_PATH``."""
    runpath: tuple[str, ...]
    """``DT_RUNPATH`` directories, unexpanded; searched after ``LD_LIBRARY_PATH`` (and, when present,
    the loader ignores ``DT_RPATH``)."""

    def search_dirs(self, origin: str | os.PathLike[str]) -> tuple[Path, ...]:
        """The object's own search directories with ``$ORIGIN`` expanded to ``origin`` (its directory):
        ``RUNPATH`` when it has one, else ``RPATH``."""
        expanded = re.compile(r"\$(?:ORIGIN\b|\{ORIGIN\})")
        dirs = self.runpath or self.rpath
        return tuple(Path(expanded.sub(lambda _: os.fspath(origin), entry)) for entry in dirs if entry)


def cudart_majors(needed: Iterable[str]) -> frozenset[int]:
    """The CUDA runtime majors a NEEDED list asks for: ``libcudart.so.13`` → 13."""
    return frozenset(int(found.group(1)) for name in needed if (found := re.fullmatch(r"libcudart\.so\.(\d+)", name)))


def read_dynamic(data: bytes | bytearray | mmap.mmap) -> DynamicSection:
    """The dynamic section of the ELF object in ``data``; an object without one (static) has none of it."""
    if len(data) < 16 or bytes(data[:4]) != b"\x7fELF":
        raise ElfError("not an ELF file (no \\x7fELF magic)")
    elf_class, byte_order = data[4], data[5]
    if elf_class not in (1, 2) or byte_order not in (1, 2):
        raise ElfError(f"unknown ELF class {elf_class} or byte order {byte_order}")
    wide = elf_class == 2
    end = "<" if byte_order == 1 else ">"

    def unpack(fmt: str, offset: int) -> tuple[int, ...]:
        try:
            return struct.unpack_from(end + fmt, data, offset)
        except struct.error:
            raise ElfError(f"cut short: {struct.calcsize(end + fmt)} bytes wanted at offset {offset}") from None

    if wide:
        (phoff,) = unpack("Q", 32)
        phentsize, phnum = unpack("HH", 54)
        header, fields = "IIQQQQQQ", ("type", "flags", "offset", "vaddr", "paddr", "filesz", "memsz", "align")
        entry_format = "qQ"
    else:
        (phoff,) = unpack("I", 28)
        phentsize, phnum = unpack("HH", 42)
        header, fields = "IIIIIIII", ("type", "offset", "vaddr", "paddr", "filesz", "memsz", "flags", "align")
        entry_format = "iI"
    if phnum and phentsize < struct.calcsize(end + header):
        raise ElfError(f"program header entries of {phentsize} bytes are too small")
    segments = [dict(zip(fields, unpack(header, phoff + index * phentsize), strict=True)) for index in range(phnum)]
    dynamic = next((segment for segment in segments if segment["type"] == PT_DYNAMIC), None)
    if dynamic is None:
        return DynamicSection(needed=(), soname=None, rpath=(), runpath=())

    entry_size = struct.calcsize(end + entry_format)
    entries: list[tuple[int, int]] = []
    for offset in range(dynamic["offset"], dynamic["offset"] + dynamic["filesz"] - entry_size + 1, entry_size):
        tag, value = unpack(entry_format, offset)
        if tag == DT_NULL:
            break
        entries.append((tag, value))
    tags = dict(entries)  # the loader reads one STRTAB/STRSZ; last wins, as in glibc
    if DT_STRTAB not in tags:
        raise ElfError("the dynamic section has no DT_STRTAB")
    strtab = _file_offset(tags[DT_STRTAB], segments)
    strsz = tags.get(DT_STRSZ, len(data) - strtab)
    if strtab + strsz > len(data):
        raise ElfError(f"the string table ({strsz} bytes at {strtab}) runs past the end of the file")

    def string(index: int) -> str:
        if index >= strsz:
            raise ElfError(f"string index {index} is outside the string table ({strsz} bytes)")
        stop = data.find(b"\0", strtab + index, strtab + strsz)
        if stop < 0:
            raise ElfError(f"the string at index {index} has no terminating NUL")
        return bytes(data[strtab + index : stop]).decode("utf-8", "surrogateescape")

    def paths(tag: int) -> tuple[str, ...]:
        return tuple(part for tagged, value in entries if tagged == tag for part in string(value).split(":"))

    return DynamicSection(
        needed=tuple(string(value) for tag, value in entries if tag == DT_NEEDED),
        soname=string(tags[DT_SONAME]) if DT_SONAME in tags else None,
        rpath=paths(DT_RPATH),
        runpath=paths(DT_RUNPATH),
    )


def read_dynamic_file(path: str | os.PathLike[str]) -> DynamicSection:
    """:func:`read_dynamic` of the file at ``path``, mapped rather than read (only the headers and the
    string table are touched)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise ElfError("not an ELF file (empty)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return read_dynamic(mapped)


def _file_offset(address: int, segments: list[dict[str, int]]) -> int:
    for segment in segments:
        if segment["type"] == PT_LOAD and segment["vaddr"] <= address < segment["vaddr"] + segment["filesz"]:
            return address - segment["vaddr"] + segment["offset"]
    raise ElfError(f"address {address:#x} is in no loaded segment")
