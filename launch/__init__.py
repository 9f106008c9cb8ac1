"""``ds-swift-launch``: node agents, the job store host, replacement machines (installed as ``ds_swift.launch``).

- :mod:`.args`: the command line (deepspeed-launcher compatible flags), validated;
- :mod:`.spawn`: starting, watching and killing one machine's workers;
- :mod:`.control`: what agents tell each other through the job store, and the event log;
- :mod:`.job`: what every agent knows about the job, and what each worker is told;
- :mod:`.agent`: the node agent, with :mod:`.agent_failures` (what follows a rank's death),
  :mod:`.health` (failing GPUs, hung ranks) and :mod:`.fate` (failure -> spare, shrink, restart or abort);
- :mod:`.liveness`: agents watching each other's liveness (a machine lost with its agent);
- :mod:`.launcher`: the loop that runs the agents of this process;
- :mod:`.hostfile`, :mod:`.slurm`, :mod:`.remote`: which hosts run agents, and starting them
  under SLURM (``srun``) or with pdsh/ssh;
- :mod:`.cli`: the console script.
"""
