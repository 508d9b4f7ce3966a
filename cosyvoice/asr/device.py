"""Where the neural engines decode (``COSYVOICE_DEVICE``, ``COSYVOICE_COMPUTE_TYPE``)."""

from __future__ import annotations

# CTranslate2 compute type per device when the setting is "auto": int8 weights on the CPU
# (AVX2 int8 products), int8 weights with float16 arithmetic on a GPU.
AUTO_COMPUTE_TYPE = {"cpu": "int8", "cuda": "int8_float16"}


def resolve_device(requested: str = "auto", torch_backend: bool = False) -> str:
    """``requested`` ("cpu", "cuda"); for "auto" (or empty), CUDA where a GPU is visible:
    to CTranslate2, or to torch for the torch backend (either may lack a CUDA build)."""
    if requested and requested != "auto":
        return requested
    if torch_backend:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    import ctranslate2

    return "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"


def resolve_compute_type(requested: str, device: str) -> str:
    return AUTO_COMPUTE_TYPE[device] if requested in ("", "auto") else requested
