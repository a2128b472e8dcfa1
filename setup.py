"""Package discovery, the one part of the build that pyproject.toml cannot express: every ``torchtune_ac``
package, and the top-level ``recipes/`` and ``configs/`` folders shipped as ``torchtune_ac._recipes`` and
``torchtune_ac._configs`` (with each config folder), so that a new package or config folder needs no line
anywhere. Everything else is in pyproject.toml."""

from setuptools import find_namespace_packages, find_packages, setup

setup(
    packages=[
        *find_packages(include=["torchtune_ac", "torchtune_ac.*"]),
        # data folders inside a package (the embedded preference pairs) are packages too, or setuptools warns
        *find_namespace_packages(include=["torchtune_ac.data.embedded.*"], exclude=["*.__pycache__"]),
        "torchtune_ac._recipes",
        "torchtune_ac._configs",
        *(f"torchtune_ac._configs.{folder}" for folder in find_namespace_packages("configs")),
    ]
)
