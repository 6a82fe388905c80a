"""Numbers and names shared by every part of tfmp, defined once.

Sources: IEEE 754 binary16 limits (5 exponent bits, 10 stored significand bits:
largest finite value (2 - 2**-10) * 2**15 = 65504, smallest subnormal 2**-24,
about 6e-8; equal to NumPy's ``finfo(float16)``); bfloat16 keeps 8 significant bits
(7 stored), so its relative precision is 2**-8 (Google, "bfloat16: the secret to
high performance on Cloud TPUs").
"""

from __future__ import annotations

# No other imports: the command line and the examples' option parsers read this module
# before TensorFlow (or NumPy) is loaded.

#: IEEE 754 binary16: the largest finite value (65504).
FLOAT16_MAX = (2.0 - 2.0**-10) * 2.0**15
#: IEEE 754 binary16: the smallest positive subnormal value (2**-24).
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24
#: bfloat16's relative precision (unit roundoff is half of it): 2**-8.
BFLOAT16_EPSILON = 2.0**-8
#: The 16-bit float compute dtypes of Keras's mixed policies.
LOW_PRECISION = ("float16", "bfloat16")
#: Names of non-finite kinds by bits (1 = NaN, 2 = inf), as the loss-scale
#: optimizer's `last_loss_status` and the numerics recorder store them.
NON_FINITE_KINDS = {1: "nan", 2: "inf", 3: "nan+inf"}

#: Keras dtype policy names tfmp chooses between, and the choices `tfmp.enable`
#: (and the examples' ``--policy``) accept: "auto" picks one for the hardware.
MIXED_FLOAT16 = "mixed_float16"
MIXED_BFLOAT16 = "mixed_bfloat16"
FLOAT32 = "float32"
POLICY_CHOICES = ("auto", MIXED_FLOAT16, MIXED_BFLOAT16, FLOAT32)
