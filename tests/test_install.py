"""The set-ups: the NumPy 2 start-up hook, and (slow) the GPU set-up in a
NumPy 2 environment, offline from a folder of wheels."""
from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.mark.slow
def test_gpu_setup_keeps_numpy_2_offline(tmp_path):
    """The README's GPU set-up in a venv that has NumPy 2, from a folder of
    wheels made by scripts/make_wheelhouse.sh, with no package index."""
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "numpy>=2"], check=True)
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(["bash", str(ROOT / "scripts" / "make_wheelhouse.sh"), str(wheels)],
                   check=True, env={**os.environ, "PYTHON_VERSION": version})
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_gpu.sh")], check=True,
                   env={**os.environ, "PYTHON": py, "WHEELS": str(wheels),
                        "PIP_NO_INDEX": "1"})
    p = subprocess.run([py, "-c", "import chainer, numpy, chainer_recompute; "
                        "print(numpy.__version__)"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith("2."), p.stdout
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "chainer-recompute"], check=True)
