"""The commands that belong to no one package, each a `main(argv) -> int` run through the shared
frame (`parity.runtime.frame`): `compare`, `score` (and the report output they share), `advise`,
and `info` (`models`, `backends`, `kernels`). The other commands live with their package
(`parity.nightly.command`, `parity.audit.command`, ...); `parity.cli` dispatches to all of them.
"""
