"""``attnlab info``: the machine as attnlab sees it (CPU, torch, C++ kernels, auto's thresholds)."""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any

#: CPU flags that decide attnlab's and torch's vector paths (x86: AVX2/AVX-512/AMX; ARM: SIMD).
RELEVANT_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)
DTYPES = ("float32", "bfloat16", "float16")


def environment() -> dict[str, Any]:
    """What ``attnlab info`` prints, as a dict (nothing is built or loaded to find it out)."""
    import torch

    from .. import __version__, _ext, _settings
    from ..functional.thresholds import cpu_info
    from ..functional.thresholds import describe as describe_thresholds

    model, flags = cpu_info()
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    shown = [f for f in RELEVANT_FLAGS if (f in flags) or (x86 and f.startswith(("avx", "amx")))]
    kernels = {}
    for name in _ext.KERNELS:
        try:
            path = str(_ext.library_path(name))
        except OSError as e:  # a source that cannot be read
            path = f"unknown ({e})"
        kernels[name] = {
            "state": _ext.state(name),
            "built": os.path.exists(path),
            "loaded": _ext.status(name) is True,
            "path": path,
        }
    return {
        "attnlab": __version__,
        "python": platform.python_version(),
        "cpu": {
            "model": model,
            "machine": platform.machine(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "flags": {f: f in flags for f in shown},
        },
        "torch": {
            "version": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available(),
        },
        "ext": {
            "mode": _ext.mode(),
            "env": _settings.text("ext"),
            "isa_path": _ext.isa_path(),
            "compiler": _ext.compiler(),
            "cache": str(_ext.cache_dir()),
            "kernels": kernels,
        },
        "thresholds": {d: describe_thresholds(getattr(torch, d)) for d in DTYPES},
    }


def print_environment(env: dict[str, Any]) -> None:
    """Prints `environment`'s dict as text, one fact per line, each wrapped to the terminal
    (`attnlab.cli._output.wrap`: later lines of a fact indented)."""
    from .. import _ext
    from ._output import wrap

    cpu, tch, ext = env["cpu"], env["torch"], env["ext"]
    have = " ".join(f for f, on in cpu["flags"].items() if on) or "none of interest"
    lack = " ".join(f for f, on in cpu["flags"].items() if not on)
    setting = f"{_ext.ENV}={ext['env']}" if ext["env"] is not None else f"{_ext.ENV} unset"
    facts = [
        (f"attnlab {env['attnlab']} · Python {env['python']}", "  "),
        (f"CPU: {cpu['model']} ({cpu['machine']}, {cpu['cores']} cores usable)", "  "),
        (f"  flags: {have}" + (f" · absent: {lack}" if lack else ""), "    "),
        (
            f"torch {tch['version']}: {tch['threads']} threads, CPU capability "
            f"{tch['cpu_capability']}, oneDNN {'yes' if tch['mkldnn'] else 'no'}",
            "  ",
        ),
        (
            f"C++ kernels: mode {ext['mode']} ({setting}), {ext['isa_path']} path, compiler "
            f"{ext['compiler'] or 'none'}, cache {ext['cache']}",
            "  ",
        ),
    ]
    width = max(len(n) for n in ext["kernels"])
    for name, k in ext["kernels"].items():
        where = f"  {k['path']}" if k["built"] else ""
        facts.append((f"  {name:<{width}}  {k['state']}{where}", "    "))
    facts += [(text, "  ") for text in env["thresholds"].values()]
    for text, indent in facts:
        print(wrap(text, indent=indent))


def _cmd_info(args: argparse.Namespace) -> int:
    env = environment()
    if args.json:
        print(json.dumps(env, indent=2))
    else:
        print_environment(env)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab info`` to the ``attnlab`` command's subparsers."""
    info = sub.add_parser(
        "info",
        help="print the CPU and its flags, torch, attnlab's C++ kernels and auto's thresholds",
        description=(
            "Prints what decides attnlab's engines on this machine: the CPU model and its "
            "vector flags, torch's version, threads and CPU capability, each C++ kernel "
            "(built or not, where, loaded in this process or not, ATTNLAB_EXT) and where "
            "auto's size thresholds come from. Builds and loads nothing."
        ),
    )
    info.add_argument("--json", action="store_true", help="print the same as one JSON object")
    info.set_defaults(func=_cmd_info)
