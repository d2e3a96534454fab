"""Who may put kernels into a cache directory: modes, owners, and signed entries.

Real directories and files, real compiles. What needs root (giving a file to another user)
skips without it.
"""

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap

import anyio
import pytest
from conftest import ROOT, subprocess_env
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile
from aiocompile._cache.disk import untrusted
from aiocompile._cache.sealed import MAGIC, payload, seal, unseal

KEY = b"the fleet's cache key"
OTHER_UID = 65534  # nobody
ADD = {"signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 128}, "target": "cuda:80"}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def compile_add(sched, **changes):
    return sched.compile_triton(add_kernel, **{**ADD, **changes})


def scheduler(directory, **config):
    config = aiocompile.SchedulerConfig(workers=1, preload=(), cache_dir=str(directory), **config)
    return aiocompile.Scheduler(config=config)


def entry(directory, key):
    return directory / key[:2] / f"{key}.aiok"


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def listing(directory):
    """Every path under ``directory`` with its size and modification time."""
    return {p: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in directory.rglob("*")}


def warnings_about(caplog, text):
    return [r for r in caplog.records if r.name == "aiocompile" and r.levelno == logging.WARNING
            and text in r.getMessage()]


async def build(templates, directory, **config):
    """A directory with the add kernel compiled into it; returns the kernel."""
    async def make(source):
        async with scheduler(source, **config) as sched:
            return await compile_add(sched)

    return await templates.copy(directory, f"built with {sorted(config.items())}", make)


# -- what this process makes ------------------------------------------------------------------


async def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path):
    directory = tmp_path / "new" / "cache"
    old = os.umask(0)
    try:
        async with scheduler(directory) as sched:
            kernels = [await compile_add(sched, constexprs={"BLOCK": b}) for b in (64, 128)]
    finally:
        os.umask(old)
    assert mode(directory) == 0o700
    made = list(directory.rglob("*"))
    assert {entry(directory, k.key) for k in kernels} <= set(made)
    for path in made:  # costs.json too, when the compiles were not Triton's own cache hits
        assert mode(path) == (0o700 if path.is_dir() else 0o600), path


def test_this_user_and_root_are_the_trusted_owners():
    def status(uid, mode):
        return os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    me = os.geteuid()
    for uid in {me, 0}:
        assert untrusted(status(uid, 0o700)) is None
        assert untrusted(status(uid, 0o755)) is None  # readable by all: fine, as a shipped image is
        assert untrusted(status(uid, 0o555)) is None
        assert untrusted(status(uid, 0o775)).kind == "mode"
        assert untrusted(status(uid, 0o757)).kind == "mode"
    other = next(uid for uid in (OTHER_UID, 12345) if uid not in (me, 0))
    assert untrusted(status(other, 0o700)).kind == "owner"


# -- a directory that is not trusted ------------------------------------------------------------


async def refused(directory, caplog):
    """A server on ``directory`` with no key: it must neither read nor write there."""
    before = listing(directory)
    async with scheduler(directory) as sched:
        with anyio.fail_after(60):
            kernel = await compile_add(sched)
            other = await compile_add(sched, constexprs={"BLOCK": 512})
        stats = sched.statistics()
    assert stats.disk_access == "refused"
    assert (stats.disk_hits, stats.compiled, stats.disk_writes) == (0, 2, 0)
    assert (stats.disk_refused, stats.disk_errors) == (0, 0)
    assert listing(directory) == before  # nothing written, nothing deleted, nothing touched
    assert len(warnings_about(caplog, "refusing the cache directory")) == 1
    return kernel, other


@needs_root
async def test_a_directory_owned_by_another_user_is_refused(tmp_path, caplog, templates):
    good = await build(templates, tmp_path)
    os.chown(tmp_path, OTHER_UID, -1)
    kernel, _ = await refused(tmp_path, caplog)
    assert kernel.binary == good.binary


@pytest.mark.parametrize("directory_mode", [0o770, 0o707, 0o777])
async def test_a_directory_writable_by_group_or_others_is_refused(tmp_path, caplog, directory_mode, templates):
    await build(templates, tmp_path)
    os.chmod(tmp_path, directory_mode)
    try:
        await refused(tmp_path, caplog)
    finally:
        os.chmod(tmp_path, 0o700)


