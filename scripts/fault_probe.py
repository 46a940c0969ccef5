"""Make the fused kernel fail on purpose and report how it failed (spawned by tests/gpu/test_fused_faults.py).

A kernel that traps takes its CUDA context down with it, so each fault runs in a process of
its own.  Every case first runs one valid call (which builds and loads the kernel variant and
proves the setup works), then the faulty one, and ends in one of three ways:

* exit 3 after printing ``rank R: the call failed after S s: <diagnostic>``: ``synchronize``
  raised ``MegaMoETimeout`` carrying the kernel's failure record;
* exit 0 after printing ``rank R: the call finished without an error``;
* any other exit: the probe itself broke (traceback on stderr).

Cases:

* ``bad_topk``: one ``topk_idx`` entry names expert 1000, past ``num_experts`` (world size 1);
* ``repeated_expert``: every top-k slot of every token names expert 0, so that expert receives
  ``num_topk`` times more pairs from this rank than the buffer has rows for;
* ``missing_rank``: the last rank skips the call and sleeps, the others wait for it until
  ``MEGAMOE_TIMEOUT_S`` (run under ``torchrun --nproc-per-node 2`` or more);
* ``slow_publisher``: every call runs the ``SLOW_PUBLISHER`` build (each CTA's L1 publisher
  warp starts 2 ms late, so consumers with a third L1 tile wait for it); the call's output is
  compared with the reference (exit 0 and ``matches the reference``, or exit 4);
* ``stuck_publisher``: after the valid call, the ``STUCK_PUBLISHER`` build (the publisher
  never publishes): the consumers' wait for it times out with its diagnostic.

The publisher cases run ``PUBLISHER_TOKENS`` tokens on ``PUBLISHER_SMS`` SMs with block_m 64,
so every CTA takes more than two L1 tiles.

``--tokens`` sets the call's tokens (and the buffer's): at most 96 pairs (24 tokens at top-4) are
counted by one CTA in shared memory, more by atomics on the owners' counters; each path has its
own range and overflow checks.

    PYTHONPATH=. python3 scripts/fault_probe.py --case bad_topk
    PYTHONPATH=. MEGAMOE_TIMEOUT_S=3 torchrun --nproc-per-node 2 scripts/fault_probe.py --case missing_rank
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megamoe_cli.errors import MegaMoETimeout
from megamoe_cli.fused import FusedBackend, mega_moe, synchronize
from megamoe_cli.kernel.kernel_source import ENV_EXPERIMENT
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference.layer import moe_reference_distributed

CASES = ("bad_topk", "repeated_expert", "missing_rank", "slow_publisher", "stuck_publisher")
PUBLISHER_TOKENS = 256  # 1024 pairs: ~64 rows per expert, ~25 blocks of 64, ~50 L1 tiles
PUBLISHER_SMS = 4  # a CTA holds at most 4 L1 tiles when its consumers stop (3 + a ring of 4 stages)
PUBLISHER_CONFIG = {"block_m": 64, "num_stages": 4, "num_sms": PUBLISHER_SMS}
MAX_REL_ERR = 2e-2
EXIT_MISMATCH = 4
SHAPE = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
NUM_TOKENS = 16  # 64 pairs: the shared-memory count; 32 tokens (128 pairs) take the atomics
# The pair (token 5, slot 1) of the bad_topk case: the diagnostic's index names it.
BAD_PAIR = 5 * SHAPE.num_topk + 1
BAD_EXPERT = 1000
EXIT_DIAGNOSED = 3
EXIT_USAGE = 2


def say(rank: int, message: str) -> None:
    print(f"rank {rank}: {message}", flush=True)


def finish(code: int) -> None:
    # A trapped kernel leaves a dead CUDA context; exit without the teardown that would touch it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--pid-dir", type=Path, help="write rank<R>.pid here, so a caller can stop this run")
    parser.add_argument("--sleep-s", type=float, default=300.0, help="how long the missing rank sleeps")
    parser.add_argument("--tokens", type=int, default=NUM_TOKENS, help="tokens of the call and of the buffer")
    args = parser.parse_args()
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    if args.case == "bad_topk" and args.tokens * SHAPE.num_topk <= BAD_PAIR:
        parser.error(f"bad_topk corrupts pair {BAD_PAIR}: --tokens must be at least "
                     f"{BAD_PAIR // SHAPE.num_topk + 1}, got {args.tokens}")

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.pid_dir is not None:
        (args.pid_dir / f"rank{rank}.pid").write_text(json.dumps({"pid": os.getpid(), "rank": rank}))
    if args.case == "missing_rank" and world_size < 2:
        print("missing_rank needs at least 2 ranks (run it under torchrun)", file=sys.stderr, flush=True)
        finish(EXIT_USAGE)

    torch.cuda.set_device(local_rank)
    group = None
    if world_size > 1:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", local_rank))
        group = dist.group.WORLD

    publisher = args.case in ("slow_publisher", "stuck_publisher")
    tokens = PUBLISHER_TOKENS if publisher else args.tokens
    if args.case == "slow_publisher":
        os.environ[ENV_EXPERIMENT] = "SLOW_PUBLISHER"
    problem = make_problem(SHAPE, rank, world_size, tokens, tokens, "cuda", seed=0)
    runner = FusedBackend().prepare(problem, group, dict(PUBLISHER_CONFIG) if publisher else {})
    buf = runner.buf
    runner.y.fill_(float("nan"))
    runner()
    synchronize(buf)
    say(rank, "a valid call finished")
    if group is not None:
        dist.barrier(group=group)

    if args.case == "slow_publisher":
        ref = moe_reference_distributed(problem, group)
        err = float((runner.y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        if not (torch.isfinite(runner.y).all() and err < MAX_REL_ERR):
            say(rank, f"the call does not match the reference: rel_err {err:.3e} (at most {MAX_REL_ERR:g} expected)")
            finish(EXIT_MISMATCH)
        say(rank, f"the call matches the reference: rel_err {err:.3e}")
        finish(0)

    if args.case == "stuck_publisher":
        os.environ[ENV_EXPERIMENT] = "STUCK_PUBLISHER"  # a new build, and a new plan for it
    elif args.case == "bad_topk":
        buf.topk_idx[:tokens].view(-1)[BAD_PAIR] = BAD_EXPERT
    elif args.case == "repeated_expert":
        buf.topk_idx[:tokens].fill_(0)
    elif rank == world_size - 1:
        say(rank, f"skipping the call at {time.time():.3f} and sleeping {args.sleep_s:g} s")
        time.sleep(args.sleep_s)
        finish(0)

    started = time.monotonic()
    try:
        mega_moe(runner.y, runner.l1, runner.l2, buf, config=runner.kernel_cfg)
        synchronize(buf)
    except MegaMoETimeout as exc:
        say(rank, f"the call failed after {time.monotonic() - started:.1f} s: {exc}")
        finish(EXIT_DIAGNOSED)
    say(rank, "the call finished without an error")
    finish(0)


if __name__ == "__main__":
    main()
