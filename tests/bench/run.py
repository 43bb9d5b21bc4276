"""`make bench`: every benchmark, one after the other, each printing ratios measured side by side."""

from __future__ import annotations

import sys

from services.common.logging import setup_logging


def main() -> int:
    setup_logging("warning")
    from tests.bench import (canary, engine_replicas, episodes, explorer, learning, logits, prefix, quotas, recording, reload,
                             replicas, scale, smollm2, soak, trainer, vllm)

    sections = [("explorer", explorer.main), ("recording", recording.main), ("trainer", trainer.main), ("logits", logits.main),
                ("quotas", quotas.main), ("replicas", replicas.main),
                ("reload", reload.main),
                ("canary", canary.main), ("soak", soak.main), ("scale", scale.main), ("vllm", vllm.main),
                ("smollm2", smollm2.main), ("prefix", prefix.main), ("engine-replicas", engine_replicas.main),
                ("episodes", episodes.main),
                # last: one real demo per seed and setting, 11-14 minutes each on 2 cores (12 runs by default: about 2.6 hours)
                ("learning", learning.main)]
    only = set(sys.argv[1:])
    for name, fn in sections:
        if only and name not in only:
            continue
        print(fn(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
