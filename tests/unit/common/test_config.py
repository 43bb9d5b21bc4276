"""Config loading: YAML, then KAIZEN_ env, then dotted overrides; unknown keys are named."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, dump_config, load_config
from services.explorer.config import ExplorerConfig


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_then_env_then_overrides(tmp_path):
    path = _write(tmp_path, "model: {path: /m}\nserver: {port: 1000}\nengine: {max_batch_size: 4}\n")
    env = {"KAIZEN_SERVER__PORT": "2000", "KAIZEN_ENGINE__MAX_BATCH_SIZE": "8"}
    cfg = load_config(ExplorerConfig, path, ["server.port=3000"], env=env)
    assert cfg.server.port == 3000  # the command line wins over env
    assert cfg.engine.max_batch_size == 8  # env wins over YAML
    assert cfg.model.path == "/m"


def test_override_values_are_parsed_like_yaml(tmp_path):
    cfg = load_config(ExplorerConfig, None, ["model.path=/m", "auth.api_keys=[a, b]", "engine.max_model_len=512"], env={})
    assert cfg.auth.api_keys == ["a", "b"]
    assert cfg.engine.max_model_len == 512


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.path=/m", "engine.colour=red"], "unknown config key 'engine.colour'"),
        (["model.path=/m", "nonsense=1"], "unknown config key 'nonsense'"),
        ([], "missing config key 'model'"),
        (["model.path=/m", "server.port=http"], "config key 'server.port'"),
        (["model.path=/m", "server.port"], "not of the form dotted.key=value"),
        (["model.path=/m", "model.path.deeper=1"], "'model.path' is not a section"),
    ],
)
def test_bad_config_names_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(ExplorerConfig, None, overrides, env={})
    assert needle in str(e.value)


def test_unknown_key_in_yaml_is_named(tmp_path):
    path = _write(tmp_path, "model: {path: /m}\nbuffer: {uri: sqlite:///x}\n")
    with pytest.raises(ConfigError, match="unknown config key 'buffer.uri'"):
        load_config(ExplorerConfig, path, env={})


def test_env_of_other_services_is_ignored_but_typos_inside_a_section_are_not():
    cfg = load_config(ExplorerConfig, None, ["model.path=/m"], env={"KAIZEN_TRAIN_BATCH_SIZE": "16"})
    assert cfg.model.path == "/m"
    with pytest.raises(ConfigError, match="unknown config key 'buffer.ur'"):
        load_config(ExplorerConfig, None, ["model.path=/m"], env={"KAIZEN_BUFFER__UR": "x"})


def test_missing_file_and_non_mapping_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ExplorerConfig, tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match="mapping"):
        load_config(ExplorerConfig, _write(tmp_path, "- a\n- b\n"), env={})


def test_dump_hides_secrets():
    cfg = load_config(
        ExplorerConfig, None,
        ["model.path=/m", "auth.api_keys=[s3cret]", "buffer.url=postgresql://u:pw@db/k"], env={},
    )
    text = dump_config(cfg)
    assert "s3cret" not in text and ":pw@" not in text
    assert "postgresql://u:***@db/k" in text


def test_shipped_explorer_config_loads():
    from tests.helpers import REPO

    cfg = load_config(ExplorerConfig, REPO / "configs" / "explorer.yaml", env={})
    assert cfg.engine.kind == "hf"
