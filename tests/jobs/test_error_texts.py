"""Error classes from the texts real GPUs and real torch builds raise, each with where it was seen.

Every message below is quoted as it was reported, not written for the test: the classification
must survive torch's own wording, advice included. Texts abridged in their source keep the "…".
"""

from __future__ import annotations

import pytest
import torch

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.errors import ConfigError, CorpusError

# torch >= 2.8 raises CUDA runtime errors as torch.AcceleratorError (a RuntimeError subclass);
# older builds raise a plain RuntimeError with the same text.
ACCELERATOR_ERROR: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)

# Appended by c10's CUDA error check to every CUDA runtime error (torch 2.x).
CUDA_ADVICE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

REAL_TEXTS: list[tuple[str, BaseException, str]] = [
    (
        "H100 80GB, torch 2.11+cu130, 335M-parameter model fp16 at batch 16000 (issue 14, verbatim)",
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 15.62 GiB. GPU 0 has a total capacity of 79.18 GiB of "
            "which 3.41 GiB is free. Including non-PyTorch memory, this process has 75.76 GiB memory in "
            "use. Of the allocated memory 75.06 GiB is allocated by PyTorch, and … is reserved by PyTorch "
            "but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. …"
        ),
        errors.OOM,
    ),
    (
        "torch 2.x with CUDA graphs' private pools (kaito-project/kaito#976)",
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 546.00 MiB. GPU 0 has a total capacity of 15.77 GiB of "
            "which 514.19 MiB is free. Process 562167 has 15.25 GiB memory in use. Of the allocated memory "
            "13.73 GiB is allocated by PyTorch, with 46.00 MiB allocated in private pools (e.g., CUDA "
            "Graphs), and 736.86 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        ),
        errors.OOM,
    ),
    (
        "torch 2.1 on an H100, its 'capacty' typo and max_split_size_mb advice",
        torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 448.00 MiB. GPU 1 has a total capacty of 79.10 GiB of "
            "which 364.31 MiB is free. Process 175080 has 1.46 GiB memory in use. Process 175356 has "
            "77.26 GiB memory in use. Of the allocated memory 72.12 GiB is allocated by PyTorch, and "
            "3.78 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory "
            "Management and PYTORCH_CUDA_ALLOC_CONF"
        ),
        errors.OOM,
    ),
    (
        "torch 1.x, before OutOfMemoryError existed: a RuntimeError (neurosim/DNN_NeuroSim_V1.3#28)",
        RuntimeError(
            "CUDA out of memory. Tried to allocate 1.12 MiB (GPU 0; 22.37 GiB total capacity; 15.87 GiB "
            "already allocated; 3.56 MiB free; 787.74 MiB cached)"
        ),
        errors.OOM,
    ),
    (
        "ROCm build, same allocator (a KernelBench log)",
        torch.OutOfMemoryError(
            "HIP out of memory. Tried to allocate 704.00 GiB. GPU 0 has a total capacity of 191.69 GiB of "
            "which 186.02 GiB is free. Of the allocated memory 4.89 GiB is allocated by PyTorch, and "
            "2.25 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        ),
        errors.OOM,
    ),
    (
        "cudaErrorMemoryAllocation outside the caching allocator (robbyant-research/CoDeF#72)",
        RuntimeError("CUDA error: out of memory" + CUDA_ADVICE),
        errors.OOM,
    ),
    (
        "cuBLAS handle creation without memory (vllm-project/vllm#39398)",
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        errors.OOM,
    ),
    (
        "cuDNN workspace (a comment in EfficientDet-Pytorch's inference script)",
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        errors.OOM,
    ),
    (
        "host RAM on a CPU worker: torch 2.13's CPU build here, torch.empty(1 << 62) (raised for real "
        "in test_failure_classes.py)",
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 4611686018427387904 bytes. "
            "Error code 12 (Cannot allocate memory)"
        ),
        errors.OOM,
    ),
    (
        "H100, torch 2.11: an out-of-bounds index kernel (issue 14)",
        ACCELERATOR_ERROR(
            "CUDA error: device-side assert triggered"
            + CUDA_ADVICE.replace(
                "Compile",
                "Search for `cudaErrorAssert' in "
                "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
                "information.\nCompile",
            )
        ),
        errors.CUDA_FATAL,
    ),
    (
        "illegal memory access, torch >= 2.8",
        ACCELERATOR_ERROR("CUDA error: an illegal memory access was encountered" + CUDA_ADVICE),
        errors.CUDA_FATAL,
    ),
    (
        "illegal memory access, older torch (a RuntimeError)",
        RuntimeError("CUDA error: an illegal memory access was encountered" + CUDA_ADVICE),
        errors.CUDA_FATAL,
    ),
    (
        "launch failure",
        RuntimeError("CUDA error: unspecified launch failure" + CUDA_ADVICE),
        errors.CUDA_FATAL,
    ),
    (
        "the caching allocator's OOM report cannot start NVML: an out-of-memory (pytorch/pytorch#112950)",
        RuntimeError(
            'NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "../c10/cuda/'
            'CUDACachingAllocator.cpp":1123, please report a bug to PyTorch. '
        ),
        errors.OOM,
    ),
    (
        "the same report, no NVML handle for the GPU's PCI id (pytorch/pytorch#112950, 2024-07-10)",
        RuntimeError(
            "NVML_SUCCESS == DriverAPI::get()->nvmlDeviceGetHandleByPciBusId_v2_( pci_id, &nvml_device) "
            'INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":815, please report a bug to '
            "PyTorch. "
        ),
        errors.OOM,
    ),
    (
        "the same report, its process list refused (fal-ai/fal#478; hpcaitech/Open-Sora#716, A800 MIG)",
        RuntimeError(
            'NVML_SUCCESS == r INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":830, please '
            "report a bug to PyTorch. "
        ),
        errors.OOM,
    ),
    (
        "the same report from a conda build's path (pytorch/pytorch#112377, torch 2.1.0 in Docker)",
        RuntimeError(
            'NVML_SUCCESS == r INTERNAL ASSERT FAILED at "/opt/conda/conda-bld/pytorch_1695392020201/work/c10'
            '/cuda/CUDACachingAllocator.cpp":1154, please report a bug to PyTorch.'
        ),
        errors.OOM,
    ),
    (
        "no kernels for this GPU in the torch build, torch >= 2.8 (Acly/krita-ai-diffusion#2426)",
        ACCELERATOR_ERROR(
            "CUDA error: no kernel image is available for execution on the device\nSearch for "
            "`cudaErrorNoKernelImageForDevice' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
            "group__CUDART__TYPES.html for more information." + CUDA_ADVICE
        ),
        errors.UNSUPPORTED,
    ),
    (
        "no kernels for this GPU, older torch (Adam-duan/DiT4SR#17, a V100 with torch 2.1.2)",
        RuntimeError("CUDA error: no kernel image is available for execution on the device" + CUDA_ADVICE),
        errors.UNSUPPORTED,
    ),
    (
        "an fp16 GEMM this GPU's cuBLAS does not support (TORCH_CUDABLAS_CHECK's wording)",
        RuntimeError(
            "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx( handle, opa, opb, m, n, k, "
            "&falpha, a, CUDA_R_16F, lda, b, CUDA_R_16F, ldb, &fbeta, c, CUDA_R_16F, ldc, CUDA_R_32F, "
            "CUBLAS_GEMM_DEFAULT_TENSOR_OP)`"
        ),
        errors.UNSUPPORTED,
    ),
    (
        "a launch grid the GPU cannot take (pytorch/pytorch#48573, vllm-project/vllm#16566)",
        RuntimeError("CUDA error: invalid configuration argument" + CUDA_ADVICE),
        errors.UNSUPPORTED,
    ),
    (
        "NVML's assert reached through peer access: not the allocator's OOM report",
        RuntimeError(
            "NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "
            "PeerToPeerAccess.cpp:83"
        ),
        errors.CUDA_FATAL,
    ),
    (
        "an expandable-segments mapping failure: cuMemSetAccess returned CUDA_ERROR_UNKNOWN "
        "(pytorch/pytorch#192330)",
        RuntimeError("CUDA driver error: unknown error"),
        errors.CUDA_FATAL,
    ),
    (
        "a partly mapped expandable segment: every later allocation fails (pytorch/pytorch#188008)",
        RuntimeError(
            '!handles_.at(i) INTERNAL ASSERT FAILED at "c10/cuda/CUDACachingAllocator.cpp":487, please '
            "report a bug to PyTorch. "
        ),
        errors.CUDA_FATAL,
    ),
    (
        "expandable_segments with max_split_size_mb (pytorch/pytorch#119452)",
        RuntimeError(
            '!block->expandable_segment_ INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":'
            "2814, please report a bug to PyTorch. "
        ),
        errors.CUDA_FATAL,
    ),
    (
        "a cuBLAS kernel that failed to run",
        RuntimeError(
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, "
            "k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
        ),
        errors.CUDA_FATAL,
    ),
    (
        "a device another process holds exclusively",
        ACCELERATOR_ERROR("CUDA error: CUDA-capable device(s) is/are busy or unavailable" + CUDA_ADVICE),
        errors.CUDA_FATAL,
    ),
    ("a corpus error", CorpusError("c.jsonl:3: text is int"), errors.BAD_INPUT),
    ("a settings error", ConfigError("fp16 needs a GPU"), errors.CONFIG),
    ("anything else", ValueError("something else"), errors.OTHER),
    (
        "a CPU error that merely mentions the allocator's advice later on",
        RuntimeError("mat1 and mat2 shapes cannot be multiplied. Try expandable_segments or a CUDA error"),
        errors.OTHER,
    ),
]


@pytest.mark.parametrize(("source", "exc", "kind"), REAL_TEXTS, ids=[r[0][:60] for r in REAL_TEXTS])
def test_real_error_texts_are_classified_by_type_and_first_sentence(
    source: str, exc: BaseException, kind: str
) -> None:
    assert errors.classify(exc) == kind, source


def test_first_sentence_drops_torchs_advice() -> None:
    oom = REAL_TEXTS[0][1]
    assert errors.first_sentence(oom) == "CUDA out of memory"
    nvml = next(exc for source, exc, _ in REAL_TEXTS if "#112950)" in source)
    assert errors.first_sentence(nvml).endswith("please report a bug to PyTorch")
