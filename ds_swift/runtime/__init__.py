"""The runtime, in story order: what runs in every worker between ``init_distributed`` and the end.

- :mod:`~ds_swift.runtime.context`: joining the job's process group by generation (``init_distributed``);
- :mod:`~ds_swift.runtime.engine`: the engine wrapper (``initialize``; the training loop with retries;
  its checkpoint calls, the iteration's inputs and its end in ``engine_checkpoint``, ``engine_inputs``
  and ``engine_close``);
- :mod:`~ds_swift.runtime.rebuild`: a survivor's teardown (:mod:`~ds_swift.runtime.teardown`), rejoining
  generation g+1, the DeepSpeed rebuild, a replacement's start, the call to the recovery protocol;
- :mod:`~ds_swift.runtime.hooks`: per-instruction hooks (RNG keying, fault injection, undo);
- :mod:`~ds_swift.protect.message_logging`: the message log and step-collective records;
- :mod:`~ds_swift.protect.digest_publisher`: this rank's state digest, published for verified replays;
- :mod:`~ds_swift.recovery.timeline`: the recovery timeline.

Nothing is imported here: ds_swift.recovery uses the timeline and the RNG keying, and the engine
wrapper uses ds_swift.recovery.
"""
