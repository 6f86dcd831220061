"""core/weights.py CheckpointReader: the same tensors as safetensors' own loader, read one at a
time, and corrupt files refused from the header alone."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmopt.core.weights import INDEX_FILE, CheckpointReader, read_safetensors_header
from llmopt.errors import LlmoptError


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(3, 4, 2, generator=g),
        "c.qweight": torch.randint(-2**31, 2**31 - 1, (4, 3), generator=g, dtype=torch.int32),
        "d.bias": torch.randn(6, generator=g).half(),
        "e.empty": torch.zeros(0, 4),
    }


def test_reader_matches_safetensors_loader_across_shards(tmp_path):
    tensors = _tensors()
    names = list(tensors)
    save_file({k: tensors[k] for k in names[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    reader = CheckpointReader.from_folder(tmp_path)
    assert sorted(reader.names()) == sorted(names)
    for name, expected in tensors.items():
        got = reader.get(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), name
    assert torch.equal(reader.get_rows("a.weight", 2, 5), tensors["a.weight"][2:5])
    assert torch.equal(reader.get_rows("b.weight", 1, 99), tensors["b.weight"][1:])
    # the tensor owns its memory: writing to it leaves the file untouched
    reader.get("b.weight").zero_()
    assert torch.equal(load_file(str(tmp_path / "model-00001-of-00002.safetensors"))["b.weight"], tensors["b.weight"])


def _corrupt(tmp_path, header: dict, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header,data,why", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "outside the data section"),
    ({"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, b"\0" * 16, "bytes for shape"),
    ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "invalid entry"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}}, b"\0" * 16, "outside the data section"),
])
def test_corrupt_headers_are_refused(tmp_path, header, data, why):
    path = _corrupt(tmp_path, header, data)
    with pytest.raises(LlmoptError, match=why):
        read_safetensors_header(path)


def test_truncated_header_is_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(LlmoptError, match="header length"):
        read_safetensors_header(path)
