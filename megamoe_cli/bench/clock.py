"""The GPU's SM clock sampled in the background while something runs, so that a time can be
turned into cycles (``time_us * clock_mhz``) at the clock the GPU actually ran, not its boost
figure: prefill-sized calls run hot and the clock drifts down over a run.

Two sources, the first that works: NVML (``pynvml``, read in a thread) or ``nvidia-smi
--query-gpu=clocks.sm -lms N`` in a subprocess.  Either way the samples are MHz readings taken
every ``period_ms`` while the ``with`` block runs; ``median_mhz`` is what a caller converts with.

Imports: ``errors``; ``pynvml`` inside ``ClockSampler`` when it is installed.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from typing import List, Optional

from ..errors import MegaMoEError

DEFAULT_PERIOD_MS = 50


def parse_smi_clocks(text: str) -> List[float]:
    """MHz readings from ``nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits``
    output (one number a line; lines that are not a number, e.g. ``[N/A]``, are skipped)."""
    readings = []
    for line in text.splitlines():
        word = line.strip().split(" ")[0] if line.strip() else ""
        try:
            value = float(word)
        except ValueError:
            continue
        if value > 0:
            readings.append(value)
    return readings


def bus_id(pci_bus_id: str) -> str:
    """A PCI bus id as NVML and nvidia-smi spell it, its domain eight hex digits
    (torch's ``0000:19:00.0`` is their ``00000000:19:00.0``)."""
    domain, _, rest = pci_bus_id.strip().partition(":")
    if not rest:
        return pci_bus_id.strip()
    return f"{domain.upper():0>8}:{rest.upper()}"


class ClockSampler:
    """``with ClockSampler(device_id) as clock: ...`` then ``clock.median_mhz``.

    ``device_id``: what NVML and nvidia-smi name the GPU by, its PCI bus id
    (``torch.cuda.get_device_properties(i).pci_bus_id``) or its index."""

    def __init__(self, device_id: str = "0", period_ms: int = DEFAULT_PERIOD_MS):
        self.device_id = str(device_id)
        self.period_ms = int(period_ms)
        self.samples: List[float] = []
        self.source = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._proc: Optional[subprocess.Popen] = None

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why no clock can be sampled here (None: one can)."""
        try:
            import pynvml  # noqa: F401

            return None
        except ImportError:
            pass
        if shutil.which("nvidia-smi") is None:
            return "sampling the SM clock needs pynvml or nvidia-smi, and neither is here"
        return None

    def __enter__(self) -> "ClockSampler":
        self.samples = []
        self._stop.clear()
        try:
            import pynvml

            pynvml.nvmlInit()
            if ":" in self.device_id:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(self.device_id)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(self.device_id))
            self.source = "nvml"
            self._thread = threading.Thread(target=self._nvml_loop, args=(pynvml, handle), daemon=True)
            self._thread.start()
            return self
        except ImportError:
            pass
        if shutil.which("nvidia-smi") is None:
            raise MegaMoEError(self.unavailable() or "no clock source")
        self.source = "nvidia-smi"
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", self.device_id, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
             "-lms", str(self.period_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._smi_loop, daemon=True)
        self._thread.start()
        # nvidia-smi's first reading comes after its start-up; a region shorter than that would
        # have none, so wait for one.
        deadline = time.monotonic() + 5.0
        while not self.samples and time.monotonic() < deadline and self._proc.poll() is None:
            time.sleep(0.01)
        return self

    def _nvml_loop(self, pynvml, handle) -> None:
        while not self._stop.is_set():
            self.samples.append(float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)))
            self._stop.wait(self.period_ms / 1000.0)

    def _smi_loop(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.samples.extend(parse_smi_clocks(line))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def median_mhz(self) -> float:
        if not self.samples:
            raise MegaMoEError(f"no SM clock reading came from {self.source or 'the sampler'} while the region ran")
        return statistics.median(self.samples)
