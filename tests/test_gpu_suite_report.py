"""What tests/test_gpu.py prints when the real-NCCL suite fails: the suite writes
its results in a temporary folder, so the failed checks must reach pytest's log."""

import os


def test_the_gpu_suite_test_names_every_false_check_of_its_results(tmp_path):
    """tests/test_gpu.py prints these when the GPU suite fails (its folder is temporary)."""
    from tests.test_gpu import failed_checks

    (tmp_path / "core.rank0.json").write_text(
        '{"checks": {"exact": true, "device_memory_flat_1pct": false}}')
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "reliability.json").write_text(
        '{"cases": [{"name": "x", "checks": {"bounded": false}}], "ok": false}')
    (tmp_path / "fine.json").write_text('{"checks": {"a": true}}')
    (tmp_path / "broken.json").write_text("{")
    found = {os.path.basename(p): names for p, names in failed_checks(str(tmp_path))}
    assert found == {"core.rank0.json": ["device_memory_flat_1pct"],
                     "reliability.json": ["cases/0/bounded"]}


def test_a_result_records_its_commit_from_git_or_from_an_export(tmp_path, monkeypatch):
    import subprocess

    from tests.gpu.common import run_commit

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode == 0:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        assert run_commit(root) == head
        monkeypatch.setenv("AMEM_COMMIT", "f00d")  # the caller's word beats a stale .git
        assert run_commit(root) == "f00d"
    export = tmp_path / "export"  # git archive: no .git
    export.mkdir()
    monkeypatch.delenv("AMEM_COMMIT", raising=False)
    assert run_commit(str(export)) is None
    (export / "COMMIT").write_text("abc123\n")
    assert run_commit(str(export)) == "abc123"
    monkeypatch.setenv("AMEM_COMMIT", "def456")
    assert run_commit(str(export)) == "def456"
    monkeypatch.delenv("AMEM_COMMIT")
    outer = tmp_path / "outer"  # an export inside another checkout: not that checkout's HEAD
    (outer / "export").mkdir(parents=True)
    (outer / "export" / "COMMIT").write_text("abc123\n")
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.email=a@b", "-c", "user.name=a",
                    "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    assert run_commit(str(outer / "export")) == "abc123"


def test_a_bare_tree_stops_the_gpu_scripts_with_the_install_command(tmp_path):
    """No link, no splice: without the install, one line says what to run."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import sys\n"
              "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
              f"sys.path.insert(0, {root!r})\n"
              "from tests.gpu.common import require_installed_package\n"
              "require_installed_package()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=str(tmp_path))
    assert out.returncode == 1
    assert "pip install --no-deps --no-build-isolation -e ." in out.stderr, out.stderr


def test_the_installed_package_passes(tmp_path):
    from tests.gpu.common import require_installed_package

    require_installed_package()  # CI installs the package: this must not stop


def test_a_gpu_script_builds_its_groups_on_the_torch_backend_it_is_told(monkeypatch):
    # torch 2.15's names: run_all's env records AMEM_GPU_PG_BACKEND beside the results
    from tests.gpu import common

    monkeypatch.setattr(common, "ON_CPU", False)
    monkeypatch.delenv(common.PG_BACKEND_ENV, raising=False)
    assert common.process_group_backend("nccl") == "nccl"
    monkeypatch.setenv(common.PG_BACKEND_ENV, "nccl-lazy")
    assert common.process_group_backend("nccl") == "nccl-lazy"
    assert common.process_group_backend("gloo") == "gloo"  # only "nccl" is swapped
    monkeypatch.setattr(common, "ON_CPU", True)
    assert common.process_group_backend("nccl") == "gloo"
