"""Many models on one GPU: which are resident, which sleep, and when to wake them.

- `footprint`: a model's device memory (weights and KV cache) and the budget they share;
- `model_state`: each model's state (resident, asleep, waking, going to sleep) and counts;
- `demand`: per-model arrival-rate estimates;
- `policies`: which idle model to put to sleep and which sleeping one to wake ahead of its
  requests (LRU, LRU with demand pre-warm, tabular Q-learning, `demand`: the default);
- `placement`: the decisions, synchronous and clock-free, shared by the live controller and
  the simulator (wake plans, pre-warms, drains of busy models, never a running one);
- `controller`: the live, asyncio side: requests wait for a wake, plans run on an actuator;
- `engine_actuator`: in-process AsyncEngines as the actuator;
- `engine_control`: the control calls a model server answers for its engine (the Triton chat
  model: /sleep, /wake_up, /is_sleeping, /footprint);
- `simulator`: the policies on synthetic traces in virtual time (`llmserve bench placement`).
"""
