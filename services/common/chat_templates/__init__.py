"""Chat templates Kaizen ships, and the one tokenizer loader every service renders prompts with.

``model.chat_template`` names a built-in template (``hermes-tools``) or a Jinja file and replaces
the model's own template. The Explorer's engines, the Trainer's policy and the demo all load their
tokenizer through ``load_tokenizer``, so a prompt renders to the same token ids everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.config_error import ConfigError

__all__ = ["BUILTIN_TEMPLATES", "load_tokenizer", "resolve_chat_template"]

_HERE = Path(__file__).resolve().parent

# name -> file beside this module
BUILTIN_TEMPLATES = {"hermes-tools": "hermes-tools.jinja"}


def resolve_chat_template(spec: str) -> str:
    """The Jinja text of a built-in template name or of a template file (ConfigError otherwise)."""
    if spec in BUILTIN_TEMPLATES:
        return (_HERE / BUILTIN_TEMPLATES[spec]).read_text()
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    raise ConfigError(
        f"model.chat_template {spec!r} is neither a built-in template ({', '.join(sorted(BUILTIN_TEMPLATES))}) "
        "nor an existing file"
    )


def load_tokenizer(model: Any, chat_template: str | None = None):
    """The tokenizer of ``model`` (a ModelSection, or a model path) with its chat template overridden.

    ``chat_template`` wins over a ModelSection's own ``chat_template``; with neither, the model's
    template stays.
    """
    from transformers import AutoTokenizer

    if isinstance(model, (str, Path)):
        path = str(model)
    else:
        path = model.path
        chat_template = chat_template or model.chat_template
    text = resolve_chat_template(chat_template) if chat_template else None
    tokenizer = AutoTokenizer.from_pretrained(path)
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer
