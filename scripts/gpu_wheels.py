"""Carry relaytrain to a GPU machine that reaches no package registry.

The GPU machine (docs/benchmarks.md, "GPU acceptance run") has Python 3.12 with a CUDA build of
torch, transformers, rich, psutil, pyyaml, jinja2, tokenizers and pytest in its own interpreter,
and nothing else relaytrain needs. Three modes, all stdlib until `--verify`:

    python scripts/gpu_wheels.py                 # here, online: gather .whl/ (make gpu-wheels)
    python3 scripts/gpu_wheels.py --check        # there: the carried wheels fit this source tree
    PYTHONPATH=SITE python3 scripts/gpu_wheels.py --verify   # there, after the install: imports,
                                                 # requirements and CUDA (make gpu-install)

Gathering downloads one binary wheel of each package in CARRY, at the version this interpreter
has installed (the versions the test suite passed with), for the GPU machine's Python and
manylinux platforms; builds relaytrain's own wheel; records a digest of the source tree so the
machine can refuse a wheel older than the code it carries; and prints the total, failing when
the wheels and the source tree exceed what one device call carries.

bitsandbytes travels (41 MiB, its kernels for every CUDA release) for model.quantize=nf4.
`datasets` stays behind (with pyarrow and pandas it is far beyond the budget): relaytrain imports
it only inside the glue and wikitext loaders (data/reading.py), which read the hub or a
`datasets` directory that the GPU machine has neither of.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".whl"
DIGEST = "relaytrain-source.sha256"  # beside the wheels: the tree relaytrain's wheel was built from
BUDGET_MIB = 64  # the working tree one device call carries, wheels included
# Where the GPU image's packages were last read: /work/.library/device/KINDS.md (2026-11-17).
CARRY = {
    "hydra-core": "absent from the GPU image; relaytrain composes every config with it",
    "omegaconf": "absent from the GPU image; hydra-core's config objects",
    "antlr4-python3-runtime": "absent from the GPU image; omegaconf's interpolation grammar",
    # 41 MiB (its CUDA kernels for every CUDA release): the largest of the carried, and within budget
    "bitsandbytes": "absent from the GPU image; model.quantize=nf4 (adapter=qlora) quantizes and dequantizes with it",
}
# Extras carried where this environment has them (the slow step's, `make test-slow`, does):
# an optional feature's package, left behind with one line where it is not installed here.
CARRY_IF_INSTALLED = {"torchao": "optim.state_bits=8|4 keeps AdamW's moments with it (the lowbit extra)"}
# `--with-deepspeed`: bench_gpu.py's Trainer + DeepSpeed ZeRO-3 offload contestant
# (scripts/deepspeed_contestant.py). DeepSpeed publishes its source only: it is built here into a
# pure-Python wheel, and its ops (the host Adam) are built by torch's JIT there on first use, with
# the machine's C++ compiler and ninja. With it go Trainer's accelerate and what DeepSpeed imports.
DEEPSPEED = {"accelerate": "transformers.Trainer's", "deepspeed": "ZeRO-3 with offload",
             **dict.fromkeys(("hjson", "py-cpuinfo", "msgpack", "einops", "ninja", "pydantic", "pydantic-core",
                              "annotated-types", "typing-inspection"), "DeepSpeed imports it")}
# transformers is not carried: pyproject's floor (5.17) is the image's own release.
# Manylinux tags of the GPU machine (x86-64, glibc 2.35+), as its README lists them; pip matches
# each exactly, so a wheel built for another glibc floor needs its tag named here.
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_24_x86_64"]  # bitsandbytes' tag
# Requirements of relaytrain the GPU machine may lack: imported lazily, only by what it cannot run.
LAZY = {"datasets": "imported only by data=glue / data=wikitext, which need the hub or a datasets directory"}


PREFIX = ["gpu-wheels"]  # the make target a failure line names (gpu-install for --check and --verify)


def fail(message: str) -> None:
    """One line on stderr and exit 1: what is wrong and what to do."""
    print(f"{PREFIX[0]}: {message}", file=sys.stderr)
    raise SystemExit(1)


# --------------------------------------------------------------------------- the source digest


def source_files() -> list[Path]:
    """What relaytrain's wheel is built from: the package, its configs and its build recipe."""
    files = [ROOT / "pyproject.toml"]
    for top in (ROOT / "src" / "relaytrain", ROOT / "configs"):
        files += [p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix != ".pyc" and not p.is_relative_to(ROOT / "src" / "relaytrain" / "configs")]
    return sorted(files)


def source_digest() -> str:
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- gathering (online)


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"],
                          capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        fail(f"pip {args[0]} {args[-1]}: {lines[-1] if lines else 'failed'}")


def pinned(name: str) -> str:
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        fail(f"{name} is not installed in {sys.executable}; run this with the project's environment "
             f"(make gpu-wheels installs it), whose versions the wheels copy")


