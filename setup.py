"""specserve: an LLM serving runtime built around lossless speculative decoding."""

from setuptools import find_packages, setup

setup(
    name="specserve",
    version="0.1.0",
    description="LLM serving runtime with lossless speculative decoding (EAGLE, NGRAM, ...)",
    python_requires=">=3.10",
    packages=find_packages(include=["specserve", "specserve.*"]),
    py_modules=["launch_server"],
    package_data={"specserve.runtime.entrypoints": ["playground/*"]},  # the page at / (plain files)
    install_requires=[
        # torch is installed first, pinned, by the Makefile (a CPU build on CPU machines);
        # this range only checks it.
        "torch>=2.5",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers>=4.45",
        "jinja2",
        "gguf>=0.10",
        "tqdm",
        "msgspec",
        "pyzmq",
        "fastapi",
        "uvicorn",
        "uvloop; platform_system != 'Windows'",
        "prometheus-client",
        "httpx",
        # the CPU extension (specserve/kernels/cpu) is compiled on first use with ninja + g++
        "ninja",
        # constrained decoding (specserve/runtime/constrained): its wheel needs torch, transformers,
        # triton, which are installed already; pinned, since compiled grammars cross processes
        # in its own serialization format
        "xgrammar==0.2.8",
        # --grammar-backend llguidance (no dependencies; grammars ship as text)
        "llguidance==1.9.1",
    ],
    extras_require={
        "gpu": ["flashinfer-python", "sgl-kernel"],
        "bench": ["matplotlib", "aiohttp"],
        # triton: its interpreter runs the CUDA kernels on the CPU in the test suite
        # pytest-xdist: `make test` runs the suite in two workers
        # jsonschema: the structured-output tests validate outputs against their schemas
        # sglang-router: a test runs the real router in front of a server
        # selenium: the playground's browser test drives the system's Chromium with it
        # schemathesis: the suite fuzzes the served OpenAPI spec (benchmark/fuzz_openapi.py);
        # its hypothesis drives the request parsers' property tests
        "dev": ["pytest", "pytest-xdist", "ruff", "openai", "matplotlib", "triton==3.9.0",
                "jsonschema", "sglang-router==0.3.2", "selenium", "schemathesis==4.32.5"],
    },
)
