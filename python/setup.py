"""Builds the qbl PyTorch package against the torch already installed:

    pip install --no-build-isolation ./python

The extension is compiled from the library's own headers (../include); nothing is copied.
Environment: TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: those of the visible
GPUs, as torch.utils.cpp_extension decides); QBL_INCLUDE_DIR points at another checkout's include/;
QBL_CXX_STD sets the C++ standard (default c++17, the library's; torch releases that need C++20
for their own headers build with QBL_CXX_STD=c++20).
"""

import os
import pathlib

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = pathlib.Path(__file__).resolve().parent
INCLUDE = pathlib.Path(os.environ.get("QBL_INCLUDE_DIR", HERE.parent / "include")).resolve()
if not (INCLUDE / "qbl" / "qbl.cuh").is_file():
    raise RuntimeError(
        f"qbl headers not found under {INCLUDE}: install from a qbl checkout "
        "(pip install --no-build-isolation ./python) or set QBL_INCLUDE_DIR")
STD = os.environ.get("QBL_CXX_STD", "c++17")


def version() -> str:
    fields = {}
    for line in (INCLUDE / "qbl" / "version.hpp").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("QBL_VERSION_"):
            fields[parts[1]] = parts[2]
    return ".".join(fields[f"QBL_VERSION_{k}"] for k in ("MAJOR", "MINOR", "PATCH"))


setup(
    name="qbl",
    version=version(),
    description="Fused fake-quantize, blend and linear layer (qbl) for PyTorch: forward and backward",
    packages=["qbl"],
    ext_modules=[
        CUDAExtension(
            name="qbl._C",
            # One file per concern (csrc/qbl_torch.h says which); the .cpp files need no nvcc.
            sources=["csrc/ops.cpp", "csrc/checks.cpp", "csrc/layer_registry.cu",
                     "csrc/cuda_kernels.cu", "csrc/autograd_kernel.cpp",
                     "csrc/autocast_kernel.cpp"]
            # each activation's plans in a file of its own: they compile in parallel
            + [f"csrc/plans_{a}.cu" for a in ("identity", "gelu", "gelu_tanh", "relu", "silu")],
            include_dirs=[str(INCLUDE)],
            libraries=["cublasLt"],
            # IEEE arithmetic as the library requires: no fast math, no FMA contraction beyond
            # what the headers ask for.
            extra_compile_args={"cxx": ["-O3", f"-std={STD}"], "nvcc": ["-O3", f"-std={STD}"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
