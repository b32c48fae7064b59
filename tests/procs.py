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


def alive(proc: psutil.Process) -> bool:
    """Whether the process runs (not exited, not a zombie waiting to be reaped)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_name(proc: psutil.Process) -> str:
    """The process's name, or "" once it has exited."""
    try:
        return proc.name()
    except psutil.Error:
        return ""


def listening_addresses(procs: list[psutil.Process]) -> set[str]:
    """The IP addresses the processes listen on (TCP LISTEN); one that exits while being read (an idle
    Ray worker the pool retires) listens on nothing."""
    found: set[str] = set()
    for proc in procs:
        try:
            found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == "LISTEN"}
        except psutil.Error:
            continue
    return found
