"""The PEP 517 build backend of moat-client: setuptools', with a fallback.

setuptools builds wheels with its bdist_wheel command, which setuptools
before 70.1 only has when the wheel package is installed. A fresh venv of
Python 3.11 has setuptools 65 and no wheel, and offline nothing can be
fetched. Where setuptools can build the wheel, it does; where it cannot,
this module writes the same wheel (the package under src/, pure Python, no
dependencies) with the standard library. sdists are always setuptools'.
"""

import base64
import hashlib
import os
import re
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import build_sdist, get_requires_for_build_sdist  # noqa: F401

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools_builds_wheels():
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return True
    except ImportError:
        pass
    try:
        import wheel.bdist_wheel  # noqa: F401
        return True
    except ImportError:
        return False


def _project():
    """name, version, summary and requires-python from pyproject.toml's
    [project] table (read without tomllib, which Python 3.8 lacks)."""
    with open(os.path.join(_HERE, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    table = re.search(r"^\[project\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M).group(1)

    def field(key):
        m = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(key), table, re.M)
        return m.group(1) if m else None

    return field("name"), field("version"), field("description"), field("requires-python")


def _dist_info(name, version):
    return "%s-%s.dist-info" % (name.replace("-", "_"), version)


def _metadata():
    name, version, summary, requires = _project()
    lines = ["Metadata-Version: 2.1", "Name: " + name, "Version: " + version]
    if summary:
        lines.append("Summary: " + summary)
    if requires:
        lines.append("Requires-Python: " + requires)
    readme = os.path.join(_HERE, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


_WHEEL = "Wheel-Version: 1.0\nGenerator: moat_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _write_wheel(wheel_directory, files):
    """Write a py3-none-any wheel holding files ({archive name: bytes}) and
    the project's dist-info; return its file name."""
    name, version, _, _ = _project()
    info = _dist_info(name, version)
    files = dict(files)
    files[info + "/METADATA"] = _metadata().encode("utf-8")
    files[info + "/WHEEL"] = _WHEEL.encode("utf-8")
    record = []
    for arc, data in sorted(files.items()):
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (arc, digest, len(data)))
    record.append(info + "/RECORD,,")
    files[info + "/RECORD"] = ("\n".join(record) + "\n").encode("utf-8")
    filename = "%s-%s-py3-none-any.whl" % (name.replace("-", "_"), version)
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            z.writestr(arc, data)
    return filename


def _package_files():
    src = os.path.join(_HERE, "src")
    out = {}
    for root, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info")]
        for n in names:
            if n.endswith(".py") or n == "py.typed":
                path = os.path.join(root, n)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, src).replace(os.sep, "/")] = f.read()
    return out


def get_requires_for_build_wheel(config_settings=None):
    if _setuptools_builds_wheels():
        return _setuptools.get_requires_for_build_wheel(config_settings)
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if _setuptools_builds_wheels():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    return _write_wheel(wheel_directory, _package_files())


def get_requires_for_build_editable(config_settings=None):
    if _setuptools_builds_wheels():
        return _setuptools.get_requires_for_build_editable(config_settings)
    return []


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    if _setuptools_builds_wheels():
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    # A .pth file that puts src/ on the path: the source is what runs.
    return _write_wheel(wheel_directory, {"moat_client_editable.pth": (os.path.join(_HERE, "src") + "\n").encode()})
