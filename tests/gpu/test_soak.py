"""Soak: 10,000 back-to-back fused calls through one buffer, routing and token counts changing
from call to call, eager launches mixed with CUDA-graph replays; every call checked.

Each problem's first call is judged against the reference (computed once per problem, the rule
of megamoe_cli.reference.tolerance) and its output fingerprinted (``helpers.checksum``: FP64 sums of the
values and of the position-weighted values, on the GPU).  Every later call has its ``y`` filled
with NaN first, so a row it leaves unwritten shows, and its fingerprint compared on the GPU with
the first call's: a mismatch is recorded per call without a host sync, and the record is read
(every rank's pooled) every 500 calls and at the end, naming the first call that differed.  The
500th calls and the last ones are also judged against the reference in full.

A counter the kernel fails to return to zero, a stale pool row, a combine slot read before its
push landed or an epoch that drifts between eager and graph launches shows up here as a call
whose output differs, a NaN or a hang (a timeout with a diagnostic).  World size 1 and under
torchrun: every rank runs the same call sequence.  Deselect with ``-m "not soak"``.
"""

import dataclasses
import random

import pytest
import torch

from megamoe_cli.fused import FusedBackend, mega_moe, synchronize
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference.layer import moe_reference_distributed
from helpers import assert_output_ok, checksum

pytestmark = [pytest.mark.gpu, pytest.mark.soak]

SHAPE = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
NUM_MAX_TOKENS = 128
NUM_CALLS = 10_000
SAMPLE_EVERY = 500
GRAPH_SHARE = 0.25
SEQUENCE_SEED = 2024
# (routing, tokens on rank 0, extra tokens per rank), clipped to [0, NUM_MAX_TOKENS]: full,
# empty, uneven across ranks, single-token and mostly-invalid problems.
PROBLEMS = (
    ("random", NUM_MAX_TOKENS, 0),
    ("imbalanced", 1, 50),
    ("with_invalid", 77, 0),
    ("one_expert", 0, 9),
    ("random", 0, 0),
    ("imbalanced", NUM_MAX_TOKENS, -31),
    ("random", 33, 1),
    ("with_invalid", 5, 0),
)


def rank_and_world(group):
    import torch.distributed as dist

    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def make_problems(rank, world):
    """The soak's problems; they share problem 0's experts, since one set of weights serves the whole run."""
    problems = []
    for index, (routing, tokens, per_rank) in enumerate(PROBLEMS):
        num_tokens = min(NUM_MAX_TOKENS, max(0, tokens + per_rank * rank))
        problem = make_problem(SHAPE, rank, world, num_tokens, NUM_MAX_TOKENS, "cuda", seed=100 + index,
                               routing=routing)
        if problems:
            first = problems[0]
            problem = dataclasses.replace(problem, w1=first.w1, w1_sf=first.w1_sf, w2=first.w2, w2_sf=first.w2_sf)
        problems.append(problem.validate())
    return problems


class Soak:
    def __init__(self, group):
        self.group = group
        rank, world = rank_and_world(group)
        self.problems = make_problems(rank, world)
        runner = FusedBackend().prepare(self.problems[0], group, {})
        self.buf, self.l1, self.l2, self.config = runner.buf, runner.l1, runner.l2, runner.kernel_cfg
        self.refs = [moe_reference_distributed(p, group) for p in self.problems]
        self.ys = [torch.empty(p.num_tokens, SHAPE.hidden, dtype=torch.bfloat16, device="cuda") for p in self.problems]
        self.firsts = [None] * len(self.problems)
        self.first_sums = [None] * len(self.problems)
        # Per call: 0 = matched its problem's first output, 1 = differed (set on the GPU).
        self.differed = torch.zeros(NUM_CALLS, dtype=torch.int32, device="cuda")
        self.graphs = []
        self.calls = 0

    def launch(self, index):
        """Even problems give their inputs to mega_moe (the kernel copies them); odd ones fill the
        buffer first.  Either way, consecutive calls bring different inputs."""
        problem, buf = self.problems[index], self.buf
        inputs = (problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights)
        if index % 2 == 0:
            mega_moe(self.ys[index], self.l1, self.l2, buf, config=self.config,
                     **dict(zip(("x", "x_sf", "topk_idx", "topk_weights"), inputs)))
        else:
            buf.fill(*inputs)
            mega_moe(self.ys[index], self.l1, self.l2, buf, config=self.config)

    def call(self, index, graph=False):
        """One call, its output compared with the problem's first on the GPU (no host sync)."""
        y = self.ys[index]
        y.fill_(float("nan"))
        if graph:
            self.graphs[index].replay()
        else:
            self.launch(index)
        if self.first_sums[index] is not None:
            self.differed[self.calls] = (checksum(y) != self.first_sums[index]).any().int()
        self.calls += 1

    def capture(self):
        for index in range(len(self.problems)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.launch(index)
            self.graphs.append(graph)

    def assert_every_call_matched(self):
        """Every call so far matched its problem's first output, on every rank."""
        differed = self.differed[: self.calls].clone()
        if self.group is not None:
            staged = differed.cpu() if torch.distributed.get_backend(self.group) == "gloo" else differed
            torch.distributed.all_reduce(staged, op=torch.distributed.ReduceOp.MAX, group=self.group)
            differed = staged
        bad = torch.nonzero(differed).flatten().tolist()
        assert not bad, (f"{len(bad)} of {self.calls} calls differ from their problem's first output "
                         f"(a NaN: a row left unwritten); the first is call {bad[0]}")

    def checked_call(self, index, graph=False):
        """One call judged against the reference too; the problem's first call sets its fingerprint."""
        self.call(index, graph)
        synchronize(self.buf)
        y, problem = self.ys[index], self.problems[index]
        where = f"call {self.calls - 1} (problem {index}, {'graph replay' if graph else 'eager'})"
        assert_output_ok(y, self.refs[index], problem.topk_idx, SHAPE.intermediate, self.group, what=where)
        if self.firsts[index] is None:
            self.firsts[index] = y.clone()
            self.first_sums[index] = checksum(y)
        same = torch.tensor([float(torch.equal(y, self.firsts[index]))], device="cuda")
        if self.group is not None:
            staged = same.cpu() if torch.distributed.get_backend(self.group) == "gloo" else same
            torch.distributed.all_reduce(staged, op=torch.distributed.ReduceOp.MIN, group=self.group)
            same = staged
        assert same.item() == 1, f"{where}: differs bitwise from the problem's first result"
        self.assert_every_call_matched()


def test_ten_thousand_calls_with_changing_routing_and_graph_replays(group):
    soak = Soak(group)
    sequence = random.Random(SEQUENCE_SEED)  # identical on every rank
    count = len(PROBLEMS)

    for index in range(count):
        soak.checked_call(index)
    soak.capture()
    while soak.calls < NUM_CALLS - count:
        index = sequence.randrange(count)
        graph = sequence.random() < GRAPH_SHARE
        if (soak.calls + 1) % SAMPLE_EVERY == 0:
            soak.checked_call(index, graph)
        else:
            soak.call(index, graph)
    for index in range(count):
        soak.checked_call(index, graph=bool(index % 2))
    assert soak.calls == NUM_CALLS
