"""Builds the qbl PyTorch package against the torch already installed:

    pip install --no-build-isolation ./python

The extension is compiled from the library's own headers (../include); nothing is copied. Where
torch has CUDA it builds the CPU and the CUDA kernels (nvcc from the CUDA Toolkit, whose major
version must be torch's); where torch has none, the CPU kernels alone, with the C++ compiler only
(no CUDA Toolkit needed).

Environment: TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: those of the visible GPUs,
as torch.utils.cpp_extension decides; a machine without a GPU must set it, e.g. "9.0");
QBL_CPU_ONLY=1 builds the CPU kernels alone even where torch has CUDA; QBL_INCLUDE_DIR points at
another checkout's include/; QBL_CXX_STD sets the C++ standard (default c++17, the library's;
torch releases that need C++20 for their own headers build with QBL_CXX_STD=c++20).
"""

import os
import pathlib

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

HERE = pathlib.Path(__file__).resolve().parent
INCLUDE = pathlib.Path(os.environ.get("QBL_INCLUDE_DIR", HERE.parent / "include")).resolve()
if not (INCLUDE / "qbl" / "element_math.hpp").is_file():
    raise RuntimeError(
        f"qbl headers not found under {INCLUDE}: install from a qbl checkout "
        "(pip install --no-build-isolation ./python) or set QBL_INCLUDE_DIR")
STD = os.environ.get("QBL_CXX_STD", "c++17")
WITH_CUDA = torch.version.cuda is not None and os.environ.get("QBL_CPU_ONLY", "") != "1"


def version() -> str:
    fields = {}
    for line in (INCLUDE / "qbl" / "version.hpp").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("QBL_VERSION_"):
            fields[parts[1]] = parts[2]
    return ".".join(fields[f"QBL_VERSION_{k}"] for k in ("MAJOR", "MINOR", "PATCH"))


def check_cuda_build() -> None:
    """Clear errors, before compiling, for what torch's extension builder would report late."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        raise RuntimeError(
            f"torch {torch.__version__} has CUDA {torch.version.cuda} but no CUDA Toolkit was found "
            "(nvcc on PATH or CUDA_HOME): install the toolkit of that major version, or build the "
            "CPU kernels alone with QBL_CPU_ONLY=1")
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        raise RuntimeError(
            "no GPU is visible to choose the CUDA architectures from: set TORCH_CUDA_ARCH_LIST "
            "(e.g. TORCH_CUDA_ARCH_LIST=9.0 for an H100/H200), or build the CPU kernels alone "
            "with QBL_CPU_ONLY=1")


# One file per concern (csrc/qbl_torch.h says which); everything outside csrc/cuda/ is plain C++.
SOURCES = ["csrc/ops.cpp", "csrc/checks.cpp", "csrc/eager_ops.cpp", "csrc/cpu/cpu_kernels.cpp",
           "csrc/autograd/autograd_kernel.cpp", "csrc/autocast/autocast_kernel.cpp"]
CUDA_SOURCES = (["csrc/cuda/layer_registry.cu", "csrc/cuda/cuda_kernels.cu"]
                # each activation's plans in a file of their own: they compile in parallel
                + [f"csrc/cuda/plans_{a}.cu"
                   for a in ("identity", "gelu", "gelu_tanh", "relu", "silu")])
# IEEE arithmetic as the library requires: no fast math, and no FMA contraction where eager rounds
# twice (the C++ compiler's default contracts wherever the target has FMA). -fno-trapping-math
# changes no value (it lets the compiler if-convert and vectorize the CPU kernels' loops).
CXX_FLAGS = ["-O3", f"-std={STD}", "-ffp-contract=off", "-fno-trapping-math"]

if WITH_CUDA:
    check_cuda_build()
    extension = CUDAExtension(
        name="qbl._C", sources=SOURCES + CUDA_SOURCES, include_dirs=[str(INCLUDE)],
        libraries=["cublasLt"],
        extra_compile_args={"cxx": CXX_FLAGS + ["-DQBL_WITH_CUDA"],
                            "nvcc": ["-O3", f"-std={STD}", "-DQBL_WITH_CUDA"]})
else:
    extension = CppExtension(name="qbl._C", sources=SOURCES, include_dirs=[str(INCLUDE)],
                             extra_compile_args=CXX_FLAGS)

setup(
    name="qbl",
    version=version(),
    description="Fused fake-quantize, blend and linear layer (qbl) for PyTorch: forward and backward",
    packages=["qbl"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
