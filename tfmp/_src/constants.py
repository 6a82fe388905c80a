"""Numbers and names shared by every part of tfmp, defined once.

Sources: IEEE 754 binary16 limits, read from NumPy's `finfo`; bfloat16 keeps 8
significant bits (Google, "bfloat16: the secret to high performance on Cloud TPUs").
"""

from __future__ import annotations

import os

import numpy as np

#: IEEE 754 binary16: the largest finite value (65504).
FLOAT16_MAX = float(np.finfo(np.float16).max)
#: IEEE 754 binary16: the smallest positive subnormal value (2**-24).
FLOAT16_SMALLEST_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)
#: bfloat16's relative precision (unit roundoff is half of it): 2**-8.
BFLOAT16_EPSILON = 2.0**-8
#: The largest count each 16-bit dtype holds exactly with all below it (significand bits:
#: bfloat16 8, IEEE 754 binary16 11): a running sum of 1s stops there.
EXACT_INTEGER_LIMIT = {"bfloat16": 2**8, "float16": 2**11}
#: The 16-bit float compute dtypes of Keras's mixed policies.
LOW_PRECISION = ("float16", "bfloat16")
#: Names of non-finite kinds by bits (1 = NaN, 2 = inf), as the loss-scale
#: optimizer's `last_loss_status` and the numerics recorder store them.
NON_FINITE_KINDS = {1: "nan", 2: "inf", 3: "nan+inf"}
#: String. Absolute path of the troubleshooting guide in this installation (package data);
#: messages name a section as ``f"{TROUBLESHOOTING_GUIDE}#no-speed-up"``.
TROUBLESHOOTING_GUIDE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "troubleshooting.md")
