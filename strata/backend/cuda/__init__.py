"""The CUDA backend: CuPy owns device memory, streams, graphs and cuBLAS; Strata's raw kernels (strata/_cuda_kernels.so,
built from native/cuda/ by native/build_cuda.py) are loaded through cffi in ABI mode and launched on CuPy's stream.

Each model family is defined once, in strata/models/; here is how its layers execute on a GPU:

* ``library``: the kernel library and the pointer / stream / error helpers; ``settings``: the switches and the
  launch-shape rules; ``weights``: weights on the device; ``pages``: the KV cache pages; ``gemm``: cuBLAS;
  ``attention``: paged attention as a backend op; ``gdn`` / ``gdn_prefill``: the Gated DeltaNet launchers.
* ``backend.CudaBackend``: the Backend ops, so any model's own forward runs on the GPU unchanged.
* ``runner``: the graph runner every family plan shares (DecodePlan, PlanModel); ``llama`` and ``qwen35``: the
  families' plans (fused kernels; one captured graph per context-size class); ``plans``: which plan runs a model.
"""
from strata.backend.cuda.backend import CudaBackend
from strata.backend.cuda.library import CudaUnavailable, open_kernel_library, unavailable_reason
from strata.backend.cuda.pages import CudaPagePool
from strata.backend.cuda.weights import DeviceWeight

CUDABackend = CudaBackend   # the name strata/stages/__init__.py imports

__all__ = ["CUDABackend", "CudaBackend", "CudaPagePool", "CudaUnavailable", "DeviceWeight", "open_kernel_library",
           "unavailable_reason"]
