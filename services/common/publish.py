"""Publish a LoRA adapter trained anywhere (TRL, a notebook) as an agent's next version.

    kaizen publish --agent NAME --adapter DIR --checkpoints-root ROOT [--base-model PATH] [--max-rank N]

``publish_adapter`` checks the adapter against the base model before anything is written, then
writes ``v<N+1>`` with a manifest and points LATEST at it, under the agent's publication lock, so a
running Explorer hot-loads it like a version of the Trainer's, and a running Trainer of that agent
continues from it (``TrainerService._follow_serving``). With ``candidate`` it is named in
CANDIDATE instead, so the Explorers' release policy (gate or canary) decides whether it serves.

The checks, each refused with a CheckpointError naming the problem:
- the directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (a ``.bin`` is named);
- a plain LoRA: not another PEFT method, no DoRA, no ``modules_to_save``, no LoRA on embeddings;
- every LoRA module exists in the base model and is a linear layer, and the A and B matrices have
  that layer's shapes at the adapter's rank (an adapter for another base fails here);
- its largest rank is at most ``max_rank`` (the vllm engine's ``engine.vllm.max_lora_rank``);
- every weight is finite;
- when a Kaizen Trainer trains the agent: the same rank, alpha and target modules as the Trainer's
  adapter (read from its newest version's manifest), so the Trainer can continue from it.
"""

from __future__ import annotations

import getpass
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import checkpoints
from services.common.checkpoints import AdapterVersion, CheckpointError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class AdapterInfo:
    """What the checks learnt about an adapter directory."""

    path: Path
    config: dict[str, Any]
    ranks: dict[str, int] = field(default_factory=dict)  # module path -> rank

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values())

    @property
    def target_names(self) -> list[str]:
        """The layer names LoRA is on (``q_proj``, ...), as a Trainer's ``lora.target_modules``."""
        return sorted({m.rsplit(".", 1)[-1] for m in self.ranks})


def _base_linears(base_model: str) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every linear layer of the base model, built on the meta
    device from its config alone (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base_model)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the base model's config at {base_model}: {e}") from e
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_adapter(adapter: str | Path, base_model: str, *, max_rank: int | None = None) -> AdapterInfo:
    """The adapter at ``adapter`` if the base model can serve it, else CheckpointError saying why."""
    from safetensors import SafetensorError, safe_open

    path = Path(adapter)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if not (path / CONFIG).is_file():
        raise CheckpointError(f"{path} has no {CONFIG}: save the adapter with peft's save_pretrained")
    if not (path / WEIGHTS).is_file():
        hint = " (it has adapter_model.bin: save with safe_serialization=True)" if (path / "adapter_model.bin").exists() else ""
        raise CheckpointError(f"{path} has no {WEIGHTS}{hint}")
    try:
        config = json.loads((path / CONFIG).read_text())
    except ValueError as e:
        raise CheckpointError(f"{path / CONFIG} is not valid JSON: {e}") from e
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path} is a {config.get('peft_type')!r} adapter; only LoRA adapters are served")
    if config.get("use_dora"):
        raise CheckpointError(f"{path} is a DoRA adapter; only plain LoRA is served")
    if config.get("modules_to_save"):
        raise CheckpointError(f"{path} also saves whole modules ({config['modules_to_save']}); only LoRA weights are served")

    info = AdapterInfo(path=path, config=config)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if not m:
                    raise CheckpointError(f"{path / WEIGHTS} holds {key!r}, which is not a LoRA A or B matrix of a linear layer")
                tensor = f.get_tensor(key)
                if not tensor.isfinite().all():
                    raise CheckpointError(f"{path / WEIGHTS}: {key} holds NaN or infinite values")
                shapes.setdefault(m["module"], {})[m["ab"]] = tuple(tensor.shape)
    except SafetensorError as e:
        raise CheckpointError(f"{path / WEIGHTS} cannot be read: {e}") from e
    if not shapes:
        raise CheckpointError(f"{path / WEIGHTS} holds no LoRA weights")

    linears = _base_linears(base_model)
    for module, ab in sorted(shapes.items()):
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{path}: {module} has lora_{''.join(ab)} without its pair")
        if module not in linears:
            raise CheckpointError(f"{path}: the base model at {base_model} has no linear layer {module}: "
                                  "the adapter was trained on another base model")
        (r_a, in_a), (out_b, r_b) = ab["A"], ab["B"]
        d_in, d_out = linears[module]
        if r_a != r_b or (in_a, out_b) != (d_in, d_out):
            raise CheckpointError(f"{path}: {module} has LoRA A {ab['A']} and B {ab['B']}, but the base model's layer is "
                                  f"{d_in} -> {d_out}: the adapter was trained on another base model")
        info.ranks[module] = r_a
    if max_rank is not None and info.max_rank > max_rank:
        raise CheckpointError(f"{path} has LoRA rank {info.max_rank}, above the engine's max_lora_rank {max_rank}")
    return info


