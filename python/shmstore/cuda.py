"""Registering a store's heap with CUDA, so that copies from its zero-copy views to a GPU
are direct DMA.

A tensor over a store's bytes (``get_item(..., as_torch=True)``) lives in pageable
shared memory. ``t.to("cuda", non_blocking=True)`` from pageable memory is staged through
a driver buffer and synchronous, and vLLM's model runner copies such a tensor into a new
pinned buffer first. After ``register(store)`` (``cudaHostRegister`` of the heap, once per
process) the heap is page-locked: views count as pinned (``t.is_pinned()``) and the copy is
one asynchronous DMA from the shared pages. ``python/benchmarks/gpu_copy.py`` measures the
three ways; docs/vllm.md ("GPU copies") has the figures and the trade-off (registration
time per GiB, the locked-memory limit).

Register only once the store's creator has rebuilt the heap as 2 MiB pages
(``wait_for_huge_pages``): registration pins every page, and the kernel cannot rebuild a
pinned page, so a process registering first keeps every process on 4 KiB pages.

Needs torch with CUDA; without a visible GPU, ``gpu_visible()`` is False and ``register``
raises ``CudaUnavailable`` (nothing else happens)::

    import shmstore, shmstore.cuda

    store = shmstore.Store.open("mm-cache")
    if shmstore.cuda.gpu_visible():
        shmstore.cuda.wait_for_huge_pages(store)
        shmstore.cuda.register(store)
"""

from __future__ import annotations

import time
from typing import Any

# cudaHostRegister flags (cuda_runtime_api.h).
_PORTABLE = 0x01  # pinned for every CUDA context of the process, not only the current one
_READ_ONLY = 0x08  # the device only reads: required for pages mapped read-only


class CudaUnavailable(RuntimeError):
    """No GPU is visible to torch (or torch is not installed)."""


class RegistrationFailed(RuntimeError):
    """``cudaHostRegister`` refused the heap (most often: the locked-memory limit)."""


def gpu_visible() -> bool:
    """Whether torch is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def wait_for_huge_pages(store: Any, limit_s: float = 60.0, stalled_s: float = 5.0) -> bool:
    """Waits while the store's creator rebuilds its heap as 2 MiB pages (the default on
    Linux 6.1 and later: docs/design.md, "Huge pages"): until the whole heap is, until the
    count stops growing for ``stalled_s`` (the kernel cannot, or the creator is gone), or
    for ``limit_s`` at most. Returns whether the heap is on 2 MiB pages."""
    start = last_change = time.monotonic()
    last = -1
    while True:
        st = store.stats()
        if st["page_size"] > 4096:
            return True
        now = time.monotonic()
        if st["huge_page_bytes"] != last:
            last, last_change = st["huge_page_bytes"], now
        elif now - last_change >= stalled_s or now - start >= limit_s:
            return False
        time.sleep(0.02)  # polls a counter another process moves; nothing to wait on


def _cudart() -> Any:
    if not gpu_visible():
        raise CudaUnavailable("no GPU is visible to torch: the store was not registered with CUDA")
    import torch

    return torch.cuda.cudart()


def _rc(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


# cudaError_t codes (driver_types.h) a registration meets, with what the user can do.
_ALREADY_REGISTERED = 712
_NOT_REGISTERED = 713
_FIXES = {
    2: "page-locking needs the locked-memory limit (`ulimit -l`, a container's memory "
       "limit) to cover the heap",
    1: "CUDA refused the range (a heap mapped read-only needs read_only=True)",
    _ALREADY_REGISTERED: "this process already registered the heap (register once per attach)",
    _NOT_REGISTERED: "this process has not registered the heap",
    801: "this platform cannot page-lock shared memory (some sandboxes and VMs)",
}


def _describe(rc: int) -> str:
    """``error N (cudaErrorName: CUDA's text)`` and, where one is known, what to do."""
    text = ""
    try:
        import torch

        text = str(torch._C._cudart.cudaGetErrorString(torch._C._cudart.cudaError(rc)))
    except Exception:  # an error code torch's enum lacks, or no such binding: the number alone
        pass
    fix = _FIXES.get(rc)
    return f"error {rc}" + (f" ({text})" if text else "") + (f": {fix}" if fix else "")


def register(store: Any, *, read_only: bool = True, device: int | None = None) -> None:
    """Registers the store's heap with CUDA in this process (``cudaHostRegister``,
    portable; with ``read_only``, also ``cudaHostRegisterReadOnly``, which a heap mapped
    read-only needs and a writable one allows). Pins every page of the heap until
    ``unregister`` or the end of the process.

    The call runs in ``device``'s context (default: the calling thread's current device).
    CUDA's current device is per thread, and a new thread's is device 0: from a
    background thread, pass the device the process works on, or it creates a context on
    GPU 0 (hundreds of MiB there, in every worker of a multi-GPU machine).

    Raises ``CudaUnavailable`` without a GPU, ``RegistrationFailed`` if CUDA refuses.
    """
    addr, length = store.heap_region
    flags = _PORTABLE | (_READ_ONLY if read_only else 0)
    cudart = _cudart()
    if device is None:
        rc = _rc(cudart.cudaHostRegister(addr, length, flags))
    else:
        import torch

        with torch.cuda.device(device):
            rc = _rc(cudart.cudaHostRegister(addr, length, flags))
    if rc != 0:
        raise RegistrationFailed(
            f"cudaHostRegister of the store's {length / (1 << 30):.2f} GiB heap returned "
            f"{_describe(rc)}; copies to the GPU stay staged")


def unregister(store: Any) -> None:
    """Undoes ``register`` in this process (``cudaHostUnregister``); the pages become
    pageable again. Raises ``CudaUnavailable`` without a GPU, ``RegistrationFailed`` if
    the heap was not registered."""
    addr, _ = store.heap_region
    rc = _rc(_cudart().cudaHostUnregister(addr))
    if rc != 0:
        raise RegistrationFailed(f"cudaHostUnregister of the store's heap returned {_describe(rc)}")
