"""tests/gpu/vllm_bundle.py on small fake files: the parts a device call carries, their
manifest, receiving them on the GPU machine (checked, from one bundle only),
re-assembling and installing them, the environment the runs get, and the audit of
vLLM's requirements against what travels. The GPU machine runs exactly these
functions on the real 1.2 GB bundle."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.gpu import vllm_bundle as vb  # noqa: E402


def write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def fake_bundle(tmp_path) -> dict:
    """Four files whose bytes differ everywhere: one spans three parts of 1000 bytes,
    one is empty, one shares a part with its neighbours."""
    src = tmp_path / "src"
    files = {"a.whl": bytes(range(256)) * 3, "b.bin": b"", "c.whl": os.urandom(2500),
             "d.so.2.xz": os.urandom(10)}
    for name, data in files.items():
        write(str(src / name), data)
    return files


def test_split_lays_files_end_to_end_in_parts_of_the_given_size(tmp_path):
    files = fake_bundle(tmp_path)
    manifest = vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 1000, notes={"x": 1})
    total = sum(len(d) for d in files.values())
    assert manifest["total_bytes"] == total and manifest["x"] == 1
    assert [p["size"] for p in manifest["parts"]] == [1000, 1000, 1000, total - 3000]
    rows = {r["file"]: r for r in manifest["files"]}
    assert [r["file"] for r in manifest["files"]] == sorted(files)  # stream order: by name
    assert rows["a.whl"]["offset"] == 0 and rows["a.whl"]["parts"] == [0]
    assert rows["b.bin"]["parts"] == [0]  # empty: in the part where it would start
    assert rows["c.whl"]["offset"] == 768 and rows["c.whl"]["parts"] == [0, 1, 2, 3]
    stream = b"".join(files[name] for name in sorted(files))
    for part in manifest["parts"]:  # one folder per part, each with the manifest
        folder = tmp_path / "out" / part["part"]
        data = (folder / f"{part['part']}.bin").read_bytes()
        index = int(part["part"].split("-")[1])
        assert data == stream[index * 1000:(index + 1) * 1000]
        assert part["sha256"] == hashlib.sha256(data).hexdigest()
        assert json.loads((folder / vb.MANIFEST).read_text()) == manifest
    for name, data in files.items():
        assert rows[name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert rows[name]["size"] == len(data)


def test_a_new_split_replaces_the_old_parts(tmp_path):
    fake_bundle(tmp_path)
    vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 500)
    (tmp_path / "out" / "keep.txt").write_text("not ours")
    manifest = vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 2000)
    parts = sorted(p for p in os.listdir(tmp_path / "out") if p.startswith("part-"))
    assert parts == [p["part"] for p in manifest["parts"]] == ["part-00", "part-01"]
    assert (tmp_path / "out" / "keep.txt").exists()


def test_received_parts_assemble_into_the_same_files(tmp_path):
    files = fake_bundle(tmp_path)
    manifest = vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 1000)
    store = str(tmp_path / "store")
    names = [p["part"] for p in manifest["parts"]]
    for i, name in enumerate(reversed(names)):  # any order
        have, missing = vb.receive(str(tmp_path / "out" / name), store)
        assert len(have) == i + 1 and len(missing) == len(names) - i - 1
    paths = vb.assemble(store, str(tmp_path / "files"))
    assert {os.path.basename(p): open(p, "rb").read() for p in paths} == files


def test_assemble_names_the_parts_still_missing(tmp_path):
    fake_bundle(tmp_path)
    vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 1000)
    store = str(tmp_path / "store")
    vb.receive(str(tmp_path / "out" / "part-01"), store)
    with pytest.raises(SystemExit, match="3 of 4 parts .*part-00, part-02, part-03"):
        vb.assemble(store, str(tmp_path / "files"))


def test_receive_refuses_a_damaged_part_and_parts_of_another_bundle(tmp_path):
    fake_bundle(tmp_path)
    vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 1000)
    part = tmp_path / "out" / "part-02" / "part-02.bin"
    good = part.read_bytes()
    part.write_bytes(b"\0" + good[1:])
    store = str(tmp_path / "store")
    with pytest.raises(SystemExit, match="not the bytes the manifest names"):
        vb.receive(str(tmp_path / "out" / "part-02"), store)
    part.write_bytes(good)
    vb.receive(str(tmp_path / "out" / "part-02"), store)
    (tmp_path / "src" / "c.whl").write_bytes(os.urandom(2500))  # another bundle
    vb.split(str(tmp_path / "src"), str(tmp_path / "other"), 1000)
    with pytest.raises(SystemExit, match="holds parts of bundle"):
        vb.receive(str(tmp_path / "other" / "part-00"), store)


def test_assemble_refuses_a_file_whose_bytes_changed_after_the_split(tmp_path):
    fake_bundle(tmp_path)
    vb.split(str(tmp_path / "src"), str(tmp_path / "out"), 1000)
    store = str(tmp_path / "store")
    for i in range(4):
        vb.receive(str(tmp_path / "out" / f"part-0{i}"), store)
    stored = os.path.join(store, "part-01.bin")
    data = bytearray(open(stored, "rb").read())
    data[10] ^= 0xFF  # same size: only the file hash can tell
    write(stored, bytes(data))
    with pytest.raises(SystemExit, match="c.whl: sha256 differs"):
        vb.assemble(store, str(tmp_path / "files"))


def test_part_size_leaves_room_for_the_tree_that_travels_with_every_call():
    assert vb.part_bytes_for(0) == vb.PART_CAP == 62 * 10**6
    tree = 10 * 10**6  # this repository's tree is about this size
    assert vb.part_bytes_for(tree) == vb.CALL_LIMIT - tree - vb.MARGIN
    assert vb.part_bytes_for(tree) + tree <= 64 * 2**20
    with pytest.raises(ValueError, match="leaves no room"):
        vb.part_bytes_for(64 * 2**20)


def test_tree_bytes_counts_tracked_and_untracked_files_but_not_ignored_ones(tmp_path):
    repo = str(tmp_path)
    subprocess.run(["git", "init", "-q", repo], check=True)
    write(os.path.join(repo, ".gitignore"), b"/.gpu/\n")
    write(os.path.join(repo, "tracked.py"), b"x" * 100)
    write(os.path.join(repo, "new.txt"), b"y" * 30)
    write(os.path.join(repo, ".gpu", "part.bin"), b"z" * 5000)
    subprocess.run(["git", "-C", repo, "add", "tracked.py", ".gitignore"], check=True)
    assert vb.tree_bytes(repo) == 100 + 30 + len("/.gpu/\n")
    write(os.path.join(repo, "shared", "notes.md"), b"w" * 7)  # travels even if ignored
    write(os.path.join(repo, ".gitignore"), b"/.gpu/\n/shared/\n")
    assert vb.tree_bytes(repo) == 100 + 30 + len("/.gpu/\n/shared/\n") + 7


def test_tree_bytes_of_an_exported_copy_counts_every_file_once(tmp_path):
    """No .git (a git archive export, as a GPU call may carry): nothing is ignored."""
    root = str(tmp_path / "export")
    write(os.path.join(root, "a.py"), b"x" * 100)
    write(os.path.join(root, ".gpu", "part.bin"), b"z" * 50)
    write(os.path.join(root, "shared", "notes.md"), b"w" * 7)
    assert vb.tree_bytes(root) == 157


def fake_wheel(folder: str, name: str, version: str, requires=()) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    info = f"{name}-{version}.dist-info"
    meta = "\n".join([f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"WHO = {name!r}\n")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n"
                                     f"{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_install_puts_the_wheels_in_the_site_and_unpacks_nccl(tmp_path):
    src = str(tmp_path / "src")
    os.makedirs(src)
    fake_wheel(src, "amemfakeone", "1.0")
    fake_wheel(src, "amemfaketwo", "2.0")
    library = os.urandom(3000)
    with lzma.open(os.path.join(src, "libnccl.so.2.xz"), "wb") as f:
        f.write(library)
    manifest = vb.split(src, str(tmp_path / "out"), 700)
    store, site, nccl = (str(tmp_path / n) for n in ("store", "site", "nccl"))
    for part in manifest["parts"]:
        vb.receive(str(tmp_path / "out" / part["part"]), store)
    done = vb.install(store, site, nccl, package=None)
    assert done["installed"] and sorted(done["wheels"]) == [
        "amemfakeone-1.0-py3-none-any.whl", "amemfaketwo-2.0-py3-none-any.whl"]
    assert open(os.path.join(nccl, "libnccl.so.2"), "rb").read() == library
    assert not os.listdir(os.path.join(store, "files"))  # the assembled copies are gone
    found = subprocess.run([sys.executable, "-c", "import amemfakeone, amemfaketwo;"
                            "print(amemfakeone.__file__)"], env=dict(os.environ, PYTHONPATH=site),
                           capture_output=True, text=True, check=True).stdout
    assert found.startswith(site)
    assert vb.install(store, site, nccl, package=None) == {"installed": False, "why": "already installed",
                                             "site": site}


def test_packed_wheels_are_smaller_unpack_to_the_same_members_and_install(tmp_path):
    src, packed = str(tmp_path / "src"), str(tmp_path / "packed")
    os.makedirs(src)
    wheel = fake_wheel(src, "amempacked", "1.0")
    with zipfile.ZipFile(wheel, "a", zipfile.ZIP_DEFLATED) as z:  # compressible, like .so files
        z.writestr("amempacked/table.bin", b"\x00\x01" * 50_000)
    with lzma.open(os.path.join(src, "libnccl.so.2.xz"), "wb") as f:
        f.write(b"nccl")
    rows = vb.pack(src, packed)
    assert [r[0] for r in rows] == ["amempacked-1.0-py3-none-any.whl"]
    assert sorted(os.listdir(packed)) == ["amempacked-1.0-py3-none-any" + vb.PACKED,
                                          "libnccl.so.2.xz",  # the library copied as it is
                                          vb.PACKED_FROM]
    manifest = vb.split(packed, str(tmp_path / "out"), 900)
    store, site, nccl = (str(tmp_path / n) for n in ("store", "site", "nccl"))
    for part in manifest["parts"]:
        vb.receive(str(tmp_path / "out" / part["part"]), store)
    done = vb.install(store, site, nccl, package=None)
    assert done["wheels"] == ["amempacked-1.0-py3-none-any.whl"]
    assert open(os.path.join(nccl, "libnccl.so.2"), "rb").read() == b"nccl"
    with zipfile.ZipFile(wheel) as a:
        members = {i.filename: a.read(i) for i in a.infolist()}
    assert os.path.getsize(os.path.join(packed, "amempacked-1.0-py3-none-any" + vb.PACKED)) \
        < os.path.getsize(wheel)
    for name, data in members.items():  # installed from the unpacked wheel, byte for byte
        if name.startswith("amempacked/"):
            assert open(os.path.join(site, name), "rb").read() == data


def test_environment_puts_the_bundle_first_and_preloads_nccl_once_unpacked(tmp_path):
    site, nccl = str(tmp_path / "site"), str(tmp_path / "nccl")
    base = {"PYTHONPATH": "/image/extra", "NCCL_NVLS_ENABLE": "0", "LD_PRELOAD": "/x.so"}
    env = vb.environment(base, site=site, nccl_dir=nccl, root="/repo")
    assert env["PYTHONPATH"] == os.pathsep.join([site, "/repo", "/image/extra"])
    assert env["LD_PRELOAD"] == "/x.so"  # nothing unpacked yet: nothing preloaded
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    assert env["PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK"] == "1"
    write(os.path.join(nccl, "libnccl.so.2"), b"\x7fELF")
    env = vb.environment(base, site=site, nccl_dir=nccl, root="/repo")
    assert env["LD_PRELOAD"] == f"{nccl}/libnccl.so.2 /x.so"
    again = vb.environment(env, site=site, nccl_dir=nccl, root="/repo")
    assert again["LD_PRELOAD"].count("libnccl.so.2") == 1
    assert base == {"PYTHONPATH": "/image/extra", "NCCL_NVLS_ENABLE": "0", "LD_PRELOAD": "/x.so"}


def test_audit_names_the_requirements_no_list_accounts_for(tmp_path):
    known = ["torch==2.13.0", "flashinfer-python==0.7.0.post1", "regex",
             "typing_extensions>=4.10", "Pillow>=13.0.0", "llguidance<1.8.0,>=1.7.0; "
             "platform_machine == \"x86_64\"", "tensorizer==2.10.1; extra == \"tensorizer\""]
    wheel = fake_wheel(str(tmp_path), "vllm", "0.31.0", known)
    assert vb.audit(wheel) == []
    wheel = fake_wheel(str(tmp_path / "new"), "vllm", "0.31.0",
                       known + ["brand_new.kernels>=1", "another (>=2)"])
    assert vb.audit(wheel) == ["another", "brand-new-kernels"]


def test_what_travels_is_pinned_once_and_no_list_contradicts_another():
    pins = vb.pins()
    names = [vb.canonical(p.split("==")[0]) for p in pins]
    assert len(names) == len(set(names)) == len(vb.CARRIED)
    assert all(p.count("==") == 1 and p.split("==")[1] for p in pins)
    carried, skipped = set(names), {vb.canonical(n) for n in vb.NOT_CARRIED}
    image = {vb.canonical(n) for n in vb.IN_IMAGE}
    assert not carried & skipped and not carried & image and not skipped & image
    assert {"vllm", "torch", "triton", "torchvision", "trl", "datasets"} <= carried
    # the versions trl 1.16 supports: its vllm extra pins vllm<=0.31.0, which pins torch 2.13.0
    assert dict(p.split("==") for p in pins)["vllm"] == "0.31.0"
    assert dict(p.split("==") for p in pins)["torch"] == vb.carried("torch") == "2.13.0"


def test_unmet_requirements_says_which_may_stay_unmet(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "amemfakevllm-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: amemfakevllm\nVersion: 1.0\n"
        "Requires-Dist: amem-no-such-package>=1\nRequires-Dist: flashinfer-python==0.7.2\n"
        "Requires-Dist: packaging\nRequires-Dist: pytest>=99999\n"
        "Requires-Dist: nvidia-nccl-cu13==1.0\n"
        "Requires-Dist: amem-only-with-extra; extra == \"x\"\n")
    monkeypatch.syspath_prepend(str(site))
    rows = {row[1]: row for row in vb.unmet_requirements(["amemfakevllm", "amem-not-installed"])}
    assert rows["amem-no-such-package>=1"][2:] == (None, None)
    assert rows["flashinfer-python==0.7.2"][3] == vb.NOT_CARRIED["flashinfer-python"]
    assert rows["pytest>=99999"][2] is not None  # installed, too old: named with its version
    # another version on purpose (NCCL preloaded): named with the reason, so check passes
    assert rows["nvidia-nccl-cu13==1.0"][3] == vb.OTHER_VERSION_OK["nvidia-nccl-cu13"]
    monkeypatch.setitem(vb.NOT_CARRIED, "amem-absent-optional", "not on the colocate path")
    assert vb.unmet_requirements(["amem-absent-optional"]) == [  # a NOT_CARRIED dist, absent
        ("amem-absent-optional", "amem-absent-optional", None, "not on the colocate path")]
    assert rows["amem-not-installed"] == ("amem-not-installed", "amem-not-installed", None, None)
    assert not any("packaging" in key or "extra" in key for key in rows)


def test_check_runs_its_script_and_fails_on_an_import_that_fails(tmp_path):
    """The script the GPU machine runs after the install, here with two modules: its
    JSON comes back and a failed import makes it not ok."""
    result = vb.check(site=str(tmp_path / "empty-site"),
                      modules=("json", "amem_no_such_module"), timeout_s=240)
    assert result["imports"]["json"]["ok"]
    assert result["imports"]["amem_no_such_module"]["error"].startswith("ModuleNotFoundError")
    assert not result["ok"]
    assert result["versions"]["torch"] and "unmet" in result


def test_the_command_line_splits_receives_installs_and_prints_the_environment(tmp_path, capsys):
    src = str(tmp_path / "src")
    os.makedirs(src)
    fake_wheel(src, "amemfakecli", "1.0")
    assert vb.main(["split", src, str(tmp_path / "out"), "--part-bytes", "400"]) == 0
    printed = capsys.readouterr().out
    manifest = json.load(open(tmp_path / "out" / vb.MANIFEST))
    assert f"{len(manifest['parts'])} parts of at most 0.0 MB" in printed
    store = str(tmp_path / "store")
    for part in manifest["parts"]:
        assert vb.main(["receive", str(tmp_path / "out" / part["part"]), "--store", store]) == 0
    assert "all here" in capsys.readouterr().out.splitlines()[-1]
    assert vb.main(["install", "--store", store, "--site", str(tmp_path / "site"),
                    "--no-package"]) == 0
    assert json.loads(capsys.readouterr().out)["wheels"] == ["amemfakecli-1.0-py3-none-any.whl"]
    assert vb.main(["env"]) == 0
    exports = capsys.readouterr().out
    assert f"export PYTHONPATH={vb.SITE}{os.pathsep}{vb.ROOT}" in exports
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" in exports


def test_install_package_installs_the_repository_editable_in_the_given_python(tmp_path):
    # the GPU scripts import amem_callbacks.adapters, which exists only as installed
    record = tmp_path / "argv"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\n")
    python.chmod(0o755)
    vb.install_package(str(python), "/some/checkout")
    assert record.read_text().split() == ["-m", "pip", "install", "-q", "--no-deps",
                                          "--no-build-isolation", "--no-index", "-e",
                                          "/some/checkout"]
    record.unlink()
    vb.install_package(str(python), None)
    assert not record.exists()


def test_the_environment_turns_off_the_flashinfer_sampler_that_does_not_travel():
    assert not any(p.startswith("flashinfer") for p in vb.CARRIED)
    assert vb.environment(base={})["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert vb.environment(base={"VLLM_USE_FLASHINFER_SAMPLER": "1"})[
        "VLLM_USE_FLASHINFER_SAMPLER"] == "1"  # a user's own choice stands


def test_pack_keeps_what_it_packed_from_the_same_bytes_and_drops_orphans(tmp_path):
    src, packed = str(tmp_path / "src"), str(tmp_path / "packed")
    os.makedirs(src)
    fake_wheel(src, "amemkeepone", "1.0")
    assert [r[0] for r in vb.pack(src, packed)] == ["amemkeepone-1.0-py3-none-any.whl"]
    assert vb.pack(src, packed) == []  # nothing new: nothing xz'd again
    two = fake_wheel(src, "amemkeeptwo", "1.0")
    assert [r[0] for r in vb.pack(src, packed)] == ["amemkeeptwo-1.0-py3-none-any.whl"]
    with zipfile.ZipFile(two, "a") as z:  # the same name, other bytes: packed again
        z.writestr("amemkeeptwo/more.txt", "x")
    assert [r[0] for r in vb.pack(src, packed)] == ["amemkeeptwo-1.0-py3-none-any.whl"]
    os.remove(two)
    vb.pack(src, packed)
    assert sorted(os.listdir(packed)) == ["amemkeepone-1.0-py3-none-any" + vb.PACKED,
                                          vb.PACKED_FROM]
    manifest = vb.split(packed, str(tmp_path / "out"), 10_000)  # the record does not travel
    assert [f["file"] for f in manifest["files"]] == ["amemkeepone-1.0-py3-none-any" + vb.PACKED]


def test_another_bundle_splits_without_vllms_pins_and_gets_its_own_site(tmp_path, capsys):
    # tests/gpu/bundle_torch.sh: the same parts and install, for torch 2.15's wheels
    src = str(tmp_path / "src")
    os.makedirs(src)
    fake_wheel(src, "amemfaketorch", "2.15")
    assert vb.main(["split", src, str(tmp_path / "out"), "--part-bytes", "400", "--no-pins"]) == 0
    assert "pins" not in json.load(open(tmp_path / "out" / vb.MANIFEST))
    capsys.readouterr()
    assert vb.main(["env", "--site", "/tmp/site-torch2150"]) == 0
    assert f"export PYTHONPATH=/tmp/site-torch2150{os.pathsep}{vb.ROOT}" in capsys.readouterr().out


def test_a_slimmed_wheel_keeps_only_the_named_members_and_installs(tmp_path):
    from tests.gpu import slim_wheel

    src = str(tmp_path / "src")
    os.makedirs(src)
    wheel = fake_wheel(src, "amemslim", "3.7")
    with zipfile.ZipFile(wheel, "a") as z:  # the library torch loads, and what it never does
        z.writestr("amemslim/lib/libhost.so.3", b"\x7fELF host")
        z.writestr("amemslim/include/big.h", b"x" * 10_000)
    dest = str(tmp_path / "slim" / "amemslim-3.7-py3-none-any.whl")
    os.makedirs(os.path.dirname(dest))
    kept = slim_wheel.slim(wheel, dest, ["amemslim/lib/*.so*"])
    assert "amemslim/lib/libhost.so.3" in kept and "amemslim/include/big.h" not in kept
    with zipfile.ZipFile(dest) as z:
        record = z.read(next(n for n in z.namelist() if n.endswith("RECORD"))).decode()
    assert "amemslim/lib/libhost.so.3,sha256=" in record and "big.h" not in record
    site = str(tmp_path / "site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", site, dest], check=True)
    assert open(os.path.join(site, "amemslim", "lib", "libhost.so.3"), "rb").read() == \
        b"\x7fELF host"
    assert not os.path.exists(os.path.join(site, "amemslim", "include"))
    with pytest.raises(SystemExit, match="nothing matches"):
        slim_wheel.slim(wheel, dest, ["nowhere/*"])


def test_the_device_calls_carry_each_part_and_chain_the_install_to_the_last(tmp_path, capsys):
    src = str(tmp_path / "src")
    os.makedirs(src)
    fake_wheel(src, "amemcalls", "1.0")
    dest = str(tmp_path / "out")
    manifest = vb.split(src, dest, 300)
    assert len(manifest["parts"]) >= 2
    lines = vb.device_calls(dest, "/tmp/x-parts", "/tmp/site-x")
    assert len(lines) == len(manifest["parts"])
    assert lines[0] == (f"carry [{dest}/part-00]: python3 tests/gpu/vllm_bundle.py receive "
                        f"{dest}/part-00 --store /tmp/x-parts")
    assert lines[-1].endswith(" && python3 tests/gpu/vllm_bundle.py install --store "
                              "/tmp/x-parts --site /tmp/site-x")
    assert vb.main(["commands", dest, "--check"]) == 0  # the vLLM bundle's own places
    printed = capsys.readouterr().out.splitlines()
    assert "--store" not in printed[-1] and printed[-1].endswith(
        " && python3 tests/gpu/vllm_bundle.py install && python3 tests/gpu/vllm_bundle.py check")
