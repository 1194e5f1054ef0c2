"""mppo: a Megatron-style PPO/GRPO trainer for LLMs (torchrun/Slurm, no Ray)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

# megatron-core: the tested range only (mppo/versions.py says why), read as text: nothing is installed yet.
_VERSIONS = (Path(__file__).parent / "mppo" / "versions.py").read_text()
MEGATRON_CORE = re.search(r'MEGATRON_CORE_SUPPORTED = "([^"]+)"', _VERSIONS).group(1)
CORE = [
    "torch>=2.6",
    f"megatron-core{MEGATRON_CORE}",
    "omegaconf>=2.3",
    "numpy",
    "transformers>=4.45",
    "safetensors",
    "tokenizers",
    "pyarrow",
    "tqdm",
    "psutil",
    "packaging",
    "matplotlib",
    "tensorboard",
]

setup(
    name="mppo",
    version="0.1.0",
    description="Megatron-style PPO/GRPO trainer for LLMs: megatron-core actor/critic, SGLang rollout, Triton kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["mppo", "mppo.*"]) + ["mppo.kernels"],
    package_dir={"mppo.kernels": "kernels"},
    # The stand-ins SGLang needs on the CPU are put on PYTHONPATH as files (mppo/rollout/sglang_cpu).
    package_data={"mppo": ["../configs/*.yaml", "rollout/sglang_cpu/standins/*.py",
                           "rollout/sglang_cpu/standins/sgl_kernel/*.py"]},
    install_requires=CORE,
    extras_require={
        # GPU-only packages; imported lazily, a run that needs one names this extra when it is missing.
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5.23,<0.6", "triton"],
        # reading GGUF files (`mppo convert gguf-to-hf`, the real-model demo): transformers needs both
        "gguf": ["gguf", "accelerate"],
        # triton is here too: its kernels are tested on CPU under TRITON_INTERPRET=1; gguf: the real-model tests.
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.6", "triton", "gguf", "accelerate", "peft"],
    },
    entry_points={"console_scripts": ["mppo=mppo.cli:main"]},
)
