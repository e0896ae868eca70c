"""What to check before a sweep: versions, GPUs with free and total memory, who else holds them.

Works on a machine without a GPU (or without torch) and says so plainly.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
from typing import Optional

MIB = 2**20


def _version(name: str) -> dict:
    try:
        module = importlib.import_module(name)
        return {"version": getattr(module, "__version__", "unknown"), "imports": True}
    except Exception as exc:  # report any import failure, never crash the doctor
        kind = "not installed" if isinstance(exc, ModuleNotFoundError) else f"fails to import: {exc}"
        return {"version": None, "imports": False, "error": kind.splitlines()[0][:200]}


def _smi(cmd: list[str]) -> Optional[str]:
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def nvidia_processes() -> list[dict]:
    """Compute processes holding memory on NVIDIA cards (nvidia-smi), by GPU bus id."""
    text = _smi(["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid,process_name,used_memory",
                 "--format=csv,noheader,nounits"])
    procs = []
    for line in (text or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            try:
                procs.append({"bus_id": parts[0], "pid": int(parts[1]), "name": parts[2], "used_mib": float(parts[3])})
            except ValueError:
                continue
    return procs


def diagnose() -> dict:
    """The doctor's findings as one JSON-able document."""
    report: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": {n: _version(n) for n in ("torch", "transformers", "peft", "bitsandbytes", "accelerate")},
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES",
                                                "ROCR_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")},
        "gpus": [],
        "warnings": [],
    }
    if report["env"]["CUDA_VISIBLE_DEVICES"] and report["env"]["CUDA_DEVICE_ORDER"] != "PCI_BUS_ID":
        report["warnings"].append("CUDA_VISIBLE_DEVICES is set without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA numbers "
                                  "cards fastest first, nvidia-smi by bus id; pin cards by bus id")
    if not report["libraries"]["torch"]["imports"]:
        report["warnings"].append("torch does not import: install the [probe] extra to run probes")
        return report
    import torch

    report["torch_build"] = {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
                             "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        report["warnings"].append("no CUDA or ROCm GPU is visible to torch: probes can run with --device cpu "
                                  "(tracker meter), not on a card")
        return report
    procs = nvidia_processes()
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            bus = f"{getattr(props, 'pci_domain_id', 0):08x}:{getattr(props, 'pci_bus_id', 0):02x}:" \
                  f"{getattr(props, 'pci_device_id', 0):02x}.0"
        held = total - free
        others = [p for p in procs if bus and str(p["bus_id"]).lower().endswith(str(bus).lower()[-7:])]
        gpu = {"index": i, "name": props.name, "total_mib": round(total / MIB, 1), "free_mib": round(free / MIB, 1),
               "held_mib": round(held / MIB, 1), "pci_bus_id": bus, "other_processes": others}
        report["gpus"].append(gpu)
        if held > 256 * MIB:
            report["warnings"].append(
                f"GPU {i} ({props.name}): {held / MIB:,.0f} MiB already held by other processes or contexts; a probe "
                "there measures against less than the card's total (an 8 GB card's rank-96 OOM once came from "
                "0.55 GB another process held)")
    return report


def render(report: dict) -> str:
    lines = [f"python {report['python']} on {report['platform']}"]
    for name, info in report["libraries"].items():
        lines.append(f"{name:>13}: " + (info["version"] if info["imports"] else info.get("error", "missing")))
    build = report.get("torch_build")
    if build:
        lines.append(f"  torch build: CUDA {build['cuda']}, HIP {build['hip']}, GPU visible: "
                     f"{'yes' if build['cuda_available'] else 'no'}")
    for key, value in report["env"].items():
        if value is not None:
            lines.append(f"{key}={value}")
    for g in report["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']}, {g['total_mib']:,.0f} MiB total, {g['free_mib']:,.0f} MiB free"
                     + (f", bus {g['pci_bus_id']}" if g["pci_bus_id"] else ""))
        for p in g["other_processes"]:
            lines.append(f"    pid {p['pid']} {p['name']}: {p['used_mib']:,.0f} MiB")
    if not report["gpus"]:
        lines.append("GPUs: none visible")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
