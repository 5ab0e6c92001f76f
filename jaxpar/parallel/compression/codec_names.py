"""The codecs by name: the names `--compress` / `compress=` take (`none`, `bf16`, `fp16`, `int8`, `powersgd:R`, and
`:noef` variants without error feedback, `powersgd:R:warmup=W`) and the codec each names."""

from __future__ import annotations

from jaxpar.errors import OptionError
from jaxpar.parallel.compression.casts import Cast
from jaxpar.parallel.compression.error_feedback import NO_EF
from jaxpar.parallel.compression.int8 import Int8
from jaxpar.parallel.compression.powersgd import DEFAULT_WARMUP, PowerSGD

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
        rank, _, option = rank.partition(":")
        shown = value if error_feedback else f"{value}:{NO_EF}"
        if not rank.isdigit() or int(rank) < 1:
            example = "powersgd:4" if error_feedback else f"powersgd:4:{NO_EF}"
            raise OptionError("compress", shown, f"powersgd needs a rank R >= 1 after the colon, e.g. {example}")
        warmup = DEFAULT_WARMUP
        if option:
            key, _, steps = option.partition("=")
            if key != "warmup" or not steps.isdigit():
                raise OptionError("compress", shown, f"powersgd:{rank} takes warmup=W (W >= 0 uncompressed exchanges "
                                                     f"first) after its rank, e.g. powersgd:{rank}:warmup=50")
            warmup = int(steps)
        return PowerSGD(int(rank), error_feedback, warmup)
    raise OptionError("compress", value if error_feedback else f"{value}:{NO_EF}",
                      f"is not one of: {', '.join(CODECS)} (int8 and powersgd:R also as int8:{NO_EF}, "
                      f"powersgd:R:{NO_EF}: without error feedback)")
