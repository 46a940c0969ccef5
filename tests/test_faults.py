"""Hostile inputs and faults, CPU tier: clear errors before anything launches, no hangs, nothing lost.

What the GPU tier cannot check without a GPU is checked here: the fused layer's argument
checks that run before any device work, the kernel-variant limits, the decoding of the
kernel's failure record, and the processes around the kernel (bench runs that hang, crash or
are interrupted; JIT builds killed midway; tuned-config writes killed midway; torn results
files).  The kernel's own traps are in tests/gpu/test_fused_faults.py.
"""

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from megamoe_cli import fused
from megamoe_cli.bench import launcher
from megamoe_cli.bench.launcher import run_bench, worker_pids
from megamoe_cli.bench.results import append_rows, make_row, read_results
from megamoe_cli.bench.sweep import load_sweep_text
from megamoe_cli.cli import main
from megamoe_cli.errors import MegaMoEError, MegaMoETimeout
from megamoe_cli.fused import buffer as fused_buffer
from megamoe_cli.fused import launch as fused_launch
from megamoe_cli.kernel import contract
from megamoe_cli.kernel import tuned
from megamoe_cli.kernel.kernel_source import (
    MAX_SMEM_BYTES,
    TAIL_FIELDS,
    KernelConfig,
    Variant,
    pack_params,
    param_offset,
    smem_bytes,
    variant_for,
)
from megamoe_cli.layout import PRESETS, BufferConfig, MoEShape, build_layout
from megamoe_cli.problem import make_expert_weights
from cli_checks import CRASH_ENV, HANG_ENV, fault_env, interrupt, interruptible, processes_mentioning

REPO = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
SMALL = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")


# The fused layer's argument checks (nothing here needs a GPU: each fails before device work)


@pytest.fixture(scope="module")
def weights():
    """Two local experts of a 512/256 shape, on the CPU: (w1, w1_sf, w2, w2_sf)."""
    return make_expert_weights(MoEShape(hidden=512, intermediate=256, num_experts=4, num_topk=2), 0, 2)


def bad_weights(w1, w1_sf, w2, w2_sf):
    """(id, l1 argument, l2 argument, the exact error)."""
    return [
        ("l1 a bare tensor", w1, (w2, w2_sf), "l1 must be a (weight, scales) pair of tensors, got Tensor"),
        ("l2 scales missing", (w1, w1_sf), (w2, None), "l2 must be a (weight, scales) pair of tensors, got tuple"),
        ("l1 of three", (w1, w1_sf, w1_sf), (w2, w2_sf), "l1 must be a (weight, scales) pair of tensors, got tuple"),
        ("w1 2-D", (w1[0], w1_sf), (w2, w2_sf), "expected 3-D expert weights, got w1 (512, 512) and w2 (2, 512, 256)"),
        ("w1 rows not 2*I", (w1[:, :384], w1_sf), (w2, w2_sf),
         "w1 must be [E, 2*I, H] with I and H multiples of 128, got (2, 384, 512)"),
        ("w2 of another intermediate", (w1, w1_sf), (w2[:, :, :128], w2_sf),
         "w2 must be [E, H, I] = (2, 512, 256), got (2, 512, 128)"),
        ("w2 of another expert count", (w1, w1_sf), (torch.cat([w2.view(torch.uint8)] * 2).view(w2.dtype), w2_sf),
         "w2 must be [E, H, I] = (2, 512, 256), got (4, 512, 256)"),
        ("w1 scales of another shape", (w1, w1_sf[:, :2]), (w2, w2_sf), "w1 scales must be (2, 4, 4), got (2, 2, 4)"),
        ("w2 scales of another shape", (w1, w1_sf), (w2, w2_sf.transpose(1, 2)),
         "w2 scales must be (2, 4, 2), got (2, 2, 4)"),
        ("w1 bf16", (w1.to(torch.bfloat16), w1_sf), (w2, w2_sf), "w1 must be torch.float8_e4m3fn, got torch.bfloat16"),
        ("w2 scales f16", (w1, w1_sf), (w2, w2_sf.half()), "w2 scales must be torch.float32, got torch.float16"),
        ("w1 scales on another device", (w1, w1_sf.to("meta")), (w2, w2_sf),
         "expert weights and scales must be on one device, got w1 on cpu, w1 scales on meta, "
         "w2 on cpu, w2 scales on cpu"),
    ]


