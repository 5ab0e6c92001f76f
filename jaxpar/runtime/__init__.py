"""The processes and devices a run lives on: jax.distributed start-up, the launcher, preemption, device resources."""
