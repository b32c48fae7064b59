"""The commands that belong to no one package, each a `main(argv) -> int` in the shared frame:
`compare`, `score`, `advise` and `info`; `parity.cli` dispatches to all commands.
"""
