"""Open any supported profile by looking at its bytes, not its name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from agentload.profiler.errors import ProfileError
from agentload.profiler.kineto import load_kineto
from agentload.profiler.merge import merge_profiles
from agentload.profiler.model import Profile
from agentload.profiler.nsight import load_nsight

SQLITE_MAGIC = b"SQLite format 3\x00"


def sniff(path: Path) -> str:
    """``nsight-sqlite``, ``nsight-dir`` or ``kineto``; a :class:`ProfileError` otherwise."""
    if not path.exists():
        raise ProfileError(f"{path}: no such file or directory")
    if path.is_dir():
        return "nsight-dir"
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None
    if head.startswith(SQLITE_MAGIC):
        return "nsight-sqlite"
    if head[:2] == b"\x1f\x8b" or head.lstrip()[:1] in (b"{", b"["):
        return "kineto"
    if path.suffix in (".nsys-rep", ".qdrep", ".qdstrm"):
        raise ProfileError(f"{path}: a raw Nsight report; export it first with "
                           f"`nsys export --type sqlite -o OUT.sqlite {path}`")
    if not head:
        raise ProfileError(f"{path}: empty file")
    raise ProfileError(f"{path}: not an Nsight Systems SQLite/Parquet export or a Kineto "
                       "JSON trace")


def load_profile(path: Path) -> Profile:
    """Read an Nsight SQLite export, an Nsight Parquet/Arrow directory or a Kineto trace."""
    kind = sniff(path)
    if kind == "kineto":
        return load_kineto(path)
    return load_nsight(path)


def load_profiles(paths: list[Path]) -> Profile:
    """Several profiles (one per rank, any mix of formats) merged into one; see
    :mod:`agentload.profiler.merge`. One path: exactly :func:`load_profile`."""
    if len(paths) == 1:
        return load_profile(paths[0])
    return merge_profiles([load_profile(p) for p in paths])


DEFAULT_DOMAIN = "default"
"""How ``--domain`` names NVTX's default domain (and ``record_function`` ranges)."""
NO_CATEGORY = "none"
"""How ``--category`` names ranges without an NVTX category (and ``record_function``'s)."""


def _keep_named(profile: Profile, column: str, wanted: list[str], unnamed: str,
                what: str, plural: str) -> Profile:
    """Only the ranges whose ``column`` (null: ``unnamed``) is one of ``wanted``; a name
    no range has is an error that lists the names present."""
    if not wanted:
        return profile
    present = profile.ranges[column].fill_null(unnamed)
    have = sorted(present.unique().to_list())
    missing = [d for d in wanted if d not in have]
    if missing:
        raise ProfileError(f"{profile.path}: no ranges in NVTX {what} "
                           f"{', '.join(map(repr, missing))}; {plural} present: "
                           f"{', '.join(have) or 'none (no ranges)'}")
    kept = profile.ranges.filter(present.is_in(wanted))
    note = (f"only ranges of NVTX {what} {', '.join(wanted)} were kept "
            f"({kept.height:,} of {profile.ranges.height:,})")
    return replace(profile, ranges=kept, notes=(*profile.notes, note))


def keep_domains(profile: Profile, domains: list[str]) -> Profile:
    """Only the ranges in the named NVTX ``domains`` (``default``: the default domain),
    so another library's ranges (NCCL's, say) do not become the innermost range of the
    kernels they wrap. A name no range has is an error that lists the domains present."""
    return _keep_named(profile, "domain", domains, DEFAULT_DOMAIN, "domain", "domains")


def keep_categories(profile: Profile, categories: list[str]) -> Profile:
    """Only the ranges in the named NVTX ``categories`` (``none``: ranges without one),
    so that, say, a framework's ``layer`` category owns the kernels and its finer ranges
    in other categories do not. A category never named is given by its number."""
    return _keep_named(profile, "category", categories, NO_CATEGORY, "category",
                       "categories")
