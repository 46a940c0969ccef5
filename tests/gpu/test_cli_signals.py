"""The bench CLI on GPU ranks under a stop signal: what tests/test_faults.py checks on CPU ranks
(gloo), here with NCCL ranks running the fused kernel, where a rank left running would hold its
GPU.  It starts its own torchrun, so it runs from `python -m pytest tests/gpu` (world size 1)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megamoe_cli.bench import launcher
from megamoe_cli.bench.launcher import worker_pids
from megamoe_cli.bench.results import read_results
from cli_checks import HANG_ENV, fault_env, interrupt, interruptible, processes_mentioning

pytestmark = pytest.mark.gpu


def _gpu_pids():
    """PIDs holding a CUDA context on any GPU, as nvidia-smi lists them (None without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {int(line) for line in out.stdout.split() if line.strip().isdigit()} if out.returncode == 0 else None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_ends_every_gpu_rank_and_keeps_the_rows(tmp_path, sig):
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("starts its own torchrun: run it from `python -m pytest tests/gpu`")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "r.csv"
    env = launcher.run_environment({**fault_env({HANG_ENV: 1}), "TMPDIR": str(tmp_path)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "megamoe_cli", "bench", "--preset", "small", "--tokens", "64,128",
         "--backend", "fused", "--warmup", "1", "--iters", "3", "--point-timeout", "300", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.monotonic() + 600
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first point never finished"
            time.sleep(0.2)
        (run_dir,) = tmp_path.glob("megamoe-bench-*")
        ranks = set(worker_pids(run_dir).values())
        assert len(ranks) == torch.cuda.device_count()
        run = processes_mentioning(str(run_dir))
        before = out.read_bytes()
        interrupt(proc, sig, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    deadline = time.monotonic() + 10
    while any(launcher._alive(pid) for pid in run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_mentioning(str(run_dir)), "a process of the run outlived the command"
    holders = _gpu_pids()
    if holders is not None:
        assert not holders & ranks, "a rank still holds a GPU"
    assert out.read_bytes() == before
    frame = read_results(out)
    assert list(frame["status"]) == ["ok"] and list(frame["num_tokens"]) == [64]


def test_the_fused_backends_pass_the_up_front_check_on_this_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megamoe_cli.bench import sweep

    points = sweep.sweep_from_flags(num_tokens=[8], backends=["fused", "fused-graph"], preset="small").points
    # Raises on a GPU that is not sm_90: the tier runs on Hopper only, so this must pass.
    launcher.check_backends(points, "cuda", torch.cuda.device_count())
