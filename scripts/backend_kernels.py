"""Where one layer call of a backend spends its GPU time, kernel by kernel (torch.profiler), at world
size 1: what `megamoe bench` times as one number, split so a pipeline's glue can be set against its
GEMMs.  Hopper GPU; the peers need their extras installed.

    python3 scripts/backend_kernels.py --backend deepgemm --preset deepseek-v3 --tokens 8192
    python3 scripts/backend_kernels.py --backend sglang-graph --tokens 1 --calls 20
"""

import argparse
import sys

import torch

from megamoe_cli.backends import get_backend
from megamoe_cli.layout import PRESETS
from megamoe_cli.problem import make_problem


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=5, help="profiled calls (after two warm-up calls)")
    parser.add_argument("--rows", type=int, default=25, help="kernels shown, by total GPU time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("backend_kernels.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    shape = PRESETS[args.preset]
    problem = make_problem(shape, 0, 1, args.tokens, args.tokens, "cuda", 0)
    runner = get_backend(args.backend).prepare(problem, None, {})
    for _ in range(2):
        runner()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            runner()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / args.calls
    print(f"{args.backend} {args.preset} x{args.tokens}: {total:,.1f} us of kernels per call; config {runner.config}")
    print(f"{'us/call':>10} {'share':>6} {'calls':>6}  kernel")
    for e in sorted(events, key=lambda e: e.device_time_total, reverse=True)[: args.rows]:
        per_call = e.device_time_total / args.calls
        print(f"{per_call:10.1f} {per_call / total:6.1%} {e.count // args.calls:6d}  {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
