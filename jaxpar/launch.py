"""`python -m jaxpar.launch`: the launcher's command-line entry point (the launcher is `jaxpar.runtime.launch`)."""

from jaxpar.runtime.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
