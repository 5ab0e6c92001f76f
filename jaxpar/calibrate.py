"""`python -m jaxpar.calibrate`: measure this machine and write a hardware profile (`jaxpar.calibration.command`)."""

from jaxpar.calibration.command import main

if __name__ == "__main__":
    raise SystemExit(main())
