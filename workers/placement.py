"""Where a stage process runs: its device, its torch threads and CPU cores, a GPU stage's NUMA node."""
from __future__ import annotations

import logging
import os

import torch

from strata.comm import messages as M


def use_device(spec: M.StageJob, device: torch.device, log: logging.Logger) -> None:
    """Make `device` this process's, pinned to the plan's cores (a GPU stage without any: its own NUMA node's)
    and, on a GPU, held to the plan's memory."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)
        else:
            near_gpu(device, log)
        if spec.memory:  # the plan's cap, enforced: an over-tight plan fails here, not on a bigger card's spare
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec.memory / total), device)
    else:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)


def near_gpu(device: torch.device, log: logging.Logger) -> None:
    """Run on the CPU cores of the GPU's own NUMA node (sysfs `local_cpulist`), kept within this process's
    allowed cores. An unpinned CUDA stage's thread may sleep between decode steps and wake on the far
    socket, where every kernel launch (a decode step is hundreds) crosses the socket link. Nothing known:
    nothing changes."""
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return
    path = (f"/sys/bus/pci/devices/{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
            f"{getattr(props, 'pci_device_id', 0):02x}.0/local_cpulist")
    try:
        with open(path) as f:
            cores = parse_cpulist(f.read())
    except (OSError, ValueError):
        return
    cores &= os.sched_getaffinity(0)
    if cores and cores != os.sched_getaffinity(0):
        os.sched_setaffinity(0, cores)
        log.info("%s is local to cores %s: running there", device, sorted(cores))


def parse_cpulist(text: str) -> set[int]:
    """sysfs cpulist "0-15,32-47" -> {0, ..., 15, 32, ..., 47}."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        cores.update(range(int(a), int(b or a) + 1))
    return cores
