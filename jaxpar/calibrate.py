"""`python -m jaxpar.calibrate`: measure this machine for the cost model (the measuring is
`jaxpar.cost.calibration`)."""

from jaxpar.cost.calibration import main

if __name__ == "__main__":
    raise SystemExit(main())
