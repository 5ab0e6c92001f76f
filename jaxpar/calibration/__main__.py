"""`python -m jaxpar.calibration`: the calibration command (`jaxpar.calibration.command`)."""

from jaxpar.calibration.command import main

raise SystemExit(main())
