"""What installs the project: every optional extra's packages are in the test extra that CI
installs (so their tests run there, not skip), and the README's first command takes torch's CPU
build from PyTorch's CPU index."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_test_extra_holds_every_optional_extra():
    """Every extra but the peers': those run on Hopper GPUs only (their GPU tier), and CI never
    installs them."""
    from megamoe_cli.baselines.peers import PEER_OF

    extras = PROJECT["optional-dependencies"]
    test = set(extras["test"])
    assert {"parquet", "safetensors", "plot"} <= set(extras)
    peer_extras = {peer.extra for peer in PEER_OF.values()}
    assert peer_extras <= set(extras), "every peer's extra is declared"
    for name, requirements in extras.items():
        if name in peer_extras:
            assert not set(requirements) & test, f"the peers' extra {name!r} must stay out of CI's test extra"
            continue
        missing = set(requirements) - test
        assert not missing, f"extra {name!r}: {sorted(missing)} not in the test extra, so CI would skip its tests"


def test_ci_installs_the_test_extra_and_a_cpu_torch():
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -e '.[test]'" in ci
    assert re.search(r"pip install torch==[\d.]+ --extra-index-url https://download\.pytorch\.org/whl/cpu", ci)


def test_the_readmes_first_command_takes_torch_from_the_cpu_index():
    readme = (REPO / "README.md").read_text()
    first = re.search(r"## Two commands on a fresh machine.*?```bash\n(.*?)\n```", readme, re.DOTALL).group(1)
    assert re.match(r"pip install torch==([\d.]+) --index-url https://download\.pytorch\.org/whl/cpu && "
                    r"pip install -e \. && megamoe bench$", first)


def test_the_torch_floor_is_a_version_that_was_run():
    (torch_requirement,) = [r for r in PROJECT["dependencies"] if r.startswith("torch")]
    assert torch_requirement == "torch>=2.11"  # the GPU machine's 2.11.0+cu130; the CPU tests run 2.13.0


def test_the_kernel_sources_are_found_in_the_source_tree_and_in_a_wheel(tmp_path):
    """setup.py ships csrc/ as megamoe_cli/csrc; the source tree keeps it beside the package."""
    from megamoe_cli.errors import MegaMoEError
    from megamoe_cli.kernel.kernel_source import PACKAGE_DIR, csrc_dir

    assert PACKAGE_DIR == REPO / "megamoe_cli"
    assert csrc_dir() == REPO / "csrc"
    wheel = tmp_path / "site-packages" / "megamoe_cli"
    (wheel / "csrc" / "megamoe").mkdir(parents=True)
    (wheel / "csrc" / "megamoe" / "kernel.cuh").write_text("")
    assert csrc_dir(wheel) == wheel / "csrc"
    with pytest.raises(MegaMoEError, match="kernel sources not found next to .*expected csrc/megamoe/kernel.cuh"):
        csrc_dir(tmp_path / "elsewhere" / "megamoe_cli")
