"""A learner worker: holds the policy, runs training steps, saves and loads state, publishes.

The Trainer runs ``workers`` of these as Ray actors. With more than one they form a
torch.distributed group (gloo on CPU, nccl on GPU): each computes gradients on its shard of the
batch, the adapter and critic gradients are summed with one all-reduce, and every worker applies
the same optimizer step, so replicas stay identical (data-parallel DDP, done by hand because
agents switch adapters between steps, which the DDP wrapper does not allow). Rank 0 writes files.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from services.common import checkpoints
from services.trainer.algorithms import REGISTRY
from services.trainer.algorithms.advantages import gae, sequence_logprob, terminal_rewards
from services.trainer.algorithms.masking import aggregate, masked_sum
from services.trainer.algorithms.surrogate import kl_k3
from services.trainer.batches import TrainItem
from services.trainer.config import TrainerConfig
from services.trainer.policy import Policy, pack

log = logging.getLogger(__name__)


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


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
        self.objective = REGISTRY[self.cfg.algorithm.name]
        self.policy: Policy | None = None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.critic_optimizers: dict[str, torch.optim.Optimizer] = {}

    # ------------------------------------------------------------------ set-up

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

        setup_logging(self.cfg.log_level)
        _undo_ray_niceness()
        if self.cfg.trainer.torch_threads:
            torch.set_num_threads(self.cfg.trainer.torch_threads)
        torch.manual_seed(self.cfg.trainer.seed)
        random.seed(self.cfg.trainer.seed)
        self.policy = Policy(
            model_path=self.cfg.model.path, dtype=self.cfg.model.dtype, device=self.cfg.trainer.device,
            lora=self.cfg.lora, seed=self.cfg.trainer.seed,
        )
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.policy.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=self.world_size
            )
        return {"rank": self.rank, "device": str(self.policy.device), "pid": os.getpid()}

    def ensure_agent(self, agent: str, *, state_dir: str | None = None, adapter_dir: str | None = None) -> bool:
        """Create the agent's adapter and optimizers, from a saved state or published adapter if given."""
        p = self.policy
        if p.has_agent(agent):
            return False
        p.add_agent(agent, critic=self.objective.uses_critic)
        o = self.cfg.optim
        self.optimizers[agent] = torch.optim.AdamW(
            p.adapter_parameters(agent), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas)
        )
        if self.objective.uses_critic:
            self.critic_optimizers[agent] = torch.optim.AdamW(p.value_heads[agent].parameters(), lr=self.cfg.algorithm.critic_lr)
        if state_dir:
            self.load_state(agent, state_dir)
        elif adapter_dir:
            p.load_adapter_dir(agent, Path(adapter_dir))
        return True

    # ------------------------------------------------------------------ training

    def train_step(self, agent: str, items: list[dict], norms: dict[str, float], step: int, current_version: int) -> dict[str, float]:
        """One optimizer update per epoch on this worker's shard; returns additive stat sums."""
        cfg, a, p = self.cfg, self.cfg.algorithm, self.policy
        objective = self.objective
        p.activate(agent)
        batch_items = [TrainItem(**it) for it in items]
        opt = self.optimizers[agent]
        critic_opt = self.critic_optimizers.get(agent)
        lr = cfg.optim.lr * min(1.0, (step + 1) / cfg.optim.warmup_steps) if cfg.optim.warmup_steps else cfg.optim.lr
        for g in opt.param_groups:
            g["lr"] = lr
        params = p.adapter_parameters(agent)
        critic_params = list(p.value_heads[agent].parameters()) if objective.uses_critic else []
        sequence_level = a.level == "sequence" and objective.uses_ratio
        normalizer = norms["sequences"] if sequence_level else norms["tokens"]
        want_ref = a.kl_coef > 0 or a.kl_metric
        totals: dict[str, float] = defaultdict(float)
        old_values: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        for epoch in range(cfg.trainer.epochs):
            opt.zero_grad(set_to_none=False)
            if critic_opt:
                critic_opt.zero_grad(set_to_none=False)
            for mb, micro in enumerate(_chunks(batch_items, cfg.trainer.micro_batch_size)):
                stats = self._micro_step(agent, micro, mb, epoch, normalizer, norms, want_ref, sequence_level, old_values, current_version)
                for k, v in stats.items():
                    totals[k] += v / cfg.trainer.epochs if not k.startswith("first_") else v
            self._all_reduce(params + critic_params)
            totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)) / cfg.trainer.epochs
            opt.step()
            if critic_opt:
                torch.nn.utils.clip_grad_norm_(critic_params, cfg.optim.grad_clip)
                critic_opt.step()
        totals["learner_seconds"] = time.perf_counter() - t0
        totals["lr"] = lr
        return dict(totals)

    def _micro_step(self, agent, micro, mb, epoch, normalizer, norms, want_ref, sequence_level, old_values, current_version):
        a, p, objective = self.cfg.algorithm, self.policy, self.objective
        batch = pack([i.prompt_ids for i in micro], [i.response_ids for i in micro], [i.temperature for i in micro], p.pad_id)
        dev = p.device
        mask = batch.response_mask.to(dev)
        R = batch.response_len
        old_lp = torch.zeros_like(mask)
        for row, it in enumerate(micro):
            old_lp[row, : len(it.old_logprobs)] = torch.tensor(it.old_logprobs)
        weights = torch.tensor([it.weight for it in micro], device=dev)
        rewards = torch.tensor([it.reward for it in micro], device=dev)
        out = p.forward(batch, need_hidden=objective.uses_critic, entropy_grad=a.entropy_coef > 0)
        stats: dict[str, float] = {}
        if epoch == 0:
            diff = (out.logprobs.detach() - old_lp).abs()
            stats["first_mismatch_sum"] = float(masked_sum(diff, mask))
            on = torch.tensor([float(it.model_version == current_version) for it in micro], device=dev).unsqueeze(-1) * mask
            stats["first_mismatch_on_policy_sum"] = float(masked_sum(diff, on))
            stats["first_on_policy_tokens"] = float(on.sum())
        ref_lp = None
        if want_ref:
            with torch.no_grad():
                ref_lp = p.forward(batch, need_hidden=False, adapter=False).logprobs
            stats["kl_sum"] = float(masked_sum(kl_k3(out.logprobs.detach(), ref_lp), mask))
        stats["entropy_sum"] = float(masked_sum(out.entropy.detach(), mask))
        stats["tokens"] = float(mask.sum())

        if objective.name == "sft":
            loss, st = objective.loss(logprobs=out.logprobs, mask=mask, weights=weights.unsqueeze(-1), normalizer=norms["tokens"])
        else:
            kl_args = dict(token_logprobs=out.logprobs, ref_logprobs=ref_lp, token_mask=mask,
                           token_normalizer=norms["tokens"], kl_coef=a.kl_coef if ref_lp is not None else 0.0)
            common = dict(clip_low=a.clip_low, clip_high=a.clip_high, normalizer=normalizer, **kl_args)
            if objective.uses_critic:
                values = p.value_heads[agent](out.hidden.detach())  # (B, R)
                if epoch == 0:
                    old_values[mb] = values.detach()
                ov = old_values[mb]
                if sequence_level:
                    adv = rewards - ov[:, 0]
                    returns = rewards
                    adv_mask = torch.ones_like(adv)
                else:
                    adv, returns = gae(terminal_rewards(rewards, mask), ov, mask, gamma=a.gamma, lam=a.lam)
                    adv_mask = mask
                stats["adv_sum"] = float(masked_sum(adv, adv_mask))
                stats["adv_sq_sum"] = float(masked_sum(adv**2, adv_mask))
                stats["adv_count"] = float(adv_mask.sum())
                stats["value_sum"] = float(masked_sum(ov, mask))
            else:
                adv = torch.tensor([it.advantage for it in micro], device=dev)
            if sequence_level:
                lp = sequence_logprob(out.logprobs, mask, mode=a.sequence_logprob)
                olp = sequence_logprob(old_lp, mask, mode=a.sequence_logprob)
                seq_mask = torch.ones(len(micro), device=dev)
                pol = dict(logprobs=lp, old_logprobs=olp, advantages=adv if adv.dim() == 1 else adv[:, 0], mask=seq_mask, weights=weights)
                if objective.uses_critic:
                    pol.update(values=values[:, 0], old_values=ov[:, 0], returns=returns)
            else:
                tok_adv = adv if adv.dim() == 2 else adv.unsqueeze(-1).expand(-1, R)
                pol = dict(logprobs=out.logprobs, old_logprobs=old_lp, advantages=tok_adv, mask=mask, weights=weights.unsqueeze(-1))
                if objective.uses_critic:
                    pol.update(values=values, old_values=ov, returns=returns)
            if objective.uses_critic:
                pol.update(value_clip=a.value_clip, vf_coef=a.vf_coef)
            loss, st = objective.loss(**pol, **common)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * aggregate(out.entropy, mask, norms["tokens"])
        loss.backward()
        for k, v in st.items():
            stats[k] = float(v)
        return stats

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
        self.policy.load_adapter_state(agent, load_file(str(d / "adapter_model.safetensors")))
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
        return str(v.path)

    def write_version(self, agent: str, root: str, version: int, manifest: dict[str, Any]) -> str:
        """Write the adapter as ``v<version>``; the driver moves LATEST (it decides what serves)."""
        v = checkpoints.write_version(root, agent, version, lambda d: self.policy.save_adapter(agent, d), manifest)
        return str(v.path)
