"""A process-wide memory budget for frozen graphs.

With ``freezing`` Inductor turns the weights into constants of each compiled graph and folds /
prepacks them there (MKL-packed linears, the CPP GEMM template's blocked layout), so every frozen
graph holds its own copy of the weights it uses: SmolLM2-135M fp32 is ~530 MB per graph, and one
object serving greedy and sampled rounds at two widths and three depths holds ~12 of them. Three
such objects fill a 24 GB machine, which then swaps. Past the budget
further graphs compile unfrozen (library GEMMs on the live weights: slower on CPU, no copy).

The account is per device type (host RAM for CPU graphs, device memory for CUDA graphs) and is
returned when the object that reserved it is garbage collected.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch

# Share of a device's memory that frozen weight copies may take, all objects of the process together
FREEZE_MEMORY_FRACTION = 0.5
ENV_BUDGET = "SPECGRAPH_FREEZE_BUDGET_GB"  # overrides the fraction, for every device type


def device_memory_bytes(device: torch.device) -> int:
    """Physical memory of the machine (CPU) or of the CUDA device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_bytes(*modules) -> int:
    """Bytes of the distinct parameters and buffers of ``modules`` (tied weights counted once)."""
    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        for t in (*m.parameters(), *m.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


class FreezeBudget:
    """Bytes of frozen weight copies reserved per device type, against a limit per device type."""

    def __init__(self, limit_bytes: dict | None = None):
        self._lock = threading.Lock()
        self.used: dict[str, int] = {}
        self._limit = dict(limit_bytes or {})

    def limit(self, device: torch.device) -> int:
        if device.type not in self._limit:
            env = os.environ.get(ENV_BUDGET)
            if env is not None:
                try:
                    gb = float(env)
                except ValueError:
                    raise ValueError(f"{ENV_BUDGET} must be a number of GB, got {env!r}") from None
                self._limit[device.type] = int(gb * 2**30)
            else:
                self._limit[device.type] = int(FREEZE_MEMORY_FRACTION * device_memory_bytes(device))
        return self._limit[device.type]

    def reserve(self, device: torch.device, nbytes: int, account: dict) -> bool:
        """Reserve ``nbytes`` for one more frozen graph on ``device`` and note it in ``account``
        (the object's own tally, given back by :meth:`track`); False when it would exceed the limit."""
        with self._lock:
            used = self.used.get(device.type, 0)
            if used + nbytes > self.limit(device):
                return False
            self.used[device.type] = used + nbytes
            account[device.type] = account.get(device.type, 0) + nbytes
            return True

    def release(self, account: dict) -> None:
        with self._lock:
            for dev, n in account.items():
                self.used[dev] = max(0, self.used.get(dev, 0) - n)
            account.clear()

    def track(self, owner, account: dict) -> None:
        """Give ``account`` back when ``owner`` is garbage collected (its graphs go with it)."""
        weakref.finalize(owner, self.release, account)


BUDGET = FreezeBudget()
