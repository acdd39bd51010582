#!/usr/bin/env python3
"""Fits the polynomials of vpce's vectorised exp (src/cpu/simd_rows.cc).

- Exp2 (AVX-512): 2^f = 1 + f Q(f) for f in [0, 1] (f = t - floor(t)), Q of degree 5 (the
  full exp) and 4 (the forward's sums over bf16 / fp16 logits).
- Exponential (other targets): exp(r) = 1 + r + r^2 P(r) for |r| <= ln2 / 2 (plus slack
  for the rounding of n), P of degree 4 (full) and 3 (the forward's sums over bf16 / fp16
  logits).

Each minimises the largest relative error of the exponential, by Lawson's iteratively
reweighted least squares on Chebyshev points. Prints the fp32 coefficients (as C hex
literals, highest degree first, the order of the Horner steps) and the error once they are
rounded to fp32. Needs NumPy (for example the venv that bench/compare.sh makes).
"""
import numpy as np


def minimax(x, target, weight_of_error, degree):
    """Coefficients (lowest degree first) minimising max |(poly(x) - target) weight|."""
    basis = np.vander(x, degree + 1, increasing=True)
    lawson = np.ones_like(x)
    for _ in range(300):
        w = weight_of_error * np.sqrt(lawson)
        coefficients, *_ = np.linalg.lstsq(basis * w[:, None], target * w, rcond=None)
        error = np.abs((basis @ coefficients - target) * weight_of_error)
        lawson *= error
        lawson /= lawson.sum()
    rounded = coefficients.astype(np.float32).astype(np.float64)
    worst = np.max(np.abs((basis @ rounded - target) * weight_of_error))
    return rounded, worst


def show(name, coefficients, worst, unit, unit_name):
    print(f"{name}:", ", ".join(float(c).hex().replace("0000000p", "p") + "f" for c in coefficients[::-1]))
    print(f"  largest relative error: {worst:.3g} ({worst / unit:.3f} ulp of {unit_name})")


# Exp2: Q(f) = (2^f - 1) / f; an error in Q is a relative error of 2^f times f / 2^f.
f = (np.cos(np.linspace(0.0, np.pi, 4001)) + 1.0) / 2.0
f = f[f > 1e-7]
for degree in (5, 4):
    q, worst = minimax(f, np.expm1(f * np.log(2.0)) / f, f / np.exp2(f), degree)
    show(f"Exp2, Q of degree {degree}", q, worst, 2.0**-23, "1 <= 2^f < 2")

# Exponential: P(r) = (e^r - 1 - r) / r^2; an error in P is a relative error of e^r times r^2 / e^r.
half_width = 0.3466 + 0.001
r = np.cos(np.linspace(0.0, np.pi, 4001)) * half_width
r = r[np.abs(r) > 1e-6]
for degree in (4, 3):
    p, worst = minimax(r, (np.expm1(r) - r) / r**2, r**2 / np.exp(r), degree)
    show(f"Exponential, P of degree {degree}", p, worst, 2.0**-24, "1")
