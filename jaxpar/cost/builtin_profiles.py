"""The built-in hardware profiles (`jaxpar.PROFILES`, `--hardware NAME`): A100s on NVLink inside a node, across
nodes on InfiniBand or Ethernet, and DGX A100 nodes with their NICs."""
from __future__ import annotations

from jaxpar.cost.profile import Link, Profile
from jaxpar.parallel import mesh as mesh_lib

_NVLINK = Link(5e-6, 300e9)
_IB100 = Link(10e-6, 12.5e9)
_ETH10 = Link(50e-6, 1.25e9)
_A100_PEAK = 312e12
# Narayanan et al. 2021 (Megatron-LM, "Efficient Large-Scale Language Model Training on GPU Clusters", SC21): 502
# PFLOP/s on 3072 A100s, 52% of peak, i.e. 163 TFLOP/s per GPU on a 1T-parameter GPT: a published sustained figure
# for a well-tuned large model; small models sustain less.
_A100_SUSTAINED = 163e12
_A100_MEMORY = 80e9
_NVLINK_SOURCE = ("A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16 tensor-core peak, 80 GB HBM2e, NVLink 3 at "
                  "600 GB/s per GPU (300 GB/s each way); sustained 163 TFLOP/s: Narayanan et al. 2021 (Megatron-LM, "
                  "502 PFLOP/s on 3072 A100s, 52% of peak)")
# alpha (latency) is an assumed order of magnitude, not a measurement: a few microseconds for an NVLink
# collective step, ~10 us for InfiniBand with its software stack, ~50 us for TCP over Ethernet.
PROFILES: dict[str, Profile] = {
    "a100-nvlink": Profile("a100-nvlink", _A100_PEAK, {a: _NVLINK for a in mesh_lib.AXES},
                           _NVLINK_SOURCE + "; every axis inside one 8-GPU NVSwitch node; alpha 5 us assumed",
                           _A100_MEMORY, _A100_SUSTAINED),
    # stage gets the data axis's link: both are the outer axes that cross nodes (mesh.AXES' order)
    "a100-ib100": Profile("a100-ib100", _A100_PEAK, {mesh_lib.DATA: _IB100, mesh_lib.STAGE: _IB100,
                                                     mesh_lib.FSDP: _NVLINK, mesh_lib.SEQ: _NVLINK,
                                                     mesh_lib.MODEL: _NVLINK},
                          _NVLINK_SOURCE + "; the data and stage axes cross nodes on 100 Gb/s InfiniBand (EDR: "
                          "12.5 GB/s per device); fsdp, seq and model inside a node; alpha 10 us across nodes assumed",
                          _A100_MEMORY, _A100_SUSTAINED),
    "a100-eth10": Profile("a100-eth10", _A100_PEAK, {mesh_lib.DATA: _ETH10, mesh_lib.STAGE: _ETH10,
                                                     mesh_lib.FSDP: _NVLINK, mesh_lib.SEQ: _NVLINK,
                                                     mesh_lib.MODEL: _NVLINK},
                          _NVLINK_SOURCE + "; the data and stage axes cross nodes on 10 Gb/s Ethernet (1.25 GB/s "
                          "per device); fsdp, seq and model inside a node; alpha 50 us (TCP) assumed", _A100_MEMORY,
                          _A100_SUSTAINED),
    # DGX A100: 8 GPUs on NVSwitch, 8 ConnectX-6 HDR 200 Gb/s InfiniBand NICs for compute (25 GB/s each)
    "dgx-a100": Profile("dgx-a100", _A100_PEAK, {a: _NVLINK for a in mesh_lib.AXES},
                        _NVLINK_SOURCE + "; DGX A100 datasheet: 8 GPUs per node, 8 x 200 Gb/s HDR InfiniBand NICs "
                        "(25 GB/s each); alpha 5 us inside a node and 10 us between nodes assumed", _A100_MEMORY,
                        _A100_SUSTAINED, devices_per_node=8, inter_node=Link(10e-6, 25e9), nics_per_node=8),
}
