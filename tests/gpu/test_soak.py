"""Soak: 10,000 back-to-back fused calls through one buffer, routing and token counts changing
from call to call, eager launches mixed with CUDA-graph replays, sampled against the reference
and against each problem's first result (bit for bit).

A counter the kernel fails to return to zero, a stale pool row, a combine slot read before its
push landed or an epoch that drifts between eager and graph launches shows up here as a wrong
sample, a NaN or a hang (a timeout with a diagnostic).  World size 1 and under torchrun: every
rank runs the same call sequence.  Deselect with ``-m "not soak"``.
"""

import dataclasses
import random

import pytest
import torch

from megamoe_cli.fused import FusedBackend, mega_moe, synchronize
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference import moe_reference_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.soak]

SHAPE = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
NUM_MAX_TOKENS = 128
NUM_CALLS = 10_000
SAMPLE_EVERY = 500
GRAPH_SHARE = 0.25
MAX_REL_ERR = 2e-2
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
        if graph:
            self.graphs[index].replay()
        else:
            self.launch(index)
        self.calls += 1

    def capture(self):
        for index in range(len(self.problems)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.launch(index)
            self.graphs.append(graph)

    def checked_call(self, index, graph=False):
        """One call whose output is compared with the reference and with the problem's first result,
        agreed on by every rank so all of them stop together."""
        y = self.ys[index]
        y.fill_(float("nan"))
        self.call(index, graph)
        synchronize(self.buf)
        ref = self.refs[index]
        err = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)) if y.numel() else 0.0
        if self.firsts[index] is None:
            self.firsts[index] = y.clone()
        bad = torch.tensor(
            [err, float(not torch.isfinite(y).all()), float(not torch.equal(y, self.firsts[index]))], device="cuda"
        )
        if self.group is not None:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=self.group)
        where = f"call {self.calls} (problem {index}, {'graph replay' if graph else 'eager'})"
        assert bad[1].item() == 0, f"{where}: NaN/Inf in y (rows left unwritten)"
        assert bad[0].item() < MAX_REL_ERR, f"{where}: rel_err {bad[0].item():.3e} against the reference"
        assert bad[2].item() == 0, f"{where}: differs bitwise from the problem's first result"


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
