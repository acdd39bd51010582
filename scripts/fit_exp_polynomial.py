#!/usr/bin/env python3
"""Fits the polynomial of vpce's vectorised exp (src/cpu/simd/exp-inl.h, kExpCoefficients):
exp(r) = 1 + r + r^2 P(r) for |r| <= ln2 / 2 (plus slack for the rounding of n), P of
degree 4, after Cody-Waite's reduction.

It minimises the largest relative error of the exponential, by Lawson's iteratively
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


# Exponential: P(r) = (e^r - 1 - r) / r^2; an error in P is a relative error of e^r times r^2 / e^r.
half_width = 0.3466 + 0.001
r = np.cos(np.linspace(0.0, np.pi, 4001)) * half_width
r = r[np.abs(r) > 1e-6]
p, worst = minimax(r, (np.expm1(r) - r) / r**2, r**2 / np.exp(r), 4)
show("Exponential, P of degree 4", p, worst, 2.0**-24, "1")
