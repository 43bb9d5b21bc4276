"""``model.chat_template`` replaces the model's template in the Explorer and in the Trainer alike, so the
prompt ids the Explorer records are the ids the Trainer renders from the recorded messages."""

from __future__ import annotations

import pytest

from services.trainer.learner import LearnerWorker

pytestmark = pytest.mark.integration

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n[{{ m.role | upper }}] {{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_override_renders_prompts_in_the_explorer_and_the_trainer(make_explorer, tiny_model, tmp_path):
    template = tmp_path / "tagged.jinja"
    template.write_text(TEMPLATE)
    ex = make_explorer(f"model.chat_template={template}")
    r = ex.client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    e = ex.http.get(f"/experiences/{r.choices[0].model_extra['experience_id']}").json()
    assert ex.tokenizer.decode(e["prompt_token_ids"]) == "<|im_start|>user\n[USER] hello<|im_end|>\n<|im_start|>assistant\n"

    learner = LearnerWorker({"model": {"path": str(tiny_model), "chat_template": str(template)}, "log_level": "warning"})
    learner.setup()
    tok = learner.policy.tokenizer
    text = tok.apply_chat_template(e["messages"], add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == e["prompt_token_ids"]
