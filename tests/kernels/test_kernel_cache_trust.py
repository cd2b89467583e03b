"""Kernel builds load only from where no other user can have written (``native.cached_build``).

Each test plants a library (or emulator server) at exactly the name recc would reuse, in a
place another user could have written: a directory owned by another uid, a world-writable one,
one under a world-writable parent, a read-only cache whose old fallback
(``$TMPDIR/recc-kernels-<uid>``) belongs to someone else, and a foreign or world-writable file
in recc's own cache. The planted code writes a marker file when it is loaded or run; the marker
must never appear, and the kernels must still work (built into a private directory).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recc.kernels.cpu import native

NOBODY = 65534  # another user's uid (the tests run as root, so chown works)
needs_root_and_gcc = pytest.mark.skipif(
    shutil.which("gcc") is None or not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="needs gcc, Linux and root (to hand files to another uid)")

PROBE = "int probe(void) { return 1; }\n"
PLANTED = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    int fd = open("%s", O_CREAT | O_WRONLY, 0644);
    if (fd >= 0) close(fd);
}
int probe(void) { return 666; }
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """(the probe's source, the library name recc gives it, a marker path, a planted library
    with that name's constructor writing the marker). recc's private directory starts fresh."""
    monkeypatch.setattr(native, "_private", None, raising=False)  # a fresh private directory
    src = tmp_path / "src"
    src.mkdir()
    source = src / "probe.c"
    source.write_text(PROBE)
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("RECC_CACHE_DIR", str(scratch))
    _, info = native.build_and_load(source)  # learn the name recc reuses for this source
    name = Path(info["path"]).name
    marker = tmp_path / "planted-code-ran"
    evil_src = src / "planted.c"
    evil_src.write_text(PLANTED % marker)
    evil = src / "planted.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(evil), str(evil_src)], check=True)
    return source, name, marker, evil


def _plant(directory: Path, name: str, evil: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    shutil.copy(evil, target)
    return target


def _assert_private(path: str, cache: Path) -> None:
    """The library came from a directory of this user's that no one else can write."""
    parent = Path(path).parent
    assert not Path(path).is_relative_to(cache), path
    st = parent.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, (parent, oct(st.st_mode))


@needs_root_and_gcc
@pytest.mark.parametrize("how", ["foreign_owner", "world_writable", "world_writable_parent"])
def test_a_library_planted_in_an_untrusted_cache_directory_is_not_loaded(probe, tmp_path, monkeypatch, how):
    source, name, marker, evil = probe
    if how == "world_writable_parent":
        parent = tmp_path / "shared"
        parent.mkdir()
        parent.chmod(0o777)  # no sticky bit: anyone may rename the cache away and put theirs there
        cache = parent / "cache"
    else:
        cache = tmp_path / "cache"
    _plant(cache, name, evil)
    if how == "foreign_owner":
        os.chown(cache, NOBODY, NOBODY)
        os.chown(cache / name, NOBODY, NOBODY)
    elif how == "world_writable":
        cache.chmod(0o777)
    monkeypatch.setenv("RECC_CACHE_DIR", str(cache))
    lib, info = native.build_and_load(source)
    assert not marker.exists(), "the planted library was loaded"
    assert lib.probe() == 1
    assert info["compiled"] is True
    _assert_private(info["path"], cache)
    assert native.distrust_dir(cache) is not None


@needs_root_and_gcc
def test_a_read_only_cache_does_not_fall_back_to_a_shared_temp_directory(probe, tmp_path, monkeypatch):
    """The old fallback for an unwritable cache, ``$TMPDIR/recc-kernels-<uid>``, could be made
    by anyone beforehand; the fallback is a fresh ``mkdtemp`` directory."""
    source, name, marker, evil = probe
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmpdir))
    squatted = tmpdir / f"recc-kernels-{os.getuid()}"
    _plant(squatted, name, evil)
    os.chown(squatted / name, NOBODY, NOBODY)
    os.chown(squatted, NOBODY, NOBODY)
    squatted.chmod(0o777)
    cache = tmp_path / "readonly-cache"
    cache.mkdir(mode=0o700)
    # root writes through permission bits; the immutable attribute makes it read-only for root too
    if subprocess.run(["chattr", "+i", str(cache)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        monkeypatch.setenv("RECC_CACHE_DIR", str(cache))
        lib, info = native.build_and_load(source)
    finally:
        subprocess.run(["chattr", "-i", str(cache)], check=True)
    assert not marker.exists(), "the planted library was loaded"
    assert lib.probe() == 1
    _assert_private(info["path"], cache)
    assert Path(info["path"]).parent.parent == tmpdir and Path(info["path"]).parent != squatted


@needs_root_and_gcc
@pytest.mark.parametrize("how", ["foreign_owner", "world_writable", "symlink"])
def test_an_untrusted_library_in_our_own_cache_is_rebuilt_not_loaded(probe, tmp_path, monkeypatch, how):
    source, name, marker, evil = probe
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if how == "symlink":
        (cache / name).symlink_to(evil)
    else:
        target = _plant(cache, name, evil)
        if how == "foreign_owner":
            os.chown(target, NOBODY, NOBODY)
        else:
            target.chmod(0o666)
    monkeypatch.setenv("RECC_CACHE_DIR", str(cache))
    lib, info = native.build_and_load(source)
    assert not marker.exists(), "the planted library was loaded"
    assert lib.probe() == 1 and info["compiled"] is True
    assert info["path"] == str(cache / name)  # rebuilt in place: the directory is ours
    assert native.distrust_file(cache / name) is None
    lib, info = native.build_and_load(source)
    assert info["compiled"] is False  # and trusted from then on


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_cache_directory_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_private", None, raising=False)  # a fresh private directory
    old = os.umask(0o022)
    try:
        source = tmp_path / "probe.c"
        source.write_text(PROBE)
        cache = tmp_path / "made" / "here"
        monkeypatch.setenv("RECC_CACHE_DIR", str(cache))
        _, info = native.build_and_load(source)
    finally:
        os.umask(old)
    assert Path(info["path"]).parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert native.distrust_dir(cache) is None and native.distrust_file(Path(info["path"])) is None


def test_distrust_explains_itself(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert native.distrust_dir(d) is None
    d.chmod(0o770)
    assert "writable by other users (mode 770)" in native.distrust_dir(d)
    d.chmod(0o700)
    assert "not a directory" in native.distrust_dir(Path("/dev/null"))
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: others may add entries but not rename ours
    inner = sticky / "cache"
    inner.mkdir(mode=0o700)
    assert native.distrust_dir(inner) is None


@needs_root_and_gcc
def test_the_cuda_emulator_does_not_run_a_planted_server(tmp_path, monkeypatch):
    from recc.kernels.cuda import emulator
    if emulator.compiler() is None:
        pytest.skip("no C++ compiler")
    # Unsanitized -O0 builds (seconds, not half a minute): the cache's trust is what is tested.
    monkeypatch.setattr(emulator, "SANITIZE", ())
    monkeypatch.setattr(emulator, "CXXFLAGS", tuple("-O0" if f == "-O1" else f for f in emulator.CXXFLAGS))
    monkeypatch.setattr(emulator, "_executables", {})
    monkeypatch.setattr(native, "_private", None, raising=False)  # a fresh private directory
    source = tmp_path / "fill.cu"
    source.write_text('extern "C" __global__ void fill(float* y) { y[threadIdx.x] = 2.0f; }\n')
    monkeypatch.setenv("RECC_CACHE_DIR", str(tmp_path / "scratch"))
    name = emulator.build(source).name
    emulator.shutdown()
    monkeypatch.setattr(emulator, "_executables", {})

    marker = tmp_path / "planted-server-ran"
    cache = tmp_path / "cache"
    planted = cache / "cuda-emulator" / name
    planted.parent.mkdir(parents=True)
    planted.write_text(f"#!/bin/sh\ntouch {marker}\n")
    planted.chmod(0o755)
    for p in (planted, planted.parent, cache):
        os.chown(p, NOBODY, NOBODY)
    monkeypatch.setenv("RECC_CACHE_DIR", str(cache))
    y = torch.zeros(8)
    with emulator.emulated():
        emulator.launch(source, "fill", 1, 8, (y,), 0)
    emulator.shutdown()
    assert not marker.exists(), "the planted server was run"
    assert torch.equal(y, torch.full((8,), 2.0))
    assert not emulator.build(source).is_relative_to(cache)
