"""Strata: an inference daemon for large language models (build script: the cffi C core in native/)."""
import os
import sys
import warnings

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "native"))
from build_cuda import build_cuda_kernels  # noqa: E402


WEB_PACKAGES = ["strata.serve.web", "strata.serve.web.vendor"]


class BuildPyWithCuda(build_py):
    """Compile native/cuda/*.cu into strata/_cuda_kernels.so (and its header _cuda_kernels.h) where it can be used:
    nvcc present and an NVIDIA GPU visible, or STRATA_CUDA=1; an unchanged tree is not compiled again.

    STRATA_NO_CUDA=1 skips it; a failed nvcc build is a warning, never a failed install (the CPU backend runs).
    """

    def run(self):
        if os.environ.get("STRATA_NO_CUDA") != "1":
            try:
                build_cuda_kernels(only_if_usable=True)
            except RuntimeError as e:
                warnings.warn(f"CUDA kernels not built: {str(e).splitlines()[0]}")
        super().run()


setup(
    name="strata",
    version="0.1.0",
    description="An inference daemon for LLMs with conversation checkpoints of hybrid models' running state",
    python_requires=">=3.11",
    # strata/serve/web/ holds the chat page's files (no Python): listed as data packages, as setuptools asks
    packages=find_packages(include=["strata", "strata.*", "link", "link.*"]) + WEB_PACKAGES,
    include_package_data=True,
    package_data={"strata": ["_cuda_kernels.so", "_cuda_kernels.h"],
                  **{p: ["*.html", "*.js", "*.css", "*.svg", "*.txt", "*.md"] for p in WEB_PACKAGES}},
    cmdclass={"build_py": BuildPyWithCuda},
    setup_requires=["cffi>=1.16"],
    cffi_modules=["native/build_cpu.py:ffibuilder"],
    install_requires=[
        "numpy>=1.26",
        "cffi>=1.16",
        "gguf>=0.10",
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "structlog>=24.1",
        "uvloop>=0.19",
        "aiohttp>=3.9",
        "prometheus-client>=0.20",
        "tqdm>=4.60",
        "llguidance>=1.9",
        "cryptography>=42",
        "jiter>=0.5",                # cut tool arguments read as the anthropic SDK reads them (messages_api.py)
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-asyncio>=0.23",
            "hypothesis>=6.100",
            "openai>=1.66",              # the Responses API (tests/test_serve_responses.py)
            "anthropic>=0.41",           # the Messages API's client (tests/test_serve_messages.py)
            "ollama>=0.4",               # Ollama's API's client (tests/test_serve_ollama.py)
            "jsonschema>=4.20",
            "torch==2.13.0",
            "transformers>=4.46",
            "accelerate>=0.30",
            "sentencepiece",
            "protobuf",
            "selenium>=4.20",
        ],
        "bench": ["llama-cpp-python>=0.3", "matplotlib>=3.7"],
        "gpu": ["cupy-cuda13x"],
    },
    entry_points={
        "console_scripts": [
            "strata=strata.cli.main:main",
            "stratactl=strata.cli.ctl:main",
        ]
    },
)
