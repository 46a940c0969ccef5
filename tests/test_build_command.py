"""`megamoe build`: the variants a run would launch, compiled into the JIT cache without a GPU."""

import importlib
import json
import shutil
from dataclasses import replace

import pytest

import megamoe_cli.kernel.jit as jit
from cli_checks import assert_one_line_error, run_cli
from megamoe_cli.fused import resolve_config
from megamoe_cli.kernel.kernel_source import Variant
from megamoe_cli.layout import PRESETS

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
BUILD_MODULE = importlib.import_module("megamoe_cli.kernel.jit.build")  # the package's `build` is the function


@needs_nvcc
@pytest.mark.slow
def test_it_builds_each_point_and_config_once_and_a_second_run_finds_them_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    args = ["build", "--preset", "small", "--weights", "fp4", "--tokens", "16,64", "--configs", "64:4,auto", "--json"]
    first = run_cli(*args)
    assert first.exit_code == 0, first.output
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    # per token capacity: 64:4, then what auto resolves to on an H200 (once, if it is 64:4 too)
    shape = replace(PRESETS["small"], weights="fp4")
    expected = []
    for tokens in (16, 64):
        cfg, _ = resolve_config(shape, 1, tokens, {}, gpu="H200")
        for block_m, stages in ((64, 4), (cfg.block_m, cfg.num_stages)):
            name = Variant(shape, 1, tokens, block_m, stages).name
            if name not in expected:
                expected.append(name)
    assert [r["variant"] for r in rows] == expected and len(expected) >= 2
    assert all(not r["cached"] and r["refused"] is None and r["profiling"] is False for r in rows)
    assert all((tmp_path / r["cubin"].split(str(tmp_path) + "/")[1]).is_file() for r in rows)
    again = run_cli(*args)
    assert again.exit_code == 0 and all(json.loads(line)["cached"] for line in again.stdout.splitlines())


@needs_nvcc
@pytest.mark.slow
def test_profiling_adds_the_profiling_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    result = run_cli("build", "--preset", "small", "--tokens", "16", "--configs", "64:4", "--profiling", "--json")
    assert result.exit_code == 0, result.output
    names = [json.loads(line)["variant"] for line in result.stdout.splitlines()]
    plain = Variant(PRESETS["small"], 1, 16, 64, 4).name
    assert names == [plain, plain + "_profile"]


class FakeReport:
    def __init__(self, spills=False, serialized=()):
        self.has_spills, self.serialized_wgmma = spills, list(serialized)

    def summary(self):
        return "fake: " + ("SPILLS" if self.has_spills else "clean")


class FakeKernel:
    def __init__(self, name, report):
        self.name, self.report, self.from_cache, self.cubin_path = name, report, False, f"/fake/{name}.cubin"


def test_a_variant_the_runtime_would_refuse_exits_3_naming_it(monkeypatch):
    monkeypatch.setattr(BUILD_MODULE, "find_nvcc", lambda: "nvcc")

    def fake_build(sources):
        return [FakeKernel(s.name, FakeReport(spills="t64" in s.name, serialized=("C7511",) if "_t16_" in s.name
                                              else ())) for s in sources]

    monkeypatch.setattr(jit, "build", fake_build)
    result = run_cli("build", "--preset", "small", "--tokens", "16,64,256", "--configs", "64:4")
    assert result.exit_code == 3, result.output
    assert "REFUSED: serialized WGMMAs" in result.stderr and "REFUSED: spills registers" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "2 of 3 variant(s) would be refused at launch" in last and "_t256_" not in last


def test_profiling_builds_may_spill(monkeypatch):
    monkeypatch.setattr(BUILD_MODULE, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(jit, "build", lambda sources: [FakeKernel(s.name, FakeReport(spills=s.name.endswith("_profile")))
                                                        for s in sources])
    result = run_cli("build", "--preset", "small", "--tokens", "16", "--configs", "64:4", "--profiling")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args, fragments", [
    (["--gpu", "A100"], ["A100"]),
    (["--configs", "64:9"], ["kernel config 64:9", "num_stages"]),
    (["--ranks", "3"], ["divisible by num_ranks=3"]),
])
def test_bad_input_is_one_line(monkeypatch, args, fragments):
    monkeypatch.setattr(BUILD_MODULE, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(jit, "build", lambda sources: pytest.fail("nothing may build on bad input"))
    assert_one_line_error(run_cli("build", "--preset", "small", "--tokens", "16", *args), *fragments)
