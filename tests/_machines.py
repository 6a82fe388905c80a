"""The machines whose branches the suite runs on any CPU, as `tfmp.DeviceFacts`.

Each is the CPU a session has met (or a GPU tfmp has rules for), its flags as
archspec names that microarchitecture plus what Linux reads from the CPU itself
(archspec's ``sapphirerapids`` target lacks AVX512_FP16, which the CPU has). A
test makes one of them this machine's with
`tfmp._src.policy.hardware.injected_facts`, so every decision that rests on the
machine (the "auto" policy, the float16 remapper, the GELU, the bias gradients
on a GPU) takes that machine's branch here.
"""

import archspec.cpu

from tfmp import DeviceFacts, GpuFacts
from tfmp._src.policy.hardware import cpu_from_archspec


def _cpu(target: str, name: str, *extra: str) -> DeviceFacts:
    flags = cpu_from_archspec(archspec.cpu.TARGETS[target])[1] | frozenset(extra)
    return DeviceFacts(cpu_name=name, cpu_flags=flags, cpu_target=target, system="Linux")


#: AMD Zen 4: AVX512_BF16, no float16 in oneDNN. "auto" = mixed_bfloat16.
ZEN4 = _cpu("zen4", "AMD EPYC (Zen 4)")
#: Intel Sapphire Rapids: AMX-BF16 and AVX512_FP16, so oneDNN takes float16 (the remapper trap).
SAPPHIRE_RAPIDS = _cpu("sapphirerapids", "Intel Xeon Platinum 8480+", "avx512_fp16")
#: An Intel Xeon without bfloat16 (Cascade Lake). "auto" = float32.
XEON_NO_BF16 = _cpu("cascadelake", "Intel Xeon Platinum 8259CL")
#: AMD Zen 3: AVX2 only, none of the flags with which TensorFlow turns oneDNN on by
#: default, so its Eigen kernels run everything. "auto" = float32.
ZEN3 = _cpu("zen3", "AMD EPYC (Zen 3)")
#: Sapphire Rapids with TensorFlow's oneDNN turned off: bfloat16 and float16 on Eigen.
SAPPHIRE_RAPIDS_NO_ONEDNN = DeviceFacts(
    cpu_name=SAPPHIRE_RAPIDS.cpu_name, cpu_flags=SAPPHIRE_RAPIDS.cpu_flags,
    cpu_target="sapphirerapids", system="Linux", onednn_env="0")
#: An NVIDIA A100 (compute capability 8.0) beside a Sapphire Rapids.
A100 = DeviceFacts(gpus=(GpuFacts("NVIDIA A100-SXM4-40GB", (8, 0)),),
                   cpu_name=SAPPHIRE_RAPIDS.cpu_name, cpu_flags=SAPPHIRE_RAPIDS.cpu_flags)

#: Every machine above, by name (pytest ids).
ALL = {"zen4": ZEN4, "zen3": ZEN3, "sapphire_rapids": SAPPHIRE_RAPIDS, "xeon_no_bf16": XEON_NO_BF16,
       "sapphire_rapids_no_onednn": SAPPHIRE_RAPIDS_NO_ONEDNN, "a100": A100}
#: The CPUs above on which a float16 model runs without Grappler's remapper, and not.
REMAPPER_TRAP = {"sapphire_rapids": SAPPHIRE_RAPIDS, "zen4": ZEN4}