def test_weight_transform_refuses_bad_weights_naming_what_it_expected(weights):
    for name, l1, l2, message in bad_weights(*weights):
        with pytest.raises(MegaMoEError) as caught:
            fused.transform_weights_for_mega_moe(l1, l2)
        assert str(caught.value) == message, name


def test_weight_transform_refuses_a_hidden_the_kernel_cannot_tile():
    w1, w1_sf, w2, w2_sf = make_expert_weights(MoEShape(hidden=384, intermediate=256, num_experts=4, num_topk=2), 0, 2)
    with pytest.raises(MegaMoEError, match=r"^the fused kernel needs hidden to be a multiple of 256, got 384$"):
        fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))


def test_weight_transform_takes_non_contiguous_weights_as_their_values(weights):
    w1, w1_sf, w2, w2_sf = weights
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in weights]
    assert not any(t.is_contiguous() for t in strided)
    want1, want2 = fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    got1, got2 = fused.transform_weights_for_mega_moe(tuple(strided[:2]), tuple(strided[2:]))
    for want, got in ((want1.weight, got1.weight), (want1.scale, got1.scale), (want2.weight, got2.weight),
                      (want2.scale, got2.scale)):
        assert got.is_contiguous()
        assert torch.equal(got.view(torch.uint8) if got.dtype == w1.dtype else got,
                           want.view(torch.uint8) if want.dtype == w1.dtype else want)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_m=32), "block_m=32 is not supported by the fused kernel; expected one of (64, 128)"),
        (dict(block_m=72), "block_m=72 is not supported by the fused kernel; expected one of (64, 128)"),
        (dict(hidden=100), "hidden must be a multiple of 128 (the FP8 scale block), got 100"),
        (dict(num_topk=17), "num_topk must be between 1 and num_experts=16, got 17"),
        (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank must be a positive integer, got 0"),
        (dict(device="cpu"), "SymmBuffer needs a CUDA device, got cpu"),
        (dict(group=object()), "a process group was given but torch.distributed is not initialized"),
    ],
)
def test_symm_buffer_refuses_bad_arguments_before_allocating(kwargs, message):
    args = dict(group=None, num_experts=16, num_max_tokens_per_rank=64, num_topk=4, hidden=512, intermediate=256)
    args.update(kwargs)
    group = args.pop("group")
    with pytest.raises(MegaMoEError) as caught:
        fused.SymmBuffer(group, **args)
    assert str(caught.value) == message


@no_cuda
def test_without_a_gpu_the_buffer_and_the_backend_say_so():
    with pytest.raises(MegaMoEError, match=r"^SymmBuffer needs a CUDA device, but torch sees none$"):
        fused.SymmBuffer(None, 16, 64, 4, 512, 256)
    with pytest.raises(MegaMoEError, match=r"^the fused backend needs a CUDA GPU \(sm_90a\)$"):
        fused.FusedBackend().prepare(None, None, {})


def test_mega_moe_refuses_a_buffer_it_did_not_make():
    with pytest.raises(MegaMoEError, match=r"^mega_moe: buf must be a SymmBuffer, got dict$"):
        fused.mega_moe(torch.empty(1, 512, dtype=torch.bfloat16), None, None, {})


def test_fused_config_keys_are_checked_before_the_gpu_is_asked():
    with pytest.raises(MegaMoEError, match=r"^fused backend: unknown config keys \['block_n', 'stages'\]; "
                                          r"expected block_m, num_stages, num_sms"):
        fused.resolve_config(SMALL, 1, 64, {"block_n": 128, "stages": 3})


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan-ish"])
def test_a_bad_timeout_setting_is_named(monkeypatch, value):
    monkeypatch.setenv(fused_launch.ENV_TIMEOUT, value)
    with pytest.raises(MegaMoEError, match=rf"^MEGAMOE_TIMEOUT_S must be (a number of seconds|positive), got '{value}'$"):
        fused_launch.timeout_ns()


