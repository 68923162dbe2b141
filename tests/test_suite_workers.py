"""How the suite spreads itself over pytest-xdist workers (tests/conftest.py)."""

from tests.conftest import DEVICE_MODULES, auto_workers


def test_a_quarter_of_the_cores_at_most_eight_and_serial_below_two():
    assert auto_workers(16) == 4  # the GPU host
    assert auto_workers(2) == 0  # CI: in this process
    assert auto_workers(7) == 0
    assert auto_workers(128) == 8


def test_the_environment_wins_zero_included():
    assert auto_workers(16, "0") == 0
    assert auto_workers(2, "3") == 3
    assert auto_workers(16, "") == 4


def test_the_real_nccl_suite_shares_its_worker_with_the_doctor_probe():
    assert {"test_gpu.py", "test_cli.py"} <= set(DEVICE_MODULES)
