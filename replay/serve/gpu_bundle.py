"""``agentload gpu bundle``: real vLLM and agentload, packed for a GPU box with no internet.

The box this was made for (the lent H100/H200: Python 3.12, torch 2.11.0+cu130, no network,
at most 64 MiB per transfer) has torch but neither vLLM nor agentload's own dependencies.
vLLM 0.26.0 is the release pinned to torch 2.11.0. The bundle is built here, from pinned
wheels, into two loads that each fit one transfer:

- ``vllm.tar.xz``: the vLLM wheel, trimmed. Left out: the FlashAttention-2 extension (its
  import is guarded; FA3 serves Hopper), DeepGEMM and the SM100 FMHA (Blackwell-only), the
  Rust frontend. In the large CUDA extensions the cubins of GPU generations other than the
  target are zeroed (``--arch``, default sm_90; PTX kept), which halves them compressed.
- ``site.tar.xz``: vLLM's missing dependencies, agentload's wheel and its dependencies
  (installed with ``pip --target`` for CPython 3.12 manylinux x86-64), and the dummy-weight
  model directories (``dummy_models``) prebuilt into an agentload cache.

``gpu_stage.sh`` (copied into the bundle as ``stage.sh``) unpacks whatever loads are
present on the box, checks ``import vllm`` and ``import agentload``, and writes an
``env.sh`` to source. ``bundle.json`` lists every piece with its size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer

from agentload import __version__
from agentload.replay.errors import ReplayError
from agentload.replay.serve.dummy_models import PRESETS, ensure_dummy_model

VLLM_VERSION = "0.26.0"
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64")
# Paths inside the vllm package that the target never loads.
DROPPED = ("vllm_flash_attn/_vllm_fa2_C.abi3.so", "third_party/deep_gemm",
           "third_party/fmha_sm100", "vllm-rs")
# Extensions whose fat binaries are pruned to the target architecture.
PRUNED = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so",
          "vllm_flash_attn/_vllm_fa3_C.abi3.so")
TRANSFER_LIMIT = 64 * 2**20
# Ray libraries `replay --ray` never imports (Ray Core is what places the shards), and
# Ray's Java jars: 200 MB unpacked become ~30 MB compressed without them.
RAY_DROPPED = ("jars", "rllib", "tune", "train", "serve", "data", "llm")

_FATBIN_MAGIC = 0xBA55ED50
_ELF_CUBIN = 2


class BundleError(ReplayError):
    """The bundle cannot be built (a download, a wheel or a size is wrong)."""


@dataclass(frozen=True, slots=True)
class Requirements:
    vllm: list[str]
    agentload: list[str]
    ray: list[str]


def requirements() -> Requirements:
    """The pinned lists in ``gpu_requirements.txt``, by section."""
    text = resources.files("agentload.replay.serve").joinpath("gpu_requirements.txt").read_text()
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is None:
            raise BundleError(f"gpu_requirements.txt: {line!r} is outside a [section]")
        else:
            current.append(line)
    return Requirements(sections.get("vllm", []), sections.get("agentload", []),
                        sections.get("ray", []))


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(offset, size) of the section ``name`` of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BundleError("not a little-endian ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names_off = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for k in range(shnum):
        header = shoff + k * shentsize
        name_at = names_off + struct.unpack_from("<I", data, header)[0]
        if data[name_at:data.index(b"\0", name_at)].decode() == name:
            offset, size = struct.unpack_from("<QQ", data, header + 0x18)
            return int(offset), int(size)
    raise BundleError(f"no {name} section")


def prune_fatbin(data: bytearray, keep_arch: int) -> tuple[int, int]:
    """Zero, in place, every cubin in the ELF's ``.nv_fatbin`` built for another GPU arch.

    Headers and PTX stay, so the layout is unchanged and the CUDA driver, which on a
    ``keep_arch`` GPU never picks another generation's cubin, loads the file as before.
    Returns (bytes zeroed, bytes kept). Walks the section's fatbin containers as
    ``cuobjdump`` lists them.
    """
    start, size = elf_section(data, ".nv_fatbin")
    zeroed = kept = 0
    i, section_end = start, start + size
    while i + 16 <= section_end:
        magic, _, header, length = struct.unpack_from("<IHHQ", data, i)
        if magic != _FATBIN_MAGIC:
            i += 8  # containers are 8-byte aligned
            continue
        j, end = i + header, min(i + header + length, section_end)
        while j + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, j)
            arch = struct.unpack_from("<I", data, j + 28)[0]
            if entry_header == 0 or j + entry_header + payload > end:
                break  # not a well-formed entry: leave the rest of this container alone
            body = slice(j + entry_header, j + entry_header + payload)
            if kind == _ELF_CUBIN and arch != keep_arch:
                data[body] = bytes(payload)
                zeroed += payload
            else:
                kept += payload
            j += entry_header + payload
        i = max(end, i + 8)
    return zeroed, kept


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise BundleError(f"pip {args[0]} failed ({proc.returncode}):\n{tail}")


def _platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for tag in PLATFORMS:
        args += ["--platform", tag]
    return args


def _install_into(target: Path, wheels: Iterable[Path]) -> None:
    """Install exactly these wheels (no dependencies, no index) into ``target`` as
    CPython 3.12 on manylinux x86-64 sees them."""
    _pip(["install", "--no-deps", "--no-index", "--no-compile", "--quiet",
          "--disable-pip-version-check", *_platform_args(), "--target", str(target),
          *map(str, wheels)])


def download(wheelhouse: Path, pins: Iterable[str], say: Callable[[str], None]) -> None:
    """Every pinned wheel into ``wheelhouse`` (pip skips the ones already there)."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    pins = list(pins)
    say(f"downloading {len(pins)} pinned wheels into {wheelhouse} (cached ones are kept)")
    _pip(["download", "--no-deps", "--disable-pip-version-check", "--quiet", *_platform_args(),
          "-d", str(wheelhouse), *pins])


