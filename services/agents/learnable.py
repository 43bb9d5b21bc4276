"""LearnableAgent: a local model with a PEFT head that acts as a tool-using agent and learns.

The surface MARSYS users know (``model_config``, ``name``, ``goal``, ``instruction``, ``tools``,
``learning_head="peft"``, ``learning_head_config``; ``agent.model.trainable_model`` / ``tokenizer`` /
``base_model`` / ``save_pretrained``), plus what MARSYS leaves to its users: every generation is
recorded token for token (prompt ids, sampled ids, their logprobs) into a Kaizen buffer, rewards go
in with ``feedback``, and ``learn`` trains the adapter with the Trainer's own objectives (the real
``kaizen trainer``, no second training path) and loads the result.

    agent = LearnableAgent(model_config={"name": ".cache/smollm2-135m-instruct"}, name="helper",
                           goal="Answer questions", instruction="Use the tools.", tools={"lookup": lookup},
                           learning_head="peft", learning_head_config={"r": 16, "lora_alpha": 32})
    answer = agent.run("What is the value of a?")
    agent.feedback(1.0)                 # the last run's reward, committed for training
    agent.learn(steps=2)                # GRPO by default (trainer overrides as keyword arguments)

With ``endpoint=URL`` the same agent runs through a Kaizen Explorer instead (the model named
``name`` there): ``run`` and ``feedback`` work the same, and the service's Trainer trains it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from runner_sdk import ExplorerError, SyncExplorerClient
from services.common import buffer, checkpoints
from services.common.hints import HINT_MAX_CHARS, hint_prompt_ids
from services.common.ids import experience_id, new_id
from services.common.records import Experience
from services.common.replies import ReplyError, assistant_reply, correction_record, render_reply

_PEFT_KEYS = {"r", "lora_alpha", "target_modules", "lora_dropout", "bias"}
_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LearnableAgentError(ValueError):
    """A LearnableAgent set up or used wrongly; the message says how."""


def _tool_schemas(tools: dict[str, Callable] | list[Callable] | None) -> tuple[dict[str, Callable], list[dict]]:
    from transformers.utils import get_json_schema

    if tools is None:
        return {}, []
    named = tools if isinstance(tools, dict) else {fn.__name__: fn for fn in tools}
    schemas = []
    for name, fn in named.items():
        if not callable(fn):
            raise LearnableAgentError(f"tool {name!r} is not callable")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers raises several kinds; all mean the same here
            raise LearnableAgentError(f"tool {name!r} needs type hints and a docstring with an Args section "
                                      f"(transformers.utils.get_json_schema): {e}") from e
        schema["function"]["name"] = name
        schemas.append(schema)
    return named, schemas


class PeftHead:
    """The local model: ``base_model`` (transformers), ``trainable_model`` (it, wrapped by peft with
    one LoRA adapter), ``tokenizer``; ``save_pretrained`` writes the adapter."""

    def __init__(self, model_config: dict[str, Any], head_config: dict[str, Any]):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from services.common.chat_templates import load_tokenizer

        unknown = set(head_config) - _PEFT_KEYS
        if unknown:
            raise LearnableAgentError(f"learning_head_config has unknown keys {sorted(unknown)}; use {sorted(_PEFT_KEYS)}")
        if head_config.get("bias", "none") != "none":
            raise LearnableAgentError("learning_head_config bias must be 'none': the Explorer and Trainer serve LoRA weights only")
        self.path = str(model_config.get("name") or model_config.get("path") or "")
        if not self.path:
            raise LearnableAgentError("model_config needs 'name' (a local model directory)")
        self.chat_template = model_config.get("chat_template")
        dtype = model_config.get("torch_dtype", "float32")
        self.tokenizer = load_tokenizer(self.path, self.chat_template)
        self.base_model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, dtype))
        self.lora = {"r": int(head_config.get("r", 16)), "alpha": float(head_config.get("lora_alpha", 32)),
                     "dropout": float(head_config.get("lora_dropout", 0.0)),
                     "target_modules": list(head_config.get("target_modules") or _DEFAULT_TARGETS)}
        self.trainable_model = get_peft_model(self.base_model, LoraConfig(
            r=self.lora["r"], lora_alpha=self.lora["alpha"], lora_dropout=self.lora["dropout"],
            target_modules=self.lora["target_modules"], bias="none"))
        self.trainable_model.eval()

    def save_pretrained(self, path: str | Path) -> None:
        self.trainable_model.save_pretrained(str(path))

    def load_adapter(self, path: str | Path) -> None:
        """Replace the adapter's weights by those of a PEFT adapter directory (same LoRA shape)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(self.trainable_model, load_file(str(Path(path) / "adapter_model.safetensors")))
        if getattr(result, "unexpected_keys", None):
            raise LearnableAgentError(f"{path} does not fit this agent's LoRA head (e.g. {result.unexpected_keys[:2]})")

    def sample(self, messages: list[dict], tools: list[dict], *, max_tokens: int, temperature: float):
        """(prompt ids, sampled ids, their logprobs under log_softmax(logits / T), text)."""
        import torch

        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = self.trainable_model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=1.0, top_k=0,
                output_logits=True, return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id)
        response = out.sequences[0, len(ids):].tolist()
        scale = temperature if temperature > 0 else 1.0
        logprobs = [torch.log_softmax(step[0].float() / scale, -1)[tok].item() for step, tok in zip(out.logits, response)]
        return ids, response, logprobs, self.tokenizer.decode(response, skip_special_tokens=True)


