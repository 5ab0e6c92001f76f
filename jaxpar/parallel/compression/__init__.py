"""Gradient compression as stateful communicators: a codec wraps the replica-axis exchange of a `Communicator`.

A codec is optax-like: `init(params) -> (own, shared)` (its state: `own` is one replica's copy, e.g. an
error-feedback residual, stacked over the replicas in `TrainState.comm_state`; `shared` is the same on every
replica, e.g. PowerSGD's warm-start Q), `mean(leaves, own, shared, exchange) -> (means, own, shared)` (encode, the
exchange, decode), `payload(shapes, n) -> {collective: bytes}`: the exact bytes it hands to each collective per
device, from which `CompressedCommunicator.wire_bytes` gives what the busiest device sends, and
`flops(shapes, n)`: the arithmetic the codec adds to a step, per device, by kind ("elementwise", "matmul",
"orthogonalise"); an estimate from the operations written here, not XLA's count (XLA counts 20-45 FLOPs per element
for the elementwise codecs, its own way; it does not count the QR, a LAPACK call). A codec is one class holding its
encode / decode, its wire payload and its FLOP count (what `jaxpar.cost.codecs` prices).

- `casts`: bf16 and fp16 (`Cast`);
- `int8`: int8 codes with per-chunk scales, all-gathered (`Int8`);
- `powersgd`: rank-R PowerSGD with warm start (`PowerSGD`);
- `error_feedback`: the residuals of the error-feedback codecs;
- `codec_names`: the codecs by name (`parse_codec`);
- `exchange`: the collectives a codec may use, bound to an axis and an algorithm;
- `communicator`: `CompressedCommunicator` and `compressed(communicator, codec)`.

Where: `Sync(allreduce=ALG, compress=CODEC)` (the gradient), `LocalSGD` / `DiLoCo(compress=CODEC)` (a meeting's
outer gradients); `compressed(communicator("ring"), "int8")` builds one directly.
`int8:noef` / `powersgd:R:noef`: the same codecs without error feedback (no residual), for convergence studies.
"""

from jaxpar.parallel.compression.casts import FP16_MAX, Cast
from jaxpar.parallel.compression.codec_names import CODECS, parse_codec
from jaxpar.parallel.compression.communicator import OWN, SHARED, CompressedCommunicator, compressed
from jaxpar.parallel.compression.error_feedback import NO_EF
from jaxpar.parallel.compression.exchange import Exchange
from jaxpar.parallel.compression.int8 import INT8_CHUNK, Int8, int8_decode, int8_encode
from jaxpar.parallel.compression.powersgd import PowerSGD, as_matrix_shape, orthogonalize

__all__ = ["CODECS", "FP16_MAX", "INT8_CHUNK", "NO_EF", "OWN", "SHARED", "Cast", "CompressedCommunicator", "Exchange",
           "Int8", "PowerSGD", "as_matrix_shape", "compressed", "int8_decode", "int8_encode", "orthogonalize",
           "parse_codec"]
