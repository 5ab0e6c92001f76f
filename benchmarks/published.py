"""Published scaling results projected with jaxpar's own cost model, every input a cited fact or a marked assumption.

`python -m benchmarks.published` prints the table (docs/cost-model.md holds it). Each row is a synchronous
data-parallel step of a CNN: a gradient all-reduce of (parameters x 4 bytes) over the GPUs, priced by
`jaxpar.cost.hardware.step_cost` on a `Profile` with nodes, exactly as `--explain` and `sim_time` price a compiled
step (the same `jaxpar.cost.pricing` formulas and overlap model), on one `jaxpar.cost.hlo.Collective` standing for
the all-reduce the step contains. Scaling efficiency = step time on the baseline GPUs / step time on N GPUs (the
per-GPU batch fixed, so that is throughput per GPU against the baseline's).

Compute per step. The one measured P100 training time the papers state is Goyal et al.'s: "backpropagation on a
single P100 takes 120 ms" (ResNet-50, 32 images). With the cost model's bucket assumption (backward = 2/3 of a
step's compute) that is 180 ms for 32 images, so a P100 sustains 6 x 3.8e9 x 32 / 0.18 s = 4.05 TFLOP/s on
ResNet-50 (6 FLOPs per multiply-add of the forward pass: forward + backward). The other models' compute is their
published multiply-adds per image at that same sustained rate: an assumption (equal GPU efficiency across models),
marked in the table, except where a measured single-GPU throughput of the same GPU at the same per-GPU batch is
published: TensorFlow's benchmarks (tensorflow/docs_src/performance/benchmarks.md, May 2017, "Details for NVIDIA
DGX-1 (NVIDIA Tesla P100)", training synthetic data, batch 64 per GPU, 1 GPU) give Inception V3 142 and VGG-16 154
images/s, measured with tf_cnn_benchmarks, the script the Horovod paper's benchmarks ran. Those rows use it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from jaxpar.cost.hardware import Link, Profile, step_cost
from jaxpar.cost.hlo import Collective
from jaxpar.parallel import mesh as mesh_lib

# multiply-adds per 224x224 image, forward pass
MACS = {"ResNet-50": 3.8e9,  # He et al. 2016, Table 1
        "ResNet-101": 7.6e9,  # He et al. 2016, Table 1
        "VGG-16": 15.3e9,  # He et al. 2016, Sec. 4.1 ("VGG-16/19 nets (15.3/19.6 billion FLOPs)")
        "Inception V3": 5.0e9}  # Szegedy et al. 2016, "Rethinking the Inception Architecture", Sec. 1 / Table 3
PARAMETERS = {"ResNet-50": 25.6e6,  # He et al. 2016 / torchvision
              "ResNet-101": 44.5e6,  # torchvision model card (44,549,160)
              "VGG-16": 138e6,  # Simonyan and Zisserman 2015, Table 2 (138 M)
              "Inception V3": 23.8e6}  # Keras Applications table (23,851,784)
P100_PEAK = 10.6e12  # Tesla P100 SXM2 datasheet, FP32
GOYAL_BACKWARD = 0.120  # seconds: Goyal et al. 2017, Sec. 5: backprop on one P100, ResNet-50, 32 images
GOYAL_BATCH = 32
P100_SUSTAINED = 6 * MACS["ResNet-50"] * GOYAL_BATCH / (GOYAL_BACKWARD / (2 / 3))  # 4.05e12 FLOP/s
_NVLINK_P100 = Link(5e-6, 20e9)  # one NVLink 1.0 link per ring hop, 20 GB/s each way (P100: 4 links, 160 GB/s
# bidirectional); alpha assumed, as in the built-in profiles
_PCIE3 = Link(5e-6, 15.75e9)  # PCIe 3.0 x16, 15.75 GB/s each way; alpha assumed


def goyal_profile() -> Profile:
    """Facebook Big Basin (Goyal et al. 2017, Sec. 5): 8 P100s per server on NVLink, one Mellanox ConnectX-4
    50 Gbit/s Ethernet NIC per server (6.25 GB/s); aggregation within a server, then between servers, then back:
    the hierarchical all-reduce; each layer's gradient aggregated as soon as it is computed (bucket = the last
    layer to finish, ResNet-50's conv1: 7x7x3x64 weights)."""
    return Profile("big-basin-p100", P100_PEAK, {a: _NVLINK_P100 for a in mesh_lib.AXES},
                   "Goyal et al. 2017, Sec. 5; alpha 50 us (TCP) between servers assumed", None, P100_SUSTAINED,
                   devices_per_node=8, inter_node=Link(50e-6, 50e9 / 8), nics_per_node=1,
                   allreduce="hierarchical", overlap=True, bucket=7 * 7 * 3 * 64 * 4)


def horovod_profile() -> Profile:
    """Uber's benchmark cluster (Sergeev and Del Balso 2018; Horovod README / docs/benchmarks.md): servers of 4
    Pascal GPUs on a RoCE-capable 25 Gbit/s network (one NIC per server assumed, 3.125 GB/s), NCCL's ring
    all-reduce, Tensor Fusion's 64 MB buffer (Horovod docs: the default HOROVOD_FUSION_THRESHOLD). GPUs inside a
    server on PCIe 3.0 x16 (assumed: the paper says "Pascal GPUs")."""
    return Profile("horovod-p100", P100_PEAK, {a: _PCIE3 for a in mesh_lib.AXES},
                   "Sergeev and Del Balso 2018; one 25 Gbit/s NIC per server, PCIe inside a server and alpha 10 us "
                   "(RDMA) between servers assumed", None, P100_SUSTAINED, devices_per_node=4,
                   inter_node=Link(10e-6, 25e9 / 8), nics_per_node=1, allreduce="ring", overlap=True, bucket=64e6)


