"""AIPerf's own lane schedule for a trace, computed by AIPerf (run with its python).

Reads JSON on stdin: {"seed": int, "lanes": int, "sessions": [{"id": str,
"streams": [{"id": str, "t_ms": [float, ...], "spawn_turn": int | null}]}]} where the
first stream is the main chain and each other one a subagent branch spawned by main
turn ``spawn_turn``. Builds AIPerf 0.13.0's ``TrajectorySource`` (sequential sampler,
start range 0-1, as the AgentX scenario does) on that metadata and prints, per lane, the
trace, t* (ms) and every live stream's next turn: what AIPerf's warm-up primes and
where its profiling starts. Used by tests/replay/test_aiperf_schedule.py as the reference.
"""

from __future__ import annotations

import json
import sys

from aiperf.common.enums import ConversationBranchMode
from aiperf.common.models import DatasetMetadata
from aiperf.common.models.branch import ConversationBranchInfo
from aiperf.common.models.dataset_models import ConversationMetadata, TurnMetadata
from aiperf.dataset.dataset_samplers import SequentialSampler
from aiperf.plugin.enums import DatasetSamplingStrategy
from aiperf.timing.trajectory_source import TrajectorySource


def main() -> None:
    spec = json.load(sys.stdin)
    convs = []
    for s in spec["sessions"]:
        main_stream, *subs = s["streams"]
        branches = []
        children = []
        for sub in subs:
            cid = f"{s['id']}::sa:{sub['id']}"
            children.append(ConversationMetadata(
                conversation_id=cid, is_root=False, agent_depth=1,
                turns=[TurnMetadata(timestamp_ms=t) for t in sub["t_ms"]]))
            branches.append(ConversationBranchInfo(
                branch_id=f"b-{sub['id']}", child_conversation_ids=[cid],
                mode=ConversationBranchMode.FORK))
        turns = [TurnMetadata(timestamp_ms=t) for t in main_stream["t_ms"]]
        for sub in subs:
            if sub.get("spawn_turn") is not None:
                turns[sub["spawn_turn"]].branch_ids.append(f"b-{sub['id']}")
        convs.append(ConversationMetadata(conversation_id=s["id"], turns=turns,
                                          branches=branches))
        convs.extend(children)
    meta = DatasetMetadata(conversations=convs,
                           sampling_strategy=DatasetSamplingStrategy.SEQUENTIAL)
    roots = [c.conversation_id for c in convs if c.is_root]
    src = TrajectorySource(dataset_metadata=meta, dataset_sampler=SequentialSampler(roots),
                           concurrency=spec["lanes"], random_seed=spec["seed"],
                           start_min_ratio=0.0, start_max_ratio=1.0, cache_bust_enabled=True)
    out = []
    for lane, tr in enumerate(src.trajectories):
        snap = tr.snapshot
        out.append({"lane": lane, "trace": tr.conversation_id,
                    "t_star_ms": None if snap is None else snap.t_star_ms,
                    "next": {} if snap is None else {
                        st.conversation_id: st.next_turn_index for st in snap.states}})
    recycle = [src.next_recycle_conversation_id() for _ in range(2 * len(roots))]
    print(json.dumps({"lanes": out, "recycle": recycle}))


if __name__ == "__main__":
    main()