def test_timeout_setting_default_and_fractions(monkeypatch):
    monkeypatch.delenv(fused_launch.ENV_TIMEOUT, raising=False)
    assert fused_launch.timeout_ns() == 30_000_000_000
    monkeypatch.setenv(fused_launch.ENV_TIMEOUT, "2.5")
    assert fused_launch.timeout_ns() == 2_500_000_000


# Kernel-variant limits, refused before anything compiles


def variant(shape=SMALL, num_ranks=1, block_m=64, num_stages=3):
    return Variant(shape, num_ranks, 128, block_m, num_stages)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: variant(MoEShape(hidden=384, intermediate=256, num_experts=16, num_topk=4)),
         "the fused kernel needs hidden to be a multiple of 256, got 384"),
        (lambda: variant(num_ranks=16), "the fused kernel supports at most 8 ranks, got 16"),
        (lambda: variant(MoEShape(hidden=512, intermediate=256, num_experts=64, num_topk=33)),
         "the fused kernel supports num_topk <= 32, got 33"),
        (lambda: variant(block_m=32), "block_m=32 is not supported by the fused kernel; expected one of (64, 128)"),
        (lambda: variant(num_stages=6), "num_stages=6; expected one of (2, 3, 4, 5)"),
        (lambda: KernelConfig(cluster_m=3), "cluster_m=3; expected one of"),
        (lambda: variant(PRESETS["deepseek-v3"], 1, 128, 5), "bytes of shared memory, more than the 232448"),
    ],
)
def test_variants_the_kernel_cannot_run_are_refused(build, message):
    with pytest.raises(MegaMoEError) as caught:
        build().validate()
    assert message in str(caught.value)


def test_the_shared_memory_refusal_names_the_variant_and_its_need():
    v = variant(PRESETS["deepseek-v3"], 1, 128, 5)
    assert smem_bytes(v) > MAX_SMEM_BYTES
    with pytest.raises(MegaMoEError) as caught:
        v.validate()
    assert str(caught.value).startswith(f"variant {v.name} needs {smem_bytes(v)} bytes of shared memory")


def test_kernel_config_and_buffer_must_agree():
    config = BufferConfig(num_ranks=2, num_max_tokens_per_rank=64, shape=SMALL, block_m=64)
    with pytest.raises(MegaMoEError, match=r"^the buffer serves block_m \[64\] \(laid out for block_m up to 64\) "
                                           r"but the kernel config asks for 128$"):
        variant_for(config, KernelConfig(block_m=128))
    # A buffer laid out for the largest block serves the smaller one too
    wide = BufferConfig(num_ranks=2, num_max_tokens_per_rank=64, shape=SMALL, block_m=128)
    assert [variant_for(wide, KernelConfig(block_m=b)).block_m for b in (64, 128)] == [64, 128]
    with pytest.raises(MegaMoEError, match=r"^num_sms must be >= 0 \(0 = all SMs\), got -1$"):
        variant_for(config, KernelConfig(block_m=64, num_sms=-1))
    v = variant_for(config, KernelConfig(block_m=64, num_stages=2))
    assert (v.shape, v.num_ranks, v.num_max_tokens_per_rank, v.block_m, v.num_stages) == (SMALL, 2, 64, 64, 2)


