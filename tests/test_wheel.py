"""Install truth: the wheel holds the demo model and the dashboard, installs into a fresh venv and runs
the demo from outside the repository.

Offline by design: the wheel is built with `--no-build-isolation` from this venv's setuptools, and the
fresh venv reaches this venv's packages (torch, tokenizers, crc32c, ...) through a `.pth` line instead
of downloading them; only colibri comes from the wheel (`--no-deps --no-index`). Skipped when setuptools
is missing (the build would need the network to fetch it). Set COLIBRI_SKIP_WHEEL=1 to skip it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DATA = ("colibri/data/demo", "colibri/server/dashboard")  # pyproject [tool.setuptools.package-data]

pytestmark = pytest.mark.skipif(os.environ.get("COLIBRI_SKIP_WHEEL") == "1", reason="COLIBRI_SKIP_WHEEL=1")


def _build_wheel(tmp: Path) -> Path:
    """Build from a copy of the working tree (an in-tree build would leave build/ in the checkout)."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".ruff_cache",
                                                             "*.coli", ".whl", ".gl", ".device-carry"))
    out = tmp / "dist"
    if importlib.util.find_spec("setuptools") is None:  # an isolated build would have to download it
        pytest.skip("setuptools is not installed here: building the wheel offline needs it (pip install setuptools)")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the wheel does not build: {r.stderr.strip()[-2000:]}"
    wheels = list(out.glob("colibri-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_installs_and_runs_the_demo_outside_the_repo(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in PACKAGE_DATA:
        files = [p.relative_to(ROOT).as_posix() for p in (ROOT / folder).iterdir() if p.is_file()]
        assert files, folder
        missing = [f for f in files if f not in names]
        assert not missing, f"the wheel lacks package data: {missing}"
    assert "colibri/format/integrity.py" in names and "colibri/cli/__init__.py" in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                           text=True).strip())
    # This venv's packages (torch, tokenizers, crc32c, ...) without downloading them. A path named in
    # a .pth is not scanned for .pth files itself, so this venv's editable colibri stays out of reach.
    deps = [sysconfig.get_path("purelib"), *site.getsitepackages()]
    (purelib / "_colibri_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    # --ignore-installed: never touch the colibri that pip can see through that .pth (this venv's).
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--no-warn-script-location", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=600)

    run_dir = tmp_path / "elsewhere"  # not the checkout: `import colibri` must find the installed copy
    run_dir.mkdir()
    env = {**os.environ, "COLIBRI_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    where = subprocess.check_output([str(py), "-c", _DEPS_CHECK], cwd=run_dir, env=env, text=True).strip()
    assert where.startswith(str(purelib)), where  # the wheel's colibri, not the checkout's

    r = subprocess.run([str(env_dir / "bin" / "colibri"), "--prompt", "Once upon a time", "-n", "8",
                        "--temperature", "0", "--threads", "1"], cwd=run_dir, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.strip()) > len("Once upon a time"), r.stdout
    assert "Traceback" not in r.stderr
    assert any((tmp_path / "cache").glob("demo-*.coli"))  # converted from the wheel's package data


# Every core requirement of the installed colibri is present in the fresh venv; prints where colibri is.
_DEPS_CHECK = """
import importlib.metadata as md, re, colibri
missing = []
for req in md.requires("colibri") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[ <>=!~;\\[]", req, maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(req)
assert not missing, f"core requirements missing: {missing}"
print(colibri.__file__)
"""
