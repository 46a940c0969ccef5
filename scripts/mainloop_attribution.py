"""The fused kernel's main loop against DeepGEMM's contiguous grouped GEMMs at the same point, on
one Hopper GPU, in one process: per K block of each GEMM, then where each microsecond of the
fused call goes (``megamoe_cli.bench.attribution`` holds the arithmetic and says what each
figure is).

    python3 scripts/mainloop_attribution.py --preset deepseek-v3 --tokens 8192 --out attrib/
    python3 scripts/mainloop_attribution.py --preset deepseek-v4-flash --iters 30

Steps, each timed from a CUDA graph with the L2 flushed before every replay (the median of
``--iters``), the SM clock sampled throughout (``bench.clock``):

1. the bench's problem at the point (``bench.sweep`` + ``bench.session``: routing, seed), all
   experts local;
2. DeepGEMM: the ``deepgemm`` peer backend's contiguous layout built by one eager call, then its
   two grouped GEMMs alone on that pool (L1: m = the padded pairs, n = 2 * intermediate, k =
   hidden; L2: n = hidden, k = intermediate); each config as DeepGEMM prints it
   (``DG_PRINT_CONFIGS=1``, read from the process's stdout); the GEMM kernel's own time from
   torch.profiler beside the graph's;
3. megamoe: the release build's kernel alone, then the profiling build (``MEGAMOE_PROFILE=1``,
   compiled here unless ``MEGAMOE_CACHE_DIR`` holds it) for ``--cycle-calls`` calls, its
   counters read as ``megamoe profile --cycles`` reads them (``bench.profile.cycle_breakdown``)
   and its trace for the gaps before L1 and L2 tiles (``attribution.tile_gaps``).

Writes ``attribution.md`` and ``attribution.json`` to ``--out`` (printed to stdout either way).
Needs a Hopper GPU, sgl-deep-gemm (``pip install 'megamoe[deepgemm]'``), and pynvml or
nvidia-smi for the clock; refuses in one line without them.
"""

import argparse
import os
import statistics
import sys

# Modules whose place in the package may change: imported here only.
PEERS = "megamoe_cli.baselines.peers"
PEER_DEEPGEMM = "megamoe_cli.baselines.peers.deepgemm"


