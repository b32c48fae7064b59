"""Reading other processes in tests: a process can exit (or be a zombie not yet reaped) between
listing it and reading its command line, so every read here treats a vanished process as absent."""
import psutil


def cmdline(proc: psutil.Process) -> str:
    """The process's command line as one string, or "" once it has exited or is a zombie."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process under `pid` (none once `pid` itself has gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