async def test_a_subdirectory_writable_by_others_is_refused(tmp_path, caplog, templates):
    good = await build(templates, tmp_path)
    os.chmod(entry(tmp_path, good.key).parent, 0o757)
    async with scheduler(tmp_path) as sched:
        with anyio.fail_after(60):
            kernel = await compile_add(sched)
        stats = sched.statistics()
    assert kernel.binary == good.binary
    assert (stats.disk_access, stats.disk_refused, stats.disk_hits, stats.compiled) == ("read-write", 1, 0, 1)
    assert len(warnings_about(caplog, "not trusted")) == 1


# -- a file that is not trusted -------------------------------------------------------------------


def make_untrusted(path, how, tmp_path):
    if how == "writable by others":
        os.chmod(path, 0o646)
    elif how == "writable by its group":
        os.chmod(path, 0o660)
    elif how == "owned by another user":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, OTHER_UID, -1)
    elif how == "a symbolic link":
        real = tmp_path / "elsewhere.aiok"
        os.replace(path, real)
        os.symlink(real, path)
    elif how == "a FIFO":
        path.unlink()
        os.mkfifo(path, 0o600)  # opened for reading, it would wait for a writer forever
    elif how == "a directory":
        path.unlink()
        (path / "inside").mkdir(parents=True)  # not empty: a rename cannot replace it
        (path / "inside" / "file").write_bytes(b"x")


@pytest.mark.parametrize("how", ["writable by others", "writable by its group", "owned by another user",
                                 "a symbolic link", "a FIFO", "a directory"])
async def test_an_entry_not_trusted_is_compiled_instead(tmp_path, caplog, how, templates):
    good = await build(templates, tmp_path)
    path = entry(tmp_path, good.key)
    make_untrusted(path, how, tmp_path)
    async with scheduler(tmp_path) as sched:
        with anyio.fail_after(60):
            kernel = await compile_add(sched)
            again = await compile_add(sched)
    stats = sched.statistics()  # after aclose(), which waited for the write
    assert kernel is again and kernel.binary == good.binary
    assert (stats.disk_refused, stats.disk_hits, stats.compiled, stats.disk_corrupt) == (1, 0, 1, 0)
    assert (stats.disk_errors, stats.disk_writes) == (0, 1)
    assert len(warnings_about(caplog, "not trusted")) == 1
    # The directory is this process's: the compile put a file of its own in that place.
    assert stat.S_ISREG(os.lstat(path).st_mode) and mode(path) == 0o600 and os.lstat(path).st_uid == os.geteuid()


# -- signed entries -----------------------------------------------------------------------------------


def planted(genuine_file):
    """What someone able to write the directory could put there: the genuine kernel with
    its binary swapped, its checksum recomputed by ``to_bytes()``."""
    genuine = aiocompile.TritonKernel.from_bytes(payload(genuine_file.read_bytes()))
    asm = dict(genuine.asm)
    asm["cubin"] = b"\x7fELF planted" + genuine.binary[12:]
    kernel = aiocompile.TritonKernel(
        name=genuine.name, key=genuine.key, target=genuine.target, asm=asm,
        metadata_json=json.dumps(genuine.metadata), compile_time=genuine.compile_time,
        arg_names=genuine.arg_names, signature=genuine.signature, constexprs=genuine.constexprs,
        triton_version=genuine.triton_version, triton_hash=genuine.triton_hash,
    )
    data = kernel.to_bytes()
    aiocompile.TritonKernel.from_bytes(data)  # its checksum is valid
    return data, asm["cubin"]


@pytest.mark.parametrize("signed", ["not signed", "signed with another key"])
async def test_a_planted_kernel_with_a_valid_checksum_is_refused_with_a_key(tmp_path, caplog, signed, templates):
    good = await build(templates, tmp_path, cache_key=KEY)
    path = entry(tmp_path, good.key)
    data, binary = planted(path)
    path.write_bytes(data if signed == "not signed" else seal(data, b"a key of the planter's own", good.key))
    os.chmod(path, 0o600)

    async with scheduler(tmp_path, cache_key=KEY) as sched:
        with anyio.fail_after(60):
            kernel = await compile_add(sched)
        stats = sched.statistics()
    assert kernel.binary == good.binary != binary
    assert (stats.disk_refused, stats.disk_hits, stats.compiled) == (1, 0, 1)
    assert len(warnings_about(caplog, "not trusted")) == 1
    # The compile replaced it with a signed file of its own, which the next start reads.
    assert aiocompile.TritonKernel.from_bytes(unseal(path.read_bytes(), KEY, good.key)).binary == good.binary
    async with scheduler(tmp_path, cache_key=KEY) as sched:
        assert (await compile_add(sched)).binary == good.binary
        assert sched.statistics().disk_hits == 1


