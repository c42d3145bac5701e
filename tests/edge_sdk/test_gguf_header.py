"""The GGUF header reader against ``gguf.GGUFReader`` (the package's own, which builds every metadata array): the
same scalars, tensors, types, sizes and data offsets, on a file with every metadata value type, a string array as
long as a vocabulary's, a nested array and an alignment other than the default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_sdk.backends.gguf_header import read_gguf_header
from edge_sdk.policies.custext import load_token_embeddings


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gguf

    rng = np.random.default_rng(2)
    embeddings = rng.standard_normal((9, 64)).astype(np.float32)
    path = tmp_path_factory.mktemp("gguf") / "metadata.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_token_list([f"token{i}" * (i % 5) for i in range(3000)])
    writer.add_token_scores(rng.standard_normal(3000).astype(np.float32).tolist())
    writer.add_array("test.nested", [[1, 2], [3]])
    for key, value, kind in (("u8", 7, gguf.GGUFValueType.UINT8), ("i16", -3, gguf.GGUFValueType.INT16),
                             ("u64", 2**40, gguf.GGUFValueType.UINT64), ("f64", 0.5, gguf.GGUFValueType.FLOAT64),
                             ("flag", True, gguf.GGUFValueType.BOOL), ("text", "héllo", gguf.GGUFValueType.STRING)):
        writer.add_key_value(f"test.{key}", value, kind)
    writer.add_tensor("first.weight", np.ones(3, dtype=np.float32))
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embeddings, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tensors_are_those_gguf_s_own_reader_finds(written: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(written)
    header = read_gguf_header(written)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert (ours.dims, ours.kind, ours.offset) == (tuple(theirs.shape.tolist()), theirs.tensor_type,
                                                        theirs.data_offset)
        assert (ours.n_elements, ours.n_bytes) == (int(theirs.n_elements), int(theirs.n_bytes))
    assert header.tensor("missing.weight") is None
    assert header.tensor("token_embd.weight").n_bytes == 9 * 64 // 32 * 34  # Q8_0: 32 codes and an f16 scale


def test_the_scalars_are_read_and_the_arrays_stepped_over(written: Path) -> None:
    metadata = read_gguf_header(written).metadata
    assert {key: metadata[key] for key in ("test.u8", "test.i16", "test.u64", "test.flag", "test.text")} == {
        "test.u8": 7, "test.i16": -3, "test.u64": 2**40, "test.flag": True, "test.text": "héllo"}
    assert metadata["test.f64"] == 0.5 and metadata["general.alignment"] == 64 and metadata["general.file_type"] == 7
    assert "tokenizer.ggml.tokens" not in metadata and "test.nested" not in metadata


def test_the_embeddings_are_the_bytes_gguf_s_own_reader_reads(written: Path) -> None:
    import gguf

    reference = gguf.GGUFReader(written).tensors[1]
    np.testing.assert_array_equal(load_token_embeddings(written),
                                  gguf.quants.dequantize(np.array(reference.data), reference.tensor_type))


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF"):
        read_gguf_header(np.zeros(32, dtype=np.uint8))
    (tmp_path / "short").write_bytes(b"GGU")
    with pytest.raises(ValueError, match="GGUF"):
        read_gguf_header(tmp_path / "short")


def test_a_file_s_bits_per_weight_come_from_its_header(written: Path) -> None:
    """``compare-quant``'s record of a file (eval_harness.compare.quantize.gguf_info), by hand: Q8_0 is 34 bytes
    per 32 weights (8.5 bits), F32 32 bits, F16 16; the matrices' figure leaves the token embedding out and the
    file has no other matrix."""
    from eval_harness.compare.quantize import gguf_info

    info = gguf_info(written)
    assert info.file_type == "Q8_0"
    assert info.bits_per_weight == pytest.approx(8 * (3 * 4 + 9 * 64 // 32 * 34 + 5 * 2) / (3 + 9 * 64 + 5))
    assert np.isnan(info.matrix_bits_per_weight)
    assert info.tensor_types == {"F16": 1, "F32": 1, "Q8_0": 1}