def parse_args(argv=None):
    from megamoe_cli.layout import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--weights", default="fp8", choices=("fp8", "fp4"),
                        help="fp4: megamoe runs MXFP4, DeepGEMM the same weights converted to FP8")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cycle-calls", type=int, default=5, help="profiling-build calls the counters add up")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for attribution.md and attribution.json")
    args = parser.parse_args(argv)
    for name in ("tokens", "iters", "cycle_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def missing() -> str:
    """What this machine lacks for the script ('' when nothing)."""
    import importlib

    from megamoe_cli.bench.clock import ClockSampler

    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU here (the fused kernel and DeepGEMM's GEMMs need a Hopper GPU)"
    if torch.cuda.get_device_capability(0) != (9, 0):
        return f"GPU 0 is {torch.cuda.get_device_name(0)}, not a Hopper GPU (sm_90)"
    why = importlib.import_module(PEERS).unavailable("deepgemm")
    return why or ClockSampler.unavailable() or ""


def timed(call, flush, warmup, iters):
    """Median microseconds of ``call`` replayed from a CUDA graph, the L2 flushed before each."""
    import torch

    from megamoe_cli.bench.session import time_calls
    from megamoe_cli.baselines.graphs import capture

    call()
    graph = capture(call, torch.device("cuda", torch.cuda.current_device()))
    return statistics.median(time_calls(graph.replay, warmup=warmup, iters=iters, barrier=lambda: None,
                                        device="cuda", flush=flush))


def kernel_times(call, flush, calls):
    """{kernel name: microseconds per call} of ``call`` (eager, the L2 flushed before each),
    the flush's own kernel left out."""
    import torch

    flush()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush()
            call()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_time_total > 0 and "Fill" not in event.key:
            times[event.key] = event.device_time_total / calls
    return times


def measure_deepgemm(problem, flusher, clock_id, args):
    """DeepGEMM's two GEMMs on the peer's contiguous pool: per GEMM (config, graph us, kernel
    us, clock MHz), the padded pairs and the M alignment."""
    import importlib

    import torch

    from megamoe_cli.bench import attribution as A
    from megamoe_cli.bench.clock import ClockSampler
    from megamoe_cli.errors import MegaMoEError

    peer = importlib.import_module(PEER_DEEPGEMM)
    runner = peer.DeepGEMMBackend(graph=False).prepare(problem, None, {"layout": "contiguous"})
    seen = {}
    fill = runner._experts_deepgemm

    def spy(block_expert, seg_end, counts_):
        seen["m"] = int(seg_end[-1].item())
        fill(block_expert, seg_end, counts_)

    runner._experts_deepgemm = spy
    with A.captured_stdout() as printed:
        runner()  # the pool, the activations and m_indices, as the bench's call leaves them
        torch.cuda.synchronize()
    dg, p, m, s = runner.dg, runner.problem, seen["m"], problem.shape
    xs, act_sf = runner.xs_pool[:m], runner.act_sf[:m]
    # DeepGEMM wants the A scales MN-major and transposes K-major ones in every call; done once
    # here, so the graph holds its GEMM alone.
    transform = getattr(dg, "get_mn_major_tma_aligned_tensor", None)
    if transform is not None:
        xs, act_sf = transform(xs), transform(act_sf)
    gemms = {
        "L1": (2 * s.intermediate, s.hidden, lambda: dg.m_grouped_fp8_gemm_nt_contiguous(
            (runner.x_pool[:m], xs), (p.w1, p.w1_sf), runner.h[:m], runner.m_indices[:m])),
        "L2": (s.hidden, s.intermediate, lambda: dg.m_grouped_fp8_gemm_nt_contiguous(
            (runner.act[:m], act_sf), (p.w2, p.w2_sf), runner.out[:m], runner.m_indices[:m])),
    }
    out = {}
    for name, (n, k, call) in gemms.items():
        with A.captured_stdout() as more:
            call()
            torch.cuda.synchronize()
        configs = A.parse_deepgemm_configs(printed.text + more.text)
        config = A.config_for(configs, n, k)
        if config is None:
            raise MegaMoEError(f"DeepGEMM printed no config for its GEMM at n={n} k={k} with DG_PRINT_CONFIGS=1 "
                               f"({len(configs)} config(s) for other GEMMs)")
        config.setdefault("num_sms", torch.cuda.get_device_properties(0).multi_processor_count)
        with ClockSampler(clock_id) as clock:
            graph_us = timed(call, flusher, args.warmup, args.iters)
            kernels = kernel_times(call, flusher, args.iters)
        gemm_kernel = max(kernels, key=kernels.get)
        out[name] = {"n": n, "k": k, "config": config, "graph_us": graph_us, "kernel_us": kernels[gemm_kernel],
                     "kernel": gemm_kernel, "kernels": kernels, "clock_mhz": clock.median_mhz}
    return out, m, runner.config["m_alignment"], transform is not None


def measure_megamoe(problem, flusher, clock_id, args):
    """The fused kernel alone: the release build's graph time; the profiling build's counters,
    trace and eager call time (mean) over ``--cycle-calls`` calls."""
    import torch

    from megamoe_cli.backends import get_backend
    from megamoe_cli.bench import attribution as A
    from megamoe_cli.bench.clock import ClockSampler
    from megamoe_cli.bench.profile import FusedProbe, cycle_breakdown
    from megamoe_cli.fused.diagnostics import PROFILE_ENV

    os.environ.pop(PROFILE_ENV, None)  # the first timing is the release build's
    runner = get_backend("fused").prepare(problem, None, {})
    probe = FusedProbe(runner, given=False)
    runner()  # the inputs into the buffer, the release kernel built and loaded
    probe.sync()
    with ClockSampler(clock_id) as clock:
        release_us = timed(probe.kernel, flusher, args.warmup, args.iters)
    release_mhz = clock.median_mhz

    os.environ[PROFILE_ENV] = "1"
    try:
        probe.kernel()  # builds (or loads) the profiling build
        probe.sync()
        kernel = probe.built()
        kernel.reset_profile()
        samples = []
        with ClockSampler(clock_id) as clock:
            for _ in range(args.cycle_calls):
                flusher()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                probe.kernel()
                end.record()
                probe.sync()
                samples.append(start.elapsed_time(end) * 1e3)
        counters, trace = kernel.read_profile(), kernel.read_trace()
    finally:
        os.environ.pop(PROFILE_ENV, None)
    s = problem.shape
    cfg = runner.kernel_cfg
    num_sms = cfg.num_sms or torch.cuda.get_device_properties(0).multi_processor_count
    num_sms -= num_sms % cfg.cluster_m
    return {"config": cfg.to_dict(), "num_sms": num_sms, "release_us": release_us, "release_mhz": release_mhz,
            # the mean, as the counters are: the split adds their means per call up to it
            "profile_us": statistics.fmean(samples), "profile_mhz": clock.median_mhz, "counters": counters,
            "breakdown": cycle_breakdown(counters, s.hidden, s.intermediate), "gaps": A.tile_gaps(trace)}


def main(argv=None) -> int:
    args = parse_args(argv)
    lack = missing()
    if lack:
        print(f"mainloop_attribution.py: {lack}", file=sys.stderr)
        return 2
    from megamoe_cli.errors import MegaMoEError

    try:
        return run(args)
    except MegaMoEError as exc:  # a peer that does not load, a kernel that does not build: one line
        print(f"mainloop_attribution.py: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    import importlib

    # DeepGEMM prints each config it picks with this set (read when it picks, before its first GEMM).
    os.environ["DG_PRINT_CONFIGS"] = "1"

    import torch

    from megamoe_cli.bench.clock import bus_id
    from megamoe_cli.bench.session import L2Flusher, RankSession
    from megamoe_cli.bench.sweep import sweep_from_flags

    point = sweep_from_flags(name="attribution", preset=args.preset, weights=[args.weights], backends=["fused"],
                             num_tokens=[args.tokens], check=False, flush_l2=True, warmup=args.warmup,
                             iters=args.iters, seed=args.seed).points[0]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    session = RankSession(rank=0, world_size=1, device=device)
    problem = session.problem(point)
    counts = session.expert_counts(problem, point.shape.num_experts)
    flusher = L2Flusher(device)
    pci = getattr(torch.cuda.get_device_properties(0), "pci_bus_id", None)
    clock_id = bus_id(pci) if pci else os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    deepgemm = measure_deepgemm(problem, flusher, clock_id, args)
    fused = measure_megamoe(problem, flusher, clock_id, args)
    version = importlib.import_module(PEERS)
    report(args, point.describe(), counts, deepgemm, fused, torch.cuda.get_device_name(0),
           version.version_of(version.DEEPGEMM))
    return 0


def report(args, point, counts, deepgemm, fused, gpu, peer_version):
    """The tables from the measurements, printed and (``--out``) written."""
    from megamoe_cli.bench import attribution as A

    peer, dg_rows, align, sf_once = deepgemm
    b, cfg = fused["breakdown"], fused["config"]
    layers = []
    for name in ("L1", "L2"):
        g = peer[name]
        dg = A.deepgemm_row(name, counts, dg_rows, g["n"], g["k"], g["config"], g["kernel_us"], g["clock_mhz"])
        dg.notes.update(graph_us=g["graph_us"], kernel=g["kernel"], config=g["config"])
        if g["config"].get("swap_ab"):
            dg.notes["swap_ab"] = "DeepGEMM swapped A and B: its tiles are counted as block_m along m"
        mine = A.megamoe_row(name, counts, cfg["block_m"], g["n"], g["k"], fused["num_sms"], b,
                             fused["profile_mhz"], cfg["num_stages"], cfg["cluster_m"])
        layers.append((mine, dg))
    split = A.split_call(b, fused["profile_us"], fused["profile_mhz"], layers, fused.get("gaps"))
    facts = {
        "gpu": gpu,
        "point": point,
        "pairs": sum(counts),
        "deepgemm": peer_version,
        "deepgemm padded rows (M alignment)": f"{dg_rows} ({align})",
        "deepgemm A scales transposed once outside the timed GEMM": sf_once,
        "deepgemm L1 + L2 kernels us": f"{peer['L1']['kernel_us'] + peer['L2']['kernel_us']:,.1f} (graphs: "
                                       f"{peer['L1']['graph_us'] + peer['L2']['graph_us']:,.1f})",
        "megamoe config": cfg,
        "megamoe release call us": f"{fused['release_us']:,.1f} at {fused['release_mhz']:.0f} MHz",
        "megamoe profiling-build call us": f"{fused['profile_us']:,.1f} at {fused['profile_mhz']:.0f} MHz "
                                           f"(counters cost {fused['profile_us'] - fused['release_us']:+,.1f} us)",
        "SM clock MHz (DeepGEMM L1, L2)": f"{peer['L1']['clock_mhz']:.0f}, {peer['L2']['clock_mhz']:.0f}",
        "iters, cycle calls": f"{args.iters}, {args.cycle_calls}",
    }
    title = f"Main loop attribution: {args.preset}, {args.tokens} tokens, {args.weights}"
    if args.out:
        A.write_report(args.out, title, facts, layers, split, fused["profile_us"])
    print(A.report_text(title, facts, layers, split, fused["profile_us"]))


if __name__ == "__main__":
    sys.exit(main())