def _wheel_for(wheelhouse: Path, pin: str) -> Path:
    name, _, version = pin.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for path in sorted(wheelhouse.glob("*.whl")):
        wname, wversion = path.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", wname).lower() == stem and wversion == version:
            return path
    raise BundleError(f"no wheel for {pin} in {wheelhouse}")


def source_root() -> Path:
    """The checkout agentload runs from (a wheel of it goes into the bundle)."""
    here = Path(__file__).resolve()
    for root in here.parents:  # replay/serve/ in a checkout, agentload/replay/serve/ in a wheel
        if (root / "pyproject.toml").is_file():
            return root
    raise BundleError("agentload gpu bundle builds agentload's own wheel and must run from a "
                      f"checkout of the repository (no pyproject.toml above {here.parent})")


def build_agentload_wheel(out: Path, say: Callable[[str], None]) -> Path:
    for old in out.glob("agentload-*.whl"):
        old.unlink()
    say("building agentload's wheel from the checkout")
    _pip(["wheel", "--no-deps", "--disable-pip-version-check", "--quiet", "-w", str(out),
          str(source_root())])
    wheels = list(out.glob("agentload-*.whl"))
    if len(wheels) != 1:
        raise BundleError(f"expected one agentload wheel in {out}, found {len(wheels)}")
    return wheels[0]


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """No time stamps or owners: the same inputs give a byte-identical archive."""
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


def _xz_tar(source: Path, target: Path, members: Iterable[str]) -> None:
    """``tar -cJ`` of ``members`` under ``source``: paths sorted, stamps and owners zeroed,
    ``__pycache__`` left out, so a rebuild from the same wheels is byte-identical."""
    paths: list[Path] = []
    for member in sorted(members):
        top = source / member
        paths.append(top)
        if top.is_dir():
            paths += sorted(p for p in top.rglob("*") if "__pycache__" not in p.parts)
    with tarfile.open(target, "w:xz", preset=6) as tar:
        for path in paths:
            tar.add(path, arcname=str(path.relative_to(source)), recursive=False,
                    filter=_normalized)


def pack_vllm(wheel: Path, out: Path, arch: int, say: Callable[[str], None]) -> dict[str, Any]:
    """``vllm.tar.xz``: the trimmed, pruned vLLM wheel contents."""
    with tempfile.TemporaryDirectory(prefix="agentload-vllm-") as tmp:
        root = Path(tmp)
        shutil.unpack_archive(str(wheel), str(root), "zip")
        for rel in DROPPED:
            path = root / "vllm" / rel
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        pruned = {}
        for rel in PRUNED:
            path = root / "vllm" / rel
            data = bytearray(path.read_bytes())
            zeroed, kept = prune_fatbin(data, arch)
            path.write_bytes(data)
            pruned[rel] = {"zeroed_mb": round(zeroed / 1e6, 1), "kept_mb": round(kept / 1e6, 1)}
            say(f"  {rel}: zeroed {zeroed / 1e6:.1f} MB of other archs' cubins, "
                f"kept {kept / 1e6:.1f} MB")
        say("compressing vllm.tar.xz (a few minutes on 2 cores)")
        _xz_tar(root, out / "vllm.tar.xz", [p.name for p in root.iterdir()])
    return {"dropped": list(DROPPED), "pruned": pruned, "arch": f"sm_{arch}"}


def pack_site(wheelhouse: Path, reqs: Requirements, agentload_wheel: Path, out: Path,
              say: Callable[[str], None]) -> dict[str, Any]:
    """``site.tar.xz``: dependencies installed for the box, agentload, the dummy models."""
    wheels = [_wheel_for(wheelhouse, pin) for pin in [*reqs.vllm, *reqs.agentload]]
    with tempfile.TemporaryDirectory(prefix="agentload-site-") as tmp:
        root = Path(tmp)
        say(f"installing {len(wheels) + 1} wheels for CPython {PYTHON_VERSION} into the site")
        _install_into(root / "site", [*wheels, agentload_wheel])
        site = root / "site"
        # Data vLLM never reads for a text model: mistral_common's bundled tokenizer files
        # and pycountry's translations (about 30 MB before compression).
        for rel in ("mistral_common/data", "pycountry/locales", "bin"):
            shutil.rmtree(site / rel, ignore_errors=True)
        models = [ensure_dummy_model(m, root / "cache") for m in PRESETS.values()]
        say("compressing site.tar.xz")
        _xz_tar(root, out / "site.tar.xz", ["site", "cache"])
    return {"wheels": [*sorted(w.name for w in wheels), agentload_wheel.name],
            "dummy_models": [m.name for m in models]}