def test_launch_parameters_refuse_what_the_struct_cannot_hold():
    layout = build_layout(BufferConfig(num_ranks=1, num_max_tokens_per_rank=64, shape=SMALL))
    tmaps = {name: bytes(128) for name in ("tmap_l1_a", "tmap_l1_sfa", "tmap_l1_b", "tmap_l2_a", "tmap_l2_sfa",
                                           "tmap_l2_b")}
    tail = dict.fromkeys(TAIL_FIELDS, 0)
    with pytest.raises(MegaMoEError, match=r"^at most 8 ranks, got 9$"):
        pack_params(tmaps, 0, [0] * 9, layout, tail)
    with pytest.raises(MegaMoEError, match=r"^tensor map tmap_l2_b must be 128 bytes, got 64$"):
        pack_params({**tmaps, "tmap_l2_b": bytes(64)}, 0, [0], layout, tail)
    with pytest.raises(MegaMoEError, match=r"^launch parameters: missing \['in_x'\], unknown \['extra'\]"):
        pack_params(tmaps, 0, [0], layout, {**{k: 0 for k in TAIL_FIELDS if k != "in_x"}, "extra": 1})


def test_a_plan_starts_every_launch_parameter():
    """launch_tail gives pack_params every scalar field of the struct (a field added to the
    struct but not to the plan fails here, on the CPU, not at the first GPU launch)."""
    from types import SimpleNamespace

    from megamoe_cli.fused.launch import launch_tail

    config = BufferConfig(num_ranks=2, num_max_tokens_per_rank=64, shape=SMALL)
    scale = torch.zeros(4)
    buf = SimpleNamespace(rank=1, config=config, diag=torch.zeros(8, dtype=torch.uint8))
    tail = launch_tail(buf, SimpleNamespace(weight=scale, scale=scale), SimpleNamespace(weight=scale, scale=scale))
    assert list(tail) == list(TAIL_FIELDS)
    assert tail["rank"] == 1 and tail["num_max_pool_tokens"] == config.num_max_pool_tokens
    names = [f"in_{n}" for n in ("x", "x_sf", "topk_idx", "topk_weights")]
    assert [tail[name] for name in names] == [0, 0, 0, 0]
    # mega_moe writes the four input addresses with one 32-byte pack from in_x on
    assert [param_offset(name) for name in names] == [param_offset("in_x") + 8 * i for i in range(4)]
    layout = build_layout(config)
    tmaps = {name: bytes(128) for name in ("tmap_l1_a", "tmap_l1_sfa", "tmap_l1_b", "tmap_l2_a", "tmap_l2_sfa",
                                           "tmap_l2_b")}
    packed = pack_params(tmaps, 0, [0, 0], layout, tail)
    assert struct.unpack_from("<Q", packed, param_offset("rank"))[0] == 1


# The kernel's failure record: what the device writes is what the host reads


def test_the_decoder_reads_the_record_as_the_kernel_lays_it_out():
    """The C++ struct's offsets are static_asserts of the generated contract (tests/test_contract.py);
    here the decoder's view of the same bytes, written out by hand."""
    assert [name for name, _ in contract.DIAGNOSTIC_FIELDS] == [
        "magic", "rank", "phase", "cta", "thread", "index", "expected", "observed"]
    assert contract.DIAGNOSTIC.format == "<IIIIIIQQ" and contract.DIAGNOSTIC.size == 40
    assert contract.DIAGNOSTIC.size <= contract.DIAGNOSTIC_RECORD_BYTES
    assert set(contract.PHASE_TEXT) == set(contract.Phase)


