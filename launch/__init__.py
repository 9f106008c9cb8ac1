"""``ds-swift-launch``: node agents, the job store host, replacement machines (installed as ``ds_swift.launch``).

- :mod:`.args`: the command line (deepspeed-launcher compatible flags), validated;
- :mod:`.spawn`: starting, watching and killing one machine's workers;
- :mod:`.control`: what agents tell each other through the job store, and the event log;
- :mod:`.agent`: the node agent (failure -> spare, restart or abort);
- :mod:`.launcher`: the loop that runs the agents of this process;
- :mod:`.cli`: the console script.
"""
