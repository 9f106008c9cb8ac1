"""The runtime: what every worker runs between ``init_distributed`` and the end, and how a survivor
resumes after a failure.

- :mod:`~ds_swift.runtime.context`: joining the job's process group by generation (``init_distributed``);
- :mod:`~ds_swift.runtime.engine`: the engine wrapper (``initialize``; the training loop with retries;
  its checkpoint calls, the iteration's inputs and its end in ``engine_checkpoint``, ``engine_inputs``
  and ``engine_close``; what it sets up around the engine in ``engine_setup``);
- :mod:`~ds_swift.runtime.hooks`: per-instruction hooks (RNG keying, fault injection, undo);
- :mod:`~ds_swift.runtime.rebuild`: a survivor's teardown (:mod:`~ds_swift.runtime.teardown`), a membership
  change, rejoining generation g+1, the DeepSpeed rebuild, a replacement's start, the recovery protocol;
- :mod:`~ds_swift.runtime.guard`: the post-recovery loss guard;
- :mod:`~ds_swift.runtime.timeline`: the last recovery's timeline, gathered and written;
- :mod:`~ds_swift.runtime.failure_simulation`: Nicolae et al.'s failure-simulation mode;
- :mod:`~ds_swift.runtime.warm`, :mod:`~ds_swift.runtime.forkserver`: the processes a warm spare and a fork
  server run before they become ranks.

What runs while nothing fails (buddy copies, digests, logs, running checkpoints) is ds_swift.protect;
the recovery protocol is ds_swift.recovery. Nothing is imported here.
"""
