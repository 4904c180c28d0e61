"""The pure-Python ELF reader says what ``readelf -d`` (binutils) says: NEEDED, SONAME, RPATH, RUNPATH."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import require, unavailable

from kvpolicy.app.elf import DynamicSection, ElfError, cudart_majors, read_dynamic, read_dynamic_file


def readelf(path: Path) -> DynamicSection:
    """``readelf -d path``, parsed."""
    if shutil.which("readelf") is None:
        unavailable("readelf (binutils) is not installed")
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    entries = re.findall(r"\((NEEDED|SONAME|RPATH|RUNPATH)\)\s+[^\[]*\[(.*)\]", out)

    def paths(tag: str) -> tuple[str, ...]:
        return tuple(part for kind, value in entries if kind == tag for part in value.split(":"))

    sonames = [value for kind, value in entries if kind == "SONAME"]
    return DynamicSection(
        needed=tuple(value for kind, value in entries if kind == "NEEDED"),
        soname=sonames[0] if sonames else None,
        rpath=paths("RPATH"),
        runpath=paths("RUNPATH"),
    )


def mooncake_native_files() -> list[Path]:
    package = Path(require("mooncake").__path__[0])
    bundled = sorted(package.parent.glob("mooncake_transfer_engine*.libs/*.so*"))
    return [package / "store.so", package / "engine.so", *sorted(package.glob("lib*.so")), *bundled]


def test_the_reader_agrees_with_readelf_on_every_installed_mooncake_native_file() -> None:
    files = mooncake_native_files()
    assert len(files) >= 5
    for path in files:
        assert read_dynamic_file(path) == readelf(path), path


def test_the_reader_finds_the_libraries_mooncakes_store_module_needs() -> None:
    (store, *_) = mooncake_native_files()
    section = read_dynamic_file(store)
    assert {"libibverbs.so.1", "libnuma.so.1", "libcurl.so.4"} <= set(section.needed)
    assert section.rpath[0] == "$ORIGIN"


@pytest.mark.parametrize("tags", ["--disable-new-dtags", "--enable-new-dtags"], ids=["rpath", "runpath"])
def test_the_reader_agrees_with_readelf_on_a_library_built_here(tmp_path: Path, tags: str) -> None:
    """A library with a SONAME, several NEEDED and a two-entry RPATH (or RUNPATH), built with gcc."""
    if shutil.which("gcc") is None:
        unavailable("gcc is not installed")
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libdep.so"), str(tmp_path / "dep.c"),
                    "-Wl,-soname,libdep.so.1"], check=True, capture_output=True)
    (tmp_path / "probe.c").write_text("int dep(void);\nint probe(void) { return dep(); }\n")
    library = tmp_path / "libprobe.so.3"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(library), str(tmp_path / "probe.c"), "-Wl,-soname,libprobe.so.3",
         f"-Wl,{tags}", "-Wl,-rpath,$ORIGIN/../lib:/opt/probe", f"-L{tmp_path}", "-ldep"],
        check=True, capture_output=True,
    )
    section = read_dynamic_file(library)
    assert section == readelf(library)
    assert section.soname == "libprobe.so.3"
    assert section.needed[0] == "libdep.so.1"
    assert (section.runpath if tags == "--enable-new-dtags" else section.rpath) == ("$ORIGIN/../lib", "/opt/probe")
    assert section.search_dirs("/x/lib") == (Path("/x/lib/../lib"), Path("/opt/probe"))


def test_a_file_that_is_not_elf_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ElfError, match="not an ELF file"):
        read_dynamic(b"#!/bin/sh\necho not a library\n")
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    with pytest.raises(ElfError, match="not an ELF file"):
        read_dynamic_file(empty)


def test_a_cut_short_library_is_an_error_not_a_crash() -> None:
    (store, *_) = mooncake_native_files()
    head = store.read_bytes()[:4096]  # the headers, without the dynamic section and string table they point to
    with pytest.raises(ElfError):
        read_dynamic(head)


def test_cudart_majors_reads_the_runtime_major_from_the_needed_names() -> None:
    assert cudart_majors(["libc.so.6", "libcudart.so.13", "libcuda.so.1"]) == {13}
    assert cudart_majors(["libcudart.so.12", "libcudart_static.a"]) == {12}
    assert cudart_majors(["libnuma.so.1"]) == set()
