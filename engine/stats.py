"""EngineStats: what an engine did (counters since it was built or since `reset_stats()`) and what it holds now
(kernel backends, seats, blocks, state bytes, CUDA graphs), so the harness and eval read one object instead of
the runner's and the state manager's internals (each reports through its declared interface: core.Runner,
core.StateCache)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Counters:
    """Counted by the engine core as steps run (reset by reset_stats)."""
    steps: int = 0                  # launched steps (runner.execute calls)
    requests_added: int = 0
    requests_finished: int = 0      # finished normally (length / stop); aborted ones are not counted
    prompt_tokens: int = 0          # prompt tokens of the added requests (each of n samples counts)
    fed_tokens: int = 0             # positions fed to the model: prompts (again after a preemption), newest
                                    # tokens and drafts
    generated_tokens: int = 0       # tokens sampled on the device and read back (rejected drafts and the extra
                                    # token of a request that had already finished included)
    committed_tokens: int = 0       # tokens appended to outputs (what the caller gets back)
    draft_tokens: int = 0           # drafts fed in verify rows
    accepted_draft_tokens: int = 0  # drafts equal to the target's sample at their position
    rollbacks: int = 0              # verify rows that rejected a draft (num_computed rolled back)
    decode_rows: int = 0            # sampled rows that fed only decode / verify positions (no prompt piece)
    decode_row_tokens: int = 0      # tokens those rows committed (their mean: the accepted length, bonus included)
    drafts_at: list = field(default_factory=list)     # [k]: verify rows that fed a draft at draft position k
    accepted_at: list = field(default_factory=list)   # [k]: of those, rows whose draft k was accepted
    max_step_rows: int = 0          # most rows one step fed
    max_step_tokens: int = 0        # most positions one step fed (<= max_num_batched_tokens)
    # where the engine loop's wall time goes (seconds; core.step): with asynchronous scheduling the host plans,
    # launches and applies while the device runs, so a loop whose device_wait_s is near zero is host-bound
    host_plan_s: float = 0.0        # planning steps (speculation's plan, the scheduler)
    host_launch_s: float = 0.0      # launching them (the runner's inputs, graph replay or eager launches, ring
                                    # snapshots) less a previous step read inside it; on a CPU device the forward too
    device_wait_s: float = 0.0      # blocked until a step's tokens were on the host: the device had not finished it
    host_apply_s: float = 0.0       # applying them (reading them into lists, commits, stops, finishes, the prefix
                                    # cache's blocks)


@dataclass
class EngineStats(Counters):
    """A snapshot: the counters plus what the engine holds at the time it was taken. State fields the state
    manager keeps no such thing for are None (a fake one's blocks and bytes)."""
    preemptions: int = 0            # sequences preempted (recomputed later)
    graph_replays: int = 0          # CUDA-graph replays of the decode step (runner.graph_replays)
    kernel_backend: str = "reference"                           # the backend set every step runs under
    kernel_backends: dict[str, str] = field(default_factory=dict)   # op -> backend actually used
    async_scheduling: bool = True
    cuda_graphs: bool = False
    graphs_captured: list = field(default_factory=list)         # the runner's captured graph keys
    num_seats: int = 0              # state slots (sequences that can run at once)
    free_seats: int | None = None
    num_blocks: int | None = None   # entry blocks in the state pools
    free_blocks: int | None = None
    block_tokens: int | None = None  # positions per block
    state_bytes: int | None = None   # bytes of the state pools
    state_summary: str | None = None  # the start-up log line of the state manager
    expert_traffic: dict | None = None  # LLM(expert_traffic=True): per MoE layer, parallel/traffic.ExpertTraffic
    # prefix caching (cache/prefix.py; None when off): counted like the counters above, and what it holds now
    prefix_caching: bool = False
    prefix_queried_tokens: int | None = None    # tokens of the sequences that started looking for a cached prefix
    prefix_hit_tokens: int | None = None        # of those, positions served from cached blocks
    prefix_replayed_tokens: int | None = None   # positions bounded replay recomputed for the rings of those hits
    prefix_evicted_blocks: int | None = None    # cached blocks given to new allocations
    prefix_snapshot_hits: int | None = None     # hits that started from a ring snapshot (replaying less or nothing)
    prefix_cached_blocks: int | None = None     # blocks the cache holds now (shared or idle)
    prefix_replay_tokens: int | None = None     # the replay length R of this model and state layout
    prefix_snapshots: int | None = None         # ring snapshots held now

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hit tokens over queried tokens (None: prefix caching off or nothing queried)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def graph_count(runner) -> int:
    """CUDA graphs the runner has captured so far (step graphs and draft-block graphs)."""
    return len(runner.graph_keys())


def runner_fields(runner) -> dict:
    """What the runner says about CUDA graphs."""
    return {"cuda_graphs": runner.cuda_graphs,
            "graphs_captured": [list(k) for k in sorted(runner.graph_keys(), key=repr)],
            "graph_replays": runner.graph_replays}
