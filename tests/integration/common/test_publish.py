"""`kaizen publish`: an adapter trained elsewhere (plain peft here) becomes an agent's next version that
a running Explorer hot-loads and serves; bad adapters are refused before anything is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common import checkpoints
from services.common.checkpoints import CheckpointError
from services.common.publish import check_adapter, publish_adapter
from tests.helpers import REPO
from tests.integration.adapters import train_reply_adapter

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Which way to the harbour?"}]
REPLY = "Left at the lighthouse."


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> Path:
    """A LoRA adapter trained with plain peft (as TRL or a notebook would), saved by save_pretrained."""
    out = tmp_path_factory.mktemp("trained") / "adapter"
    train_reply_adapter(tiny_model, ASK, REPLY).save_pretrained(out)
    return out


def _kaizen_publish(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "publish", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _wait_version(ex, agent: str, version: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = {m["id"]: m for m in ex.http.get("/v1/models").json()["data"]}
        if agent in models and models[agent]["version"] == version:
            return
        time.sleep(0.05)
    raise AssertionError(f"{agent} v{version} was not served within {timeout}s")


def test_published_adapter_is_hot_loaded_and_served(explorer, tiny_model, trained):
    root = explorer.root / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    r = _kaizen_publish("--agent", "guide", "--adapter", str(trained), "--checkpoints-root", str(root),
                        "--base-model", str(tiny_model), "--max-rank", "16", "--note", "from a notebook")
    assert r.returncode == 0, r.stderr
    assert "guide v1" in r.stdout
    assert checkpoints.read_latest(root, "guide", fallback=False) == 1
    manifest = checkpoints.validate_version(root, "guide", 1).manifest()
    assert manifest["source"] == "publish" and manifest["base_model"] == str(tiny_model)
    assert manifest["adapter_from"] == str(trained.resolve()) and manifest["note"] == "from a notebook"
    assert manifest["lora"]["r"] == 8 and manifest["parent_version"] == 0 and manifest["experience_count"] == 0

    _wait_version(explorer, "guide", 1)
    answer = explorer.client.chat.completions.create(model="guide", messages=ASK, temperature=0, max_tokens=12)
    assert answer.choices[0].message.content == REPLY  # the published weights serve, not the base model's
    base = explorer.client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=12)
    assert base.choices[0].message.content != REPLY
    rows = explorer.http.get("/experiences", params={"agent": "guide"}).json()["data"]
    assert [row["model_version"] for row in rows] == [1]

    # the next publication takes the next number, names its parent and finds the base model itself
    r = _kaizen_publish("--agent", "guide", "--adapter", str(trained), "--checkpoints-root", str(root))
    assert r.returncode == 0, r.stderr
    assert checkpoints.validate_version(root, "guide", 2).manifest()["parent_version"] == 1
    _wait_version(explorer, "guide", 2)


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bad"
    shutil.copytree(trained, out)
    return out


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "adapter_model.safetensors"))
    save_file(edit(weights), str(path / "adapter_model.safetensors"))


def _nan_first(weights):
    key = sorted(weights)[0]
    weights[key][0, 0] = float("nan")
    return weights


def _drop_a_b(weights):
    del weights[next(k for k in sorted(weights) if k.endswith("lora_B.weight"))]
    return weights


BAD = {
    "missing weights": (lambda p: (p / "adapter_model.safetensors").unlink(), "has no adapter_model.safetensors"),
    "bin weights": (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"), "safe_serialization=True"),
    "missing config": (lambda p: (p / "adapter_config.json").unlink(), "has no adapter_config.json"),
    "broken config": (lambda p: (p / "adapter_config.json").write_text("{"), "is not valid JSON"),
    "not LoRA": (lambda p: _edit_config(p, peft_type="IA3"), "'IA3' adapter"),
    "DoRA": (lambda p: _edit_config(p, use_dora=True), "DoRA"),
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "saves whole modules"),
    "NaN weight": (lambda p: _edit_weights(p, _nan_first), "NaN or infinite"),
    "unpaired matrix": (lambda p: _edit_weights(p, _drop_a_b), "without its pair"),
    "not safetensors": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"not a tensor file"), "cannot be read"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_refused_before_anything_is_written(case, trained, tiny_model, tmp_path):
    spoil, message = BAD[case]
    bad = _copy(trained, tmp_path)
    spoil(bad)
    root = tmp_path / "ck"
    root.mkdir()
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        publish_adapter(bad, agent="guide", checkpoints_root=root, base_model=str(tiny_model))
    assert checkpoints.list_versions(root, "guide") == [] and checkpoints.read_latest(root, "guide") is None


def test_an_adapter_for_another_base_is_refused(trained, tiny_model, tmp_path):
    from services.common.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=128, num_heads=4, intermediate_size=512)
    with pytest.raises(CheckpointError, match="trained on another base model"):
        check_adapter(trained, str(other))
    deeper = _copy(trained, tmp_path)  # LoRA on a layer the 4-layer tiny model lacks
    _edit_weights(deeper, lambda w: {k.replace("layers.0.", "layers.9."): v for k, v in w.items()})
    with pytest.raises(CheckpointError, match=r"has no linear layer model\.layers\.9\."):
        check_adapter(deeper, str(tiny_model))


def test_rank_above_the_engines_limit_is_refused(trained, tiny_model, tmp_path):
    with pytest.raises(CheckpointError, match="rank 8, above the engine's max_lora_rank 4"):
        check_adapter(trained, str(tiny_model), max_rank=4)
    r = _kaizen_publish("--agent", "guide", "--adapter", str(trained), "--checkpoints-root", str(tmp_path),
                        "--base-model", str(tiny_model), "--max-rank", "4")
    assert r.returncode == 2 and "kaizen publish:" in r.stderr and "max_lora_rank 4" in r.stderr
    assert not (tmp_path / "guide" / "v1").exists()


def test_no_base_model_known_is_a_clear_error(trained, tmp_path):
    r = _kaizen_publish("--agent", "guide", "--adapter", str(trained), "--checkpoints-root", str(tmp_path))
    assert r.returncode == 2 and "pass the base model the Explorer serves (--base-model)" in r.stderr
    r = _kaizen_publish("--agent", "no/such", "--adapter", str(trained), "--checkpoints-root", str(tmp_path))
    assert r.returncode == 2 and "invalid agent name" in r.stderr


def test_an_adapter_a_trainer_could_not_continue_from_is_refused(trained, tiny_model, tmp_path):
    """The agent's Trainer uses rank 16: a rank-8 adapter would strand it."""
    root = tmp_path / "ck"
    lora = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    checkpoints.publish_version(root, "guide", 1, lambda d: shutil.copytree(trained, d, dirs_exist_ok=True),
                                {"step": 1, "algorithm": "grpo", "lora": lora, "base_model": str(tiny_model)})
    with pytest.raises(CheckpointError, match="Trainer trains agent guide with LoRA rank 16"):
        publish_adapter(trained, agent="guide", checkpoints_root=root)
    assert checkpoints.list_versions(root, "guide") == [1]


def test_a_held_lock_makes_publish_wait_then_give_up(trained, tiny_model, tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    with checkpoints.publication_lock(root, "guide"):
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match="stayed locked"):
            publish_adapter(trained, agent="guide", checkpoints_root=root, base_model=str(tiny_model), lock_timeout_s=0.5)
        assert time.monotonic() - t0 >= 0.5
    v = publish_adapter(trained, agent="guide", checkpoints_root=root, base_model=str(tiny_model))
    assert v.version == 1
    assert (v.path / "adapter_model.safetensors").read_bytes() == (trained / "adapter_model.safetensors").read_bytes()
