"""The dense projection every layer uses, y = x . kernel over the last axes of x, accumulated in
float32: tfm.kernels.reference.linear (the specification), named here for the model's readers."""

from __future__ import annotations

from tfm.kernels.reference import linear, linear_dtypes

__all__ = ["linear", "linear_dtypes"]