@dataclass
class RunResult:
    answer: str | None
    messages: list[dict[str, Any]]
    experience_ids: list[str]
    task_id: str
    run_id: str


class LearnableAgent:
    def __init__(self, *, model_config: dict[str, Any], name: str, goal: str = "", instruction: str = "",
                 tools: dict[str, Callable] | list[Callable] | None = None, learning_head: str | None = "peft",
                 learning_head_config: dict[str, Any] | None = None, workdir: str | Path | None = None,
                 buffer_url: str | None = None, endpoint: str | None = None, api_key: str | None = None,
                 max_steps: int = 5, max_tokens: int = 256, temperature: float = 1.0):
        checkpoints.check_agent_name(name)
        if learning_head not in ("peft", None):
            raise LearnableAgentError(f"learning_head {learning_head!r} is not supported; use 'peft'")
        self.name, self.goal, self.instruction = name, goal, instruction
        self.max_steps, self.max_tokens, self.temperature = max_steps, max_tokens, temperature
        self.tools, self.tool_schemas = _tool_schemas(tools)
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self._api_key = api_key
        self.workdir = Path(workdir or f"runs/learnable/{name}")
        self.checkpoints_root = self.workdir / "checkpoints"
        self.last_run: RunResult | None = None
        self._model: PeftHead | None = None
        self._version = 0  # the version of the agent's weights (0: a fresh head)
        self._unpublished = True  # its weights are not a published version yet (learn() publishes them first)
        if self.endpoint is None:
            self._model = PeftHead(model_config, learning_head_config or {})
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.buffer_url = buffer_url or f"sqlite:///{self.workdir / 'buffer.db'}"
            self._db = buffer.create_buffer_engine(self.buffer_url)
        else:
            self._explorer = SyncExplorerClient(self.endpoint, api_key=api_key, timeout=600)

    # ------------------------------------------------------------------ MARSYS surface

    @property
    def model(self) -> PeftHead:
        if self._model is None:
            raise LearnableAgentError(f"agent {self.name} runs through the Explorer at {self.endpoint}; its weights are there")
        return self._model

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)

    def load_adapter(self, path: str | Path) -> None:
        """Start from an adapter trained elsewhere (same LoRA shape as learning_head_config)."""
        self.model.load_adapter(path)
        self._unpublished = True

    def _system(self) -> list[dict[str, Any]]:
        text = "\n\n".join(t for t in (self.instruction, f"Your goal: {self.goal}" if self.goal else "") if t)
        return [{"role": "system", "content": text}] if text else []

    # ------------------------------------------------------------------ acting

    def run(self, task: str, *, task_id: str | None = None, run_id: str | None = None) -> str | None:
        """A ReAct-style loop: the model answers or calls tools, which run here and whose results go
        back as ``role: tool``, until it answers without a call or ``max_steps`` calls were made.
        Returns the final answer (None if the steps ran out); every call is recorded."""
        task_id = task_id or new_id("task")
        run_id = run_id or "0"
        messages = [*self._system(), {"role": "user", "content": task}]
        ids: list[str] = []
        answer = None
        for _ in range(self.max_steps):
            message, eid = self._call(messages, task_id, run_id)
            ids.append(eid)
            messages.append(message)
            if not message.get("tool_calls"):
                answer = message.get("content")
                break
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                                 "content": self._run_tool(call["function"])})
        self.last_run = RunResult(answer, messages, ids, task_id, run_id)
        return answer

    async def arun(self, task: str, **kw: Any) -> str | None:
        return await asyncio.to_thread(self.run, task, **kw)

    def _run_tool(self, function: dict[str, Any]) -> str:
        fn = self.tools.get(function["name"])
        if fn is None:
            return f"error: no tool named {function['name']!r}"
        try:
            args = json.loads(function["arguments"] or "{}")
            result = fn(**args)
            if inspect.isawaitable(result):
                result = asyncio.run(result)
        except Exception as e:  # noqa: BLE001 - the model sees what went wrong, as with any tool
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result)

    def _call(self, messages: list[dict], task_id: str, run_id: str) -> tuple[dict[str, Any], str]:
        if self.endpoint is not None:
            try:
                r = self._explorer.chat_completions(
                    model=self.name, messages=messages, tools=self.tool_schemas or None, max_tokens=self.max_tokens,
                    temperature=self.temperature, metadata={"task_id": task_id, "run_id": run_id})
            except ExplorerError as e:
                raise LearnableAgentError(f"the Explorer answered {e.status}: {e.message}") from e
            choice = r["choices"][0]
            message = {k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls") and v is not None}
            return {"role": "assistant", **message}, choice["experience_id"]
        from services.common.tool_calls import parse_tool_calls

        prompt_ids, response_ids, logprobs, text = self.model.sample(messages, self.tool_schemas, max_tokens=self.max_tokens,
                                                                     temperature=self.temperature)
        content, calls = parse_tool_calls(text) if self.tool_schemas else (text, [])
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        completion = new_id("chatcmpl")
        eos = self.model.tokenizer.convert_tokens_to_ids(self.model.tokenizer.eos_token) if self.model.tokenizer.eos_token else None
        finish = "tool_calls" if calls else ("stop" if response_ids and response_ids[-1] == eos else "length")
        record = Experience(
            experience_id=experience_id(completion, 0), completion_id=completion, agent=self.name,
            model_version=self._version, task_id=task_id, run_id=run_id, prompt_token_ids=prompt_ids,
            response_token_ids=response_ids, response_logprobs=logprobs, messages=[dict(m) for m in messages],
            response=message, tools=self.tool_schemas or None, finish_reason=finish,
            sampling={"temperature": self.temperature, "top_p": 1.0, "max_tokens": self.max_tokens, "seed": None})
        buffer.insert_experiences(engine=self._db, records=[record])
        return message, record.experience_id

    # ------------------------------------------------------------------ learning

    def feedback(self, reward: float | None = None, *, hint: str | None = None, correction: dict[str, Any] | None = None,
                 call: int = 0, run: RunResult | None = None, commit: bool = True) -> int:
        """Reward every call of ``run`` (default: the last one) and, with ``commit``, make them
        trainable. Feedback in words, beside the reward or alone: ``hint``, what the agent should have
        done (learnt by self-distillation: ``learn(algorithm={"name": "opd"})``, or grpo's hint_coef);
        ``correction``, the assistant message (``content`` and/or ``tool_calls``) that the run's call
        ``call`` (an index into its calls: 0 the first, -1 the last) should have answered: it becomes a
        demonstration of that call's prompt, committed at once (``commit`` aside) and trained by the
        supervised term. Embedded, the reward, the hint and the correction are written in one
        transaction; through an Explorer they are too for a run of one call, and otherwise the
        correction goes first, under an idempotency key (a retry of this feedback stores it once).
        Returns how many calls got the reward or the hint (0 for a correction alone)."""
        run = run or self.last_run
        if run is None:
            raise LearnableAgentError("no run to reward yet: call run(task) first")
        if reward is None and not (hint or "").strip() and correction is None:
            raise LearnableAgentError("feedback needs a reward, a non-empty hint or a correction")
        if hint is not None and not hint.strip():
            raise LearnableAgentError("a hint must not be empty (leave it out to send the rest alone)")
        if hint is not None and len(hint) > HINT_MAX_CHARS:
            raise LearnableAgentError(f"a hint has at most {HINT_MAX_CHARS} characters ({len(hint)} given)")
        ids = run.experience_ids
        if correction is not None:
            if isinstance(call, bool) or not isinstance(call, int) or not -len(ids) <= call < len(ids):
                raise LearnableAgentError(f"correction of call {call!r}: this run made {len(ids)} call(s), "
                                          f"0 to {len(ids) - 1} (or -{len(ids)} to -1 from the end)")
            try:
                correction = assistant_reply(correction)
            except ReplyError as e:
                raise LearnableAgentError(f"correction: {e.message}") from None
        words = reward is not None or hint is not None  # what reaches every call of the run
        if self.endpoint is not None:
            return self._send_feedback(run, reward, hint, correction, call, commit=commit, words=words)
        note = {"labels": [], "comment": None, "source": "learnable-agent"}
        rows = buffer.feedback_rows(engine=self._db, msg_ids=ids) if hint is not None or correction is not None else []
        hints = None
        if hint is not None:
            tok = self.model.tokenizer
            hints = {r.experience_id: {"text": hint, "source": "learnable-agent", "at": buffer.utcnow().isoformat(),
                                       "prompt_token_ids": hint_prompt_ids(tok, r.messages, r.tools, hint)}
                     for r in rows}
        corrections = [] if correction is None else [self._correction(rows, ids[call], correction)]
        result = buffer.apply_feedback(engine=self._db, msg_ids=ids if words else [ids[call]], reward=reward,
                                       feedback=note, task_id=run.task_id, run_id=run.run_id, hints=hints,
                                       corrections=corrections)
        if commit:
            buffer.commit_experiences(engine=self._db, msg_ids=ids)
        return len(result.experience_ids) if words else 0

    def _send_feedback(self, run: RunResult, reward: float | None, hint: str | None, correction: dict[str, Any] | None,
                       call: int, *, commit: bool, words: bool) -> int:
        """``feedback`` through the Explorer: one /feedback body where it can be (a correction names one
        call, a reward or a hint the whole episode)."""
        ids = run.experience_ids
        path = "/feedback"
        try:
            if correction is not None and words and len(ids) == 1:
                self._explorer.feedback(msg_ids=ids, reward=reward, hint=hint, correction=correction)
            else:
                if correction is not None:  # first: a correction the Explorer refuses leaves everything as it was
                    key = hashlib.sha256(json.dumps([run.task_id, run.run_id, ids[call], correction],
                                                    sort_keys=True).encode()).hexdigest()
                    self._explorer.feedback(msg_ids=[ids[call]], correction=correction, idempotency_key=key)
                if words:
                    self._explorer.feedback(task_id=run.task_id, run_id=run.run_id, reward=reward, hint=hint)
            if commit:
                path = "/commit"
                self._explorer.commit(task_id=run.task_id)
        except ExplorerError as e:
            raise LearnableAgentError(f"{path} answered {e.status}: {e.message}") from e
        return len(ids) if words else 0

    def _correction(self, rows: list[Experience], corrected: str, reply: dict[str, Any]) -> Experience:
        """The demonstration a correction of the call ``corrected`` becomes, rendered as the Explorer
        renders one (services/common/replies.py)."""
        exp = next(r for r in rows if r.experience_id == corrected)
        config = self.model.base_model.config
        try:
            prompt_ids, reply_ids = render_reply(self.model.tokenizer, exp.messages, reply, exp.tools,
                                                 max_len=getattr(config, "max_position_embeddings", None) or 2048,
                                                 check_conversation=False)
        except ReplyError as e:
            raise LearnableAgentError(e.message.replace("response", "correction", 1)) from None
        return correction_record(exp, reply, prompt_ids, reply_ids, comment=None)

    def learn(self, steps: int = 1, *, ray_address: str | None = None, timeout_s: float = 3600, **overrides: Any) -> int:
        """Train the adapter for ``steps`` Trainer steps on the committed experiences (the real
        ``kaizen trainer``, GRPO unless ``algorithm={"name": ...}`` says otherwise; keyword arguments
        are Trainer config sections), then load the newest version. Returns that version."""
        import yaml

        from services.common.publish import publish_adapter

        if self.endpoint is not None:
            raise LearnableAgentError(f"agent {self.name} learns through the service behind {self.endpoint} (its Trainer)")
        head = self.model
        batch = int(overrides.get("train_batch_size", 16))
        committed = buffer.count_by_status(engine=self._db, agent=self.name).get("committed", 0)
        if committed < batch:
            raise LearnableAgentError(f"{committed} committed experiences, and a step trains on train_batch_size={batch}: "
                                      "run and reward more tasks first (or pass a smaller train_batch_size)")
        self.checkpoints_root.mkdir(parents=True, exist_ok=True)
        if self._unpublished:  # weights the Trainer has not seen: published first, so that it starts from them
            with tempfile.TemporaryDirectory() as d:
                head.save_pretrained(d)
                self._version = publish_adapter(d, agent=self.name, checkpoints_root=self.checkpoints_root,
                                                base_model=head.path, note="LearnableAgent weights before learn()").version
            self._unpublished = False
        config = {
            "model": {"path": head.path, **({"chat_template": head.chat_template} if head.chat_template else {})},
            "buffer": {"url": self.buffer_url}, "checkpoints": {"root": str(self.checkpoints_root)},
            "lora": head.lora, "algorithm": {"name": "grpo"},
            "trainer": {"agents": [self.name], "max_steps": steps, "run_dir": str(self.workdir / "trainer"), "progress": False},
            "ray": {"address": ray_address},
        }
        for section, values in overrides.items():
            config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
        path = self.workdir / "trainer.yaml"
        path.write_text(yaml.safe_dump(config))
        r = subprocess.run([sys.executable, "-m", "services.cli", "trainer", "--config", str(path)], capture_output=True,
                           text=True, timeout=timeout_s)
        (self.workdir / "trainer.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise LearnableAgentError(f"the Trainer failed (exit {r.returncode}); see {self.workdir / 'trainer.log'}: "
                                      f"{(r.stdout + r.stderr)[-1500:]}")
        latest = checkpoints.read_latest(self.checkpoints_root, self.name) or 0
        if latest > self._version:
            head.load_adapter(checkpoints.version_dir(self.checkpoints_root, self.name, latest))
            self._version = latest
        return self._version

    def close(self) -> None:
        if self.endpoint is not None:
            self._explorer.close()
        else:
            self._db.dispose()
