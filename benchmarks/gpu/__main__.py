"""`python3 -m benchmarks.gpu`: see the package docstring and `--help`."""

from benchmarks.gpu.cli import main

if __name__ == "__main__":
    main()
