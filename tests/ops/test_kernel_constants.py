"""Each number shared by the kernels is defined once, in a C header; the Python mirrors in
flashllm_ext.ops.constants (which the MLX backend and its Metal header use) must equal it."""

import re
from pathlib import Path

from flashllm_ext.ops import constants as kc

CSRC = Path(__file__).resolve().parents[2] / "csrc"
METAL = Path(__file__).resolve().parents[2] / "metal"


def header_constants(path: Path) -> dict[str, int]:
    """NAME = value pairs of enums and constexpr ints in a C header."""
    text = path.read_text()
    return {name: int(value) for name, value in re.findall(r"\b(k\w+)\s*=\s*(\d+)\b", text)}


def test_endor_row_codes_match_the_header():
    codes = header_constants(CSRC / "common/endor_codes.h")
    assert kc.ENDOR_ROW_CODES == {name: codes[name] for name in kc.ENDOR_ROW_CODES}
    assert set(kc.ENDOR_ROW_CODES) == {n for n in codes if n.startswith("kEndorRow")}


def test_ffn_geometry_matches_the_header():
    grid = header_constants(CSRC / "common/ffn_grid.h")
    assert (kc.FFN_MAX_TOKENS, kc.FFN_ROWS_PER_CHUNK, kc.FFN_MAX_CHUNKS) == (
        grid["kFfnMaxTokens"],
        grid["kFfnRowsPerChunk"],
        grid["kFfnMaxChunks"],
    )
    assert kc.METAL_THREADGROUP == header_constants(CSRC / "simt/bodies.h")["kMetalThreadgroup"]


def test_metal_bodies_use_the_names_not_the_numbers():
    """The Metal bodies say kEndorRow... / kFfnMaxTokens (from metal_header() under MLX, from the C headers under
    the SIMT emulation), so a changed header cannot leave a stale literal behind."""
    header = kc.metal_header()
    for name, value in {**kc.ENDOR_ROW_CODES, "kFfnMaxTokens": kc.FFN_MAX_TOKENS}.items():
        assert f"constant int {name} = {value};" in header
    for body in METAL.glob("*.metal"):
        text = body.read_text()
        assert not re.search(r"row_status\[\w+\] = \d", text), body.name
        assert not re.search(r"\[8\]|t < 8;", text), body.name
