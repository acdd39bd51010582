#!/usr/bin/env python3
"""Fits the polynomial of vpce's vectorised exp (src/cpu/simd_rows.cc, Exp2).

2^f = 1 + f Q(f) for f in [0, 1] (f = t - floor(t)): Q of degree 5 minimises the largest
relative error of 2^f, by Lawson's iteratively reweighted least squares on Chebyshev points.
Prints the fp32 coefficients (as C hex literals, highest degree first, the order of the
Horner steps) and the error once they are rounded to fp32.
Needs NumPy (for example the venv that bench/compare.sh makes).
"""
import numpy as np

DEGREE = 5

f = (np.cos(np.linspace(0.0, np.pi, 4001)) + 1.0) / 2.0
f = f[f > 1e-7]
target = np.expm1(f * np.log(2.0)) / f
weight_of_error = f / np.exp2(f)  # an error in Q, as a relative error of 2^f
basis = np.vander(f, DEGREE + 1, increasing=True)

lawson = np.ones_like(f)
for _ in range(300):
    w = weight_of_error * np.sqrt(lawson)
    coefficients, *_ = np.linalg.lstsq(basis * w[:, None], target * w, rcond=None)
    error = np.abs((basis @ coefficients - target) * weight_of_error)
    lawson *= error
    lawson /= lawson.sum()

rounded = coefficients.astype(np.float32).astype(np.float64)
worst = np.max(np.abs((basis @ rounded - target) * weight_of_error))
print("coefficients:", ", ".join(float(c).hex().replace("0000000p", "p") + "f" for c in rounded[::-1]))
print(f"largest relative error of 2^f: {worst:.3g} ({worst / 2**-23:.3f} ulp of 1 <= 2^f < 2)")