# images/s on one P100 (DGX-1, SXM2), batch 64, synthetic data: TensorFlow benchmarks, May 2017 (module docstring)
TF_P100_BATCH64 = {"Inception V3": 142.0, "VGG-16": 154.0}


class Case(NamedTuple):
    paper: str
    model: str
    batch: int  # images per GPU per step
    baseline: int  # GPUs of the baseline the efficiency is relative to
    gpus: int
    reported: float  # scaling efficiency the paper reports
    profile: Profile
    compute_source: str
    images_per_second: float | None = None  # a measured single-GPU throughput, when one is cited


def cases() -> list[Case]:
    goyal, horovod = goyal_profile(), horovod_profile()
    measured = "from Goyal's measured 120 ms backward, 32 images"
    scaled = "scaled from ResNet-50 by multiply-adds (assumption)"

    def tf(model):
        return f"TensorFlow benchmarks: {TF_P100_BATCH64[model]:g} images/s on one P100", TF_P100_BATCH64[model]

    return [Case("Goyal et al. 2017", "ResNet-50", 32, 8, 256, 0.90, goyal, measured),
            Case("Sergeev and Del Balso 2018", "Inception V3", 64, 1, 512, 0.90, horovod, *tf("Inception V3")),
            Case("Sergeev and Del Balso 2018", "ResNet-101", 64, 1, 512, 0.90, horovod, scaled),
            Case("Sergeev and Del Balso 2018", "VGG-16", 64, 1, 512, 0.68, horovod, *tf("VGG-16")),
            # Horovod's docs/benchmarks.md: the same cluster at 32 servers (128 GPUs): 90%, 90% and 79%
            Case("Horovod docs/benchmarks.md", "Inception V3", 64, 1, 128, 0.90, horovod, *tf("Inception V3")),
            Case("Horovod docs/benchmarks.md", "ResNet-101", 64, 1, 128, 0.90, horovod, scaled),
            Case("Horovod docs/benchmarks.md", "VGG-16", 64, 1, 128, 0.79, horovod, *tf("VGG-16"))]


def _allreduce(nbytes: float, gpus: int) -> list[Collective]:
    """The gradient all-reduce of a data-parallel step over `gpus` (positions 0..gpus-1, filling nodes in order)."""
    if gpus <= 1:
        return []
    return [Collective("all-reduce", int(nbytes), gpus, (mesh_lib.REPLICA_AXIS,), groups=(tuple(range(gpus)),))]


def step_seconds(case: Case, gpus: int, profile: Profile | None = None) -> float:
    """Seconds of one step of `case` on `gpus` GPUs, priced by `jaxpar.cost.hardware.step_cost`."""
    profile = profile or case.profile
    if case.images_per_second:  # the measured time, as FLOPs at the P100's sustained rate (so profiles scale it)
        flops = case.batch / case.images_per_second * P100_SUSTAINED
    else:
        flops = 6 * MACS[case.model] * case.batch
    cost = step_cost(flops, _allreduce(4 * PARAMETERS[case.model], gpus), profile)
    return cost.compute + cost.exposed


def efficiency(case: Case, profile: Profile | None = None) -> float:
    return step_seconds(case, case.baseline, profile) / step_seconds(case, case.gpus, profile)


def table() -> list[dict]:
    rows = []
    for case in cases():
        flat = efficiency(case, replace(case.profile, overlap=False))
        projected = efficiency(case)
        rows.append({"paper": case.paper, "model": case.model, "gpus": f"{case.baseline} -> {case.gpus}",
                     "per_gpu_batch": case.batch, "compute_s": step_seconds(case, 1), "compute": case.compute_source,
                     "gradient_bytes": 4 * PARAMETERS[case.model], "allreduce": case.profile.allreduce,
                     "reported": case.reported, "projected": projected, "no_overlap": flat,
                     "within_10_points": abs(projected - case.reported) <= 0.10})
    return rows


def images_per_second_to_reach(case: Case, target: float, overlap: bool = True) -> float:
    """The single-GPU images/s at which the projection of `case` equals `target` (bisection on the sustained
    FLOP/s): what a missed row's compute would have to be."""
    profile = replace(case.profile, overlap=overlap)
    lo, hi = 1e-3, 1e3  # factors of the sustained FLOP/s

    def at(factor):
        return replace(profile, sustained=P100_SUSTAINED * factor)

    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if efficiency(case, at(mid)) > target else (lo, mid)
    return case.batch / step_seconds(case, 1, at(lo))


def markdown(rows) -> str:
    lines = ["| paper | model | GPUs | batch per GPU | compute per step (s) | gradient (MB) | all-reduce | reported "
             "| projected | without overlap | within 10 points |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['paper']} | {r['model']} | {r['gpus']} | {r['per_gpu_batch']} | {r['compute_s']:.3f} "
                     f"({r['compute']}) | {r['gradient_bytes'] / 1e6:.1f} | {r['allreduce']} | {r['reported']:.0%} | "
                     f"{r['projected']:.1%} | {r['no_overlap']:.1%} | {'yes' if r['within_10_points'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(table()))
    for case, row in zip(cases(), table()):
        if not row["within_10_points"]:
            print(f"{case.model}: the projection reaches the reported {case.reported:.0%} at "
                  f"{images_per_second_to_reach(case, case.reported):.0f} images/s on one GPU (without overlap: "
                  f"{images_per_second_to_reach(case, case.reported, overlap=False):.0f}); the inputs give "
                  f"{case.batch / step_seconds(case, 1):.0f}")
