"""GGUF weights kept in their blocks: read exactly (the embedded Q4_1 file against its converted checkpoint; each
block type against the `gguf` library's own dequantizer), refused by name where unsupported, and the block kernels
against the dequantized fp32 matmul. Greedy output on the blocks is in tests/engine/test_gguf_generation.py."""
import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from engine.cpu_kernels import build_block_matmul
from engine.layers.quantized import BlockWeight, block_matmul
from engine.models.cache_files import umask
from engine.models import checkpoint_tensors, embedded_checkpoint, embedded_gguf_path
from engine.models.gguf import read_tensors
from tests.engine.kernel_builds import BUILT_ELSEWHERE, kernels_for


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]]):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_embedded_gguf_reads_to_exactly_its_converted_checkpoint():
    config = AutoConfig.from_pretrained(embedded_checkpoint())
    ours = dict(read_tensors(embedded_gguf_path(), config))
    reference = dict(checkpoint_tensors(embedded_checkpoint()))
    assert set(ours) == set(reference)
    kinds = {name: value.kind for name, value in ours.items() if isinstance(value, BlockWeight)}
    assert sum(kind == "q4" for kind in kinds.values()) == 210 and kinds["model.embed_tokens.weight"] == "q8"
    for name, value in ours.items():
        dense = value.dequantize() if isinstance(value, BlockWeight) else value
        assert torch.equal(dense, reference[name]), name  # q/k rows un-permuted, every value bit for bit


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_each_block_type_reads_as_the_gguf_library_dequantizes_it(tmp_path, kind):
    values = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (values, kind)})
    (name, tensor), = read_tensors(path, None)
    assert name == "model.layers.0.mlp.down_proj.weight"
    expected = gguf.quants.dequantize(gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, kind)),
                                      getattr(gguf.GGMLQuantizationType, kind))
    dense = tensor.dequantize() if isinstance(tensor, BlockWeight) else tensor
    assert torch.equal(dense, torch.from_numpy(expected.astype(np.float32)))


def test_a_kept_copy_reads_as_the_file_did_and_a_changed_file_is_read_again(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    path = write_gguf(tmp_path / "m.gguf", {
        "blk.0.attn_norm.weight": (rng.standard_normal(64).astype(np.float32), "F32"),
        "blk.0.ffn_gate.weight": (rng.standard_normal((8, 64)).astype(np.float32), "Q4_0"),
        "blk.0.ffn_up.weight": (rng.standard_normal((8, 64)).astype(np.float32), "Q4_1"),
        "blk.0.ffn_down.weight": (rng.standard_normal((64, 8 * 32)).astype(np.float32), "Q8_0")})
    cache = tmp_path / "cache"
    first = list(read_tensors(path, None, cache))
    [kept_file] = cache.rglob("*.safetensors")
    assert kept_file.stat().st_mode & 0o777 == 0o666 & ~umask()  # as the umask allows (a shared cache), not 0600
    assert not list(cache.rglob(".keep-*"))

    def no_reader(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    kept = list(read_tensors(path, None, cache))
    assert [name for name, _ in kept] == [name for name, _ in first]
    for (name, a), (_, b) in zip(first, kept):
        if isinstance(a, BlockWeight):
            assert a.kind == b.kind and torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), name
            assert (a.mins is None and b.mins is None) or torch.equal(a.mins, b.mins), name
        else:
            assert torch.equal(a, b), name
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="parsed again"):
        list(read_tensors(path, None, cache))


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    values = np.ones((8, 64), dtype=np.float32)
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.attn_norm.weight": (values[0], "F32"), "blk.0.ffn_up.weight": (values, "Q5_0")})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is stored as Q5_0.*supported: F32"):
        list(read_tensors(path, None))


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> BlockWeight:
    g = torch.Generator().manual_seed(seed)
    groups = cols // 32
    scales = (torch.rand(rows, groups, generator=g) * 0.05).half().float()
    if kind == "q8":
        return BlockWeight("q8", torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8), scales, None)
    mins = (torch.randn(rows, groups, generator=g) * 0.05).half().float()
    return BlockWeight("q4", torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8), scales, mins)


