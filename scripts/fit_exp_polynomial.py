#!/usr/bin/env python3
"""Fits the polynomial of vpce's vectorised exp (src/cpu/simd_rows.cc, Exponential).

exp(r) = 1 + r + r^2 P(r) for |r| <= ln2 / 2 (plus slack for the rounding of n): P of
degree 4 minimises the largest relative error of exp(r), by Lawson's iteratively
reweighted least squares on Chebyshev points. Prints the fp32 coefficients (as C hex
literals, lowest degree first) and the error once they are rounded to fp32.
Needs NumPy (for example the venv that bench/compare.sh makes).
"""
import numpy as np

DEGREE = 4
HALF_WIDTH = 0.3466 + 0.001  # ln2 / 2, and room for n rounded from x / ln2 in fp32

r = np.cos(np.linspace(0.0, np.pi, 4001)) * HALF_WIDTH
r = r[np.abs(r) > 1e-6]
target = (np.expm1(r) - r) / r**2
weight_of_error = r**2 / np.exp(r)  # an error in P, as a relative error of exp(r)
basis = np.vander(r, DEGREE + 1, increasing=True)

lawson = np.ones_like(r)
for _ in range(200):
    w = weight_of_error * np.sqrt(lawson)
    coefficients, *_ = np.linalg.lstsq(basis * w[:, None], target * w, rcond=None)
    error = np.abs((basis @ coefficients - target) * weight_of_error)
    lawson *= error
    lawson /= lawson.sum()

rounded = coefficients.astype(np.float32).astype(np.float64)
worst = np.max(np.abs((basis @ rounded - target) * weight_of_error))
print("coefficients:", ", ".join(float(c).hex().replace("0000000p", "p") + "f" for c in rounded))
print(f"largest relative error of exp(r): {worst:.3g} ({worst / 2**-24:.3f} ulp of 1)")