@pytest.mark.parametrize("planted", ["with an envelope", "without one"])
@pytest.mark.parametrize("access", ["signed-only", "read-write"])
async def test_a_huge_planted_file_is_refused_unread_and_compiled_instead(tmp_path, caplog, planted, access,
                                                                          templates):
    """A 64 GiB file (sparse: it costs no disk) in a kernel's place, in a directory others
    may write (read for its signed entries only) or in this user's own: read whole, it
    would fail every request for that kernel with a MemoryError. It is not read at all."""
    good = await build(templates, tmp_path, cache_key=KEY)
    path = entry(tmp_path, good.key)
    with open(path, "wb") as f:
        # An envelope (version 1, a tag of the planter's making) before the data to verify.
        f.write(MAGIC + b"\x01" + bytes(32) if planted == "with an envelope" else b"\x7fELF")
        f.truncate(64 << 30)
    if access == "signed-only":
        os.chmod(tmp_path, 0o777)
    try:
        async with scheduler(tmp_path, cache_key=KEY) as sched:
            with anyio.fail_after(60):
                kernel = await compile_add(sched)
                again = await compile_add(sched)
            stats = sched.statistics()
    finally:
        os.chmod(tmp_path, 0o700)
    assert kernel is again and kernel.binary == good.binary
    assert (stats.disk_access, stats.disk_refused, stats.disk_errors) == (access, 1, 0)
    assert (stats.disk_hits, stats.compiled, stats.failed) == (0, 1, 0)
    assert len(warnings_about(caplog, "not trusted")) == 1
    if access == "signed-only":
        assert os.stat(path).st_size == 64 << 30  # not this process's directory: left alone
    else:
        # Replaced by the compile with a signed file of its own.
        assert aiocompile.TritonKernel.from_bytes(unseal(path.read_bytes(), KEY, good.key)).binary == good.binary


