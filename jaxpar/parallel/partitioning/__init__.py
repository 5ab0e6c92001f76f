"""Every partitioning decision: logical axis names -> mesh axes -> `PartitionSpec` / `NamedSharding`.

Every PartitionSpec and NamedSharding of the project is built in this package (a lint checks it); the rest of the
library asks it for layouts by what they are for (`from jaxpar.parallel import partitioning as shd`):

- `rules`: the sharding rules (`DEFAULT_RULES`, a dict or Flax's list of pairs) and a parameter's spec from them;
- `fsdp_placement`: which dimension the fsdp axis splits (big_vision's fallback, parameters without names);
- `state`: the train state's shardings (rules, path rules and a model's own specs) and the optimizer state's;
- `stages`: parameters split over the stage axis, and the layouts inside a stage map (`over_stages`);
- `batches`: the examples over the batch axes;
- `replicas`: per-replica stacks, ZeRO-3's gathered copies, a replica's own shard of each leaf;
- `communicators`: a compressed communicator's state and PowerSGD's factors;
- `restore`: where a saved array is read;
- `sequence`: an activation's sequence split over the seq axis (context parallelism);
- `specs`: the primitives they share (replicated, per replica, an entry's axes, bytes per device).
"""

from jaxpar.parallel.partitioning.batches import batch_sharding, batch_spec, fsdp_rows
from jaxpar.parallel.partitioning.communicators import (COMM_OWN, communicator_shardings, communicator_specs,
                                                        factor_specs, factor_splits)
from jaxpar.parallel.partitioning.fsdp_placement import fsdp_anywhere, fsdp_split
from jaxpar.parallel.partitioning.replicas import (fsdp_reduce_specs, gathered_over, per_fsdp_device,
                                                   replicate_within, stacked, within_replica_axes,
                                                   within_replica_specs, within_replica_splits)
from jaxpar.parallel.partitioning.restore import restore_sharding
from jaxpar.parallel.partitioning.sequence import sequence_blocks
from jaxpar.parallel.partitioning.rules import DEFAULT_RULES, LAYERS, normalize_rules, spec_for, validate_rules
from jaxpar.parallel.partitioning.specs import (PER_REPLICA, REPLICATED, bytes_per_device, constrain,
                                                device_grid_spec, leading_over_devices, replicated,
                                                replicated_specs, specs_of, split_axes)
from jaxpar.parallel.partitioning.stages import (STAGE_SPLIT, check_stages, over_stages, stage_row_shards,
                                                 stage_rows, stage_rows_axis)
from jaxpar.parallel.partitioning.state import (is_variable, logical_names_of, optimizer_shardings, own_axes,
                                                state_shardings)

__all__ = ["COMM_OWN", "DEFAULT_RULES", "LAYERS", "PER_REPLICA", "REPLICATED", "STAGE_SPLIT", "batch_sharding",
           "batch_spec", "bytes_per_device", "check_stages", "communicator_shardings", "communicator_specs",
           "constrain", "device_grid_spec", "factor_specs", "factor_splits", "fsdp_anywhere", "fsdp_reduce_specs",
           "fsdp_rows", "fsdp_split", "gathered_over", "is_variable", "leading_over_devices", "logical_names_of",
           "normalize_rules", "optimizer_shardings", "over_stages", "own_axes", "per_fsdp_device",
           "replicate_within", "replicated", "replicated_specs", "restore_sharding", "sequence_blocks",
           "spec_for", "specs_of", "split_axes", "stacked", "stage_row_shards", "stage_rows", "stage_rows_axis",
           "state_shardings", "validate_rules", "within_replica_axes", "within_replica_specs",
           "within_replica_splits"]
