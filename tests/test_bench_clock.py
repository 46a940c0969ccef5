"""The SM clock sampler (``bench.clock``): nvidia-smi's output read, bus ids spelled the way NVML
wants them, and the subprocess path run against a stand-in ``nvidia-smi``."""

import os
import stat
import time

import pytest

from megamoe_cli.bench import clock
from megamoe_cli.errors import MegaMoEError


def test_parse_smi_clocks():
    assert clock.parse_smi_clocks("1980\n[N/A]\n1755 MHz\n\n0\n") == [1980.0, 1755.0]
    assert clock.parse_smi_clocks("") == []


def test_bus_id():
    assert clock.bus_id("0000:19:00.0") == "00000000:19:00.0"
    assert clock.bus_id("00000000:9a:00.0") == "00000000:9A:00.0"
    assert clock.bus_id("3") == "3"


def _fake_smi(folder, readings):
    path = folder / "nvidia-smi"
    lines = "".join(f"echo {r}; sleep 0.01; " for r in readings)
    path.write_text(f"#!/bin/sh\n{lines}\nexec sleep 30\n")  # exec: terminating it ends the sleep too
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder


@pytest.fixture
def no_nvml(monkeypatch):
    import builtins

    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("no pynvml in this test")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)


def test_samples_from_nvidia_smi(tmp_path, monkeypatch, no_nvml):
    monkeypatch.setenv("PATH", str(_fake_smi(tmp_path, [1500, 1600, 1400])) + os.pathsep + os.environ["PATH"])
    with clock.ClockSampler("0", period_ms=10) as sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sampler.source == "nvidia-smi"
    assert sampler.samples == [1500.0, 1600.0, 1400.0]
    assert sampler.median_mhz == 1500.0


def test_no_source(tmp_path, monkeypatch, no_nvml):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "needs pynvml or nvidia-smi" in clock.ClockSampler.unavailable()
    with pytest.raises(MegaMoEError, match="needs pynvml or nvidia-smi"):
        with clock.ClockSampler("0"):
            pass


def test_no_reading_is_an_error():
    with pytest.raises(MegaMoEError, match="no SM clock reading"):
        clock.ClockSampler("0").median_mhz