def _trainer_lora(root: str | Path, agent: str) -> dict[str, Any] | None:
    """The LoRA settings of the Trainer that trains ``agent`` (from its newest version's manifest),
    or None when no Kaizen Trainer has published for it."""
    for version in reversed(checkpoints.list_versions(root, agent)):
        try:
            manifest = checkpoints.validate_version(root, agent, version).manifest()
        except CheckpointError:
            continue
        if manifest.get("source") != "publish" and "lora" in manifest:
            return manifest["lora"]
    return None


def _check_trainer_can_continue(info: AdapterInfo, lora: dict[str, Any], agent: str) -> None:
    alpha = info.config.get("lora_alpha")
    mine = (sorted(set(info.ranks.values())), None if alpha is None else float(alpha), info.target_names)
    theirs = ([lora.get("r")], float(lora.get("alpha", 0)), sorted(lora.get("target_modules", [])))
    if mine != theirs:
        raise CheckpointError(
            f"a Kaizen Trainer trains agent {agent} with LoRA rank {theirs[0][0]}, alpha {theirs[1]:g} on {theirs[2]}; "
            f"this adapter has rank {'/'.join(map(str, mine[0]))}, alpha {mine[1]} on {mine[2]}, so the Trainer could "
            "not continue from it (train it with the Trainer's lora settings)")


def publish_adapter(adapter: str | Path, *, agent: str, checkpoints_root: str | Path, base_model: str | None = None,
                    max_rank: int | None = None, note: str | None = None, lock_timeout_s: float = 600.0,
                    candidate: bool = False) -> AdapterVersion:
    """Check ``adapter`` and publish it as ``agent``'s next version; returns that version.

    ``base_model``: the model the Explorer serves (``model.path``); by default the one named in the
    agent's newest manifest. Nothing is written when a check fails.
    """
    root = Path(checkpoints_root)
    checkpoints.check_agent_name(agent)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} does not exist")
    if base_model is None:
        latest = checkpoints.read_latest(root, agent)
        if not latest:
            raise CheckpointError(f"agent {agent} has no version yet: pass the base model the Explorer serves (--base-model)")
        base_model = checkpoints.validate_version(root, agent, latest).manifest().get("base_model")
        if not base_model:
            raise CheckpointError(f"the manifest of {agent} v{latest} names no base model: pass --base-model")
    info = check_adapter(adapter, base_model, max_rank=max_rank)
    source = Path(adapter).resolve()

    with checkpoints.publication_lock(root, agent, timeout_s=lock_timeout_s):
        lora = _trainer_lora(root, agent)
        if lora is not None:
            _check_trainer_can_continue(info, lora, agent)
        parent = checkpoints.read_latest(root, agent) or 0
        version = max([parent, *checkpoints.list_versions(root, agent)]) + 1

        def write(out: Path) -> None:
            config = {**info.config, "base_model_name_or_path": base_model}
            (out / CONFIG).write_text(json.dumps(config, indent=2))
            shutil.copyfile(source / WEIGHTS, out / WEIGHTS)

        manifest = {
            "source": "publish",
            "base_model": base_model,
            "adapter_from": str(source),
            "trained_on": info.config.get("base_model_name_or_path"),
            "lora": {"r": info.max_rank, "alpha": info.config.get("lora_alpha"), "target_modules": info.target_names},
            "parent_version": parent,
            "published_by": getpass.getuser(),
            "note": note,
            "experience_ids": [],
            "experience_count": 0,
        }
        if not candidate:
            return checkpoints.publish_version(root, agent, version, write, manifest)
        published = checkpoints.write_version(root, agent, version, write, manifest)
        checkpoints.set_candidate(root, agent, version)
        return published
