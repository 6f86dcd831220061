"""Reading and writing safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.errors import LlmoptError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, in index order when sharded."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LlmoptError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise LlmoptError(f"{folder}: shard(s) named in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        hint = " (only PyTorch .bin weights found; convert them to safetensors)" if bins else ""
        raise LlmoptError(f"{folder} has no .safetensors weights{hint}")
    return files


def load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the files, memory-mapped; a corrupt or truncated file is a clear error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise LlmoptError(f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}") from None
    return tensors


def check_safetensors(files: list[Path]) -> int:
    """Each file's header read and checked without reading tensor data: safetensors' own `safe_open`
    refuses a header that does not parse, offsets that overlap or leave gaps, a tensor whose byte
    range does not fit its shape and dtype, and data that does not end where the file does.
    LlmoptError naming the first bad file; returns the number of tensors."""
    from safetensors import SafetensorError, safe_open

    count = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                count += len(f.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise LlmoptError(f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}") from None
    return count


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


# safetensors' dtype names (the header's "dtype") -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
# a header larger than this is not a checkpoint (safetensors itself refuses > 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file."""
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensor table and metadata of one safetensors file, checked against its size (every
    offset inside the data section, each tensor's byte count matching its dtype and shape)."""
    def bad(why: str) -> LlmoptError:
        return LlmoptError(f"{path} is not a readable safetensors file (corrupt or truncated?): {why}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise bad(f"header length {header_len} does not fit the file's {size} bytes")
            raw = f.read(header_len)
    except OSError as exc:
        raise LlmoptError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has an invalid entry {str(info)[:200]}") from None
        if any(d < 0 for d in shape) or not 0 <= begin <= end or data_start + end > size:
            raise bad(f"tensor {name!r}: offsets {begin}..{end} lie outside the data section ({size - data_start} bytes)")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise bad(f"tensor {name!r}: {end - begin} bytes for shape {list(shape)} of {info['dtype']}")
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


class CheckpointReader:
    """Tensors of a (possibly sharded) safetensors checkpoint, read one at a time with `pread`
    into memory the tensor owns. Not mmap: mapped pages of a large file stay counted in the
    resident set while any view is alive, and a layer-at-a-time reader must keep its peak
    at one layer."""

    def __init__(self, files: list[Path]):
        self.files = list(files)
        self.entries: dict[str, TensorEntry] = {}
        for path in self.files:
            entries, _ = read_safetensors_header(path)
            self.entries.update(entries)

    @classmethod
    def from_folder(cls, folder: Path) -> "CheckpointReader":
        return cls(safetensors_files(folder))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self):
        return iter(self.entries)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get(name)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        return self._read(entry, entry.begin, entry.nbytes, entry.shape)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor (its first dimension), reading only their bytes."""
        entry = self.entries[name]
        row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
        start, stop = max(0, start), min(entry.shape[0], stop)
        count = max(0, stop - start)
        return self._read(entry, entry.begin + start * row_bytes, count * row_bytes, (count, *entry.shape[1:]))

    def _read(self, entry: TensorEntry, offset: int, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        with open(entry.path, "rb", buffering=0) as f:
            done = 0
            while done < nbytes:
                n = os.preadv(f.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise LlmoptError(f"{entry.path} is truncated (reading at byte {offset + done})")
                done += n
        if nbytes == 0:
            return torch.empty(shape, dtype=entry.dtype)
        return torch.frombuffer(buffer, dtype=entry.dtype).reshape(shape)


# safetensors writes tensors sorted by dtype, largest alignment first (its Rust `Dtype` enum
# order, descending), then by name; a planned file must follow it to equal `save_file`'s bytes
_SAFETENSORS_WRITE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                            "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a writer will receive: its name, dtype and shape, known before its data."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_shard_size(size: int | str) -> int:
    """"5GB", "500MB", "2GiB" or a byte count -> bytes (huggingface_hub's reading, as transformers')."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(size).strip()
    try:
        value = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        raise LlmoptError(f"--max-shard-size {size!r} is not a size; write e.g. 5GB, 500MB or a byte count") from None
    if value <= 0:
        raise LlmoptError(f"--max-shard-size must be positive, got {size!r}")
    return value


class SafetensorsShardWriter:
    """Writes a safetensors checkpoint whose tensor table is planned before any data arrives, so
    tensors can be written one at a time, in any order, and freed: each file's header is
    written first and each tensor's bytes go to their planned offset (`pwrite`).

    Shards are split as transformers' `save_pretrained` splits them (huggingface_hub's
    splitter over the plan's order, `max_shard_size` per file): one file is
    `model.safetensors`, several are `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json`. Each file's bytes equal what `safetensors.torch.save_file`
    writes for the same tensors with metadata {"format": "pt"}.
    """

    def __init__(self, folder: Path, plan: list[TensorSpec], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
        from huggingface_hub import split_state_dict_into_shards_factory

        self.folder = Path(folder)
        specs = {spec.name: spec for spec in plan}
        split = split_state_dict_into_shards_factory(
            specs, get_storage_size=lambda spec: spec.nbytes, get_storage_id=lambda spec: None,
            filename_pattern="model{suffix}.safetensors", max_shard_size=parse_shard_size(max_shard_size))
        self.sharded = split.is_sharded
        self.weight_map = dict(split.tensor_to_filename)
        self.total_size = sum(spec.nbytes for spec in plan)
        self._where: dict[str, tuple[Path, int, TensorSpec]] = {}  # name -> (file, absolute offset, spec)
        self._missing: dict[str, int] = {}  # name -> bytes not yet written
        self.files: list[Path] = []
        for filename, names in split.filename_to_tensors.items():
            path = self.folder / filename
            self._plan_file(path, [specs[name] for name in names])
            self.files.append(path)

    def _plan_file(self, path: Path, specs: list[TensorSpec]) -> None:
        order = {name: i for i, name in enumerate(_SAFETENSORS_WRITE_ORDER)}
        specs = sorted(specs, key=lambda s: (order[_SAFETENSORS_NAMES[s.dtype]], s.name))
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            header[spec.name] = {"dtype": _SAFETENSORS_NAMES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
        data_start = 8 + len(raw)
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            f.truncate(data_start + offset)
        for spec in specs:
            begin = header[spec.name]["data_offsets"][0]
            self._where[spec.name] = (path, data_start + begin, spec)
            self._missing[spec.name] = spec.nbytes

    def write(self, name: str, tensor: torch.Tensor, row_start: int = 0) -> None:
        """Write `tensor` as planned tensor `name`, or as its rows from `row_start` on (a large
        tensor written in pieces)."""
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is not in the checkpoint's plan")
        path, offset, spec = self._where[name]
        whole = tuple(tensor.shape) == spec.shape and row_start == 0
        rows_fit = tensor.dim() >= 1 and tuple(tensor.shape[1:]) == spec.shape[1:] and \
            row_start + tensor.shape[0] <= spec.shape[0]
        if tensor.dtype != spec.dtype or not (whole or rows_fit):
            raise ValueError(f"tensor {name!r}: {tensor.dtype} {tuple(tensor.shape)} at row {row_start} "
                             f"does not fit the plan's {spec.dtype} {spec.shape}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        row_bytes = math.prod(spec.shape[1:]) * spec.dtype.itemsize
        with open(path, "r+b", buffering=0) as f:
            view, done, at = memoryview(data), 0, offset + row_start * row_bytes
            while done < len(view):
                done += os.pwrite(f.fileno(), view[done:], at + done)
        self._missing[name] -= len(data)

    def close(self) -> list[Path]:
        """Check every planned tensor was written in full; write the index when sharded."""
        unwritten = [name for name, left in self._missing.items() if left]
        if unwritten:
            raise RuntimeError(f"checkpoint incomplete: {len(unwritten)} tensor(s) not written, e.g. {unwritten[:3]}")
        if self.sharded:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return self.files


def open_weights(source) -> "CheckpointReader":
    """The checkpoint tensors of a `ModelSource` (a Hugging Face folder), read one at a time."""
    if source.kind == "architecture":
        raise LlmoptError(f"{source.spec} is a shipped architecture (a config without weights): pass "
                          "--load-format dummy for random weights of its shape, or a checkpoint")
    if source.kind == "gguf":
        raise LlmoptError(f"{source.spec} is a GGUF file, not a safetensors checkpoint")
    return CheckpointReader.from_folder(source.path)
