"""Measuring this machine for the cost model (`python -m jaxpar.calibrate`): matmul FLOP/s, launch time, the links
of each mesh axis per collective kind, the gradient codecs' compute and a model's own step, written as a hardware
profile that `--hardware FILE` reads."""

from jaxpar.calibration.machine import MATMUL_SIZES, calibrate, summary
from jaxpar.calibration.model import calibrate_model

__all__ = ["MATMUL_SIZES", "calibrate", "calibrate_model", "summary"]
