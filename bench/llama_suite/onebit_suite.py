"""pytest plugin for `cargo xtask llama-suite`: llama.cpp's server tests on the local model.

Loaded with `-p onebit_suite` from the copied tests directory. The presets that download a text
model from Hugging Face serve the local model named by ONEBIT_SUITE_MODEL instead; a test that
needs a model or file that cannot be had offline (a multimodal preset, a LoRA adapter, a model
set by the test itself) is skipped, in both arms alike. Each test's outcome is written to
ONEBIT_SUITE_REPORT as JSON ({nodeid: "passed" | "failed" | "skipped"}) at the session's end.
"""

import json
import os

import pytest
import utils

MODEL = os.environ["ONEBIT_SUITE_MODEL"]
REPORT = os.environ["ONEBIT_SUITE_REPORT"]

# Presets whose model the local text model cannot stand in for (they load a projector too).
MULTIMODAL = {"tinygemma3", "tinyopenjev"}

# Files the tests download that the local model stands in for (a drafter for speculation).
STAND_INS = {"stories15M-q4_0.gguf"}


def _remapped(name, make):
    def preset():
        server = make()
        if name in MULTIMODAL:
            server.onebit_unavailable = f"the multimodal preset {name} (a projector from Hugging Face)"
        elif server.model_hf_repo or server.model_url:
            server.model_file = MODEL
            server.model_hf_repo = None
            server.model_hf_file = None
            server.model_url = None
        return server

    return staticmethod(preset)


for _name, _method in list(vars(utils.ServerPreset).items()):
    if isinstance(_method, staticmethod) and _name != "load_all":
        setattr(utils.ServerPreset, _name, _remapped(_name, _method.__func__))

# Every model is local: nothing to fetch before the session.
utils.ServerPreset.load_all = staticmethod(lambda: None)

_start = utils.ServerProcess.start


def _start_offline(self, *args, **kwargs):
    unavailable = getattr(self, "onebit_unavailable", None)
    if unavailable is None and (self.model_hf_repo or self.model_url or self.mmproj_url):
        unavailable = f"a model from the internet ({self.model_hf_repo or self.model_url or self.mmproj_url})"
    if unavailable is not None:
        pytest.skip(f"needs {unavailable}")
    return _start(self, *args, **kwargs)


utils.ServerProcess.start = _start_offline


def _download_offline(url, output_file_path=None):
    name = url.split("/")[-1]
    if name in STAND_INS:
        return MODEL
    pytest.skip(f"needs a file from the internet ({url})", allow_module_level=True)


utils.download_file = _download_offline

_outcomes = {}


def pytest_runtest_logreport(report):
    seen = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and seen is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.passed and report.when == "call" and seen is None:
        _outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session):
    with open(REPORT, "w") as out:
        json.dump(_outcomes, out, indent=0, sort_keys=True)
