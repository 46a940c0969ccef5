"""Package discovery pyproject.toml cannot express: every ``megamoe_cli`` subpackage, plus the CUDA
sources in ``csrc/`` shipped as ``megamoe_cli/csrc`` so an installed JIT finds its headers."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megamoe_cli", "megamoe_cli.*"]) + ["megamoe_cli.csrc"],
    package_dir={"megamoe_cli.csrc": "csrc"},
    package_data={"megamoe_cli.csrc": ["**/*.cuh", "**/*.cu", "**/*.h", "**/*.hpp", "**/*.cpp", "**/*.inc"],
                  "megamoe_cli": ["data/*.json"]},
)