async def test_no_entry_larger_than_the_bound_is_read_or_written(tmp_path, templates):
    good = await build(templates, tmp_path, cache_key=KEY)
    size = entry(tmp_path, good.key).stat().st_size
    async with scheduler(tmp_path, cache_key=KEY, cache_dir_entry_bytes=size // 2) as sched:
        with anyio.fail_after(60):
            kernel = await compile_add(sched)
            other = await compile_add(sched, constexprs={"BLOCK": 512})
        stats = sched.statistics()
    assert kernel.binary == good.binary
    assert (stats.disk_refused, stats.disk_hits, stats.compiled, stats.disk_writes) == (1, 0, 2, 0)
    assert not entry(tmp_path, other.key).exists()
    async with scheduler(tmp_path, cache_key=KEY, cache_dir_entry_bytes=size) as sched:
        assert (await compile_add(sched)).binary == good.binary
        assert sched.statistics().disk_hits == 1


async def test_without_a_key_the_owner_of_the_directory_is_all_the_trust(tmp_path, templates):
    # What the key is for: a checksum vouches for nothing, so without a key a file that
    # this user (or root) put in the directory is loaded, whatever it holds.
    good = await build(templates, tmp_path)
    path = entry(tmp_path, good.key)
    data, binary = planted(path)
    path.write_bytes(data)
    async with scheduler(tmp_path) as sched:
        assert (await compile_add(sched)).binary == binary
        assert sched.statistics().disk_hits == 1


async def test_with_a_key_entries_written_without_it_are_refused_and_left_in_place_until_replaced(tmp_path):
    kernels = {}
    async with scheduler(tmp_path) as sched:
        for block in (64, 128):
            kernels[block] = await compile_add(sched, constexprs={"BLOCK": block})
    unsigned = entry(tmp_path, kernels[64].key).read_bytes()
    assert unsigned == kernels[64].to_bytes()
    async with scheduler(tmp_path, cache_key=KEY) as sched:
        with anyio.fail_after(60):
            again = await compile_add(sched, constexprs={"BLOCK": 64})
        stats = sched.statistics()
    assert again.binary == kernels[64].binary
    assert (stats.disk_refused, stats.disk_hits, stats.compiled) == (1, 0, 1)
    # Replaced by a signed one where it was compiled; the other one is still there, unsigned.
    resigned = unseal(entry(tmp_path, kernels[64].key).read_bytes(), KEY, kernels[64].key)
    assert resigned != unsigned and aiocompile.TritonKernel.from_bytes(resigned).binary == kernels[64].binary
    assert entry(tmp_path, kernels[128].key).read_bytes() == kernels[128].to_bytes()


async def test_signed_entries_still_load_without_a_key_in_a_trusted_directory(tmp_path, templates):
    good = await build(templates, tmp_path, cache_key=KEY)
    async with scheduler(tmp_path) as sched:
        assert (await compile_add(sched)).binary == good.binary
        assert sched.statistics().disk_hits == 1


SIGNED_PROCESS = textwrap.dedent("""
    import asyncio, json, sys
    sys.path.insert(0, sys.argv[2])
    import aiocompile
    from triton_kernels import ADD_SIGNATURE, add_kernel

    async def main():
        config = aiocompile.SchedulerConfig.from_env().with_changes(workers=1, cache_dir=sys.argv[1])
        async with aiocompile.Scheduler(config=config) as sched:
            kernels = await sched.compile_many([
                dict(kernel=add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": b}, target="cuda:80")
                for b in (64, 128, 256)])
            print(json.dumps({"keys": [k.key for k in kernels], **sched.statistics().to_dict()}))

    asyncio.run(main())
""")


async def signed_by_another_process(templates, directory):
    """``directory`` with three kernels that another process compiled into it with the
    key; returns their keys."""
    async def make(source):
        proc = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-c", SIGNED_PROCESS, str(source), str(ROOT / "tests")], capture_output=True, text=True,
            timeout=300, env=subprocess_env(AIOCOMPILE_CACHE_KEY=KEY.decode())))
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["compiled"] == 3
        return result["keys"]

    return await templates.copy(directory, "signed by another process", make)


async def read_back(directory, keys):
    async with scheduler(directory, cache_key=KEY) as sched:
        with anyio.fail_after(60):
            kernels = [await compile_add(sched, constexprs={"BLOCK": b}) for b in (64, 128, 256)]
        return [k.key for k in kernels], sched.statistics()


async def test_a_signed_entry_from_another_process_with_the_same_key_is_a_disk_hit(tmp_path, templates):
    # There AIOCOMPILE_CACHE_KEY, as text; here the same key, as bytes.
    keys = await signed_by_another_process(templates, tmp_path)
    for key in keys:
        unseal(entry(tmp_path, key).read_bytes(), KEY, key)
    read, stats = await read_back(tmp_path, keys)
    assert read == keys
    assert (stats.disk_access, stats.disk_hits, stats.compiled, stats.disk_refused) == ("read-write", 3, 0, 0)


@needs_root
async def test_with_a_key_a_directory_owned_by_another_user_is_read_for_its_signed_entries(tmp_path, templates):
    directory = tmp_path / "shared"
    keys = await signed_by_another_process(templates, directory)
    for path in [directory, *directory.rglob("*")]:
        os.chown(path, OTHER_UID, OTHER_UID)
    before = listing(directory)
    read, stats = await read_back(directory, keys)
    assert read == keys
    assert (stats.disk_access, stats.disk_hits, stats.compiled, stats.disk_refused) == ("signed-only", 3, 0, 0)
    # A kernel it does not hold is compiled and not written there: not this process's directory.
    async with scheduler(directory, cache_key=KEY) as sched:
        await compile_add(sched, constexprs={"BLOCK": 512})
        stats = sched.statistics()
    assert (stats.compiled, stats.disk_writes, stats.disk_errors) == (1, 0, 0)
    assert listing(directory) == before
    # Without the key, the same directory is refused.
    async with scheduler(directory) as sched:
        assert sched.statistics().disk_access == "refused"