def failed_buffer(magic=contract.DIAGNOSTIC_MAGIC, rank=1, phase=8, cta=3, thread=53, index=21, expected=16, observed=1000):
    """A SymmBuffer stand-in whose failure record holds what a trapping kernel wrote."""
    buf = object.__new__(fused.SymmBuffer)
    buf.device = torch.device("cpu")
    buf.diag = torch.zeros(8, dtype=torch.int64)
    raw = struct.pack("<6I2Q", magic, rank, phase, cta, thread, index, expected, observed)
    buf.diag.view(torch.uint8)[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf


def test_the_diagnostic_names_rank_phase_place_expected_and_observed():
    assert failed_buffer().diagnostic() == (
        "megamoe kernel failed on rank 1: topk_idx out of range; CTA 3, thread 53, index 21: expected 16, observed 1000"
    )
    assert failed_buffer(phase=2, index=1, expected=9, observed=6).diagnostic() == (
        "megamoe kernel failed on rank 1: count exchange (index 0: ranks announced; index 1: CTAs of every rank "
        "arrived); CTA 3, thread 53, index 1: expected 9, observed 6"
    )
    assert "phase 42;" in failed_buffer(phase=42).diagnostic()
    # 0: nothing failed; 1: a thread claimed the record but had not finished it when the host looked.
    assert failed_buffer(magic=0).diagnostic() is None
    assert failed_buffer(magic=1).diagnostic() is None


def test_synchronize_turns_a_failed_launch_into_the_kernels_diagnostic(monkeypatch):
    trap = RuntimeError("CUDA error: an illegal instruction was encountered")

    def failing_synchronize(device=None):
        raise trap

    monkeypatch.setattr(torch.cuda, "synchronize", failing_synchronize)
    with pytest.raises(MegaMoETimeout) as caught:
        fused.synchronize(failed_buffer(phase=6, index=0, expected=10, observed=6))
    assert str(caught.value).startswith("megamoe kernel failed on rank 1: combine barrier (ranks);")
    assert caught.value.__cause__ is trap
    # A failure the kernel did not record stays the driver's own error.
    with pytest.raises(RuntimeError) as caught:
        fused.synchronize(failed_buffer(magic=0))
    assert caught.value is trap


# Bench runs that hang, crash or are interrupted


SWEEP = """\
name: faults
shape: {preset: small}
num_tokens: [4, 8]
backends: [reference]
warmup: 0
iters: 1
timeout_s: 120
"""


def alive(pids):
    return [pid for pid in pids if launcher._alive(pid)]


def wait_gone(pids, wait_s=10.0):
    deadline = time.monotonic() + wait_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


@pytest.mark.slow
def test_cli_bench_point_that_hangs_is_stopped_by_its_watchdog(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run folder lands here
    for name, value in fault_env({HANG_ENV: 0}).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "r.csv"
    started = time.monotonic()
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--preset", "small", "--tokens", "4",
                                       "--backend", "reference", "--warmup", "0", "--iters", "1",
                                       "--point-timeout", "4", "--out", str(out)])
    elapsed = time.monotonic() - started

    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run stopped at point 0 of 1 (reference small num_tokens=4): ")
    assert "did not finish within 4 s" in last
    assert elapsed < 60, f"a hung point held the command for {elapsed:.0f} s"
    (run_dir,) = tmp_path.glob("megamoe-bench-*")
    assert f"run files kept in {run_dir}" in last
    assert (run_dir / "torchrun.log").exists() and list(run_dir.glob("fatal.rank*.txt"))
    assert not wait_gone(worker_pids(run_dir).values())
    frame = read_results(out)
    assert list(frame["status"]) == ["failed"]
    assert "did not finish within 4 s" in frame["error"][0]


