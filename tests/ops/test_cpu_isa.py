"""CPU ISA dispatch: a path is chosen only when the CPU has every feature its kernels are compiled with (the target
attributes in csrc/cpu/*.cpp), and those of the paths below it."""

import os

import pytest

from flashllm_ext import _C

AVX2 = {"avx2", "fma", "f16c", "popcnt"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}
AVX512_VNNI = AVX512 | {"avx512vnni"}
AVX512_VBMI2 = AVX512_VNNI | {"avx512vbmi", "avx512vbmi2"}
AVX512_BF16 = AVX512_VBMI2 | {"avx512bf16"}


@pytest.mark.parametrize(
    "features,isa",
    [
        (set(), "scalar"),
        (AVX2, "avx2"),
        (AVX512, "avx512"),
        (AVX512_VNNI, "avx512vnni"),
        (AVX512_VBMI2, "avx512vbmi2"),
        (AVX512_BF16, "avx512bf16"),
        (AVX512_BF16 | {"avx512_fp16", "sse4.2"}, "avx512bf16"),  # features no path needs change nothing
        (AVX512_VNNI | {"avx512bf16"}, "avx512vnni"),  # Cooper Lake: BF16 without VBMI2
        ({"avx2"}, "scalar"),
        (AVX512 - {"avx512vl"}, "avx2"),
        (AVX512_VBMI2 - {"avx512bw"}, "avx2"),
        (AVX2 | {"avx512vbmi2"}, "avx2"),
        (AVX512 | {"avx512vbmi", "avx512vbmi2"}, "avx512"),  # VBMI2 without VNNI (no such CPU known): below VNNI
        (AVX512_VBMI2 - {"avx512vbmi"}, "avx512vnni"),  # quant_scores' VBMI2 level uses VBMI too
    ],
)
def test_isa_for_features(features, isa):
    assert _C.isa_for_features(sorted(features)) == isa


@pytest.mark.parametrize("masked", sorted(AVX2))
def test_a_cpu_that_masks_an_avx2_feature_gets_the_scalar_path(masked):
    """A VM may report AVX2 and AVX-512 while masking FMA or F16C: the AVX2 and AVX-512 kernels are compiled with
    them (SIGILL), so only the scalar path is safe."""
    assert _C.isa_for_features(AVX512_BF16 - {masked}) == "scalar"


def test_bad_feature_lists_are_refused():
    with pytest.raises(TypeError):
        _C.isa_for_features(3)
    with pytest.raises(TypeError):
        _C.isa_for_features(["avx2", 3])


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads the CPU flags the Linux kernel reports")
def test_detected_isa_follows_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    # The kernel spells three names differently from GCC; it also clears flags whose register state the OS does not
    # save, as libgcc's own check does.
    gcc_names = {"avx512_vbmi2": "avx512vbmi2", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16"}
    features = {gcc_names.get(flag, flag) for flag in flags}
    assert _C.detected_cpu_isa() == _C.isa_for_features(features)


def test_each_level_can_be_forced_up_to_the_detected_one_and_no_further():
    names = _C.cpu_isas()
    assert names[0] == "scalar" and _C.detected_cpu_isa() in names
    previous = _C.cpu_isa()
    try:
        for name in names[: names.index(_C.detected_cpu_isa()) + 1]:
            _C.set_cpu_isa(name)
            assert _C.cpu_isa() == name
        for name in names[names.index(_C.detected_cpu_isa()) + 1 :]:
            with pytest.raises(ValueError, match="does not support"):
                _C.set_cpu_isa(name)
        with pytest.raises(ValueError, match="unknown CPU ISA 'avx9' \\(scalar, avx2, .*avx512bf16\\)"):
            _C.set_cpu_isa("avx9")
    finally:
        _C.set_cpu_isa(previous)
