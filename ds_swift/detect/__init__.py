"""Detection: how a worker learns that its generation failed, and who it tells.

In story order: :mod:`~ds_swift.detect.watchdog` (a thread polling the job's failure flag and
writing this rank's heartbeat, judging its neighbours' heartbeats), :mod:`~ds_swift.detect.classify`
(is this exception a dead peer or a bug?), :mod:`~ds_swift.detect.wake` (waking pipeline
neighbours blocked in a receive from us) and :mod:`~ds_swift.detect.monitor` (what the runtime
asks of all of them for the generation in force). The node agent's side (a dead child, a failing
GPU) lives in the launcher (``launch/agent.py``); the after-receive check is a DeepSpeed patch
(``patches/deepspeed_rebuild.py``).
"""
