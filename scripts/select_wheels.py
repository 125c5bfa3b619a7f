"""Print the wheels of OPT_DIR that this Python needs besides what SITE already holds.

``python3 scripts/select_wheels.py SITE OPT_DIR [REQ ...]``: reads the requirements of every
distribution installed in SITE, plus the REQs (e.g. ``prometheus-client``, the project's own), (``pip install --target SITE``) and prints, one per line, each
wheel of OPT_DIR whose project is required but missing from this interpreter's path, or
present at a version the requirement excludes. Repeats over the chosen wheels' own
requirements. Lets a device call keep the image's own packages (e.g. the h11 that its httpx
was built against) unless a carried package really needs a newer one. Run it with SITE on
PYTHONPATH. Standard library plus ``packaging`` (or pip's vendored copy).
"""
from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - the GPU image has packaging; pip vendors it anyway
    from pip._vendor.packaging.requirements import Requirement


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(lines: list[str] | None) -> list[Requirement]:
    out = []
    for text in lines or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def _wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    return _requires(msg.get_all("Requires-Dist"))


def select(site: Path, opt_dir: Path, extra: list[str] = ()) -> list[Path]:
    wheels = {canon(p.name.split("-")[0]): p for p in sorted(opt_dir.glob("*.whl"))}
    carried = {canon(d.metadata["Name"]) for d in metadata.distributions(path=[str(site)])}
    todo = [r for d in metadata.distributions(path=[str(site)]) for r in _requires(d.requires)]
    todo += _requires(list(extra))
    chosen: dict[str, Path] = {}
    while todo:
        req = todo.pop()
        name = canon(req.name)
        if name in carried or name in chosen or name not in wheels:
            continue
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            chosen[name] = wheels[name]
            todo += _wheel_requires(wheels[name])
    return sorted(chosen.values())


if __name__ == "__main__":
    for wheel in select(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]):
        print(wheel)