def activation_rounding_bound(x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor:
    """[rows, outputs]: the most the AVX2 path's 16-bit activations (|error| <= a block's largest |x| / 65534) can
    move each output; the fp32 paths stay far inside it."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 65534
    weight = blocks.dequantize().double().abs().view(blocks.shape[0], -1, 32).sum(-1)
    return step @ weight.T


def assert_within_the_bound(got, x, blocks, expected):
    slack = 1e-5 * expected.abs().max().item()  # fp32 accumulation
    excess = (got.double() - expected).abs() - activation_rounding_bound(x, blocks) - slack
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 10, 17])  # 1 and 2: the one-row and two-row integer chains
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outputs", [80, 40])  # 40: not whole groups of 16 rows, so the file's layout on AVX-512 too
def test_the_block_kernel_equals_the_dequantized_fp32_matmul(kind, rows, dtype, outputs):
    blocks = random_blocks(kind, outputs, 192, seed=rows)
    bias = torch.randn(outputs).to(dtype)
    x = torch.randn(rows, 192).to(dtype)
    got = block_matmul(x, blocks.pack(), bias)
    expected = F.linear(x.double(), blocks.dequantize().double(), bias.double())
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_within_the_bound(got, x, blocks, expected)
        return
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())  # bf16 output


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_blocks_are_packed_in_the_layout_this_cpu_reads(kind):
    """Interleaved by 16 rows where the kernel wants it (AVX-512) and the scales are fp16 values, as GGUF stores
    them; otherwise the file's own layout, which every build reads."""
    blocks = random_blocks(kind, 32, 64, seed=0)
    lanes = build_block_matmul().interleaved_rows()
    packed = blocks.pack()
    assert packed.codes.dim() == (3 if lanes else 2)
    if lanes:
        assert packed.codes.shape == (32 // lanes, 2, lanes * (16 if kind == "q4" else 32))
        assert packed.scales.dtype == torch.float16 and packed.nbytes < blocks.nbytes
    off_fp16 = BlockWeight(kind, blocks.codes, blocks.scales + 1e-6, blocks.mins)
    assert off_fp16.pack().codes.dim() == 2
    assert random_blocks(kind, 40, 64, seed=0).pack().codes.dim() == 2


@pytest.fixture(scope="module")
def isa_variants() -> dict:
    return {isa: kernels_for(isa) for isa in BUILT_ELSEWHERE}


@pytest.mark.slow
@pytest.mark.parametrize("isa", BUILT_ELSEWHERE)
def test_the_avx2_and_portable_kernels_equal_the_dequantized_fp32_matmul(isa, isa_variants):
    """Built here with AVX-512 (and AVX2) switched off, so the paths other CPUs take are checked on this one too."""
    kernels = isa_variants[isa]
    for kind in ("q4", "q8"):
        for rows in (1, 4, 6):
            blocks = random_blocks(kind, 40, 128, seed=rows)
            x = torch.randn(rows, 128)
            args = (blocks.codes, blocks.scales, blocks.mins) if kind == "q4" else (blocks.codes, blocks.scales)
            got = getattr(kernels, f"{kind}_matmul")(x, *args)
            assert_within_the_bound(got, x, blocks, x.double() @ blocks.dequantize().double().T)


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in BUILT_ELSEWHERE, reason="this CPU's best is AVX2: no AVX-512 build to compare with")
def test_the_avx2_interleaved_kernel_gives_the_avx512_ones_numbers_bit_for_bit(isa_variants):
    """Both read the same 16-row layout: the integer sums are exact and each row's fp32 operations the same, so AVX2
    CPUs get AVX-512's outputs exactly, for one to five x rows (the one-row and two-row chains, part tiles)."""
    for kind in ("q4", "q8"):
        packed = random_blocks(kind, 48, 256, seed=3).pack()
        assert packed.codes.dim() == 3
        args = (packed.codes, packed.scales, packed.mins) if kind == "q4" else (packed.codes, packed.scales)
        for rows in (1, 2, 3, 5):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            native = getattr(build_block_matmul(), f"{kind}_matmul")(x, *args)
            assert torch.equal(getattr(isa_variants["avx2"], f"{kind}_matmul")(x, *args), native)


def test_the_block_kernel_refuses_activations_that_are_not_whole_blocks():
    blocks = random_blocks("q4", 32, 64, seed=0).pack()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        build_block_matmul().q4_matmul(torch.randn(1, 48), blocks.codes, blocks.scales, blocks.mins)
