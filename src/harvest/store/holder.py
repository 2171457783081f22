"""Where a lease's holder runs, to prove it gone on this machine (harvest.store.lease): a process is its boot id
(a kernel's, shared by its containers), its pid namespace, its pid and its start time; never its hostname, which
another VM or container may share."""

from __future__ import annotations

import os

from harvest.store.records import LeaseRecord


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def _pid_namespace(pid: int | str = "self") -> str:
    try:
        return str(os.stat(f"/proc/{pid}/ns/pid").st_ino)
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [state, ppid, ...] ([] where there is no such process)."""
    stat = _read_first_line(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split() if ")" in stat else []


def _start_ticks(pid: int) -> str:
    """When process `pid` of this namespace started (clock ticks since boot): tells a reused pid apart."""
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else ""


def process_key(pid: int | None = None) -> str:
    """`boot:pid-namespace:pid:start` of a process of this machine ('' parts where unknown)."""
    pid = os.getpid() if pid is None else pid
    boot = _read_first_line("/proc/sys/kernel/random/boot_id")
    return f"{boot}:{_pid_namespace()}:{pid}:{_start_ticks(pid)}"


def holder_alive(record: LeaseRecord) -> bool | None:
    """Whether the process that wrote `record` still runs, where this machine can prove it (the record's
    process key, of its boot and pid namespace; never its hostname): False when that pid is gone, runs
    another process, or is a zombie (killed, not reaped: it never writes again); True when that very process
    still runs; None otherwise (another boot, another pid namespace, or no key)."""
    if record.process.count(":") != 3:
        return None
    boot, ns, pid, start = record.process.split(":")
    my_boot, my_ns, _, _ = process_key().split(":")
    if not boot or boot != my_boot or not ns or ns != my_ns or not pid.isdigit() or not start:
        return None
    fields = _stat_fields(int(pid))
    return len(fields) > 19 and fields[19] == start and fields[0] not in ("Z", "X")
