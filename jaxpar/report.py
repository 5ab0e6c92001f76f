"""`python -m jaxpar.report`: the report's command-line entry point (the report is `jaxpar.io.report`)."""

from jaxpar.io.report import main

if __name__ == "__main__":
    raise SystemExit(main())
