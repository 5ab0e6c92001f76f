"""The codecs by name: the names `--compress` / `compress=` take (`none`, `bf16`, `fp16`, `int8`, `powersgd:R`, and
`:noef` variants without error feedback) and the codec each names."""

from __future__ import annotations

from jaxpar.errors import OptionError
from jaxpar.parallel.compression.casts import Cast
from jaxpar.parallel.compression.error_feedback import NO_EF
from jaxpar.parallel.compression.int8 import Int8
from jaxpar.parallel.compression.powersgd import PowerSGD

CODECS = ("none", "bf16", "fp16", "int8", "powersgd:R")


def parse_codec(value):
    """The codec called `value` (None / 'none': no compression, returns None); a bad name is an OptionError.
    int8 and powersgd:R take a ':noef' suffix: the same codec without error feedback (int8:noef, powersgd:4:noef)."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str):
        raise OptionError("compress", value, f"must be one of: {', '.join(CODECS)}")
    base, colon, suffix = value.rpartition(":")
    error_feedback = not (colon and suffix == NO_EF)
    if not error_feedback:
        if base in ("bf16", "fp16"):
            raise OptionError("compress", value, f"{base} keeps no residual, so it has no :{NO_EF} variant; use "
                                                 f"{base}, int8:{NO_EF} or powersgd:R:{NO_EF}")
        value = base
    if value in ("bf16", "fp16"):
        return Cast(value)
    if value == "int8":
        return Int8(error_feedback)
    name, _, rank = value.partition(":")
    if name == "powersgd":
        if not rank.isdigit() or int(rank) < 1:
            example = "powersgd:4" if error_feedback else f"powersgd:4:{NO_EF}"
            raise OptionError("compress", value if error_feedback else f"{value}:{NO_EF}",
                              f"powersgd needs a rank R >= 1 after the colon, e.g. {example}")
        return PowerSGD(int(rank), error_feedback)
    raise OptionError("compress", value if error_feedback else f"{value}:{NO_EF}",
                      f"is not one of: {', '.join(CODECS)} (int8 and powersgd:R also as int8:{NO_EF}, "
                      f"powersgd:R:{NO_EF}: without error feedback)")