def pack_ray(wheelhouse: Path, reqs: Requirements, out: Path,
             say: Callable[[str], None]) -> dict[str, Any]:
    """``ray.tar.xz``: Ray Core and what the staged site lacks of its dependencies."""
    wheels = [_wheel_for(wheelhouse, pin) for pin in reqs.ray]
    with tempfile.TemporaryDirectory(prefix="agentload-ray-") as tmp:
        root = Path(tmp)
        say(f"installing {len(wheels)} wheels into the Ray load")
        _install_into(root / "ray-site", wheels)
        for rel in RAY_DROPPED:
            shutil.rmtree(root / "ray-site" / "ray" / rel, ignore_errors=True)
        # console scripts carry this machine's python in their shebang (as in the site)
        shutil.rmtree(root / "ray-site" / "bin", ignore_errors=True)
        say("compressing ray.tar.xz")
        _xz_tar(root, out / "ray.tar.xz", ["ray-site"])
    return {"wheels": sorted(w.name for w in wheels), "dropped": list(RAY_DROPPED)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_bundle(out: Path, *, arch: int = 90, wheelhouse: Path | None = None,
                 with_ray: bool = False, only_ray: bool = False,
                 say: Callable[[str], None] = print) -> dict[str, Any]:
    """Build both loads (and ``ray.tar.xz`` when asked), ``stage.sh`` and ``bundle.json``
    into ``out``; returns the manifest. ``only_ray`` adds the Ray load to a built bundle."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    wheelhouse = wheelhouse or out / "wheels"
    reqs = requirements()
    manifest_path = out / "bundle.json"
    if only_ray:
        if not manifest_path.is_file():
            raise BundleError(f"--only-ray adds to a built bundle, and {out} has no bundle.json")
        manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    else:
        download(wheelhouse, [f"vllm=={VLLM_VERSION}", *reqs.vllm, *reqs.agentload], say)
        agentload_wheel = build_agentload_wheel(wheelhouse, say)
        vllm_info = pack_vllm(_wheel_for(wheelhouse, f"vllm=={VLLM_VERSION}"), out, arch, say)
        site_info = pack_site(wheelhouse, reqs, agentload_wheel, out, say)
        manifest = {"agentload": __version__, "vllm": VLLM_VERSION, "python": PYTHON_VERSION,
                    "arch": f"sm_{arch}", "pieces": {}, "vllm_trim": vllm_info,
                    "site": site_info}
    names = [] if only_ray else ["vllm.tar.xz", "site.tar.xz"]
    if with_ray or only_ray:
        download(wheelhouse, reqs.ray, say)
        manifest["ray"] = pack_ray(wheelhouse, reqs, out, say)
        names.append("ray.tar.xz")
    stage = out / "stage.sh"
    stage.write_text(resources.files("agentload.replay.serve").joinpath("gpu_stage.sh").read_text())
    stage.chmod(0o755)
    pieces = manifest["pieces"]
    for name in names:
        path = out / name
        size = path.stat().st_size
        pieces[name] = {"bytes": size, "sha256": _sha256(path)}
        flag = "" if size <= TRANSFER_LIMIT else "  (over one 64 MiB transfer)"
        say(f"  {name:12} {size / 2**20:6.1f} MiB{flag}")
    manifest["built_s"] = round(time.monotonic() - started, 1)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    say(f"bundle written to {out} in {manifest['built_s']:.0f} s")
    return manifest


def bundle_command(
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Bundle folder (keep it git-ignored).")] = Path(".gpu"),
    arch: Annotated[int, typer.Option(
        "--arch", help="Compute capability whose cubins are kept (90: H100/H200). PTX is "
        "always kept.")] = 90,
    wheelhouse: Annotated[Path | None, typer.Option(
        "--wheelhouse", help="Where pinned wheels are downloaded and cached (default "
        "OUTPUT/wheels); a filled one builds offline.")] = None,
    with_ray: Annotated[bool, typer.Option(
        "--with-ray", help="Also pack ray.tar.xz (Ray Core, ~30 MiB) for `--ray` runs on "
        "the box.")] = False,
    only_ray: Annotated[bool, typer.Option(
        "--only-ray", help="Add ray.tar.xz to the bundle already in OUTPUT.")] = False,
) -> None:
    """Pack vLLM 0.26.0 and agentload for an offline GPU box (two loads under 64 MiB).

    Then, on the box: bash OUTPUT/stage.sh; . /tmp/agentload-gpu/env.sh; and run
    agentload there (docs/gpu.md).
    """
    build_bundle(output, arch=arch, wheelhouse=wheelhouse, with_ray=with_ray, only_ray=only_ray,
                 say=lambda line: typer.echo(line, err=True))
