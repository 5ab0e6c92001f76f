"""Presets: each module defines `get_config() -> jaxpar.cli.Config`; use with
`python run.py --config configs/NAME.py`."""
