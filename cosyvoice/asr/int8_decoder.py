"""Weight-only int8 for Whisper's text decoder (torch backend, CPU).

Greedy decoding reads every decoder weight once per token: the projections of its six blocks
and, largest of all, the output projection tied to the 51865 x 512 token embedding. On the
CPU that is memory-bound, so int8 weights (a quarter of fp32's bytes) with one bf16 scale per
output row, multiplied by torch's ``_weight_int8pack_mm`` with bf16 activations, cut the time
of each step (docs/benchmarks.md, "int8 decoder"). ``torch.ao`` dynamic quantization would
repack the weights into private memory in each process and leaves the tied output
projection alone (it is no ``nn.Linear``).

The int8 weights are computed once from the checkpoint and kept beside it in a file of their
own (``<checkpoint>.int8dec.pt``), memory-mapped like the checkpoint, so every worker process
shares their pages. The cross-attention key and value projections stay as they are: they run
once per final on the whole encoder output, a matrix product, not a per-token read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

SUFFIX = ".int8dec.pt"
FORMAT = 1


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 weight, bf16 scale per row)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(torch.bfloat16).contiguous()


def _targets(decoder: nn.Module) -> dict[str, nn.Linear]:
    """The decoder's per-token projections, by name (cross-attention key/value excluded)."""
    out = {}
    for name, module in decoder.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(("cross_attn.key",
                                                                "cross_attn.value")):
            out[name] = module
    return out


def _source_id(checkpoint: Path) -> list[int]:
    st = checkpoint.stat()
    return [st.st_size, st.st_mtime_ns]


def load_or_build(model: Any, checkpoint: str) -> dict[str, torch.Tensor]:
    """The int8 tensors of ``model``'s decoder, memory-mapped from the file beside
    ``checkpoint``; built (atomically) when missing or made from another checkpoint."""
    ckpt = Path(checkpoint)
    path = ckpt.with_name(ckpt.name + SUFFIX)
    if path.is_file():
        stored = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if stored.get("format") == FORMAT and stored.get("source") == _source_id(ckpt):
            return stored["tensors"]
    decoder = model.decoder
    tensors: dict[str, torch.Tensor] = {}
    for name, module in _targets(decoder).items():
        tensors[f"{name}.q"], tensors[f"{name}.s"] = quantize(module.weight)
    tensors["logits.q"], tensors["logits.s"] = quantize(decoder.token_embedding.weight)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format": FORMAT, "source": _source_id(ckpt), "tensors": tensors}, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)["tensors"]


def int8_mm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x @ (q * s).T for x of any leading shape, in bf16, returned in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(flat, q, s)
    return y.reshape(*x.shape[:-1], q.shape[0]).to(x.dtype)


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` whose product reads int8 weights (``q``, ``s``); its fp32 weight
    stays in place, unread, so the module is still loaded and saved as before."""

    q: torch.Tensor
    s: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_mm(x, self.q, self.s)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def install(model: Any, tensors: dict[str, torch.Tensor], logit_tail: int = 0) -> None:
    """Make ``model``'s decoder read the int8 weights: its projections become Int8Linear
    and its output projection the int8 copy of the token embedding. ``logit_tail``: the
    positions, from the end, whose logits greedy decoding reads (the start-of-transcript
    sequence's length); 0 computes them all."""
    decoder = model.decoder
    for name, module in _targets(decoder).items():
        module.__class__ = Int8Linear
        module.q, module.s = tensors[f"{name}.q"], tensors[f"{name}.s"]
    decoder.__class__ = _int8_text_decoder_class()
    decoder.logits_q, decoder.logits_s = tensors["logits.q"], tensors["logits.s"]
    decoder.logit_tail = logit_tail


def _int8_text_decoder_class() -> type:
    """openai-whisper's TextDecoder with its tied output projection read in int8."""
    from whisper.model import TextDecoder

    class Int8TextDecoder(TextDecoder):
        logit_tail = 0  # set by install()

        def forward(self, x, xa, kv_cache=None):
            offset = next(iter(kv_cache.values())).shape[1] if kv_cache else 0
            x = (self.token_embedding(x)
                 + self.positional_embedding[offset:offset + x.shape[-1]])
            x = x.to(xa.dtype)
            for block in self.blocks:
                x = block(x, xa, mask=self.mask, kv_cache=kv_cache)
            x = self.ln(x)
            tail = self.logit_tail
            if not tail or x.shape[1] <= tail:
                return int8_mm(x, self.logits_q, self.logits_s).float()
            # The first step of a prompted final: decoding reads the logits at the
            # start-of-transcript token (the no-speech probability) and at the last
            # position, both in the tail; the prompt's positions are never read.
            logits = x.new_zeros((*x.shape[:2], self.logits_q.shape[0]), dtype=torch.float32)
            logits[:, -tail:] = int8_mm(x[:, -tail:], self.logits_q, self.logits_s).float()
            return logits

    return Int8TextDecoder
