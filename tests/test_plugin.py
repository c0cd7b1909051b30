"""The plugin registers once: Airflow's own plugin loading, in a fresh process, warns nothing.

Airflow loads plugins from the plugins folder and from ``airflow.plugins`` entry points (of every
distribution it finds on ``sys.path``) and refuses a second plugin of one name with the warning
``Plugin 'airflow_torchrun' already registered, skipping``. Two ways led there: a deployment that
copies ``plugins/`` into its plugins folder *and* installs the package, and the
``operators/airflow_torchrun.egg-info`` that setuptools leaves in the source root during
``pip install -e`` (the editable install puts that root on ``sys.path``, so the distribution is
found twice); ``make install`` removes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

from tests.conftest import ROOT

PROBE = """
from airflow import plugins_manager
plugins, errors = plugins_manager._get_plugins()
names = [p.name for p in plugins]
print("COUNT", names.count("airflow_torchrun"))
print("ERRORS", errors)
"""


@pytest.mark.slow
def test_plugin_folder_and_entry_point_register_the_plugin_once(tmp_path: object) -> None:
    home = os.path.join(str(tmp_path), "airflow")
    # -S: no .pth processing, so only this checkout's source and the installed metadata are seen
    # (what a clean install has), not another editable checkout the shared venv may point at.
    path = os.pathsep.join([str(ROOT / "operators"), sysconfig.get_paths()["purelib"]])
    env = {
        **os.environ,
        "AIRFLOW_HOME": home,
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PYTHONPATH": path,
    }
    done = subprocess.run(
        [sys.executable, "-S", "-c", PROBE], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "COUNT 1" in out, out
    assert "already registered" not in out, out


def test_source_root_holds_no_egg_info_that_would_register_the_plugin_twice() -> None:
    stray = sorted(p.name for p in (ROOT / "operators").glob("*.egg-info"))
    assert not stray, (
        f"{stray} in operators/: on sys.path through the editable install, it makes Airflow load the "
        "plugin's entry point twice; `make install` removes it"
    )