def download(requirement: str, dest: Path, python_version: str) -> None:
    """One binary wheel for the GPU machine; a pure-Python package published only as a source
    archive (antlr4-python3-runtime 4.9.3) is built into a universal wheel here instead."""
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", *platforms,
         "-d", str(dest), requirement], capture_output=True, text=True)
    if done.returncode == 0:
        return
    if "from versions: none" not in done.stderr and "No matching distribution" not in done.stderr:
        fail(f"pip download {requirement}: {done.stderr.strip().splitlines()[-1]}")
    with tempfile.TemporaryDirectory() as tmp:
        pip("wheel", "--no-deps", "--no-binary", requirement.split("==")[0], "-w", tmp, requirement)
        (built,) = Path(tmp).glob("*.whl")
        if not built.name.endswith("-py3-none-any.whl") and not built.name.endswith("-py2.py3-none-any.whl"):
            fail(f"{requirement} has no wheel for Python {python_version} on manylinux and its source "
                 f"builds {built.name}, not a pure-Python wheel; add its platform tag to PLATFORMS")
        shutil.move(str(built), dest / built.name)


def build_relaytrain(dest: Path) -> None:
    pip("wheel", "--no-deps", "-w", str(dest), str(ROOT))
    (dest / DIGEST).write_text(source_digest() + "\n")


def travelling_bytes() -> int:
    """The working tree a device call carries: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum(p.stat().st_size for name in listed if name
               for p in [ROOT / name.decode()] if p.is_file() and not p.is_symlink())


def gather(dest: Path, python_version: str, deepspeed: bool = False) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # two versions of one package stop the whole install there
        old.unlink()
    for name in [*CARRY, *(DEEPSPEED if deepspeed else ())]:
        download(pinned(name), dest, python_version)
    for name, why in CARRY_IF_INSTALLED.items():
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            print(f"gpu-wheels: not carried: {name}, not installed here ({why})")
            continue
        download(pinned(name), dest, python_version)
    build_relaytrain(dest)
    wheels = sorted(dest.glob("*.whl"))
    mib = 2**20
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / mib:6.2f} MiB  {wheel.name}")
    carried = sum(w.stat().st_size for w in wheels)
    tree = travelling_bytes()
    total = carried + tree
    line = (f"wheels {carried / mib:.1f} MiB + source tree {tree / mib:.1f} MiB = {total / mib:.1f} MiB "
            f"of the {BUDGET_MIB} MiB a device call carries")
    if total > BUDGET_MIB * mib:
        fail(f"{line}: too much; drop a wheel the GPU machine already has, or move large untracked files away")
    print(f"gpu-wheels: {len(wheels)} wheels in {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}; {line}")


# --------------------------------------------------------------------------- on the GPU machine


def check(dest: Path) -> None:
    """Before installing: one wheel per package, and relaytrain's built from this very tree."""
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        fail(f"no wheels in {dest}; gather them on a connected machine with `make gpu-wheels` and carry .whl")
    names = [w.name.split("-")[0].lower().replace("_", "-") for w in wheels]  # a wheel name's first field
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"{dest} holds two versions of {', '.join(twice)}; run `make gpu-wheels` again (it clears the folder)")
    recorded = (dest / DIGEST).read_text().strip() if (dest / DIGEST).exists() else None
    if recorded != source_digest():
        fail("the relaytrain wheel in .whl was built from other sources than this tree; run `make gpu-wheels` "
             "again after the last edit")


def verify() -> None:
    """After installing: relaytrain and the carried packages import, every requirement of
    relaytrain this machine must meet is met, and torch sees a CUDA device."""
    try:
        import hydra
        import omegaconf
        import torch
        import transformers
        from packaging.requirements import Requirement

        import relaytrain
    except ImportError as err:
        fail(f"{err}; did `make gpu-install` install into the folder on PYTHONPATH ({sys.path[0]})?")

    unmet = []
    for spec in importlib.metadata.requires("relaytrain") or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev, plot, ...), not needed to train
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if req.name in LAZY and have is None:
            continue
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (found {have or 'none'})")
    print(f"gpu-install: relaytrain {relaytrain.__version__} from {Path(relaytrain.__file__).parent.parent}; "
          f"hydra {hydra.__version__}, omegaconf {omegaconf.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    if unmet:
        fail(f"unmet requirements of relaytrain: {'; '.join(unmet)}; add them to CARRY in scripts/gpu_wheels.py")
    if not torch.cuda.is_available():
        fail(f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda or 'none'})")
    print(f"gpu-install: CUDA device {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; "
          f"not carried: {', '.join(f'{k} ({v})' for k, v in LAZY.items())}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dest", nargs="?", type=Path, default=DEST, help="the wheel folder (default: .whl)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    p.add_argument("--with-deepspeed", action="store_true",
                   help="also carry DeepSpeed and accelerate: bench_gpu.py's ZeRO-3 offload contestant")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="on the GPU machine, before installing")
    mode.add_argument("--verify", action="store_true", help="on the GPU machine, after installing")
    args = p.parse_args(argv)
    if args.check or args.verify:
        PREFIX[0] = "gpu-install"
    if args.check:
        check(args.dest.resolve())
    elif args.verify:
        verify()
    else:
        gather(args.dest.resolve(), args.python_version, args.with_deepspeed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
