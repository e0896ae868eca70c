"""What to check before a sweep: versions, GPUs with free and total memory, who else holds them.

Works on a machine without a GPU (or without torch) and says so plainly.
"""

from __future__ import annotations

import importlib
import json
import os
import re
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


def run_smi(cmd: list[str], warnings: Optional[list[str]] = None) -> Optional[str]:
    """A vendor tool's output, or None (missing, failed: a failure is reported, never read)."""
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as exc:
        if warnings is not None:
            warnings.append(f"{cmd[0]} could not run: {exc}")
        return None
    if out.returncode != 0:
        if warnings is not None:
            first = (out.stderr or out.stdout).strip().splitlines()[:1]
            warnings.append(f"{cmd[0]} exited {out.returncode}" + (f": {first[0][:160]}" if first else ""))
        return None
    return out.stdout


def bus_id(props) -> Optional[str]:
    """A card's PCI address as nvidia-smi prints it ('00000000:01:00.0'), from torch's integer
    domain, bus and device ids; None when torch gives none."""
    bus = getattr(props, "pci_bus_id", None)
    if not isinstance(bus, int):
        return None
    domain = getattr(props, "pci_domain_id", 0) or 0
    device = getattr(props, "pci_device_id", 0) or 0
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def same_bus(a: str, b: str) -> bool:
    """nvidia-smi prints 8 domain digits, rocm-smi and others 4: compare bus, device and function."""
    def norm(x: str) -> tuple[int, ...]:
        parts = re.split(r"[:.]", x.strip())
        return tuple(int(p, 16) for p in parts[-3:]) if len(parts) >= 3 else ()

    try:
        return norm(a) == norm(b) and norm(a) != ()
    except ValueError:
        return False


def nvidia_processes(warnings: Optional[list[str]] = None) -> list[dict]:
    """Compute processes holding memory on NVIDIA cards (nvidia-smi), by GPU bus id."""
    text = run_smi(["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid,process_name,used_memory",
                 "--format=csv,noheader,nounits"], warnings)
    procs = []
    for line in (text or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            try:
                procs.append({"bus_id": parts[0], "pid": int(parts[1]), "name": parts[2], "used_mib": float(parts[3])})
            except ValueError:
                continue
    return procs


def rocm_processes(warnings: Optional[list[str]] = None) -> list[dict]:
    """Processes holding memory on AMD cards (``rocm-smi --showpids --json``): pid, name, the
    memory they hold; rocm-smi names no bus per process, so each is listed on every card it
    reports (the number of GPUs the process uses is in its record)."""
    text = run_smi(["rocm-smi", "--showpids", "--json"], warnings)
    if not text:
        return []
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    procs = []
    for key, value in (doc.get("system", {}) if isinstance(doc, dict) else {}).items():
        m = re.match(r"PID(\d+)", key)
        if not m:
            continue
        fields = [f.strip() for f in str(value).split(",")]
        try:
            used = float(fields[2]) / MIB if len(fields) > 2 else None
        except ValueError:
            used = None
        procs.append({"bus_id": None, "pid": int(m[1]), "name": fields[0] if fields else "",
                      "used_mib": round(used, 1) if used is not None else None})
    return procs


def rocm_driver_version(warnings: Optional[list[str]] = None) -> Optional[str]:
    """The driver version from ``rocm-smi --showdriverversion --json`` (not its banner line)."""
    text = run_smi(["rocm-smi", "--showdriverversion", "--json"], warnings)
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    for value in (doc or {}).values():
        if isinstance(value, dict):
            for k, v in value.items():
                if "driver version" in k.lower():
                    return str(v)
    return None


def smi_memory(warnings: Optional[list[str]] = None) -> dict[str, dict]:
    """Used and total MiB per card by bus id, from nvidia-smi: read without creating a CUDA
    context (torch's mem_get_info would, and a context is several hundred MiB of its own)."""
    text = run_smi(["nvidia-smi", "--query-gpu=pci.bus_id,memory.used,memory.total", "--format=csv,noheader,nounits"],
                warnings)
    out = {}
    for line in (text or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            try:
                out[parts[0]] = {"used_mib": float(parts[1]), "total_mib": float(parts[2])}
            except ValueError:
                continue
    return out


#: Memory held on a card by other processes above which the doctor warns.
HELD_WARN_MIB = 256


def diagnose() -> dict:
    """The doctor's findings as one JSON-able document."""
    report: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": {n: _version(n) for n in ("torch", "transformers", "peft", "bitsandbytes", "accelerate")},
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES",
                                                "ROCR_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
                                                "PYTORCH_HIP_ALLOC_CONF")},
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
    hip = report["torch_build"]["hip"] is not None
    if hip:
        procs = rocm_processes(report["warnings"])
        report["driver"] = rocm_driver_version(report["warnings"])
    else:
        procs = nvidia_processes(report["warnings"])
    memory = {} if hip else smi_memory(report["warnings"])
    me = os.getpid()
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        bus = bus_id(props)
        on_card = [p for p in procs if p["pid"] != me and (p["bus_id"] is None or (bus and same_bus(p["bus_id"], bus)))]
        gpu = {"index": i, "name": props.name, "total_mib": round(props.total_memory / MIB, 1), "pci_bus_id": bus,
               "other_processes": on_card}
        used = next((v for k, v in memory.items() if bus and same_bus(k, bus)), None)
        if used is not None:
            gpu["used_mib"] = used["used_mib"]
            gpu["free_mib"] = round(used["total_mib"] - used["used_mib"], 1)
        report["gpus"].append(gpu)
        held = sum(p["used_mib"] or 0 for p in on_card)
        if held > HELD_WARN_MIB:
            report["warnings"].append(
                f"GPU {i} ({props.name}): {held:,.0f} MiB held by other processes "
                f"({', '.join(str(p['pid']) for p in on_card)}); a probe there measures against less than the "
                "card's total (an 8 GB card's rank-96 OOM once came from 0.55 GB another process held)")
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
        free = f", {g['free_mib']:,.0f} MiB free" if g.get("free_mib") is not None else ""
        lines.append(f"GPU {g['index']}: {g['name']}, {g['total_mib']:,.0f} MiB total{free}"
                     + (f", bus {g['pci_bus_id']}" if g["pci_bus_id"] else ""))
        for p in g["other_processes"]:
            used = f"{p['used_mib']:,.0f} MiB" if p.get("used_mib") is not None else "memory not reported"
            lines.append(f"    pid {p['pid']} {p['name']}: {used}")
    if not report["gpus"]:
        lines.append("GPUs: none visible")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
