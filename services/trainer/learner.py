"""A learner worker: holds the policy, runs training steps, saves and loads state, publishes.

The Trainer runs ``workers`` of these as Ray actors. With more than one they form a
torch.distributed group (gloo on CPU, nccl on GPU): each computes gradients on its shard of the
batch, the adapter and critic gradients are summed with one all-reduce, and every worker applies
the same optimizer step, so replicas stay identical (data-parallel DDP, done by hand because
agents switch adapters between steps, which the DDP wrapper does not allow). Rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from services.common import checkpoints
from services.trainer.algorithms.masking import aggregate, masked_sum
from services.trainer.algorithms.surrogate import kl_k3, kl_penalty
from services.trainer.algorithms.sft import sft_loss
from services.trainer.batches import Norms, TrainItem, episode_chunks, length_chunks
from services.trainer.config import TrainerConfig
from services.trainer.policy import PackedBatch, Policy, chain_rows, pack
from services.trainer.recipes import GATHER_IDS, MicroBatch
from services.trainer.stats import StepStats

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_adapter.safetensors"  # in a saved state: the KL's reference (kl_reference: cold_start)


class _Scorer:
    """``Recipe.extra_inputs``' view of the policy: logprobs of given tokens, without gradients; with
    ``version``, under the agent's adapter as published in that version (``versions`` reads it), put in
    place for the forward and taken out again (the weights being trained are restored exactly)."""

    def __init__(self, policy: Policy, share_prefix_min: int, models: Callable[[str], Policy] | None = None, *,
                 agent: str | None = None, current_version: int | None = None,  # the version the live weights are
                 versions: Callable[[str, int], dict[str, torch.Tensor] | None] | None = None):
        self.policy, self.share_prefix_min, self.models = policy, share_prefix_min, models
        self.agent, self.current_version, self.versions = agent, current_version, versions

    def _model(self, model: str | None) -> Policy:
        if model is None:
            return self.policy
        if self.models is None:
            raise ValueError(f"this scorer has no model but the policy (asked for {model})")
        return self.models(model)

    def _published(self, version: int | None) -> dict[str, torch.Tensor] | None:
        """The adapter state to score under for ``version``: None for the weights as they are (no version,
        the current one, v0 (the base model: no adapter), or one whose adapter cannot be read)."""
        if version is None or version == 0 or version == self.current_version or self.versions is None \
                or self.agent is None:
            return None
        return self.versions(self.agent, version)

    def _adapter(self, adapter: bool, model: str | None, version: int | None) -> bool:
        """Whether the forward uses the agent's adapter: not for the base model, nor for v0, which is it."""
        return adapter and not (model is None and version == 0 and self.current_version != 0)

    def has_version(self, version: int) -> bool:
        return version == 0 or version == self.current_version or self._published(version) is not None

    @contextlib.contextmanager
    def _weights(self, adapter: bool, model: str | None, version: int | None):
        state = self._published(version) if adapter and model is None else None
        if state is None:
            yield
            return
        saved = {k: v.clone() for k, v in self.policy.adapter_state(self.agent).items()}  # (on CPU: the live tensors)
        try:
            self.policy.load_adapter_state(self.agent, state)  # inside: a load that fails half-way is undone too
            yield
        finally:
            self.policy.load_adapter_state(self.agent, saved)

    @torch.no_grad()
    def logprobs(self, prompts, responses, temperatures, *, adapter: bool = True, model: str | None = None,
                 version: int | None = None) -> torch.Tensor:
        p = self._model(model)
        batch = pack(prompts, responses, temperatures, p.pad_id, share_prefix_min=self.share_prefix_min)
        adapter = self._adapter(adapter, model, version)
        with self._weights(adapter, model, version):
            out = p.forward(batch, need_hidden=False, adapter=adapter)
        return out.logprobs * batch.response_mask.to(p.device)  # (B, R)

    @torch.no_grad()
    def top_logprobs(self, prompts, responses, temperatures, k: int, *, adapter: bool = True, model: str | None = None,
                     version: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self._model(model)
        batch = pack(prompts, responses, temperatures, p.pad_id, share_prefix_min=self.share_prefix_min)
        adapter = self._adapter(adapter, model, version)
        with self._weights(adapter, model, version):
            out = p.forward(batch, need_hidden=False, adapter=adapter, top_k=k)
        mask = batch.response_mask.to(p.device)
        return out.logprobs * mask, out.top[0] * mask.unsqueeze(-1), out.top[1]


def _widen(ids: torch.Tensor, width: int) -> torch.Tensor:
    """(B, R', k) token ids padded (with id 0, masked later) or cut to the batch's R positions."""
    if ids.shape[1] < width:
        return torch.nn.functional.pad(ids, (0, 0, 0, width - ids.shape[1]))
    return ids[:, :width]


def _undo_ray_niceness() -> None:
    """Ray workers start at nice 15 (RAY_worker_niceness); a learner at that priority starves behind
    any busy neighbour. Raising priority back needs privileges: try, and say so if it fails."""
    nice = None
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as e:  # PermissionError without CAP_SYS_NICE
        log.warning("learner runs at nice %s (could not lower it: %s); start Ray with RAY_worker_niceness=0", nice, e)


class LearnerWorker:
    def __init__(self, config: dict[str, Any], rank: int = 0, world_size: int = 1):
        self.cfg = TrainerConfig.model_validate(config)
        self.rank = rank
        self.world_size = world_size
        self.recipe = self.cfg.algorithm.recipe()
        self.policy: Policy | None = None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.critic_optimizers: dict[str, torch.optim.Optimizer] = {}
        # agent -> the guard's scores on its weights now: (NLL summed, tokens) of each set of demonstrations scored
        # together, so that a guard set that grows scores only its new members
        self._guard_nll: dict[str, dict[frozenset[str], tuple[float, int]]] = {}
        self._others: dict[str, Policy] = {}  # path -> another model a recipe scores with (a teacher)
        self._version_states: dict[tuple[str, int], dict[str, torch.Tensor] | None] = {}  # published adapters, read once
        # agent -> the published version its live weights are exactly (None: unpublished steps since, or unknown)
        self._live_version: dict[str, int | None] = {}
        # agent -> its adapter as the cold start left it: the KL's reference with algorithm.kl_reference cold_start
        self._reference: dict[str, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ set-up

    def _other_model(self, path: str) -> Policy:
        """Another model for a recipe's scorer (a teacher), loaded once, on the policy's device and dtype;
        it must share the agent's tokenizer, since it scores the agent's token ids."""
        if path not in self._others:
            p = self.policy
            other = Policy(model_path=path, chat_template=None, dtype=self.cfg.model.dtype, device=self.cfg.trainer.device,
                           lora=self.cfg.lora, seed=self.cfg.trainer.seed, attention=self.cfg.trainer.attention)
            if other.tokenizer.get_vocab() != p.tokenizer.get_vocab() or \
                    other.base.config.vocab_size != p.base.config.vocab_size:
                raise ValueError(f"the teacher model {path} does not share the agent's tokenizer ({p.model_path}): "
                                 "it could not score the agent's token ids")
            other.base.eval()
            self._others[path] = other
        return self._others[path]

    def _published_adapter(self, agent: str, version: int) -> dict[str, torch.Tensor] | None:
        """The adapter state ``agent`` published as ``version`` (a hint's teacher scores the tokens under the
        version that sampled them), read once and kept for the next few steps; None, logged once, when it
        cannot be read (retention deleted it, or it has another LoRA rank: ``kaizen publish``)."""
        key = (agent, version)
        if key in self._version_states:
            self._version_states[key] = self._version_states.pop(key)  # the most recently used goes last
        else:
            from safetensors.torch import load_file

            state = None
            try:
                v = checkpoints.validate_version(self.cfg.checkpoints.root, agent, version)
                config = json.loads((v.path / "adapter_config.json").read_text())
                lora = self.cfg.lora
                if (config.get("r"), float(config.get("lora_alpha", 0))) != (lora.r, float(lora.alpha)):
                    raise ValueError(f"LoRA rank {config.get('r')} alpha {config.get('lora_alpha')}, not this trainer's "
                                     f"{lora.r} and {lora.alpha}")
                state = load_file(str(v.path / "adapter_model.safetensors"))
                live = self.policy.adapter_state(agent)
                if {k: tuple(t.shape) for k, t in state.items()} != {k: tuple(t.shape) for k, t in live.items()}:
                    raise ValueError("its LoRA weights are not this trainer's modules and shapes")
            except Exception as e:  # unreadable (retention deleted it), corrupt, or another adapter (kaizen publish)
                state = None
                log.warning("%s v%d cannot be read (%s): its hinted calls are scored by the teacher as the adapter stands "
                            "before the step", agent, version, e)
            self._version_states[key] = state
            while len(self._version_states) > 4:  # the few versions a step's rows come from (within max_staleness)
                self._version_states.pop(next(iter(self._version_states)))
        return self._version_states[key]

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 only: an address and free port for the process group."""
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:
            host = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> dict[str, Any]:
        from services.common.logging import setup_logging

        setup_logging(self.cfg.log_level, self.cfg.log_format)
        _undo_ray_niceness()
        if self.cfg.trainer.torch_threads:
            torch.set_num_threads(self.cfg.trainer.torch_threads)
        torch.manual_seed(self.cfg.trainer.seed)
        random.seed(self.cfg.trainer.seed)
        self.policy = Policy(
            model_path=self.cfg.model.path, chat_template=self.cfg.model.chat_template, dtype=self.cfg.model.dtype,
            device=self.cfg.trainer.device, lora=self.cfg.lora, seed=self.cfg.trainer.seed,
            attention=self.cfg.trainer.attention,
        )
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.policy.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=self.world_size
            )
        node = None
        with contextlib.suppress(ImportError):  # (the GPU checks run learners without Ray installed)
            import ray

            # never ray.get_runtime_context() outside Ray: it would start or join a cluster from this process
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"rank": self.rank, "device": str(self.policy.device), "pid": os.getpid(), "node": node,
                "attention": self.policy.attention, "kernel_norms": self.policy.fused_norms}

    def ensure_agent(self, agent: str, *, state_dir: str | None = None, adapter_dir: str | None = None) -> bool:
        """Create the agent's adapter and optimizers, from a saved state or published adapter if given."""
        p = self.policy
        if p.has_agent(agent):
            return False
        p.add_agent(agent, critic=self.recipe.uses_critic)
        self._fresh_optimizers(agent)
        self._live_version[agent] = 0  # a fresh adapter is the base model
        if state_dir:
            self.load_state(agent, state_dir)
        elif adapter_dir:
            p.load_adapter_dir(agent, Path(adapter_dir))
            self._live_version[agent] = None
        return True

    def _fresh_optimizers(self, agent: str) -> None:
        o = self.cfg.optim
        self.optimizers[agent] = torch.optim.AdamW(
            self.policy.adapter_parameters(agent), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas)
        )
        if self.recipe.uses_critic:
            self.critic_optimizers[agent] = torch.optim.AdamW(self.policy.value_heads[agent].parameters(),
                                                              lr=self.recipe.config.critic_lr)

    def adopt_adapter(self, agent: str, adapter_dir: str) -> None:
        """Continue ``agent`` from an adapter published from elsewhere (``kaizen publish``): its
        weights, a fresh optimizer (the moments of other weights do not apply); a critic keeps its head."""
        self.policy.load_adapter_dir(agent, Path(adapter_dir))
        self._fresh_optimizers(agent)
        self._guard_nll.pop(agent, None)  # other weights: the guard scores them afresh
        self._reference.pop(agent, None)  # the next step's weights (these) become the KL's reference
        self._live_version[agent] = None

    def reset_agent(self, agent: str) -> None:
        """Back to the base model (a rollback to v0): a fresh adapter and optimizer; a critic keeps its head."""
        self.policy.reset_adapter(agent)
        self._fresh_optimizers(agent)
        self._guard_nll.pop(agent, None)
        self._reference.pop(agent, None)
        self._live_version[agent] = 0

    # ------------------------------------------------------------------ training

    def train_step(self, agent: str, items: list[TrainItem], norms: Norms, step: int, current_version: int,
                   guard: list[TrainItem] | None = None) -> StepStats:
        """One optimizer update per epoch on this worker's shard; returns additive statistics (``_train_step``).
        With ``kl_reference: cold_start``, the weights the step that ends the cold start leaves become the KL's
        reference (so the state saved after it holds it too)."""
        self.policy.activate(agent)
        self._keep_reference(agent, step)  # a reference not kept yet (cold_start_steps 0, an older state): these weights
        stats = self._train_step(agent, items, norms, step, current_version, guard)
        self._keep_reference(agent, step + 1)
        return stats

    def _train_step(self, agent: str, items: list[TrainItem], norms: Norms, step: int, current_version: int,
                    guard: list[TrainItem] | None) -> StepStats:
        """One optimizer update per epoch on this worker's shard; returns additive statistics.

        With ``guard`` (demonstrations, the same on every worker): an update after which their NLL
        per token exceeds ``guard.max_ratio`` x before + ``guard.slack`` is undone (weights and
        optimizer state) and redone at half the learning rate, up to ``guard.retries`` times; when
        every attempt is refused the step keeps the weights it started from. With ``guard.max_kl``,
        an update that moves the policy on the step's own sampled tokens by more than that (their
        mean KL, before || after, pooled over the learners' shards) is refused the same way."""
        cfg = self.cfg
        lr = cfg.optim.lr_at(step)
        g = cfg.guard
        live = self._live_version.get(agent)  # what the weights are before the step (the teacher's reference)
        # every learner takes the same branches, whatever its shard holds: the KL and each attempt's verdict
        # are all-reduced
        kl_on = g.max_kl is not None
        if not guard:  # a step that changes the weights unscored: what the guard scored before no longer holds
            self._guard_nll.pop(agent, None)
        if not guard and not kl_on:
            return self._update(agent, items, norms, current_version, lr, live)
        watched = [i for i in items if not i.demonstration and not i.context]
        t0 = time.perf_counter()
        if guard:
            before = self._guard_before(agent, guard)
        guard_seconds = time.perf_counter() - t0
        logprobs_before = self._sampled_logprobs(watched) if kl_on else []
        saved = self._snapshot(agent)
        for attempt in range(g.retries + 1):
            stats = self._update(agent, items, norms, current_version, lr * 0.5**attempt, live)
            stats.guard_attempts = float(attempt + 1)
            passed = True
            if guard:
                t0 = time.perf_counter()
                after_sums = self._nll_sums(guard)
                guard_seconds += time.perf_counter() - t0
                after = after_sums[0] / max(after_sums[1], 1)
                stats.guard_before, stats.guard_after, stats.guard_seconds = before, after, guard_seconds
                passed = after <= g.max_ratio * before + g.slack
            if kl_on:
                stats.guard_kl = self._kl_since(logprobs_before, watched)  # None: no sampled token in the step
                passed = passed and (stats.guard_kl is None or stats.guard_kl <= g.max_kl)
            if self._all_agree(passed):
                if guard:  # the next step's "before", without scoring again
                    self._guard_nll[agent] = {frozenset(i.experience_id for i in guard): after_sums}
                return stats
            self._restore(agent, saved)
        stats.guard_refused = 1.0
        self._live_version[agent] = live  # the weights it started from: their scores (_guard_before's) stand
        return stats

    def _guard_before(self, agent: str, guard: list[TrainItem]) -> float:
        """The guard set's NLL per token on ``agent``'s weights now. What was scored on these weights
        (the last step's "after", or a refused step's "before") is kept by the sets of demonstrations
        scored together: a set wholly in ``guard`` counts as it was, and only the members no kept set
        holds are scored (a guard set grows as corrections become demonstrations: without this every
        step that added one would score the whole set twice)."""
        ids = {i.experience_id for i in guard}
        kept = {part: sums for part, sums in self._guard_nll.get(agent, {}).items() if part <= ids}
        known = set().union(*kept)
        new = [i for i in guard if i.experience_id not in known]
        if new:
            kept[frozenset(i.experience_id for i in new)] = self._nll_sums(new)
        self._guard_nll[agent] = kept
        return sum(t for t, _ in kept.values()) / max(sum(n for _, n in kept.values()), 1)

    def _keep_reference(self, agent: str, step: int) -> None:
        """With ``kl_reference: cold_start``, the adapter before ``agent``'s first step past its cold start
        (``step``: the steps taken, those of the adapter as it is now) is kept as the KL's reference, and
        saved with its state. One past it without a saved reference (the option turned on later, an
        adapter adopted from elsewhere) takes the weights it has now, and says so."""
        a = self.cfg.algorithm
        if a.kl_reference != "cold_start" or agent in self._reference or step < a.cold_start_steps:
            return
        if step > a.cold_start_steps:
            log.warning("%s: no saved KL reference; its adapter at step %d is the reference from now on, not the "
                        "cold start's (step %d)", agent, step, a.cold_start_steps)
        self._reference[agent] = {n: p.detach().clone() for n, p in self.policy.adapter_named_parameters(agent).items()}

    @contextlib.contextmanager
    def _reference_weights(self, agent: str):
        """The agent's adapter parameters hold its KL reference (``_reference``) inside, their own values
        again after: copied in place, so entered before a forward whose graph a backward will use."""
        ref = self._reference.get(agent) if self.cfg.algorithm.kl_reference == "cold_start" else None
        if ref is None:
            yield
            return
        params, model = self.policy.adapter_named_parameters(agent), self.policy.model
        training = model.training
        with torch.no_grad():
            saved = {n: p.detach().clone() for n, p in params.items()}
            for n, p in params.items():
                p.copy_(ref[n])
        try:
            model.eval()  # the reference without LoRA dropout, as the base model (adapter off) is
            yield
        finally:
            model.train(training)
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])

    def _all_agree(self, passed: bool) -> bool:
        """Whether every learner passed (each scores the same guard set on the same weights, but float
        order may differ by device: one verdict for all, so all go on to the same next attempt)."""
        if self.world_size <= 1:
            return passed
        import torch.distributed as dist

        failed = torch.tensor([0.0 if passed else 1.0], device=self.policy.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        return float(failed) == 0.0

    @torch.no_grad()
    def _sampled_logprobs(self, items: list[TrainItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Logprobs of ``items``' sampled tokens under the active adapter, at their sampling
        temperatures (over the whole vocabulary, a grammar's mask aside), with their masks: one pair
        per micro-batch, in ``_length_chunks`` order."""
        p, out = self.policy, []
        for micro in self._length_chunks(items):
            batch = self._pack(micro)
            out.append((p.forward(batch, need_hidden=False).logprobs, batch.response_mask.to(p.device)))
        return out

    def _kl_since(self, before: list[tuple[torch.Tensor, torch.Tensor]], items: list[TrainItem]) -> float | None:
        """Mean per-token KL from the policy that scored ``before`` to the one now, on ``items``'
        sampled tokens (k3, which is never negative), pooled over every learner's shard: the same on
        all. None when no learner had a sampled token."""
        after = self._sampled_logprobs(items)
        if len(after) != len(before):
            raise RuntimeError(f"the guard scored {len(before)} micro-batches before the update and {len(after)} after")
        total = torch.zeros(2, dtype=torch.float64, device=self.policy.device)
        for (old, mask), (new, _) in zip(before, after):
            # k3 of KL(before || after): the tokens were sampled from the policy before, or from a version at most
            # staleness.max_staleness behind it
            total += torch.stack([masked_sum(kl_k3(old, new), mask).double(), mask.sum().double()])
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        kl, tokens = total.tolist()
        return kl / tokens if tokens else None

    def _update(self, agent: str, items: list[TrainItem], norms: Norms, current_version: int, lr: float,
                live: int | None = None) -> StepStats:
        """``live``: the published version the weights are before the update (None: none), which a recipe's
        scorer needs (a hint's teacher, as the version that sampled the call)."""
        cfg, p, recipe = self.cfg, self.policy, self.recipe
        self._live_version[agent] = None  # from the first update on, weights no version holds (until written)
        opt = self.optimizers[agent]
        critic_opt = self.critic_optimizers.get(agent)
        for g in opt.param_groups:
            g["lr"] = lr
        params = p.adapter_parameters(agent)
        critic_params = list(p.value_heads[agent].parameters()) if recipe.uses_critic else []
        stats = StepStats(lr=lr)
        cache: dict = {}  # the recipe's memory across the epochs of this step
        t0 = time.perf_counter()
        rollouts = [i for i in items if not i.demonstration]
        # calls whose term of the loss is exactly zero (advantage 0, and no KL penalty, entropy bonus or critic to
        # move them) are scored in micro-batches of their own without gradients: the step's figures count them,
        # its backward passes do not
        a = cfg.algorithm
        if not cfg.trainer.inert_backward and a.kl_coef == 0 and a.entropy_coef == 0 and not recipe.uses_critic:
            inert = [i for i in rollouts if recipe.inert(i)]
        else:
            inert = []
        skip = {id(i) for i in inert}
        micros = [(m, True) for m in self._micro_batches([i for i in rollouts if id(i) not in skip])]
        micros += [(m, False) for m in self._micro_batches(inert)]
        stats.inert_calls = float(len(inert))
        for epoch in range(cfg.trainer.epochs):
            opt.zero_grad(set_to_none=False)
            if critic_opt:
                critic_opt.zero_grad(set_to_none=False)
            for key, (micro, grad) in enumerate(micros):
                per_epoch, objective, first = self._micro_step(agent, micro, key=key, epoch=epoch, norms=norms, cache=cache,
                                                    current_version=current_version, live=live, grad=grad)
                stats.add(per_epoch, 1.0 / cfg.trainer.epochs)  # a step reports its epochs' mean
                stats.add_objective(objective, 1.0 / cfg.trainer.epochs)
                stats.add(first)
            for micro in self._length_chunks([i for i in items if i.demonstration]):
                stats.add(self._demonstration_step(micro, norms), 1.0 / cfg.trainer.epochs)
            self._all_reduce(params + critic_params)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
            stats.add({"grad_norm": grad_norm}, 1.0 / cfg.trainer.epochs)
            # A gradient of exactly zero (every advantage 0: a GRPO group all right or all wrong) carries no
            # evidence; AdamW would still move the weights along its old momentum, about as far as a real
            # step. So the adapter stays as it is (every replica sees the same reduced norm).
            if grad_norm != 0.0:
                opt.step()
            if critic_opt:
                if float(torch.nn.utils.clip_grad_norm_(critic_params, cfg.optim.grad_clip)) != 0.0:
                    critic_opt.step()
        stats.learner_seconds = time.perf_counter() - t0
        return stats

    @torch.no_grad()
    def _nll_sums(self, demos: list[TrainItem]) -> tuple[float, int]:
        """NLL of ``demos``' response tokens under the active adapter, summed, and their count (no gradients)."""
        total, tokens = 0.0, 0
        for micro in self._length_chunks(demos):
            logprobs, mask = self._demonstration_logprobs(micro)
            total -= float(masked_sum(logprobs, mask))
            tokens += int(mask.sum())
        return total, tokens

    def _snapshot(self, agent: str) -> dict[str, Any]:
        """Copies of what an update changes: the adapter, the value head and their optimizers' state."""
        p = self.policy
        return {
            "adapter": {k: v.detach().clone() for k, v in p.adapter_state(agent).items()},
            "optimizer": copy.deepcopy(self.optimizers[agent].state_dict()),
            "value_head": copy.deepcopy(p.value_heads[agent].state_dict()) if agent in p.value_heads else None,
            "critic_optimizer": copy.deepcopy(self.critic_optimizers[agent].state_dict())
            if agent in self.critic_optimizers else None,
        }

    def _restore(self, agent: str, saved: dict[str, Any]) -> None:
        p = self.policy
        p.load_adapter_state(agent, saved["adapter"])
        # load_state_dict keeps the tensors it is given and the next step updates them in place: a copy,
        # so that a second refusal restores the same state
        self.optimizers[agent].load_state_dict(copy.deepcopy(saved["optimizer"]))
        if saved["value_head"] is not None:
            p.value_heads[agent].load_state_dict(saved["value_head"])
            self.critic_optimizers[agent].load_state_dict(copy.deepcopy(saved["critic_optimizer"]))

    def _micro_step(self, agent: str, micro: list[TrainItem], *, key: int, epoch: int, norms: Norms, cache: dict,
                    current_version: int, live: int | None = None,
                    grad: bool = True) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Forward, the recipe's loss (plus the KL penalty and entropy bonus every objective may
        have), backward. Returns (statistics of every epoch, the recipe's statistics, statistics of
        the first epoch only). The recipe's extra inputs are computed at the first epoch, before
        any update, and kept for the step's other epochs. Without ``grad`` (calls whose term is
        exactly zero: ``Recipe.inert``) the same forward and figures, no gradients and no backward."""
        with torch.set_grad_enabled(grad):
            return self._micro_step_in(agent, micro, key=key, epoch=epoch, norms=norms, cache=cache,
                                       current_version=current_version, live=live, grad=grad)

    def _micro_step_in(self, agent: str, micro: list[TrainItem], *, key: int, epoch: int, norms: Norms, cache: dict,
                       current_version: int, live: int | None, grad: bool) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        a, p, recipe = self.cfg.algorithm, self.policy, self.recipe
        if ("extra", key) not in cache:  # before this forward: a recipe may ask it for some tokens' logprobs
            scorer = _Scorer(p, self.cfg.trainer.shared_prefix_min_tokens, self._other_model, agent=agent,
                             current_version=live, versions=self._published_adapter)
            cache[("extra", key)] = recipe.extra_inputs(micro, scorer)
        gather = cache[("extra", key)].get(GATHER_IDS)
        batch = self._pack(micro)
        dev = p.device
        response_mask = batch.response_mask.to(dev)
        has_context = any(it.context for it in micro)
        # teammates' calls (context) are valued by the critic, never trained by the policy
        mask = response_mask * torch.tensor([0.0 if it.context else 1.0 for it in micro], device=dev).unsqueeze(-1) \
            if has_context else response_mask
        old_lp = torch.zeros_like(mask)
        for row, it in enumerate(micro):
            old_lp[row, : len(it.old_logprobs)] = torch.tensor(it.old_logprobs)
        allowed = p.allowed_tokens([i.grammar for i in micro], [i.response_ids for i in micro], batch.response_len)
        ref_lp = None
        # before the policy's forward: a reference adapter is copied in and out in place. With cold_start, none before
        # the cold start ends (a step of it with rollouts): no penalty, no figure. The reference does not move within a
        # step: scored at its first epoch, kept for the others
        if (a.kl_coef > 0 or a.kl_metric) and (a.kl_reference == "base" or agent in self._reference):
            if ("reference", key) not in cache:
                with torch.no_grad(), self._reference_weights(agent):
                    cache[("reference", key)] = p.forward(batch, need_hidden=False, adapter=a.kl_reference == "cold_start",
                                                          allowed=allowed).logprobs
            ref_lp = cache[("reference", key)]
        out = p.forward(batch, need_hidden=recipe.uses_critic, entropy_grad=a.entropy_coef > 0, allowed=allowed,
                        gather=None if gather is None else _widen(gather, batch.response_len))
        stats: dict[str, float] = {"entropy_sum": float(masked_sum(out.entropy.detach(), mask)), "tokens": float(mask.sum())}
        first: dict[str, float] = {}
        if epoch == 0:
            diff = (out.logprobs.detach() - old_lp).abs()
            on = torch.tensor([float(it.model_version == current_version) for it in micro], device=dev).unsqueeze(-1) * mask
            first = {"mismatch_sum": float(masked_sum(diff, mask)), "mismatch_on_policy_sum": float(masked_sum(diff, on)),
                     "on_policy_tokens": float(on.sum())}
        if ref_lp is not None:
            stats["kl_sum"] = float(masked_sum(kl_k3(out.logprobs.detach(), ref_lp), mask))
        mb = MicroBatch(
            items=micro, logprobs=out.logprobs, old_logprobs=old_lp, mask=mask,
            weights=torch.tensor([it.weight for it in micro], device=dev),
            rewards=torch.tensor([it.reward or 0.0 for it in micro], device=dev),
            hidden=out.hidden if recipe.uses_critic else None,
            value_head=p.value_heads[agent] if recipe.uses_critic else None,
            norms=norms, objective=a, sequence_level=a.level == "sequence" and recipe.uses_ratio,
            key=key, first_epoch=epoch == 0, cache=cache, value_mask=response_mask if has_context else None,
            extra=cache[("extra", key)], gathered=out.gathered,
        )
        loss, st = recipe.loss(mb)
        objective = {k: float(v) for k, v in st.items() if k != "loss"}
        if recipe.uses_ratio and a.kl_coef > 0 and ref_lp is not None:
            kl = kl_penalty(out.logprobs, ref_lp, mask, norms.tokens)
            loss = loss + a.kl_coef * kl
            stats["kl_loss"] = float(kl.detach())
        stats["loss"] = float(loss.detach())  # the objective's (and KL penalty's); the entropy bonus is not a loss
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * aggregate(out.entropy, mask, norms.tokens)
        if grad:
            loss.backward()
        return stats, objective, first

    def _micro_batches(self, items: list[TrainItem]) -> list[list[TrainItem]]:
        """A recipe that credits an episode's calls together (a critic) sees whole episodes; the
        others get sequences of similar length together, so little of each forward is padding."""
        return episode_chunks(items, self.cfg.trainer.micro_batch_size) if self.recipe.uses_critic else self._length_chunks(items)

    def _length_chunks(self, items: list[TrainItem]) -> list[list[TrainItem]]:
        """Micro-batches by length (``length_chunks``). When ``items`` can be chained (``_chainable``),
        the calls one row scores (``chain_rows``) stay together, and micro_batch_size and
        micro_batch_tokens count that row as laid out: from its shortest prompt to its longest call's end."""
        t = self.cfg.trainer
        if not self._chainable(items):
            return length_chunks(items, t.micro_batch_size, t.micro_batch_tokens)
        rows = chain_rows([i.prompt_ids for i in items], [i.response_ids for i in items], [i.temperature for i in items])
        priced: dict[int, list[TrainItem]] = {}
        shapes = []
        for r in rows:
            head, start = items[r[0]], min(len(items[k].prompt_ids) for k in r)
            full = head.prompt_ids + head.response_ids
            shape = replace(head, prompt_ids=full[:start], response_ids=full[start:])
            priced[id(shape)] = [items[k] for k in r]
            shapes.append(shape)
        return [[c for shape in chunk for c in priced[id(shape)]]
                for chunk in length_chunks(shapes, t.micro_batch_size, t.micro_batch_tokens)]

    def _chainable(self, items: list[TrainItem]) -> bool:
        """Whether ``items``' calls may share rows: ``trainer.chain_calls``, on a model whose logits are its
        LM head's product (``Policy.chains``)."""
        return self.cfg.trainer.chain_calls and self.policy.chains

    def _pack(self, micro: list[TrainItem], *, temperature: float | None = None) -> PackedBatch:
        """``micro`` laid out for a forward (at its calls' temperatures, or ``temperature``), its calls
        chained into shared rows when ``_chainable``."""
        temperatures = [i.temperature if temperature is None else temperature for i in micro]
        t = self.cfg.trainer
        return pack([i.prompt_ids for i in micro], [i.response_ids for i in micro], temperatures, self.policy.pad_id,
                    share_prefix_min=t.shared_prefix_min_tokens, chain=self._chainable(micro))

    def _demonstration_step(self, micro: list[TrainItem], norms: Norms) -> dict[str, float]:
        """The supervised term: the token-mean NLL of the step's demonstrations and replayed
        successes, each at its weight (``demonstration_weight``, ``imitation_weight``), in the same
        update as the objective's own loss (a mixed objective). Reports their unweighted NLL."""
        logprobs, mask = self._demonstration_logprobs(micro)
        weights = torch.tensor([i.weight for i in micro], device=mask.device).unsqueeze(-1)
        loss, st = sft_loss(logprobs=logprobs, mask=mask, weights=weights, normalizer=norms.demo_tokens)
        loss.backward()
        return {"demo_nll": float(st["nll"])}

    def _demonstration_logprobs(self, micro: list[TrainItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of the demonstrations' response tokens (with grad unless under no_grad) and their mask."""
        p = self.policy
        batch = self._pack(micro, temperature=1.0)
        return p.forward(batch, need_hidden=False, entropy_grad=False).logprobs, batch.response_mask.to(p.device)

    def _all_reduce(self, params: list[torch.nn.Parameter]) -> None:
        if self.world_size <= 1:
            return
        import torch.distributed as dist

        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # shard losses are already scaled by the batch size
        offset = 0
        for q, g in zip(params, grads):
            n = g.numel()
            q.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n

    # ------------------------------------------------------------------ state and publication

    def save_state(self, agent: str, path: str, meta: dict[str, Any]) -> str:
        """Everything a restarted trainer needs for ``agent``, written atomically to ``path``."""
        from safetensors.torch import save_file

        def write(tmp: Path) -> None:
            save_file(self.policy.adapter_state(agent), str(tmp / "adapter_model.safetensors"))
            if agent in self._reference:
                save_file({n: t.detach().cpu().contiguous() for n, t in self._reference[agent].items()}, str(tmp / REFERENCE_FILE))
            torch.save(
                {
                    "optimizer": self.optimizers[agent].state_dict(),
                    "critic_optimizer": self.critic_optimizers[agent].state_dict() if agent in self.critic_optimizers else None,
                    "value_head": self.policy.value_heads[agent].state_dict() if agent in self.policy.value_heads else None,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                },
                tmp / "trainer_state.pt",
            )
            (tmp / "trainer.json").write_text(json.dumps(meta, indent=2))

        checkpoints.write_dir_atomic(Path(path), write)
        return path

    def load_state(self, agent: str, path: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        d = Path(path)
        self._guard_nll.pop(agent, None)  # other weights: the guard scores them afresh
        self._live_version[agent] = None  # a saved state may be of a step never published
        self.policy.load_adapter_state(agent, load_file(str(d / "adapter_model.safetensors")))
        self._reference.pop(agent, None)
        if (d / REFERENCE_FILE).exists():
            ref, names = load_file(str(d / REFERENCE_FILE)), self.policy.adapter_named_parameters(agent)
            if {n: tuple(t.shape) for n, t in ref.items()} == {n: tuple(p.shape) for n, p in names.items()}:
                self._reference[agent] = {n: t.to(names[n].device, names[n].dtype) for n, t in ref.items()}
            else:  # another LoRA layout (the state of another configuration): the next step takes its weights
                log.warning("%s: the saved KL reference in %s is not this adapter's parameters; not used", agent, d)
        blob = torch.load(d / "trainer_state.pt", weights_only=False)
        self.optimizers[agent].load_state_dict(blob["optimizer"])
        if blob.get("value_head") is not None and agent in self.policy.value_heads:
            self.policy.value_heads[agent].load_state_dict(blob["value_head"])
            self.critic_optimizers[agent].load_state_dict(blob["critic_optimizer"])
        torch.set_rng_state(blob["rng"]["torch"])
        random.setstate(blob["rng"]["python"])
        if blob["rng"].get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(blob["rng"]["cuda"])
        return json.loads((d / "trainer.json").read_text())

    def publish(self, agent: str, root: str, version: int, manifest: dict[str, Any]) -> str:
        """Write ``v<version>`` and point LATEST at it, in one call (the demo's warm start)."""
        v = checkpoints.publish_version(root, agent, version, lambda d: self.policy.save_adapter(agent, d), manifest)
        self._live_version[agent] = version
        return str(v.path)

    def write_version(self, agent: str, root: str, version: int, manifest: dict[str, Any]) -> str:
        """Write the adapter as ``v<version>``; the driver moves LATEST (it decides what serves)."""
        v = checkpoints.write_version(root, agent, version, lambda d: self.policy.save_adapter(agent, d), manifest)
        self._live_version[agent] = version  # (rank 0 alone writes: the other ranks read it back, the same weights)
        return str(v.path)