@pytest.mark.slow
def test_after_a_rank_crashes_mid_sweep_the_next_run_appends_to_the_same_file(tmp_path):
    points = load_sweep_text(SWEEP).points
    out = tmp_path / "results.csv"
    crashed = run_bench(points, 2, out, device="cpu", env=fault_env({CRASH_ENV: 1}), grace_s=2, run_root=tmp_path)
    assert not crashed.ok
    assert "rank 1 failed first" in crashed.message
    assert "test hook MEGAMOE_TEST_CRASH_AT_POINT=1: exiting at point 1" in crashed.message
    after_crash = out.read_bytes()

    clean = run_bench(points, 2, out, device="cpu", run_root=tmp_path)
    assert clean.ok, clean.message

    assert out.read_bytes().startswith(after_crash)
    assert out.read_text().count("run_id,") == 1
    frame = read_results(out)
    assert list(frame["run_id"]) == [crashed.run_id] * 2 + [clean.run_id] * 2
    assert list(frame["status"]) == ["ok", "failed", "ok", "ok"]
    assert list(frame["num_tokens"]) == [4, 8, 4, 8]
    assert "exiting at point 1" in frame["error"][1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.slow
def test_a_stop_signal_ends_every_process_of_the_run_and_keeps_its_rows(tmp_path, sig):
    """What Ctrl-C, kill, timeout, a job scheduler and a closed terminal send, sent to the CLI's own
    pid mid-sweep: torchrun starts every rank in a session of its own, so none of them gets the
    signal; the CLI must stop them all, save the rows measured, and exit with 128 + the signal."""
    out = tmp_path / "r.csv"
    env = launcher.run_environment({**fault_env({HANG_ENV: 1}), "TMPDIR": str(tmp_path)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "megamoe_cli", "bench", "--device", "cpu", "--preset", "small", "--tokens", "4,8",
         "--backend", "reference", "--warmup", "0", "--iters", "1", "--point-timeout", "120", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first point never finished"
            time.sleep(0.1)
        (run_dir,) = tmp_path.glob("megamoe-bench-*")
        while len(worker_pids(run_dir)) < 2:
            assert time.monotonic() < deadline, "the ranks never wrote their pid files"
            time.sleep(0.1)
        run = processes_mentioning(str(run_dir))
        ranks = set(worker_pids(run_dir).values())
        assert ranks < set(run) and len(run) == 3, "expected torchrun and two ranks"
        before = out.read_bytes()

        started = time.monotonic()
        stderr = interrupt(proc, sig, timeout=60)
        assert time.monotonic() - started < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    assert f"stopped: every rank ended; 1 of 2 point(s) measured, in {out}" in stderr
    assert "Traceback" not in stderr
    assert not wait_gone(run), "a process of the run outlived the command"
    assert not processes_mentioning(str(run_dir))
    assert not run_dir.exists()  # the rows are in --out; the interrupted run leaves nothing behind
    assert out.read_bytes() == before
    frame = read_results(out)
    assert list(frame["status"]) == ["ok"] and list(frame["num_tokens"]) == [4]


def test_a_signal_while_torchrun_starts_is_held_until_its_pid_is_recorded():
    """The launcher starts torchrun under SignalsHeld: a stop signal raised inside Popen, after
    the fork, would lose torchrun's pid and leave it and its ranks running."""
    caught = []

    def stop(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    saved = signal.signal(signal.SIGTERM, stop)
    try:
        held = launcher.SignalsHeld()
        with held:
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs between bytecodes of this loop: it ends once the signal is held,
            # and the caller's handler, had it run instead, would have raised out of it.
            deadline = time.monotonic() + 10
            while not held.held:
                assert time.monotonic() < deadline, "the signal never arrived"
            survived = True
        assert survived and caught == []
        assert signal.getsignal(signal.SIGTERM) is stop  # the caller's handler is back
        with pytest.raises(KeyboardInterrupt):
            held.deliver()  # raised where the launcher handles a stop: inside its try
        assert caught == [signal.SIGTERM]
        held.deliver()  # delivered once
    finally:
        signal.signal(signal.SIGTERM, saved)


# Results files torn by a crash mid-write


def test_a_torn_jsonl_results_line_is_skipped_with_a_warning_and_the_rows_around_it_survive(tmp_path):
    points = load_sweep_text(SWEEP).points
    path = tmp_path / "r.jsonl"
    append_rows(path, [make_row(p, run_id="r1", world_size=2, device="cpu", env={}, status="ok") for p in points])
    with open(path, "a") as f:
        f.write('{"run_id": "r2", "sta')
    append_rows(path, [make_row(points[0], run_id="r3", world_size=2, device="cpu", env={}, status="ok")])

    frame = read_results(path)
    assert list(frame["run_id"]) == ["r1", "r1", "r3"]
    assert frame.attrs["warnings"] == [f"{path}: 1 damaged row(s) skipped (line 3: not JSON (Unterminated string "
                                       "starting at))"]
    result = CliRunner().invoke(main, ["report", str(path)])
    assert result.exit_code == 0, result.output
    (line,) = [text for text in result.stderr.splitlines() if "damaged" in text]
    assert line.startswith(f"warning: {path}: 1 damaged row(s) skipped (line 3: not JSON")
    assert result.stdout.count(" r3 ") == 1 and result.stdout.count(" r1 ") == 2


# JIT builds killed midway while another process waits


needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc on PATH")
KERNEL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 3.0f; }\n'
BUILDER = """
import json, sys
from megamoe_cli.kernel.jit import KernelSource, build
(kernel,) = build([KernelSource("killed", sys.argv[1])], lock_timeout_s=float(sys.argv[2]))
print(json.dumps({"from_cache": kernel.from_cache, "cubin": str(kernel.cubin_path)}))
"""


def start_builder(cache, nvcc, lock_timeout_s):
    env = dict(os.environ, MEGAMOE_CACHE_DIR=str(cache), MEGAMOE_NVCC=str(nvcc), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", BUILDER, KERNEL, str(lock_timeout_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@needs_nvcc
@pytest.mark.slow
def test_a_process_waiting_on_a_killed_build_takes_it_over(tmp_path):
    cache = tmp_path / "cache"
    starts = tmp_path / "starts"
    slow = tmp_path / "slow-nvcc"
    slow.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then exec {NVCC} --version; fi
        echo $$ >> {starts}
        sleep 60
        exec {NVCC} "$@"
        """))
    slow.chmod(0o755)
    holder = start_builder(cache, slow, 60)
    waiter = None
    try:
        deadline = time.monotonic() + 60
        while not starts.exists():
            assert holder.poll() is None, holder.communicate()
            assert time.monotonic() < deadline, "the first build never started compiling"
            time.sleep(0.02)
        waiter = start_builder(cache, NVCC, 60)
        time.sleep(1.0)
        assert waiter.poll() is None, "the second process did not wait for the build in progress"
        (directory,) = cache.glob("killed-*")
        assert not (directory / "kernel.cubin").exists()

        os.kill(holder.pid, signal.SIGKILL)  # the compiler it started lives on, as after a crashed rank
        killed_at = time.monotonic()
        stdout, stderr = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, stderr
        assert time.monotonic() - killed_at < 30
    finally:
        for proc in (holder, waiter):
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the builder and any compiler it left behind
                except ProcessLookupError:
                    pass
                proc.communicate()

    result = json.loads(stdout)
    assert not result["from_cache"]
    cubin = Path(result["cubin"])
    assert cubin.parent == directory and cubin.read_bytes()[:4] == b"\x7fELF"
    assert not list(directory.glob("*.tmp-*"))


@needs_nvcc
def test_a_damaged_cache_entry_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    from megamoe_cli.kernel.jit import KernelSource, build

    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEGAMOE_NVCC", raising=False)
    source = KernelSource("damaged", KERNEL)
    (first,) = build([source])
    # A zero-length cubin is what a rename without fsync can leave after a power loss.
    first.cubin_path.write_bytes(b"")
    (rebuilt,) = build([source])
    assert not rebuilt.from_cache and rebuilt.cubin_path.read_bytes()[:4] == b"\x7fELF"
    report = rebuilt.cubin_path.parent / "report.json"
    report.write_text('{"key": "')
    (again,) = build([source])
    assert not again.from_cache and json.loads(report.read_text())["key"] == again.key
    (cached,) = build([source])
    assert cached.from_cache


# Tuned-config writes killed midway


NUM_ENTRIES = 2000
WRITER = f"""
import sys
from megamoe_cli.kernel import tuned
from megamoe_cli.layout import MoEShape

path, generation = sys.argv[1], int(sys.argv[2])
keys = [tuned.make_key("H200", 8, MoEShape(hidden=128 * (1 + i % 64), intermediate=128, num_experts=8, num_topk=2),
                       1 << (i // 64)) for i in range({NUM_ENTRIES})]
while True:
    entries = [tuned.make_entry(k, {{"num_stages": 3}}, 1.0, 2.0, date="d", commit=f"gen{{generation}}") for k in keys]
    tuned.merge_and_save(entries, path)
    print(generation, flush=True)
    generation += 1
"""


def start_writer(path, generation):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(generation)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=interruptible)


def temp_files(directory):
    return list(directory.glob(".tuned.json.*.tmp"))


def wait_for_a_write_in_progress(directory, proc, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not temp_files(directory):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer never started a write"
        time.sleep(0.001)


def store_generation(path):
    """The one generation every entry carries: a store that is whole, never a mix or a cut."""
    entries = tuned.load(path)
    assert len(entries) == NUM_ENTRIES
    generations = {entry["commit"] for entry in entries.values()}
    assert len(generations) == 1, f"entries from several writes: {sorted(generations)[:3]}"
    return int(generations.pop()[len("gen"):])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_a_tuned_config_write_killed_midway_leaves_the_old_or_the_new_store(tmp_path, sig):
    path = tmp_path / "tuned.json"
    generation = 1
    chance = random.Random(7)
    for round_index in range(6):
        for orphan in temp_files(tmp_path):  # left by a writer SIGTERM killed before it could clean up
            orphan.unlink()
        writer = start_writer(path, generation)
        written = []
        try:
            if round_index % 2 == 0:
                wait_for_a_write_in_progress(tmp_path, writer)  # between the temp file and the rename
            else:
                written.append(int(writer.stdout.readline()))
                time.sleep(chance.uniform(0.0, 0.2))  # anywhere in the loop
            writer.send_signal(sig)
            writer.wait(timeout=30)
            written += [int(line) for line in writer.stdout.read().split()]
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        assert writer.returncode != 0
        if path.exists():
            found = store_generation(path)
            assert generation - 1 <= found <= max([generation - 1] + written) + 1
            generation = found + 1
    # The lock died with the writer: the next write goes through at once.
    key = tuned.make_key("H200", 8, SMALL, 64)
    tuned.merge_and_save([tuned.make_entry(key, {"num_stages": 2}, 1.0, 2.0, date="d", commit="after")], path)
    assert tuned.lookup(key, path) == {"num_stages": 2}
    assert len(tuned.load(path)) == NUM_ENTRIES + 1


# Peer atomics: the count phase adds to the owners' counters across GPUs


def test_a_group_whose_gpus_lack_native_peer_atomics_is_refused_by_name():
    bus = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"]
    devices = {b: i for i, b in enumerate(bus)}
    with pytest.raises(MegaMoEError) as caught:
        fused_buffer.check_peer_atomics(0, bus, devices.get, lambda me, peer: peer != 2)
    message = str(caught.value)
    assert "rank 0 (GPU 0000:18:00.0)" in message and "rank 2's memory (GPU 0000:3a:00.0)" in message
    assert "NVLink" in message
    # Every pair supported: each peer checked once, none refused.
    asked = []
    assert fused_buffer.check_peer_atomics(1, bus, devices.get, lambda me, peer: asked.append((me, peer)) or True) == 2
    assert asked == [(1, 0), (1, 2)]


def test_peers_this_process_cannot_see_are_not_checked():
    bus = ["0000:18:00.0", "0000:2a:00.0"]
    only_mine = {"0000:18:00.0": 0}.get
    assert fused_buffer.check_peer_atomics(0, bus, only_mine, lambda me, peer: False) == 0
    assert fused_buffer.check_peer_atomics(1, bus, {}.get, lambda me, peer: False) == 0


@pytest.mark.parametrize(
    "shape,layer,count",
    [
        (MoEShape(hidden=7424, intermediate=2048, num_experts=256, num_topk=8), "L2 (hidden 7424)", 29),
        (MoEShape(hidden=7168, intermediate=1920, num_experts=256, num_topk=8), "L1 (2 x intermediate 1920)", 15),
    ],
)
def test_cluster_variant_refuses_an_odd_number_of_n_tiles(shape, layer, count):
    Variant(shape, 2, 4096, 128, 4, 1).validate()  # without clusters the shape is fine
    with pytest.raises(MegaMoEError) as caught:
        Variant(shape, 2, 4096, 128, 4, 2).validate()
    assert str(caught.value) == (
        "cluster_m=2 pairs the 256-column tiles of an expert's last block, so both layers need a multiple of 2 "
        f"of them; {layer} has {count}; use cluster_m=1"
    )
