"""`python -m miniddp.bench soak`: a few seconds of a tiny model beside a CPU hog, and what its
report says. No timing is asserted; the false alarms and the bits are exact, so they are."""

from __future__ import annotations

import sys

import pytest

from tests.harness.processes import child_env, run_in_own_session


@pytest.mark.slow  # 15 s; tests/test_real_scale.py checks no false alarm beside a hog
def test_a_short_soak_reports_no_false_alarm_and_torchs_bits(tmp_path):
    command = [sys.executable, "-m", "miniddp.bench", "soak", "--minutes", "0.05", "--hogs", "1"]
    command += ["--width", "64", "--depth", "2", "--check-every", "3"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 0, output[-3000:]
    assert "false alarms: 0 (must be 0)" in output, output[-3000:]
    assert "bitwise torch's DDP: yes" in output, output[-3000:]
    assert output.count("resident memory") == 2, output[-3000:]


def test_a_soak_of_zero_minutes_is_refused_before_it_starts(tmp_path):
    command = [sys.executable, "-m", "miniddp.bench", "soak", "--minutes", "0"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=60)
    assert returncode != 0 and "must be > 0, got 0" in output, output[-3000:]
