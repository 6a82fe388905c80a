"""Which ISA oneDNN runs TensorFlow's matmuls with: the verbose parser on oneDNN's own lines, and the child once for real."""

import dataclasses
import os

import pytest

from tfmp._src.policy import onednn_isa
from tfmp._src.policy.hardware import detect_device_facts

# oneDNN's info lines (`get_isa_info` in src/cpu/x64/cpu_isa_traits.cpp) and exec lines in
# ONEDNN_VERBOSE=1's layout (oneDNN 3.x: "v1,primitive,exec"; 2.x and DNNL: without).
HEAD = "onednn_verbose,v1,info,oneDNN v3.7.3 (commit N/A)\nonednn_verbose,v1,info,cpu,runtime:threadpool,nthr:2\n"
AMX_INFO = ("Intel AVX-512 with float16, Intel DL Boost and bfloat16 support and Intel AMX with "
            "bfloat16 and 8-bit integer support")
BF16_INFO = "Intel AVX-512 with Intel DL Boost and bfloat16 support"
AVX512_INFO = "Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions"


def _info(isa):
    return f"{HEAD}onednn_verbose,v1,info,cpu,isa:{isa}\nonednn_verbose,v1,info,gpu,runtime:none\n"


def _exec(kind, impl, src, inner):
    return (f"onednn_verbose,v1,primitive,exec,cpu,{kind},{impl},forward_training,"
            f"src:{src}::blocked:ab::f0 wei:{src}::blocked:ab::f0 dst:{src}::blocked:ab::f0,,,"
            f"128x{inner}:{inner}x64,0.05\n")


def _gemm_api(inner):  # TensorFlow's sgemm calls (this machine's real layout)
    return (f"onednn_verbose,v1,primitive,exec,cpu,gemm_api,,undef,src_f32::blocked:ab:f0 "
            f"wei_f32::blocked:ab:f0 dst_f32::blocked:ab:f0,,,128x{inner}:{inner}x64,0.02\n")


BF16_K, F32_K = onednn_isa.SHAPES["bfloat16"][1], onednn_isa.SHAPES["float32"][1]
CASES = {
    "amx": (_info(AMX_INFO) + _exec("matmul", "brg_matmul:avx512_core_amx", "bf16", BF16_K)
            + _gemm_api(F32_K), "AMX", {"bfloat16": "brg_matmul:avx512_core_amx on bf16",
                                        "float32": "gemm_api on f32"}),
    # AMX on the CPU, yet the bfloat16 matmul ran AVX512_BF16 code: the primitive decides.
    "amx_cpu_avx512_bf16_kernel": (
        _info(AMX_INFO) + _exec("matmul", "brg_matmul:avx512_core_bf16", "bf16", BF16_K)
        + _gemm_api(F32_K), "AVX512_BF16", None),
    "avx512_bf16": (_info(BF16_INFO) + _exec("matmul", "gemm:jit", "bf16", BF16_K)
                    + _exec("inner_product", "x64:gemm:jit", "f32", F32_K), "AVX512_BF16",
                    {"bfloat16": "gemm:jit on bf16", "float32": "x64:gemm:jit on f32"}),
    # AVX-512 without bfloat16: TensorFlow converts bfloat16 to float32 for sgemm.
    "avx512": (_info(AVX512_INFO) + _gemm_api(BF16_K) + _gemm_api(F32_K), "AVX512", None),
    # A 2-core AMD EPYC Zen 3, TensorFlow 2.21 (copied from its output).
    "avx2": (_info("Intel AVX2") + _gemm_api(BF16_K) + _gemm_api(F32_K), "AVX2",
             {"bfloat16": "gemm_api on f32", "float32": "gemm_api on f32"}),
    # oneDNN 2.x / DNNL layout, no "v1,primitive" fields.
    "old_layout_amx": ("dnnl_verbose,info,cpu,isa:Intel AVX-512 with Intel DL Boost and bfloat16 "
                       "support and Intel AMX with bfloat16 and 8-bit integer support\n"
                       f"dnnl_verbose,exec,cpu,matmul,brg:avx512_core_amx,undef,src_bf16::blocked:ab:f0 "
                       f"wei_bf16::blocked:ab:f0 dst_bf16::blocked:ab:f0,,,128x{BF16_K}:{BF16_K}x64,0.1\n",
                       "AMX", {"bfloat16": "brg:avx512_core_amx on bf16"}),
    "nothing_printed": ("some other output\n", "oneDNN off", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_isa_is_read_from_onednn_s_own_lines(case):
    text, label, matmuls = CASES[case]
    found = onednn_isa.parse_verbose(text)
    assert (found.label, found.source) == (label, "measured")
    if matmuls is not None:
        assert dict(found.matmuls) == matmuls
    assert found.to_dict()["label"] == label and label in found.describe()


def test_an_unfinished_child_is_unknown_and_names_map_to_isas():
    assert onednn_isa.parse_verbose("", finished=False).isa == "unknown"
    assert [onednn_isa.isa_of_info(text) for text in (
        AMX_INFO, BF16_INFO, AVX512_INFO, "Intel AVX2", "Intel AVX2 with Intel DL Boost",
        "Intel AVX2 with Intel DL Boost, float16 and bfloat16 support", "Intel SSE4.1",
        "AArch64 SVE (256 bits)", f"{BF16_INFO} and Intel AMX with 8-bit integer support")] == [
        "amx", "avx512_bf16", "avx512", "avx2", "avx2", "avx2", "sse41", "unknown", "avx512_bf16"]
    assert onednn_isa.parse_verbose(_info(AMX_INFO)).cpu_isa == AMX_INFO  # commas and all
    assert onednn_isa.isa_of_implementation("gemm:jit") is None
    assert onednn_isa.isa_of_implementation("brgemm:avx10_1_512") == "avx512_bf16"


def _expected_isa(facts):
    """What oneDNN's ISA table gives for these CPU flags, bfloat16 reaching oneDNN's kernels
    only where TensorFlow hands it over (`DeviceFacts.onednn_bfloat16`), else as float32."""
    flags = facts.cpu_flags
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        if facts.onednn_bfloat16 and {"amx_bf16", "amx_tile"} <= flags:
            return "amx"
        return "avx512_bf16" if facts.onednn_bfloat16 and "avx512_bf16" in flags else "avx512"
    return next((isa for flag, isa in (("avx2", "avx2"), ("avx", "avx"), ("sse4_1", "sse41"))
                 if flag in flags), "off")


def test_the_child_reports_what_this_cpu_s_flags_give_with_onednn_forced_on():
    """The one real child (about a second: TensorFlow's C API, no Python import of it)."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1")
    found = onednn_isa.finish(onednn_isa.start(env))
    facts = dataclasses.replace(detect_device_facts(), onednn_env="1")
    assert found.source == "measured", found.source
    assert found.isa == _expected_isa(facts), found
    if found.isa != "off":
        assert {"bfloat16", "float32"} <= set(dict(found.matmuls)) and found.cpu_isa
