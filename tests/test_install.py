"""The set-ups: the NumPy 2 start-up hook, and (slow) the GPU set-up in a
NumPy 2 environment, offline from a folder of wheels (the wheels are
downloaded first, as on a machine that reaches PyPI; the set-up itself is
watched to ask no package index)."""
from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
import venv
from pathlib import Path

import pytest

from chainer_recompute import _numpy2_hook

ROOT = Path(__file__).resolve().parents[1]


def test_hook_installs_and_uninstalls(tmp_path):
    path = _numpy2_hook.install(str(tmp_path))
    assert Path(path).name == _numpy2_hook.PTH_NAME
    line = Path(path).read_text()
    assert line.startswith("import ") and line.count("\n") == 1  # what site.py executes
    assert _numpy2_hook.uninstall(str(tmp_path)) and not Path(path).exists()
    assert not _numpy2_hook.uninstall(str(tmp_path))


def test_hook_applies_the_compat_layer_before_chainer(tmp_path):
    """What the .pth line does at start-up, then `import chainer` first."""
    line = Path(_numpy2_hook.install(str(tmp_path))).read_text()
    code = (line + "import sys\n"
            "assert 'chainer' not in sys.modules and 'numpy' not in sys.modules\n"
            "import chainer\n"
            "assert '_chainer_recompute_compat' in sys.modules\n"
            "assert not any(type(f).__name__ == '_BeforeChainer' for f in sys.meta_path)\n"
            "import numpy; assert hasattr(numpy, 'sctypes')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


class _Index(http.server.BaseHTTPRequestHandler):
    """A package index that has nothing and notes every request."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.asked.append(self.path)  # type: ignore[attr-defined]
        self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _watched_index():
    """A local index that notes what pip asks it (see :class:`_Index`)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    server.asked = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


def _offline_env(index_url: str) -> dict:
    """pip's environment with no configuration file, ``index_url`` as its
    only index, and every other host behind a proxy on a closed port."""
    dead = "http://127.0.0.1:9"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=index_url, PIP_RETRIES="0",
               PIP_TIMEOUT="3", PIP_DISABLE_PIP_VERSION_CHECK="1", http_proxy=dead,
               https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead,
               no_proxy="127.0.0.1", NO_PROXY="127.0.0.1")
    return env


@pytest.mark.slow
def test_gpu_setup_from_a_wheelhouse_installs_offline(tmp_path):
    """The README's GPU set-up on a machine with no package index. Where
    PyPI is reachable: the folder of wheels (scripts/make_wheelhouse.sh),
    and NumPy 2 for the target environment. Then offline (pip cannot reach
    any index, checked): a venv gets NumPy 2 from its file, and
    scripts/setup_gpu.sh installs the project from the wheels alone, keeping
    NumPy 2."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels, numpy_dir = tmp_path / "wheels", tmp_path / "numpy"
    subprocess.run(["bash", str(ROOT / "scripts" / "make_wheelhouse.sh"), str(wheels)],
                   check=True, env={**os.environ, "PYTHON_VERSION": version})
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", str(numpy_dir), "numpy>=2"], check=True)

    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)  # ensurepip: no index
    py = str(env_dir / "bin" / "python")
    with _watched_index() as index:
        offline = _offline_env(f"http://127.0.0.1:{index.server_address[1]}/simple")
        # the watch works: pip asks the watched index, and finds nothing
        reach = subprocess.run([py, "-m", "pip", "download", "-q", "--no-deps", "-d",
                                str(tmp_path / "x"), "six"], env=offline, capture_output=True)
        assert reach.returncode != 0 and index.asked, (reach.returncode, index.asked)
        del index.asked[:]
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                        str(numpy_dir), "numpy>=2"], check=True, env=offline)
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_gpu.sh")], check=True,
                       env={**offline, "PYTHON": py, "WHEELS": str(wheels)})
        assert not index.asked, f"the set-up asked a package index: {index.asked[:5]}"
    p = subprocess.run([py, "-c", "import chainer, numpy, chainer_recompute; "
                        "print(numpy.__version__)"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith("2."), p.stdout
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "chainer-recompute"], check=True,
                   env=offline)
