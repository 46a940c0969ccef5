"""Host cost of an eager launch through megamoe_cli.kernel.jit, on one GPU: a trivial kernel and the fused
layer at 1 token (world size 1, every expert local).

Every number is from the host timeline (time.perf_counter), in microseconds per call, the median
over --samples batches of --calls calls:

- ``host``: the calls issued back to back with no sync in between, the clock stopped when the last
  call returns (what the host spends per call while the device queue absorbs the work; batches stay
  far below the queue's depth, and the device is drained between batches);
- ``loop``: the same batch with the clock stopped after the device finished it (per call in a loop:
  the larger of the host's and the device's time, plus gaps);
- the same two for the call captured once in a CUDA graph and replayed (``graph replay``), which is
  what a decode loop under CUDA graphs pays.

Rows for the fused layer: ``launch`` (the prepared launch alone: the parameter block written in
place, one driver launch), ``eager call`` (``mega_moe`` with the inputs given, as a model calls it),
and ``graph replay``.  The issue's target: the eager call's ``loop`` within 10 us of the graph
replay's ``loop`` at 1 token.

    python3 scripts/launch_cost.py                     # table
    python3 scripts/launch_cost.py --json > cost.json  # one JSON object
"""

import argparse
import json
import statistics
import struct
import sys
import time


def measure(fn, sync, calls: int, samples: int) -> dict:
    """Median host-side and loop microseconds per call of ``fn`` over ``samples`` batches."""
    for _ in range(3):
        fn()
    sync()
    host, loop = [], []
    for _ in range(samples):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        sync()
        done = time.perf_counter()
        host.append((issued - start) / calls * 1e6)
        loop.append((done - start) / calls * 1e6)
    return {"host_us": statistics.median(host), "loop_us": statistics.median(loop),
            "host_us_min": min(host), "loop_us_min": min(loop)}


def graph_of(torch, fn, device):
    """``fn`` captured once into a CUDA graph; returns the replay."""
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graph.replay


TRIVIAL_SOURCE = r"""
struct Params { int* out; int value; int pad[13]; };   // 64 bytes, like a small real block

extern "C" __global__ void trivial(const __grid_constant__ Params p) {
    if (threadIdx.x == 0 && blockIdx.x == 0) p.out[0] = p.value;
}
"""


def trivial_kernel(torch, device, calls: int, samples: int) -> dict:
    from megamoe_cli.kernel.jit import KernelSource, build, load_module

    (built,) = build([KernelSource("launch_cost_trivial", TRIVIAL_SOURCE)])
    function = load_module(built.cubin_path, device.index).get_function("trivial")
    out = torch.zeros(1, dtype=torch.int32, device=device)
    prepared = function.prepare((1,), (32,), 0, 64)
    prepared.params[:] = struct.pack("<Qi52x", out.data_ptr(), 7)
    stream = torch.cuda.current_stream(device).cuda_stream

    def launch():
        prepared.launch(stream)

    def sync():
        torch.cuda.synchronize(device)

    rows = {"launch": measure(launch, sync, calls, samples)}
    replay = graph_of(torch, lambda: prepared.launch(torch.cuda.current_stream(device).cuda_stream), device)
    rows["graph replay"] = measure(replay, sync, calls, samples)
    sync()
    if out.item() != 7:
        raise SystemExit(f"launch_cost: the trivial kernel wrote {out.item()}, expected 7")
    return rows


def fused_layer(torch, device, preset_name: str, num_tokens: int, calls: int, samples: int) -> dict:
    from megamoe_cli.fused import FusedBackend, mega_moe, synchronize
    from megamoe_cli.layout import preset
    from megamoe_cli.problem import make_problem

    shape = preset(preset_name)
    problem = make_problem(shape, 0, 1, num_tokens, num_tokens, device=device)
    runner = FusedBackend().prepare(problem, None, {})
    runner()
    synchronize(runner.buf)
    p = runner.problem

    def eager():
        mega_moe(runner.y, runner.l1, runner.l2, runner.buf, x=p.x, x_sf=p.x_sf, topk_idx=p.topk_idx,
                 topk_weights=p.topk_weights, config=runner.kernel_cfg)

    eager()
    plan = list(runner.buf.plans.values())[-1]  # the plan the eager call used
    stream = torch.cuda.current_stream(device).cuda_stream

    def launch():  # the prepared launch alone: no checks, the block as the last call left it
        plan.prepared.launch(stream)

    def sync():
        synchronize(runner.buf)

    rows = {"launch": measure(launch, sync, calls, samples), "eager call": measure(eager, sync, calls, samples)}
    replay = graph_of(torch, eager, device)
    rows["graph replay"] = measure(replay, sync, calls, samples)
    rows["config"] = runner.config
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="deepseek-v3", help="model shape of the fused layer (default deepseek-v3)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per call of the fused layer (default 1)")
    ap.add_argument("--calls", type=int, default=50, help="calls per batch (default 50)")
    ap.add_argument("--samples", type=int, default=20, help="batches; the median is reported (default 20)")
    ap.add_argument("--skip-fused", action="store_true", help="the trivial kernel only (no kernel build of the layer)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    args = ap.parse_args()
    if args.calls < 1 or args.samples < 1 or args.tokens < 1:
        ap.error(f"--calls, --samples and --tokens must be positive, got {args.calls}, {args.samples}, {args.tokens}")

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("launch_cost: needs a CUDA GPU (sm_90a for the fused layer), but torch sees none")
    device = torch.device("cuda", torch.cuda.current_device())
    from megamoe_cli.kernel.jit import driver

    if hasattr(driver, "cu"):  # the tree under test binds the driver through cuda.bindings (else ctypes)
        import cuda.bindings

        binding = f"cuda.bindings {cuda.bindings.__version__}"
    else:
        binding = "ctypes"
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "binding": binding,
        "calls_per_batch": args.calls,
        "samples": args.samples,
        "trivial": trivial_kernel(torch, device, args.calls, args.samples),
    }
    if not args.skip_fused:
        result["fused"] = fused_layer(torch, device, args.preset, args.tokens, args.calls, args.samples)
        result["fused_tokens"] = args.tokens
        result["preset"] = args.preset
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['gpu']}, torch {result['torch']}, driver binding: {result['binding']}; "
          f"us per call, median of {args.samples} batches of {args.calls}", file=sys.stderr)
    print(f"{'what':<32} {'host':>8} {'loop':>8}")
    for group in ("trivial", "fused"):
        for name, row in result.get(group, {}).items():
            if name == "config":
                continue
            label = f"{group}: {name}" if group == "trivial" else f"fused {args.tokens} tok: {name}"
            print(f"{label:<32} {row['host_us']:>8.1f} {row['loop_us']:>8.1f}")
    if "fused" in result:
        gap = result["fused"]["eager call"]["loop_us"] - result["fused"]["graph replay"]["loop_us"]
        print(f"eager call loop - graph replay loop: {gap:.1f} us (target: within 10 us)")


if __name__ == "__main__":
    main()
